"""The endpoints' state: each one's connection (executor) and stage, and its
latch. docs/failure-semantics.md describes the behaviour.

An endpoint whose connection fails is latched: decodes fail fast until a
reconnect (manual, or automatic with backoff) opens a new connection and
uploads the stage's weights again. Latching loses every sequence's KV cache;
the owner's `lose_kv` callback clears it and says which sequences to re-feed.
With resuming (resume.py) a reconnect may move the stage to a spare, and a
stage on a spare is moved back to its own endpoint once that is back.
Nothing here needs a model: `connect(placement)` (an executor, opened and
loaded) and `lose_kv()` are the owner's.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import structlog

from coordinator.cluster.executors import Executor, peer_failed
from coordinator.cluster.failures import EndpointFailure, EndpointUnavailable, StageFailed
from coordinator.decode.values import FailureKind
from coordinator.model.stage import Stage

log = structlog.get_logger("coordinator")


@dataclass
class Place:
    """A stage's place in the cluster: the endpoint serving it now, its
    connection (executor), its stage, and its latch."""
    endpoint: str
    layers: range
    executor: Executor | None = None
    stage: Stage | None = None
    failure: EndpointFailure | None = None
    reconnect_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    auto_task: asyncio.Task | None = None
    home: str = ""  # the endpoint it was configured with (`endpoint` differs while a spare holds its stage)
    home_task: asyncio.Task | None = None  # while a spare holds the stage: moving it back home (resuming)


def _bounds(r: range | None) -> list[int] | None:
    return None if r is None else [r.start, r.stop]


def _shard(p: Place) -> dict | None:
    """A tensor-parallel member's shard of every layer (model/tensor_split.Shard), as plain lists; else None."""
    shard = p.stage.shard if p.stage is not None else None
    if shard is None:
        return None
    return {"rank": shard.rank, "of": shard.n, "group": p.stage.tensor_group, "heads": _bounds(shard.heads),
            "kv_heads": _bounds(shard.kv_heads), "kv_replicated": shard.replicated_kv, "ffn_rows": _bounds(shard.ffn),
            "embd_rows": _bounds(p.stage.embd_rows), "head_rows": _bounds(p.stage.head_rows),
            "out_rows": _bounds(shard.out)}


class EndpointSet:
    def __init__(self, endpoints: list[str], io, lock: asyncio.Lock,
                 connect: Callable[[Place, str], Awaitable[object]], lose_kv: Callable[[], set[int]],
                 auto_reconnect: bool = False, backoff: tuple[float, float] = (0.25, 8.0),
                 stats: dict | None = None, resumer=None):
        """`io`: the LoopThread; `lock`: the decode lock (latch and swap
        connections between steps); `resumer` (coordinator/decode/resume.py, when
        resuming is on): keeps the KV cache through a latch, names spares to
        reconnect to and rebuilds the KV cache after a reconnect."""
        self.places = [Place(e, range(0), home=e) for e in endpoints]
        self.resumer = resumer if resumer is not None and resumer.enabled else None
        self.io, self.lock, self.connect, self.lose_kv = io, lock, connect, lose_kv
        self.auto_reconnect = bool(auto_reconnect)
        self.backoff = tuple(backoff)
        self.stats = stats if stats is not None else {"reconnects": 0}
        self.needs_refeed: set[int] = set()

    # ------------------------------------------------------------ opening
    async def open_all(self, new_executor) -> list[dict]:
        """A connection to every endpoint at once; their DEVICE_INFO."""
        for p in self.places:
            p.executor = new_executor(p.endpoint)
        try:
            infos = await asyncio.gather(*(p.executor.open() for p in self.places))
        except StageFailed as exc:
            raise EndpointUnavailable(exc.endpoint, exc.cause, exc.message) from None
        for p in self.places:
            self.watch(p, p.executor)
        return infos

    async def load_all(self, gguf, progress: bool, on_upload=None) -> None:
        """Upload every stage's weights, to all endpoints at once (a progress bar on
        request; `on_upload(done, total)` at the start and after every chunk)."""
        total = sum(len(p.stage.weight_data(gguf, n)) for p in self.places for n in p.stage.weights)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="B", unit_scale=True, desc="uploading weights", leave=False)
        done = 0

        def uploaded(n: int) -> None:
            nonlocal done
            done += n
            if bar:
                bar.update(n)
            if on_upload:
                on_upload(done, total)

        if on_upload:
            on_upload(0, total)
        try:
            # all at once: each upload is bound by its own link, not by the others' turns
            results = await asyncio.gather(*(p.executor.load(p.stage, gguf, uploaded) for p in self.places),
                                           return_exceptions=True)
            for p, result in zip(self.places, results):
                if isinstance(result, StageFailed) and result.lost_connection:
                    self._latch(p, result)
            for result in results:  # the first endpoint's failure in placement order names the culprit
                if isinstance(result, StageFailed):
                    raise EndpointUnavailable(result.endpoint, result.cause, result.message) from None
                if isinstance(result, BaseException):
                    raise result
        finally:
            if bar:
                bar.close()

    def watch(self, p: Place, ex) -> None:
        """Latch `p` as soon as its connection fails, also between decodes (a
        worker that dies, hangs or drops us while we are idle), so health() and
        failed() tell the truth before the next decode finds out."""
        client = ex.client
        if client is None:
            return
        client.on_failure = lambda failure: self.io.spawn(self._connection_lost(p, ex, failure))
        if client.failed is not None:  # it failed before it was watched (during the upload)
            client.on_failure(client.failed)

    async def _connection_lost(self, p: Place, ex, failure) -> None:
        async with self.lock:  # between steps: a step in flight latches its own failures
            if p.executor is ex and p.failure is None and not self.io.closed:
                self._latch(p, peer_failed(p.endpoint, failure))

    async def close_all(self) -> None:
        for p in self.places:
            if p.executor is not None:
                try:
                    await p.executor.close()
                except Exception:
                    pass

    # ------------------------------------------------------------ status
    def status(self) -> list[dict]:
        return [{"endpoint": p.endpoint, "layers": [p.layers.start, p.layers.stop],
                 "head_rows": _bounds(p.stage.head_rows) if p.stage else None, "shard": _shard(p),
                 "failed": p.failure is not None, "rtt": p.executor.rtt if p.executor is not None else None} for p in self.places]

    @property
    def split_mode(self) -> str:
        """"tensor" when the places are one tensor-parallel group (each a shard of every layer), else "layer"."""
        return "tensor" if any(p.stage is not None and p.stage.shard is not None for p in self.places) else "layer"

    async def probe(self, timeout: float) -> list[dict]:
        """Every connected endpoint's probe (its executor's: ping round trip,
        memory), all at once and outside the decode lock, so a step is never
        held up; with the worker compute time summed over the current
        connection. A latched endpoint is not asked: its `error` is the cause."""
        async def one(p: Place) -> dict:
            ex = p.executor
            if ex is None:
                return {"error": f"worker {p.endpoint} is being reconnected"}
            if p.failure is not None:
                return {"error": p.failure.cause}
            found = await ex.probe(timeout)
            compute_us = ex.compute_us  # a remote worker's; None in this process
            return dict(found, compute_seconds=None if compute_us is None else compute_us / 1e6)

        return list(await asyncio.gather(*(one(p) for p in self.places)))

    def failed(self) -> list[EndpointFailure]:
        return [p.failure for p in self.places if p.failure is not None]

    def health(self) -> dict:
        failed = self.failed()
        status = "ok" if not failed else ("reconnecting" if self.auto_reconnect else "failed")
        return {"status": status, "split_mode": self.split_mode,
                "endpoints": [{"endpoint": p.endpoint, "layers": [p.layers.start, p.layers.stop],
                               "shard": _shard(p), "ok": p.failure is None,
                               # its steps go over a step channel now (docs/protocol.md, "Step channels")
                               "step_channel": getattr(p.executor, "channel", None) is not None,
                               **({"kind": p.failure.kind, "cause": p.failure.cause, "since": p.failure.since,
                                   "attempts": p.failure.attempts, "next_attempt": p.failure.next_attempt}
                                  if p.failure is not None else {})}
                              for p in self.places],
                "needs_refeed": sorted(self.needs_refeed)}

    # ------------------------------------------------------------ latching
    def latch(self, exc: StageFailed) -> None:
        """Latch the endpoint `exc` names (a failure of its connection)."""
        for p in self.places:
            if p.endpoint == exc.endpoint:
                self._latch(p, exc)

    def _latch(self, p: Place, exc: StageFailed) -> None:
        if p.failure is None:
            self._set_failure(p, EndpointFailure(p.endpoint, exc.message, exc.cause, time.time()))

    def _set_failure(self, p: Place, failure: EndpointFailure) -> None:
        """Latch `p` failed. Its worker freed our buffers with the connection, so
        every sequence's KV cache is gone: lose_kv() clears it, and the
        sequences are remembered for needs_refeed()/reconnect()."""
        first = p.failure is None
        if not first:  # still failed: since when stays the first failure's (alerts count from it)
            failure.attempts, failure.since = p.failure.attempts, p.failure.since
        if self.resumer is not None:  # the table stays: the rows are rebuilt once the stage is back
            self.resumer.kv_lost(self.places.index(p), failure if first else None)
        self.needs_refeed |= self.lose_kv()
        # published last: another thread that sees the latch (failed_endpoints, health) sees its consequences
        p.failure = failure
        if first:
            log.error("endpoint latched failed", endpoint=p.endpoint, kind=failure.kind, cause=failure.cause)
        if self.auto_reconnect and not self.io.closed:
            self._schedule_auto_reconnect(p)

    # ------------------------------------------------------------ reconnecting
    async def reconnect(self, endpoint: str | None) -> list[int]:
        if endpoint is not None and endpoint not in [p.endpoint for p in self.places]:
            raise ValueError(f"{endpoint!r} is not an endpoint of this coordinator")
        for p in self.places:
            if endpoint is None and p.failure is not None:
                await self._reconnect_place(p, only_if_failed=True)
            elif p.endpoint == endpoint:
                await self._reconnect_place(p, only_if_failed=False)
        return sorted(self.needs_refeed)

    async def _reconnect_place(self, p: Place, only_if_failed: bool, spares: bool = False) -> None:
        """A new connection for `p` (with `spares`, the resumer may name a spare
        to take its stage), its weights uploaded; the latch cleared."""
        async with p.reconnect_lock:
            async with self.lock:
                if p.failure is None:
                    if only_if_failed:
                        return  # someone else reconnected it meanwhile
                    # retire the healthy connection first: its buffers are freed before
                    # the new ones are allocated, and decodes fail fast in between
                    retired = f"worker {p.endpoint}: connection being replaced by reconnect()"
                    self._set_failure(p, EndpointFailure(p.endpoint, retired, FailureKind.RECONNECT, time.time()))
                old, p.executor = p.executor, None
            if old is not None:
                await old.close()
            # connect and upload outside the decode lock: decodes keep failing fast meanwhile
            targets = self.resumer.candidates(p) if spares and self.resumer is not None else [p.endpoint]
            ex, target, own_failure = None, None, None
            started = time.monotonic()
            for target in targets:
                if target != p.endpoint and not self.resumer.claim(target):
                    continue  # another stage took that spare meanwhile
                try:
                    ex = await self.connect(p, target)
                    break
                except StageFailed as exc:
                    if target == p.endpoint:  # always among the targets: what the latch says
                        own_failure = exc
                    else:
                        self.resumer.release(target)
                        log.warning("spare could not take over", spare=target, cause=exc.message)
            if ex is None:
                exc = own_failure
                async with self.lock:
                    self._set_failure(p, EndpointFailure(p.endpoint, exc.message, exc.cause, time.time()))
                raise EndpointUnavailable(p.endpoint, exc.cause, exc.message) from None
            async with self.lock:
                if target != p.endpoint:
                    self.resumer.moved(p, target)
                    if p.endpoint != p.home and (p.home_task is None or p.home_task.done()):
                        p.home_task = self.io.loop.create_task(self._bring_home(p))
                p.stage.graphs.clear()  # their wire form names the old connection's buffer
                p.executor = ex
                self.watch(p, ex)
                p.failure = None
                took = time.monotonic() - started
                self.stats["reconnects"] += 1
                self.stats["reconnect_seconds"] = self.stats.get("reconnect_seconds", 0.0) + took
                log.info("endpoint reconnected", endpoint=p.endpoint, seconds=round(took, 3),
                         needs_refeed=sorted(self.needs_refeed))
                if self.resumer is not None:
                    await self.resumer.reconnected(self.places, self.latch)

    # ------------------------------------------------------------ moving a stage back from a spare
    async def _bring_home(self, p: Place) -> None:
        """While a spare holds `p`'s stage (resuming): every `resumer.home_every`
        seconds, try to move it back to its own endpoint (`_move_home`)."""
        while p.endpoint != p.home and not self.io.closed:
            await asyncio.sleep(self.resumer.home_every)
            if p.failure is not None or p.endpoint == p.home:
                continue  # resuming: its reconnect attempts try the home endpoint too
            try:
                await self._move_home(p)
            except StageFailed as exc:
                log.debug("stage not moved home yet", endpoint=p.home, cause=exc.message)
            except Exception:  # a bug of ours: logged, and tried again
                log.exception("moving a stage home failed", endpoint=p.home)

    async def _move_home(self, p: Place) -> None:
        """`p`'s own endpoint connected and loaded while the spare goes on
        serving; then, between two steps, the stage switches to it and its KV
        rows are rebuilt there (resume.py's replay); the spare's connection is
        closed (its buffers freed) and it is a spare again. Raises StageFailed
        when the home endpoint cannot take the stage (not back yet)."""
        async with p.reconnect_lock:  # never with a resume of the same stage
            if p.failure is not None or p.endpoint == p.home or not self.resumer.claim(p.home):
                return  # resuming, home already, or the home endpoint holds another stage now
            ex = None
            try:
                ex = await self.connect(p, p.home)
                async with self.lock:
                    if p.failure is not None:  # the spare failed meanwhile: resumed the usual way
                        return
                    old, spare = p.executor, p.endpoint
                    p.stage.graphs.clear()  # their wire form names the spare's buffer
                    p.executor, p.endpoint = ex, p.home
                    ex = None
                    self.watch(p, p.executor)
                    self.resumer.moved_home(p, spare)
                    self.resumer.kv_lost(self.places.index(p))  # the home worker holds none of our KV rows
                    await self.resumer.reconnected(self.places, self.latch)
                await old.close()  # outside the lock; its failure no longer latches anything (not p's)
            finally:
                if ex is not None:  # not switched to: the home endpoint is a spare again
                    await ex.close()
                if p.endpoint != p.home:
                    self.resumer.release(p.home)

    def set_auto_reconnect(self, enabled: bool, backoff: tuple[float, float] | None = None) -> None:
        """On the loop thread: turn the policy on (retrying every latched
        endpoint) or off (cancelling the retries)."""
        self.auto_reconnect = bool(enabled)
        if backoff is not None:
            self.backoff = tuple(backoff)
        for p in self.places:
            if enabled and p.failure is not None:
                self._schedule_auto_reconnect(p)
            elif not enabled and p.auto_task is not None:
                p.auto_task.cancel()
                p.auto_task = None
                if p.failure is not None:
                    p.failure.next_attempt = None

    def _schedule_auto_reconnect(self, p: Place) -> None:
        if p.auto_task is None or p.auto_task.done():
            p.auto_task = self.io.loop.create_task(self._auto_reconnect(p))

    async def _auto_reconnect(self, p: Place) -> None:
        delay, cap = self.backoff
        while p.failure is not None and self.auto_reconnect and not self.io.closed:
            p.failure.next_attempt = time.time() + delay
            await asyncio.sleep(delay)
            if p.failure is None:
                return
            attempt = p.failure.attempts + 1
            p.failure.attempts = attempt
            p.failure.next_attempt = None
            try:
                await self._reconnect_place(p, only_if_failed=True, spares=True)
                if p.failure is None:
                    log.info("endpoint reconnected automatically", endpoint=p.endpoint, attempts=attempt)
                    return
                continue  # it failed again at once (rebuilding its KV cache): this task retries it
            except EndpointUnavailable as exc:
                # attempts 1, 2, 4, 8, ... (resuming tries 50 times a second); failed_endpoints() has every one
                if attempt & (attempt - 1) == 0:
                    log.warning("automatic reconnect failed", endpoint=p.endpoint, attempts=attempt,
                                cause=exc.message)
            except Exception:
                log.exception("automatic reconnect failed", endpoint=p.endpoint)
            delay = self.resumer.next_delay(p, delay, cap) if self.resumer is not None else min(delay * 2, cap)
