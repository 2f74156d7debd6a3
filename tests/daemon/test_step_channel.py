"""Step channels on a real daemon: a client's recomputes go straight to its compute
process and come back as the daemon's would; everything the daemon refuses is
refused there too; a stranger cannot take the channel; a second client takes it
back; a freed buffer or graph is never computed over it; the compute process's
death closes it at once; the computes are counted in the daemon's metrics."""
from __future__ import annotations

import os
import re
import signal
import socket
import struct
import time
import urllib.request

import numpy as np
import pytest

from conftest import SLACK, free_port
from graph_helpers import COMPUTE, F32, INPUT, OUTPUT, T, f32s
from ggml_ffi import lib
from rpc_daemon.wire.protocol import Command, Status
from rpc_daemon.wire.step_channel import ACK, pack_hello
from rpc_helpers import RawConn, assigned_pids, small_graph

pytestmark = pytest.mark.system

# x (input, 4 floats) -> y = 2x (output)
GRAPH = [T(F32, [4], flags=INPUT), T(F32, [4], op=lib.GGML_OP_SCALE, src=[0], params=f32s(2.0), flags=OUTPUT | COMPUTE)]
STEP = {"graph_id": 1, "inputs": [[0, 0, 16]], "outputs": [1]}


def floats(out: bytes):
    return list(struct.unpack("<4f", out))


def first_compute(conn: RawConn, graph=GRAPH, graph_id: int = 1):
    h, out = conn.call(Command.GRAPH_COMPUTE, dict(STEP, graph_id=graph_id, tensors=graph), f32s(1, 2, 3, 4))
    assert h["status"] == 0, h
    return out


def open_channel(conn: RawConn, ticket: bytes | None = None) -> RawConn:
    """STEP_CHANNEL on `conn`, then the channel (HELLO with the reply's ticket, or `ticket`; ACK read)."""
    h, _ = conn.call(Command.STEP_CHANNEL)
    assert h["status"] == 0 and h["granted"], h
    sock = socket.create_connection(("127.0.0.1", h["port"]), timeout=10)
    sock.sendall(pack_hello(h["ticket"] if ticket is None else ticket))
    sock.settimeout(10 * SLACK)
    ack = sock.recv(1)
    channel = RawConn.over(sock)
    channel.ack = ack
    return channel


def eventually(cond, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout * SLACK
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


@pytest.fixture
def conn(start_daemon):
    d = start_daemon("--metrics-port", str(free_port()))
    c = RawConn(d.port)
    c.hello_reply = c.hello()
    yield d, c
    c.close()


def test_a_recompute_over_the_channel_is_the_daemons(conn):
    d, c = conn
    assert "step_channel" in c.hello_reply["features"]
    by_daemon = first_compute(c)
    ch = open_channel(c)
    assert ch.ack == ACK
    for _ in range(3):
        h, out = ch.call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3, 4))
        assert h["status"] == 0 and h["outputs"] == [[1, 0, 16]] and "compute_us" in h, h
        assert out == by_daemon and floats(out) == [2, 4, 6, 8]
    h, _ = ch.call(Command.PING)
    assert h["status"] == 0
    h, out = c.call(Command.GRAPH_RECOMPUTE, STEP, f32s(5, 5, 5, 5))  # the daemon's path still works beside it
    assert h["status"] == 0 and floats(out) == [10] * 4


def test_the_channel_refuses_what_the_daemon_refuses(conn):
    d, c = conn
    first_compute(c)
    ch = open_channel(c)
    cases = [
        (Command.GRAPH_RECOMPUTE, dict(STEP, graph_id=9), f32s(1, 2, 3, 4), Status.NOT_FOUND),  # never sent
        (Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3), Status.INVALID_REQUEST),  # inputs run past the blob
        (Command.GRAPH_RECOMPUTE, dict(STEP, inputs=[[0, 0, 12]]), f32s(1, 2, 3), Status.INVALID_REQUEST),  # size
        (Command.GRAPH_RECOMPUTE, dict(STEP, inputs=[[1, 0, 16]]), f32s(1, 2, 3, 4), Status.INVALID_REQUEST),
        (Command.GRAPH_RECOMPUTE, dict(STEP, outputs=[7]), f32s(1, 2, 3, 4), Status.INVALID_REQUEST),
        (Command.GRAPH_RECOMPUTE, dict(STEP, graph_id="1"), f32s(1, 2, 3, 4), Status.INVALID_REQUEST),
        (Command.GRAPH_RECOMPUTE, dict(STEP, tensor={"link": 1, "step": 0, "exchange": [0], "timeout": 1}),
         f32s(1, 2, 3, 4), Status.INVALID_REQUEST),  # an input is not an exchange tensor
        (Command.GRAPH_RECOMPUTE, dict(STEP, step_input={"tag": 1, "token": b"0" * 16, "tensor": 0}),
         f32s(1, 2, 3, 4), Status.INVALID_REQUEST),  # step links' fields: the connection's only
        (Command.GRAPH_RECOMPUTE, dict(STEP, reply_output=True), f32s(1, 2, 3, 4), Status.INVALID_REQUEST),
        (Command.ALLOC_BUFFER, {"size": 64}, b"", Status.UNKNOWN_COMMAND),
        (Command.GRAPH_COMPUTE, dict(STEP, tensors=GRAPH), f32s(1, 2, 3, 4), Status.UNKNOWN_COMMAND),
        ("x", {}, b"", Status.INVALID_REQUEST),
        (12.0, {}, b"", Status.INVALID_REQUEST),  # no PING: an integer cmd only, as on the connection
        (True, {}, b"", Status.INVALID_REQUEST),
    ]
    for cmd, fields, blob, status in cases:
        h, _ = ch.call(cmd, fields, blob)
        assert h["status"] == status, (cmd, fields, h)
    ch.send({"cmd": int(Command.PING)})  # no id
    h, _ = ch.recv_frame()
    assert h["status"] == Status.INVALID_REQUEST, h
    h, out = ch.call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 1, 1, 1))  # and it still computes
    assert h["status"] == 0 and floats(out) == [2] * 4


@pytest.mark.parametrize("prefix", [struct.pack("<IQ", 0, 0), struct.pack("<IQ", 16, (64 << 20) + 1)],
                         ids=["empty-header", "blob-over-64MiB"])
def test_bytes_that_break_the_framing_close_the_channel_only(prefix, conn):
    d, c = conn
    first_compute(c)
    ch = open_channel(c)
    ch.send_raw(prefix)
    h, _ = ch.recv_frame()
    assert h["status"] == Status.LIMIT_EXCEEDED and h["id"] is None, h
    with pytest.raises(EOFError):
        ch.recv_frame()
    h, out = c.call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3, 4))  # the session and its process are fine
    assert h["status"] == 0 and floats(out) == [2, 4, 6, 8]
    assert d.alive()


def test_a_stranger_with_the_wrong_ticket_gets_no_channel(conn):
    d, c = conn
    first_compute(c)
    h, _ = c.call(Command.STEP_CHANNEL)
    stranger = socket.create_connection(("127.0.0.1", h["port"]), timeout=10)
    stranger.sendall(pack_hello(b"\0" * 32))
    stranger.settimeout(5 * SLACK)
    assert stranger.recv(1) == b""  # closed without an ACK
    stranger.close()
    sock = socket.create_connection(("127.0.0.1", h["port"]), timeout=10)  # the client still gets in
    sock.sendall(pack_hello(h["ticket"]))
    sock.settimeout(10 * SLACK)
    assert sock.recv(1) == ACK
    h, out = RawConn.over(sock).call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3, 4))
    assert h["status"] == 0, h
    sock.close()


def test_a_second_client_takes_the_channel_back(conn, start_daemon):
    d, a = conn
    first_compute(a)
    ch = open_channel(a)
    h, _ = ch.call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3, 4))
    assert h["status"] == 0
    b = RawConn(d.port)
    b.hello()
    assert floats(first_compute(b)) == [2, 4, 6, 8]  # its compute waits for nothing but the close
    with pytest.raises(EOFError):  # a's channel is closed: its steps go through the daemon again
        ch.call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3, 4))
    h, out = a.call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3, 4))
    assert h["status"] == 0 and floats(out) == [2, 4, 6, 8]
    h, _ = a.call(Command.STEP_CHANNEL)  # not while b computes here
    assert h["status"] == 0 and h["granted"] is False and "another client" in h["reason"], h
    b.close()
    replies = []  # granted again once b is gone (then "being opened" until that one is used)
    assert eventually(lambda: replies.append(a.call(Command.STEP_CHANNEL)[0]) or replies[-1]["granted"]
                      or "being opened" in replies[-1]["reason"])
    assert any(r["granted"] for r in replies), replies


def test_a_freed_buffer_or_graph_is_never_computed_over_the_channel(conn):
    d, c = conn
    h, _ = c.call(Command.ALLOC_BUFFER, {"size": 4096})
    assert h["status"] == 0, h
    buf = h["buffer"]
    x = np.arange(12, dtype=np.float32)
    h, _ = c.call(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": 48}, x.tobytes())
    assert h["status"] == 0, h
    _, idx, fields, yb, expect = small_graph(buf, 0, x)  # z = (x + y) * y, x in the buffer
    h, out = c.call(Command.GRAPH_COMPUTE, dict(fields, graph_id=2), yb)
    assert h["status"] == 0 and np.array_equal(np.frombuffer(out, np.float32), expect), h
    step = {"graph_id": 2, "inputs": fields["inputs"], "outputs": fields["outputs"]}
    first_compute(c)
    ch = open_channel(c)
    h, out = ch.call(Command.GRAPH_RECOMPUTE, step, yb)
    assert h["status"] == 0 and np.array_equal(np.frombuffer(out, np.float32), expect), h
    h, _ = c.call(Command.FREE_BUFFER, {"buffer": buf})
    assert h["status"] == 0
    h, _ = ch.call(Command.GRAPH_RECOMPUTE, step, yb)  # at once: no window after the free
    assert h["status"] == Status.INVALID_REQUEST and f"buffer {buf}" in h["error"], h
    h, _ = c.call(Command.GRAPH_FREE, {"graph_id": 1})
    assert h["status"] == 0
    h, _ = ch.call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3, 4))
    assert h["status"] == Status.NOT_FOUND, h


def test_the_compute_processs_death_closes_the_channel_and_the_daemon_says_why(conn):
    d, c = conn
    first_compute(c)
    ch = open_channel(c)
    os.kill(assigned_pids(d)[-1], signal.SIGKILL)
    with pytest.raises((EOFError, ConnectionError)):
        ch.call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3, 4))
    h, _ = c.call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3, 4))  # what the client sends next
    assert h["status"] == Status.FAILED and "SIGKILL" in h["error"], h
    h, out = c.call(Command.GRAPH_COMPUTE, dict(STEP, tensors=GRAPH), f32s(1, 2, 3, 4))  # a new process
    assert h["status"] == 0 and floats(out) == [2, 4, 6, 8]


def test_a_death_the_daemon_finds_by_itself_is_the_next_computes_answer(conn):
    """The compute process killed while the client is idle: the daemon's own once-a-second call
    (the channel's counts) finds it; the client's next compute hears of it, once."""
    d, c = conn
    first_compute(c)
    ch = open_channel(c)
    os.kill(assigned_pids(d)[-1], signal.SIGKILL)
    assert eventually(lambda: any("compute process lost" in line for line in d.log_lines), timeout=3.0)
    h, _ = c.call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3, 4))
    assert h["status"] == Status.FAILED and "SIGKILL" in h["error"], h
    h, out = c.call(Command.GRAPH_COMPUTE, dict(STEP, tensors=GRAPH), f32s(1, 2, 3, 4))
    assert h["status"] == 0 and floats(out) == [2, 4, 6, 8]
    ch.close()


def test_a_silent_stranger_holds_the_listener_one_second_only(conn):
    d, c = conn
    first_compute(c)
    h, _ = c.call(Command.STEP_CHANNEL)
    stranger = socket.create_connection(("127.0.0.1", h["port"]), timeout=10)  # says nothing
    time.sleep(0.1)
    started = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", h["port"]), timeout=10)
    sock.sendall(pack_hello(h["ticket"]))
    sock.settimeout(10 * SLACK)
    assert sock.recv(1) == ACK
    assert time.monotonic() - started < (1.0 + 0.5) * SLACK  # the stranger's 1 s hello bound, then ours
    stranger.close()
    sock.close()


def test_the_channels_computes_are_counted_in_the_metrics(conn):
    d, c = conn
    first_compute(c)
    ch = open_channel(c)
    for _ in range(5):
        assert ch.call(Command.GRAPH_RECOMPUTE, STEP, f32s(1, 2, 3, 4))[0]["status"] == 0

    def computes() -> float:
        port = d.args[d.args.index("--metrics-port") + 1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return float(re.search(r"^ggml_rpc_computes_total (\S+)$", text, re.M).group(1))
    assert eventually(lambda: computes() == 6, timeout=3.0), computes()  # within a second or so


def test_no_channel_with_test_faults(start_daemon):
    d = start_daemon("--test-fault", "cmd=PING,after=1000,action=close")
    c = RawConn(d.port)
    assert "step_channel" not in c.hello()["features"]
    h, _ = c.call(Command.STEP_CHANNEL)  # asked anyway
    assert h["status"] == 0 and h["granted"] is False and "test faults" in h["reason"], h
    c.close()


# ---------------------------------------------------------------- fuzzing the channel's checks

def test_whatever_a_client_sends_over_its_channel_the_compute_process_survives(conn):
    """Random GRAPH_RECOMPUTEs, other commands and refused frames over the channel
    (fuzz_protocol.channel_messages): each is answered or closes the channel; the compute
    process never dies, and the session computes right afterwards. bench/fuzz_daemon.py
    runs as many as you like (--families channel)."""
    from hypothesis import HealthCheck, given, settings
    from fuzz_protocol import ChannelFuzzer, channel_messages

    d, c = conn
    c.close()
    fuzzer = ChannelFuzzer(d)
    fuzzer.start()

    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(channel_messages())
    def case(msg):
        fuzzer.send(msg)

    try:
        case()
        fuzzer.check()
    finally:
        fuzzer.close()
