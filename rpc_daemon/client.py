"""asyncio client of the worker protocol, with a deadline on everything.

No receive waits forever: connecting has a timeout, and while a request is
outstanding the client pings the daemon; if nothing at all arrives from it for
`liveness_timeout` seconds the connection is declared dead. A slow but alive
worker keeps answering pings from its event loop while it computes, so a long
compute is not mistaken for a dead peer.
"""
from __future__ import annotations

import asyncio
import itertools
import time

from rpc_daemon import protocol as P
from rpc_daemon.protocol import Command, Status
from rpc_daemon.sockets import tune_socket


class RpcError(Exception):
    """The daemon answered with an error status; the connection is still usable."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{Status(status).name if status in Status._value2member_map_ else status}: {message}")
        self.status = status
        self.message = message


class PeerFailed(Exception):
    """The connection is gone or unusable. `kind` is one of 'unreachable',
    'timeout', 'closed', 'protocol'."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


class RpcClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, endpoint: str,
                 liveness_timeout: float, ping_interval: float, limits: P.Limits):
        self.reader, self.writer, self.endpoint = reader, writer, endpoint
        self.liveness_timeout = liveness_timeout
        self.ping_interval = ping_interval
        self.limits = limits
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._failure: PeerFailed | None = None
        self.last_rx = time.monotonic()
        self.rtt: float | None = None
        self.server_hello: dict = {}
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())

    # ------------------------------------------------------------ connect
    @classmethod
    async def connect(cls, endpoint: str, connect_timeout: float = 5.0, liveness_timeout: float = 2.0,
                      ping_interval: float | None = None, limits: P.Limits = P.Limits()) -> "RpcClient":
        host, port = parse_endpoint(endpoint)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 20),
                                                    connect_timeout)
        except asyncio.TimeoutError:
            raise PeerFailed("timeout", f"worker {endpoint} did not accept a connection within {connect_timeout:g} s") from None
        except OSError as exc:
            raise PeerFailed("unreachable", f"worker {endpoint} unreachable: {exc.strerror or exc}") from None
        tune_socket(writer.get_extra_info("socket"))
        client = cls(reader, writer, endpoint, liveness_timeout, ping_interval or liveness_timeout / 4, limits)
        try:
            hello, _ = await client.request(Command.HELLO, {"version": P.PROTOCOL_VERSION,
                                                           "features": list(P.FEATURES)})
        except RpcError as exc:
            client.close()
            if exc.status == Status.VERSION_MISMATCH:
                raise PeerFailed("protocol", f"worker {endpoint} speaks another protocol version: {exc.message}") from None
            raise PeerFailed("protocol", f"worker {endpoint} refused HELLO: {exc.message}") from None
        except PeerFailed:
            client.close()
            raise
        client.server_hello = hello
        return client

    # ------------------------------------------------------------ reading
    async def _read_loop(self) -> None:
        try:
            while True:
                prefix = await self.reader.readexactly(P.PREFIX.size)
                header_len, blob_len = P.parse_prefix(prefix, self.limits)
                header = P.decode_header(await self.reader.readexactly(header_len), self.limits)
                blob = await self.reader.readexactly(blob_len) if blob_len else b""
                self.last_rx = time.monotonic()
                fut = self._pending.pop(header.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result((header, blob))
                elif header.get("id") is None and header.get("status", 0) != 0:
                    # the daemon refused something at the framing level and will hang up
                    raise PeerFailed("protocol", f"worker {self.endpoint}: {header.get('error', 'protocol error')}")
        except asyncio.IncompleteReadError:
            self._fail(PeerFailed("closed", f"worker {self.endpoint} closed the connection"))
        except (ConnectionError, OSError) as exc:
            self._fail(PeerFailed("closed", f"connection to worker {self.endpoint} lost: {exc}"))
        except P.ProtocolError as exc:
            self._fail(PeerFailed("protocol", f"worker {self.endpoint} sent a bad frame: {exc.message}"))
        except PeerFailed as exc:
            self._fail(exc)
        except asyncio.CancelledError:
            self._fail(PeerFailed("closed", f"connection to worker {self.endpoint} closed"))
            raise

    def _fail(self, failure: PeerFailed) -> None:
        if self._failure is None:
            self._failure = failure
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self._failure)
        self._pending.clear()
        self.writer.close()

    @property
    def failed(self) -> PeerFailed | None:
        return self._failure

    # ------------------------------------------------------------ requests
    def _send(self, cmd: int, fields: dict, blob) -> asyncio.Future:
        if self._failure is not None:
            raise self._failure
        req_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        header = dict(fields, cmd=int(cmd), id=req_id)
        self.writer.write(P.encode_frame(header, len(blob)))
        if len(blob):
            self.writer.write(blob)
        return fut

    async def request(self, cmd: int, fields: dict | None = None, blob=b"",
                      deadline: float | None = None) -> tuple[dict, bytes]:
        """Send one request and wait for its reply, pinging while waiting.
        Raises RpcError for an error status, PeerFailed if the peer is gone."""
        fut = self._send(cmd, fields or {}, blob)
        started = time.monotonic()
        self.last_rx = max(self.last_rx, started)
        try:
            await self._drain()
            while True:
                try:
                    header, out = await asyncio.wait_for(asyncio.shield(fut), self.ping_interval)
                    break
                except asyncio.TimeoutError:
                    now = time.monotonic()
                    if now - self.last_rx > self.liveness_timeout:
                        self._fail(PeerFailed("timeout", f"worker {self.endpoint} sent nothing for "
                                                         f"{now - self.last_rx:.1f} s (liveness bound "
                                                         f"{self.liveness_timeout:g} s)"))
                        raise self._failure from None
                    if deadline is not None and now - started > deadline:
                        self._fail(PeerFailed("timeout", f"worker {self.endpoint} did not answer within {deadline:g} s"))
                        raise self._failure from None
                    self._send(Command.PING, {}, b"")
        except asyncio.CancelledError:
            self._fail(PeerFailed("closed", "request cancelled; connection closed to keep replies in order"))
            raise
        if cmd == Command.PING:
            self.rtt = time.monotonic() - started
        status = header.get("status")
        if status not in (Status.SUCCESS,):
            raise RpcError(status if isinstance(status, int) else Status.FAILED, str(header.get("error", "")))
        return header, out

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(self.writer.drain(), max(self.liveness_timeout * 4, 10.0))
        except asyncio.TimeoutError:
            self._fail(PeerFailed("timeout", f"worker {self.endpoint} stopped reading"))
            raise self._failure from None
        except (ConnectionError, OSError) as exc:
            self._fail(PeerFailed("closed", f"connection to worker {self.endpoint} lost: {exc}"))
            raise self._failure from None

    async def ping(self) -> float:
        await self.request(Command.PING)
        return self.rtt

    def close(self) -> None:
        if self._failure is None:
            self._failure = PeerFailed("closed", f"connection to worker {self.endpoint} closed by us")
        self._reader_task.cancel()
        self.writer.close()

    async def aclose(self) -> None:
        self.close()
        try:
            await self._reader_task
        except (asyncio.CancelledError, Exception):
            pass


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"endpoint {endpoint!r} must be host:port")
    return host.strip("[]"), int(port)
