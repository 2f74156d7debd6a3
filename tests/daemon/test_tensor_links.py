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


@pytest.fixture(params=["plain", "tls"])
def any_pair(request):
    """pair, then tls_pair (workers with --tls-cert and --peer-tls-ca: the links run TLS)."""
    return request.getfixturevalue("pair" if request.param == "plain" else "tls_pair")


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
    assert "cancelled" not in h and h["unlinked"] == [1]  # timed out: this member's own failure, with rank 1
    assert s.recv(1) == b""
    s.close()


def test_a_join_that_cannot_reach_a_lower_rank_names_it(pair):
    """Rank 1's connection to rank 0's listener is refused (the port is closed): LINK_FAILED, its own
    failure, with the rank it could not link with (`unlinked`: the coordinator weighs it against that
    rank's own join)."""
    import socket
    da, db, a, b = pair
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    b.call(Command.TENSOR_LINK, {"op": "listen", "link": 4})
    h, _ = b.call(Command.TENSOR_LINK, {"op": "join", "link": 4, "rank": 1, "n": 2, "timeout": 2.0,
                                        "peers": [{"rank": 0, "host": "127.0.0.1", "port": port,
                                                   "ticket": b"\1" * 32}]})
    assert h["status"] == Status.LINK_FAILED and f"cannot connect to rank 0 at 127.0.0.1:{port}" in h["error"], h
    assert h["unlinked"] == [0] and "cancelled" not in h and "peer_rank" not in h, h


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


def test_a_killed_peer_ends_the_wait_at_once(any_pair):
    da, db, a, b = any_pair
    link(a, b, db.port)
    started = time.monotonic()
    threading.Timer(0.5, db.kill).start()  # b never computes: a waits on the exchange until b dies
    h, _ = compute(a, [1, 2, 3, 4], 0, timeout=60)
    assert h["status"] == Status.LINK_FAILED and "rank 1" in h["error"], h
    assert time.monotonic() - started < 0.5 + 2 * SLACK


def test_tensor_cancel_ends_the_wait_of_a_stopped_peer(any_pair):
    da, db, a, b = any_pair
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


def test_a_peer_out_of_step_drops_the_link(any_pair):
    da, db, a, b = any_pair
    link(a, b, db.port)
    (ha, _), (hb, _) = both(lambda: compute(a, [1, 2, 3, 4], 5), lambda: compute(b, [1, 2, 3, 4], 6))
    assert ha["status"] == hb["status"] == Status.LINK_FAILED, (ha, hb)
    assert "expected" in ha["error"]
    h, _ = compute(a, [1, 2, 3, 4], 7)  # dropped: linked again before the next step
    assert h["status"] == Status.LINK_FAILED and "not set up" in h["error"], h


GRAPH8 = [T(F32, [8], flags=INPUT),
          T(F32, [8], op=lib.GGML_OP_SCALE, src=[0], params=f32s(2.0), flags=COMPUTE),
          T(F32, [8], op=lib.GGML_OP_ADD, src=[1, 1], flags=OUTPUT | COMPUTE)]


def test_a_peer_sending_another_size_drops_the_link(any_pair):
    da, db, a, b = any_pair
    link(a, b, db.port)
    eight = lambda: b.call(Command.GRAPH_COMPUTE, {  # noqa: E731
        "tensors": GRAPH8, "inputs": [[0, 0, 32]], "outputs": [2],
        "tensor": {"link": 7, "step": 0, "exchange": [1], "timeout": 30}}, f32s(*range(8)))
    (ha, _), (hb, _) = both(lambda: compute(a, [1, 2, 3, 4], 0), eight)
    assert ha["status"] == hb["status"] == Status.LINK_FAILED, (ha, hb)
    assert "16 bytes" in ha["error"] and "32 bytes" in ha["error"], ha


def test_a_peer_that_never_sends_its_partial_ends_the_wait_at_the_steps_timeout(any_pair):
    da, db, a, b = any_pair
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


# ---------------------------------------------------------------- over TLS (workers with --peer-tls-ca)

def tls_args(tls_files, cert=None, key=None, ca=None) -> tuple:
    return ("--tls-cert", cert or tls_files.cert, "--tls-key", key or tls_files.key,
            *(() if ca is False else ("--peer-tls-ca", ca or tls_files.ca)))


def tls_conn(port: int, ca: str) -> RawConn:
    """A RawConn over TLS to a daemon on 127.0.0.1, its certificate verified against `ca`."""
    import socket
    from rpc_daemon.wire.tls import client_context
    sock = client_context(ca).wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                          server_hostname="127.0.0.1")
    conn = RawConn.over(sock)
    conn.hello_reply = conn.hello()
    return conn


@pytest.fixture
def tls_pair(start_daemon, tls_files):
    da, db = start_daemon(*tls_args(tls_files)), start_daemon(*tls_args(tls_files))
    a, b = tls_conn(da.port, tls_files.ca), tls_conn(db.port, tls_files.ca)
    yield da, db, a, b
    a.close()
    b.close()


class Relay:
    """A TCP relay on 127.0.0.1 to `port` for one connection, keeping every byte it passes (what
    an attacker on the path between two workers sees)."""

    def __init__(self, port: int):
        import socket
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import socket
        self.listener.settimeout(30)
        inner, _ = self.listener.accept()
        outer = socket.create_connection(("127.0.0.1", self.target), timeout=30)

        def pump(src, dst):
            try:
                while True:
                    data = src.recv(1 << 16)
                    if not data:
                        break
                    with self.lock:
                        self.seen += data
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        other = threading.Thread(target=pump, args=(outer, inner), daemon=True)
        other.start()
        pump(inner, outer)
        other.join(30)

    def close(self) -> None:
        self.listener.close()


def link_via(a: RawConn, b: RawConn, relay_to_a, link_id: int = 7):
    """link(), b reaching a's listener through a Relay."""
    ha, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": link_id})
    hb, _ = b.call(Command.TENSOR_LINK, {"op": "listen", "link": link_id})
    assert ha["status"] == 0 and hb["status"] == 0, (ha, hb)
    relay = relay_to_a(ha["port"])
    ra, rb = both(lambda: a.call(Command.TENSOR_LINK, {"op": "join", "link": link_id, "rank": 0, "n": 2})[0],
                  lambda: b.call(Command.TENSOR_LINK, {"op": "join", "link": link_id, "rank": 1, "n": 2, "peers": [
                      {"rank": 0, "host": "127.0.0.1", "port": relay.port, "ticket": ha["ticket"]}]})[0])
    assert ra["status"] == 0 and rb["status"] == 0, (ra, rb)
    return relay


# partials no other bytes of the link could be: 2 x these floats (the exchanged tensor is SCALE 2)
MARKED = [1234.5678, -8765.4321, 3.14159265, 271828.18]


def exchanged_in_clear(pair) -> bool:
    """Link the pair through a Relay, run two steps; whether either member's partial crossed it as is."""
    da, db, a, b = pair
    relays = []
    link_via(a, b, lambda port: relays.append(Relay(port)) or relays[-1])
    try:
        for step in range(2):
            (ha, oa), (hb, ob) = both(lambda: compute(a, MARKED, step), lambda: compute(b, MARKED[::-1], step))
            assert ha["status"] == 0 and hb["status"] == 0, (ha, hb)
            assert floats(oa) == floats(ob)
        with relays[0].lock:
            seen = bytes(relays[0].seen)
        partials = [struct.pack("<4f", *[2 * x for x in xs]) for xs in (MARKED, MARKED[::-1])]
        return any(p in seen for p in partials)
    finally:
        relays[0].close()


def test_tls_workers_link_over_tls_and_sum_the_partials(tls_pair):
    da, db, a, b = tls_pair
    hello = a.hello_reply
    assert "tensor_links" in hello["features"] and "step_channel" not in hello["features"], hello
    _, ra, rb = link(a, b, db.port)
    assert ra["status"] == 0 and rb["status"] == 0, (ra, rb)
    for step in range(3):
        (ha, oa), (hb, ob) = both(lambda: compute(a, [1, 2, 3, 4], step), lambda: compute(b, [10, 20, 30, 40], step))
        assert ha["status"] == 0 and hb["status"] == 0, (ha, hb)
        want = [2 * (2 * (p + q)) for p, q in zip([1, 2, 3, 4], [10, 20, 30, 40])]
        assert floats(oa) == floats(ob) == want
    assert any("tensor link up" in line and "tls=True" in line for line in da.log_lines), da.log_lines[-5:]


def test_over_tls_the_partials_do_not_cross_the_network_in_clear(pair, tls_pair):
    """What a relay between the workers passes: without TLS the members' partials as they are (the
    check sees them), with TLS none of them."""
    assert exchanged_in_clear(pair)
    assert not exchanged_in_clear(tls_pair)


def test_a_tls_worker_without_peer_ca_offers_no_tensor_links(start_daemon, tls_files):
    d = start_daemon(*tls_args(tls_files, ca=False))
    conn = tls_conn(d.port, tls_files.ca)
    try:
        hello = conn.hello_reply
        assert "tensor_links" not in hello["features"] and "step_channel" not in hello["features"], hello
        h, _ = conn.call(Command.TENSOR_LINK, {"op": "listen", "link": 1})
        assert h["status"] == Status.INVALID_REQUEST and "--peer-tls-ca" in h["error"], h
    finally:
        conn.close()


def test_a_member_whose_certificate_its_peer_cannot_verify_fails_the_join_as_itself(start_daemon, tls_files, tmp_path):
    """Rank 0 serves a certificate no CA of rank 1's --peer-tls-ca signed. Rank 1 (its TLS client)
    fails verifying it and says its peer's was the failure (`peer_rank`); rank 0 hears the refusal
    (an alert) and fails as itself: the coordinator names rank 0."""
    da = start_daemon(*tls_args(tls_files, cert=tls_files.self_signed_cert, key=tls_files.self_signed_key))
    db = start_daemon(*tls_args(tls_files))
    a, b = tls_conn(da.port, tls_files.self_signed_cert), tls_conn(db.port, tls_files.ca)
    try:
        started = time.monotonic()
        _, ra, rb = link(a, b, db.port)
        assert time.monotonic() - started < 2 * SLACK  # at once, not at the join's timeout
        assert rb["status"] == Status.LINK_FAILED and "certificate verify failed" in rb["error"], rb
        assert "rank 0" in rb["error"] and rb.get("peer_rank") == 0 and "cancelled" not in rb, rb
        assert ra["status"] == Status.LINK_FAILED and "refused this worker's TLS handshake" in ra["error"], ra
        assert "unknown ca" in ra["error"] and "peer_rank" not in ra and "cancelled" not in ra, ra
        h, _ = compute(a, [1, 2, 3, 4], 0)  # nothing kept
        assert h["status"] == Status.LINK_FAILED and "not set up" in h["error"], h
    finally:
        a.close()
        b.close()


def stranger_after_hello(port: int, ticket: bytes, link_id: int, rank: int = 1):
    """A connection that passes a TLS listener's plaintext vetting (its HELLO has the digest, as one
    seen on the wire would) and is answered ACK."""
    import socket
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(pack_hello(link_id, rank, ticket, tls=True))
    assert s.recv(1) == b"\x01"
    return s


def test_a_connection_taken_over_after_the_hello_cannot_complete_tls(tls_pair, tls_files):
    """A stranger holding the HELLO's digest but not the ticket passes the plaintext vetting, then
    completes TLS (rank 0 asks no client certificate) but cannot show the ticket inside it: rank 0's
    join fails saying so, naming rank 1 as the failure, and the stranger gets no ACK."""
    from rpc_daemon.wire.tensor_frames import pack_tls_hello
    from rpc_daemon.wire.tls import client_context
    da, db, a, b = tls_pair
    h, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": 5})
    a.request(Command.TENSOR_LINK, {"op": "join", "link": 5, "rank": 0, "n": 2, "timeout": 10})
    raw = stranger_after_hello(h["port"], h["ticket"], 5)
    s = client_context(tls_files.ca).wrap_socket(raw, server_hostname="127.0.0.1")
    s.sendall(pack_tls_hello(5, 1, bytes(32)))
    assert s.recv(1) == b""  # no ACK: closed
    s.close()
    join = a.recv_frame()[0]
    assert join["status"] == Status.LINK_FAILED and "wrong tensor-link ticket inside TLS" in join["error"], join
    assert join.get("peer_rank") == 1, join


def test_a_plaintext_hello_is_refused_by_a_tls_listener(tls_pair):
    """A HELLO of a worker without TLS (the ticket itself, not its digest) is closed unanswered, the
    join keeps waiting for the right one (here: times out)."""
    import socket
    da, db, a, b = tls_pair
    h, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": 6})
    a.request(Command.TENSOR_LINK, {"op": "join", "link": 6, "rank": 0, "n": 2, "timeout": 1})
    s = socket.create_connection(("127.0.0.1", h["port"]), timeout=10)
    s.sendall(pack_hello(6, 1, h["ticket"]))
    assert s.recv(1) == b""
    s.close()
    join = a.recv_frame()[0]
    assert join["status"] == Status.LINK_FAILED and "not linked with rank(s) [1]" in join["error"], join


def test_the_tls_phase_has_the_joins_deadline_and_tensor_cancel_ends_it(tls_pair):
    """A member that passed the plaintext HELLO and then says nothing: rank 0's compute process waits
    in the TLS handshake until the join's timeout; a TENSOR_CANCEL ends that wait at once."""
    da, db, a, b = tls_pair
    h, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": 8})
    started = time.monotonic()
    a.request(Command.TENSOR_LINK, {"op": "join", "link": 8, "rank": 0, "n": 2, "timeout": 1.5})
    silent = stranger_after_hello(h["port"], h["ticket"], 8)
    try:
        join = a.recv_frame()[0]
        assert join["status"] == Status.LINK_FAILED and "did not complete the TLS handshake" in join["error"], join
        assert "peer_rank" not in join and "cancelled" not in join, join  # its own: the deadline passed
        assert 1.5 - 0.1 <= time.monotonic() - started < 1.5 + 2 * SLACK
    finally:
        silent.close()
    h, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": 9})
    a.request(Command.TENSOR_LINK, {"op": "join", "link": 9, "rank": 0, "n": 2, "timeout": 60})
    silent = stranger_after_hello(h["port"], h["ticket"], 9)
    try:
        time.sleep(0.5)  # in the TLS phase by now
        started = time.monotonic()
        a.request(Command.TENSOR_CANCEL, {"link": 9})
        frames = [a.recv_frame()[0] for _ in range(2)]
        join = next(f for f in frames if f["status"] != 0)
        assert join["status"] == Status.LINK_FAILED and join.get("cancelled") is True, frames
        assert time.monotonic() - started < 2 * SLACK
    finally:
        silent.close()


def test_over_tls_a_partial_larger_than_the_socket_buffers_is_summed(tls_pair):
    """1 MiB partials: many TLS records each way, writes that must wait for the socket (OpenSSL's
    retried write) while the reads interleave; every member ends with the same exact sum."""
    import numpy as np
    da, db, a, b = tls_pair
    n = 1 << 18
    graph = [T(F32, [n], flags=INPUT),
             T(F32, [n], op=lib.GGML_OP_SCALE, src=[0], params=f32s(2.0), flags=COMPUTE),
             T(F32, [n], op=lib.GGML_OP_ADD, src=[1, 1], flags=OUTPUT | COMPUTE)]
    _, ra, rb = link(a, b, db.port)
    assert ra["status"] == 0 and rb["status"] == 0, (ra, rb)
    xa = np.arange(n, dtype=np.float32)
    xb = np.float32(0.5) * np.arange(n, dtype=np.float32)[::-1].copy()

    def run(conn, x, step):
        return conn.call(Command.GRAPH_COMPUTE, {"tensors": graph, "inputs": [[0, 0, 4 * n]], "outputs": [2],
                                                 "tensor": {"link": 7, "step": step, "exchange": [1],
                                                            "timeout": 30}}, x.tobytes())
    for step in range(2):
        (ha, oa), (hb, ob) = both(lambda: run(a, xa, step), lambda: run(b, xb, step))
        assert ha["status"] == 0 and hb["status"] == 0, (ha, hb)
        want = 2 * (2 * xa + 2 * xb)
        assert oa == ob and np.array_equal(np.frombuffer(oa, np.float32), want)


def test_three_tls_members_link_and_sum_in_rank_order(start_daemon, tls_files):
    """Each member runs TLS with its peers in increasing rank order (rank 1 the client of 0 and the
    server of 2): no member waits on another that waits on it."""
    daemons = [start_daemon(*tls_args(tls_files)) for _ in range(3)]
    conns = [tls_conn(d.port, tls_files.ca) for d in daemons]
    try:
        listens = [c.call(Command.TENSOR_LINK, {"op": "listen", "link": 3})[0] for c in conns]
        peers = [{"rank": r, "host": "127.0.0.1", "port": h["port"], "ticket": h["ticket"]}
                 for r, h in enumerate(listens)]
        joins = [None] * 3

        def join(r):
            joins[r] = conns[r].call(Command.TENSOR_LINK, {"op": "join", "link": 3, "rank": r, "n": 3,
                                                           "peers": peers[:r]})[0]
        threads = [threading.Thread(target=join, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(j is not None and j["status"] == 0 for j in joins), joins
        outs = [None] * 3

        def run(r):
            outs[r] = compute(conns[r], [r + 1] * 4, 0, link_id=3)
        threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(h["status"] == 0 and floats(o) == [2 * 2 * (1 + 2 + 3)] * 4 for h, o in outs), outs
    finally:
        for c in conns:
            c.close()


def test_a_worker_times_its_round_trips_to_a_peer(any_pair):
    """TENSOR_LINK rtt: `count` PINGs to another worker over this worker's own link to it (with TLS
    between TLS workers), each one's round trip; an unreachable peer is LINK_FAILED saying so (the
    connection stays); a bad peer or count is refused before anything is sent."""
    import socket
    da, db, a, b = any_pair
    assert "tensor_rtt" in a.hello_reply["features"], a.hello_reply
    h, _ = b.call(Command.TENSOR_LINK, {"op": "rtt", "peer": f"127.0.0.1:{da.port}", "count": 3})
    assert h["status"] == 0 and len(h["rtts"]) == 3 and all(0 < r < SLACK for r in h["rtts"]), h
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    h, _ = b.call(Command.TENSOR_LINK, {"op": "rtt", "peer": f"127.0.0.1:{port}", "count": 1})
    assert h["status"] == Status.LINK_FAILED and f"cannot reach worker 127.0.0.1:{port}" in h["error"], h
    for bad in ({"peer": "nowhere", "count": 1}, {"peer": f"127.0.0.1:{da.port}", "count": 17},
                {"peer": f"127.0.0.1:{da.port}", "count": 0}, {"peer": 5, "count": 1}):
        h, _ = b.call(Command.TENSOR_LINK, {"op": "rtt", **bad})
        assert h["status"] == Status.INVALID_REQUEST, (bad, h)
    h, _ = b.call(Command.TENSOR_LINK, {"op": "rtt", "peer": f"127.0.0.1:{da.port}", "count": 1})
    assert h["status"] == 0, h  # the connection served on


def test_a_peer_whose_certificate_is_not_for_its_address_is_not_linked(start_daemon, tls_files):
    """Rank 0 listens on 127.0.0.2 with a certificate the CA signed for 127.0.0.1 and localhost only:
    rank 1, its TLS client, checks the address it was told (as step links do) and refuses it, naming
    the mismatch (peer_rank: the failure is rank 0's); rank 0 hears the refusal as its own failure."""
    import socket
    from rpc_daemon.wire.tls import client_context
    da, db = start_daemon(*tls_args(tls_files), "-H", "127.0.0.2"), start_daemon(*tls_args(tls_files))
    ctx = client_context(tls_files.ca)
    ctx.check_hostname = False  # this test's own connection to rank 0 only: the links check theirs
    a = RawConn.over(ctx.wrap_socket(socket.create_connection(("127.0.0.2", da.port), timeout=10),
                                     server_hostname="127.0.0.2"))
    a.hello()
    b = tls_conn(db.port, tls_files.ca)
    try:
        ha, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": 3})
        b.call(Command.TENSOR_LINK, {"op": "listen", "link": 3})
        ra, rb = both(lambda: a.call(Command.TENSOR_LINK, {"op": "join", "link": 3, "rank": 0, "n": 2})[0],
                      lambda: b.call(Command.TENSOR_LINK, {"op": "join", "link": 3, "rank": 1, "n": 2, "peers": [
                          {"rank": 0, "host": "127.0.0.2", "port": ha["port"], "ticket": ha["ticket"]}]})[0])
        assert rb["status"] == Status.LINK_FAILED and rb.get("peer_rank") == 0, rb
        assert "cannot verify the certificate of rank 0 at 127.0.0.2" in rb["error"], rb
        assert "IP address mismatch" in rb["error"], rb
        assert ra["status"] == Status.LINK_FAILED and "peer_rank" not in ra and "bad certificate" in ra["error"], ra
    finally:
        a.close()
        b.close()


def test_a_tls_phase_waiting_on_a_silent_peer_holds_up_no_other_client(start_daemon, tls_files):
    """The TLS phase waits on the peers, not the CPU: it runs outside the daemon-wide compute lock, so
    another client's compute on the same worker is answered at once while a join's TLS phase waits
    (up to its 10 s) for a peer that passed the plaintext vetting and went silent; when that peer
    closes, the join ends at once, naming it."""
    d = start_daemon(*tls_args(tls_files))
    joining, other = tls_conn(d.port, tls_files.ca), tls_conn(d.port, tls_files.ca)
    try:
        h, _ = joining.call(Command.TENSOR_LINK, {"op": "listen", "link": 8})
        joining.request(Command.TENSOR_LINK, {"op": "join", "link": 8, "rank": 0, "n": 2, "timeout": 10})
        silent = stranger_after_hello(h["port"], h["ticket"], 8)
        time.sleep(0.3)  # the join is in its TLS phase, waiting for the silent peer's handshake
        t = time.monotonic()
        reply, out = other.call(Command.GRAPH_COMPUTE, {"tensors": GRAPH, "inputs": [[0, 0, 16]], "outputs": [2]},
                                f32s(1, 2, 3, 4))
        took = time.monotonic() - t
        silent.close()
        assert reply["status"] == 0 and took < 1.0 * SLACK, (reply, took)  # under the lock: the join's 10 s
        join = joining.recv_frame()[0]
        assert join["status"] == Status.LINK_FAILED and join.get("peer_rank") == 1, join
        assert "closed the tensor link during the TLS handshake" in join["error"], join
    finally:
        joining.close()
        other.close()


@pytest.mark.parametrize("host", ["127.0.0.1\x00", "a b", "x" * 70 + ".lan", "\u0085host"])
def test_a_join_naming_a_host_no_socket_or_tls_can_take_is_refused(pair, host):
    """A peer `host` with a control character or space, or not IDNA-encodable, is refused before
    anything connects (a NUL in it once reached the TLS phase and killed the compute process)."""
    da, db, a, b = pair
    b.call(Command.TENSOR_LINK, {"op": "listen", "link": 3})
    h, _ = b.call(Command.TENSOR_LINK, {"op": "join", "link": 3, "rank": 1, "n": 2, "timeout": 1,
                                        "peers": [{"rank": 0, "host": host, "port": 1, "ticket": b"\1" * 32}]})
    assert h["status"] == Status.INVALID_REQUEST and "'host'" in h["error"], h


# ------------------------------------------- exchanges over TLS, against a member played by the test

class FakeRank1:
    """Rank 1 of a TLS link played from the test process against a real rank 0: it holds the
    listener's ticket (a member, not a stranger), vets and runs TLS 1.3 as a member's compute process
    would (an SSLObject over memory BIOs, so the test chooses every record and every byte that goes on
    the wire), and then sends whatever the test needs in place of a member's EXCHANGE frames."""

    def __init__(self, conn: RawConn, ca: str, link_id: int):
        """Listen and join on `conn` as rank 0 of a group of 2, then be its rank 1: the join replies OK."""
        import socket
        import ssl
        from rpc_daemon.wire.tensor_frames import pack_tls_hello
        from rpc_daemon.wire.tls import client_context
        h, _ = conn.call(Command.TENSOR_LINK, {"op": "listen", "link": link_id})
        assert h["status"] == 0, h
        conn.request(Command.TENSOR_LINK, {"op": "join", "link": link_id, "rank": 0, "n": 2, "timeout": 10})
        self.sock = stranger_after_hello(h["port"], h["ticket"], link_id)  # a HELLO with the ticket's digest
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each send its own segment
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = client_context(ca).wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")
        self._drive(self.tls.do_handshake)
        self.send(pack_tls_hello(link_id, 1, h["ticket"]))
        assert self.read(1) == b"\x01"
        join = conn.recv_frame()[0]
        assert join["status"] == 0, join

    def _drive(self, step):
        """`step()` (a call of the SSLObject) done: what it writes sent, the socket's bytes fed to it."""
        import ssl
        while True:
            try:
                result = step()
            except ssl.SSLWantReadError:
                self.sock.sendall(self.outgoing.read())
                data = self.sock.recv(1 << 16)
                if not data:
                    raise EOFError("rank 0 closed the link") from None
                self.incoming.write(data)
                continue
            self.sock.sendall(self.outgoing.read())
            return result

    def read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = self._drive(lambda: self.tls.read(n - len(data)))
            if not more:
                raise EOFError("rank 0 ended its TLS session")
            data += more
        return data

    def records(self, data: bytes) -> bytes:
        """`data` encrypted: the TLS records a write of it makes (OpenSSL's boundaries), not sent."""
        self.tls.write(data)
        return self.outgoing.read()

    def send(self, data: bytes) -> None:
        self.sock.sendall(self.records(data))

    def receive_frame(self) -> tuple[int, int, list]:
        """Rank 0's next EXCHANGE frame: step, index and its partial (4 floats)."""
        from rpc_daemon.wire.tensor_frames import EXCHANGE
        step, index, size = EXCHANGE.unpack(self.read(EXCHANGE.size))
        return step, index, floats(self.read(size)) if size == 16 else size

    def close_notify(self) -> None:
        """This side's TLS session ended (a close_notify alert sent); the TCP connection stays open."""
        import ssl
        try:
            self.tls.unwrap()
        except ssl.SSLWantReadError:  # it sent its close_notify and would wait for rank 0's
            pass
        self.sock.sendall(self.outgoing.read())

    def assert_closed(self) -> None:
        """Rank 0's end of the connection is closed or shut down, with no TLS record first (no
        close_notify): EOF, or a reset (our bytes left unread)."""
        self.sock.settimeout(10)
        try:
            assert self.sock.recv(1) == b""
        except ConnectionResetError:
            pass

    def close(self) -> None:
        self.sock.close()


def frame(step: int, partial, index: int = 0) -> bytes:
    """An EXCHANGE frame: header and the f32 partial."""
    from rpc_daemon.wire.tensor_frames import EXCHANGE
    body = f32s(*partial)
    return EXCHANGE.pack(step, index, len(body)) + body


def summed(x, partial) -> list:
    """What GRAPH outputs on rank 0 for input `x` when rank 1's partial is `partial`: 2 (2x + p)."""
    return [2 * (2 * p + q) for p, q in zip(x, partial)]


def assert_dropped(conn: RawConn, peer: FakeRank1, link_id: int) -> None:
    """After a failed exchange: rank 0's compute process holds the link no more (its next compute
    says so), and the TENSOR_CANCEL a coordinator then sends every member shuts the daemon's copy of
    the connection down: rank 1 sees it close, with no close_notify first."""
    h, _ = compute(conn, [1, 2, 3, 4], 1, link_id=link_id)
    assert h["status"] == Status.LINK_FAILED and h.get("link_missing") is True, h
    h, _ = conn.call(Command.TENSOR_CANCEL, {"link": link_id})
    assert h["status"] == 0, h
    peer.assert_closed()


@pytest.fixture
def tls_worker(start_daemon, tls_files):
    """One TLS worker (--peer-tls-ca) and a connection to it: rank 0 against a FakeRank1."""
    d = start_daemon(*tls_args(tls_files))
    conn = tls_conn(d.port, tls_files.ca)
    yield d, conn
    conn.close()


def test_over_tls_a_frame_already_received_is_taken_without_waiting(tls_worker, tls_files):
    """Rank 1 sends two steps' frames in one write, before rank 0 computes either: rank 0's first
    receive takes both into its TLS session, step 0 decrypts its frame and leaves step 1's there.
    Step 1 must read what its session holds before it waits on the socket, which gets nothing more
    (rank 1 sends nothing else): a wait there would end only at step 1's timeout, LINK_FAILED."""
    d, a = tls_worker
    peer = FakeRank1(a, tls_files.ca, 10)
    try:
        peer.send(frame(0, [1, 1, 1, 1]) + frame(1, [5, 6, 7, 8]))
        h, out = compute(a, [1, 2, 3, 4], 0, link_id=10, timeout=8)
        assert h["status"] == 0 and floats(out) == summed([1, 2, 3, 4], [1, 1, 1, 1]), h
        assert peer.receive_frame() == (0, 0, [2, 4, 6, 8])
        started = time.monotonic()
        h, out = compute(a, [1, 2, 3, 4], 1, link_id=10, timeout=8)
        took = time.monotonic() - started
        assert h["status"] == 0 and floats(out) == summed([1, 2, 3, 4], [5, 6, 7, 8]), h
        assert took < 1.0 * SLACK, took  # no wait: the timeout is 8 s
        assert peer.receive_frame() == (1, 0, [2, 4, 6, 8])
    finally:
        peer.close()


def test_over_tls_a_frame_in_one_byte_records_is_summed(tls_worker, tls_files):
    """Rank 1 writes its frame through TLS one byte at a time, each byte its own record (5 bytes of
    record header, 1 of data, 1 of content type, 16 of tag) in its own TCP segment, while rank 0
    waits in the exchange: the receiver accepts any split of the stream into records, down to one
    byte a record, and sums exactly."""
    d, a = tls_worker
    peer = FakeRank1(a, tls_files.ca, 11)
    mine = [0.5, -1.25, 1e6, 3.0]

    def rank1():
        got = peer.receive_frame()  # rank 0 is in the exchange: its own frame has come
        for byte in frame(0, mine):
            record = peer.records(bytes([byte]))
            assert len(record) == 5 + 1 + 1 + 16 and record[0] == 0x17, record  # one record, one byte
            peer.sock.sendall(record)
            time.sleep(0.001)
        return got

    try:
        (h, out), got = both(lambda: compute(a, [1, 2, 3, 4], 0, link_id=11, timeout=8), rank1)
        assert h["status"] == 0 and floats(out) == summed([1, 2, 3, 4], mine), h
        assert got == (0, 0, [2, 4, 6, 8])
    finally:
        peer.close()


def fails_at_once(a, peer, link_id: int, answer, words: str) -> None:
    """Rank 1 (`peer`) takes rank 0's frame, then `answer()`s it wrongly: rank 0's compute answers
    LINK_FAILED with `words` in its error at once (its timeout is 60 s), and the link is dropped."""
    def rank1():
        got = peer.receive_frame()
        answer()
        return got

    try:
        started = time.monotonic()
        (h, _), got = both(lambda: compute(a, [1, 2, 3, 4], 0, link_id=link_id, timeout=60), rank1)
        took = time.monotonic() - started
        assert h["status"] == Status.LINK_FAILED and "tensor link to rank 1" in h["error"], h
        assert words in h["error"].lower(), h
        assert took < 2 * SLACK, took
        assert got == (0, 0, [2, 4, 6, 8])
        assert_dropped(a, peer, link_id)
    finally:
        peer.close()


def test_over_tls_a_close_notify_in_a_frame_fails_the_exchange_at_once(tls_worker, tls_files):
    """Rank 1 sends its frame's header, then ends its TLS session (close_notify) and keeps the TCP
    connection open: rank 0 answers LINK_FAILED naming rank 1 as soon as the alert comes, not at the
    compute's timeout (60 s), and drops the link."""
    d, a = tls_worker
    peer = FakeRank1(a, tls_files.ca, 12)

    def answer():
        peer.send(frame(0, [1, 1, 1, 1])[:16])
        peer.close_notify()

    fails_at_once(a, peer, 12, answer, "tensor link to rank 1 closed")


def test_over_tls_a_corrupted_record_fails_the_exchange_at_once(tls_worker, tls_files):
    """Rank 1's frame with one bit of its first record's ciphertext flipped (what a path that alters
    bytes would do): the record does not authenticate, and rank 0 answers LINK_FAILED with OpenSSL's
    reason at once (the compute's timeout is 60 s), and drops the link: no sum is made of them."""
    d, a = tls_worker
    peer = FakeRank1(a, tls_files.ca, 13)

    def answer():
        wire = bytearray(peer.records(frame(0, [1, 1, 1, 1])))
        wire[5] ^= 0x01  # the first byte after the first record's 5-byte header
        peer.sock.sendall(wire)

    fails_at_once(a, peer, 13, answer, "bad record mac")


def test_over_tls_a_record_over_the_maximum_size_fails_the_exchange_at_once(tls_worker, tls_files):
    """A record header announcing 65535 bytes (TLS 1.3 allows 2^14 + 256 of ciphertext), followed
    by a few bytes, the connection left open: rank 0 refuses it on its header, LINK_FAILED at once,
    rather than waiting (until the compute's 60 s timeout) for the rest of a record it could never
    take."""
    d, a = tls_worker
    peer = FakeRank1(a, tls_files.ca, 14)
    fails_at_once(a, peer, 14, lambda: peer.sock.sendall(b"\x17\x03\x03" + struct.pack(">H", 0xFFFF) + bytes(64)),
                  "length too long")


def test_over_tls_a_flood_for_another_step_fails_on_its_header_and_the_worker_links_again(tls_worker, tls_files):
    """Rank 1 answers with a frame of another step announcing 64 MiB and streams those 64 MiB as valid
    records: rank 0 checks the header as soon as its 16 bytes are decrypted and fails then (LINK_FAILED
    at once, the compute's timeout being 60 s) without reading on for the frame's body (the flood
    stalls on full socket buffers, far short of its end, until the next listen closes the
    connection). The daemon answers on, and the same compute process (not one started after a
    crash) links again and sums a correct exchange."""
    from rpc_daemon.wire.tensor_frames import EXCHANGE
    from rpc_helpers import assigned_pids
    d, a = tls_worker
    flood = 64 << 20
    peer = FakeRank1(a, tls_files.ca, 15)
    pid = assigned_pids(d)[-1]  # this session's compute process (the join started it)
    got, sent, ended = [], [0], threading.Event()

    def rank1():
        try:
            got.append(peer.receive_frame())
            chunk = bytes(1 << 20)
            peer.send(EXCHANGE.pack(1, 0, flood))  # step 1 where rank 0 is in step 0
            for _ in range(flood // len(chunk)):
                peer.send(chunk)
                sent[0] += len(chunk)
        except OSError:  # rank 0's end is closed: the rest of the flood cannot go
            pass
        finally:
            ended.set()

    flooding = threading.Thread(target=rank1, daemon=True)
    again = None
    try:
        flooding.start()
        started = time.monotonic()
        h, _ = compute(a, [1, 2, 3, 4], 0, link_id=15, timeout=60)
        took = time.monotonic() - started
        assert h["status"] == Status.LINK_FAILED, h
        assert f"(step 1, index 0, {flood} bytes), expected (step 0, index 0, 16 bytes)" in h["error"], h
        assert took < 2 * SLACK, took
        assert got == [(0, 0, [2, 4, 6, 8])]
        h, _ = a.call(Command.TENSOR_CANCEL, {"link": 15})  # as a coordinator would
        assert h["status"] == 0, h
        assert d.alive() and os.path.exists(f"/proc/{pid}")
        h, _ = a.call(Command.PING)
        assert h["status"] == 0, h
        again = FakeRank1(a, tls_files.ca, 16)  # its listen closes the daemon's copy of the flooded link
        assert ended.wait(2 * SLACK) and sent[0] < flood // 2, sent  # cut off, not read to its end
        (h, out), theirs = both(lambda: compute(a, [1, 2, 3, 4], 0, link_id=16, timeout=8),
                                lambda: (again.receive_frame(), again.send(frame(0, [3, 3, 3, 3])))[0])
        assert h["status"] == 0 and floats(out) == summed([1, 2, 3, 4], [3, 3, 3, 3]), h
        assert theirs == (0, 0, [2, 4, 6, 8])
        assert assigned_pids(d)[-1] == pid  # the same process: not one started after a crash
    finally:
        peer.close()
        if again is not None:
            again.close()
        flooding.join(30)
