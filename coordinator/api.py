"""The coordinator's front door: load a GGUF model, split its layers over
endpoints, decode.

`decode` returns llama_decode-style codes (DecodeResult) and never raises for a
failure of a worker; `generate`/`stream` raise DecodeError. Any endpoint
failure latches that endpoint: later decodes fail fast without network traffic
until `reconnect()` opens a new connection (or, with `auto_reconnect`, a
background task does, with backoff). A failed decode leaves no logits.
docs/failure-semantics.md has the whole table.

This class is a facade over a CoordinatorConfig (config.py): it builds the
parts and submits every call to their I/O thread (cluster/loop.py). The work
is theirs: model/loading.py puts the model on the workers, decode/decoder.py
decodes (a batch in, a DecodeOutcome out), decode/resume.py waits out a lost
worker, decode/generation.py turns prompts into text, cluster/endpoints.py
keeps the connections and their latches.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import AsyncIterator, Iterator, Sequence

import numpy as np
import structlog

from coordinator.cluster.endpoints import EndpointSet
from coordinator.cluster.executors import ChunkDigests
from coordinator.cluster.failures import EndpointFailure, EndpointUnavailable
from coordinator.cluster.loop import LoopThread
from coordinator.config import CoordinatorConfig
from coordinator.decode.batch_checks import checked_greedy, checked_range, checked_seq
from coordinator.decode.decoder import Decoder
from coordinator.decode.gate import DecodeGate
from coordinator.decode.generation import Generations
from coordinator.decode.head_placement import HeadPlacement, checked_mode
from coordinator.decode.kv_cells import KVCells
from coordinator.decode.microbatch import MicroBatches
from coordinator.decode.pipeline import Pipeline
from coordinator.decode.resume import RESUME_BACKOFF, Resumer
from coordinator.decode.values import Batch, DecodeError, DecodeOutcome, DecodeResult, FailureKind
from coordinator.model.architectures import architecture
from coordinator.model.architectures.common import head_source
from coordinator.model.default_model import default_model_path
from coordinator.model.gguf_file import GGUFFile
from coordinator.model.loading import ModelLoader
from coordinator.model.split_plan import DoesNotFit, plan_rows, plan_split
from coordinator.text.tokenizer import Tokenizer
from rpc_daemon.wire.auth import load_secret

__all__ = ["Batch", "Coordinator", "CoordinatorConfig", "DecodeError", "DecodeResult", "DoesNotFit",
           "EndpointFailure", "EndpointUnavailable", "FailureKind", "default_model_path", "plan_rows", "plan_split"]

log = structlog.get_logger("coordinator")
# what a decode step adds to Coordinator.stats (the warm-up's steps take theirs back)
DECODE_COUNTS = ("decodes", "tokens", "decode_seconds", "micro_batches", "linked_steps")


class Coordinator:
    def __init__(self, endpoints: Sequence[str] = ("local",), model: str | None = None, **options):
        """`Coordinator(endpoints, model, **options)`: the options are
        CoordinatorConfig's fields (config.py documents each); an unknown one
        is a TypeError, a bad value a ValueError, before anything starts."""
        self.config = config = CoordinatorConfig.of(endpoints, model, options)
        self.stats = {"decodes": 0, "tokens": 0, "decode_seconds": 0.0, "generated": 0, "reconnects": 0,
                      "micro_batches": 0, "linked_steps": 0}
        self._resume = Resumer(config.resume_within, config.spares, self.stats, config.spare_after)
        auto_reconnect = config.auto_reconnect or self._resume.enabled  # the stage comes back by the reconnect
        backoff = config.reconnect_backoff or (RESUME_BACKOFF if self._resume.enabled else (0.25, 8.0))
        self.model_path = config.model or default_model_path()
        self.n_batch, self.threads, self.n_ctx = config.n_batch, config.threads, config.n_ctx
        head_mode = checked_mode(config.head_split) if len(config.endpoints) > 1 else "whole"
        self.head_shards = head_mode != "whole"  # the stages hold shares of the output head
        self._head = HeadPlacement(head_mode)
        self.step_links = bool(config.step_links)
        executor_options = {
            "connect_timeout": config.connect_timeout, "liveness_timeout": config.liveness_timeout,
            "use_cache": config.use_cache, "request_timeout": config.request_timeout,
            "step_channels": bool(config.step_channels),
            # security (docs/security.md): the workers' shared secret (rpc_daemon/wire/auth.py), TLS CA
            "secret": load_secret(config.secret, config.secret_file), "tls_ca": config.tls_ca,
            # a reconnect or a spare's takeover need not hash the weights again
            "digests": ChunkDigests()}
        self._head_share: float | None = None
        self._io = LoopThread()
        # decode steps in flight at once (pipelined); `async with` it: latching, reconnects and KV edits between steps
        gate = DecodeGate()
        try:
            self.gguf = GGUFFile(self.model_path)
            self.arch = architecture(self.gguf.architecture)
            self.hp = self.arch.hparams(self.gguf)
            self.tokenizer = Tokenizer.from_gguf_fields(self.gguf.get)
            self.kv = KVCells(self.n_ctx, self.hp.n_swa)
            self._loader = ModelLoader(self.gguf, self.arch, self.hp, self.n_ctx, self.n_batch, self.threads,
                                       executor_options, self._head, (config.cache_type_k, config.cache_type_v),
                                       config.exact_sums)
            self._endpoints = EndpointSet(config.endpoints, self._io, gate, self._loader.connect, self._lose_kv,
                                          auto_reconnect, backoff, self.stats, self._resume)
            self._pipeline = Pipeline(self._places, self.hp, self.kv, self.head_shards, self._resume.journal,
                                      links=self.step_links, stats=self.stats, head_placement=self._head)
            self._decoder = Decoder(self._pipeline, MicroBatches(self._pipeline, config.micro_batch), self.kv, gate,
                                    self._endpoints, self.n_batch, self.stats, self._resume.journal)
            self._resume.attach(self._decoder, self._endpoints)
            self._generations = Generations(self._resume, self.tokenizer, self.n_ctx, self.n_batch, self.stats)
            self._run(self._loader.load(self._endpoints, self._pipeline, config.split, self.head_shards,
                                        config.progress, config.on_upload, config.split_mode,
                                        min(config.request_timeout or 600.0, 600.0), config.tensor_group))
            if len(self._pipeline.groups) == 1:  # one tensor-parallel group computes every step: nothing to pipeline
                self._decoder.micro.micro_batch = 0
            if config.warmup:
                self._warm_up()
        except BaseException:
            self.close()
            raise

    def _warm_up(self) -> None:
        """A generation's two kinds of one-token step through every stage (CoordinatorConfig.warmup),
        each at position 0 with the cache cleared after it; then nothing left of them to read or
        count: the decode counters, the head placement's step counts and the last outcome as before.
        On the loop, between no other steps: a reconnect task's own counters are not touched."""
        async def warm_up() -> None:
            counts = {k: self.stats[k] for k in DECODE_COUNTS if k in self.stats}
            head, started = self._head.mark(), time.perf_counter()
            try:
                for greedy in (True, False):
                    outcome = await self._decoder.decode(Batch.single([0], 0), greedy)
                    self._decoder.kv_clear()
                    if outcome.code != DecodeResult.OK:  # its endpoint stays latched, as any failed decode's
                        log.warning("warm-up step failed", code=outcome.code.name, error=outcome.error)
                        return
                log.info("warmed up", seconds=round(time.perf_counter() - started, 3))
            except Exception as exc:  # the start goes on without it, as after a failed step
                log.warning("warm-up step failed", error=f"{type(exc).__name__}: {exc}")
            finally:
                self._decoder.kv_clear()
                for k in DECODE_COUNTS:
                    if k in counts:
                        self.stats[k] = counts[k]
                    else:
                        self.stats.pop(k, None)
                self._head.restore(head)
                self._decoder.last = DecodeOutcome(DecodeResult.OK)
        self._run(warm_up())

    async def _close_all(self) -> None:
        if hasattr(self, "_endpoints"):  # else the constructor failed before connecting anything
            await self._endpoints.close_all()
        here = getattr(self, "_pipeline", None) and self._pipeline.here
        if here is not None:
            await here.executor.close()

    def _lose_kv(self) -> set[int]:
        """An endpoint latched: every sequence's KV cache is gone with its buffers
        (resuming: the table stays, the rows are rebuilt when the stage is back,
        and the last step's outputs stay readable: they are right)."""
        if self._resume.enabled:
            return set()
        return self._decoder.forget_kv()

    # the I/O thread's loop and the stages' places, for tests and benchmarks that look inside
    _loop = property(lambda self: self._io.loop)
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
        fail), "degraded" while every stage serves but one is on a spare.
        `split_choice`: how the split mode was settled (asked, chosen, and auto's figures)."""
        health = self._resume.health(self._endpoints.health(), self._endpoints.places)
        health["split_choice"] = dict(self._loader.split_choice)
        return health

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
    def decode(self, batch: Batch, greedy: bool | int = False) -> DecodeResult:
        """Decode a batch. With greedy=True the last worker returns only each
        requested row's argmax token (read it with token(i)) instead of its
        logits: 4 bytes a row on the wire instead of 4 x n_vocab. With greedy=k
        (2..MAX_BEST_TOKENS, at most n_vocab) it returns each row's k best tokens, best first
        (best_tokens(i); token(i) is the first): what a greedy sampler that bans
        up to k - 1 tokens (ignore_eos) needs."""
        return self._run(self._decoder.decode(batch, checked_greedy(greedy))).code

    async def adecode(self, batch: Batch, greedy: bool | int = False) -> DecodeResult:
        return (await self._io.call(self._decoder.decode(batch, checked_greedy(greedy)))).code

    def decode_resuming(self, batch: Batch, greedy: bool | int = False) -> DecodeResult:
        """decode(), but with `resume_within` set a step that fails because an
        endpoint failed waits (at most resume_within seconds) for its stage to
        be back, on its worker or a spare, with the KV cache rebuilt, and is
        decoded again; only then, or past the bound, does it return. Without
        resume_within it is decode()."""
        return self._run(self._resume.decode(batch, checked_greedy(greedy))).code

    async def adecode_resuming(self, batch: Batch, greedy: bool | int = False) -> DecodeResult:
        return (await self._io.call(self._resume.decode(batch, checked_greedy(greedy)))).code

    async def adecode_outcome(self, batch: Batch, greedy: bool | int = False) -> DecodeOutcome:
        """adecode_resuming(), returning this step's own outcome: its code, its
        outputs (logits(i)/token(i)) and, failed, its error. For callers with
        several steps in flight at once (the HTTP server's groups of slots),
        where logits() and last_error are those of the step that finished last.
        Such a caller forms its own groups: only a long run of one sequence's
        tokens is cut into micro-batches, the sequences are not grouped again."""
        return await self._io.call(self._resume.decode(batch, checked_greedy(greedy), group=False))

    def embed(self, batch: Batch) -> DecodeOutcome:
        """Decode `batch` for embeddings: for every token that wants an output
        (Batch.logits), its final hidden state after output_norm (f32[n_embd]),
        read with outcome.hidden(i); no output head runs. The KV rows are
        written and kept as a decode's (kv_seq_rm them when done). The outcome's
        code and error as decode()'s; it does not pause to resume."""
        return self._run(self._decoder.embed(batch))

    async def aembed(self, batch: Batch) -> DecodeOutcome:
        return await self._io.call(self._decoder.embed(batch))

    @property
    def pipelined(self) -> bool:
        """Steps are cut into micro-batches and several may be in flight at
        once (micro_batch > 0 and more than one endpoint)."""
        return self._decoder.pipelined

    @property
    def head_share(self) -> float:
        """The output head's part of the weight bytes a token reads (the head and every layer)."""
        if self._head_share is None:
            head = len(self.gguf.tensor_data(head_source(self.gguf.tensors)))
            self._head_share = head / max(head + self.gguf.layer_bytes, 1)
        return self._head_share

    @property
    def pipeline_stages(self) -> int:
        """The stages a step goes through one after another: the endpoints, or the tensor-parallel groups."""
        return self._pipeline.n_stages

    @property
    def micro_batch(self) -> int:
        return self._decoder.micro.micro_batch

    @property
    def resume_within(self) -> float | None:
        return self._resume.resume_within

    def spares(self) -> list[str]:
        """The spare endpoints not holding a stage now (a lost endpoint joins them)."""
        return list(self._resume.spares)

    # what the last decode to end left: its outputs (after OK) and its error (after a failure)
    last_error = property(lambda self: self._decoder.last.error)
    last_cause = property(lambda self: self._decoder.last.cause)
    last_failed_endpoint = property(lambda self: self._decoder.last.endpoint)

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits of batch token i (negative: from the end of the rows that wanted
        logits) after a decode that returned OK; raises otherwise."""
        return self._decoder.last.logits(i)

    def token(self, i: int = -1) -> int:
        """The greedy (argmax) token for batch token i after a decode that
        returned OK, with or without greedy=True; raises otherwise."""
        return self._decoder.last.token(i)

    def best_tokens(self, i: int = -1) -> np.ndarray:
        """Batch token i's best tokens, best first (i32), after a decode with
        greedy=k that returned OK: its k highest logits' ids, the first the argmax
        (lowest id on a tie), then by logit, a lower id first among equal ones
        as far as each head shard's own k best show them; raises otherwise."""
        return self._decoder.last.best_tokens(i)

    # ------------------------------------------------------------ KV management
    # The cell table is the decode step's: find_slot, assign and the masks run on
    # the loop thread while a step is in flight. A call from another thread runs
    # there too, between steps (under the decode gate); interleaved, a seq_rm
    # could empty rows a step had just claimed, and the text would go wrong.
    def _kv_op(self, fn, *args):
        if self._io.on_loop():
            return fn(*args)

        async def between_steps():
            async with self._decoder.gate:
                return fn(*args)
        return self._run(between_steps())

    def kv_clear(self) -> None:
        self._kv_op(self._decoder.kv_clear)

    def kv_seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        """Remove sequence `seq` (-1: every sequence) from positions [p0, p1)
        (p1 < 0: to the end)."""
        self._kv_op(self._decoder.kv_seq_rm, checked_seq(seq, allow_all=True), *checked_range(p0, p1))

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
