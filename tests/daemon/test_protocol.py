"""Sans-I/O tests of rpc_daemon.wire.protocol (framing, field checks) and
rpc_daemon.validation.graph (the validation choke point). No sockets, no daemon."""
from __future__ import annotations

import copy

import msgpack
import pytest

from ggml_ffi import Context, lib, tensor_name
from rpc_daemon.wire import framing as F
from rpc_daemon.wire import protocol as P
from rpc_daemon.validation.graph import MAX_ELEMENTS, MAX_NE, parse_graph
from rpc_daemon.wire.graph_codec import encode_graph
from rpc_daemon.wire.protocol import ProtocolError, Status
from rpc_helpers import encode_prefix

LIMITS = P.Limits()
BUF, BUF_SIZE = 7, 4096


def raises(status: Status, *fragments: str, fatal: bool | None = None):
    """Context manager: a ProtocolError with `status` whose message holds every fragment."""

    class _Check:
        def __enter__(self):
            self.cm = pytest.raises(ProtocolError)
            self.info = self.cm.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self.cm.__exit__(*exc)
            err = self.info.value
            assert err.status == status, f"expected {status.name}, got {err.status.name}: {err.message}"
            for f in fragments:
                assert f in err.message, f"{f!r} not in {err.message!r}"
            if fatal is not None:
                assert err.fatal is fatal
            return suppressed

    return _Check()


# ---------------------------------------------------------------- framing

def test_prefix_roundtrip():
    frame = F.encode_frame({"cmd": 1, "id": 5}, blob_len=100)
    header_len, blob_len = F.parse_prefix(frame[:12], LIMITS)
    assert blob_len == 100 and header_len == len(frame) - 12
    assert F.decode_header(frame[12:], LIMITS) == {"cmd": 1, "id": 5}


def test_prefix_accepts_limits_exactly():
    assert F.parse_prefix(encode_prefix(LIMITS.max_header, LIMITS.max_blob), LIMITS) == (
        LIMITS.max_header, LIMITS.max_blob)
    assert F.parse_prefix(encode_prefix(1, 0), LIMITS) == (1, 0)


def test_prefix_header_len_zero():
    with raises(Status.LIMIT_EXCEEDED, "header_len 0", fatal=True):
        F.parse_prefix(encode_prefix(0, 0), LIMITS)


@pytest.mark.parametrize("header_len", [LIMITS.max_header + 1, 2**32 - 1])
def test_prefix_header_len_too_big(header_len):
    with raises(Status.LIMIT_EXCEEDED, f"header_len {header_len}", fatal=True):
        F.parse_prefix(encode_prefix(header_len, 0), LIMITS)


@pytest.mark.parametrize("blob_len", [LIMITS.max_blob + 1, 2**64 - 1])
def test_prefix_blob_len_too_big(blob_len):
    with raises(Status.LIMIT_EXCEEDED, f"blob_len {blob_len}", fatal=True):
        F.parse_prefix(encode_prefix(10, blob_len), LIMITS)


def test_prefix_truncated():
    with raises(Status.INVALID_REQUEST, "truncated", fatal=True):
        F.parse_prefix(encode_prefix(10, 0)[:11], LIMITS)


def test_custom_limits_apply():
    small = P.Limits(max_header=100, max_blob=1000)
    with raises(Status.LIMIT_EXCEEDED, "header_len 101"):
        F.parse_prefix(encode_prefix(101, 0), small)
    with raises(Status.LIMIT_EXCEEDED, "blob_len 1001"):
        F.parse_prefix(encode_prefix(100, 1001), small)


@pytest.mark.parametrize("data", [
    b"\xc1",  # never-used msgpack byte
    b"\x82\xa3cmd",  # truncated map
    msgpack.packb({"a": 1}) + b"\x00",  # trailing bytes
    msgpack.packb({1: 2}),  # integer keys (strict_map_key)
])
def test_bad_msgpack(data):
    with raises(Status.INVALID_REQUEST, "not valid msgpack", fatal=False):
        F.decode_header(data, LIMITS)


@pytest.mark.parametrize("value", [[1, 2], 5, "cmd", None, b"\x01"])
def test_header_not_a_map(value):
    with raises(Status.INVALID_REQUEST, "must be a msgpack map", fatal=False):
        F.decode_header(msgpack.packb(value, use_bin_type=True), LIMITS)


def _stream(frames) -> bytes:
    return b"".join(F.encode_frame(h, len(b)) + b for h, b in frames)


def _feed(reader: F.FrameReader, data: bytes, cuts) -> list:
    """Deliver `data` to `reader` the way a transport does, in pieces ending at `cuts`."""
    got, pos = [], 0
    for end in [*cuts, len(data)]:
        while pos < end:
            buf = reader.buffer()
            n = min(len(buf), end - pos)
            assert n > 0
            buf[:n] = data[pos: pos + n]
            pos += n
            got += reader.received(n)
    return got


FRAMES = [({"id": 1, "status": 0}, b""), ({"id": 2, "x": "y" * 300}, b"abc"),
          ({"id": 3}, bytes(range(256)) * 400), ({"id": 4}, b"z" * 70_000), ({"id": 5}, b"")]


@pytest.mark.parametrize("step", [1, 7, 12, 13, 4096, 65_536, 10 ** 9])
def test_frame_reader_any_split(step):
    """Frames come out whole and in order however the stream is cut: byte by byte, across prefixes and
    headers, several frames per read, and blobs larger than the receive buffer (their own bytearray)."""
    data = _stream(FRAMES)
    reader = F.FrameReader(LIMITS, size=4096)
    got = _feed(reader, data, range(step, len(data), step))
    assert [(h, bytes(b)) for h, b in got] == FRAMES
    assert not reader.partial


def test_frame_reader_header_larger_than_buffer():
    frames = [({"id": 1, "big": "q" * 20_000}, b"tail"), ({"id": 2}, b"")]
    reader = F.FrameReader(LIMITS, size=1024)
    data = _stream(frames)
    got = _feed(reader, data, range(500, len(data), 500))
    assert [(h, bytes(b)) for h, b in got] == frames


def test_frame_reader_partial_and_errors():
    reader = F.FrameReader(LIMITS)
    data = _stream([({"id": 9}, b"12345")])
    assert _feed(reader, data[:-2], []) == [] and reader.partial
    assert _feed(reader, data[-2:], []) == [({"id": 9}, b"12345")] and not reader.partial
    with raises(Status.LIMIT_EXCEEDED, "header_len 0"):
        _feed(F.FrameReader(LIMITS), encode_prefix(0, 0), [])
    with raises(Status.INVALID_REQUEST, "msgpack map"):
        _feed(F.FrameReader(LIMITS), encode_prefix(1, 0) + msgpack.packb(5), [])


def test_reply_header():
    assert P.reply_header(3, Status.SUCCESS) == {"id": 3, "status": 0}
    assert P.reply_header(None, Status.NOT_FOUND, "gone", x=1) == {"id": None, "status": -105, "error": "gone", "x": 1}


def test_check_hello():
    assert P.check_hello({"version": P.PROTOCOL_VERSION})["version"] == P.PROTOCOL_VERSION
    for bad in ({"version": P.PROTOCOL_VERSION + 1}, {}, {"version": str(P.PROTOCOL_VERSION)}):
        with raises(Status.VERSION_MISMATCH, "not supported", fatal=True):
            P.check_hello(bad)
    ours = {"version": "0.25.3", "op_table": "a" * 16}
    assert P.check_hello({"version": P.PROTOCOL_VERSION, "ggml": ours}, ours)
    assert P.check_hello({"version": P.PROTOCOL_VERSION}, ours)  # raw clients may leave it out
    with raises(Status.VERSION_MISMATCH, "ggml mismatch", fatal=True):
        P.check_hello({"version": P.PROTOCOL_VERSION, "ggml": {"version": "0.20.2", "op_table": "b" * 16}}, ours)
    with raises(Status.VERSION_MISMATCH, "must be", fatal=True):
        P.check_hello({"version": P.PROTOCOL_VERSION, "ggml": ["0.25.3"]}, ours)


# ---------------------------------------------------------------- fields

def test_field_int():
    assert P.field_int({"size": 5}, "size", 1) == 5
    assert P.field_int({}, "value", 0, 255, default=3) == 3
    with raises(Status.INVALID_REQUEST, "'size' is required"):
        P.field_int({}, "size")
    with raises(Status.INVALID_REQUEST, "'size' must be an integer, got str"):
        P.field_int({"size": "5"}, "size")
    with raises(Status.INVALID_REQUEST, "'size' must be an integer, got bool"):
        P.field_int({"size": True}, "size")
    with raises(Status.INVALID_REQUEST, "'size' must be an integer, got float"):
        P.field_int({"size": 1.0}, "size")
    with raises(Status.INVALID_REQUEST, "'buffer'=0 outside 1.."):
        P.field_int({"buffer": 0}, "buffer", 1)
    with raises(Status.INVALID_REQUEST, "'offset'=-1 outside 0.."):
        P.field_int({"offset": -1}, "offset")
    with raises(Status.INVALID_REQUEST, "'value'=256 outside 0..255"):
        P.field_int({"value": 256}, "value", 0, 255)
    with raises(Status.INVALID_REQUEST, f"'offset'={2**63} outside"):
        P.field_int({"offset": 2**63}, "offset")


def test_field_list():
    assert P.field_list({"tensors": [1]}, "tensors", 4) == [1]
    assert P.field_list({}, "inputs", 4, default=[]) == []
    with raises(Status.INVALID_REQUEST, "'tensors' must be a list"):
        P.field_list({}, "tensors", 4)
    with raises(Status.INVALID_REQUEST, "'tensors' must be a list"):
        P.field_list({"tensors": {"a": 1}}, "tensors", 4)
    with raises(Status.LIMIT_EXCEEDED, "'tensors' has 5 entries, limit 4"):
        P.field_list({"tensors": [0] * 5}, "tensors", 4)


def test_field_bytes():
    assert P.field_bytes({"k": b"ab"}, "k", 2) == b"ab"
    with raises(Status.INVALID_REQUEST, "'k' must be bytes"):
        P.field_bytes({"k": "ab"}, "k", 2)
    with raises(Status.INVALID_REQUEST, "'k' longer than 2"):
        P.field_bytes({"k": b"abc"}, "k", 2)


def test_parse_range():
    r = P.parse_range({"buffer": 3, "offset": 8, "size": 16})
    assert (r.buffer, r.offset, r.size) == (3, 8, 16)
    r = P.parse_range({"src_buffer": 4, "src_offset": 0, "size": 16}, "src_")
    assert (r.buffer, r.offset, r.size) == (4, 0, 16)
    with raises(Status.INVALID_REQUEST, "'buffer'=0"):
        P.parse_range({"buffer": 0, "offset": 0, "size": 1})
    with raises(Status.INVALID_REQUEST, "'size' is required"):
        P.parse_range({"buffer": 1, "offset": 0})


def test_parse_inputs_bounds():
    h = {"inputs": [[0, 0, 16], [2, 16, 4]]}
    specs = P.parse_inputs(h, 20, 3)
    assert [(s.tensor, s.blob_offset, s.size) for s in specs] == [(0, 0, 16), (2, 16, 4)]
    assert P.parse_inputs({}, 0, 3) == []
    assert P.parse_inputs({"inputs": [[0, 0, 0]]}, 0, 1)[0].size == 0
    with raises(Status.INVALID_REQUEST, "inputs[1] data [16, 21) outside the blob of 20 bytes"):
        P.parse_inputs({"inputs": [[0, 0, 16], [1, 16, 5]]}, 20, 3)
    with raises(Status.INVALID_REQUEST, "inputs[0] names tensor 3, not in the graph"):
        P.parse_inputs({"inputs": [[3, 0, 4]]}, 20, 3)
    with raises(Status.INVALID_REQUEST, "inputs[0] names tensor -1"):
        P.parse_inputs({"inputs": [[-1, 0, 4]]}, 20, 3)
    with raises(Status.INVALID_REQUEST, "inputs[0] data [-4, 0)"):
        P.parse_inputs({"inputs": [[0, -4, 4]]}, 20, 3)
    with raises(Status.INVALID_REQUEST, "inputs[0] data"):
        P.parse_inputs({"inputs": [[0, 4, -4]]}, 20, 3)
    for bad in ([0, 0], [0, 0, 4, 4], [0, "0", 4], [0, 0, True], (0, 0, 4), 7):
        with raises(Status.INVALID_REQUEST, "inputs[0] must be [tensor, blob_offset, size]"):
            P.parse_inputs({"inputs": [bad]}, 20, 3)
    with raises(Status.INVALID_REQUEST, "'inputs' must be a list"):
        P.parse_inputs({"inputs": {}}, 20, 3)
    with raises(Status.LIMIT_EXCEEDED, "'inputs'"):
        P.parse_inputs({"inputs": [[0, 0, 0]] * ((1 << 16) + 1)}, 20, 3)
    # n_tensors None (recompute before the graph is known): only the blob bound applies
    assert P.parse_inputs({"inputs": [[99, 0, 4]]}, 4, None)[0].tensor == 99


def test_parse_outputs_bounds():
    assert P.parse_outputs({"outputs": [0, 2]}, 3) == [0, 2]
    assert P.parse_outputs({}, 3) == []
    for bad in (3, -1, "1", None, True, 1.0):
        with raises(Status.INVALID_REQUEST, f"outputs[1]={bad!r} is not a tensor of the graph"):
            P.parse_outputs({"outputs": [0, bad]}, 3)
    with raises(Status.INVALID_REQUEST, "'outputs' must be a list"):
        P.parse_outputs({"outputs": 1}, 3)


# ---------------------------------------------------------------- graphs

def buffer_size(key: int):
    return BUF_SIZE if key == BUF else None


def build_wire(make):
    """Build a graph with the real ggml constructors; `make(ctx, x)` gets the
    tensor x (f32 [4, 3], placed at offset 0 of buffer BUF) and returns the
    result tensor. Returns (wire tensors, {tensor: index})."""
    ctx = Context(64)
    try:
        x = ctx.new_tensor(lib.GGML_TYPE_F32, [4, 3], "x")
        out = make(ctx, x)
        lib.ggml_set_output(out)
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, out)
        tensors, index_of = encode_graph(gf, lambda t: (BUF, 0) if t == x else None)
        names = {}
        for t, i in index_of.items():
            names[tensor_name(t) or f"#{i}"] = i
        return tensors, names
    finally:
        ctx.close()


def make_add_mul(ctx, x):
    y = ctx.new_tensor(lib.GGML_TYPE_F32, [4, 3], "y")
    lib.ggml_set_input(y)
    s = lib.ggml_add(ctx.ptr, x, y)
    lib.ggml_set_name(s, b"s")
    z = lib.ggml_mul(ctx.ptr, s, y)
    lib.ggml_set_name(z, b"z")
    return z


def make_view(ctx, x):
    """v = view of 4 floats at byte 32 of the intermediate s = x + y; z = v * 2."""
    y = ctx.new_tensor(lib.GGML_TYPE_F32, [4, 3], "y")
    lib.ggml_set_input(y)
    s = lib.ggml_add(ctx.ptr, x, y)
    lib.ggml_set_name(s, b"s")
    v = lib.ggml_view_1d(ctx.ptr, s, 4, 32)
    lib.ggml_set_name(v, b"v")
    z = lib.ggml_scale(ctx.ptr, v, 2.0)
    lib.ggml_set_name(z, b"z")
    return z


def make_mul_mat(ctx, x):
    b = ctx.new_tensor(lib.GGML_TYPE_F32, [4, 2], "b")
    lib.ggml_set_input(b)
    z = lib.ggml_mul_mat(ctx.ptr, x, b)  # [3, 2]
    lib.ggml_set_name(z, b"z")
    return z


def check(tensors):
    return parse_graph({"tensors": tensors}, LIMITS, buffer_size)


@pytest.fixture(scope="module")
def add_mul():
    return build_wire(make_add_mul)


def test_valid_graphs_pass(add_mul):
    tensors, n = add_mul
    spec = check(tensors)
    assert [t.op for t in spec.tensors] == [t["op"] for t in tensors]
    assert spec.nodes == [n["s"], n["z"]]
    assert spec.inputs == [n["y"]]
    assert spec.buffers == {BUF}
    assert spec.tensors[n["x"]].buffer == BUF and spec.tensors[n["x"]].nbytes == 48
    for make in (make_view, make_mul_mat):
        tensors, n = build_wire(make)
        spec = check(tensors)
        assert spec.nodes and spec.tensors[n["z"]].op != lib.GGML_OP_NONE
    tensors, n = build_wire(make_view)
    v = check(tensors).tensors[n["v"]]
    assert v.is_view and v.view_src == n["s"] and v.view_offs == 32


def mutated(tensors, i, **changes):
    out = copy.deepcopy(tensors)
    out[i].update(changes)
    return out


def test_cycle_rejected(add_mul):
    tensors, n = add_mul
    s = n["s"]
    # a node naming itself or a later tensor: the only ways to spell a cycle
    for src in ([s, n["y"]], [n["z"], n["y"]]):
        with raises(Status.INVALID_REQUEST, f"tensors[{s}]", f"src index {src[0]}", "earlier tensor"):
            check(mutated(tensors, s, src=src))
    with raises(Status.INVALID_REQUEST, f"tensors[{s}]", "view_src"):
        check(mutated(tensors, s, view_src=s))


@pytest.mark.parametrize("bad", [99, 1 << 40, -2])
def test_out_of_range_src(add_mul, bad):
    tensors, n = add_mul
    with raises(Status.INVALID_REQUEST, f"tensors[{n['z']}]", f"src index {bad}"):
        check(mutated(tensors, n["z"], src=[n["s"], bad]))


def test_bad_src_list(add_mul):
    tensors, n = add_mul
    for bad in ([0] * 11, "01", [0.0], None):
        with raises(Status.INVALID_REQUEST, f"tensors[{n['z']}]", "src must be a list"):
            check(mutated(tensors, n["z"], src=bad))


@pytest.mark.parametrize("op", [lib.GGML_OP_COUNT, -1, 10**6, "ADD", None])
def test_invalid_op(add_mul, op):
    tensors, n = add_mul
    with raises(Status.INVALID_REQUEST, f"tensors[{n['s']}]", f"op {op!r} is not a ggml op"):
        check(mutated(tensors, n["s"], op=op))


@pytest.mark.parametrize("ttype", [lib.GGML_TYPE_COUNT, 4, -1, 1000, "f32", None])
def test_invalid_type(add_mul, ttype):
    # 4 was GGML_TYPE_Q4_2: removed, block size 0
    tensors, n = add_mul
    with raises(Status.INVALID_REQUEST, f"tensors[{n['y']}]", f"type {ttype!r} is not a ggml type"):
        check(mutated(tensors, n["y"], type=ttype))


def test_huge_ne(add_mul):
    tensors, n = add_mul
    y = n["y"]
    with raises(Status.INVALID_REQUEST, f"tensors[{y}]", f"ne value {MAX_NE + 1} outside"):
        check(mutated(tensors, y, ne=[MAX_NE + 1, 1, 1, 1]))
    with raises(Status.INVALID_REQUEST, f"tensors[{y}]", f"ne value {2**63 - 1} outside"):
        check(mutated(tensors, y, ne=[4, 2**63 - 1, 1, 1]))
    with raises(Status.INVALID_REQUEST, f"tensors[{y}]", "ne value 0 outside"):
        check(mutated(tensors, y, ne=[4, 0, 1, 1]))
    with raises(Status.INVALID_REQUEST, f"tensors[{y}]", f"more than {MAX_ELEMENTS} elements"):
        check(mutated(tensors, y, ne=[1 << 20] * 4))
    with raises(Status.INVALID_REQUEST, f"tensors[{y}]", "ne must be a list of 4 integers"):
        check(mutated(tensors, y, ne=[4, 3, 1]))


def test_ne0_not_multiple_of_block_size(add_mul):
    tensors, n = add_mul
    q = lib.GGML_TYPE_Q4_0  # 32 elements per 18-byte block
    with raises(Status.INVALID_REQUEST, f"tensors[{n['y']}]", "ne[0]=33", "q4_0 block size 32"):
        check(mutated(tensors, n["y"], type=q, ne=[33, 1, 1, 1], nb=[18, 36, 36, 36]))


def test_extent_past_end_of_buffer(add_mul):
    tensors, n = add_mul
    x = n["x"]
    assert check(mutated(tensors, x, offset=BUF_SIZE - 48)).tensors[x].offset == BUF_SIZE - 48
    with raises(Status.INVALID_REQUEST, f"tensors[{x}]", f"data [{BUF_SIZE - 47}, {BUF_SIZE + 1}) runs past the end of buffer {BUF}"):
        check(mutated(tensors, x, offset=BUF_SIZE - 47))
    # a huge stride makes a tiny tensor huge
    with raises(Status.INVALID_REQUEST, f"tensors[{x}]", "runs past the end of buffer"):
        check(mutated(tensors, x, nb=[4, 16, 1 << 40, 1 << 40], ne=[4, 3, 2, 1]))


def test_buffer_not_owned(add_mul):
    tensors, n = add_mul
    with raises(Status.INVALID_REQUEST, f"tensors[{n['x']}]", f"buffer {BUF + 1} is not a buffer of this connection"):
        check(mutated(tensors, n["x"], buffer=BUF + 1))
    # a node may not write its result into someone else's buffer either
    with raises(Status.INVALID_REQUEST, f"tensors[{n['z']}]", "buffer 12345 is not a buffer of this connection"):
        check(mutated(tensors, n["z"], buffer=12345, offset=0))


def test_view_past_view_src():
    tensors, n = build_wire(make_view)
    v = n["v"]
    ok = mutated(tensors, v, view_offs=32)  # 4 floats at byte 32 of 48: the last row
    assert check(ok).tensors[v].view_offs == 32
    with raises(Status.INVALID_REQUEST, f"tensors[{v}]", "view of 16 bytes at view_offs 36 runs past its view_src (48 bytes)"):
        check(mutated(tensors, v, view_offs=36))
    with raises(Status.INVALID_REQUEST, f"tensors[{v}]", "runs past its view_src"):
        check(mutated(tensors, v, ne=[8, 1, 1, 1], nb=[4, 32, 32, 32]))


def test_view_of_buffer_tensor_past_buffer_end():
    def make(ctx, x):
        v = lib.ggml_view_1d(ctx.ptr, x, 4, 0)
        lib.ggml_set_name(v, b"v")
        z = lib.ggml_scale(ctx.ptr, v, 2.0)
        return z

    tensors, n = build_wire(make)
    v = n["v"]
    check(mutated(tensors, v, view_offs=BUF_SIZE - 16))
    with raises(Status.INVALID_REQUEST, f"tensors[{v}]", "runs past its view_src"):
        check(mutated(tensors, v, view_offs=BUF_SIZE - 12))


def test_mul_mat_shape_mismatch():
    tensors, n = build_wire(make_mul_mat)
    z, b = n["z"], n["b"]
    with raises(Status.INVALID_REQUEST, f"tensors[{z}]", "MUL_MAT", "src0 ne[0]=4 != src1 ne[0]=8"):
        check(mutated(tensors, b, ne=[8, 2, 1, 1], nb=[4, 32, 64, 64]))
    with raises(Status.INVALID_REQUEST, f"tensors[{z}]", "MUL_MAT", "result must be f32 [3, 2, 1, 1]"):
        check(mutated(tensors, z, ne=[4, 2, 1, 1], nb=[4, 16, 32, 32]))
    with raises(Status.INVALID_REQUEST, f"tensors[{z}]", "MUL_MAT", "src1 type i32 not supported"):
        check(mutated(tensors, b, type=lib.GGML_TYPE_I32))


def test_unsupported_op(add_mul):
    tensors, n = add_mul
    with raises(Status.INVALID_REQUEST, f"tensors[{n['z']}]", "op CONV_TRANSPOSE_1D is not supported"):
        check(mutated(tensors, n["z"], op=lib.GGML_OP_CONV_TRANSPOSE_1D))


def test_leaf_outside_buffers_needs_input_flag(add_mul):
    tensors, n = add_mul
    with raises(Status.INVALID_REQUEST, f"tensors[{n['y']}]", "must be flagged INPUT"):
        check(mutated(tensors, n["y"], flags=0))
    # in a buffer it needs no flag
    check(mutated(tensors, n["y"], flags=0, buffer=BUF, offset=64))


def test_other_schema_errors(add_mul):
    tensors, n = add_mul
    z = n["z"]
    cases = [
        (dict(params=b"\0" * 65), "params must be at most 64 bytes"),
        (dict(flags=1 << 20), "has unknown bits"),
        (dict(name="n" * 64), "name must be a string shorter than 64 bytes"),
        (dict(nb=[4, 16, 48, -1]), "nb value -1 outside"),
        (dict(offset=-8), "offset -8 outside"),
        (dict(view_offs=16), "view_offs without view_src"),
    ]
    for change, msg in cases:
        with raises(Status.INVALID_REQUEST, f"tensors[{z}]", msg):
            check(mutated(tensors, z, **change))
    with raises(Status.INVALID_REQUEST, "tensors[1]: must be a map"):
        check([tensors[0], [1, 2]])
    with raises(Status.INVALID_REQUEST, "graph has no tensors"):
        check([])
    with raises(Status.INVALID_REQUEST, "graph has no op to compute"):
        check([tensors[n["x"]]])
    with raises(Status.LIMIT_EXCEEDED, "'tensors'"):
        parse_graph({"tensors": tensors}, P.Limits(max_graph_tensors=len(tensors) - 1), buffer_size)


def test_op_rule_needs_sources(add_mul):
    tensors, n = add_mul
    with raises(Status.INVALID_REQUEST, f"tensors[{n['z']}]", "MUL: takes 2..2 sources, got 1"):
        check(mutated(tensors, n["z"], src=[n["s"]]))
    with raises(Status.INVALID_REQUEST, f"tensors[{n['z']}]", "MUL: src[0] is required"):
        check(mutated(tensors, n["z"], src=[-1, n["s"]]))
