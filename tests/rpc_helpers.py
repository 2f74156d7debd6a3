"""Helpers shared by the daemon tests: a raw-socket frame client with timeouts,
a small reference graph, and the "is a normal client still served" check."""
from __future__ import annotations

import asyncio
import os
import re
import socket
import time
import urllib.request

import numpy as np

from conftest import SLACK
from ggml_ffi import Context, lib
from rpc_daemon.wire import framing as F
from rpc_daemon.wire import protocol as P
from rpc_daemon.client import RpcClient, RpcError
from rpc_daemon.wire.graph_codec import encode_graph
from rpc_daemon.wire.protocol import Command, Status

RECV_TIMEOUT = 10.0
SECRET = b"correct horse battery staple 0123456789"  # the shared secret of the tests' daemons


def rss(pid: int) -> int:
    """Resident set size of process `pid`, bytes (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def open_memfds(pid: int) -> int:
    """Client buffers (memfds) the daemon process `pid` still holds open."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += "ggml-rpc-" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return n


def assigned_pids(d) -> list[int]:
    """Compute processes a daemon (a conftest DaemonProcess) handed to a client, from its log
    (each client computes in its own), in order."""
    return [int(m.group(1)) for line in d.log_lines
            if "compute process assigned" in line and (m := re.search(r"pid=(\d+)", line))]


# ---------------------------------------------------------------- raw frames

def encode_prefix(header_len: int, blob_len: int) -> bytes:
    """A frame prefix alone, lengths as given (true or not)."""
    return F.PREFIX.pack(header_len, blob_len)


class RawConn:
    """A blocking socket that speaks frames; every receive has a timeout."""

    def __init__(self, endpoint_port: int, timeout: float = RECV_TIMEOUT):
        self.sock = socket.create_connection(("127.0.0.1", endpoint_port), timeout=timeout)
        self.sock.settimeout(timeout)
        self._ids = 0

    @classmethod
    def over(cls, sock: socket.socket, timeout: float = RECV_TIMEOUT) -> "RawConn":
        """A RawConn on a socket already connected (a step channel's)."""
        conn = cls.__new__(cls)
        conn.sock = sock
        conn.sock.settimeout(timeout)
        conn._ids = 0
        return conn

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, header: dict, blob: bytes = b"") -> None:
        self.sock.sendall(F.encode_frame(header, len(blob)) + bytes(blob))

    def request(self, cmd: int, fields: dict | None = None, blob: bytes = b"") -> int:
        """Send one request; returns its id."""
        self._ids += 1
        self.send(dict(fields or {}, cmd=int(cmd) if isinstance(cmd, Command) else cmd, id=self._ids), blob)
        return self._ids

    def _recv_exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError(f"peer closed after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def recv_frame(self) -> tuple[dict, bytes]:
        """One reply frame. Raises EOFError if the daemon closed, socket.timeout
        if nothing arrived in time."""
        header_len, blob_len = F.parse_prefix(self._recv_exactly(F.PREFIX.size), P.Limits())
        header = F.decode_header(self._recv_exactly(header_len), P.Limits())
        blob = self._recv_exactly(blob_len) if blob_len else b""
        return header, blob

    def call(self, cmd: int, fields: dict | None = None, blob: bytes = b"") -> tuple[dict, bytes]:
        req_id = self.request(cmd, fields, blob)
        header, out = self.recv_frame()
        assert header.get("id") == req_id, header
        return header, out

    def hello(self) -> dict:
        header, _ = self.call(Command.HELLO, {"version": P.PROTOCOL_VERSION})
        assert header["status"] == Status.SUCCESS, header
        return header

    def wait_closed(self, timeout: float = 5.0) -> list[dict]:
        """Read until the daemon closes the connection; returns the frames read.
        Fails if it is still open after `timeout` seconds (times SLACK)."""
        frames = []
        timeout *= SLACK
        deadline = time.monotonic() + timeout
        self.sock.settimeout(timeout)
        while time.monotonic() < deadline:
            try:
                frames.append(self.recv_frame()[0])
            except (EOFError, ConnectionResetError, BrokenPipeError):
                return frames
            except socket.timeout:
                break
        raise AssertionError(f"daemon did not close the connection within {timeout} s (got {frames})")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def raw_session(d) -> RawConn:
    """A raw connection to daemon `d` that has said HELLO."""
    conn = RawConn(d.port)
    conn.hello()
    return conn


# ---------------------------------------------------------------- graphs

def small_graph(buf: int, offset: int = 0, x_data=None, y_data=None):
    """z = (x + y) * y on f32 [4, 3]: x lives in client buffer `buf` at `offset`,
    y is an inline input. Returns (wire tensors, {name: index}, request fields,
    input blob, expected z)."""
    x_data = np.arange(12, dtype=np.float32) if x_data is None else x_data
    y_data = np.full(12, 2, np.float32) if y_data is None else y_data
    ctx = Context(16)
    try:
        x = ctx.new_tensor(lib.GGML_TYPE_F32, [4, 3], "x")
        y = ctx.new_tensor(lib.GGML_TYPE_F32, [4, 3], "y")
        lib.ggml_set_input(y)
        s = lib.ggml_add(ctx.ptr, x, y)
        z = lib.ggml_mul(ctx.ptr, s, y)
        lib.ggml_set_output(z)
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, z)
        tensors, index_of = encode_graph(gf, lambda t: (buf, offset) if t == x else None)
        idx = {"x": index_of[x], "y": index_of[y], "s": index_of[s], "z": index_of[z]}
    finally:
        ctx.close()
    yb = y_data.tobytes()
    fields = {"tensors": tensors, "inputs": [[idx["y"], 0, len(yb)]], "outputs": [idx["z"]]}
    return tensors, idx, fields, yb, (x_data + y_data) * y_data


async def check_compute(c: RpcClient, buf: int, offset: int, x_data: np.ndarray, graph_id: int = 0) -> None:
    """Run the small graph on data `x_data` already at (buf, offset); check the numbers."""
    y_data = np.linspace(-1, 1, 12, dtype=np.float32)
    _, idx, fields, yb, expect = small_graph(buf, offset, x_data, y_data)
    h, out = await c.request(Command.GRAPH_COMPUTE, dict(fields, graph_id=graph_id), yb)
    assert h["status"] == Status.SUCCESS
    assert h["outputs"] == [[idx["z"], 0, 48]]
    np.testing.assert_array_equal(np.frombuffer(out, np.float32), expect)


async def checked_session(c: RpcClient, seed: int = 0) -> None:
    """On an open client: ALLOC_BUFFER, SET/GET round trip, a small GRAPH_COMPUTE, FREE; all checked."""
    h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 4096})
    buf = h["buffer"]
    assert h["size"] == 4096
    data = (np.arange(12, dtype=np.float32) + seed).astype(np.float32)
    await c.request(Command.SET_TENSOR, {"buffer": buf, "offset": 128, "size": 48}, data.tobytes())
    _, out = await c.request(Command.GET_TENSOR, {"buffer": buf, "offset": 128, "size": 48})
    assert out == data.tobytes()
    await check_compute(c, buf, 128, data)
    await c.request(Command.FREE_BUFFER, {"buffer": buf})


async def normal_session(endpoint: str, seed: int = 0) -> None:
    """HELLO, then checked_session."""
    c = await RpcClient.connect(endpoint, liveness_timeout=10.0)
    try:
        assert c.server_hello["status"] == Status.SUCCESS and c.server_hello["version"] == P.PROTOCOL_VERSION
        await checked_session(c, seed)
    finally:
        await c.aclose()


async def with_buffer(endpoint: str, body, size: int = 4096):
    """`await body(client, buffer)` on a new connection holding one fresh buffer of
    `size` bytes; the connection is closed after, whatever happens."""
    c = await RpcClient.connect(endpoint)
    try:
        h, _ = await c.request(Command.ALLOC_BUFFER, {"size": size})
        return await body(c, h["buffer"])
    finally:
        await c.aclose()


def assert_served(d, seed: int = 0, timeout: float = 30.0) -> None:
    """The daemon process is alive and a normal client gets correct answers."""
    assert d.alive(), "daemon died:\n" + "".join(d.log_lines[-30:])
    asyncio.run(asyncio.wait_for(normal_session(d.endpoint, seed), timeout))
    assert d.alive(), "daemon died:\n" + "".join(d.log_lines[-30:])


async def expect_error(coro, status: Status, *fragments: str) -> str:
    """Await an RpcClient request that must fail with `status`; the error
    message must contain every fragment."""
    try:
        await coro
    except RpcError as exc:
        assert exc.status == status, f"expected {status.name}, got {exc}"
        for f in fragments:
            assert f in exc.message, f"{f!r} not in {exc.message!r}"
        return exc.message
    raise AssertionError(f"request succeeded, expected {status.name}")


N = 1024


def chain_graph(buf: int, steps: int):
    """x_{k+1} = mul_mat(a, x_k), `steps` times: a f32 [N, N] at 0, x_0 f32 [N, N]
    right after it in `buf`: a graph that computes long enough to test what
    happens during a compute. Returns (wire tensors, index of the result)."""
    ctx = Context(steps + 8)
    try:
        a = ctx.new_tensor(lib.GGML_TYPE_F32, [N, N], "a")
        x0 = ctx.new_tensor(lib.GGML_TYPE_F32, [N, N], "x0")
        x = x0
        for _ in range(steps):
            x = lib.ggml_mul_mat(ctx.ptr, a, x)
        lib.ggml_set_output(x)
        gf = ctx.new_graph(steps + 8)
        lib.ggml_build_forward_expand(gf, x)
        place = {a: (buf, 0), x0: (buf, N * N * 4)}
        tensors, idx = encode_graph(gf, lambda t: place.get(t))
        return tensors, idx[x]
    finally:
        ctx.close()


def metric(metrics_port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] == name)


def bytes_in(metrics_port: int) -> float:
    return metric(metrics_port, "ggml_rpc_bytes_in_total")


# ---------------------------------------------------------------- a scripted worker

class FakeWorker:
    """A scripted worker on 127.0.0.1: a real listening socket served by a
    thread, one connection at a time. It answers HELLO as a protocol-2 daemon
    without a secret does, PING at once, and every other request with
    `answer(header, blob)`: a dict (the reply's fields, status SUCCESS unless
    they say otherwise, no blob), raw bytes (written as they are: a lie), or
    None (no answer). The default answers like a daemon with no tensor cache
    and room for anything (DEVICE_INFO lists every op, ALLOC_BUFFER hands out
    buffers, the rest succeed with no data). `requests` records every request
    header after HELLO, PINGs excepted."""

    def __init__(self, answer=None, ops=()):
        import threading
        self.answer = answer or self.default_answer
        self.ops = list(ops)
        self.requests: list[dict] = []
        self._buffers = 0
        self._stop = threading.Event()
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(4)
        self.lsock.settimeout(0.2)
        self.endpoint = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def default_answer(self, h: dict, blob: bytes):
        cmd = h.get("cmd")
        if cmd == Command.DEVICE_INFO:
            return {"name": "CPU", "free_memory": 1 << 34, "total_memory": 1 << 34, "alignment": 64,
                    "threads": 1, "tensor_cache": False, "ops": self.ops}
        if cmd == Command.ALLOC_BUFFER:
            self._buffers += 1
            return {"buffer": self._buffers, "size": h["size"], "alignment": 64}
        return {}

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                s, _ = self.lsock.accept()
            except OSError:
                continue
            try:
                self._client(s)
            except OSError:
                pass
            finally:
                s.close()

    def _client(self, s: socket.socket) -> None:
        s.settimeout(0.2)
        pending = b""

        def take(n: int) -> bytes:
            nonlocal pending
            while len(pending) < n:
                try:
                    chunk = s.recv(1 << 20)
                except TimeoutError:
                    if self._stop.is_set():
                        raise OSError("stopped")
                    continue
                if not chunk:
                    raise OSError("closed")
                pending += chunk
            out, pending = pending[:n], pending[n:]
            return out

        while True:
            header_len, blob_len = F.PREFIX.unpack(take(F.PREFIX.size))
            h = F.decode_header(take(header_len), P.Limits())
            blob = take(blob_len)
            if h.get("cmd") == Command.HELLO:
                reply = {"version": P.PROTOCOL_VERSION, "features": [], "server": "fake", "max_blob": 1 << 30,
                         "idle_timeout": 300}
            elif h.get("cmd") == Command.PING:
                reply = {"time": time.time()}
            else:
                self.requests.append(h)
                reply = self.answer(h, blob)
            if reply is None:
                continue
            if isinstance(reply, (bytes, bytearray)):
                s.sendall(reply)
                continue
            reply = dict(reply)
            status, error = reply.pop("status", Status.SUCCESS), reply.pop("error", "")
            s.sendall(F.encode_frame(P.reply_header(h.get("id"), status, error, **reply)))

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.lsock.close()


def feed_reader(reader: F.FrameReader, data: bytes, step: int, first: int | None = None) -> list:
    """`data` into a sans-I/O FrameReader, at most `first` (default `step`) bytes in the first
    receive, then at most `step` bytes a receive; the frames it gave."""
    got, pos, size = [], 0, step if first is None else first
    while pos < len(data):
        buf = reader.buffer()
        n = min(len(buf), len(data) - pos, size)
        buf[:n] = data[pos: pos + n]
        pos += n
        got += reader.received(n)
        size = step
    return got
