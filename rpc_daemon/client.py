# Over 400 lines: one class, RpcClient, whose transport callbacks, watchdog and request API share one state.
"""asyncio client of the worker protocol, with a deadline on everything.

No receive waits forever:

* connecting, and the HELLO exchange that follows, are bounded by
  `connect_timeout`;
* while a request is outstanding a watchdog timer pings the daemon every
  `ping_interval` seconds of silence, and declares the connection dead once
  nothing at all (no reply, no pong, no byte of a large reply, no progress in
  sending a large request) has been seen for `liveness_timeout` seconds. A
  slow but alive worker answers pings from its event loop while it computes, so
  a long compute is not mistaken for a dead peer;
* a request may carry an overall `deadline` as well.

Silence is the worker's only while this process could ask and listen: a
watchdog tick that fires late, because this process's event loop was busy (a
large step's logits checked and put side by side on it), finds the pings due
meanwhile unsent and what the worker sent still unread in the socket. Such a
tick does not declare the worker dead: the time it was late is not counted as
the worker's silence, and it looks again after the loop has read its sockets
(STALL_RECHECK).

No reply makes it allocate more than its request implies: each request
carries the most blob bytes its reply may hold (`reply_blob`: a GET_TENSOR's
size, a compute's outputs; framing.reply_blob_bound otherwise), and a reply
whose prefix claims more is refused before anything is allocated for it: the
connection fails with PeerFailed PROTOCOL.

`liveness_timeout=None` turns the pings and the liveness bound off. That exists
to measure what the mechanism costs (bench/bench_faults.py), not for use.

The watchdog is one timer per connection, armed only while requests are
pending, so a request that is answered within `ping_interval` costs no ping
and no extra task.
"""
from __future__ import annotations

import asyncio
import errno
import itertools
import os
import socket
import ssl
import time

from ggml_ffi.core import ggml_identity
from rpc_daemon.failure_kind import FailureKind
from rpc_daemon.service import hoptrace
from rpc_daemon.wire import framing as F
from rpc_daemon.wire import protocol as P
from rpc_daemon.wire import step_channel
from rpc_daemon.wire.auth import AuthFailed, ClientAuth
from rpc_daemon.wire.protocol import Command, Status
from rpc_daemon.wire.sockets import tune_socket


class RpcError(Exception):
    """The daemon answered with an error status; the connection is still usable."""

    def __init__(self, status: int, message: str, header: dict | None = None):
        super().__init__(f"{Status(status).name if status in Status._value2member_map_ else status}: {message}")
        self.status = status
        self.message = message
        self.header = header or {}  # the whole reply (e.g. the auth challenge of a pending HELLO)


class PeerFailed(Exception):
    """The connection is gone or unusable. `kind` is FailureKind.UNREACHABLE,
    TIMEOUT, CLOSED or PROTOCOL (a str enum: compares equal to the plain word)."""

    def __init__(self, kind: FailureKind, message: str, mid_reply: bool = False, how: str = ""):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.mid_reply = mid_reply  # closed with a reply partly received (a step channel's must not be sent again)
        self.how = how  # a closed connection's way of ending: "EOF" or the socket's error ("connection reset by peer")


def _oserror_text(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)  # the transport may pass any exception, not only OSError
    if code == errno.ECONNREFUSED or isinstance(exc, ConnectionRefusedError):
        return "connection refused (is the daemon running on that port?)"
    if isinstance(exc, socket.gaierror):  # its errno is a resolver code, not an errno
        return f"cannot resolve the host name ({exc.strerror or exc})"
    if isinstance(code, int):
        return os.strerror(code).lower()
    return str(exc) or type(exc).__name__


# errnos of a connection the worker's side ended (RST), as good as its EOF
_PEER_GONE = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})

# A watchdog tick this late found this process's loop busy (STALL_GRACE); it looks again this soon
# (STALL_RECHECK), after the loop's next read of its sockets, before it declares a worker silent
STALL_GRACE, STALL_RECHECK = 0.05, 0.01
KEEPALIVE_MAX = 5.0  # seconds between pings on an idle connection, at most


class RpcClient(asyncio.BufferedProtocol):
    """One connection. It is the transport's protocol: replies are cut out of
    the receive buffer in the callback that filled it (F.FrameReader) and
    handed to the waiting request directly, with no reader task in between;
    a large reply lands in its own buffer without further copies."""

    def __init__(self, endpoint: str, liveness_timeout: float | None, ping_interval: float | None,
                 limits: P.Limits):
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        if liveness_timeout is not None and liveness_timeout <= 0:
            raise ValueError("liveness_timeout must be positive (or None to disable liveness pings)")
        self.liveness_timeout = liveness_timeout
        self.ping_interval = (ping_interval or liveness_timeout / 4) if liveness_timeout is not None else None
        self.limits = limits
        self._frames = F.FrameReader(limits, blob_bound=self._reply_bound)
        self._loop = asyncio.get_running_loop()
        self._can_write = asyncio.Event()  # cleared while the transport's write buffer is over its limit
        self._can_write.set()
        self._lost = self._loop.create_future()  # done when the transport is gone
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        # id -> (the most blob bytes its reply may carry, command) of a pending request whose reply may carry any
        self._bounds: dict[int, tuple[int, int]] = {}
        self._abandoned: dict[int, int] = {}  # id -> command of a request whose caller was cancelled
        self._deadlines: dict[int, tuple[float, float]] = {}  # id -> (absolute deadline, seconds)
        self._pings: set[int] = set()
        self._failure: PeerFailed | None = None
        self._watch: asyncio.TimerHandle | None = None
        self._watch_at = 0.0  # when the armed timer is due (monotonic): a tick later than that found the loop busy
        self._watch_idle = False  # the armed timer is the idle keepalive's, not a request's
        self.keepalive_interval: float | None = None  # set from HELLO: ping an idle connection this often
        self._keepalive_at: float | None = None  # an idle keepalive ping went out then, unanswered yet
        self._keepalive_id: int | None = None
        self.on_failure = None  # called once with the PeerFailed when the connection fails (not by close())
        self._last_ping = 0.0
        self._wbuf = 0  # transport write-buffer size after our last write
        self.last_rx = time.monotonic()  # last sign of life: a byte received or sent-progress
        self.rtt: float | None = None
        self.server_hello: dict = {}
        self.frames_sent = 0  # every frame written, pings included (tests: "no network traffic")
        self.pings_sent = 0

    # ------------------------------------------------------------ connect
    @classmethod
    async def connect(cls, endpoint: str, connect_timeout: float = 5.0, liveness_timeout: float | None = 2.0,
                      ping_interval: float | None = None, limits: P.Limits = P.Limits(),
                      secret: bytes | None = None, ssl_context=None) -> "RpcClient":
        """Open a connection and exchange HELLO, all within `connect_timeout`.
        With `secret`, HELLO authenticates both sides (rpc_daemon/wire/auth.py); with
        `ssl_context` (rpc_daemon.wire.tls.client_context) the connection is TLS."""
        host, port = parse_endpoint(endpoint)
        started = time.monotonic()
        try:
            _, client = await asyncio.wait_for(
                asyncio.get_running_loop().create_connection(
                    lambda: cls(endpoint, liveness_timeout, ping_interval, limits), host, port, ssl=ssl_context),
                connect_timeout)
        except asyncio.TimeoutError:
            raise PeerFailed(FailureKind.TIMEOUT, f"worker {endpoint} unreachable: no connection within "
                                        f"{connect_timeout:g} s") from None
        except ssl.SSLError as exc:  # before OSError, its base: the worker is reachable, TLS failed
            raise PeerFailed(FailureKind.PROTOCOL, f"worker {endpoint}: TLS handshake failed: "
                                         f"{getattr(exc, 'verify_message', None) or exc.reason or exc}") from None
        except OSError as exc:
            raise PeerFailed(FailureKind.UNREACHABLE, f"worker {endpoint} unreachable: {_oserror_text(exc)}") from None
        tune_socket(client.transport.get_extra_info("socket"))
        try:
            hello = await _hello(client, secret, started + connect_timeout)
        except AuthFailed as exc:
            client.close()
            raise PeerFailed(FailureKind.PROTOCOL, f"worker {endpoint}: authentication failed: {exc}") from None
        except RpcError as exc:
            client.close()
            if exc.status == Status.NOT_AUTHORIZED:
                raise PeerFailed(FailureKind.PROTOCOL, f"worker {endpoint} refused the connection: not authorized: "
                                             f"{exc.message}") from None
            if exc.status == Status.VERSION_MISMATCH:
                raise PeerFailed(FailureKind.PROTOCOL, f"worker {endpoint} is incompatible: {exc.message}") from None
            raise PeerFailed(FailureKind.PROTOCOL, f"worker {endpoint} refused HELLO: {exc.message}") from None
        except PeerFailed as exc:
            client.close()
            if exc.kind == "timeout":
                raise PeerFailed(FailureKind.TIMEOUT, f"worker {endpoint} accepted the connection but did not answer "
                                            f"HELLO in time ({exc.message})") from None
            if exc.kind == "closed" and ssl_context is None:
                # a worker of ours answers any HELLO, even a refused one; a peer that hangs up on it speaks
                # another protocol (or TLS): say the likely one first
                raise PeerFailed(FailureKind.CLOSED, f"worker {endpoint} is probably not a ggml-distributed worker: "
                                           f"it hung up on our HELLO ({exc.how or exc.message}), as llama.cpp's rpc-server "
                                           f"(which also uses port 50052) does with clients of another protocol; "
                                           f"run ggml-distributed's ggml-rpc-server there. If it is one that serves TLS, give its CA "
                                           f"(tls_ca / --tls-ca)") from None
            raise
        except BaseException:
            client.close()
            raise
        client.server_hello = hello
        idle = hello.get("idle_timeout")
        if isinstance(idle, (int, float)) and idle > 0:
            # the worker drops a connection idle this long, and with it our buffers: keep ours
            # alive; and often enough that a worker that hangs while we are idle is noticed soon
            client.keepalive_interval = min(idle / 3, KEEPALIVE_MAX)
            client._arm()
        return client

    # ------------------------------------------------------------ transport callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._frames.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.last_rx = time.monotonic()  # every byte, a large reply's too, is a sign of life
        if hoptrace.ON and not self._frames.partial:
            hoptrace.mark("client rx")
        try:
            frames = self._frames.received(nbytes)
            for header, blob in frames:
                self._deliver(header, blob)
        except F.ReplyTooLarge as exc:
            self._fail(PeerFailed(FailureKind.PROTOCOL, self._too_large(exc)))
        except P.ProtocolError as exc:
            self._fail(PeerFailed(FailureKind.PROTOCOL, f"worker {self.endpoint} sent a bad frame ({exc.message}); "
                                              f"is it a ggml-rpc-server speaking protocol {P.PROTOCOL_VERSION}?"))
        except PeerFailed as exc:
            self._fail(exc)
        except MemoryError:
            self._fail(PeerFailed(FailureKind.PROTOCOL, f"worker {self.endpoint} sent a reply too large to hold in memory"))
        except Exception as exc:  # e.g. an unhashable reply id: the stream is not ours to trust any more
            self._fail(PeerFailed(FailureKind.PROTOCOL, f"worker {self.endpoint} sent a bad reply "
                                              f"({type(exc).__name__}: {exc})"))

    def _reply_bound(self, header: dict | None) -> int:
        """FrameReader's blob_bound: the most blob bytes the reply may carry. On
        its prefix (`header` None), any pending request's largest; once its
        header is read, the bound of the request its id names (none for any
        other id: a pong, an error frame, a reply to nothing we sent)."""
        if header is None:
            return max(self._bounds.values(), default=(0, 0))[0]
        req_id = header.get("id")
        return self._bounds.get(req_id, (0, 0))[0] if type(req_id) is int else 0

    def _too_large(self, exc: F.ReplyTooLarge) -> str:
        if exc.header is None:  # refused on its prefix: it may answer any request outstanding
            if not self._bounds:
                what = f"none of the {len(self._pending)} request(s) outstanding expects any data"
            else:
                req_id, (_, cmd) = max(self._bounds.items(), key=lambda item: item[1][0])
                what = (f"the requests outstanding imply at most {exc.bound} (the largest: "
                        f"{Command(cmd).name}, id {req_id})")
        else:
            req_id = exc.header.get("id")
            cmd = self._bounds.get(req_id, (0, None))[1]
            name = Command(cmd).name if cmd in Command._value2member_map_ else "no request of ours"
            what = f"its request (id {req_id!r}, {name}) implies at most {exc.bound}"
        return (f"worker {self.endpoint} sent a reply of {exc.blob_len} bytes of data where {what}; a lying "
                f"or broken worker: the connection is closed, nothing was allocated for that reply")

    def _deliver(self, header: dict, blob) -> None:
        req_id = header.get("id")
        if req_id is not None and type(req_id) is not int:
            raise PeerFailed(FailureKind.PROTOCOL, f"worker {self.endpoint} sent a reply with id {req_id!r}")
        fut = self._pending.pop(req_id, None)
        if fut is not None:
            self._bounds.pop(req_id, None)
            cmd = self._abandoned.pop(req_id, None)
            if cmd is not None:
                self._reclaim(cmd, header)
            elif not fut.done():
                fut.set_result((header, blob))
            if not self._pending and self._watch is not None and not self._watch_idle \
                    and self.keepalive_interval is not None:
                # the last reply is in: the idle keepalive's timer, not the request's
                # (whose next tick may be later than the worker's idle timeout)
                self._watch.cancel()
                self._watch = None
                self._arm_idle()
        elif req_id in self._pings:
            self._pings.discard(req_id)
            if req_id == self._keepalive_id:
                self._keepalive_answered()
        elif req_id is None and header.get("status", 0) != 0:
            # the daemon refused something at the framing level and will hang up
            raise PeerFailed(FailureKind.PROTOCOL, f"worker {self.endpoint} refused the connection: "
                                         f"{header.get('error', 'protocol error')}")

    def eof_received(self) -> bool:
        # fail now: closing our side waits for our write buffer to drain, which a
        # peer that stopped reading never does
        self._fail(self._closed_by_worker())
        return False

    def _closed_by_worker(self, error: BaseException | None = None) -> PeerFailed:
        where = " in the middle of a reply" if self._frames.partial else ""
        how = "EOF" if error is None else _oserror_text(error)
        said = "" if error is None else f"{how}: "
        return PeerFailed(FailureKind.CLOSED, f"worker {self.endpoint} closed the connection{where} "
                                    f"({said}crashed, killed or restarted?)", mid_reply=self._frames.partial, how=how)

    def connection_lost(self, exc) -> None:
        if exc is None:
            self._fail(self._closed_by_worker(), abort=False)
        elif getattr(exc, "errno", None) in _PEER_GONE:
            # a killed worker sends FIN, or RST when our bytes sat unread in its buffer (a ping, the
            # next request): a race, so both read the same
            self._fail(self._closed_by_worker(exc), abort=False)
        else:
            how = _oserror_text(exc)
            self._fail(PeerFailed(FailureKind.CLOSED, f"connection to worker {self.endpoint} lost: {how}", how=how),
                       abort=False)
        self._can_write.set()  # a request waiting to write wakes up and sees the failure
        if not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def _fail(self, failure: PeerFailed, abort: bool = True, by_us: bool = False) -> None:
        if self._failure is None:
            self._failure = failure
            if self.on_failure is not None and not by_us:
                self._loop.call_soon(self.on_failure, failure)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self._failure)
        self._pending.clear()
        self._bounds.clear()
        self._abandoned.clear()
        self._deadlines.clear()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if abort and self.transport is not None:  # abort, not close: close() would wait to flush what a stopped peer never reads
            self.transport.abort()

    @property
    def failed(self) -> PeerFailed | None:
        return self._failure

    def when_lost(self, callback) -> None:
        """Call `callback()` once the connection is gone (failed, or closed), at once if it is."""
        if self._failure is not None:
            self._loop.call_soon(callback)
        else:
            self._lost.add_done_callback(lambda _: callback())

    # ------------------------------------------------------------ watchdog
    def _arm(self) -> None:
        if self._failure is not None:
            return
        if self._watch is not None:
            if not (self._watch_idle and self._pending):
                return
            self._watch.cancel()  # a request went out: its liveness bound replaces the idle timer
            self._watch = None
        if not self._pending:
            self._arm_idle()
            return
        self._keepalive_at = self._keepalive_id = None  # the request's liveness bound takes over
        now = time.monotonic()
        at = float("inf")
        if self.liveness_timeout is not None:
            at = min(self.last_rx + self.liveness_timeout, max(self.last_rx, self._last_ping) + self.ping_interval)
        if self._deadlines:
            at = min(at, min(d for d, _ in self._deadlines.values()))
        if at != float("inf"):
            self._watch = self._loop.call_later(max(0.0, at - now), self._tick)
            self._watch_at, self._watch_idle = max(at, now), False

    def _arm_idle(self) -> None:
        """Nothing pending: wake for the next keepalive ping or, with one
        unanswered, to give up on it after the liveness bound."""
        if self.keepalive_interval is None:
            return
        if self._keepalive_at is None:
            at = max(self.last_rx, self._last_ping) + self.keepalive_interval
        elif self.liveness_timeout is not None:
            at = self._keepalive_at + self.liveness_timeout
        else:
            return  # the pong re-arms
        now = time.monotonic()
        self._watch = self._loop.call_later(max(0.0, at - now), self._tick)
        self._watch_at, self._watch_idle = max(at, now), True

    def _stalled(self, now: float) -> bool:
        """This tick came more than STALL_GRACE late: this process's loop was busy, so what the
        worker sent meanwhile may still be unread, and the pings due meanwhile did not go out. If
        so, the worker's silence is counted without that time (only while this process could ask
        and listen), and the tick looks again once the loop has read its sockets."""
        late = now - self._watch_at
        if late <= STALL_GRACE:
            return False
        self.last_rx = min(now, self.last_rx + late)
        self._watch = self._loop.call_later(STALL_RECHECK, self._tick)
        self._watch_at = now + STALL_RECHECK
        return True

    def _keepalive_answered(self) -> None:
        self._keepalive_at = self._keepalive_id = None
        if self._watch is not None and self._watch_idle:
            self._watch.cancel()
            self._watch = None
        self._arm()

    def _tick(self) -> None:
        self._watch = None
        if self._failure is not None:
            return
        if not self._pending:
            self._idle_tick()
            return
        now = time.monotonic()
        wbuf = self.transport.get_write_buffer_size()
        if wbuf < self._wbuf:  # the peer took some of a large request since we last looked
            self.last_rx = now
        self._wbuf = wbuf
        overdue = [seconds for deadline, seconds in self._deadlines.values() if now >= deadline]
        if overdue and self._stalled(now):  # the answer may have come in time, still unread
            return
        if overdue:
            self._fail(PeerFailed(FailureKind.TIMEOUT, f"worker {self.endpoint} timed out: no answer within "
                                             f"{min(overdue):g} s"))
            return
        if self.liveness_timeout is not None:
            silent = now - self.last_rx
            if silent >= self.liveness_timeout and self._stalled(now):
                return
            if silent >= self.liveness_timeout:
                doing = "took nothing of our request" if wbuf else "sent nothing"
                self._fail(PeerFailed(FailureKind.TIMEOUT, f"worker {self.endpoint} timed out: it {doing} for {silent:.1f} s "
                                                 f"(liveness bound {self.liveness_timeout:g} s); stopped, hung or "
                                                 f"cut off"))
                return
            if silent >= self.ping_interval and now - self._last_ping >= self.ping_interval:
                self._send_ping(now)
        self._arm()

    def _idle_tick(self) -> None:
        if self.keepalive_interval is None:  # a worker that did not say its idle timeout
            return
        now = time.monotonic()
        if self._keepalive_at is not None:
            if self.liveness_timeout is not None and now - self._keepalive_at >= self.liveness_timeout:
                if self._stalled(now):
                    return
                self._fail(PeerFailed(FailureKind.TIMEOUT, f"worker {self.endpoint} timed out: it did not answer a keepalive "
                                                 f"ping within {self.liveness_timeout:g} s while idle; stopped, "
                                                 f"hung or cut off"))
                return
        elif now - max(self.last_rx, self._last_ping) >= self.keepalive_interval:
            self._keepalive_id = self._send_ping(now)
            self._keepalive_at = now
        self._arm_idle()

    def _send_ping(self, now: float) -> int:
        req_id = next(self._ids)
        self._pings.add(req_id)
        if len(self._pings) > 64:  # pongs that never came back while other bytes did: forget old ids
            self._pings = set(sorted(self._pings)[-32:])
        self._write(F.encode_frame({"cmd": int(Command.PING), "id": req_id}, 0), b"")
        self._last_ping = now
        self.pings_sent += 1
        return req_id

    # ------------------------------------------------------------ requests
    def _write(self, frame: bytes, blob) -> None:
        if len(blob):
            self.transport.writelines([frame, blob])  # one vectored write, one segment for a small request
        else:
            self.transport.write(frame)
        self.frames_sent += 1
        self._wbuf = self.transport.get_write_buffer_size()

    def _send(self, cmd: int, fields: dict, blob, reply_blob: int = 0,
              silent_since: float | None = None) -> tuple[int, asyncio.Future]:
        """Write one request; `reply_blob`: the most blob bytes its reply may carry; `silent_since`
        (monotonic): the worker owes us an answer since then, not only since now."""
        if self._failure is not None:
            raise self._failure
        req_id = next(self._ids)
        fut = self._loop.create_future()
        if not self._pending:
            # the connection may have been quiet for long: silence counts from now, or from
            # `silent_since`, but never from more than a ping interval before this request went out
            # (this process's loop may have been busy past the time it meant to send it)
            now = time.monotonic()
            since = now if silent_since is None else silent_since
            if self.ping_interval is not None:
                since = max(since, now - self.ping_interval)
            self.last_rx = max(self.last_rx, since)
        self._pending[req_id] = fut
        if reply_blob > 0:
            self._bounds[req_id] = (reply_blob, int(cmd))
        header = dict(fields, cmd=int(cmd), id=req_id)
        self._write(F.encode_frame(header, len(blob)), blob)
        return req_id, fut

    async def request(self, cmd: int, fields: dict | None = None, blob=b"",
                      deadline: float | None = None, reply_blob: int | None = None,
                      silent_since: float | None = None) -> tuple[dict, bytes]:
        """Send one request and wait for its reply, pinging while waiting.
        Raises RpcError for an error status, PeerFailed if the peer is gone,
        timed out (liveness or `deadline` seconds), or spoke garbage (also: a
        reply whose data exceeds `reply_blob`, the most bytes the request
        implies; None: framing.reply_blob_bound's, which for a graph compute
        is `max_blob`: pass the outputs' size)."""
        started = time.monotonic()
        traced = hoptrace.ON and cmd in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE)
        if traced:
            hoptrace.mark("client send")
        fields = fields or {}
        if reply_blob is None:
            reply_blob = F.reply_blob_bound(cmd, fields, self.limits.max_blob)
        req_id, fut = self._send(cmd, fields, blob, reply_blob, silent_since)
        if deadline is not None:
            self._deadlines[req_id] = (started + deadline, deadline)
        self._arm()
        try:
            if not self._can_write.is_set():
                await self._can_write.wait()  # the peer is slow to take a large request
            if self._failure is not None and not fut.done():
                raise self._failure
            header, out = await fut
            if traced:
                hoptrace.mark("client has reply")
        except asyncio.CancelledError:
            # The frame is whole in the transport's buffer: the worker will answer it.
            # The request stays pending (the liveness watch keeps running) and its
            # reply is dropped when it comes; the connection stays up.
            if self._failure is None and req_id in self._pending:
                self._abandoned[req_id] = int(cmd)
            elif self._failure is None and fut.done() and not fut.cancelled() and fut.exception() is None:
                self._reclaim(int(cmd), fut.result()[0])  # the reply came just before the cancellation
            raise
        finally:
            self._deadlines.pop(req_id, None)
        if cmd == Command.PING:
            self.rtt = time.monotonic() - started
        status = header.get("status")
        if status != Status.SUCCESS:
            raise RpcError(status if isinstance(status, int) else Status.FAILED, str(header.get("error", "")), header)
        return header, out

    def _reclaim(self, cmd: int, header: dict) -> None:
        """The reply to an abandoned request: give back what it created."""
        buffer = header.get("buffer")
        if cmd == Command.ALLOC_BUFFER and header.get("status") == Status.SUCCESS and type(buffer) is int:
            req_id, fut = self._send(Command.FREE_BUFFER, {"buffer": buffer}, b"")
            fut.cancel()  # nobody waits for it; the reply is dropped like any abandoned one
            self._abandoned[req_id] = int(Command.FREE_BUFFER)
            self._arm()

    async def ping(self) -> float:
        await self.request(Command.PING)
        return self.rtt

    def close(self) -> None:
        flushed = not self.transport.get_write_buffer_size()
        self._fail(PeerFailed(FailureKind.CLOSED, f"connection to worker {self.endpoint} closed by us"), abort=not flushed,
                   by_us=True)
        if flushed:
            self.transport.close()

    async def aclose(self) -> None:
        self.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._lost), 1.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass


async def connect_step_channel(endpoint: str, host: str, port: int, ticket: bytes, timeout: float,
                               limits: P.Limits = P.Limits()) -> RpcClient:
    """A step channel (docs/protocol.md, "Step channels") to `endpoint`'s compute process, opened
    by its STEP_CHANNEL reply (`port`, `ticket`): connected, HELLO said and ACKed, all within
    `timeout`. It has no liveness pings (the compute process answers between steps only): its
    requests' deadlines bound it, and the connection to the daemon watches the worker."""
    loop = asyncio.get_running_loop()
    name = f"{endpoint} (step channel)"
    try:
        async with asyncio.timeout(timeout):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, addr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, addr)
                await loop.sock_sendall(sock, step_channel.pack_hello(ticket))
                if await loop.sock_recv(sock, 1) != step_channel.ACK:
                    raise PeerFailed(FailureKind.CLOSED, f"worker {name} refused the step channel")
                tune_socket(sock)
                _, client = await loop.create_connection(lambda: RpcClient(name, None, None, limits), sock=sock)
            except BaseException:
                sock.close()
                raise
    except (TimeoutError, asyncio.TimeoutError):
        raise PeerFailed(FailureKind.TIMEOUT, f"worker {name}: not open within {timeout:g} s") from None
    except OSError as exc:
        raise PeerFailed(FailureKind.UNREACHABLE, f"worker {name} unreachable: {_oserror_text(exc)}") from None
    return client


async def _hello(client: RpcClient, secret: bytes | None, deadline: float) -> dict:
    """HELLO, and with a secret the AUTH round that completes it (protocol in
    rpc_daemon/wire/auth.py). Returns the daemon's final HELLO reply."""
    state = ClientAuth(secret) if secret else None
    fields = {"version": P.PROTOCOL_VERSION, "features": list(P.FEATURES), "ggml": ggml_identity()}
    if state is not None:
        fields.update(state.hello_fields())
    try:
        hello, _ = await client.request(Command.HELLO, fields, deadline=max(0.05, deadline - time.monotonic()))
    except RpcError as exc:
        if state is None or exc.status != Status.NOT_AUTHORIZED or "auth" not in exc.header:
            raise
        answer = state.answer(exc.header)
        hello, _ = await client.request(Command.AUTH, answer, deadline=max(0.05, deadline - time.monotonic()))
    if state is not None:
        state.verify_server(hello)
    try:  # the daemon checked our op table; check its too (every protocol-2 daemon sends it)
        if "ggml" in hello:
            P.check_same_ggml(hello["ggml"], ggml_identity(), "the worker", "this client")
    except P.ProtocolError as exc:
        raise RpcError(exc.status, exc.message, hello) from None
    return hello


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    if not isinstance(endpoint, str):
        raise ValueError(f"endpoint {endpoint!r} must be a 'host:port' string")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        raise ValueError(f"endpoint {endpoint!r} must be host:port (no scheme or path), e.g. 10.0.0.2:50052")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"endpoint {endpoint!r}: port {port} is not in 1..65535")
    return host.strip("[]"), int(port)
