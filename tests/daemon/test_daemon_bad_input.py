"""A live daemon against hostile and broken clients. After every case the daemon
process must still be alive and serve a normal client correctly."""
from __future__ import annotations

import asyncio
import copy
import os
import socket
import struct
import time

import msgpack
import numpy as np
import pytest

from conftest import SLACK
from ggml_ffi import lib
from rpc_daemon.wire import framing as F
from rpc_daemon.wire import protocol as P
from rpc_daemon.client import RpcClient
from rpc_daemon.wire.protocol import Command, Status
from rpc_helpers import (RawConn, assert_served, check_compute, checked_session, encode_prefix, expect_error,
                         normal_session, open_memfds, raw_session, small_graph, with_buffer)

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

MiB = 1 << 20



def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ---------------------------------------------------------------- framing abuse

def test_random_bytes(d):
    rng = np.random.default_rng(1234)
    junk = rng.integers(0, 256, MiB, dtype=np.uint8).tobytes()
    header_len, blob_len = F.PREFIX.unpack(junk[:12])
    assert header_len > P.Limits().max_header or blob_len > P.Limits().max_blob  # the seed makes it so
    with RawConn(d.port) as conn:
        try:
            conn.send_raw(junk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon hung up mid-send: fine
        frames = conn.wait_closed()
    # the reply, if it was not lost to the reset, names the broken limit
    for f in frames:
        assert f["id"] is None and f["status"] == Status.LIMIT_EXCEEDED, f


@pytest.mark.parametrize("header_len, blob_len, fragment", [
    (10, 2**64 - 1, f"blob_len {2**64 - 1}"),
    (0, 0, "header_len 0"),
    (2**32 - 1, 0, f"header_len {2**32 - 1}"),
])
def test_bad_length_prefix(d, header_len, blob_len, fragment):
    with RawConn(d.port) as conn:
        conn.send_raw(encode_prefix(header_len, blob_len))
        frames = conn.wait_closed()
    assert len(frames) == 1, frames
    assert frames[0]["status"] == Status.LIMIT_EXCEEDED and fragment in frames[0]["error"], frames


def test_bad_length_prefix_after_hello(d):
    with raw_session(d) as conn:
        conn.send_raw(encode_prefix(10, 2**64 - 1))
        frames = conn.wait_closed()
    assert [f["status"] for f in frames] == [Status.LIMIT_EXCEEDED]


@pytest.mark.parametrize("first", [
    {"cmd": int(Command.DEVICE_INFO), "id": 1},
    {"cmd": int(Command.PING), "id": 1},
    {"cmd": int(Command.ALLOC_BUFFER), "id": 1, "size": 4096},
    {"cmd": 999, "id": 1},
    {"id": 1},
])
def test_first_command_not_hello(d, first):
    with RawConn(d.port) as conn:
        conn.send(first)
        frames = conn.wait_closed()
    assert len(frames) == 1, frames
    assert frames[0]["id"] == 1 and frames[0]["status"] == Status.INVALID_REQUEST
    assert "first command must be HELLO" in frames[0]["error"]


def test_bad_msgpack_header_is_not_fatal(d):
    with raw_session(d) as conn:
        body = b"\xc1\xc1\xc1"
        conn.send_raw(encode_prefix(len(body), 5) + body + b"12345")  # the blob is skipped
        h, _ = conn.recv_frame()
        assert h["id"] is None and h["status"] == Status.INVALID_REQUEST and "msgpack" in h["error"]
        body = msgpack.packb([1, 2])
        conn.send_raw(encode_prefix(len(body), 0) + body)
        h, _ = conn.recv_frame()
        assert h["status"] == Status.INVALID_REQUEST and "must be a msgpack map" in h["error"]
        h, _ = conn.call(Command.DEVICE_INFO)
        assert h["status"] == Status.SUCCESS and h["name"] == "CPU"


@pytest.mark.parametrize("cut", ["prefix", "header", "blob"])
def test_truncated_frame_then_close(d, cut):
    conn = raw_session(d)
    h, _ = conn.call(Command.ALLOC_BUFFER, {"size": MiB})
    frame = F.encode_frame({"cmd": int(Command.SET_TENSOR), "id": 9, "buffer": h["buffer"], "offset": 0,
                            "size": MiB}, MiB)
    part = {"prefix": frame[:5], "header": frame[:len(frame) - 3], "blob": frame + b"\1" * 1000}[cut]
    conn.send_raw(part)
    time.sleep(0.05)
    conn.close()


def test_truncated_frames_without_hello(d):
    for part in (b"\x01", encode_prefix(100, 0) + b"\x80" * 10, encode_prefix(5, 2**20) + b"\x81\xa1a\x01\x01"):
        conn = RawConn(d.port)
        conn.send_raw(part)
        conn.close()


# ---------------------------------------------------------------- bad requests, connection stays usable

@pytest.mark.parametrize("cmd, status, fragment", [
    *[(c, Status.UNKNOWN_COMMAND, "unknown command") for c in (99, -1, 2**40)],
    # not an integer: an ill-typed field, like any other (a bool or 5.0 is not SET_TENSOR)
    *[(c, Status.INVALID_REQUEST, "'cmd' must be an integer") for c in ("HELLO", None, [1], 1.5, True, 5.0)],
])
def test_unknown_command(d, cmd, status, fragment):
    with raw_session(d) as conn:
        h, _ = conn.call(cmd, {})
        assert h["status"] == status and fragment in h["error"], h
        h, _ = conn.call(Command.DEVICE_INFO)
        assert h["status"] == Status.SUCCESS and h["name"] == "CPU"
        h, _ = conn.call(Command.ALLOC_BUFFER, {"size": 64})
        assert h["status"] == Status.SUCCESS and h["size"] == 64


def test_set_tensor_out_of_bounds(d):
    with raw_session(d) as conn:
        h, _ = conn.call(Command.ALLOC_BUFFER, {"size": 4096})
        buf = h["buffer"]
        good = bytes(range(16))
        cases = [
            ({"offset": 4000, "size": 200}, b"\xee" * 200, "range [4000, 4200) runs past the end of buffer"),
            ({"offset": 4096, "size": 1}, b"\xee", "runs past the end"),
            ({"offset": 2**63 - 1, "size": 2}, b"\xee\xee", "runs past the end"),
            ({"offset": -1, "size": 1}, b"\xee", "'offset'=-1"),
            ({"offset": 0, "size": 10}, b"\xee" * 20, "size 10 != blob length 20"),
            ({"offset": 0}, b"\xee", "'size' is required"),
            ({"offset": 0, "size": "1"}, b"\xee", "'size' must be an integer"),
        ]
        for fields, blob, msg in cases:
            h, _ = conn.call(Command.SET_TENSOR, dict(fields, buffer=buf), blob)
            assert h["status"] == Status.INVALID_REQUEST and msg in h["error"], (fields, h)
        # pipelined: the bad one is checked on the queued (not direct) path too
        conn.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": 16}, good)
        conn.request(Command.SET_TENSOR, {"buffer": buf, "offset": 4090, "size": 16}, b"\xee" * 16)
        conn.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": 8}, b"\xee" * 16)
        conn.request(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": 4096})
        replies = [conn.recv_frame() for _ in range(4)]
        assert [r[0]["status"] for r in replies] == [Status.SUCCESS, Status.INVALID_REQUEST,
                                                     Status.INVALID_REQUEST, Status.SUCCESS]
        assert replies[3][1] == good + bytes(4096 - 16)  # nothing of the refused writes landed
        for cmd, fields in [(Command.GET_TENSOR, {"offset": 4095, "size": 2}),
                            (Command.COPY_TENSOR, {"offset": 0, "size": 16, "src_buffer": buf, "src_offset": 4090}),
                            (Command.COPY_TENSOR, {"offset": 4090, "size": 16, "src_buffer": buf, "src_offset": 0})]:
            h, _ = conn.call(cmd, dict(fields, buffer=buf))
            assert h["status"] == Status.INVALID_REQUEST and "runs past the end" in h["error"], h
        h, _ = conn.call(Command.SET_TENSOR, {"buffer": buf, "offset": 4080, "size": 16}, good)
        assert h["status"] == Status.SUCCESS
        h, out = conn.call(Command.GET_TENSOR, {"buffer": buf, "offset": 4080, "size": 16})
        assert h["status"] == Status.SUCCESS and out == good


def test_other_clients_buffer_is_out_of_reach(d):
    async def scenario():
        a = await RpcClient.connect(d.endpoint)
        b = await RpcClient.connect(d.endpoint)
        try:
            h, _ = await a.request(Command.ALLOC_BUFFER, {"size": 4096})
            abuf = h["buffer"]
            secret = np.arange(1024, dtype=np.float32)
            await a.request(Command.SET_TENSOR, {"buffer": abuf, "offset": 0, "size": 4096}, secret.tobytes())
            h, _ = await b.request(Command.ALLOC_BUFFER, {"size": 4096})
            bbuf = h["buffer"]
            assert bbuf != abuf
            not_yours = f"buffer {abuf} is not a buffer of this connection"
            await expect_error(b.request(Command.SET_TENSOR, {"buffer": abuf, "offset": 0, "size": 16}, b"\xff" * 16),
                               Status.INVALID_REQUEST, not_yours)
            await expect_error(b.request(Command.GET_TENSOR, {"buffer": abuf, "offset": 0, "size": 16}),
                               Status.INVALID_REQUEST, not_yours)
            await expect_error(b.request(Command.COPY_TENSOR, {"buffer": bbuf, "offset": 0, "size": 16,
                                                               "src_buffer": abuf, "src_offset": 0}),
                               Status.INVALID_REQUEST, not_yours)
            await expect_error(b.request(Command.COPY_TENSOR, {"buffer": abuf, "offset": 0, "size": 16,
                                                               "src_buffer": bbuf, "src_offset": 0}),
                               Status.INVALID_REQUEST, not_yours)
            await expect_error(b.request(Command.BUFFER_CLEAR, {"buffer": abuf, "value": 1}),
                               Status.INVALID_REQUEST, not_yours)
            await expect_error(b.request(Command.FREE_BUFFER, {"buffer": abuf}), Status.INVALID_REQUEST, not_yours)
            # a graph reading A's buffer
            _, idx, fields, yb, _ = small_graph(abuf, 0)
            await expect_error(b.request(Command.GRAPH_COMPUTE, fields, yb), Status.INVALID_REQUEST,
                               f"tensors[{idx['x']}]", not_yours)
            # a graph writing its result into A's buffer
            _, idx, fields, yb, _ = small_graph(bbuf, 0)
            fields = copy.deepcopy(fields)
            fields["tensors"][idx["z"]].update(buffer=abuf, offset=0)
            await expect_error(b.request(Command.GRAPH_COMPUTE, fields, yb), Status.INVALID_REQUEST,
                               f"tensors[{idx['z']}]", not_yours)
            # ... and a view into A's buffer
            fields = copy.deepcopy(fields)
            fields["tensors"][idx["z"]].update(buffer=abuf, offset=0, view_src=idx["x"], view_offs=0)
            await expect_error(b.request(Command.GRAPH_COMPUTE, fields, yb), Status.INVALID_REQUEST)
            # A's data is unchanged, and B still works
            _, out = await a.request(Command.GET_TENSOR, {"buffer": abuf, "offset": 0, "size": 4096})
            assert out == secret.tobytes()
            await check_compute(a, abuf, 0, secret[:12])
            await b.request(Command.SET_TENSOR, {"buffer": bbuf, "offset": 0, "size": 48}, secret[100:112].tobytes())
            await check_compute(b, bbuf, 0, secret[100:112])
        finally:
            await a.aclose()
            await b.aclose()

    run(scenario())


def _cycle(t, idx):
    t[idx["s"]]["src"] = [idx["s"], idx["y"]]
    return idx["s"], "src index"


def _cycle_forward(t, idx):
    t[idx["s"]]["src"] = [idx["x"], idx["z"]]
    return idx["s"], "must name an earlier tensor"


def _src_out_of_range(t, idx):
    t[idx["z"]]["src"] = [idx["s"], 1000]
    return idx["z"], "src index 1000"


def _src_negative(t, idx):
    t[idx["z"]]["src"] = [-7, idx["y"]]
    return idx["z"], "src index -7"


def _invalid_op(t, idx):
    t[idx["z"]]["op"] = lib.GGML_OP_COUNT + 5
    return idx["z"], "is not a ggml op"


def _unsupported_op(t, idx):
    t[idx["z"]]["op"] = lib.GGML_OP_CONV_TRANSPOSE_1D
    return idx["z"], "CONV_TRANSPOSE_1D is not supported"


def _invalid_type(t, idx):
    t[idx["y"]]["type"] = 4  # removed Q4_2
    return idx["y"], "type 4 is not a ggml type"


def _invalid_type_big(t, idx):
    t[idx["s"]]["type"] = 10**9
    return idx["s"], "is not a ggml type"


def _huge_ne(t, idx):
    t[idx["y"]]["ne"] = [4, 1 << 41, 1, 1]
    return idx["y"], "ne value"


def _huge_elements(t, idx):
    t[idx["y"]]["ne"] = [1 << 20, 1 << 20, 1 << 20, 1]
    return idx["y"], "elements"


def _huge_ne_overflow(t, idx):
    t[idx["s"]]["ne"] = [2**64 - 1, 1, 1, 1]
    return idx["s"], "ne value"


@pytest.mark.parametrize("mutate", [_cycle, _cycle_forward, _src_out_of_range, _src_negative, _invalid_op,
                                    _unsupported_op, _invalid_type, _invalid_type_big, _huge_ne, _huge_elements,
                                    _huge_ne_overflow])
def test_bad_graph(d, mutate):
    async def scenario(c, buf):
        x = np.arange(12, dtype=np.float32) * 3
        await c.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": 48}, x.tobytes())
        _, idx, fields, yb, _ = small_graph(buf, 0)
        fields = copy.deepcopy(fields)
        bad_index, fragment = mutate(fields["tensors"], idx)
        for graph_id in (0, 5):
            await expect_error(c.request(Command.GRAPH_COMPUTE, dict(fields, graph_id=graph_id), yb),
                               Status.INVALID_REQUEST, f"tensors[{bad_index}]", fragment)
        # a refused graph is not cached
        await expect_error(c.request(Command.GRAPH_RECOMPUTE, {"graph_id": 5, "inputs": fields["inputs"],
                                                               "outputs": fields["outputs"]}, yb),
                           Status.NOT_FOUND)
        await check_compute(c, buf, 0, x)
        await check_compute(c, buf, 0, x, graph_id=5)

    run(with_buffer(d.endpoint, scenario))


def test_graph_input_errors(d):
    async def scenario(c, buf):
        _, idx, fields, yb, _ = small_graph(buf, 0)
        cases = [
            (dict(fields, inputs=[]), yb, f"no data for input tensor {idx['y']}"),
            (dict(fields, inputs=[[idx["y"], 0, 48]]), yb[:40], "outside the blob of 40 bytes"),
            (dict(fields, inputs=[[idx["y"], 0, 44]]), yb, "needs 48 bytes, got 44"),
            (dict(fields, inputs=[[idx["x"], 0, 48]]), yb, f"tensor {idx['x']} is not an input leaf"),
            (dict(fields, outputs=[99]), yb, "outputs[0]=99"),
            (dict(fields, tensors="nope"), yb, "'tensors' must be a list"),
            (dict(fields, graph_id=-1), yb, "'graph_id'=-1"),
        ]
        for f, blob, msg in cases:
            await expect_error(c.request(Command.GRAPH_COMPUTE, f, blob), Status.INVALID_REQUEST, msg)
        await expect_error(c.request(Command.GRAPH_RECOMPUTE, {"graph_id": 77}), Status.NOT_FOUND)
        await check_compute(c, buf, 0, np.zeros(12, np.float32))

    run(with_buffer(d.endpoint, scenario))


@pytest.mark.parametrize("version", [P.PROTOCOL_VERSION + 1, 0, "1", None])
def test_hello_wrong_version(d, version):
    with RawConn(d.port, timeout=5) as conn:
        fields = {} if version is None else {"version": version}
        h, _ = conn.call(Command.HELLO, fields)
        assert h["status"] == Status.VERSION_MISMATCH, h
        assert h["version"] == P.PROTOCOL_VERSION and "not supported" in h["error"]
        assert conn.wait_closed() == []


@pytest.mark.parametrize("theirs", [{"version": "0.20.2", "op_table": "0" * 16}, {"version": "0.25.3"}, "0.25.3"])
def test_hello_from_another_ggml_is_refused(d, theirs):
    """A client whose ggml op table differs (an older ggml: other op numbers) is refused at
    HELLO, closed, told both versions; the daemon serves the next client."""
    from ggml_ffi import ggml_identity

    with RawConn(d.port, timeout=5) as conn:
        h, _ = conn.call(Command.HELLO, {"version": P.PROTOCOL_VERSION, "ggml": theirs})
        assert h["status"] == Status.VERSION_MISMATCH, h
        assert h["ggml"] == ggml_identity(), h
        if isinstance(theirs, dict) and "op_table" in theirs:
            assert "ggml mismatch" in h["error"] and "0.20.2" in h["error"] and ggml_identity()["version"] in h["error"]
        assert conn.wait_closed() == []
    with RawConn(d.port, timeout=5) as conn:
        h, _ = conn.call(Command.HELLO, {"version": P.PROTOCOL_VERSION, "ggml": ggml_identity()})
        assert h["status"] == Status.SUCCESS and h["ggml"] == ggml_identity(), h


def test_client_leaves_without_reading_reply(d):
    """GET_TENSOR of 64 MiB, then close at once: the daemon's write fails (EPIPE or
    ECONNRESET), which must not kill it (no SIGPIPE) nor wedge it."""
    for linger in (False, True, False):
        conn = raw_session(d)
        h, _ = conn.call(Command.ALLOC_BUFFER, {"size": 64 * MiB})
        assert h["status"] == Status.SUCCESS, h
        buf = h["buffer"]
        h, _ = conn.call(Command.BUFFER_CLEAR, {"buffer": buf, "value": 0x5A})
        assert h["status"] == Status.SUCCESS, h
        if linger:  # close with RST instead of FIN
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.request(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": 64 * MiB})
        conn.close()
        assert d.alive()


def test_fifty_clients_at_once(d):
    """50 clients connected at the same time (all HELLOs answered before any
    session starts, so the daemon holds 50 connections at once), then all 50
    sessions run together and every answer is checked. A daemon that served
    connections one after another, or let one client's wait hold the others,
    fails the connect (5 s) or liveness (10 s) bound of some client, or the
    run's timeout."""
    async def all_of_them():
        clients = await asyncio.gather(*(RpcClient.connect(d.endpoint, liveness_timeout=10.0) for _ in range(50)))
        try:
            assert all(c.server_hello["status"] == Status.SUCCESS for c in clients)
            await asyncio.gather(*(checked_session(c, seed=i) for i, c in enumerate(clients)))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    run(all_of_them(), timeout=120)
    assert d.alive()


# ---------------------------------------------------------------- idle clients

def test_idle_clients_are_dropped(start_daemon):
    d = start_daemon("-t", "1", "--idle-timeout", "1")
    t0 = time.monotonic()
    silent = RawConn(d.port)  # never says anything
    quiet = raw_session(d)  # says HELLO, then nothing
    assert_served(d)  # meanwhile others are served
    assert silent.wait_closed(timeout=6) == []
    t_silent = time.monotonic() - t0
    assert quiet.wait_closed(timeout=6) == []
    t_quiet = time.monotonic() - t0
    assert 0.9 < t_silent < 4.5 * SLACK and 0.9 < t_quiet < 4.5 * SLACK, (t_silent, t_quiet)
    silent.close()
    quiet.close()
    assert_served(d)


def test_active_client_is_not_dropped(start_daemon):
    d = start_daemon("-t", "1", "--idle-timeout", "1")
    with raw_session(d) as conn:
        for _ in range(7):  # 2 s of activity, longer than the idle timeout
            h, _ = conn.call(Command.PING)
            assert h["status"] == Status.SUCCESS
            time.sleep(0.3)
        h, _ = conn.call(Command.DEVICE_INFO)
        assert h["status"] == Status.SUCCESS


# ---------------------------------------------------------------- memory cap

async def free_memory(c: RpcClient) -> int:
    h, _ = await c.request(Command.DEVICE_INFO)
    assert h["total_memory"] == h["max_buffer_size"]
    return h["free_memory"]


async def wait_free_memory(c: RpcClient, want: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout * SLACK
    got = None
    while time.monotonic() < deadline:
        got = await free_memory(c)
        if got == want:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"free_memory {got}, expected {want}")


def test_mem_cap(start_daemon):
    d = start_daemon("-t", "1", "-m", "1", "--no-huge-pages")  # 4 KiB pages: a 1 MiB cap holds buffers

    async def scenario():
        c = await RpcClient.connect(d.endpoint)
        try:
            h, _ = await c.request(Command.DEVICE_INFO)
            assert h["total_memory"] == MiB and h["free_memory"] == MiB
            await expect_error(c.request(Command.ALLOC_BUFFER, {"size": 2 * MiB}), Status.ALLOC_FAILED,
                               f"cannot allocate {2 * MiB} bytes")
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": MiB // 2})
            b1 = h["buffer"]
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": MiB // 2})
            b2 = h["buffer"]
            assert await free_memory(c) == 0
            await expect_error(c.request(Command.ALLOC_BUFFER, {"size": 1}), Status.ALLOC_FAILED)
            await c.request(Command.FREE_BUFFER, {"buffer": b1})
            assert await free_memory(c) == MiB // 2
            await expect_error(c.request(Command.ALLOC_BUFFER, {"size": MiB // 2 + 1}), Status.ALLOC_FAILED)
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": MiB // 2})
            b3 = h["buffer"]
            await expect_error(c.request(Command.FREE_BUFFER, {"buffer": b1}), Status.INVALID_REQUEST)  # twice
            for b in (b2, b3):
                await c.request(Command.FREE_BUFFER, {"buffer": b})
            assert await free_memory(c) == MiB
            # a graph's intermediates count against the cap too: leave them room
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": MiB - 4096})
            x = np.arange(12, dtype=np.float32)
            at = MiB - 4096 - 48
            await c.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": at, "size": 48}, x.tobytes())
            await check_compute(c, h["buffer"], at, x)
        finally:
            await c.aclose()

    run(scenario())
    run(_served_when_free(d))


def outer_product_graph(n: int):
    """z = a x b (mul_mat of two inline [1, n] f32 vectors): 8n bytes in, a 4n*n-byte intermediate."""
    from ggml_ffi import Context
    from rpc_daemon.wire.graph_codec import encode_graph

    ctx = Context(8)
    try:
        a = ctx.new_tensor(lib.GGML_TYPE_F32, [1, n], "a")
        b = ctx.new_tensor(lib.GGML_TYPE_F32, [1, n], "b")
        for t in (a, b):
            lib.ggml_set_input(t)
        z = lib.ggml_mul_mat(ctx.ptr, a, b)
        lib.ggml_set_output(z)
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, z)
        tensors, index_of = encode_graph(gf, lambda t: None)
        ia, ib, iz = index_of[a], index_of[b], index_of[z]
    finally:
        ctx.close()
    va, vb = np.linspace(-1, 1, n, dtype=np.float32), np.linspace(2, 3, n, dtype=np.float32)
    fields = {"tensors": tensors, "inputs": [[ia, 0, 4 * n], [ib, 4 * n, 4 * n]], "outputs": [iz]}
    return fields, va.tobytes() + vb.tobytes(), np.outer(vb, va)


def test_mem_cap_counts_compute_memory(start_daemon):
    """--mem covers what a graph's intermediates take in the compute process, not only client buffers: a
    graph whose compute buffer does not fit is refused (ALLOC_FAILED, saying so) before any compute, and a
    graph that fits shows up in free_memory until it is freed."""
    d = start_daemon("-t", "1", "-m", "2", "--no-huge-pages")  # 4 KiB pages: a 2 MiB cap holds buffers

    async def scenario():
        c = await RpcClient.connect(d.endpoint)
        try:
            big, big_blob, _ = outer_product_graph(1024)  # a 4 MiB intermediate under a 2 MiB cap
            await expect_error(c.request(Command.GRAPH_COMPUTE, dict(big, graph_id=1), big_blob), Status.ALLOC_FAILED,
                               "compute memory", "--mem")
            await expect_error(c.request(Command.GRAPH_RECOMPUTE, {"graph_id": 1, "inputs": big["inputs"],
                                                                   "outputs": big["outputs"]}, big_blob),
                               Status.ALLOC_FAILED, "compute memory")  # the cached graph: refused again, no crash
            assert await free_memory(c) == 2 * MiB
            small, small_blob, expect = outer_product_graph(256)  # 256 KiB
            h, out = await c.request(Command.GRAPH_COMPUTE, dict(small, graph_id=2), small_blob)
            np.testing.assert_allclose(np.frombuffer(out, np.float32).reshape(256, 256), expect, rtol=1e-6)
            held = 2 * MiB - await free_memory(c)
            assert 256 << 10 <= held < MiB
            await expect_error(c.request(Command.ALLOC_BUFFER, {"size": 2 * MiB - held + 1}), Status.ALLOC_FAILED,
                               "held by compute")
            await c.request(Command.GRAPH_FREE, {"graph_id": 2})
            await c.request(Command.GRAPH_FREE, {"graph_id": 1})
            await wait_free_memory(c, 2 * MiB)  # the compute process dropped the graph: the memory is back
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 2 * MiB})
        finally:
            await c.aclose()

    run(scenario())
    assert_served(d)


def test_mem_cap_compute_and_buffer_race(start_daemon):
    """A graph's first compute (6.4 MiB of intermediates) and another client's 6 MiB buffer each fit an
    8 MiB cap alone: sent together, exactly one is admitted, whichever order the daemon serves them in."""
    d = start_daemon("-t", "1", "-m", "8")

    async def scenario():
        a = await RpcClient.connect(d.endpoint)
        b = await RpcClient.connect(d.endpoint)
        try:
            for attempt in range(3):
                g, blob, _ = outer_product_graph(1300)
                comp = asyncio.ensure_future(a.request(Command.GRAPH_COMPUTE, dict(g, graph_id=1), blob))
                await asyncio.sleep(0.002 * attempt)
                alloc = asyncio.ensure_future(b.request(Command.ALLOC_BUFFER, {"size": 6 * MiB}))
                got = await asyncio.gather(comp, alloc, return_exceptions=True)
                ok = [not isinstance(r, Exception) for r in got]
                assert ok.count(True) == 1, got
                assert all(r.status == Status.ALLOC_FAILED for r in got if isinstance(r, Exception)), got
                h, _ = await b.request(Command.DEVICE_INFO)
                assert h["free_memory"] <= 2 * MiB, h  # one of the two holds its 6+ MiB
                if ok[1]:
                    await b.request(Command.FREE_BUFFER, {"buffer": got[1][0]["buffer"]})
                await a.request(Command.GRAPH_FREE, {"graph_id": 1})
                await wait_free_memory(b, 8 * MiB)
        finally:
            await a.aclose()
            await b.aclose()

    run(scenario())


async def _served_when_free(d):
    """A normal session needs 4 KiB: it fits once the last client's 1 MiB is freed."""
    c = await RpcClient.connect(d.endpoint)
    try:
        await wait_free_memory(c, MiB)
    finally:
        await c.aclose()
    await normal_session(d.endpoint)


def _disconnect_after_alloc(port):
    conn = raw_session_port(port)
    conn.call(Command.ALLOC_BUFFER, {"size": MiB // 2})
    conn.call(Command.ALLOC_BUFFER, {"size": MiB // 4})
    conn.close()


def _disconnect_after_set_tensor(port):
    conn = raw_session_port(port)
    h, _ = conn.call(Command.ALLOC_BUFFER, {"size": MiB})
    h, _ = conn.call(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": 4096}, b"\x11" * 4096)
    assert h["status"] == Status.SUCCESS
    conn.close()


def _disconnect_mid_set_tensor(port):
    conn = raw_session_port(port)
    h, _ = conn.call(Command.ALLOC_BUFFER, {"size": MiB})
    conn.send_raw(F.encode_frame({"cmd": int(Command.SET_TENSOR), "id": 50, "buffer": h["buffer"], "offset": 0,
                                  "size": MiB}, MiB) + b"\x22" * 5000)
    time.sleep(0.05)
    conn.close()


def _disconnect_after_compute(port):
    async def scenario():
        c = await RpcClient.connect(f"127.0.0.1:{port}")
        h, _ = await c.request(Command.ALLOC_BUFFER, {"size": MiB - 4096})  # room for the graph's intermediates
        x = np.ones(12, np.float32)
        await c.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": 48}, x.tobytes())
        await check_compute(c, h["buffer"], 0, x, graph_id=3)
        await c.aclose()

    run(scenario())


def _disconnect_without_reading(port):
    conn = raw_session_port(port)
    h, _ = conn.call(Command.ALLOC_BUFFER, {"size": MiB})
    conn.request(Command.GET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": MiB})
    conn.close()


def raw_session_port(port) -> RawConn:
    conn = RawConn(port)
    conn.hello()
    return conn


def memfd_bytes(pid: int) -> int:
    """Bytes in the client arenas (memfds) the daemon holds open."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "ggml-rpc-" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                n += os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
        except OSError:
            pass
    return n


@pytest.mark.parametrize("leave", [_disconnect_after_alloc, _disconnect_after_set_tensor, _disconnect_mid_set_tensor,
                                   _disconnect_after_compute, _disconnect_without_reading])
def test_disconnect_frees_buffers(start_daemon, leave):
    """Every way of leaving frees the client's buffers and its connection slot:
    with --max-clients 2 and a watcher connected, a leaked connection would lock
    the next client out."""
    d = start_daemon("-t", "1", "-m", "1", "--max-clients", "2", "--no-huge-pages")  # 4 KiB pages

    async def watch():
        watcher = await RpcClient.connect(d.endpoint)
        try:
            assert await free_memory(watcher) == MiB
            for _ in range(3):
                await asyncio.get_running_loop().run_in_executor(None, leave, d.port)
                await wait_free_memory(watcher, MiB)
            # and the memory really is usable again
            h, _ = await watcher.request(Command.ALLOC_BUFFER, {"size": MiB})
            await watcher.request(Command.FREE_BUFFER, {"buffer": h["buffer"]})
            # the leavers' arenas are closed; the watcher's own (its memfd and the mmap's duplicate)
            # holds no pages now that its buffer is freed
            deadline = time.monotonic() + 5 * SLACK
            while open_memfds(d.proc.pid) > 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert open_memfds(d.proc.pid) == 2, "departed clients' memory is still mapped"
            assert memfd_bytes(d.proc.pid) == 0, "a freed buffer's pages are still held"
        finally:
            await watcher.aclose()

    run(watch())
    assert_served(d)
    assert not any("Traceback" in line for line in d.log_lines), "".join(d.log_lines[-30:])


def test_pipelined_flood_in_one_write_answered_in_order(d):
    """3000 small requests in one write (far more than one receive and than the per-connection queue
    bound): the daemon parses at most a queue's worth, pauses, and resumes with the bytes it kept, so every
    request is answered, once, in order."""
    conn = RawConn(d.port)
    try:
        conn.hello()
        ids = list(range(100, 3100))
        conn.send_raw(b"".join(F.encode_frame({"cmd": int(Command.PING), "id": i}) if i % 3 == 0 else
                               F.encode_frame({"cmd": int(Command.DEVICE_INFO), "id": i}) for i in ids))
        got = [conn.recv_frame()[0] for _ in ids]
        # PINGs are answered at once when parsed, queued commands in queue order: ids stay in order per kind
        assert [h["id"] for h in got if h["id"] % 3] == [i for i in ids if i % 3]
        assert sorted(h["id"] for h in got) == ids
        assert all(h["status"] == Status.SUCCESS for h in got)
    finally:
        conn.close()
    assert_served(d)


class PlainTransport:
    """The asyncio transport surface a daemon Connection uses, for driving it without sockets. With
    `high_water`, writes past it call the protocol's pause_writing, as a peer that reads nothing causes."""

    def __init__(self, protocol, high_water: int | None = None):
        self.protocol, self.high_water = protocol, high_water
        self.out, self.paused, self.closing, self.events = bytearray(), False, False, []

    def write(self, data):
        self.out += data
        if self.high_water is not None and len(self.out) > self.high_water and "pause_writing" not in self.events:
            self.events.append("pause_writing")
            self.protocol.pause_writing()

    def writelines(self, parts):
        self.write(b"".join(bytes(p) for p in parts))

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True

    abort = close

    def pause_reading(self):
        self.paused = True
        self.events.append("pause_reading")

    def resume_reading(self):
        self.paused = False
        self.events.append("resume_reading")

    def is_reading(self):
        return not self.paused and not self.closing

    def get_write_buffer_size(self):
        return len(self.out)

    def get_extra_info(self, key, default=None):
        return ("127.0.0.1", 1) if key == "peername" else None


def test_queue_bound_holds_within_one_receive():
    """Sans-I/O, on the connection object: one 64 KiB receive full of small requests queues no more than
    the bound, and the rest is parsed once the queue drains."""
    from rpc_daemon.daemon.config import DaemonConfig
    from rpc_daemon.daemon.connection import MAX_QUEUED, Connection, Daemon

    async def scenario():
        daemon = Daemon(DaemonConfig(max_requests_per_second=0))
        conn = Connection(daemon)
        transport = PlainTransport(conn)
        conn.connection_made(transport)
        try:
            data = F.encode_frame({"cmd": int(Command.HELLO), "id": 0, "version": P.PROTOCOL_VERSION}) + \
                b"".join(F.encode_frame({"cmd": int(Command.DEVICE_INFO), "id": i}) for i in range(1, 5000))
            buf = conn.get_buffer(-1)
            n = len(buf)
            buf[:n] = data[:n]
            conn.buffer_updated(n)
            assert transport.paused and conn.queue.qsize() == MAX_QUEUED + 1, conn.queue.qsize()
            for _ in range(2000):  # the worker task drains the queue, and parsing resumes from the kept bytes
                if not transport.paused and conn.queue.empty():
                    break
                await asyncio.sleep(0)
            assert conn.queue.qsize() <= MAX_QUEUED + 1
            frames, replies, pos = F.FrameReader(P.Limits()), [], 0
            while pos < len(transport.out):
                room = frames.buffer()
                k = min(len(room), len(transport.out) - pos)
                room[:k] = transport.out[pos: pos + k]
                pos += k
                replies += frames.received(k)
            complete = n // len(F.encode_frame({"cmd": int(Command.DEVICE_INFO), "id": 4999}))
            assert [h["id"] for h, _ in replies][: complete] == list(range(complete))
        finally:
            conn.connection_lost(None)
            daemon.close()

    asyncio.run(scenario())


def test_graph_over_more_buffers_than_one_message_carries(d):
    """A graph whose tensors live in 300 buffers (more than one message could carry descriptors for, when
    each buffer was a memfd of its own; now they are ranges of the client's one arena), and the sum over all
    of them is right."""
    from ggml_ffi import Context
    from rpc_daemon.wire.graph_codec import encode_graph

    n_bufs = 300
    values = np.arange(n_bufs * 4, dtype=np.float32).reshape(n_bufs, 4) / 7

    async def scenario():
        c = await RpcClient.connect(d.endpoint)
        try:
            bufs = []
            for row in values:
                h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 4096})
                await c.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": 16}, row.tobytes())
                bufs.append(h["buffer"])
            ctx = Context(2 * n_bufs + 8)
            try:
                xs = [ctx.new_tensor(lib.GGML_TYPE_F32, [4], f"x{i}") for i in range(n_bufs)]
                total = xs[0]
                for x in xs[1:]:
                    total = lib.ggml_add(ctx.ptr, total, x)
                lib.ggml_set_output(total)
                gf = ctx.new_graph(2 * n_bufs)
                lib.ggml_build_forward_expand(gf, total)
                where = {x: (b, 0) for x, b in zip(xs, bufs)}
                tensors, index_of = encode_graph(gf, where.get)
                out_index = index_of[total]
            finally:
                ctx.close()
            h, out = await c.request(Command.GRAPH_COMPUTE, {"tensors": tensors, "outputs": [out_index]})
            expect = np.zeros(4, np.float32)
            for row in values:
                expect = expect + row
            np.testing.assert_array_equal(np.frombuffer(out, np.float32), expect)
        finally:
            await c.aclose()

    run(scenario())
    assert_served(d)


def test_kept_bytes_do_not_resume_reading_for_a_client_that_reads_nothing():
    """Parsing the bytes kept past a full queue answers PINGs on the spot; when those replies fill the write
    buffer (pause_writing), reading stays paused: a client that reads none of its replies cannot make the
    daemon's write buffer grow by sending more."""
    from rpc_daemon.daemon.config import DaemonConfig
    from rpc_daemon.daemon.connection import Connection, Daemon

    async def scenario():
        daemon = Daemon(DaemonConfig(max_requests_per_second=0))
        conn = Connection(daemon)
        transport = PlainTransport(conn, high_water=64 << 10)
        conn.connection_made(transport)
        try:
            hello = F.encode_frame({"cmd": int(Command.HELLO), "id": 0, "version": P.PROTOCOL_VERSION})
            buf = conn.get_buffer(-1)  # before HELLO the receive buffer is small (a frame is at most ~4 KiB)
            buf[: len(hello)] = hello
            conn.buffer_updated(len(hello))
            data = b"".join(F.encode_frame({"cmd": int(Command.DEVICE_INFO), "id": i}) for i in range(1, 66))
            ping = F.encode_frame({"cmd": int(Command.PING), "id": 7})
            buf = conn.get_buffer(-1)
            data += ping * ((len(buf) - len(data)) // len(ping))
            buf[: len(data)] = data
            conn.buffer_updated(len(data))
            for _ in range(500):
                await asyncio.sleep(0)
            assert "pause_writing" in transport.events, transport.events
            assert transport.paused, transport.events  # still not reading
            assert transport.events[-1] == "pause_reading", transport.events
        finally:
            conn.connection_lost(None)
            daemon.close()

    asyncio.run(scenario())


def test_alloc_right_after_graph_free_sees_the_memory_free(start_daemon):
    """GRAPH_FREE then, pipelined behind it, an ALLOC_BUFFER that fits only once the graph's intermediates
    are gone: the allocation waits for the compute process to drop the graph, and succeeds."""
    d = start_daemon("-t", "1", "-m", "8")

    async def scenario():
        c = await RpcClient.connect(d.endpoint)
        try:
            g, blob, _ = outer_product_graph(1300)  # 6.4 MiB of intermediates
            await c.request(Command.GRAPH_COMPUTE, dict(g, graph_id=1), blob)
            _, (h, _) = await asyncio.gather(c.request(Command.GRAPH_FREE, {"graph_id": 1}),
                                             c.request(Command.ALLOC_BUFFER, {"size": 6 * MiB}))
            assert h["size"] == 6 * MiB
        finally:
            await c.aclose()

    run(scenario())
