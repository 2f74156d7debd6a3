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
    def __init__(self, coord):
        self.coord = coord
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
        c = self.coord
        if not is_int(max_tokens) or max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, not {max_tokens!r}")
        ids = c.tokenize(prompt)
        # the last new token is sampled, never decoded: it needs no KV cell
        if len(ids) + max(max_tokens - 1, 0) > c.n_ctx:
            raise DecodeError(DecodeResult.NO_KV_SLOT, None, f"context full: prompt of {len(ids)} tokens plus "
                              f"{max_tokens} new ones exceeds n_ctx {c.n_ctx}", FailureKind.CONTEXT_FULL)
        sampler = Sampler(temperature, top_k, top_p, seed)
        greedy = temperature == 0  # the last worker returns the argmax, not a megabyte of logits
        c.kv_seq_rm(0)
        text = TextStream(c.tokenizer, stop)
        pos, pending = 0, ids
        for _ in range(max_tokens):
            for start in range(0, len(pending), c.n_batch):
                chunk = pending[start: start + c.n_batch]
                # with resume_within set it pauses through a lost worker (resume.py)
                code = await c._resume.decode(Batch.single(chunk, pos), greedy)
                if code != DecodeResult.OK:  # nothing of this step is emitted
                    raise DecodeError(code, c.last_failed_endpoint, c.last_error or code.name, c.last_cause)
                pos += len(chunk)
            token = c.token(-1) if greedy else sampler.sample(c.logits(-1))
            if c.tokenizer.is_eog(token):
                break
            c.stats["generated"] += 1
            piece = text.feed(token)
            if piece:
                yield piece
            if text.stopped:
                return
            pending = [token]
        piece = text.finish()
        if piece:
            yield piece
