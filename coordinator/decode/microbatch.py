"""Pipeline parallelism within a decode step: the batch is cut into
micro-batches that follow each other through the stages (flow.py),
so worker A computes micro-batch k+1 while worker B computes micro-batch k,
and the head round of one overlaps the layers of the next.

Each micro-batch is decoded exactly as if it were a decode of its own, the
micro-batches one after another: its KV rows are assigned, and n_kv and its
masks fixed, after those of the micro-batches before it and before those of
the ones after; every stage computes them in that order. So the logits are
those of the unpipelined path decoding the same micro-batches in turn, bit
for bit, and the KV journal records each micro-batch as a step of its own
(a resume replays them in those shapes). A failure of any micro-batch fails
the whole decode: every row it assigned is rolled back and nothing of any
micro-batch is returned or recorded.

How a batch is cut (`plan_cuts`), with two or more stages only:

* a run of tokens of one sequence longer than `micro_batch` (a long prompt)
  into pieces of `micro_batch` tokens and the rest: causal, so piece k+1 on a
  stage needs only that stage's KV rows of piece k (one size for every long
  prompt's pieces: the workers keep a few graph shapes cached, not one per
  prompt length);
* then the pieces packed, in batch order, into about max(n_stages,
  n_tokens / micro_batch) micro-batches of about equal size, but not below
  micro_batch / 2 tokens (5 prompts of 20 tokens over 2 stages: 40, 40, 20; one
  token for each of 8 sequences: one micro-batch, as a 4-token step costs
  about 0.7 of an 8-token one); for a caller that steps its own groups at
  once (the HTTP server, adecode_outcome), only into about n_tokens /
  micro_batch;
* a cut in which a token would attend to a token of a later micro-batch
  (a batch not in causal order) is not used: the batch stays whole.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from coordinator.decode.pipeline import Pipeline
from coordinator.decode.step_io import PreparedStep, StepFailed, off_loop_from, step_failed
from coordinator.decode.flow import FlowFailed, flow

DEFAULT_MICRO_BATCH = 64  # tokens; prompt chunks of 64 keep ggml's matmuls efficient on the CPU
MAX_LINKED = 16  # micro-batches of one step sent at once over step links (more: relayed, a stage at a time)
# hidden-state bytes of one step's micro-batches sent at once over step links: half the
# mailbox a worker keeps per session by default (max_inflight, 64 MiB), so a next stage
# that falls behind holds them all (more: relayed)
MAX_LINKED_BYTES = 32 << 20


def _runs(tok_seq: np.ndarray) -> list[tuple[int, int]]:
    """Maximal stretches of consecutive tokens with the same sequence mask."""
    starts = [0, *np.flatnonzero(tok_seq[1:] != tok_seq[:-1]) + 1, len(tok_seq)]
    return list(zip(starts, starts[1:]))


def _in_causal_order(cuts: list[tuple[int, int]], tok_pos: np.ndarray, tok_seq: np.ndarray) -> bool:
    """No token attends to (shares a sequence with, at a position not after
    its own) a token of a later micro-batch: in each sequence, every token's
    position is above those of the micro-batches before its own."""
    start = np.repeat([a for a, _ in cuts], [b - a for a, b in cuts])  # where each token's micro-batch starts
    bits = np.arange(int(np.bitwise_or.reduce(tok_seq, initial=0)).bit_length(), dtype=tok_seq.dtype)
    member = ((tok_seq[:, None] >> bits) & 1) != 0  # [token, sequence]
    pos = tok_pos.astype(np.int64)
    highest = np.maximum.accumulate(np.where(member, pos[:, None], np.iinfo(np.int64).min), axis=0)
    later = start > 0
    return not (member[later] & (pos[later, None] <= highest[start[later] - 1])).any()


def plan_cuts(tok_pos: np.ndarray, tok_seq: np.ndarray, n_stages: int, micro_batch: int,
              group: bool = True) -> list[tuple[int, int]]:
    """The micro-batches of a batch, as [start, stop) token ranges in batch
    order. `group` False: only long runs are cut, the sequences are not put
    in groups (a caller that steps its own groups at once, as the server)."""
    n = len(tok_pos)
    whole = [(0, n)]
    if n_stages < 2 or micro_batch < 1 or n < 2:
        return whole
    pieces = []
    for a, b in _runs(tok_seq):  # pieces of exactly micro_batch tokens, the rest last: few graph shapes
        pieces.extend((i, min(i + micro_batch, b)) for i in range(a, b, micro_batch))
    # tokens per micro-batch; groups of sequences not below micro_batch / 2 tokens: a smaller step costs
    # nearly as much as a larger one on the CPU (measured: 4 tokens about 0.7 of 8), which overlap cannot win back
    target = -(-n // max(n_stages if group else 1, -(-n // micro_batch)))
    target = max(target, micro_batch // 2) if group else target
    cuts: list[list[int]] = []
    for a, b in pieces:
        if cuts and cuts[-1][1] - cuts[-1][0] + b - a <= target:
            cuts[-1][1] = b
        else:
            cuts.append([a, b])
    cuts = [(int(a), int(b)) for a, b in cuts]
    if len(cuts) < 2 or not _in_causal_order(cuts, tok_pos, tok_seq):
        return whole
    return cuts


@dataclass
class Admitted:
    """A decode step's micro-batches, their KV rows assigned and inputs fixed,
    its place in every stage's order taken; not yet computed."""
    steps: list[PreparedStep]
    saved: list[tuple]  # what the rows held, for KVCells.rollback
    after: list  # per stage: done when the step before has finished with that stage
    done: list  # per stage: set when this step has


class MicroBatches:
    """Decode steps cut into micro-batches that flow through the stages, and
    the order in which every stage takes them, across steps too: a step
    admitted after another is computed after it on every stage, so several
    steps may be in flight at once (gate.py). `micro_batch`: 0 turns
    pipelining off (the coordinator then decodes one step at a time, each
    whole, the stages one after another: Pipeline.step)."""

    def __init__(self, pipeline: Pipeline, micro_batch: int):
        if isinstance(micro_batch, bool) or not (isinstance(micro_batch, int) and micro_batch >= 0):
            raise ValueError(f"micro_batch must be a number of tokens (0: no pipelining), not {micro_batch!r}")
        self.pipeline, self.micro_batch = pipeline, micro_batch
        self._tails: list = [None] * pipeline.n_stages  # per stage: the last admitted step's `done`

    @property
    def enabled(self) -> bool:
        return self.micro_batch > 0

    def admit(self, tokens, rows: np.ndarray, tok_pos: np.ndarray, tok_seq: np.ndarray, out_rows: np.ndarray,
              greedy: bool, group: bool = True) -> Admitted:
        """Assign the rows `rows` micro-batch by micro-batch (each fixes n_kv
        and its masks after the rows of those before it) and take the step's
        place in every stage's order. Synchronous: nothing else happens between.
        `group`: see plan_cuts."""
        kv, pipe = self.pipeline.kv, self.pipeline
        saved, steps = [], []
        cuts = plan_cuts(tok_pos, tok_seq, pipe.n_stages, self.micro_batch, group)
        relayed = not _fit_links(len(cuts), len(rows), pipe.hp.n_embd)
        for a, b in cuts:
            saved.append(kv.assign(rows[a:b], tok_pos[a:b], tok_seq[a:b]))
            mine = (out_rows[(out_rows >= a) & (out_rows < b)] - a).astype(np.int32)
            # micro-batches that will be relayed (run): their head choice counts the relayed hops
            steps.append(pipe.prepare(list(tokens[a:b]), rows[a:b], tok_pos[a:b], tok_seq[a:b], mine, greedy,
                                      relayed=relayed))
        loop = asyncio.get_running_loop()
        done = [loop.create_future() for _ in range(pipe.n_stages)]
        after, self._tails = self._tails, done
        return Admitted(steps, saved, after, done)

    async def run(self, step: Admitted) -> np.ndarray:
        """The logits (or greedy tokens) of the step's output rows, in order.
        Raises StepFailed for a failure of any micro-batch (after the requests
        in flight have ended); nothing is kept of the others."""
        pipe, steps = self.pipeline, step.steps
        try:
            pipe.report_late()
        except StepFailed:
            _finished(step.done)
            raise
        if linkable(steps, pipe.hp.n_embd) and all(f is None or f.done() for f in step.after):
            # nothing earlier in flight (a single stream, a prompt): the micro-batches may go worker to
            # worker (step links), every request at once; later steps wait for them as for any step
            try:
                results = await pipe.linked(steps)
            except BaseException:
                _finished(step.done)
                raise
            if results is not None:
                _finished(step.done)
                return await _joined(results)

        if len(steps) == 1 and len(pipe.places) == 1 and not pipe.groups:
            return await self._alone(step)
        try:
            results = await flow(len(steps), pipe.flow_stages(steps), after=step.after, done=step.done)
        except FlowFailed as failed:
            raise step_failed(failed.errors) from None
        return await _joined(results)

    async def _alone(self, step: Admitted) -> np.ndarray:
        """One micro-batch through the one stage (in process, or one worker): what
        flow() does for it (after the step before has finished with the stage, then
        the stage, `done` set, then the result; a failure raised as StepFailed),
        without flow's tasks and queues, a step's largest Python cost there."""
        pipe, s = self.pipeline, step.steps[0]
        try:
            if step.after[0] is not None:
                await asyncio.shield(step.after[0])  # a cancelled step must not cancel its predecessor's future
            try:
                out = await pipe.run_stage(pipe.places[0], s, None)
            except Exception as exc:
                raise step_failed([exc]) from None
            finally:
                _finished(step.done)
            try:
                result = await pipe.finish(s, out)
            except Exception as exc:
                raise step_failed([exc]) from None
        finally:
            _finished(step.done)
        return await _joined([result])

    def rollback(self, step: Admitted) -> None:
        for s in reversed(step.saved):
            self.pipeline.kv.rollback(s)

    def record(self, step: Admitted) -> None:
        """Into the KV journal, each micro-batch as a step of its own."""
        for s in step.steps:
            self.pipeline.record(s)


def linkable(steps: list[PreparedStep], n_embd: int) -> bool:
    """Whether a step's micro-batches may go over step links all at once: a
    head round only for the last one (a worker takes its requests in order, so
    an earlier one's shard would hold up the next micro-batch's layers, which
    relayed it overlaps), not too many requests queued per worker, and room
    for all their hidden states in a worker's mailbox."""
    return (_fit_links(len(steps), sum(s.shape.n_tokens for s in steps), n_embd)
            and not any(s.head_in_shares for s in steps[:-1]))


def _fit_links(n_pieces: int, n_tokens: int, n_embd: int) -> bool:
    """Few enough micro-batches, and hidden states small enough, to send at once over step links."""
    return n_pieces <= MAX_LINKED and n_tokens * n_embd * 4 <= MAX_LINKED_BYTES


async def _joined(results: list[np.ndarray]) -> np.ndarray:
    """The micro-batches' results one after another. One result is taken as it is
    when it is writable (a step's own array: the head's joined shards, or the
    reply it was read from), not copied again (1 MiB a token for Gemma 3's
    logits); a read-only one (a view of a reply's bytes) is copied, as before,
    so a caller may still write into what logits(i) returns; from step_io.OFF_LOOP
    floats on a thread of its own (4 micro-batches of every row's logits: 268 MB,
    0.55-0.63 s on the loop thread)."""
    if len(results) == 1 and results[0].flags.writeable:
        return results[0]
    return await off_loop_from(sum(r.size for r in results), np.concatenate, results)


def _finished(done: list) -> None:
    """A step is done with every stage."""
    for f in done:
        if f is not None and not f.done():
            f.set_result(None)
