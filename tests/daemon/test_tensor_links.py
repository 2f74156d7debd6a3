"""Tensor links between two real daemons: linked, each compute's marked tensor is
summed with the peer's partial, worker to worker; a stranger cannot join; a peer
that dies or a TENSOR_CANCEL ends the wait at once; a link out of step is dropped."""
from __future__ import annotations

import os
import signal
import struct
import threading
import time

import pytest

from conftest import SLACK
from graph_helpers import COMPUTE, F32, INPUT, OUTPUT, T, f32s
from ggml_ffi import lib
from rpc_daemon.wire.protocol import Command, Status
from rpc_daemon.wire.tensor_frames import pack_hello
from rpc_helpers import RawConn

pytestmark = pytest.mark.system


def both(fn_a, fn_b):
    """Run two blocking calls at once (each waits for the other's side)."""
    out = {}
    t = threading.Thread(target=lambda: out.__setitem__("b", fn_b()))
    t.start()
    out["a"] = fn_a()
    t.join(30)
    return out["a"], out["b"]


def link(a: RawConn, b: RawConn, port_b_daemon: int, link_id: int = 7):
    """Rank 0 on `a`, rank 1 on `b` (b connects to a's listener)."""
    ha, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": link_id})
    hb, _ = b.call(Command.TENSOR_LINK, {"op": "listen", "link": link_id})
    assert ha["status"] == 0 and hb["status"] == 0, (ha, hb)
    ra, rb = both(lambda: a.call(Command.TENSOR_LINK, {"op": "join", "link": link_id, "rank": 0, "n": 2})[0],
                  lambda: b.call(Command.TENSOR_LINK, {"op": "join", "link": link_id, "rank": 1, "n": 2, "peers": [
                      {"rank": 0, "host": "127.0.0.1", "port": ha["port"], "ticket": ha["ticket"]}]})[0])
    return ha, ra, rb


# x (input, 4 floats) -> y = 2x (exchanged: summed over the group) -> z = y + y (output)
GRAPH = [T(F32, [4], flags=INPUT),
         T(F32, [4], op=lib.GGML_OP_SCALE, src=[0], params=f32s(2.0), flags=COMPUTE),
         T(F32, [4], op=lib.GGML_OP_ADD, src=[1, 1], flags=OUTPUT | COMPUTE)]


def compute(conn: RawConn, x, step: int, link_id: int = 7, timeout: float = 30.0, graph=GRAPH, exchange=(1,)):
    fields = {"tensors": graph, "inputs": [[0, 0, 16]], "outputs": [2],
              "tensor": {"link": link_id, "step": step, "exchange": list(exchange), "timeout": timeout}}
    return conn.call(Command.GRAPH_COMPUTE, fields, f32s(*x))


def floats(out: bytes):
    return list(struct.unpack("<4f", out))


@pytest.fixture
def pair(start_daemon):
    da, db = start_daemon(), start_daemon()
    a, b = RawConn(da.port), RawConn(db.port)
    a.hello_reply = a.hello()
    b.hello()
    yield da, db, a, b
    a.close()
    b.close()


def test_all_reduce_sums_the_partials_on_both_members(pair):
    da, db, a, b = pair
    assert "tensor_links" in a.hello_reply["features"]
    _, ra, rb = link(a, b, db.port)
    assert ra["status"] == 0 and rb["status"] == 0, (ra, rb)
    for step in range(3):  # several steps over the same link
        (ha, oa), (hb, ob) = both(lambda: compute(a, [1, 2, 3, 4], step), lambda: compute(b, [10, 20, 30, 40], step))
        assert ha["status"] == 0 and hb["status"] == 0, (ha, hb)
        want = [2 * (2 * (p + q)) for p, q in zip([1, 2, 3, 4], [10, 20, 30, 40])]
        assert floats(oa) == floats(ob) == want
        assert "exchange_us" in ha


def test_a_stranger_with_the_wrong_ticket_is_not_linked(pair):
    da, db, a, b = pair
    ha, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": 3})
    import socket
    s = socket.create_connection(("127.0.0.1", ha["port"]))
    s.sendall(pack_hello(3, 1, b"\0" * 32))
    s.settimeout(5)
    # the listener drops it without an ACK; the join then times out, saying so
    h, _ = a.call(Command.TENSOR_LINK, {"op": "join", "link": 3, "rank": 0, "n": 2, "timeout": 1.0})
    assert h["status"] == Status.LINK_FAILED and "not linked with rank(s) [1] within 1 s" in h["error"], h
    assert "cancelled" not in h  # timed out: this member's own failure
    assert s.recv(1) == b""
    s.close()


def test_a_silent_stranger_does_not_hold_up_the_members(pair):
    """Connections that say nothing (or half a HELLO) are vetted beside the real peer's,
    each within its own hello deadline: the join links the member at once."""
    import socket
    da, db, a, b = pair
    ha, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": 4})
    hb, _ = b.call(Command.TENSOR_LINK, {"op": "listen", "link": 4})
    silent = [socket.create_connection(("127.0.0.1", ha["port"])) for _ in range(8)]
    half = socket.create_connection(("127.0.0.1", ha["port"]))
    half.sendall(pack_hello(4, 1, ha["ticket"])[:20])
    try:
        # before, the listener read the first connection's HELLO until the join's own deadline; one
        # at a time with 1 s each, the 9 ahead of the member would outlast the join's 5 s too
        ra, rb = both(lambda: a.call(Command.TENSOR_LINK, {"op": "join", "link": 4, "rank": 0, "n": 2,
                                                           "timeout": 5})[0],
                      lambda: b.call(Command.TENSOR_LINK, {"op": "join", "link": 4, "rank": 1, "n": 2, "peers": [
                          {"rank": 0, "host": "127.0.0.1", "port": ha["port"], "ticket": ha["ticket"]}]})[0])
        assert ra["status"] == 0 and rb["status"] == 0, (ra, rb)
        (h0, o0), (h1, o1) = both(lambda: compute(a, [1, 2, 3, 4], 0, link_id=4),
                                  lambda: compute(b, [1, 1, 1, 1], 0, link_id=4))
        assert h0["status"] == h1["status"] == 0 and floats(o0) == floats(o1) == [8, 12, 16, 20], (h0, h1)
        for s in (*silent, half):  # each closed unanswered after its hello deadline
            s.settimeout(10)
            assert s.recv(1) == b""
    finally:
        for s in (*silent, half):
            s.close()


def test_a_tensor_cancel_naming_no_link_is_refused_and_the_connection_kept(pair):
    da, db, a, b = pair
    for bad in ("7", 0, -1, 1.5, True):
        h, _ = a.call(Command.TENSOR_CANCEL, {"link": bad})
        assert h["status"] == Status.INVALID_REQUEST and "'link'" in h["error"], (bad, h)
    h, _ = a.call(Command.TENSOR_CANCEL, {})  # no link: whatever the session has (here none)
    assert h["status"] == 0
    h, _ = a.call(Command.PING)
    assert h["status"] == 0


def test_compute_without_a_link_is_link_failed_not_a_crash(pair):
    da, db, a, b = pair
    h, _ = compute(a, [1, 2, 3, 4], 0, link_id=99)
    assert h["status"] == Status.LINK_FAILED and "not set up" in h["error"], h
    h, _ = a.call(Command.PING)
    assert h["status"] == 0


def test_bad_exchange_tensors_are_refused(pair):
    da, db, a, b = pair
    h, _ = compute(a, [1, 2, 3, 4], 0, exchange=(0,))  # an input, not a computed node
    assert h["status"] == Status.INVALID_REQUEST and "computed node" in h["error"], h
    h, _ = compute(a, [1, 2, 3, 4], 0, exchange=(5,))
    assert h["status"] == Status.INVALID_REQUEST, h


def test_a_killed_peer_ends_the_wait_at_once(pair):
    da, db, a, b = pair
    link(a, b, db.port)
    started = time.monotonic()
    threading.Timer(0.5, db.kill).start()  # b never computes: a waits on the exchange until b dies
    h, _ = compute(a, [1, 2, 3, 4], 0, timeout=60)
    assert h["status"] == Status.LINK_FAILED and "rank 1" in h["error"], h
    assert time.monotonic() - started < 0.5 + 2 * SLACK


def test_tensor_cancel_ends_the_wait_of_a_stopped_peer(pair):
    da, db, a, b = pair
    link(a, b, db.port)
    db.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        a.request(Command.GRAPH_COMPUTE, {"tensors": GRAPH, "inputs": [[0, 0, 16]], "outputs": [2],
                                          "tensor": {"link": 7, "step": 0, "exchange": [1], "timeout": 60}},
                  f32s(1, 2, 3, 4))
        time.sleep(0.3)
        a.request(Command.TENSOR_CANCEL, {"link": 7})
        frames = [a.recv_frame() for _ in range(2)]  # the cancel's reply first (answered at once), then the compute's
        statuses = sorted(h["status"] for h, _ in frames)
        assert statuses == sorted([0, Status.LINK_FAILED]), frames
        assert time.monotonic() - started < 0.3 + 2 * SLACK
    finally:
        db.signal(signal.SIGCONT)


def test_a_peer_out_of_step_drops_the_link(pair):
    da, db, a, b = pair
    link(a, b, db.port)
    (ha, _), (hb, _) = both(lambda: compute(a, [1, 2, 3, 4], 5), lambda: compute(b, [1, 2, 3, 4], 6))
    assert ha["status"] == hb["status"] == Status.LINK_FAILED, (ha, hb)
    assert "expected" in ha["error"]
    h, _ = compute(a, [1, 2, 3, 4], 7)  # dropped: linked again before the next step
    assert h["status"] == Status.LINK_FAILED and "not set up" in h["error"], h


GRAPH8 = [T(F32, [8], flags=INPUT),
          T(F32, [8], op=lib.GGML_OP_SCALE, src=[0], params=f32s(2.0), flags=COMPUTE),
          T(F32, [8], op=lib.GGML_OP_ADD, src=[1, 1], flags=OUTPUT | COMPUTE)]


def test_a_peer_sending_another_size_drops_the_link(pair):
    da, db, a, b = pair
    link(a, b, db.port)
    eight = lambda: b.call(Command.GRAPH_COMPUTE, {  # noqa: E731
        "tensors": GRAPH8, "inputs": [[0, 0, 32]], "outputs": [2],
        "tensor": {"link": 7, "step": 0, "exchange": [1], "timeout": 30}}, f32s(*range(8)))
    (ha, _), (hb, _) = both(lambda: compute(a, [1, 2, 3, 4], 0), eight)
    assert ha["status"] == hb["status"] == Status.LINK_FAILED, (ha, hb)
    assert "16 bytes" in ha["error"] and "32 bytes" in ha["error"], ha


def test_a_peer_that_never_sends_its_partial_ends_the_wait_at_the_steps_timeout(pair):
    da, db, a, b = pair
    link(a, b, db.port)  # b is alive and answering, but never computes
    started = time.monotonic()
    h, _ = compute(a, [1, 2, 3, 4], 0, timeout=0.5)
    assert h["status"] == Status.LINK_FAILED and "no answer from rank(s) [1] in time" in h["error"], h
    assert 0.5 <= time.monotonic() - started < 0.5 + 2 * SLACK
    h, _ = b.call(Command.PING)
    assert h["status"] == 0


def test_tensor_cancel_ends_a_join_that_waits_for_its_peers(pair):
    da, db, a, b = pair
    h, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": 9})
    assert h["status"] == 0
    started = time.monotonic()
    a.request(Command.TENSOR_LINK, {"op": "join", "link": 9, "rank": 0, "n": 2, "timeout": 60})
    time.sleep(0.3)
    a.request(Command.TENSOR_CANCEL, {"link": 9})
    frames = [a.recv_frame()[0] for _ in range(2)]  # the cancel's reply (at once), then the join's
    join = next(f for f in frames if f["status"] != 0)
    assert join["status"] == Status.LINK_FAILED and join.get("cancelled") is True, frames  # the coordinator's cue
    assert time.monotonic() - started < 0.3 + 2 * SLACK


def _children_cpu_seconds(pid: int) -> float:
    """The CPU time (user + system) of `pid`'s child processes (a daemon's compute processes)."""
    total = 0.0
    for child in open(f"/proc/{pid}/task/{pid}/children").read().split():
        try:
            fields = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@pytest.mark.parametrize("spin_ms", [0, 300])
def test_spin_ms_bounds_how_long_a_member_waits_for_its_peer_awake(start_daemon, spin_ms):
    """--spin-ms: a member whose peer comes 0.6 s late keeps its core busy for --spin-ms of that wait
    (300: most of 0.3 s of CPU time), then sleeps; with 0 it sleeps at once (next to no CPU time)."""
    da, db = start_daemon("--spin-ms", str(spin_ms)), start_daemon("--spin-ms", str(spin_ms))
    a, b = RawConn(da.port), RawConn(db.port)
    try:
        a.hello()
        b.hello()
        _, ra, rb = link(a, b, db.port)
        assert ra["status"] == 0 and rb["status"] == 0, (ra, rb)
        both(lambda: compute(a, [1, 2, 3, 4], 0), lambda: compute(b, [1, 2, 3, 4], 0))  # graphs placed
        time.sleep(2.0)  # the spare compute process started after the first compute is done starting up
        before = _children_cpu_seconds(da.proc.pid)

        def late_b():
            time.sleep(0.6)
            return compute(b, [10, 20, 30, 40], 1)

        (ha, _), (hb, _) = both(lambda: compute(a, [1, 2, 3, 4], 1), late_b)
        assert ha["status"] == 0 and hb["status"] == 0, (ha, hb)
        spent = _children_cpu_seconds(da.proc.pid) - before
        if spin_ms:
            assert spent > 0.1, spent  # most of 0.3 s, less on a machine whose other cores are busy
        else:
            assert spent < 0.1, spent
    finally:
        a.close()
        b.close()


def test_spin_ms_is_a_bounded_number_of_milliseconds():
    from rpc_daemon.daemon.cli import parse_args
    assert parse_args([])[0].spin_ms == 20.0
    assert parse_args(["--spin-ms", "0"])[0].spin_ms == 0.0
    for bad in ("-1", "1001", "nan"):
        with pytest.raises(SystemExit):
            parse_args(["--spin-ms", bad])
