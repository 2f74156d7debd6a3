"""The decode engine: a batch in, a DecodeOutcome out.

It owns what a decode step needs between the facade and the workers: the
checks before a step (batch_checks.py), the KV cell table, admission through
the gate (gate.py), the step itself (pipeline.py; micro-batches in flight,
microbatch.py), and the outcome. A failure of a worker is an outcome, never
an exception: the endpoints it lost are latched (cluster/endpoints.py) and the
outcome names the one the decode reports. docs/architecture.md, "A decode
step", walks one through; docs/failure-semantics.md has every code.

Read top to bottom: `decode` picks the path (one step at a time, whole, or
pipelined), `_admit` is every check before a step, `_ok`/`_step_failed` turn
a step's end into its outcome. KV edits (`kv_*`) run between steps: the
facade schedules them under the gate.
"""
from __future__ import annotations

import time

import numpy as np
import structlog

from coordinator.cluster.failures import EndpointFailure, StageFailed
from coordinator.decode.batch_checks import batch_problem, refeed_problem, seq_ids_of, seq_masks
from coordinator.decode.gate import DecodeGate
from coordinator.decode.kv_cells import KVCells
from coordinator.decode.microbatch import MicroBatches
from coordinator.decode.pipeline import Pipeline
from coordinator.decode.step_io import StepFailed
from coordinator.decode.values import NO_OUTPUT, Batch, DecodeOutcome, DecodeResult, FailureKind, StepOutput

log = structlog.get_logger("coordinator")


def failed(code: DecodeResult, message: str, cause: FailureKind, endpoint: str | None = None) -> DecodeOutcome:
    return DecodeOutcome(code, NO_OUTPUT, message, cause, endpoint)


class Decoder:
    def __init__(self, pipeline: Pipeline, micro: MicroBatches, kv: KVCells, gate: DecodeGate, endpoints,
                 n_batch: int, stats: dict, journal=None):
        """`endpoints`: the EndpointSet (its latches, and the sequences to re-feed);
        `journal`: the KV journal when resuming is on (cleared with the table)."""
        self.pipeline, self.micro, self.kv, self.gate, self.endpoints = pipeline, micro, kv, gate, endpoints
        self.n_batch, self.stats, self.journal = n_batch, stats, journal
        self.n_vocab = pipeline.hp.n_vocab
        self.latches = 0  # endpoints latched by failed steps, ever (a step in flight notices one)
        self.last: DecodeOutcome = DecodeOutcome(DecodeResult.OK)  # the outcome the last decode to end left

    @property
    def pipelined(self) -> bool:
        """Steps are cut into micro-batches and several may be in flight at once."""
        return self.micro.enabled and self.pipeline.n_stages > 1

    async def decode(self, batch: Batch, greedy: bool | int = False, group: bool = True) -> DecodeOutcome:
        """One decode: its outcome, also kept as `last`. `group` (pipelined):
        the batch's sequences may be cut into groups that follow each other
        through the stages; a caller that forms its own groups says False."""
        last = self.last  # a new decode leaves nothing of the one before to read, whatever its end
        self.last = DecodeOutcome(last.code, NO_OUTPUT, last.error, last.cause, last.endpoint)
        greedy = min(int(greedy), self.n_vocab)  # a head cannot rank more tokens than it has rows
        outcome = await (self._pipelined(batch, greedy, group) if self.micro.enabled else self._whole(batch, greedy))
        self.last = outcome
        return outcome

    async def embed(self, batch: Batch) -> DecodeOutcome:
        """A step whose outputs are the wanted rows' final hidden states, normalized
        (output_norm; no head): one whole step between the others (pipelined or not),
        its KV rows written and kept as a decode's. Its outcome, also kept as `last`."""
        last = self.last
        self.last = DecodeOutcome(last.code, NO_OUTPUT, last.error, last.cause, last.endpoint)
        self.last = await self._whole(batch, False, normed=True)
        return self.last

    async def _whole(self, batch: Batch, greedy: bool, normed: bool = False) -> DecodeOutcome:
        async with self.gate:  # one step at a time, whole, the stages one after another
            admitted = self._admit(batch)
            if isinstance(admitted, DecodeOutcome):
                return admitted
            rows, tok_pos, tok_seq, out_rows, started = admitted
            saved = self.kv.assign(rows, tok_pos, tok_seq)
            try:
                out = await self.pipeline.step(batch.tokens, rows, tok_pos, tok_seq, out_rows, greedy, normed)
            except StepFailed as exc:
                self.kv.rollback(saved)
                return self._step_failed(exc)
            except BaseException:
                self.kv.rollback(saved)
                raise
            if normed:
                return self._ok(batch, greedy, out_rows, None, started, hidden=out)
            return self._ok(batch, greedy, out_rows, out, started)

    async def _pipelined(self, batch: Batch, greedy: bool, group: bool) -> DecodeOutcome:
        """Admitted under the gate's lock, computed while later steps are
        admitted, finished in admission order (gate.py)."""
        try:
            seqs = int(np.bitwise_or.reduce(seq_masks(seq_ids_of(batch))))
        except Exception:  # a malformed batch: _admit refuses it
            seqs = 0
        while True:
            await self.gate.wait_for(self.gate.sharing(seqs))  # their rows may be this step's inputs
            async with self.gate.lock:
                if self.gate.sharing(seqs):
                    continue
                admitted = self._admit(batch)
                if isinstance(admitted, DecodeOutcome):
                    return admitted
                rows, tok_pos, tok_seq, out_rows, started = admitted
                step = self.micro.admit(batch.tokens, rows, tok_pos, tok_seq, out_rows, greedy, group=group)
                ticket = self.gate.admit(seqs)
                latches = self.latches
                break
        try:
            try:
                out, step_failed = await self.micro.run(step), None
            except StepFailed as exc:
                out, step_failed = None, exc
            await self.gate.turn(ticket)
        except BaseException:  # cancelled: rolled back now; the steps after it keep their order
            self.micro.rollback(step)
            self.gate.finish_in_turn(ticket)
            raise
        try:
            if step_failed is None and self.latches != latches:
                # an endpoint latched after this step was admitted: its rows there are gone (or, resuming, to be
                # rebuilt): it fails as a step decoded after the failure would have
                lost = self.endpoints.failed()
                if lost:
                    self.micro.rollback(step)
                    return failed(DecodeResult.ENDPOINT_FAILED, lost[0].cause, lost[0].kind, lost[0].endpoint)
            if step_failed is not None:
                self.micro.rollback(step)
                return self._step_failed(step_failed)
            self.micro.record(step)
            self.stats["micro_batches"] += len(step.steps)
            return self._ok(batch, greedy, out_rows, out, started)
        finally:
            self.gate.finish(ticket)

    def _admit(self, batch: Batch):
        """The checks before a step and its KV rows (not yet assigned): (rows,
        positions, sequence masks, output rows, start time), or the outcome of
        a step refused."""
        problem = batch_problem(batch, self.n_batch, self.n_vocab, self.kv)
        if problem:
            log.warning("invalid batch", error=problem)
            return failed(DecodeResult.INVALID_BATCH, problem, FailureKind.INVALID_BATCH)
        latched = self.endpoints.failed()
        if latched:  # fail fast, no network traffic
            f: EndpointFailure = latched[0]
            return failed(DecodeResult.ENDPOINT_FAILED, f"{f.cause} [latched {time.time() - f.since:.1f} s ago; "
                          f"reconnect() to recover]", f.kind, f.endpoint)
        refeed = self.endpoints.needs_refeed
        problem = refeed and refeed_problem(batch, refeed, self.kv)
        if problem:
            return failed(DecodeResult.INVALID_BATCH, problem, FailureKind.INVALID_BATCH)
        n = len(batch.tokens)
        tok_pos, tok_seq = np.asarray(batch.pos, dtype=np.int64), seq_masks(seq_ids_of(batch))
        rows = self.kv.find_slot(n, tok_seq)  # each sequence's rows in the order of its positions
        if rows is None:
            return failed(DecodeResult.NO_KV_SLOT, f"context full: no room for {n} tokens in the KV cache "
                          f"({self.kv.used()} of {self.kv.n_ctx} cells used)", FailureKind.CONTEXT_FULL)
        want = list(batch.logits) if batch.logits is not None else [i == n - 1 for i in range(n)]
        out_rows = np.array([i for i, w in enumerate(want) if w], dtype=np.int32)
        return rows, tok_pos, tok_seq, out_rows, time.perf_counter()

    def _ok(self, batch: Batch, greedy: bool, out_rows, out, started: float, hidden=None) -> DecodeOutcome:
        self.stats["decodes"] += 1
        self.stats["tokens"] += len(batch.tokens)
        self.stats["decode_seconds"] += time.perf_counter() - started
        self.endpoints.needs_refeed.difference_update(s for ids in seq_ids_of(batch) for s in ids)
        if hidden is not None:
            return DecodeOutcome(DecodeResult.OK, StepOutput(out_rows, hidden=hidden))
        return DecodeOutcome(DecodeResult.OK, StepOutput(out_rows, tokens=out) if greedy
                             else StepOutput(out_rows, logits=out))

    def _step_failed(self, exc: StepFailed) -> DecodeOutcome:
        for lost in exc.lost:
            self.latches += 1
            self.endpoints.latch(lost)
        reported = exc.reported
        if reported in exc.lost:
            return failed(DecodeResult.ENDPOINT_FAILED, reported.message, reported.cause, reported.endpoint)
        if not isinstance(reported, StageFailed):  # a bug of ours: still a code, never an exception
            log.error("decode failed unexpectedly", exc_info=reported)
            return failed(DecodeResult.COMPUTE_FAILED, f"internal error in the coordinator: "
                          f"{type(reported).__name__}: {reported}", FailureKind.INTERNAL)
        return failed(DecodeResult.COMPUTE_FAILED, reported.message, reported.cause, reported.endpoint)

    # ------------------------------------------------------------ the KV cell table, between steps
    def forget_kv(self) -> set[int]:
        """Clear the KV table; the sequences it held, to re-feed. The last
        outcome stays readable: an OK decode's outputs are right whatever
        latches after it (docs/failure-semantics.md, "OK means readable")."""
        lost = self.kv.seqs_present()
        self.kv.clear()
        self.endpoints.needs_refeed |= lost
        return lost

    def kv_clear(self) -> None:
        self.kv.clear()
        if self.journal is not None:
            self.journal.clear()
        self.endpoints.needs_refeed.clear()

    def kv_seq_rm(self, seq: int, p0: int, p1: int) -> None:
        self.kv.seq_rm(seq, p0, p1)
        if p0 <= 0 and p1 < 0:  # the whole sequence: nothing left to re-feed
            if seq < 0:
                self.endpoints.needs_refeed.clear()
            else:
                self.endpoints.needs_refeed.discard(seq)
