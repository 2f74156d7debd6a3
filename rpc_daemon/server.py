"""The worker daemon: asyncio connections that move bytes, and one handler per
command. Validation lives in protocol.py and graph.py; compute in compute.py.

A connection is a BufferedProtocol that only moves bytes: protocol.FrameReader
(the client's too) cuts the frames, and the connection, as its sink, says
where each blob goes, so SET_TENSOR data lands straight in the destination
shared-memory buffer once the whole request has been checked. PING is
answered as soon as it is read, even while the connection's previous request
is still computing; every other request runs in order on the connection's own
task.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import os
import resource
import time
from dataclasses import dataclass, field

import numpy as np
import structlog

from rpc_daemon import auth as A
from rpc_daemon import hoptrace
from rpc_daemon import protocol as P
from rpc_daemon import row_ids
from rpc_daemon.buffers import ALIGNMENT, BufferRegistry, SharedBuffer, arena_size_for, round_up
from rpc_daemon.compute import ComputeFailed, ComputePool
from rpc_daemon.graph import SUPPORTED_OP_NAMES, GraphSpec, parse_graph
from rpc_daemon.protocol import Command, ProtocolError, Status
from rpc_daemon.ratelimit import TokenBucket
from rpc_daemon.sockets import tune_socket
from rpc_daemon.tensor_cache import TensorCache

log = structlog.get_logger("rpc")


@dataclass
class DaemonConfig:
    host: str = "127.0.0.1"
    port: int = 50052
    threads: int = 1
    mem: int = 0  # bytes; 0 = physical memory
    metrics_port: int | None = None  # Prometheus metrics over HTTP on host:metrics_port
    cache_dir: str | None = None
    idle_timeout: float = 300.0
    hello_timeout: float = 10.0
    compute_timeout: float = 600.0
    max_clients: int = 64
    limits: P.Limits = P.Limits()
    unsafe_no_validation: bool = False  # tests only: lets graphs reach libggml unchecked
    test_faults: tuple = ()  # tests only: fault specs for rpc_daemon/faults.py (--test-fault)
    # security (docs/security.md)
    secret: bytes | None = field(default=None, repr=False)  # set: HELLO runs auth.py's challenge-response
    tls_cert: str | None = None  # set (with tls_key): TLS on the listening port
    tls_key: str | None = None
    insecure: bool = False  # a non-loopback bind without a secret, acknowledged
    max_requests_per_second: float = 2000.0  # per client, token bucket; 0 = unlimited
    request_burst: int = 4000


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory()


MAX_QUEUED = 64  # requests queued per connection before it stops reading
LARGE_GRAPH = 2048  # graphs with more tensors are validated off the event loop
RX_SIZE = 1 << 16  # receive buffer of an authenticated connection
PREAUTH_RX_SIZE = 1 << 13  # before authentication: one frame is at most 12 + max_preauth_header bytes

# Descriptors the daemon holds per connected client, whatever its buffer count: its socket,
# its arena (the memfd and the mmap's duplicate), its compute process's link, and that
# process's output area (memfd + mmap); plus 2 in passing (a tensor-cache file, a process spawn).
FDS_PER_CLIENT = 8
# and for itself: stdio, the listening socket(s), the event loop, the metrics server, the
# spare compute process's link, libraries' own
FDS_BASE = 64


def fd_client_limit(max_clients: int) -> int:
    """How many clients the open-files limit lets the daemon serve: raises the soft
    RLIMIT_NOFILE up to the hard one if `max_clients` needs it, and if even that is
    too low, says so and returns the smaller number it can serve."""
    need = FDS_BASE + max_clients * FDS_PER_CLIENT
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else hard  # headroom: all the hard limit allows
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_clients
    served = max(1, (soft - FDS_BASE) // FDS_PER_CLIENT)
    log.warning("the open-files limit cannot cover --max-clients: refusing clients past the limit it can",
                rlimit_nofile=soft, hard_limit=hard, max_clients=max_clients, effective_max_clients=served,
                fds_per_client=FDS_PER_CLIENT, fds_base=FDS_BASE,
                fix=f"raise the limit to {need} (ulimit -n, systemd LimitNOFILE=) or lower --max-clients")
    return served


class Daemon:
    """State shared by all connections."""

    def __init__(self, config: DaemonConfig):
        max_clients = fd_client_limit(config.max_clients)
        if max_clients != config.max_clients:
            config = dataclasses.replace(config, max_clients=max_clients)
        self.config = config
        mem = config.mem or physical_memory()
        self.buffers = BufferRegistry(mem, arena_size_for(config.limits.max_client_bytes or mem))
        # one compute process per client that computes (and a spare), serialized daemon-wide
        self.compute = ComputePool(config.threads, config.compute_timeout)
        self.buffers.compute_bytes = lambda: self.compute.compute_bytes
        self.compute.budget_base = lambda: self.buffers.max_bytes - self.buffers.allocated
        self.cache = TensorCache(config.cache_dir) if config.cache_dir else None
        self.connections: set[Connection] = set()
        self._ids = itertools.count(1)
        self.stats = collections.Counter()
        self.faults = None  # tests only: injected faults (rpc_daemon/faults.py), None in normal use
        if config.test_faults:
            from rpc_daemon.faults import Faults
            self.faults = Faults(list(config.test_faults), self)

    def new_client_id(self) -> int:
        return next(self._ids)

    def close(self) -> None:
        for conn in list(self.connections):
            conn.abort("daemon shutting down")
        self.compute.close()


class Connection(asyncio.BufferedProtocol):
    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.limits = daemon.config.limits
        self.client_id = daemon.new_client_id()
        self.transport: asyncio.Transport | None = None
        self.log = log
        self.hello_done = False
        self.closed = False
        self.graphs: dict[int, GraphSpec] = {}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.worker: asyncio.Task | None = None
        self.worker_busy = False
        self.last_activity = time.monotonic()
        # frames are cut by protocol.FrameReader, the client's too; this connection is its
        # sink (header, frame, hold). Before authentication a frame is at most
        # 12 + max_preauth_header bytes and no blob, so the receive buffer is small; it
        # grows to RX_SIZE once the connection is authenticated. A blob is received into
        # memory as it arrives (never allocated at the length its prefix claims), or
        # straight into its SET_TENSOR destination.
        self.reader = P.FrameReader(self.limits, PREAUTH_RX_SIZE, sink=self, authenticated=False,
                                    eager_blobs=False)
        self._refused: ProtocolError | None = None  # the refusal header() decided for the frame being read
        self._inflight = 0  # bytes of queued (and running) requests held in daemon memory: headers, blobs
        self.auth = A.ServerAuth(daemon.config.secret) if daemon.config.secret else None
        self.bucket = TokenBucket(daemon.config.max_requests_per_second, daemon.config.request_burst)
        self._warn_budget = TokenBucket(5.0, 20)  # refusals logged per client: no log flood
        self._can_write = asyncio.Event()  # cleared while the client does not read its replies
        self._can_write.set()
        self._wbuf = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.connected_at = time.monotonic()
        tune_socket(transport.get_extra_info("socket"))
        peer = transport.get_extra_info("peername")
        self.log = log.bind(peer=f"{peer[0]}:{peer[1]}" if peer else "?", client=self.client_id)
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
        return self.reader.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.daemon.stats["bytes_in"] += nbytes
        self.last_activity = time.monotonic()
        if hoptrace.ON and not self.reader.partial:
            hoptrace.mark("daemon rx")
        try:
            self.reader.received(nbytes)
        except ProtocolError as exc:
            self._framing_broken(exc)

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
            return P.DISCARD
        try:
            self._check_rate()
            buf = self._direct_destination(h, blob_len)
        except ProtocolError as exc:
            self._refused = exc
            return P.DISCARD
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
        r, _ = P.parse_set_tensor(h, blob_len)
        buf, _ = self._check_range(r)
        return buf

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
        if type(cmd) is not int:  # 0.0 or False must not pass for HELLO, 13.0 not for AUTH, 12.0 not for PING
            if not self.hello_done:
                self._reply(req_id, Status.INVALID_REQUEST, f"the first command must be HELLO (cmd {cmd!r:.40})")
                self.abort("first frame without a valid cmd")
                return
            cmd = None  # refused by _dispatch, in its turn: replies keep request order
        if cmd == Command.AUTH and self.auth is not None and self.auth.pending:
            self._auth(req_id, header)
            return
        if not self.hello_done and self.auth is not None and (cmd != Command.HELLO or self.auth.pending):
            self._reply(req_id, Status.NOT_AUTHORIZED, "not authenticated: this worker requires HELLO with "
                                                       "auth_nonce, then AUTH (a shared secret)")
            self.abort("request before authentication")
            return
        if not self.hello_done and cmd != Command.HELLO:
            self._reply(req_id, Status.INVALID_REQUEST, "the first command must be HELLO")
            self.abort("first command was not HELLO")
            return
        if cmd == Command.PING:
            self._reply(req_id, Status.SUCCESS, time=time.time())
            return
        if cmd == Command.HELLO:
            self._hello(req_id, header)
            return
        if hoptrace.ON:
            hoptrace.mark("daemon queued")
        self.queue.put_nowait((header, blob, direct, held))
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
        self._watchdog = asyncio.get_running_loop().call_later(1.0, self._check_idle)

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
        self._can_write.set()  # a worker waiting to write wakes up and sees the connection gone
        if self.worker is not None:
            self.queue.put_nowait(None)  # the worker frees everything once in-flight work ends
        else:
            self._release()
        self.log.info("client disconnected", error=str(exc) if exc else None)

    def _release(self) -> None:
        # drop views into client buffers (a half-read SET_TENSOR blob, queued requests)
        # so the buffers can be unmapped now
        self.reader.close()  # also breaks the reader <-> connection cycle: freed at once, not by the gc
        while not self.queue.empty():
            self.queue.get_nowait()
        self.graphs.clear()
        # its compute process has mapped its memory: it is killed, never handed to anyone else
        self.daemon.compute.release(self.client_id)
        self.daemon.buffers.release(self.client_id)  # its buffers and its arena
        self.daemon.connections.discard(self)

    async def _work(self) -> None:
        try:
            while True:
                item = await self.queue.get()
                if item is None or self.closed:
                    return
                if not self._can_write.is_set():
                    await self._can_write.wait()
                    if self.closed:
                        return
                self._resume_reading()
                header, blob, direct, held = item
                self.worker_busy = True
                try:
                    await self._dispatch(header, blob, direct)
                finally:
                    self.worker_busy = False
                    self.last_activity = time.monotonic()
                    item = header = blob = None  # its memory goes now, not at the next request
                    self._inflight -= held
                self._resume_reading()
        finally:
            item = header = blob = None  # a direct SET_TENSOR's blob is a view into its buffer
            self._release()

    # ------------------------------------------------------------ replies
    def _reply(self, req_id, status: Status, message: str = "", blob=b"", quiet: bool = False, **fields) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if status != Status.SUCCESS and status != Status.NOT_FOUND and not quiet and self._warn_budget.take():
            self.log.warning("request refused", status=Status(status).name, error=message)
        header = P.reply_header(req_id, status, message, **fields)
        frame = P.encode_frame(header, len(blob))
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
        req_id = header.get("id")
        try:
            cmd = P.command(header)  # an int: a bool or a float is refused, not taken for a command
        except ProtocolError as exc:
            self._reply(req_id, exc.status, exc.message)
            return
        handler = HANDLERS.get(cmd)
        if handler is None:
            self._reply(req_id, Status.UNKNOWN_COMMAND, f"unknown command {cmd!r}")
            return
        fault = self.daemon.faults.take(cmd) if self.daemon.faults is not None else None  # tests only
        if fault is not None and await fault.before(self):
            return
        try:
            result = await handler(self, header, blob, direct)
        except ProtocolError as exc:
            self._reply(req_id, exc.status, exc.message)
            return
        except Exception as exc:  # a bug of ours must not take the daemon down
            self.log.exception("handler failed", cmd=cmd)
            self._reply(req_id, Status.FAILED, f"internal error: {type(exc).__name__}: {exc}")
            return
        fields, out = result if isinstance(result, tuple) else (result or {}, b"")
        status, error = fields.pop("status", Status.SUCCESS), fields.pop("error", "")
        if fault is not None and await fault.reply(self, req_id, status, error, out, fields):  # tests only
            return
        self._reply(req_id, status, error, out, **fields)

    # ------------------------------------------------------------ helpers
    def _hello(self, req_id, header: dict) -> None:
        try:
            P.check_hello(header)
            challenge = self.auth.challenge(header) if self.auth is not None and not self.hello_done else None
        except ProtocolError as exc:
            self._reply(req_id, exc.status, exc.message, version=P.PROTOCOL_VERSION)
            self.abort(exc.message)
            return
        if challenge is not None:  # authentication pending: the next frame must be AUTH
            self._reply(req_id, Status.NOT_AUTHORIZED, "authentication required: answer the challenge with AUTH",
                        quiet=True, version=P.PROTOCOL_VERSION, auth=challenge)
            return
        self._authenticated()
        self._reply(req_id, Status.SUCCESS, version=P.PROTOCOL_VERSION, features=self.features(),
                    server="ggml-rpc-server (python)", max_blob=self.limits.max_blob,
                    idle_timeout=self.daemon.config.idle_timeout)

    def _auth(self, req_id, header: dict) -> None:
        try:
            server_proof = self.auth.verify(header)
        except ProtocolError as exc:
            self._reply(req_id, exc.status, exc.message)
            self.abort(exc.message)
            return
        self._authenticated()
        self.log.info("client authenticated")
        self._reply(req_id, Status.SUCCESS, version=P.PROTOCOL_VERSION, features=self.features(),
                    server="ggml-rpc-server (python)", max_blob=self.limits.max_blob,
                    idle_timeout=self.daemon.config.idle_timeout, proof=server_proof)

    def _authenticated(self) -> None:
        """HELLO (and AUTH with a secret) succeeded: full frame limits, full-size receive buffer."""
        if not self.hello_done:
            self.hello_done = True
            self.reader.authenticated = True  # the next prefix, even in this receive, gets the full limits
            self.reader.resize(RX_SIZE)

    def features(self) -> list[str]:
        return [f for f in P.FEATURES if f != "tensor_cache" or self.daemon.cache is not None]

    def _buffer(self, key: int) -> SharedBuffer:
        buf = self.daemon.buffers.get(self.client_id, key)
        if buf is None:
            raise ProtocolError(Status.INVALID_REQUEST, f"buffer {key} is not a buffer of this connection")
        return buf

    def _check_range(self, r: P.ByteRange) -> tuple[SharedBuffer, P.ByteRange]:
        buf = self._buffer(r.buffer)
        if r.offset + r.size > buf.size:
            raise ProtocolError(Status.INVALID_REQUEST,
                                f"range [{r.offset}, {r.offset + r.size}) runs past the end of buffer {r.buffer} "
                                f"({buf.size} bytes)")
        return buf, r

    def _buffer_size(self, key: int) -> int | None:
        buf = self.daemon.buffers.get(self.client_id, key)
        return None if buf is None else buf.size

    def graph_key(self, graph_id: int) -> str:
        return f"{self.client_id}:{graph_id}"

    def forget_graph(self, graph_id: int) -> None:
        proc = self.daemon.compute.get(self.client_id)
        if proc is not None:
            proc.forget_graph(self.graph_key(graph_id))


# ---------------------------------------------------------------- handlers
# Each takes (connection, header, blob, direct) and returns reply fields, or
# (fields, blob); errors are raised as ProtocolError.

async def handle_device_info(c: Connection, h, blob, direct):
    from ggml_ffi import lib

    reg = c.daemon.buffers
    features = [name for name in ("sse3", "ssse3", "avx", "avx2", "avx_vnni", "f16c", "fma", "avx512",
                                  "avx512_vbmi", "avx512_vnni", "avx512_bf16", "neon", "arm_fma", "fp16_va",
                                  "dotprod", "matmul_int8", "sve")
                if getattr(lib, f"ggml_cpu_has_{name}", lambda: 0)()]
    free = min(reg.max_bytes - reg.allocated - reg.compute_bytes(), available_memory())
    return {"name": "CPU", "description": cpu_model(), "total_memory": reg.max_bytes, "free_memory": max(0, free),
            "alignment": ALIGNMENT, "max_buffer_size": reg.max_bytes, "threads": c.daemon.config.threads,
            "cpu_features": features, "tensor_cache": c.daemon.cache is not None,
            "ops": SUPPORTED_OP_NAMES}  # a coordinator checks the ops its graphs need at connect


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


async def handle_alloc_buffer(c: Connection, h, blob, direct):
    size = P.field_int(h, "size", 1)
    count, held = c.daemon.buffers.held_by(c.client_id)
    if count >= c.limits.max_buffers:
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"buffer count limit {c.limits.max_buffers} reached")
    cap = c.limits.max_client_bytes
    if cap and held + round_up(size) > cap:  # buffers are whole pages, and count as such
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"cannot allocate {size} bytes ({round_up(size)} as whole "
                                                   f"pages): this client holds {held} of its {cap}-byte limit")
    await c.daemon.compute.allocations_settled()  # a graph's first compute may be taking memory right now
    buf = c.daemon.buffers.alloc(c.client_id, size)
    if buf is None:
        reg = c.daemon.buffers
        return {"status": Status.ALLOC_FAILED,
                "error": f"cannot allocate {size} bytes ({max(0, reg.max_bytes - reg.allocated - reg.compute_bytes())} "
                         f"of {reg.max_bytes} free; {reg.compute_bytes()} held by compute)"}
    return {"buffer": buf.key, "size": buf.size, "alignment": ALIGNMENT}


async def handle_free_buffer(c: Connection, h, blob, direct):
    buf = c._buffer(P.field_int(h, "buffer", 1))
    proc = c.daemon.compute.get(c.client_id)
    if proc is not None:
        proc.forget_buffer(buf.key)
    c.daemon.buffers.free(buf)  # its pages are released at once (the child's ggml buffer struct goes below)
    if proc is not None:
        proc.flush_soon()
    return {}


async def handle_buffer_clear(c: Connection, h, blob, direct):
    buf = c._buffer(P.field_int(h, "buffer", 1))
    value = P.field_int(h, "value", 0, 255, default=0)
    fill = np.frombuffer(buf.view, dtype=np.uint8)  # memset, no temporary of the buffer's size
    fill.fill(value)
    del fill
    return {}


async def handle_set_tensor(c: Connection, h, blob, direct):
    r, cache = P.parse_set_tensor(h, len(blob))  # the same checks a direct write passed before landing
    buf, r = c._check_range(r)
    dest = buf.view[r.offset: r.offset + r.size]
    if not direct:
        dest[:] = blob
    if cache and c.daemon.cache is not None:
        await asyncio.get_running_loop().run_in_executor(None, c.daemon.cache.store, dest)
    return {}


async def handle_set_tensor_hash(c: Connection, h, blob, direct):
    buf, r = c._check_range(P.parse_range(h))
    hex_digest = h.get("hash")
    if not isinstance(hex_digest, str) or len(hex_digest) != 64:
        raise ProtocolError(Status.INVALID_REQUEST, "field 'hash' must be a sha256 hex digest")
    if c.daemon.cache is None:
        return {"status": Status.NOT_FOUND, "error": "this daemon has no tensor cache"}
    dest = buf.view[r.offset: r.offset + r.size]
    try:
        ok = await asyncio.get_running_loop().run_in_executor(None, c.daemon.cache.load_into, hex_digest, dest)
    except ValueError as exc:
        raise ProtocolError(Status.INVALID_REQUEST, str(exc)) from None
    if not ok:
        return {"status": Status.NOT_FOUND, "error": "content not in the tensor cache"}
    return {}


async def handle_get_tensor(c: Connection, h, blob, direct):
    buf, r = c._check_range(P.parse_range(h))
    if r.size > c.limits.max_blob:
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"GET_TENSOR of {r.size} bytes exceeds max_blob "
                                                   f"{c.limits.max_blob}; read it in parts")
    return {}, bytes(buf.view[r.offset: r.offset + r.size])


async def handle_copy_tensor(c: Connection, h, blob, direct):
    src, rs = c._check_range(P.parse_range(h, "src_"))
    dst, rd = c._check_range(P.parse_range(h))
    dst.view[rd.offset: rd.offset + rd.size] = src.view[rs.offset: rs.offset + rs.size]
    return {}


def _input_blob(c: Connection, spec: GraphSpec, h: dict, blob) -> tuple[list, object]:
    inputs = P.parse_inputs(h, len(blob), len(spec.tensors))
    given = {i.tensor for i in inputs}
    for i in inputs:
        t = spec.tensors[i.tensor]
        if i.tensor not in spec.inputs:
            raise ProtocolError(Status.INVALID_REQUEST, f"inputs: tensor {i.tensor} is not an input leaf of the graph")
        if i.size != t.nbytes:
            raise ProtocolError(Status.INVALID_REQUEST,
                                f"inputs: tensor {i.tensor} ({t.name!r}) needs {t.nbytes} bytes, got {i.size}")
    missing = [i for i in spec.inputs if i not in given]
    if missing and not c.daemon.config.unsafe_no_validation:
        t = spec.tensors[missing[0]]
        raise ProtocolError(Status.INVALID_REQUEST, f"inputs: no data for input tensor {t.index} ({t.name!r})")
    return [(i.tensor, i.blob_offset, i.size) for i in inputs], blob


def _check_run(c: Connection, spec: GraphSpec, h: dict, blob) -> tuple[list, list, object, dict]:
    """Everything a compute of `spec` with this request's inputs and outputs
    needs checked, before it has any effect: (inputs, outputs, blob, buffers)."""
    if hoptrace.ON:
        hoptrace.mark("daemon handler")
    inputs, blob = _input_blob(c, spec, h, blob)
    row_ids.check_inputs(spec.row_groups, spec.tensors, inputs, blob)  # GET_ROWS/SET_ROWS ids in range
    outputs = P.parse_outputs(h, len(spec.tensors))
    unreadable = [i for i in outputs if spec.readable is not None and i not in spec.readable]
    if unreadable:
        raise ProtocolError(Status.INVALID_REQUEST, f"outputs: tensor {unreadable[0]} has no memory after "
                                                    "compute (a leaf no node uses)")
    reply_bytes = sum(spec.tensors[i].nbytes for i in outputs)
    if reply_bytes > c.limits.max_blob:  # the reply is a frame too: max_blob bounds it as it does GET_TENSOR's
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"outputs: {reply_bytes} bytes exceed max_blob "
                                                   f"{c.limits.max_blob}; read large tensors with GET_TENSOR")
    bufs = {}
    for key in spec.buffers:
        buf = c._buffer(key)
        bufs[key] = (buf.offset, buf.size)
    return inputs, outputs, blob, bufs


async def _run_graph(c: Connection, graph_id, spec: GraphSpec, checked):
    inputs, outputs, blob, bufs = checked
    arena = c.daemon.buffers.arena(c.client_id)
    key = c.graph_key(graph_id)
    if hoptrace.ON:
        hoptrace.mark("daemon validated")
    try:
        # the client's own compute process: only its arena is mapped there
        reply, out = await c.daemon.compute.for_client(c.client_id).call(
            {"kind": "compute", "graph_key": key, "inputs": inputs, "outputs": outputs}, blob, bufs, spec,
            out_size=sum(spec.tensors[i].nbytes for i in outputs),
            client_arena=(arena.size, arena.fd) if arena is not None else None)
    except ComputeFailed as exc:
        c.daemon.stats["compute_restarts"] += 1
        return {"status": Status.FAILED, "error": str(exc)}
    c.daemon.stats["computes"] += 1
    c.daemon.stats["compute_us"] += reply.get("compute_us", 0)
    if reply["status"] != 0:
        c.daemon.stats["compute_errors"] += 1
        return {"status": reply["status"], "error": reply.get("error", "compute failed")}
    return {"outputs": reply["outputs"], "compute_us": reply.get("compute_us", 0)}, out


async def handle_graph_compute(c: Connection, h, blob, direct):
    graph_id = P.field_int(h, "graph_id", 0, default=0)
    if c.daemon.config.unsafe_no_validation:
        from rpc_daemon.graph import parse_unchecked
        spec = parse_unchecked(h, c._buffer_size)
    elif len(h.get("tensors") or ()) > LARGE_GRAPH:
        # pure Python over tens of thousands of tensors: in a thread, so the loop keeps
        # answering every other client (it gets the GIL back every few milliseconds)
        spec = await asyncio.get_running_loop().run_in_executor(None, parse_graph, h, c.limits, c._buffer_size)
    else:
        spec = parse_graph(h, c.limits, c._buffer_size)
    if graph_id and graph_id not in c.graphs and len(c.graphs) >= c.limits.max_graphs:
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"cached graph limit {c.limits.max_graphs} reached; free one")
    cached = sum(len(g.tensors) for gid, g in c.graphs.items() if gid != graph_id) + len(spec.tensors)
    if graph_id and cached > c.limits.max_cached_tensors:
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"cached graphs would hold {cached} tensors, limit "
                                                   f"{c.limits.max_cached_tensors}; free one")
    checked = _check_run(c, spec, h, blob)  # a refused request must not replace the graph cached under its id
    if graph_id:
        c.graphs[graph_id] = spec
    else:
        graph_id = -1  # one-off graph: cached in the compute process under a throwaway key
    c.forget_graph(graph_id)
    return await _run_graph(c, graph_id, spec, checked)


async def handle_graph_recompute(c: Connection, h, blob, direct):
    graph_id = P.field_int(h, "graph_id", 1)
    spec = c.graphs.get(graph_id)
    if spec is None:
        return {"status": Status.NOT_FOUND, "error": f"graph {graph_id} is not cached; send it with GRAPH_COMPUTE"}
    for key in spec.buffers:  # a buffer may have been freed since the graph was sent
        c._buffer(key)
    return await _run_graph(c, graph_id, spec, _check_run(c, spec, h, blob))


async def handle_graph_free(c: Connection, h, blob, direct):
    graph_id = P.field_int(h, "graph_id", 1)
    if c.graphs.pop(graph_id, None) is not None:
        c.forget_graph(graph_id)
        proc = c.daemon.compute.get(c.client_id)
        if proc is not None:
            proc.flush_soon()  # its compute memory is returned (and counted free) now, not at the next compute
    return {}


HANDLERS = {
    Command.DEVICE_INFO: handle_device_info,
    Command.ALLOC_BUFFER: handle_alloc_buffer,
    Command.FREE_BUFFER: handle_free_buffer,
    Command.BUFFER_CLEAR: handle_buffer_clear,
    Command.SET_TENSOR: handle_set_tensor,
    Command.GET_TENSOR: handle_get_tensor,
    Command.COPY_TENSOR: handle_copy_tensor,
    Command.SET_TENSOR_HASH: handle_set_tensor_hash,
    Command.GRAPH_COMPUTE: handle_graph_compute,
    Command.GRAPH_RECOMPUTE: handle_graph_recompute,
    Command.GRAPH_FREE: handle_graph_free,
}
