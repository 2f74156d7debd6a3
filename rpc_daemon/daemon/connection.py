"""The daemon's connections: asyncio BufferedProtocols that only move bytes,
and the Daemon state they share. What each command does, and how its requests
are scheduled, is in handlers.py (one table); what a request must satisfy, in
rpc_daemon/validation/; what a connection's first bytes are (a llama.cpp
client?), in wire/llamacpp.py. Tests' misbehaving connections subclass this
one (rpc_daemon/testing/faulty_connection.py).

protocol.FrameReader (the client's too) cuts the frames, and the connection,
as its sink, says where each blob goes, so SET_TENSOR data lands straight in
the destination shared-memory buffer once the whole request has been checked.
Commands whose table row says so (PING, HELLO, AUTH) are answered as soon as
they are read, even while the connection's previous request is still
computing; every other request runs in order on the connection's own task
(those whose row says so, a few side by side).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import time

import structlog

from rpc_daemon.compute.pool import ComputePool
from rpc_daemon.daemon.buffers import BufferRegistry, SharedBuffer, arena_size_for
from rpc_daemon.daemon.config import DaemonConfig, fd_client_limit
from rpc_daemon.daemon.handlers import COMMANDS, CommandRow, Session, overlap, runs_beside
from rpc_daemon.daemon.peers import MAX_DEFERRED, Deferred, PeerLinks
from rpc_daemon.daemon.ratelimit import RateFloor, TokenBucket
from rpc_daemon.daemon.tensor_cache import TensorCache, default_max_bytes
from rpc_daemon.service import hoptrace
from rpc_daemon.service.memory import give_back_free_heap, physical_memory
from rpc_daemon.service.shared_memory import SharedMemory
from rpc_daemon.validation import requests as V
from rpc_daemon.wire import framing as F
from rpc_daemon.wire import llamacpp
from rpc_daemon.wire import protocol as P
from rpc_daemon.wire.protocol import Command, ProtocolError, Status
from rpc_daemon.wire.sockets import tune_socket

log = structlog.get_logger("rpc")


MAX_QUEUED = 64  # requests queued per connection before it stops reading
RX_SIZE = 1 << 16  # receive buffer of an authenticated connection
PREAUTH_RX_SIZE = 1 << 13  # before authentication: one frame is at most 12 + max_preauth_header bytes


class Daemon:
    """State shared by all connections."""

    def __init__(self, config: DaemonConfig):
        max_clients = fd_client_limit(config.max_clients)
        if max_clients != config.max_clients:
            config = dataclasses.replace(config, max_clients=max_clients)
        self.config = config
        mem = config.mem or physical_memory()
        # where the clients' arenas live, and whether on 2 MiB pages (service/shared_memory.py)
        self.shm = SharedMemory.open(config.shm_dir, config.huge_pages)
        self.buffers = BufferRegistry(mem, arena_size_for(config.limits.max_client_bytes or mem), self.shm)
        # one compute process per client that computes (and a spare), serialized daemon-wide
        self.compute = ComputePool(config.threads, config.compute_timeout, config.spin_ms)
        self.buffers.compute_bytes = lambda: self.compute.compute_bytes
        self.compute.budget_base = lambda: self.buffers.max_bytes - self.buffers.allocated
        self.cache = None
        if config.cache_dir:
            self.cache = TensorCache(config.cache_dir, config.cache_max or default_max_bytes(config.cache_dir, mem))
        self.connections: set[Connection] = set()
        self._ids = itertools.count(1)
        self.stats = collections.Counter()
        self.peer_links = _peer_links(config, self.stats)  # step links to other workers (daemon/peers.py)

    def new_client_id(self) -> int:
        return next(self._ids)

    def close(self) -> None:
        for conn in list(self.connections):
            conn.abort("daemon shutting down")
        self.peer_links.close()
        self.compute.close()
        self.shm.close()


def _peer_links(config: DaemonConfig, stats) -> PeerLinks:
    """Peer connections speak as this daemon's clients do: its shared secret,
    and TLS (verified against --peer-tls-ca) when it serves TLS itself."""
    ssl_context = None
    if config.tls_cert and config.peer_tls_ca:
        from rpc_daemon.wire.tls import client_context
        ssl_context = client_context(config.peer_tls_ca)
    return PeerLinks(config.secret, ssl_context, config.peer_timeout,
                     usable=not config.tls_cert or ssl_context is not None, stats=stats)


class Connection(asyncio.BufferedProtocol):
    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.limits = daemon.config.limits
        # what the handlers see of this client; it holds no reference back to the connection, so a
        # closed connection is freed at once by its refcount, not by the gc
        self.session = Session(daemon)
        self.transport: asyncio.Transport | None = None
        self.log = log
        self.closed = False
        self.queue: asyncio.Queue = asyncio.Queue()
        self._queued = asyncio.Event()  # set when a request is queued (_run_beside waits for one)
        self.worker: asyncio.Task | None = None
        self.worker_busy = False
        self.last_activity = time.monotonic()
        # frames are cut by protocol.FrameReader, the client's too; this connection is its
        # sink (header, frame, hold). Before authentication a frame is at most
        # 12 + max_preauth_header bytes and no blob, so the receive buffer is small; it
        # grows to RX_SIZE once the connection is authenticated. A blob is received into
        # memory as it arrives (never allocated at the length its prefix claims), or
        # straight into its SET_TENSOR destination.
        self.reader = F.FrameReader(self.limits, PREAUTH_RX_SIZE, sink=self, authenticated=False,
                                    eager_blobs=False)
        # a connection's first bytes are looked at before the reader parses them, until they tell whether
        # they are a llama.cpp client's HELLO (answered in its framing, then closed) or go to the reader
        # (wire/llamacpp.py decides; meanwhile it keeps them: at most one pre-auth receive, once)
        self._opening: llamacpp.Opening | None = llamacpp.Opening()
        self._opening_rx: memoryview | None = None  # the receive buffer handed out while looking
        self._refused: ProtocolError | None = None  # the refusal header() decided for the frame being read
        self._inflight = 0  # bytes of queued (and running) requests held in daemon memory: headers, blobs
        self.bucket = TokenBucket(daemon.config.max_requests_per_second, daemon.config.request_burst)
        self._warn_budget = TokenBucket(5.0, 20)  # refusals logged per client: no log flood
        # after authentication, a frame in progress arrives at --min-rate or the connection goes (_check_idle)
        self._floor = RateFloor(daemon.config.min_rate, daemon.config.min_rate_window)
        self._rx_total = 0
        self._can_write = asyncio.Event()  # cleared while the client does not read its replies
        self._can_write.set()
        self._wbuf = 0
        self._deferred = asyncio.Semaphore(MAX_DEFERRED)  # forwarding computes whose pushes are unanswered

    @property
    def client_id(self) -> int:
        return self.session.client_id

    @property
    def hello_done(self) -> bool:
        return self.session.hello_done

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.connected_at = time.monotonic()
        tune_socket(transport.get_extra_info("socket"))
        peer = transport.get_extra_info("peername")
        self.log = self.session.log = log.bind(peer=f"{peer[0]}:{peer[1]}" if peer else "?", client=self.client_id)
        if len(self.daemon.connections) >= self.daemon.config.max_clients:
            self._reply(None, Status.LIMIT_EXCEEDED, f"too many clients (limit {self.daemon.config.max_clients})")
            transport.close()
            self.closed = True
            return
        self.daemon.connections.add(self)
        self.worker = asyncio.get_running_loop().create_task(self._work())
        self._watchdog = asyncio.get_running_loop().call_later(1.0, self._check_idle)
        self.log.info("client connected")

    # ------------------------------------------------------------ framing (moving bytes; protocol.FrameReader cuts frames)
    def get_buffer(self, sizehint: int):
        if self._opening is not None:
            self._opening_rx = self.reader.buffer()  # read back by _opening_received, not by the reader
            return self._opening_rx
        return self.reader.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.daemon.stats["bytes_in"] += nbytes
        self._rx_total += nbytes
        self.last_activity = time.monotonic()
        if hoptrace.ON and not self.reader.partial:
            hoptrace.mark("daemon rx")
        try:
            if self._opening_rx is not None:
                data, self._opening_rx = bytes(self._opening_rx[:nbytes]), None
                self._opening_received(data)
            else:
                self.reader.received(nbytes)
        except ProtocolError as exc:
            self._framing_broken(exc)

    def _opening_received(self, data: bytes) -> None:
        """A connection's first bytes, until llamacpp.Opening has decided: ours
        go to the frame reader, a llama.cpp client's HELLO is answered (with a
        version llama.cpp refuses) and the connection closed."""
        for event in self._opening.received(data):
            if isinstance(event, llamacpp.Ours):
                self._opening = None
                self.reader.feed(event.data)
            elif isinstance(event, llamacpp.Detected):
                self.log.warning(llamacpp.LOG_LINE, hint=llamacpp.HINT)
            else:  # llamacpp.Answer
                # closing stops reading (bytes already received may still come once more: then nothing is written)
                if not self.transport.is_closing():
                    self.transport.write(event.reply)
                self.abort(llamacpp.CLOSE_REASON)

    def _framing_broken(self, exc: ProtocolError) -> None:
        """A prefix past the limits (before authentication: past the pre-auth
        bound): framing can no longer be trusted. Answer and hang up."""
        self._reply(None, exc.status, exc.message)
        self.abort(exc.message)

    def header(self, h: dict | None, error: ProtocolError | None, blob_len: int):
        """FrameSink: a header is read. Where its blob goes: DISCARD (the
        request is refused: bad msgpack, rate limit, a SET_TENSOR that fails
        its checks), its SET_TENSOR destination, or memory (None)."""
        self._refused = None
        if error is not None:
            return F.DISCARD
        try:
            self._check_rate()
            buf = self._direct_destination(h, blob_len)
        except ProtocolError as exc:
            self._refused = exc
            return F.DISCARD
        if buf is None:
            return None
        return buf.view[h["offset"]: h["offset"] + blob_len]

    def hold(self) -> bool:
        """FrameSink: stop parsing after this frame (the rest is kept)."""
        return self.transport is None or self.transport.is_closing() or self._over_bounds()

    def _over_bounds(self) -> bool:
        """Too much queued: stop reading (backpressure) until the worker drains it."""
        return self.queue.qsize() > MAX_QUEUED or self._inflight > self.limits.max_inflight

    def _check_rate(self) -> None:
        if self.hello_done and not self.bucket.take():
            cfg = self.daemon.config
            raise ProtocolError(Status.LIMIT_EXCEEDED, f"request rate limit exceeded ({cfg.max_requests_per_second:g} "
                                                       f"requests/s, burst {cfg.request_burst}); slow down")

    def _direct_destination(self, h: dict, blob_len: int) -> SharedBuffer | None:
        """For a SET_TENSOR that will run next, the buffer to read its data
        into. Every field is checked first, strictly (cmd 5.0 is not
        SET_TENSOR): a request that will be refused never lands a byte."""
        if not self.hello_done or self.worker_busy or not self.queue.empty():
            return None
        if type(h.get("cmd")) is not int or h["cmd"] != Command.SET_TENSOR:
            return None
        return V.check_set_tensor(h, blob_len, self.session.buffer_of)[0]

    def frame(self, header: dict | None, error: ProtocolError | None, blob, direct: bool, header_len: int) -> None:
        """FrameSink: a frame is complete."""
        error, self._refused = error or self._refused, None
        held = header_len + (0 if direct else len(blob))  # what the queued request keeps in memory
        req_id = header.get("id") if isinstance(header, dict) else None
        if error is not None:
            self._reply(req_id, error.status, error.message)
            if error.fatal or not self.hello_done:  # before HELLO, nothing but a valid HELLO is accepted
                self.abort(error.message)
            return
        cmd = header.get("cmd")
        refused = V.admission(cmd, self.hello_done, self.session.auth is not None, self.session.auth_pending)
        if refused is not None:
            exc, why = refused
            self._reply(req_id, exc.status, exc.message)
            self.abort(why)
            return
        if type(cmd) is not int:
            cmd = None  # refused by _dispatch, in its turn: replies keep request order
        row = COMMANDS.get(cmd)
        if row is not None and row.answer_now is not None and row.answer_now(self.session):
            self._answer_now(req_id, row, header, blob)
            return
        if hoptrace.ON:
            hoptrace.mark("daemon queued")
        self.queue.put_nowait((header, blob, direct, held))
        self._queued.set()
        self._inflight += held
        if self._over_bounds() and self.transport is not None:
            self.transport.pause_reading()

    # ------------------------------------------------------------ lifecycle
    def _check_idle(self) -> None:
        if self.closed:
            return
        if self.transport is not None:
            wbuf = self.transport.get_write_buffer_size()
            if wbuf < self._wbuf:  # the client took some of its replies
                self.last_activity = time.monotonic()
            self._wbuf = wbuf
        idle = time.monotonic() - self.last_activity
        limit = self.daemon.config.idle_timeout
        if not self.hello_done:
            limit = min(limit, self.daemon.config.hello_timeout)
            # a trickle of bytes must not hold a slot: HELLO is due within hello_timeout of connecting
            idle = max(idle, time.monotonic() - self.connected_at)
        if idle > limit and ((self.queue.empty() and not self.worker_busy) or not self._can_write.is_set()):
            self.log.info("closing idle client", idle_s=round(idle, 1))
            if not self._can_write.is_set() and self.transport is not None:
                self.transport.abort()  # it does not read: flushing its replies would never end
            self.abort("idle timeout")
            return
        if self._too_slow():
            return
        self._watchdog = asyncio.get_running_loop().call_later(1.0, self._check_idle)

    def _too_slow(self) -> bool:
        """An authenticated client sending a frame slower than the floor (--min-rate over
        --min-rate-window) loses its connection, and so its --max-clients slot. Only time
        the daemon spends reading counts (not its own backpressure); before authentication
        the hello timeout bounds the whole connection instead."""
        transport = self.transport
        in_frame = (self.hello_done and self.reader.partial and not self.reader.held and transport is not None
                    and not transport.is_closing() and transport.is_reading())
        rate = self._floor.sample(time.monotonic(), self._rx_total, in_frame)
        if rate is None:
            return False
        cfg = self.daemon.config
        why = (f"sending slower than the floor: a frame in progress arrived at {rate:.0f} bytes/s over "
               f"{cfg.min_rate_window:g} s, under --min-rate {cfg.min_rate:g}")
        self.log.warning("closing slow client", rate_bytes_per_s=round(rate), min_rate=cfg.min_rate,
                         window_s=cfg.min_rate_window)
        self._reply(None, Status.LIMIT_EXCEEDED, why, quiet=True)  # (logged just above)
        self.abort(why)
        return True

    def abort(self, why: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.log.info("closing connection", reason=why)
            self.transport.close()  # flushes the last reply first...
            # ...but a peer that never reads would keep the connection forever
            asyncio.get_running_loop().call_later(5.0, self.transport.abort)

    def pause_writing(self) -> None:
        # the client does not read its replies: produce no more (no unbounded write buffer)
        self._can_write.clear()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._can_write.set()
        self._resume_reading()

    def _resume_reading(self) -> None:
        """Read again once the queue is short (under 16 requests and half the
        in-flight bound): first what was received past a full queue."""
        if self.queue.qsize() >= 16 or self._inflight > self.limits.max_inflight // 2:
            return
        if self.transport is None or self.transport.is_closing():
            return
        if not self._can_write.is_set():
            return  # the client does not read its replies: resume_writing comes back here
        if self.reader.held:
            try:
                self.reader.resume()
            except ProtocolError as exc:
                self._framing_broken(exc)
            # what it answered may have filled the write buffer (pause_writing) or the queue again
            if self.reader.held or self.transport.is_closing() or not self._can_write.is_set():
                return
        self.transport.resume_reading()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.session.steps is not None:  # a request waiting for a step input stops waiting now
            self.session.steps.mailbox.close()
            self.daemon.peer_links.unregister(self.session.steps)
        if self.session.tensor_links is not None:  # its compute process's exchanges end now
            self.session.tensor_links.close()
        if self.session.step_channel is not None:  # a client connecting its channel: refused now
            self.session.step_channel.close()
        self._can_write.set()  # a worker waiting to write wakes up and sees the connection gone
        if self.worker is not None:
            self.queue.put_nowait(None)  # the worker frees everything once in-flight work ends
            self._queued.set()
        else:
            self._release()
        self.log.info("client disconnected", error=str(exc) if exc else None)

    def _release(self) -> None:
        # drop views into client buffers (a half-read SET_TENSOR blob, queued requests)
        # so the buffers can be unmapped now
        self.reader.close()  # also breaks the reader <-> connection cycle: freed at once, not by the gc
        while not self.queue.empty():
            self.queue.get_nowait()
        self.session.graphs.clear()
        # its compute process has mapped its memory: it is killed, never handed to anyone else
        self.daemon.compute.release(self.client_id)
        held = self.daemon.buffers.arena(self.client_id) is not None
        self.daemon.buffers.release(self.client_id)  # its buffers and its arena
        self.daemon.connections.discard(self)
        if held:  # a client that held buffers (a stage) is gone: so is the heap its requests grew
            give_back_free_heap()

    async def _work(self) -> None:
        item = None
        try:
            while not self.closed:
                if item is None:
                    item = await self.queue.get()
                if item is None or self.closed:
                    return
                if not self._can_write.is_set():
                    await self._can_write.wait()
                    if self.closed:
                        return
                self._resume_reading()
                header, blob, direct, held = item
                item = None
                self.worker_busy = True
                try:
                    beside = runs_beside(header)
                    if beside is not None:  # and the request after them
                        item = await self._run_beside(beside[0], (header, blob, direct, held))
                    else:
                        try:
                            await self._dispatch(header, blob, direct)
                        finally:
                            self._inflight -= held
                finally:
                    self.worker_busy = False
                    self.last_activity = time.monotonic()
                    header = blob = None  # its memory goes now, not at the next request
                self._resume_reading()
        finally:
            item = header = blob = None  # a direct SET_TENSOR's blob is a view into its buffer
            self._release()

    async def _run_beside(self, row: CommandRow, first: tuple):
        """Requests of `row`'s command queued back to back, up to row.at_once
        at a time (SET_TENSOR_HASH: one cache entry is read while another is
        hashed, both release the GIL, so they keep two cores busy). Replies go
        out in request order; a request whose range overlaps a running one's
        waits until none runs, so every range ends as if they had run one at a
        time. Returns the request taken from the queue after them that is not
        one of them (to run next), or None."""
        running: collections.deque = collections.deque()  # (its _handle task, bytes it holds, its range)
        item, after, ended = first, None, False
        try:
            while True:
                if item is not None:
                    beside = runs_beside(item[0])
                    rng = beside[1] if beside is not None and beside[0] is row else None
                    if rng is None or any(overlap(rng, other) for _, _, other in running):
                        after = item  # in its turn, once the running ones are answered
                    else:
                        header, blob, direct, held = item
                        running.append((asyncio.ensure_future(self._handle(header, blob, direct)), held, rng))
                    item = None
                if not running:
                    return after
                task, held, _ = running[0]
                if after is None and not ended and len(running) < row.at_once:
                    if not self.queue.empty():
                        item = self.queue.get_nowait()
                        ended = item is None  # the connection's end (self.closed is set): answer what runs
                        continue
                    # the oldest one's end or the next request's arrival, whichever comes first
                    self._queued.clear()
                    arrival = asyncio.ensure_future(self._queued.wait())
                    await asyncio.wait((task, arrival), return_when=asyncio.FIRST_COMPLETED)
                    arrival.cancel()
                    if not task.done():
                        continue
                outcome = await task
                running.popleft()
                self._inflight -= held
                if not self._can_write.is_set():
                    await self._can_write.wait()
                await self._answer(outcome)
                self._resume_reading()
        finally:
            # a handler still running writes into a buffer of this connection: it ends before the
            # buffers can be released, even if this task was cancelled
            for task, held, _ in running:
                if not task.done():
                    await asyncio.wait([task])
                self._inflight -= held

    # ------------------------------------------------------------ replies
    def _reply(self, req_id, status: Status, message: str = "", blob=b"", quiet: bool = False, **fields) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if status != Status.SUCCESS and status != Status.NOT_FOUND and not quiet and self._warn_budget.take():
            self.log.warning("request refused", status=Status(status).name, error=message)
        header = P.reply_header(req_id, status, message, **fields)
        frame = F.encode_frame(header, len(blob))
        self.daemon.stats["bytes_out"] += len(frame) + len(blob)
        if hoptrace.ON:
            hoptrace.mark("daemon reply")
        if len(blob):
            # one vectored write: the frame alone would leave as its own segment and
            # wake the client once for it and once more for the blob
            self.transport.writelines([frame, blob])
        else:
            self.transport.write(frame)

    async def _dispatch(self, header: dict, blob, direct: bool) -> None:
        await self._answer(await self._handle(header, blob, direct))

    async def _handle(self, header: dict, blob, direct: bool):
        """Run one queued request's handler. Its outcome, to _answer: (id, the
        handler's result, how to send its reply), or None when already answered."""
        req_id = header.get("id")
        try:
            cmd = P.command(header)  # an int: a bool or a float is refused, not taken for a command
        except ProtocolError as exc:
            return req_id, {"status": exc.status, "error": exc.message}, self._send
        row = COMMANDS.get(cmd)
        if row is None or row.answer_now is not None:  # AUTH without a pending challenge
            return req_id, {"status": Status.UNKNOWN_COMMAND, "error": f"unknown command {cmd!r}"}, self._send
        try:
            called = await self._call(cmd, row, header, blob, direct)
        except ProtocolError as exc:
            called = {"status": exc.status, "error": exc.message, **exc.fields}, self._send
        except Exception as exc:  # a bug of ours must not take the daemon down
            self.log.exception("handler failed", cmd=cmd)
            called = {"status": Status.FAILED, "error": f"internal error: {type(exc).__name__}: {exc}"}, self._send
        return None if called is None else (req_id, *called)

    async def _call(self, cmd: int, row: CommandRow, header: dict, blob, direct: bool):
        """The handler's result and how its reply is sent (`_send`), or None
        for a request already dealt with (no reply). A test connection
        (testing/faulty_connection.py) overrides this to misbehave around the handler."""
        return await row.handler(self.session, header, blob, direct), self._send

    async def _send(self, req_id, fields: dict, out) -> None:
        """Reply with a handler's result: its fields (`status` and `error` among them set the reply's) and blob."""
        status, error = fields.pop("status", Status.SUCCESS), fields.pop("error", "")
        self._reply(req_id, status, error, out, **fields)
        if hoptrace.ON:  # a handler's reply is out (not an ack answered at once: a push may wait on it)
            hoptrace.flush()

    async def _answer(self, outcome) -> None:
        """Reply with a request's outcome (_handle's)."""
        if outcome is None:
            return
        req_id, result, send = outcome
        if isinstance(result, Deferred):
            # its reply waits for its pushes to peer workers; the connection's next request need not
            await self._deferred.acquire()
            result.start(self.daemon.peer_links)
            asyncio.get_running_loop().create_task(self._reply_deferred(req_id, result, send))
            await asyncio.sleep(0)  # the pushes write before the next request is handled (Deferred.start)
            return
        fields, out = result if isinstance(result, tuple) else (result or {}, b"")
        await send(req_id, fields, out)

    async def _reply_deferred(self, req_id, result: Deferred, send) -> None:
        try:
            fields, out = await result.finish()
            await send(req_id, fields, out)
        except Exception as exc:  # a bug of ours must not take the daemon down
            self.log.exception("forwarding failed")
            self._reply(req_id, Status.FAILED, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self._deferred.release()

    def _answer_now(self, req_id, row, header: dict, blob) -> None:
        """A command answered as soon as it is read (PING, HELLO, AUTH, STEP_INPUT): a refusal it raises
        closes the connection (STEP_INPUT returns its refusals instead)."""
        try:
            fields = row.handler(self.session, header, blob, False)
        except ProtocolError as exc:
            self._reply(req_id, exc.status, exc.message, **exc.fields)
            self.abort(exc.message)
            return
        if self.session.hello_done and not self.reader.authenticated:
            self._authenticated()
        status, error = fields.pop("status", Status.SUCCESS), fields.pop("error", "")
        self._reply(req_id, status, error, quiet=fields.pop("quiet", False), **fields)

    # ------------------------------------------------------------ helpers
    def _authenticated(self) -> None:
        """The session authenticated (HELLO, and AUTH with a secret): full frame limits, full-size receive buffer."""
        self.reader.authenticated = True  # the next prefix, even in this receive, gets the full limits
        self.reader.resize(RX_SIZE)
