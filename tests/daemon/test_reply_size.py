"""The client allocates only what it expects (docs/security.md, "A worker's
replies"; docs/protocol.md, "What a client expects of a reply's size").

A reply's blob is bounded by what its request implies (a GET_TENSOR's size, a
compute's outputs), checked on the 12-byte prefix before anything is
allocated for it: a lying or broken worker gets its connection closed as a
protocol error, and the client never holds memory for the lie.

The pure rule (rpc_daemon/wire/framing.py: reply_blob_bound, check_reply_blob,
FrameReader's blob_bound) is tested without sockets; RpcClient against a
scripted worker on a real socket (rpc_helpers.FakeWorker).
"""
from __future__ import annotations

import asyncio
import time
import tracemalloc

import pytest

from conftest import SLACK
from rpc_daemon.client import PeerFailed, RpcClient
from rpc_daemon.wire import framing as F
from rpc_daemon.wire import protocol as P
from rpc_daemon.wire.protocol import Command, Status
from rpc_helpers import FakeWorker, feed_reader

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MAX_BLOB = P.Limits().max_blob


# ---------------------------------------------------------------- the rule, pure

def test_reply_blob_bound_is_what_the_request_implies():
    """GET_TENSOR: its size (at most max_blob); a graph compute: max_blob (the
    fields do not spell out its outputs' sizes: a client that knows the graph
    passes their sum); every other command: no data at all."""
    bound = F.reply_blob_bound
    assert bound(Command.GET_TENSOR, {"buffer": 1, "offset": 0, "size": 4096}, MAX_BLOB) == 4096
    assert bound(Command.GET_TENSOR, {"size": 2 * GiB}, MAX_BLOB) == MAX_BLOB
    for size in (None, True, 4096.0, -1, 0, "4096"):  # what the daemon refuses is answered without data
        assert bound(Command.GET_TENSOR, {"size": size}, MAX_BLOB) == 0, size
    assert bound(Command.GET_TENSOR, None, MAX_BLOB) == 0
    assert bound(Command.GRAPH_COMPUTE, {}, MAX_BLOB) == bound(Command.GRAPH_RECOMPUTE, {}, MAX_BLOB) == MAX_BLOB
    others = set(Command) - {Command.GET_TENSOR, Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE}
    assert others and all(bound(cmd, {"size": 4096}, MAX_BLOB) == 0 for cmd in others)
    assert bound(99, {"size": 4096}, MAX_BLOB) == 0


def test_check_reply_blob():
    F.check_reply_blob(0, 0)
    F.check_reply_blob(4096, 4096)
    for header in (None, {"id": 7, "status": 0}):
        with pytest.raises(F.ReplyTooLarge) as info:
            F.check_reply_blob(4097, 4096, header)
        exc = info.value
        assert isinstance(exc, P.ProtocolError) and exc.status == Status.LIMIT_EXCEEDED and exc.fatal
        assert (exc.blob_len, exc.bound, exc.header) == (4097, 4096, header)
        assert "4097" in exc.message and "4096" in exc.message
    with pytest.raises(F.ReplyTooLarge):
        F.check_reply_blob(1, 0)




class Bounds:
    """A client's view for FrameReader.blob_bound: id -> bound of its pending requests."""

    def __init__(self, by_id: dict):
        self.by_id, self.calls = by_id, []

    def __call__(self, header):
        self.calls.append(None if header is None else header.get("id"))
        if header is None:
            return max(self.by_id.values(), default=0)
        req_id = header.get("id")
        return self.by_id.get(req_id, 0) if type(req_id) is int else 0


@pytest.mark.parametrize("step", [1, 5, 12, 4096, 1 << 20])
def test_a_lying_prefix_is_refused_before_anything_is_allocated(step):
    """A prefix claiming 1 GiB where the requests outstanding imply at most 4
    KiB: refused on the prefix itself (the header not even read), and the
    reader, which allocates a reply's blob at once, has allocated nothing."""
    bounds = Bounds({1: 4 * KiB})
    reader = F.FrameReader(P.Limits(), blob_bound=bounds)
    lie = F.encode_frame({"id": 1, "status": 0}, GiB) + b"\0" * 100
    tracemalloc.start()
    try:
        with pytest.raises(F.ReplyTooLarge) as info:
            feed_reader(reader, lie, step)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.header is None and info.value.bound == 4 * KiB and info.value.blob_len == GiB
    assert bounds.calls == [None]  # the prefix alone
    assert peak < 64 * KiB, peak


@pytest.mark.parametrize("step", [1, 7, 64, 1 << 20])
def test_a_reply_is_held_to_the_request_its_header_names(step):
    """Two requests outstanding, 1 MiB and 16 bytes: a reply of 1 MiB passes
    the prefix (some request may take it) but not the header check when it
    answers the 16-byte one, still before its blob is allocated; the honest
    replies, and replies without data (a pong, an error frame, a bad id),
    pass. The daemon's reader (a sink, no bound) is not affected."""
    bounds = Bounds({2: MiB, 3: 16})
    reader = F.FrameReader(P.Limits(), blob_bound=bounds)
    honest = (F.encode_frame({"id": 2, "status": 0}, MiB) + b"\1" * MiB
              + F.encode_frame({"id": 3, "status": 0}, 16) + b"\2" * 16
              + F.encode_frame({"id": 99, "status": 0})  # a pong
              + F.encode_frame({"id": None, "status": int(Status.LIMIT_EXCEEDED), "error": "x"})
              + F.encode_frame({"id": [3], "status": 0}))  # a bad id: the client's to refuse, not the bound's
    got = feed_reader(reader, honest, step)
    assert [(h["id"], len(b)) for h, b in got] == [(2, MiB), (3, 16), (99, 0), (None, 0), ([3], 0)]

    reader = F.FrameReader(P.Limits(), blob_bound=bounds)
    lie = F.encode_frame({"id": 3, "status": 0}, MiB)
    tracemalloc.start()
    try:
        with pytest.raises(F.ReplyTooLarge) as info:
            feed_reader(reader, lie + b"\0" * 100, step)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.header == {"id": 3, "status": 0} and info.value.bound == 16
    assert peak < 256 * KiB, peak  # not the 1 MiB it claims

    sink = F.FrameSink()
    daemon_side = F.FrameReader(P.Limits(), sink=sink, eager_blobs=False)
    feed_reader(daemon_side, F.encode_frame({"cmd": 5, "id": 1}, MiB) + b"\0" * MiB, step)
    assert not daemon_side.partial


# ---------------------------------------------------------------- RpcClient against a lying worker

def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def lie_about(cmds, blob_len: int = GiB, sends: bytes = b"\0" * 4096):
    """A worker's answer: to a request of `cmds`, a reply whose prefix claims
    `blob_len` bytes of data, then only `sends` of them (and silence)."""
    def answer(h, blob):
        if h.get("cmd") in cmds:
            return F.encode_frame(P.reply_header(h["id"], Status.SUCCESS, outputs=[]), blob_len) + sends
        return FakeWorker.default_answer(worker, h, blob)
    worker = FakeWorker(answer)
    return worker


def test_a_reply_larger_than_its_get_tensor_closes_the_connection_without_allocating():
    """GET_TENSOR of 4 KiB answered with a prefix claiming 1 GiB: PeerFailed,
    kind protocol, at once, naming the worker, the claim, the request and its
    bound; the connection is closed (the next request fails the same way) and
    the client allocated nothing near the lie."""
    worker = lie_about({Command.GET_TENSOR})

    async def scenario():
        c = await RpcClient.connect(worker.endpoint)
        try:
            tracemalloc.start()
            started = time.monotonic()
            with pytest.raises(PeerFailed) as info:
                await c.request(Command.GET_TENSOR, {"buffer": 1, "offset": 0, "size": 4 * KiB}, deadline=30)
            took = time.monotonic() - started
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            assert c.failed is info.value
            with pytest.raises(PeerFailed):
                await c.request(Command.PING)
            return info.value, took, peak
        finally:
            if tracemalloc.is_tracing():
                tracemalloc.stop()
            await c.aclose()

    try:
        exc, took, peak = run(scenario())
    finally:
        worker.close()
    assert exc.kind == "protocol", exc
    for fragment in (worker.endpoint, f"{GiB} bytes of data", "GET_TENSOR", f"at most {4 * KiB}",
                     "nothing was allocated"):
        assert fragment in exc.message, exc.message
    assert took < 1.0 * SLACK, took
    assert peak < 16 * MiB, f"{peak} bytes allocated for a reply that claimed {GiB}"


def test_a_compute_reply_is_bounded_by_the_outputs_the_client_expects():
    """A compute whose client says its outputs are 48 bytes (reply_blob),
    answered with a reply claiming 64 MiB (under max_blob, so only the
    request's bound can tell): refused the same way; the same reply to a
    client that does not say (a raw tool: max_blob) is read as it arrives."""
    worker = lie_about({Command.GRAPH_RECOMPUTE}, 64 * MiB, sends=b"")

    async def scenario():
        c = await RpcClient.connect(worker.endpoint)
        try:
            tracemalloc.start()
            with pytest.raises(PeerFailed) as info:
                await c.request(Command.GRAPH_RECOMPUTE, {"graph_id": 1, "inputs": [], "outputs": [3]},
                                deadline=30, reply_blob=48)
            _, peak = tracemalloc.get_traced_memory()
            return info.value, peak
        finally:
            tracemalloc.stop()
            await c.aclose()

    try:
        exc, peak = run(scenario())
    finally:
        worker.close()
    assert exc.kind == "protocol" and "GRAPH_RECOMPUTE" in exc.message and "at most 48" in exc.message, exc
    assert peak < 16 * MiB, peak


def test_honest_replies_pass_and_a_wrong_id_is_held_to_its_own_request():
    """Replies of exactly the size asked for pass, pipelined; a reply that
    names the 16-byte request but claims the 1 MiB one's size is refused
    (it passed the prefix: the 1 MiB request could take it)."""
    state = {"lie": False}

    def answer(h, blob):
        if h.get("cmd") != Command.GET_TENSOR:
            return FakeWorker.default_answer(worker, h, blob)
        size = h["size"]
        if state["lie"] and size == 16:
            return F.encode_frame(P.reply_header(h["id"], Status.SUCCESS), MiB)
        return F.encode_frame(P.reply_header(h["id"], Status.SUCCESS), size) + bytes([size % 251]) * size

    worker = FakeWorker(answer)

    async def scenario():
        c = await RpcClient.connect(worker.endpoint)
        try:
            big, small = await asyncio.gather(
                c.request(Command.GET_TENSOR, {"buffer": 1, "offset": 0, "size": MiB}),
                c.request(Command.GET_TENSOR, {"buffer": 1, "offset": 0, "size": 16}))
            assert len(big[1]) == MiB and small[1] == bytes([16]) * 16
            state["lie"] = True
            big = asyncio.ensure_future(c.request(Command.GET_TENSOR, {"buffer": 1, "offset": 0, "size": MiB}))
            with pytest.raises(PeerFailed) as info:
                await c.request(Command.GET_TENSOR, {"buffer": 1, "offset": 0, "size": 16})
            with pytest.raises(PeerFailed):
                await big  # the same connection: failed with it
            return info.value
        finally:
            await c.aclose()

    try:
        exc = run(scenario())
    finally:
        worker.close()
    assert exc.kind == "protocol" and "GET_TENSOR" in exc.message and "at most 16" in exc.message, exc.message
