"""Security: the published llama.cpp rpc-server advisories translated to our
protocol, authentication, TLS, the bind-address rule, limits and row-id checks.

Every attack case gets an error reply, and afterwards the daemon still serves a
normal client correctly. All daemons listen on 127.0.0.1; 0.0.0.0 is used only
to see the daemon refuse to start (it exits before listening).
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import hmac
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SLACK, DaemonProcess
from ggml_ffi import Context, lib
from rpc_daemon.wire import auth as A
from rpc_daemon.wire import framing as F
from rpc_daemon.wire import protocol as P
from rpc_daemon.validation import row_ids
from rpc_daemon.client import PeerFailed, RpcClient
from rpc_daemon.wire.graph_codec import encode_graph
from rpc_daemon.wire.protocol import Command, Status
from rpc_daemon.daemon.ratelimit import TokenBucket
from rpc_daemon.wire.tls import client_context
from rpc_helpers import (SECRET, RawConn, assert_served, check_compute, checked_session, expect_error,
                         open_memfds, raw_session, small_graph, with_buffer)

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

MiB = 1 << 20
WRONG = b"incorrect horse battery staple 98765432"


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))





@pytest.fixture(scope="module")
def authd(secret_file):
    """A daemon that requires the shared secret (no TLS)."""
    d = DaemonProcess("-t", "1", "-m", "256", "--secret-file", secret_file)
    yield d
    d.stop()
    d.kill()


@pytest.fixture(scope="module")
def tlsd(secret_file, tls_files):
    """A daemon with the shared secret and TLS."""
    d = DaemonProcess("-t", "1", "-m", "256", "--secret-file", secret_file, "--tls-cert", tls_files.cert,
                      "--tls-key", tls_files.key)
    yield d
    d.stop()
    d.kill()


def served_with(d, **connect) -> None:
    """The daemon is alive and a client connecting with `connect` options is served."""
    async def go():
        c = await RpcClient.connect(d.endpoint, liveness_timeout=10.0, **connect)
        try:
            await checked_session(c)
        finally:
            await c.aclose()

    assert d.alive(), "daemon died:\n" + "".join(d.log_lines[-30:])
    run(go())
    assert d.alive()


@contextlib.contextmanager
def attacker_and_victim(d, fill: int):
    """Two sessions, each with a 4 KiB buffer; the victim's is filled with `fill`.
    Yields (conn, its buffer, other, the victim buffer)."""
    with raw_session(d) as conn, raw_session(d) as other:
        h, _ = conn.call(Command.ALLOC_BUFFER, {"size": 4096})
        buf = h["buffer"]
        h, _ = other.call(Command.ALLOC_BUFFER, {"size": 4096})
        victim = h["buffer"]
        other.call(Command.BUFFER_CLEAR, {"buffer": victim, "value": fill})
        yield conn, buf, other, victim


# ================================================================ advisories

def test_write_what_where_set_tensor(d):
    """CVE-2024-42479 (rpc-server set_tensor: write anywhere through a buffer
    base plus an unchecked offset). Ours: every SET_TENSOR range is checked
    against the size of a buffer this connection owns."""
    with attacker_and_victim(d, 0x42) as (conn, buf, other, victim):
        cases = [
            ({"buffer": buf, "offset": 4096, "size": 8}, b"\xee" * 8, Status.INVALID_REQUEST, "runs past the end"),
            ({"buffer": buf, "offset": 2**63 - 8, "size": 8}, b"\xee" * 8, Status.INVALID_REQUEST, "runs past"),
            ({"buffer": buf, "offset": 2**64 - 8, "size": 8}, b"\xee" * 8, Status.INVALID_REQUEST, "'offset'"),
            ({"buffer": buf, "offset": -4096, "size": 8}, b"\xee" * 8, Status.INVALID_REQUEST, "'offset'"),
            ({"buffer": buf, "offset": 0, "size": 2**64 - 1}, b"\xee" * 8, Status.INVALID_REQUEST, "'size'"),
            ({"buffer": victim, "offset": 0, "size": 8}, b"\xee" * 8, Status.INVALID_REQUEST,
             f"buffer {victim} is not a buffer of this connection"),
            ({"buffer": 0, "offset": 0x7F0000000000, "size": 8}, b"\xee" * 8, Status.INVALID_REQUEST, "'buffer'=0"),
            ({"buffer": 10**12, "offset": 0, "size": 8}, b"\xee" * 8, Status.INVALID_REQUEST, "not a buffer"),
        ]
        for fields, blob, status, fragment in cases:
            h, _ = conn.call(Command.SET_TENSOR, fields, blob)
            assert h["status"] == status and fragment in h["error"], (fields, h)
            if fields["size"] == 8:  # COPY_TENSOR is the same write primitive
                h, _ = conn.call(Command.COPY_TENSOR, dict(fields, src_buffer=buf, src_offset=0))
                assert h["status"] == Status.INVALID_REQUEST, (fields, h)
        _, out = conn.call(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": 4096})
        assert out == bytes(4096)  # none of the refused writes landed
        _, out = other.call(Command.GET_TENSOR, {"buffer": victim, "offset": 0, "size": 4096})
        assert out == b"\x42" * 4096


def test_arbitrary_read_get_tensor(d):
    """CVE-2024-42478 (rpc-server get_tensor: read anywhere). Ours: a refused
    read returns an error and not one byte of data."""
    with attacker_and_victim(d, 0x5E) as (conn, buf, other, victim):
        for fields, fragment in [
            ({"buffer": buf, "offset": 4000, "size": 200}, "runs past the end"),
            ({"buffer": buf, "offset": 0, "size": 1 << 40}, "runs past the end"),
            ({"buffer": buf, "offset": 2**63 - 1, "size": 2**63 - 1}, "runs past the end"),
            ({"buffer": buf, "offset": 2**64 - 4096, "size": 4096}, "'offset'"),
            ({"buffer": victim, "offset": 0, "size": 16}, f"buffer {victim} is not a buffer of this connection"),
            ({"buffer": 0, "offset": 0x7F0000000000, "size": 16}, "'buffer'=0"),
        ]:
            h, out = conn.call(Command.GET_TENSOR, fields)
            assert h["status"] == Status.INVALID_REQUEST and fragment in h["error"], (fields, h)
            assert out == b""
            # ... nor through a copy into our own buffer
            h, _ = conn.call(Command.COPY_TENSOR, {"buffer": buf, "offset": 0, "size": fields["size"],
                                                   "src_buffer": fields["buffer"], "src_offset": fields["offset"]})
            assert h["status"] == Status.INVALID_REQUEST, h
        _, out = conn.call(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": 16})
        assert out == bytes(16)


@pytest.mark.parametrize("ttype, ne, nb, fragment", [
    # nbytes = ne * type size past 2**64 in C; our validator computes with Python ints
    (lib.GGML_TYPE_F32, [2**62, 8, 1, 1], None, "ne value"),
    (lib.GGML_TYPE_F32, [2**40, 2**40, 2**40, 2**40], None, "elements"),
    (lib.GGML_TYPE_F32, [2**64 - 1, 1, 1, 1], None, "ne value"),
    (lib.GGML_TYPE_F32, [4, 3, 1, 1], [4, 2**63, 2**63, 2**63], "nb value"),
    (lib.GGML_TYPE_Q4_0, [33, 3, 1, 1], None, "block size"),
    (lib.GGML_TYPE_F32, [0, 3, 1, 1], None, "ne value 0"),
])
def test_type_size_overflow(d, ttype, ne, nb, fragment):
    """CVE-2024-42477 (rpc-server: ggml_nbytes overflow, then a tiny buffer is
    taken as big enough). Ours: ne/nb bounds and element counts with Python ints."""
    async def scenario(c, buf):
        _, idx, fields, yb, _ = small_graph(buf, 0)
        fields = copy.deepcopy(fields)
        for name in ("x", "y"):  # a buffer tensor and an inline input
            tensors = copy.deepcopy(fields["tensors"])
            tensors[idx[name]].update(type=ttype, ne=ne, **({"nb": nb} if nb else {}))
            await expect_error(c.request(Command.GRAPH_COMPUTE, dict(fields, tensors=tensors), yb),
                               Status.INVALID_REQUEST, f"tensors[{idx[name]}]", fragment)
        # and the raw allocation sizes
        for size in (2**64 - 1, 2**63, 0, -1):
            await expect_error(c.request(Command.ALLOC_BUFFER, {"size": size}), Status.INVALID_REQUEST, "'size'")
        await check_compute(c, buf, 0, np.zeros(12, np.float32))

    run(with_buffer(d.endpoint, scenario))


def test_buffer_zero_is_not_a_pointer(d):
    """CVE-2026-34159 (rpc-server: a tensor whose buffer is 0 kept its `data`
    field as a raw pointer). Ours: data outside a client buffer is always the
    daemon's to place; an offset without a buffer is refused."""
    async def scenario(c, buf):
        _, idx, fields, yb, _ = small_graph(buf, 0)
        for name, flags in (("x", 0), ("x", lib.GGML_TENSOR_FLAG_INPUT), ("s", None), ("z", None)):
            tensors = copy.deepcopy(fields["tensors"])
            tensors[idx[name]].update(buffer=0, offset=0x7F00DEAD0000)
            if flags is not None:
                tensors[idx[name]]["flags"] = flags
            for graph_id in (0, 9):
                await expect_error(c.request(Command.GRAPH_COMPUTE, dict(fields, tensors=tensors,
                                                                         graph_id=graph_id), yb),
                                   Status.INVALID_REQUEST, f"tensors[{idx[name]}]", "without a buffer")
        # buffer 0 in the plain commands is no buffer at all
        for cmd, f in [(Command.SET_TENSOR, {"size": 8}), (Command.GET_TENSOR, {"size": 8}),
                       (Command.BUFFER_CLEAR, {}), (Command.FREE_BUFFER, {}),
                       (Command.SET_TENSOR_HASH, {"size": 8, "hash": "0" * 64})]:
            await expect_error(c.request(cmd, dict(f, buffer=0, offset=0x7F00DEAD0000),
                                         b"\0" * 8 if cmd == Command.SET_TENSOR else b""),
                               Status.INVALID_REQUEST, "'buffer'=0")
        await expect_error(c.request(Command.GRAPH_RECOMPUTE, {"graph_id": 9}), Status.NOT_FOUND)
        await check_compute(c, buf, 0, np.zeros(12, np.float32))

    run(with_buffer(d.endpoint, scenario))


def test_use_after_free_through_recompute(d):
    """GHSA-2phh-px2f-2qmx (rpc-server: graph_recompute reused a graph whose
    buffer had been freed). Ours: every recompute re-checks that each buffer
    the cached graph names is still this connection's."""
    async def scenario():
        c = await RpcClient.connect(d.endpoint)
        other = await RpcClient.connect(d.endpoint)
        try:
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 4096})
            buf = h["buffer"]
            x = np.arange(12, dtype=np.float32)
            await c.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": 48}, x.tobytes())
            await check_compute(c, buf, 0, x, graph_id=7)  # cached: in the daemon and the compute process
            _, idx, fields, yb, expect = small_graph(buf, 0, x)
            rec = {"graph_id": 7, "inputs": fields["inputs"], "outputs": fields["outputs"]}
            h, out = await c.request(Command.GRAPH_RECOMPUTE, rec, yb)
            np.testing.assert_array_equal(np.frombuffer(out, np.float32), expect)
            await c.request(Command.FREE_BUFFER, {"buffer": buf})
            # the freed memory is reused by someone else straight away
            h, _ = await other.request(Command.ALLOC_BUFFER, {"size": 4096})
            await other.request(Command.BUFFER_CLEAR, {"buffer": h["buffer"], "value": 0x77})
            for _ in range(2):
                await expect_error(c.request(Command.GRAPH_RECOMPUTE, rec, yb), Status.INVALID_REQUEST,
                                   f"buffer {buf} is not a buffer of this connection")
            # a new buffer does not bring the graph back: ids are never reused
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 4096})
            assert h["buffer"] != buf
            await expect_error(c.request(Command.GRAPH_RECOMPUTE, rec, yb), Status.INVALID_REQUEST, "not a buffer")
            await c.request(Command.GRAPH_FREE, {"graph_id": 7})
            await c.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": 48}, x.tobytes())
            await check_compute(c, h["buffer"], 0, x, graph_id=7)
        finally:
            await c.aclose()
            await other.aclose()

    run(scenario())


# ---------------------------------------------------------------- GET_ROWS / SET_ROWS ids

ROWS = 10


def get_rows_graph(buf: int, n_ids: int = 3, view: bool = False):
    """z = get_rows(a, ids): a f32 [4, ROWS] in `buf` at 0, ids i32 an inline
    input (or, with `view`, a view into an inline input of 2 * n_ids ids
    starting at its element n_ids). Returns (fields, ids index, z index, ids
    nbytes sent inline)."""
    ctx = Context(16)
    try:
        a = ctx.new_tensor(lib.GGML_TYPE_F32, [4, ROWS], "a")
        if view:
            full = ctx.new_tensor(lib.GGML_TYPE_I32, [2 * n_ids], "ids_full")
            lib.ggml_set_input(full)
            ids = lib.ggml_view_1d(ctx.ptr, full, n_ids, 4 * n_ids)
            sent = full
        else:
            ids = sent = ctx.new_tensor(lib.GGML_TYPE_I32, [n_ids], "ids")
            lib.ggml_set_input(ids)
        z = lib.ggml_get_rows(ctx.ptr, a, ids)
        lib.ggml_set_output(z)
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, z)
        tensors, index_of = encode_graph(gf, lambda t: (buf, 0) if t == a else None)
        n_sent = 4 * (2 * n_ids if view else n_ids)
        fields = {"tensors": tensors, "inputs": [[index_of[sent], 0, n_sent]], "outputs": [index_of[z]]}
        return fields, index_of[sent], index_of[z], n_sent
    finally:
        ctx.close()


def set_rows_graph(buf: int, n_ids: int = 3):
    """dst f32 [4, ROWS] in `buf` at 0; dst[ids] = src; src f32 [4, n_ids] and
    ids i64 [n_ids] inline. Returns (fields builder(ids, src), ids index)."""
    ctx = Context(16)
    try:
        dst = ctx.new_tensor(lib.GGML_TYPE_F32, [4, ROWS], "dst")
        src = ctx.new_tensor(lib.GGML_TYPE_F32, [4, n_ids], "src")
        ids = ctx.new_tensor(lib.GGML_TYPE_I64, [n_ids], "kv_idxs")
        lib.ggml_set_input(src)
        lib.ggml_set_input(ids)
        z = lib.ggml_set_rows(ctx.ptr, dst, src, ids)
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, z)
        tensors, index_of = encode_graph(gf, lambda t: (buf, 0) if t == dst else None)
    finally:
        ctx.close()
    i_src, i_ids = index_of[src], index_of[ids]

    def fields(id_values, src_values):
        ib = np.asarray(id_values, np.int64).tobytes()
        sb = np.asarray(src_values, np.float32).tobytes()
        return {"tensors": tensors, "inputs": [[i_src, 0, len(sb)], [i_ids, len(sb), len(ib)]], "outputs": []}, sb + ib

    return fields, i_ids


def test_get_rows_ids_out_of_range(d):
    async def scenario(c, buf):
        a = np.arange(4 * ROWS, dtype=np.float32).reshape(ROWS, 4)
        await c.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": a.nbytes}, a.tobytes())
        fields, i_ids, i_z, n = get_rows_graph(buf)
        good = np.array([0, 9, 4], np.int32)
        h, out = await c.request(Command.GRAPH_COMPUTE, dict(fields, graph_id=3), good.tobytes())
        np.testing.assert_array_equal(np.frombuffer(out, np.float32).reshape(3, 4), a[good])
        for bad, shown in (([0, ROWS, 1], ROWS), ([-1, 2, 3], -1), ([1, 2, 2**31 - 1], 2**31 - 1)):
            blob = np.array(bad, np.int32).tobytes()
            await expect_error(c.request(Command.GRAPH_COMPUTE, dict(fields, graph_id=0), blob),
                                     Status.INVALID_REQUEST, f"tensors[{i_ids}] ('ids')", f"row id {shown}",
                                     f"outside 0..{ROWS - 1}", "GET_ROWS")
            # the cached graph is checked on every recompute too
            await expect_error(c.request(Command.GRAPH_RECOMPUTE, {"graph_id": 3, "inputs": fields["inputs"],
                                                                   "outputs": fields["outputs"]}, blob),
                               Status.INVALID_REQUEST, f"row id {shown}")
        h, out = await c.request(Command.GRAPH_RECOMPUTE, {"graph_id": 3, "inputs": fields["inputs"],
                                                           "outputs": fields["outputs"]}, good.tobytes())
        np.testing.assert_array_equal(np.frombuffer(out, np.float32).reshape(3, 4), a[good])
        # ids that are a view of an inline input: only the viewed part counts
        fields, i_full, _, n = get_rows_graph(buf, view=True)
        ids = np.array([77, -5, 99, 1, 2, 3], np.int32)  # the view sees [1, 2, 3]
        h, out = await c.request(Command.GRAPH_COMPUTE, fields, ids.tobytes())
        np.testing.assert_array_equal(np.frombuffer(out, np.float32).reshape(3, 4), a[[1, 2, 3]])
        ids[4] = ROWS + 5
        await expect_error(c.request(Command.GRAPH_COMPUTE, fields, ids.tobytes()), Status.INVALID_REQUEST,
                           f"row id {ROWS + 5} at [1, 0, 0, 0]", "GET_ROWS")
        _, out = await c.request(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": a.nbytes})
        assert out == a.tobytes()

    run(with_buffer(d.endpoint, scenario))


def test_set_rows_ids_out_of_range(d):
    async def scenario(c, buf):
        make, i_ids = set_rows_graph(buf)
        src = np.arange(12, dtype=np.float32).reshape(3, 4) + 100
        fields, blob = make([2, 0, 9], src)
        await c.request(Command.GRAPH_COMPUTE, fields, blob)
        _, out = await c.request(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": 4 * 4 * ROWS})
        dst = np.frombuffer(out, np.float32).reshape(ROWS, 4)
        np.testing.assert_array_equal(dst[[2, 0, 9]], src)
        for bad in ([2, 0, ROWS], [-1, 0, 1], [0, 1, 2**40]):
            fields, blob = make(bad, src * 0 - 1)
            await expect_error(c.request(Command.GRAPH_COMPUTE, fields, blob), Status.INVALID_REQUEST,
                               f"tensors[{i_ids}] ('kv_idxs')", "SET_ROWS", f"outside 0..{ROWS - 1}")
        _, out2 = await c.request(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": 4 * 4 * ROWS})
        assert out2 == out  # nothing written by the refused requests

    run(with_buffer(d.endpoint, scenario))


def test_rows_out_of_range_unvalidated_is_contained(start_daemon):
    """Without validation the ids reach libggml: the compute process dies (ggml
    asserts on the id, or faults), the daemon and the client's data do not."""
    dd = start_daemon("-t", "1", "--unsafe-no-validation")

    async def scenario():
        c = await RpcClient.connect(dd.endpoint, liveness_timeout=10.0)
        try:
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 4096})
            buf = h["buffer"]
            a = np.arange(4 * ROWS, dtype=np.float32).reshape(ROWS, 4)
            await c.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": a.nbytes}, a.tobytes())
            fields, _, _, _ = get_rows_graph(buf)
            for bad in ([0, ROWS, 1], [0, 1 << 30, 1]):
                await expect_error(c.request(Command.GRAPH_COMPUTE, fields, np.array(bad, np.int32).tobytes()),
                                   Status.FAILED, "compute process died")
                assert dd.alive()
            make, _ = set_rows_graph(buf)
            f, blob = make([-(1 << 40), 0, 1], np.zeros((3, 4), np.float32))  # the first row asserts
            await expect_error(c.request(Command.GRAPH_COMPUTE, f, blob), Status.FAILED, "compute process died")
            good = np.array([3, 2, 1], np.int32)
            h, out = await c.request(Command.GRAPH_COMPUTE, fields, good.tobytes())
            np.testing.assert_array_equal(np.frombuffer(out, np.float32).reshape(3, 4), a[good])
        finally:
            await c.aclose()

    run(scenario())
    assert_served(dd)


def test_row_checks_plan_and_check_pure():
    """row_ids without a daemon: a strided view over inline ids, broadcast (stride 0) dims dropped, and
    overlapping strides refused rather than iterated."""
    from rpc_daemon.validation.graph import parse_graph
    fields, i_full, i_z, n = get_rows_graph(5, view=True)
    spec = parse_graph(fields, P.Limits(), lambda b: 4096 if b == 5 else None)
    row_checks = row_ids.plan(spec.tensors, spec.inputs)  # what parse_graph groups into spec.row_groups
    (chk,) = row_checks
    assert chk.root == i_full and chk.offs == 12 and chk.rows == ROWS and chk.op == "GET_ROWS"
    row_ids.check_inputs(row_checks, spec.tensors, fields["inputs"], np.array([99, 99, 99, 0, 1, 9], "<i4"))
    with pytest.raises(P.ProtocolError, match=r"row id 10 at \[2, 0, 0, 0\]"):
        row_ids.check_inputs(row_checks, spec.tensors, fields["inputs"], np.array([0, 0, 0, 0, 1, 10], "<i4"))
    wide = row_ids.RowCheck(0, "GET_ROWS", 1, 1, 0, "<i4", (1 << 40, 1, 1, 1), (0, 4, 4, 4), ROWS, 0)
    assert row_ids.ids_array(wide, memoryview(bytes(4))).shape == (1, 1, 1, 1)  # stride 0: one value
    overlap = row_ids.RowCheck(0, "GET_ROWS", 1, 1, 0, "<i4", (1 << 20, 1 << 20, 1, 1), (4, 4, 4, 4),
                               ROWS, 0)
    assert row_ids.ids_array(overlap, memoryview(bytes(1 << 24))) is None
    with pytest.raises(P.ProtocolError, match="cannot be checked"):
        row_ids.check([overlap], [spec.tensors[0]] * 2, lambda t: memoryview(bytes(1 << 24)))


# ================================================================ authentication

def test_auth_handshake_pure():
    server, client = A.ServerAuth(SECRET), A.ClientAuth(SECRET)
    challenge = server.challenge({"version": 1, **client.hello_fields()})
    assert challenge["method"] == "hmac-sha256" and len(challenge["nonce"]) == A.NONCE_LEN
    answer = client.answer({"auth": challenge})
    server_proof = server.verify(answer)
    client.verify_server({"proof": server_proof})
    # the two proofs differ (labels), so neither can be reflected as the other
    assert answer["proof"] != server_proof
    # every server nonce is fresh
    assert len({A.ServerAuth(SECRET).challenge(client.hello_fields())["nonce"] for _ in range(100)}) == 100


def test_auth_pure_failures(monkeypatch):
    # wrong secret on the client
    server, client = A.ServerAuth(SECRET), A.ClientAuth(WRONG)
    answer = client.answer({"auth": server.challenge(client.hello_fields())})
    with pytest.raises(P.ProtocolError, match="wrong shared secret") as e:
        server.verify(answer)
    assert e.value.status == Status.NOT_AUTHORIZED and e.value.fatal
    with pytest.raises(P.ProtocolError, match="without a pending challenge"):
        server.verify(answer)  # one attempt per connection
    # no nonce, bad nonce, second HELLO
    for hello in ({}, {"auth_nonce": b"short"}, {"auth_nonce": "x" * 32}):
        with pytest.raises(P.ProtocolError) as e:
            A.ServerAuth(SECRET).challenge(hello)
        assert e.value.status == Status.NOT_AUTHORIZED and e.value.fatal
    s = A.ServerAuth(SECRET)
    s.challenge(A.ClientAuth(SECRET).hello_fields())
    with pytest.raises(P.ProtocolError, match="repeated"):
        s.challenge(A.ClientAuth(SECRET).hello_fields())
    # replay: a recorded answer fails against a new server nonce
    s1, c1 = A.ServerAuth(SECRET), A.ClientAuth(SECRET)
    recorded = c1.answer({"auth": s1.challenge(c1.hello_fields())})
    s1.verify(recorded)
    s2 = A.ServerAuth(SECRET)
    s2.challenge(c1.hello_fields())  # the same client nonce
    with pytest.raises(P.ProtocolError, match="wrong shared secret"):
        s2.verify(recorded)
    # the client refuses a server that cannot prove the secret, skips it, or reflects our nonce
    c = A.ClientAuth(SECRET)
    c.answer({"auth": A.ServerAuth(WRONG).challenge(c.hello_fields())})
    with pytest.raises(A.AuthFailed, match="could not prove"):
        c.verify_server({"proof": hmac.new(WRONG, b"x", hashlib.sha256).digest()})
    with pytest.raises(A.AuthFailed, match="without authenticating"):
        A.ClientAuth(SECRET).verify_server({"status": 0})
    c = A.ClientAuth(SECRET)
    with pytest.raises(A.AuthFailed, match="echoed"):
        c.answer({"auth": {"method": "hmac-sha256", "nonce": c.client_nonce}})
    with pytest.raises(A.AuthFailed, match="method"):
        c.answer({"auth": {"method": "none"}})
    # proofs are compared in constant time
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(A.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    s, c = A.ServerAuth(SECRET), A.ClientAuth(SECRET)
    c.verify_server({"proof": s.verify(c.answer({"auth": s.challenge(c.hello_fields())}))})
    assert len(calls) == 2


def test_load_secret(tmp_path):
    f = tmp_path / "s"
    f.write_bytes(SECRET + b"\n")
    assert A.load_secret(secret_file=str(f), environ={}) == SECRET
    assert A.load_secret(environ={A.ENV_VAR: SECRET.decode()}) == SECRET
    assert A.load_secret(SECRET.decode(), environ={A.ENV_VAR: "other other other other"}) == SECRET
    assert A.load_secret(environ={}) is None
    for kw in ({"secret": "short"}, {"secret_file": str(tmp_path / "missing")},
               {"secret": SECRET, "secret_file": str(f)}):
        with pytest.raises(A.SecretError):
            A.load_secret(**kw, environ={})
    f.chmod(0o644)
    assert A.secret_file_too_open(str(f))
    f.chmod(0o600)
    assert not A.secret_file_too_open(str(f))
    # precedence: --secret-file, then systemd's credential, then the environment variable
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / A.CREDENTIAL).write_bytes(WRONG + b"\n")
    both = {"CREDENTIALS_DIRECTORY": str(creds), A.ENV_VAR: "x" + SECRET.decode()}
    assert A.load_secret(secret_file=str(f), environ=both) == SECRET
    assert A.load_secret(environ=both) == WRONG
    (creds / A.CREDENTIAL).unlink()  # a credentials directory without ours: the variable
    assert A.load_secret(environ=both) == b"x" + SECRET


@pytest.mark.parametrize("weak, problem", [
    (b"change-me-to-a-long-random-string", "example value"),
    (b"0123456789abcdef0123456789abcde", "31 bytes; use at least 32"),
    (b"a" * 64, "1-byte pattern repeated"),
    (b"password1234" * 3, "12-byte pattern repeated"),
    (b"ab" * 20 + b"b" * 20, "only 2 distinct bytes"),
])
def test_weak_secrets_are_refused(weak, problem):
    with pytest.raises(A.SecretError, match=problem) as e:
        A.check_secret(weak)
    assert "openssl rand -hex 32" in str(e.value)


def test_random_secrets_are_accepted():
    import secrets
    for _ in range(2000):  # what the documentation tells operators to make, and raw random bytes
        A.check_secret(secrets.token_hex(16).encode())
        A.check_secret(secrets.token_hex(32).encode())
        A.check_secret(secrets.token_bytes(32))
    A.check_secret(SECRET)
    A.check_secret(WRONG)


def test_example_files_hold_no_usable_secret():
    """A value in deploy/*.example is known to everyone: none may be accepted."""
    import pathlib
    deploy = pathlib.Path(__file__).resolve().parents[2] / "deploy"
    values = [line.split("=", 1)[1].strip().encode() for path in deploy.glob("*.example")
              for line in path.read_text().splitlines()
              if "=" in line and "SECRET" in line.split("=", 1)[0].upper() and not line.startswith("#")]
    for value in values + sorted(A.EXAMPLE_SECRETS):
        if value:
            with pytest.raises(A.SecretError):
                A.check_secret(value)


def test_token_bucket_pure():
    now = [0.0]
    b = TokenBucket(10, 5, clock=lambda: now[0])
    assert [b.take() for _ in range(7)] == [True] * 5 + [False] * 2
    assert b.wait_time() == pytest.approx(0.1)
    now[0] += 0.25
    assert [b.take() for _ in range(3)] == [True, True, False]
    now[0] += 100
    assert sum(b.take() for _ in range(10)) == 5  # never more than the burst
    assert all(TokenBucket(0, 1).take() for _ in range(1000))


async def raw_auth(port: int, secret: bytes) -> tuple[RawConn, list[bytes]]:
    """A raw-socket authenticated HELLO; returns the connection and the exact
    frames it sent (for replaying)."""
    conn = RawConn(port)
    state = A.ClientAuth(secret)
    hello = F.encode_frame({"cmd": int(Command.HELLO), "id": 1, "version": P.PROTOCOL_VERSION,
                            **state.hello_fields()})
    conn.send_raw(hello)
    h, _ = conn.recv_frame()
    assert h["status"] == Status.NOT_AUTHORIZED and "auth" in h, h
    auth = F.encode_frame({"cmd": int(Command.AUTH), "id": 2, **state.answer(h)})
    conn.send_raw(auth)
    h, _ = conn.recv_frame()
    assert h["status"] == Status.SUCCESS, h
    state.verify_server(h)
    return conn, [hello, auth]


def free_memory(endpoint: str, secret: bytes | None = None, **kw) -> int:
    async def go():
        c = await RpcClient.connect(endpoint, secret=secret, **kw)
        try:
            h, _ = await c.request(Command.DEVICE_INFO)
            return h["free_memory"]
        finally:
            await c.aclose()
    return run(go())


def test_auth_refuses_wrong_and_missing_secret(authd):
    before = free_memory(authd.endpoint, SECRET)
    for secret, fragment in ((None, "requires authentication"), (WRONG, "wrong shared secret")):
        for _ in range(3):
            with pytest.raises(PeerFailed, match=fragment) as e:
                run(RpcClient.connect(authd.endpoint, secret=secret))
            assert e.value.kind == "protocol" and "not authorized" in e.value.message
    # raw: no HELLO, HELLO without nonce, a command instead of AUTH, a wrong proof -> NOT_AUTHORIZED, closed
    attempts = [
        [({"cmd": int(Command.ALLOC_BUFFER), "id": 1, "size": MiB}, "not authenticated")],
        [({"cmd": int(Command.HELLO), "id": 1, "version": P.PROTOCOL_VERSION}, "requires authentication")],
        [({"cmd": int(Command.HELLO), "id": 1, "version": P.PROTOCOL_VERSION, "auth_nonce": os.urandom(32)}, None),
         ({"cmd": int(Command.ALLOC_BUFFER), "id": 2, "size": MiB}, "not authenticated")],
        [({"cmd": int(Command.HELLO), "id": 1, "version": P.PROTOCOL_VERSION, "auth_nonce": os.urandom(32)}, None),
         ({"cmd": int(Command.HELLO), "id": 2, "version": P.PROTOCOL_VERSION, "auth_nonce": os.urandom(32)},
          "not authenticated")],
        [({"cmd": int(Command.HELLO), "id": 1, "version": P.PROTOCOL_VERSION, "auth_nonce": os.urandom(32)}, None),
         ({"cmd": int(Command.AUTH), "id": 2, "proof": os.urandom(32)}, "wrong shared secret")],
        [({"cmd": int(Command.HELLO), "id": 1, "version": P.PROTOCOL_VERSION, "auth_nonce": os.urandom(32)}, None),
         ({"cmd": int(Command.AUTH), "id": 2, "proof": "not bytes"}, "wrong shared secret")],
        [({"cmd": int(Command.AUTH), "id": 1, "proof": os.urandom(32)}, "not authenticated")],
        [({"cmd": int(Command.PING), "id": 1}, "not authenticated")],
    ]
    for frames in attempts:
        with RawConn(authd.port) as conn:
            for header, fragment in frames:
                conn.send(header)
                h, _ = conn.recv_frame()
                assert h["status"] == Status.NOT_AUTHORIZED, (frames, h)
                if fragment is None:
                    assert "auth" in h  # the pending challenge
                else:
                    assert fragment in h["error"], (frames, h)
            assert conn.wait_closed() == []
    # nothing was allocated for any of them, and the daemon serves the right secret
    assert free_memory(authd.endpoint, SECRET) == before
    assert open_memfds(authd.proc.pid) == 0
    served_with(authd, secret=SECRET)


def test_auth_replayed_handshake_fails(authd):
    conn, recorded = run(raw_auth(authd.port, SECRET))
    h, _ = conn.call(Command.DEVICE_INFO)
    assert h["status"] == Status.SUCCESS
    conn.close()
    # replay frame by frame: the daemon's challenge is new, the recorded proof is not
    with RawConn(authd.port) as replay:
        replay.send_raw(recorded[0])
        h, _ = replay.recv_frame()
        assert h["status"] == Status.NOT_AUTHORIZED and "auth" in h
        replay.send_raw(recorded[1])
        h, _ = replay.recv_frame()
        assert h["status"] == Status.NOT_AUTHORIZED and "wrong shared secret" in h["error"]
        assert replay.wait_closed() == []
    # and all at once, with a request behind it that must never run
    with RawConn(authd.port) as replay:
        replay.send_raw(b"".join(recorded) + F.encode_frame({"cmd": int(Command.ALLOC_BUFFER), "id": 3, "size": MiB}))
        frames = [replay.recv_frame()[0]]
        frames += replay.wait_closed()
        assert [f["status"] for f in frames] == [Status.NOT_AUTHORIZED, Status.NOT_AUTHORIZED], frames
    assert open_memfds(authd.proc.pid) == 0
    served_with(authd, secret=SECRET)


def test_auth_client_refuses_unauthenticated_server(start_daemon, authd):
    """Mutual: a client with a secret refuses a worker without one, and a fake
    worker that accepts any proof."""
    plain = start_daemon("-t", "1")
    with pytest.raises(PeerFailed, match="without authenticating"):
        run(RpcClient.connect(plain.endpoint, secret=SECRET))

    async def fake_worker():
        async def handle(reader, writer):
            for status, fields in ((Status.NOT_AUTHORIZED, {"auth": {"method": "hmac-sha256",
                                                                     "nonce": os.urandom(32)}}),
                                   (Status.SUCCESS, {"version": 1, "proof": os.urandom(32)})):
                prefix = await reader.readexactly(12)
                hl, bl = F.PREFIX.unpack(prefix)
                h = F.decode_header(await reader.readexactly(hl), P.Limits())
                writer.write(F.encode_frame(P.reply_header(h["id"], status, **fields)))
            await writer.drain()
            await asyncio.sleep(1)
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises(PeerFailed, match="could not prove it knows the shared secret"):
                await RpcClient.connect(f"127.0.0.1:{port}", secret=SECRET)
        finally:
            server.close()

    run(fake_worker())


def test_auth_end_to_end(authd, secret_file):
    served_with(authd, secret=SECRET)

    async def many():
        await asyncio.gather(*(normal_session_auth(authd.endpoint, i) for i in range(8)))

    run(many())
    # the daemon's log shows who was refused, never the secret
    assert not any(SECRET.decode() in line for line in authd.log_lines)


async def normal_session_auth(endpoint, seed):
    c = await RpcClient.connect(endpoint, secret=SECRET, liveness_timeout=10.0)
    try:
        await checked_session(c, seed)
    finally:
        await c.aclose()


def test_secret_from_env_is_not_inherited(start_daemon):
    """GGML_RPC_SECRET works like --secret-file, and is scrubbed from the
    environment: the compute process (which runs libggml on client graphs)
    never has it."""
    dd = start_daemon("-t", "1", env={A.ENV_VAR: SECRET.decode()})
    served_with(dd, secret=SECRET)
    with pytest.raises(PeerFailed, match="not authorized"):
        run(RpcClient.connect(dd.endpoint))
    children = subprocess.run(["pgrep", "-P", str(dd.proc.pid)], capture_output=True, text=True).stdout.split()
    assert children, "no compute process"
    checked = 0
    for pid in children:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert A.ENV_VAR.encode() not in f.read()
            checked += 1
        except (ProcessLookupError, FileNotFoundError):  # a child gone meanwhile (zombie: ESRCH; reaped: ENOENT):
            pass  # the departed client's compute process, or a start-up probe of ggml's buffer types
    assert checked, "no compute process"  # the spare at least


def test_secret_from_systemd_credential(start_daemon, secret_file, tmp_path):
    """Under systemd (LoadCredential=rpc-secret:PATH) the daemon reads
    $CREDENTIALS_DIRECTORY/rpc-secret: it beats $GGML_RPC_SECRET, and an
    explicit --secret-file beats it."""
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / A.CREDENTIAL).write_bytes(SECRET + b"\n")
    env = {"CREDENTIALS_DIRECTORY": str(creds), A.ENV_VAR: WRONG.decode()}
    d = start_daemon("-t", "1", env=env)
    served_with(d, secret=SECRET)
    for secret, fragment in ((None, "requires authentication"), (WRONG, "wrong shared secret")):
        with pytest.raises(PeerFailed, match=fragment):
            run(RpcClient.connect(d.endpoint, secret=secret))
    wrong_file = tmp_path / "wrong"
    wrong_file.write_bytes(WRONG)
    wrong_file.chmod(0o600)
    d2 = start_daemon("-t", "1", "--secret-file", str(wrong_file), env=env)
    served_with(d2, secret=WRONG)
    with pytest.raises(PeerFailed, match="wrong shared secret"):
        run(RpcClient.connect(d2.endpoint, secret=SECRET))
    # a weak credential is refused at start like any other secret
    (creds / A.CREDENTIAL).write_bytes(b"change-me-to-a-long-random-string\n")
    r = start_and_fail("-H", "127.0.0.1", env={"CREDENTIALS_DIRECTORY": str(creds)})
    assert r.returncode == 2 and "example value" in r.stderr and str(creds) in r.stderr, r.stderr


# ================================================================ TLS

def test_tls_wrong_certificate_refused(tlsd, tls_files, start_daemon, secret_file):
    # the client verifies against another CA
    with pytest.raises(PeerFailed, match="TLS handshake failed") as e:
        run(RpcClient.connect(tlsd.endpoint, secret=SECRET, ssl_context=client_context(tls_files.other_ca)))
    assert e.value.kind == "protocol" and "certificate" in e.value.message
    # a rogue daemon with a self-signed certificate for the same address
    rogue = start_daemon("-t", "1", "--secret-file", secret_file, "--tls-cert", tls_files.self_signed_cert,
                         "--tls-key", tls_files.self_signed_key)
    with pytest.raises(PeerFailed, match="TLS handshake failed"):
        run(RpcClient.connect(rogue.endpoint, secret=SECRET, ssl_context=client_context(tls_files.ca)))
    # plaintext to the TLS port, and TLS to a plaintext port
    with pytest.raises(PeerFailed) as e:
        run(RpcClient.connect(tlsd.endpoint, secret=SECRET))
    assert e.value.kind in ("closed", "protocol"), e.value
    plain = start_daemon("-t", "1", "--secret-file", secret_file)
    with pytest.raises(PeerFailed):
        run(RpcClient.connect(plain.endpoint, secret=SECRET, ssl_context=client_context(tls_files.ca)))
    # right CA, wrong secret
    with pytest.raises(PeerFailed, match="wrong shared secret"):
        run(RpcClient.connect(tlsd.endpoint, secret=WRONG, ssl_context=client_context(tls_files.ca)))
    # raw bytes of our protocol on the TLS port: no reply, closed, daemon fine
    with RawConn(tlsd.port) as conn:
        conn.send({"cmd": int(Command.HELLO), "id": 1, "version": 1})
        assert conn.wait_closed(timeout=15) == []
    served_with(tlsd, secret=SECRET, ssl_context=client_context(tls_files.ca))


def test_tls_end_to_end(tlsd, tls_files):
    ctx = client_context(tls_files.ca)

    async def big_round_trip():
        c = await RpcClient.connect(tlsd.endpoint, secret=SECRET, ssl_context=ctx, liveness_timeout=10.0)
        try:
            await checked_session(c)
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 32 * MiB})
            data = np.random.default_rng(5).integers(0, 256, 32 * MiB, dtype=np.uint8).tobytes()
            await c.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": len(data)}, data)
            _, out = await c.request(Command.GET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": len(data)})
            assert out == data
        finally:
            await c.aclose()

    run(big_round_trip())


def test_coordinator_generate_with_secret_and_tls(tlsd, tls_files, secret_file, tmp_path):
    from coordinator import Coordinator
    from tiny_models import write_tiny_llama

    model = str(write_tiny_llama(tmp_path / "tiny.gguf", seed=0))
    prompt = "The capital of France is"
    with Coordinator(["local"], model=model, n_ctx=128) as local:
        expect = local.generate(prompt, max_tokens=12)
    with Coordinator([tlsd.endpoint], model=model, n_ctx=128, secret_file=secret_file, tls_ca=tls_files.ca) as c:
        assert c.generate(prompt, max_tokens=12) == expect
    with Coordinator([tlsd.endpoint], model=model, n_ctx=128, secret=SECRET, tls_ca=tls_files.ca) as c:
        assert c.generate(prompt, max_tokens=12) == expect
    for kw in ({"secret": WRONG, "tls_ca": tls_files.ca}, {"secret": SECRET, "tls_ca": tls_files.other_ca},
               {"tls_ca": tls_files.ca}):
        with pytest.raises(ConnectionError):
            Coordinator([tlsd.endpoint], model=model, n_ctx=128, connect_timeout=5.0, **kw)
    # the command line, with the secret in the environment
    r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "--endpoints", tlsd.endpoint, "-m", model,
                        "-c", "128", "-p", prompt, "-n", "12", "--tls-ca", tls_files.ca],
                       env=dict(os.environ, **{A.ENV_VAR: SECRET.decode()}), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expect
    r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "--endpoints", tlsd.endpoint, "-m", model,
                        "-c", "128", "-p", prompt, "-n", "4", "--tls-ca", tls_files.ca, "--secret-file", secret_file],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert tlsd.alive()


# ================================================================ bind address and flags

def start_and_fail(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "rpc_daemon", "-p", "0", *args], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, **(env or {})))
    assert "listening" not in r.stderr, r.stderr
    return r


def test_non_loopback_bind_requires_secret_or_insecure(secret_file, tls_files):
    for host in ("0.0.0.0", "::", "192.0.2.1", "example.invalid"):
        r = start_and_fail("-H", host)
        assert r.returncode == 2, r.stderr
        assert f"refusing to listen on {host} without a shared secret" in r.stderr and "--insecure" in r.stderr
    # the flag checks without binding anything (parse only)
    from rpc_daemon.daemon.cli import parse_args
    config, _ = parse_args(["-H", "0.0.0.0", "--insecure"])
    assert config.insecure and config.secret is None
    config, _ = parse_args(["-H", "0.0.0.0", "--secret-file", secret_file, "--tls-cert", tls_files.cert,
                            "--tls-key", tls_files.key])
    assert config.secret == SECRET and config.tls_cert == tls_files.cert and SECRET.decode() not in repr(config)
    env = {A.ENV_VAR: SECRET.decode()}
    from rpc_daemon.daemon import security_cli
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("-H", "--host", default="127.0.0.1")
    security_cli.add_args(p)
    args = p.parse_args(["-H", "0.0.0.0"])
    from rpc_daemon.daemon.config import DaemonConfig
    cfg = security_cli.apply(p, args, DaemonConfig(host="0.0.0.0"), environ=env)
    assert cfg.secret == SECRET and A.ENV_VAR not in env  # taken, and scrubbed from the environment
    # bad security settings exit with status 2 before listening
    short = tls_files.ca + ".short"
    with open(short, "w") as f:
        f.write("short")
    for args, fragment in [(("--secret-file", short), "use at least 32"),
                           (("--secret-file", "/nonexistent/secret"), "cannot read secret file"),
                           (("--tls-cert", tls_files.cert), "go together"),
                           (("--tls-cert", tls_files.ca, "--tls-key", tls_files.key), "cannot load TLS"),
                           (("--max-requests-per-second", "-1"), "must be >= 0")]:
        r = start_and_fail("-H", "127.0.0.1", *args)
        assert r.returncode == 2 and fragment in r.stderr, (args, r.stderr)
    r = start_and_fail("-H", "127.0.0.1", env={A.ENV_VAR: "tooshort"})
    assert r.returncode == 2 and "use at least 32" in r.stderr


def test_test_only_flags_are_not_in_the_production_cli(start_daemon):
    """ggml-rpc-server refuses --test-fault, --test-older and --unsafe-no-validation; only the
    test entry point (not an installed script) has them."""
    import tomllib
    for flag in (("--test-fault", "cmd=PING,action=close"), ("--unsafe-no-validation",),
                 ("--test-older", "dot_type_inputs")):
        r = start_and_fail("-H", "127.0.0.1", *flag)
        assert r.returncode == 2 and "unrecognized arguments" in r.stderr and flag[0] in r.stderr, r.stderr
    help_text = subprocess.run([sys.executable, "-m", "rpc_daemon", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    assert "--secret-file" in help_text and "--test-fault" not in help_text and "unsafe" not in help_text
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert not any("testing" in target for target in scripts.values()), scripts
    # the test entry point takes them, with every production flag
    dd = start_daemon("-t", "1", "--unsafe-no-validation", "--test-fault", "cmd=DEVICE_INFO,action=close",
                      "--max-clients", "8")
    assert "unsafe_no_validation=True" in dd.wait_log("listening")
    assert dd.wait_log("TEST FAULT INJECTION ENABLED")
    assert dd.proc.args[2] == "rpc_daemon.testing.daemon_cli"
    r = subprocess.run([sys.executable, "-m", "rpc_daemon.testing.daemon_cli", "--test-fault", "action=explode"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "action" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "rpc_daemon.testing.daemon_cli", "--test-older", "graph_reuse"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no older behaviour known for graph_reuse" in r.stderr, r.stderr


# ================================================================ limits

def test_rate_limit(start_daemon):
    dd = start_daemon("-t", "1", "--max-requests-per-second", "20", "--request-burst", "10")
    with raw_session(dd) as conn:
        h, _ = conn.call(Command.ALLOC_BUFFER, {"size": 4096})
        buf = h["buffer"]
        # a burst of 40 pipelined requests: about the burst (10, less the one above) pass
        ids = [conn.request(Command.DEVICE_INFO if i % 2 else Command.PING) for i in range(20)]
        ids += [conn.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": 64}, b"\xab" * 64)
                for _ in range(20)]
        replies = [conn.recv_frame()[0] for _ in ids]
        assert sorted(r["id"] for r in replies) == ids
        statuses = [r["status"] for r in replies]
        n_ok = statuses.count(Status.SUCCESS)
        assert 8 <= n_ok <= 16 and statuses.count(Status.LIMIT_EXCEEDED) == 40 - n_ok, statuses
        limited = [r for r in replies if r["status"] == Status.LIMIT_EXCEEDED]
        assert all("request rate limit exceeded (20 requests/s, burst 10)" in r["error"] for r in limited)
        # the refused SET_TENSORs wrote nothing (their data was discarded, not read into the buffer)
        time.sleep(0.5)
        h, out = conn.call(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": 64})
        assert h["status"] == Status.SUCCESS and out == bytes(64)
        # after waiting, requests pass again, at the sustained rate
        calls, ok = 0, 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5 * SLACK:
            h, _ = conn.call(Command.PING)
            calls, ok = calls + 1, ok + (h["status"] == Status.SUCCESS)
            time.sleep(0.06)  # ~16/s, under 20/s
        assert ok == calls >= 10, (ok, calls)
    # other clients have their own bucket
    served_with(dd)
    # and the daemon logged a bounded number of warnings for the flood
    assert sum("rate limit" in line for line in dd.log_lines) <= 25


def test_per_client_memory_cap(start_daemon):
    # 4 KiB pages (2 MiB ones: test_shared_memory.py)
    dd = start_daemon("-t", "1", "-m", "4", "--max-client-mem", "1", "--max-buffers", "3", "--no-huge-pages")

    async def scenario():
        a = await RpcClient.connect(dd.endpoint)
        b = await RpcClient.connect(dd.endpoint)
        try:
            await a.request(Command.ALLOC_BUFFER, {"size": MiB // 2})
            await a.request(Command.ALLOC_BUFFER, {"size": MiB // 2})
            await expect_error(a.request(Command.ALLOC_BUFFER, {"size": 1}), Status.LIMIT_EXCEEDED,
                               f"holds {MiB} of its {MiB}-byte limit")
            h, _ = await b.request(Command.ALLOC_BUFFER, {"size": MiB})  # B has its own MiB
            await expect_error(b.request(Command.ALLOC_BUFFER, {"size": 1}), Status.LIMIT_EXCEEDED, "-byte limit")
            await b.request(Command.FREE_BUFFER, {"buffer": h["buffer"]})
            for _ in range(3):
                await b.request(Command.ALLOC_BUFFER, {"size": 4096})
            await expect_error(b.request(Command.ALLOC_BUFFER, {"size": 4096}), Status.LIMIT_EXCEEDED,
                               "buffer count limit 3")
        finally:
            await a.aclose()
            await b.aclose()

    run(scenario())
    served_with(dd)


def test_client_that_does_not_read_is_bounded(start_daemon):
    """A client that pipelines big reads and never reads the replies: the
    daemon stops producing replies (write back-pressure) instead of buffering
    them all, drops the client at the idle timeout, and serves others."""
    dd = start_daemon("-t", "1", "--idle-timeout", "2")

    def rss() -> int:
        with open(f"/proc/{dd.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    conn = raw_session(dd)
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    h, _ = conn.call(Command.ALLOC_BUFFER, {"size": 16 * MiB})
    buf = h["buffer"]
    conn.call(Command.BUFFER_CLEAR, {"buffer": buf, "value": 1})
    base = rss()
    for _ in range(60):  # 960 MiB of replies asked for
        conn.request(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": 16 * MiB})
    time.sleep(1.0)
    grown = rss() - base
    assert grown < 200 * MiB, f"daemon RSS grew by {grown >> 20} MiB"
    served_with(dd)  # meanwhile others are served
    dd.wait_log("closing idle client", timeout=10)  # dropped although requests are queued: it does not read
    conn.wait_closed(timeout=10)
    conn.close()
    served_with(dd)


def test_row_checks_grouped_by_ids_use_the_fewest_rows():
    """Checks reading the same ids (every layer's SET_ROWS reads the KV row ids) are min/maxed once, against
    the smallest row count of the group, and a refusal still names the check the ids break."""
    from types import SimpleNamespace
    tensors = [SimpleNamespace(name=f"t{i}") for i in range(6)]
    i32 = "<i4"
    wide = row_ids.RowCheck(2, "SET_ROWS", 1, 1, 0, i32, (2, 1, 1, 1), (4, 8, 8, 8), 10, 4)
    narrow = row_ids.RowCheck(3, "SET_ROWS", 1, 1, 0, i32, (2, 1, 1, 1), (4, 8, 8, 8), 5, 5)
    (grp,) = row_ids.group([wide, narrow])
    assert grp.rows == 5 and grp.checks == (wide, narrow)
    ids = memoryview(np.array([0, 4], i32).tobytes())
    row_ids.check([grp], tensors, lambda t: ids)
    bad = memoryview(np.array([0, 7], i32).tobytes())
    with pytest.raises(P.ProtocolError, match=r"row id 7 at \[1, 0, 0, 0\] is outside 0\.\.4.*tensors\[3\]"):
        row_ids.check([grp], tensors, lambda t: bad)
    neg = memoryview(np.array([-1, 0], i32).tobytes())
    with pytest.raises(P.ProtocolError, match=r"row id -1 .*outside 0\.\.9.*tensors\[2\]"):
        row_ids.check([wide, narrow], tensors, lambda t: neg)
