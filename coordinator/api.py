"""The coordinator: load a GGUF model, split its layers over endpoints, decode.

`decode` returns llama_decode-style codes (DecodeResult) and never raises for a
failure of a worker; `generate`/`stream` raise DecodeError. Any endpoint
failure latches that endpoint: later decodes fail fast without network traffic
until `reconnect()` opens a new connection (or, with `auto_reconnect`, a
background task does, with backoff). A failed decode leaves no logits.
docs/failure-semantics.md has the whole table.

This class is the public face; the work is in focused modules:

* loop.py: the private event loop thread every call is submitted to;
* results.py: Batch, DecodeResult, the errors, a step's outputs;
* planning.py: configuration checks and the split;
* batch_checks.py: what a decode refuses before sending anything;
* endpoints.py: connections, latching, health, reconnecting;
* pipeline.py: one step through the stages and the head;
* generation.py: generate/stream on top of decode.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from typing import AsyncIterator, Callable, Iterator, Sequence

import numpy as np
import structlog

from coordinator.decode.batch_checks import (batch_problem, checked_range, checked_seq, refeed_problem, seq_ids_of,
                                      seq_masks)
from coordinator.cluster.endpoints import EndpointSet, Placement
from coordinator.decode.gate import DecodeGate
from coordinator.cluster.executors import ChunkDigests, buffer_bytes, make_executor
from coordinator.decode.generation import Generations
from coordinator.model.gguf_file import GGUFFile
from coordinator.decode.head_placement import HeadPlacement, checked_mode
from coordinator.decode.kv_cells import KVCells
from coordinator.cluster.loop import LoopThread
from coordinator.decode.microbatch import DEFAULT_MICRO_BATCH, MicroBatches
from coordinator.model.architectures import architecture
from coordinator.model.architectures.common import head_source
from coordinator.decode.pipeline import Pipeline, StepFailed
from coordinator.model.split_plan import (PAGE, DoesNotFit, compute_reserve, endpoint_free, fit_split, plan_rows, plan_split, split_weights)
from coordinator.config import checked_setup
from coordinator.model.default_model import default_model_path
from coordinator.decode.resume import RESUME_BACKOFF, Resumer
from coordinator.decode.values import (NO_OUTPUT, Batch, DecodeError, DecodeOutcome, DecodeResult, FailureKind, StepOutput)
from coordinator.cluster.failures import EndpointFailure, EndpointUnavailable, StageFailed
from coordinator.model.stage import Stage
from coordinator.text.tokenizer import Tokenizer
from rpc_daemon.daemon.config import available_memory
from rpc_daemon.wire.auth import load_secret

__all__ = ["Batch", "Coordinator", "DecodeError", "DecodeResult", "DoesNotFit", "EndpointFailure",
           "EndpointUnavailable", "FailureKind", "default_model_path", "plan_rows", "plan_split"]

log = structlog.get_logger("coordinator")

# the outcome of the last decode in this task: several steps may be in flight at once, and each
# caller of adecode_outcome reads its own (self._out and last_error are the last to finish)
_OUTCOME: contextvars.ContextVar[DecodeOutcome] = contextvars.ContextVar("decode_outcome")
# set by adecode_outcome: its caller steps groups of sequences at once, so a step's sequences are not grouped again
_OWN_GROUPS: contextvars.ContextVar[bool] = contextvars.ContextVar("own_groups", default=False)


class Coordinator:
    def __init__(self, endpoints: Sequence[str] = ("local",), model: str | None = None,
                 split: Sequence[float] | None = None, n_ctx: int = 2048, n_batch: int = 512,
                 threads: int = 1, connect_timeout: float = 5.0, liveness_timeout: float | None = 2.0,
                 use_cache: bool = True, progress: bool = False, request_timeout: float | None = 900.0,
                 auto_reconnect: bool = False, reconnect_backoff: tuple[float, float] | None = None,
                 secret: str | bytes | None = None, secret_file: str | None = None, tls_ca: str | None = None,
                 head_split: bool | str = "auto", on_upload: Callable[[int, int], None] | None = None,
                 resume_within: float | None = None, spares: Sequence[str] = (),
                 spare_after: float | None = None, micro_batch: int = DEFAULT_MICRO_BATCH,
                 step_links: bool = True):
        """`model`: a GGUF path; None: the bundled Gemma 3 270M, from the `model`
        extra (without it: FileNotFoundError, before anything is started).

        Fault handling: `connect_timeout` bounds connecting plus HELLO;
        `liveness_timeout` is the detection bound for a stopped, hung or cut-off
        worker while a request is outstanding (None disables the liveness pings:
        for measurements only); `request_timeout` bounds any single request even
        from a worker that keeps answering pings. `auto_reconnect` reconnects a
        failed endpoint in the background, waiting `reconnect_backoff[0]` seconds
        before the first attempt and doubling up to `reconnect_backoff[1]`.

        Security (docs/security.md): `secret` or `secret_file` (else systemd's
        credential $CREDENTIALS_DIRECTORY/rpc-secret, else the environment
        variable GGML_RPC_SECRET) is the workers' shared secret,
        proven in both directions at HELLO; `tls_ca` (a PEM CA bundle) turns on
        TLS and verifies each worker's certificate against it.

        `head_split` (with several endpoints): True ("split"): every endpoint
        computes a share of the output head's vocabulary rows, in the split's
        proportions, all at once after the last layer, instead of the last
        endpoint computing all of it (coordinator/model/stage.py); faster when the
        head is a large part of a step, but one more network hop. False
        ("whole"): the last endpoint computes all of it. "here": the last
        endpoint computes its share and this process the rest of the rows (from
        the normed rows the last stage replies with: the split's compute at the
        whole head's hops; this process holds those rows and computes them
        with `threads` threads). "auto" (the default):
        every endpoint holds its share, and the last one the whole head too
        where the round trips measured before the upload say a step could take
        it whole (and it has the memory), and then this process the rows
        besides the last one's share; each step takes the fastest by the
        measured round trips and head compute times
        (coordinator/decode/head_placement.py). Same logits whichever runs.

        `micro_batch` (tokens; with several endpoints): a batch is cut into
        micro-batches that follow each other through the stages, so every
        worker computes at once (coordinator/decode/microbatch.py): a prompt longer
        than this in chunks of at most this many tokens, a batch of several
        sequences in about as many groups as there are endpoints (of at
        least micro_batch / 2 tokens each). The logits
        are those of decoding the same micro-batches one after another. 0
        turns it off: every batch is one step, the stages one after another.

        `step_links` (with several remote endpoints that offer them): a step's
        hidden state goes from worker to worker, and the last stage's normed
        state straight to the head shards, instead of back through the
        coordinator between stages (docs/protocol.md, "Step links"). Same
        logits; fewer network hops per token. False: always relayed.

        `on_upload(done, total)` (bytes of weights) is called when the upload
        starts and after every chunk, from the coordinator's I/O thread: the
        server uses it to keep systemd's start timeout from expiring while a big
        model uploads (rpc_daemon/service/systemd.py, StartTimeoutExtender).

        Resuming (docs/failure-semantics.md, "Resuming"): with `resume_within`
        (seconds) set, generate/stream/astream (and decode_resuming) pause
        instead of failing when a worker is lost: the endpoint is reconnected
        automatically (backoff 0.02 s doubling to 0.05 s unless
        `reconnect_backoff` says otherwise) or, once it has been down for a
        while (`spare_after` seconds; default min(1 s, resume_within / 4)),
        its stage moves to one of `spares` (host:port workers), and back to
        its own endpoint once that is back; the KV
        cache is rebuilt by replaying the steps exactly as first decoded, and
        the step is retried: the same text as without the failure. Not back
        within `resume_within`: the original error."""
        endpoints, split = checked_setup(endpoints, split, n_batch, threads)
        spares = checked_setup(list(spares), None, n_batch, threads)[0] if spares else []
        self.stats = {"decodes": 0, "tokens": 0, "decode_seconds": 0.0, "generated": 0, "reconnects": 0,
                      "micro_batches": 0, "linked_steps": 0}
        self._resume = Resumer(self, resume_within, spares, self.stats, spare_after)
        if self._resume.enabled:
            auto_reconnect = True  # the stage comes back by the automatic reconnect
        if reconnect_backoff is None:
            reconnect_backoff = RESUME_BACKOFF if self._resume.enabled else (0.25, 8.0)
        self.model_path = model or default_model_path()
        self.n_batch = n_batch
        self.threads = threads
        head_mode = checked_mode(head_split) if len(endpoints) > 1 else "whole"
        self.head_split = head_mode != "whole"  # the stages hold shards of the head
        self._head = HeadPlacement(head_mode)
        self.step_links = bool(step_links)
        self._exec_opts = {"connect_timeout": connect_timeout, "liveness_timeout": liveness_timeout,
                           "use_cache": use_cache, "request_timeout": request_timeout,
                           # security (docs/security.md): the workers' shared secret (rpc_daemon/wire/auth.py), TLS CA
                           "secret": load_secret(secret, secret_file), "tls_ca": tls_ca,
                           # a reconnect or a spare's takeover need not hash the weights again
                           "digests": ChunkDigests()}
        self.last_error: str | None = None
        self.last_failed_endpoint: str | None = None
        self.last_cause: FailureKind | None = None
        self._io = LoopThread()
        # decode steps in flight at once (pipelined); `async with` it: latching, reconnects and KV edits between steps
        self._gate = DecodeGate()
        self._latches = 0  # endpoints latched by failed steps, ever (a step in flight notices one)
        self._out = NO_OUTPUT  # what the last decode left to read
        self._generations = Generations(self)
        self._endpoints = EndpointSet(endpoints, self._io, self._gate, self._connect, self._lose_kv,
                                      auto_reconnect, reconnect_backoff, self.stats, self._resume)
        self.gguf = GGUFFile(self.model_path)
        try:
            self.arch = architecture(self.gguf.architecture)
            self.hp = self.arch.hparams(self.gguf)
            self.tokenizer = Tokenizer.from_gguf_fields(self.gguf.get)
            self.n_ctx = int(n_ctx)
            if self.n_ctx < 1:
                raise ValueError("n_ctx must be at least 1")
            self.kv = KVCells(self.n_ctx, self.hp.n_swa)
            self._pipeline = Pipeline(self._places, self.hp, self.kv, self.head_split, self._resume.journal,
                                      links=self.step_links, stats=self.stats, placement=self._head)
            self._micro = MicroBatches(self._pipeline, micro_batch)
            self._run(self._open(split, progress, on_upload))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ loading
    async def _open(self, split, progress: bool, on_upload) -> None:
        """Connect, plan the split (layers, head rows), build the stages, upload."""
        places = self._places
        infos = await self._endpoints.open_all(self._new_executor)
        weights = split_weights(split, infos, len(places))
        reserve = compute_reserve(self.hp, self.n_batch, self.n_ctx)

        def plan(whole_head: bool):
            def need(index: int, layers: range, head_rows) -> int:
                stage = Stage.create(index, self.arch, self.hp, self.gguf, layers, self.hp.n_layer, self.n_ctx,
                                     head_rows, whole_head)
                return -(-buffer_bytes(stage) // PAGE) * PAGE + reserve

            # checked against each worker's free memory before anything is uploaded (DoesNotFit); the whole
            # head besides is taken only where the layers stay as they would be without it
            return fit_split([p.endpoint for p in places], [endpoint_free(i) for i in infos], self.hp.n_layer,
                             self.hp.n_vocab, weights, self.head_split, split is not None or whole_head, need)

        whole_head = False  # the last stage holds the whole head besides the shards (auto, where it may win)
        if self._head.mode == "auto":
            await self._pipeline.measure_rtts()
            head_bytes = len(self.gguf.tensor_data(head_source(self.gguf.tensors)))
            whole_head = self._head.held_whole(head_bytes, len(places))
            if not whole_head:
                log.info("the last worker holds only its share of the output head: a hop costs less than the "
                         "least the split saves", one_way_ms=round(self._head.one_way() * 1e3, 3))
        try:
            layer_plan, heads = plan(whole_head)
        except DoesNotFit as exc:
            if not whole_head:
                raise
            log.info("the last worker has no room for the whole output head besides the layers: the head stays "
                     "split", reason=str(exc))
            self._head.mode, whole_head = "split", False
            layer_plan, heads = plan(whole_head)
        self._head.whole_held = whole_head
        for index, (p, layers, head_rows) in enumerate(zip(places, layer_plan, heads)):
            p.layers = layers
            p.stage = Stage.create(index, self.arch, self.hp, self.gguf, layers, self.hp.n_layer, self.n_ctx,
                                   head_rows, whole_head)
        uploads = self._endpoints.load_all(self.gguf, progress, on_upload)
        if whole_head or self._head.mode == "here":  # a far last worker: a step may take its share plus one here
            # copied here while the workers upload; both end before a failure of either is raised
            for outcome in await asyncio.gather(uploads, self._hold_head_here(), return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
        else:
            await uploads
        if self._head.mode == "auto":
            await self._pipeline.measure_rtts(pings=1)  # one more round trip each, now the uploads are done
            self._head.measured_at = time.monotonic()

    async def _hold_head_here(self) -> None:
        """Hold in this process the output head's rows besides the last
        worker's share (head_placement.py, "here"): a step can then have the
        last worker compute its share while this process computes the rest
        from the normed rows the last stage replies with, which costs the
        split's compute without the split's extra hop."""
        rows = self._places[-1].stage.head_rows
        if not rows or not rows.start or rows.stop != self.hp.n_vocab:
            return  # no share on the last worker, or nothing besides it
        stage = Stage.head_share(self.arch, self.hp, self.gguf, range(0, rows.start))
        need, available = buffer_bytes(stage), available_memory()
        if need > available // 2:  # the rows are an optimization: never worth crowding this machine
            log.warning("the coordinator does not hold the output head's other rows: they need more than half "
                        "of its available memory", need_mib=need >> 20, available_mib=available >> 20)
            return
        here = Placement("local", range(0), executor=make_executor("local", self.threads), stage=stage)
        try:
            await here.executor.open()
            await here.executor.load(here.stage, self.gguf)
        except BaseException:
            await here.executor.close()
            raise
        self._pipeline.here, self._head.here_held = here, True

    async def _close_all(self) -> None:
        await self._endpoints.close_all()
        here = getattr(self, "_pipeline", None) and self._pipeline.here
        if here is not None:
            await here.executor.close()

    def _new_executor(self, endpoint: str):
        return make_executor(endpoint, self.threads, **self._exec_opts)

    async def _connect(self, p: Placement, endpoint: str):
        """A new connection to `endpoint` (`p`'s, or a spare's) with `p`'s stage's weights (reconnect)."""
        self._head.forget(endpoint)  # measured again (head_placement.REFRESH_S) over the new connection
        ex = self._new_executor(endpoint)
        try:
            await ex.open()
            await ex.load(p.stage, self.gguf)
        except BaseException:
            await ex.close()
            raise
        return ex

    def _lose_kv(self) -> set[int]:
        """An endpoint latched: every sequence's KV cache is gone with its buffers
        (resuming: the table stays, the rows are rebuilt when the stage is back,
        and the last step's outputs stay readable: they are right)."""
        if self._resume.enabled:
            return set()
        return self._forget_kv()

    def _forget_kv(self) -> set[int]:
        """Clear the KV table; the sequences it held, to re-feed."""
        lost = self.kv.seqs_present()
        self.kv.clear()
        self._out = NO_OUTPUT  # it continued sequences that are gone
        self._endpoints.needs_refeed |= lost
        return lost

    # the loop thread and the endpoints' state, by their old names
    _loop = property(lambda self: self._io.loop)
    _thread = property(lambda self: self._io.thread)
    _places = property(lambda self: self._endpoints.places)

    def _run(self, coro):
        return self._io.run(coro)

    # ------------------------------------------------------------ status
    def endpoints(self) -> list[dict]:
        return self._endpoints.status()

    def failed_endpoints(self) -> list[EndpointFailure]:
        """One entry per endpoint latched failed: endpoint, cause, kind, since."""
        return self._endpoints.failed()

    def health(self) -> dict:
        """What a health check should report: "ok" when no endpoint is latched
        failed, else "reconnecting" (auto_reconnect on) or "failed", with the
        failures. Decodes fail fast with ENDPOINT_FAILED unless it is "ok" or
        "degraded". Resuming (resume_within set): "resuming" while a latched
        endpoint is younger than resume_within (generations pause, they do not
        fail), "degraded" while every stage serves but one is on a spare."""
        return self._resume.health(self._endpoints.health(), self._endpoints.places)

    async def aprobe(self, timeout: float = 1.0) -> list[dict]:
        """Ask every connected worker, now, for a PING round trip and its memory
        (DEVICE_INFO), each bounded by `timeout`; one dict per endpoint, in
        order: `ping_rtt` (s), `total_memory`, `free_memory` (bytes),
        `compute_seconds` (worker compute time summed over the current
        connection), or `error` (a message) for what could not be had. It
        does not take the decode lock: decodes go on meanwhile."""
        return await self._io.call(self._probe(timeout))

    async def _probe(self, timeout: float) -> list[dict]:
        found = await self._endpoints.probe(timeout)
        for p, probe in zip(self._places, found):  # on the loop thread, as every other sample
            if probe.get("ping_rtt") is not None:
                self._head.record_rtt(p.endpoint, probe["ping_rtt"])
        return found

    def head_placement(self) -> dict:
        """Where the output head runs and why (coordinator/decode/head_placement.py):
        `mode` (auto, split, whole or here), `choice` (the last step's: split,
        whole or here), `one_way_seconds` and `saved_seconds` it was chosen by,
        `extra_hops` the split cost that step, `steps_split`/`steps_whole`/
        `steps_here`, `changes`, `whole_held` (the last worker holds the whole
        head), `here_held` (this process holds the rows besides the last
        worker's share) and each worker's median `rtt_seconds`."""
        return self._head.view()

    def needs_refeed(self) -> list[int]:
        """Sequences whose KV cache was lost with a failed endpoint and that have
        not been re-fed (from position 0) or removed since."""
        return sorted(self._endpoints.needs_refeed)

    @property
    def auto_reconnect(self) -> bool:
        return self._endpoints.auto_reconnect

    @property
    def reconnect_backoff(self) -> tuple[float, float]:
        return self._endpoints.backoff

    # ------------------------------------------------------------ decode
    def decode(self, batch: Batch, greedy: bool = False) -> DecodeResult:
        """Decode a batch. With greedy=True the last worker returns only each
        requested row's argmax token (read it with token(i)) instead of its
        logits: 4 bytes a row on the wire instead of 4 x n_vocab."""
        return self._run(self._decode(batch, greedy))

    async def adecode(self, batch: Batch, greedy: bool = False) -> DecodeResult:
        return await self._io.call(self._decode(batch, greedy))

    def decode_resuming(self, batch: Batch, greedy: bool = False) -> DecodeResult:
        """decode(), but with `resume_within` set a step that fails because an
        endpoint failed waits (at most resume_within seconds) for its stage to
        be back, on its worker or a spare, with the KV cache rebuilt, and is
        decoded again; only then, or past the bound, does it return. Without
        resume_within it is decode()."""
        return self._run(self._resume.decode(batch, greedy))

    async def adecode_resuming(self, batch: Batch, greedy: bool = False) -> DecodeResult:
        return await self._io.call(self._resume.decode(batch, greedy))

    async def adecode_outcome(self, batch: Batch, greedy: bool = False) -> DecodeOutcome:
        """adecode_resuming(), returning this step's own outcome: its code, its
        outputs (logits(i)/token(i)) and, failed, its error. For callers with
        several steps in flight at once (the HTTP server's groups of slots),
        where logits() and last_error are those of the step that finished last.
        Such a caller forms its own groups: only a long run of one sequence's
        tokens is cut into micro-batches, the sequences are not grouped again."""
        async def decode() -> DecodeOutcome:
            _OWN_GROUPS.set(True)
            await self._resume.decode(batch, greedy)
            return _OUTCOME.get()
        return await self._io.call(decode())

    @property
    def pipelined(self) -> bool:
        """Steps are cut into micro-batches and several may be in flight at
        once (micro_batch > 0 and more than one endpoint)."""
        return self._micro.enabled and len(self._places) > 1

    @property
    def micro_batch(self) -> int:
        return self._micro.micro_batch

    @property
    def resume_within(self) -> float | None:
        return self._resume.resume_within

    def spares(self) -> list[str]:
        """The spare endpoints not holding a stage now (a lost endpoint joins them)."""
        return list(self._resume.spares)

    async def _decode(self, batch: Batch, greedy: bool = False) -> DecodeResult:
        if self._micro.enabled:
            return await self._decode_pipelined(batch, greedy)
        async with self._gate:  # one step at a time, whole, the stages one after another
            admitted = self._admit(batch, greedy)
            if isinstance(admitted, DecodeResult):
                return admitted
            rows, tok_pos, tok_seq, out_rows, started = admitted
            saved = self.kv.assign(rows, tok_pos, tok_seq)
            try:
                out = await self._pipeline.step(batch.tokens, rows, tok_pos, tok_seq, out_rows, greedy)
            except StepFailed as failed:
                self.kv.rollback(saved)
                return self._step_failed(failed)
            except BaseException:
                self.kv.rollback(saved)
                raise
            return self._step_ok(batch, greedy, out_rows, out, started)

    async def _decode_pipelined(self, batch: Batch, greedy: bool) -> DecodeResult:
        """Admitted under the gate's lock, computed while later steps are
        admitted, finished in admission order (decode_gate.py)."""
        try:
            seqs = int(np.bitwise_or.reduce(seq_masks(seq_ids_of(batch))))
        except Exception:  # a malformed batch: _admit refuses it
            seqs = 0
        while True:
            await self._gate.wait_for(self._gate.sharing(seqs))  # their rows may be this step's inputs
            async with self._gate.lock:
                if self._gate.sharing(seqs):
                    continue
                admitted = self._admit(batch, greedy)
                if isinstance(admitted, DecodeResult):
                    return admitted
                rows, tok_pos, tok_seq, out_rows, started = admitted
                step = self._micro.admit(batch.tokens, rows, tok_pos, tok_seq, out_rows, greedy,
                                         group=not _OWN_GROUPS.get())
                ticket = self._gate.admit(seqs)
                latches = self._latches
                break
        try:
            try:
                out, failed = await self._micro.run(step), None
            except StepFailed as exc:
                out, failed = None, exc
            await self._gate.turn(ticket)
        except BaseException:  # cancelled: rolled back now; the steps after it keep their order
            self._micro.rollback(step)
            self._out = NO_OUTPUT
            self._gate.finish_in_turn(ticket)
            raise
        try:
            if failed is None and self._latches != latches:
                # an endpoint latched after this step was admitted: its rows there are gone (or, resuming, to be
                # rebuilt): it fails as a step decoded after the failure would have
                f = self._endpoints.failed()
                if f:
                    self._micro.rollback(step)
                    self._out = NO_OUTPUT
                    return self._failed(DecodeResult.ENDPOINT_FAILED, f[0].cause, f[0].kind, f[0].endpoint)
            if failed is not None:
                self._micro.rollback(step)
                self._out = NO_OUTPUT
                return self._step_failed(failed)
            self._micro.record(step)
            self.stats["micro_batches"] += len(step.steps)
            return self._step_ok(batch, greedy, out_rows, out, started)
        finally:
            self._gate.finish(ticket)

    def _admit(self, batch: Batch, greedy: bool):
        """The checks before a step and its KV rows (not yet assigned): (rows,
        positions, sequence masks, output rows, start time), or the
        DecodeResult of a step refused."""
        self._out = NO_OUTPUT
        problem = batch_problem(batch, self.n_batch, self.hp.n_vocab, self.kv)
        if problem:
            log.warning("invalid batch", error=problem)
            return self._failed(DecodeResult.INVALID_BATCH, problem, FailureKind.INVALID_BATCH)
        latched = self._endpoints.failed()
        if latched:  # fail fast, no network traffic
            f = latched[0]
            return self._failed(DecodeResult.ENDPOINT_FAILED, f"{f.cause} [latched {time.time() - f.since:.1f} "
                                f"s ago; reconnect() to recover]", f.kind, f.endpoint)
        refeed = self._endpoints.needs_refeed
        problem = refeed and refeed_problem(batch, refeed, self.kv)
        if problem:
            return self._failed(DecodeResult.INVALID_BATCH, problem, FailureKind.INVALID_BATCH)
        n = len(batch.tokens)
        rows = self.kv.find_slot(n)
        if rows is None:
            return self._failed(DecodeResult.NO_KV_SLOT, f"context full: no room for {n} tokens in the KV "
                                f"cache ({self.kv.used()} of {self.n_ctx} cells used)", FailureKind.CONTEXT_FULL)
        tok_pos, tok_seq = np.asarray(batch.pos, dtype=np.int64), seq_masks(seq_ids_of(batch))
        want = list(batch.logits) if batch.logits is not None else [i == n - 1 for i in range(n)]
        out_rows = np.array([i for i, w in enumerate(want) if w], dtype=np.int32)
        return rows, tok_pos, tok_seq, out_rows, time.perf_counter()

    def _step_ok(self, batch: Batch, greedy: bool, out_rows, out, started: float) -> DecodeResult:
        self.stats["decodes"] += 1
        self.stats["tokens"] += len(batch.tokens)
        self.stats["decode_seconds"] += time.perf_counter() - started
        self._out = StepOutput(out_rows, tokens=out) if greedy else StepOutput(out_rows, logits=out)
        self._endpoints.needs_refeed.difference_update(s for ids in seq_ids_of(batch) for s in ids)
        self.last_error = self.last_cause = self.last_failed_endpoint = None
        _OUTCOME.set(DecodeOutcome(DecodeResult.OK, self._out))
        return DecodeResult.OK

    def _step_failed(self, failed: StepFailed) -> DecodeResult:
        for exc in failed.lost:
            self._latches += 1
            self._endpoints.latch(exc)
        exc = failed.reported
        if exc in failed.lost:
            return self._failed(DecodeResult.ENDPOINT_FAILED, exc.message, exc.cause, exc.endpoint)
        if not isinstance(exc, StageFailed):  # a bug of ours: still a code, never an exception
            log.error("decode failed unexpectedly", exc_info=exc)
            return self._failed(DecodeResult.COMPUTE_FAILED, f"internal error in the coordinator: "
                                f"{type(exc).__name__}: {exc}", FailureKind.INTERNAL)
        return self._failed(DecodeResult.COMPUTE_FAILED, exc.message, exc.cause, exc.endpoint)

    def _failed(self, code: DecodeResult, message: str, cause: FailureKind,
                endpoint: str | None = None) -> DecodeResult:
        self.last_error, self.last_cause, self.last_failed_endpoint = message, cause, endpoint
        _OUTCOME.set(DecodeOutcome(code, NO_OUTPUT, message, cause, endpoint))
        return code

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits of batch token i (negative: from the end of the rows that wanted
        logits) after a decode that returned OK; raises otherwise."""
        return self._out.logits(i)

    def token(self, i: int = -1) -> int:
        """The greedy (argmax) token for batch token i after a decode that
        returned OK, with or without greedy=True; raises otherwise."""
        return self._out.token(i)

    # ------------------------------------------------------------ KV management
    # The cell table is the decode step's: find_slot, assign and the masks run on
    # the loop thread while a step is in flight. A call from another thread runs
    # there too, between steps (under the decode lock); interleaved, a seq_rm
    # could empty rows a step had just claimed, and the text would go wrong.
    def _kv_op(self, fn, *args):
        if self._io.on_loop():
            return fn(*args)

        async def between_steps():
            async with self._gate:
                return fn(*args)
        return self._run(between_steps())

    def kv_clear(self) -> None:
        self._kv_op(self._kv_clear)

    def _kv_clear(self) -> None:
        self.kv.clear()
        if self._resume.journal is not None:
            self._resume.journal.clear()
        self._endpoints.needs_refeed.clear()

    def kv_seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        """Remove sequence `seq` (-1: every sequence) from positions [p0, p1)
        (p1 < 0: to the end)."""
        self._kv_op(self._kv_seq_rm, checked_seq(seq, allow_all=True), *checked_range(p0, p1))

    def _kv_seq_rm(self, seq: int, p0: int, p1: int) -> None:
        self.kv.seq_rm(seq, p0, p1)
        if p0 <= 0 and p1 < 0:  # the whole sequence: nothing left to re-feed
            if seq < 0:
                self._endpoints.needs_refeed.clear()
            else:
                self._endpoints.needs_refeed.discard(seq)

    def kv_seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Let sequence `dst` share `src`'s cells in positions [p0, p1) (p1 < 0:
        to the end); nothing is copied on the workers."""
        self._kv_op(self.kv.seq_cp, checked_seq(src), checked_seq(dst), *checked_range(p0, p1))

    def kv_seq_pos_max(self, seq: int) -> int:
        """The highest position sequence `seq` has in the KV cache, -1 if none."""
        return self._kv_op(self.kv.seq_pos_max, checked_seq(seq))

    # ------------------------------------------------------------ recovery
    def reconnect(self, endpoint: str | None = None) -> list[int]:
        """Open a new connection and dispatcher to `endpoint` (even a healthy
        one), or to every failed endpoint, and restore its weights (from the
        worker's tensor cache where it has them); this clears the latch.
        Returns the sequences whose KV cache was lost (needs_refeed()): re-feed
        them from position 0 before continuing them. Raises EndpointUnavailable
        (a ConnectionError) if the worker cannot be reached or loaded; the
        endpoint then stays latched, with the new cause."""
        return self._run(self._endpoints.reconnect(endpoint))

    async def areconnect(self, endpoint: str | None = None) -> list[int]:
        return await self._io.call(self._endpoints.reconnect(endpoint))

    def set_auto_reconnect(self, enabled: bool, backoff: tuple[float, float] | None = None) -> None:
        """Turn the automatic reconnection policy on or off (see __init__). When
        on, every failed endpoint is retried in the background with exponential
        backoff until it is back; decodes meanwhile fail fast with
        ENDPOINT_FAILED, and afterwards needs_refeed() lists what to re-feed."""
        self._io.loop.call_soon_threadsafe(self._endpoints.set_auto_reconnect, enabled, backoff)

    def wait_healthy(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until no endpoint is latched failed,
        e.g. while auto_reconnect brings one back. True if healthy."""
        deadline = time.monotonic() + timeout
        while self.failed_endpoints():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    # ------------------------------------------------------------ text
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def stream(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 40,
               top_p: float = 0.95, seed: int | None = None, stop: Sequence[str] = ()) -> Iterator[str]:
        owner = (threading.get_ident(), None)
        yield from self._io.iterate(self._generations.pieces(owner, prompt, max_tokens, temperature, top_k, top_p,
                                                             seed, stop))

    async def astream(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 40,
                      top_p: float = 0.95, seed: int | None = None, stop: Sequence[str] = ()) -> AsyncIterator[str]:
        owner = (threading.get_ident(), id(asyncio.current_task()))
        pieces = self._generations.pieces(owner, prompt, max_tokens, temperature, top_k, top_p, seed, stop)
        async with contextlib.aclosing(self._io.aiterate(pieces)) as bridged:
            async for piece in bridged:
                yield piece

    def generate(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 40,
                 top_p: float = 0.95, seed: int | None = None, stop: Sequence[str] = ()) -> str:
        return "".join(self.stream(prompt, max_tokens, temperature, top_k, top_p, seed, stop))

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        if self._io.closed:
            return
        self._io.close(self._close_all)
        if hasattr(self, "gguf"):
            self.gguf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
