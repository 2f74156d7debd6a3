"""generate/stream/astream: prompt in, text out, step by step on sequence 0.

Generations all use sequence 0, so they take turns (interleaved, their steps
would continue each other's text). Text is yielded only after a step
succeeded; a failed step raises DecodeError and what was held back is dropped.
With resume_within set, a step pauses through a lost worker (resume.py).
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Sequence

from coordinator.config import is_int
from coordinator.decode.values import Batch, DecodeError, DecodeResult, FailureKind
from coordinator.text.sampling import Sampler
from coordinator.text.stream import TextStream


class Generations:
    def __init__(self, resumer, tokenizer, n_ctx: int, n_batch: int, stats: dict):
        """`resumer.decode`: a decode that pauses through a lost worker when resuming is on (resume.py)."""
        self.resumer, self.tokenizer, self.n_ctx, self.n_batch, self.stats = resumer, tokenizer, n_ctx, n_batch, stats
        self._lock = asyncio.Lock()  # one generation at a time
        self._owner = None  # the thread or task whose generation holds it

    async def pieces(self, owner, prompt: str, max_tokens: int, temperature: float, top_k: int, top_p: float,
                     seed: int | None, stop: Sequence[str]):
        """The text of one generation, piece by piece. `owner` is (thread, task
        or None for a sync call). Waiting for a generation held by the same
        thread blocks that thread for good, unless both are async and in
        different tasks of its loop: refuse it."""
        holder = self._owner
        if holder is not None and holder[0] == owner[0] and (None in (holder[1], owner[1]) or holder[1] == owner[1]):
            raise RuntimeError("this thread already has a generation open on this coordinator (a stream not yet "
                               "exhausted or closed); finish or close it first")
        async with self._lock:
            self._owner = owner
            try:
                async with contextlib.aclosing(self._generate(prompt, max_tokens, temperature, top_k, top_p, seed,
                                                              stop)) as pieces:
                    async for piece in pieces:
                        yield piece
            finally:
                self._owner = None

    async def _generate(self, prompt, max_tokens, temperature, top_k, top_p, seed, stop):
        if not is_int(max_tokens) or max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, not {max_tokens!r}")
        tokenizer, decoder = self.tokenizer, self.resumer.decoder
        ids = tokenizer.encode(prompt)
        # the last new token is sampled, never decoded: it needs no KV cell
        if len(ids) + max(max_tokens - 1, 0) > self.n_ctx:
            raise DecodeError(DecodeResult.NO_KV_SLOT, None, f"context full: prompt of {len(ids)} tokens plus "
                              f"{max_tokens} new ones exceeds n_ctx {self.n_ctx}", FailureKind.CONTEXT_FULL)
        sampler = Sampler(temperature, top_k, top_p, seed)
        greedy = temperature == 0  # the last worker returns the argmax, not a megabyte of logits
        decoder.kv_seq_rm(0, 0, -1)  # on the loop, between steps: generations take turns
        text = TextStream(tokenizer, stop)
        pos, pending = 0, ids
        for _ in range(max_tokens):
            for start in range(0, len(pending), self.n_batch):
                chunk = pending[start: start + self.n_batch]
                # with resume_within set it pauses through a lost worker (resume.py)
                outcome = await self.resumer.decode(Batch.single(chunk, pos), greedy)
                if outcome.code != DecodeResult.OK:  # nothing of this step is emitted
                    raise DecodeError(outcome.code, outcome.endpoint, outcome.error or outcome.code.name,
                                      outcome.cause)
                pos += len(chunk)
            token = outcome.token(-1) if greedy else sampler.sample(outcome.logits(-1))
            if tokenizer.is_eog(token):
                break
            self.stats["generated"] += 1
            piece = text.feed(token)
            if piece:
                yield piece
            if text.stopped:
                return
            pending = [token]
        piece = text.finish()
        if piece:
            yield piece
