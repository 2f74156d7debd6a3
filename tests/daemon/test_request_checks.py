"""Sans-I/O tests of rpc_daemon.validation.requests: what each request must
satisfy before it has any effect. Pure functions over headers and a fake
session lookup; no sockets, no daemon. Each refusal is asserted by its status
and exact message, each acceptance by the exact values returned."""
from __future__ import annotations

import struct
from dataclasses import dataclass

import pytest

from ggml_ffi import lib
from rpc_daemon.validation import requests as V
from rpc_daemon.wire.protocol import ByteRange, Command, Limits, ProtocolError, Status

F32, I32 = lib.GGML_TYPE_F32, lib.GGML_TYPE_I32
INPUT, OUTPUT, COMPUTE = lib.GGML_TENSOR_FLAG_INPUT, lib.GGML_TENSOR_FLAG_OUTPUT, lib.GGML_TENSOR_FLAG_COMPUTE
TOKEN = bytes(range(16))
I64_MAX = (1 << 63) - 1


@dataclass
class Buf:
    """What the checks read of a client buffer: its key, offset in the arena, size."""
    key: int
    offset: int
    size: int


BUFS = {7: Buf(7, 4096, 256), 9: Buf(9, 8192, 64)}


def buffer_of(key):
    return BUFS.get(key)


def refused(fn, *args, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kw)
    return info.value


def assert_refused(status: Status, message: str, fn, *args, **kw) -> None:
    err = refused(fn, *args, **kw)
    assert (err.status, err.message) == (status, message)


# ---------------------------------------------------------------- admission

@pytest.mark.parametrize("cmd, shown", [(0.0, "0.0"), (False, "False"), ("HELLO", "'HELLO'"), (None, "None")])
def test_a_first_frame_without_an_int_cmd_is_refused_and_closes(cmd, shown):
    exc, why = V.admission(cmd, hello_done=False, auth_required=False, auth_pending=False)
    assert (exc.status, exc.message) == (Status.INVALID_REQUEST, f"the first command must be HELLO (cmd {shown})")
    assert why == "first frame without a valid cmd"


def test_a_long_non_int_cmd_is_shown_cut_to_40_characters():
    exc, _ = V.admission("x" * 100, False, False, False)
    assert exc.message == "the first command must be HELLO (cmd '" + "x" * 39 + ")"


def test_a_non_int_cmd_passes_once_authenticated():
    """Refused in its turn (UNKNOWN/INVALID by the dispatcher), so replies keep request order."""
    assert V.admission(8.0, hello_done=True, auth_required=True, auth_pending=False) is None
    assert V.admission(True, hello_done=True, auth_required=False, auth_pending=False) is None


def test_a_command_enum_is_not_an_int_cmd():
    """`cmd` as msgpack decodes it is a plain int; an IntEnum (or any int subclass) is not one."""
    exc, why = V.admission(Command.HELLO, False, False, False)
    assert (exc.message, why) == ("the first command must be HELLO (cmd <Command.HELLO: 0>)",
                                  "first frame without a valid cmd")


def test_only_hello_before_hello_without_a_secret():
    assert V.admission(int(Command.HELLO), False, False, False) is None
    for cmd in (Command.DEVICE_INFO, Command.PING, Command.AUTH, 99):
        exc, why = V.admission(int(cmd), False, False, False)
        assert (exc.status, exc.message, why) == (Status.INVALID_REQUEST, "the first command must be HELLO",
                                                  "first command was not HELLO")


NOT_AUTH = ("not authenticated: this worker requires HELLO with auth_nonce, then AUTH (a shared secret)",
            "request before authentication")


def test_with_a_secret_only_hello_then_the_auth_its_challenge_admits():
    assert V.admission(int(Command.HELLO), False, True, auth_pending=False) is None
    assert V.admission(int(Command.AUTH), False, True, auth_pending=True) is None
    for cmd, pending in ((Command.PING, False), (Command.AUTH, False),  # AUTH with no challenge out
                         (Command.HELLO, True),  # a second HELLO instead of the AUTH
                         (Command.DEVICE_INFO, True)):
        exc, why = V.admission(int(cmd), False, True, pending)
        assert (exc.status, (exc.message, why)) == (Status.NOT_AUTHORIZED, NOT_AUTH), (cmd, pending)


def test_everything_passes_admission_once_authenticated():
    for cmd in Command:
        assert V.admission(int(cmd), True, True, False) is None
    assert V.admission(-1, True, False, False) is None  # unknown commands: refused in their turn


# ---------------------------------------------------------------- buffers and ranges

def test_owned():
    assert V.owned(7, buffer_of) is BUFS[7]
    assert_refused(Status.INVALID_REQUEST, "buffer 8 is not a buffer of this connection", V.owned, 8, buffer_of)


def test_check_range_bounds():
    assert V.check_range(ByteRange(7, 0, 256), buffer_of) == (BUFS[7], ByteRange(7, 0, 256))  # all of it
    assert V.check_range(ByteRange(7, 256, 0), buffer_of)[1] == ByteRange(7, 256, 0)  # empty, at the very end
    assert_refused(Status.INVALID_REQUEST, "range [200, 257) runs past the end of buffer 7 (256 bytes)",
                   V.check_range, ByteRange(7, 200, 57), buffer_of)
    assert_refused(Status.INVALID_REQUEST, "range [257, 257) runs past the end of buffer 7 (256 bytes)",
                   V.check_range, ByteRange(7, 257, 0), buffer_of)
    assert_refused(Status.INVALID_REQUEST, "buffer 1 is not a buffer of this connection",
                   V.check_range, ByteRange(1, 0, 0), buffer_of)


def test_a_huge_range_does_not_wrap():
    """Offsets and sizes are Python ints: their sum cannot overflow past the buffer's end."""
    assert_refused(Status.INVALID_REQUEST, f"range [{I64_MAX}, {2 * I64_MAX}) runs past the end of buffer 7 "
                                           f"(256 bytes)",
                   V.check_set_tensor, {"buffer": 7, "offset": I64_MAX, "size": I64_MAX}, I64_MAX, buffer_of)


def test_check_set_tensor():
    buf, r, cache = V.check_set_tensor({"buffer": 7, "offset": 16, "size": 8}, 8, buffer_of)
    assert (buf, r, cache) == (BUFS[7], ByteRange(7, 16, 8), False)
    assert V.check_set_tensor({"buffer": 9, "offset": 0, "size": 64, "cache": True}, 64, buffer_of)[2] is True
    h = {"buffer": 7, "offset": 16, "size": 8}
    assert_refused(Status.INVALID_REQUEST, "size 8 != blob length 9", V.check_set_tensor, h, 9, buffer_of)
    assert_refused(Status.INVALID_REQUEST, "field 'cache' must be a bool, got int",
                   V.check_set_tensor, dict(h, cache=1), 8, buffer_of)
    assert_refused(Status.INVALID_REQUEST, f"field 'buffer'=0 outside 1..{I64_MAX}",
                   V.check_set_tensor, dict(h, buffer=0), 8, buffer_of)
    assert_refused(Status.INVALID_REQUEST, f"field 'offset'=-1 outside 0..{I64_MAX}",
                   V.check_set_tensor, dict(h, offset=-1), 8, buffer_of)
    assert_refused(Status.INVALID_REQUEST, "field 'offset' must be an integer, got float",
                   V.check_set_tensor, dict(h, offset=16.0), 8, buffer_of)
    assert_refused(Status.INVALID_REQUEST, "field 'size' must be an integer, got bool",
                   V.check_set_tensor, dict(h, size=True), 1, buffer_of)
    assert_refused(Status.INVALID_REQUEST, "field 'size' is required",
                   V.check_set_tensor, {"buffer": 7, "offset": 0}, 0, buffer_of)
    assert_refused(Status.INVALID_REQUEST, "range [250, 258) runs past the end of buffer 7 (256 bytes)",
                   V.check_set_tensor, dict(h, offset=250), 8, buffer_of)
    assert_refused(Status.INVALID_REQUEST, "buffer 8 is not a buffer of this connection",
                   V.check_set_tensor, dict(h, buffer=8), 8, buffer_of)


def test_check_set_tensor_hash():
    digest = "ab" * 32
    assert V.check_set_tensor_hash({"buffer": 7, "offset": 0, "size": 256, "hash": digest}, buffer_of) == (
        BUFS[7], ByteRange(7, 0, 256), digest)
    h = {"buffer": 7, "offset": 0, "size": 4}
    for bad in ("ab" * 31 + "a", "ab" * 32 + "a", bytes(32), bytes(64), None, 5):
        assert_refused(Status.INVALID_REQUEST, "field 'hash' must be a sha256 hex digest",
                       V.check_set_tensor_hash, dict(h, hash=bad), buffer_of)
    # the range is checked first: a bad range is refused as such, whatever the hash
    assert_refused(Status.INVALID_REQUEST, "range [0, 257) runs past the end of buffer 7 (256 bytes)",
                   V.check_set_tensor_hash, dict(h, size=257, hash=None), buffer_of)


def test_check_get_tensor_is_bounded_by_max_blob():
    limits = Limits(max_blob=64)
    assert V.check_get_tensor({"buffer": 7, "offset": 0, "size": 64}, buffer_of, limits) == (
        BUFS[7], ByteRange(7, 0, 64))
    assert_refused(Status.LIMIT_EXCEEDED, "GET_TENSOR of 65 bytes exceeds max_blob 64; read it in parts",
                   V.check_get_tensor, {"buffer": 7, "offset": 0, "size": 65}, buffer_of, limits)
    # past the buffer is refused as a range, before the size bound
    assert_refused(Status.INVALID_REQUEST, "range [0, 257) runs past the end of buffer 7 (256 bytes)",
                   V.check_get_tensor, {"buffer": 7, "offset": 0, "size": 257}, buffer_of, limits)


def test_check_copy_tensor():
    h = {"src_buffer": 9, "src_offset": 32, "buffer": 7, "offset": 224, "size": 32}
    assert V.check_copy_tensor(h, buffer_of) == (BUFS[9], ByteRange(9, 32, 32), BUFS[7], ByteRange(7, 224, 32))
    assert_refused(Status.INVALID_REQUEST, "range [33, 65) runs past the end of buffer 9 (64 bytes)",
                   V.check_copy_tensor, dict(h, src_offset=33), buffer_of)
    assert_refused(Status.INVALID_REQUEST, "range [225, 257) runs past the end of buffer 7 (256 bytes)",
                   V.check_copy_tensor, dict(h, offset=225), buffer_of)
    assert_refused(Status.INVALID_REQUEST, "buffer 3 is not a buffer of this connection",
                   V.check_copy_tensor, dict(h, src_buffer=3), buffer_of)
    assert_refused(Status.INVALID_REQUEST, "field 'src_buffer' is required",
                   V.check_copy_tensor, {"buffer": 7, "offset": 0, "size": 1}, buffer_of)


def pages(n: int) -> int:
    return -(-n // 4096) * 4096


def test_check_alloc_counts_and_caps():
    limits = Limits(max_buffers=3, max_client_bytes=3 * 4096)
    assert V.check_alloc({"size": 1}, 0, 0, limits, pages) == 1
    assert V.check_alloc({"size": 4096}, 2, 2 * 4096, limits, pages) == 4096  # exactly up to the cap
    assert_refused(Status.LIMIT_EXCEEDED, "buffer count limit 3 reached",
                   V.check_alloc, {"size": 1}, 3, 0, limits, pages)
    assert_refused(Status.LIMIT_EXCEEDED, "cannot allocate 4097 bytes (8192 as whole pages): this client holds "
                                          "8192 of its 12288-byte limit",
                   V.check_alloc, {"size": 4097}, 1, 8192, limits, pages)
    # one byte over a page counts as a whole page against the cap
    assert_refused(Status.LIMIT_EXCEEDED, "cannot allocate 1 bytes (4096 as whole pages): this client holds "
                                          "12288 of its 12288-byte limit",
                   V.check_alloc, {"size": 1}, 1, 12288, limits, pages)
    # a cap that is not whole pages: what counts is the pages the buffer takes, not its bytes
    odd_cap = Limits(max_client_bytes=10000)
    assert V.check_alloc({"size": 4096}, 1, 4096, odd_cap, pages) == 4096
    assert_refused(Status.LIMIT_EXCEEDED, "cannot allocate 4097 bytes (8192 as whole pages): this client holds "
                                          "4096 of its 10000-byte limit",
                   V.check_alloc, {"size": 4097}, 1, 4096, odd_cap, pages)
    uncapped = Limits(max_client_bytes=0)
    assert V.check_alloc({"size": I64_MAX}, 0, 1 << 40, uncapped, pages) == I64_MAX
    assert_refused(Status.INVALID_REQUEST, f"field 'size'=0 outside 1..{I64_MAX}",
                   V.check_alloc, {"size": 0}, 0, 0, uncapped, pages)
    assert_refused(Status.INVALID_REQUEST, f"field 'size'={I64_MAX + 1} outside 1..{I64_MAX}",
                   V.check_alloc, {"size": I64_MAX + 1}, 0, 0, uncapped, pages)
    assert_refused(Status.INVALID_REQUEST, "field 'size' must be an integer, got str",
                   V.check_alloc, {"size": "4096"}, 0, 0, uncapped, pages)


def test_check_buffer_clear():
    assert V.check_buffer_clear({"buffer": 7}, buffer_of) == (BUFS[7], 0)
    assert V.check_buffer_clear({"buffer": 7, "value": 255}, buffer_of) == (BUFS[7], 255)
    assert_refused(Status.INVALID_REQUEST, "field 'value'=256 outside 0..255",
                   V.check_buffer_clear, {"buffer": 7, "value": 256}, buffer_of)
    assert_refused(Status.INVALID_REQUEST, "field 'value'=-1 outside 0..255",
                   V.check_buffer_clear, {"buffer": 7, "value": -1}, buffer_of)
    assert_refused(Status.INVALID_REQUEST, "field 'value' must be an integer, got bool",
                   V.check_buffer_clear, {"buffer": 7, "value": True}, buffer_of)
    assert_refused(Status.INVALID_REQUEST, "buffer 2 is not a buffer of this connection",
                   V.check_buffer_clear, {"buffer": 2}, buffer_of)


# ---------------------------------------------------------------- computes

def t(ttype, ne, **kw) -> dict:
    """A wire tensor with contiguous strides."""
    size = 4  # f32 and i32 alike
    ne = list(ne) + [1] * (4 - len(ne))
    nb = [size, size * ne[0], size * ne[0] * ne[1], size * ne[0] * ne[1] * ne[2]]
    return dict({"type": ttype, "ne": ne, "nb": nb}, **kw)


def f32s(*vals) -> bytes:
    return struct.pack(f"<{len(vals)}f", *vals)


def scale_graph(**fields) -> dict:
    """y = scale(x): x f32[4] inline (tensor 0), y the output (tensor 1)."""
    tensors = [t(F32, [4], flags=INPUT, name="x"),
               t(F32, [4], op=lib.GGML_OP_SCALE, src=[0], params=f32s(2.0), flags=OUTPUT | COMPUTE, name="y")]
    return dict({"tensors": tensors, "inputs": [[0, 0, 16]], "outputs": [1]}, **fields)


def get_rows_graph() -> dict:
    """rows = get_rows(table, ids): table f32[4, 3] in buffer 7, ids i32[2] inline (tensor 1)."""
    tensors = [t(F32, [4, 3], buffer=7, offset=0, name="table"),
               t(I32, [2], flags=INPUT, name="ids"),
               t(F32, [4, 2], op=lib.GGML_OP_GET_ROWS, src=[0, 1], flags=OUTPUT | COMPUTE, name="rows")]
    return {"tensors": tensors, "inputs": [[1, 0, 8]], "outputs": [2]}


LIMITS = Limits()


def test_a_valid_compute_is_returned_as_a_run():
    run = V.check_graph_compute(scale_graph(graph_id=5), bytes(16), LIMITS, buffer_of, {})
    assert (run.graph_id, run.inputs, run.outputs, run.buffers, run.out_size) == (5, [(0, 0, 16)], [1], {}, 16)
    assert [x.name for x in run.spec.tensors] == ["x", "y"] and run.spec.inputs == [0]
    run = V.check_graph_compute(get_rows_graph(), struct.pack("<2i", 0, 2), LIMITS, buffer_of, {})
    assert (run.graph_id, run.buffers, run.out_size) == (0, {7: (4096, 256)}, 32)


def test_compute_inputs_are_checked():
    blob = bytes(16)
    assert_refused(Status.INVALID_REQUEST, "inputs: no data for input tensor 0 ('x')",
                   V.check_graph_compute, scale_graph(inputs=[]), blob, LIMITS, buffer_of, {})
    assert_refused(Status.INVALID_REQUEST, "inputs: tensor 0 ('x') needs 16 bytes, got 12",
                   V.check_graph_compute, scale_graph(inputs=[[0, 0, 12]]), blob, LIMITS, buffer_of, {})
    assert_refused(Status.INVALID_REQUEST, "inputs: tensor 1 is not an input leaf of the graph",
                   V.check_graph_compute, scale_graph(inputs=[[1, 0, 16]]), blob, LIMITS, buffer_of, {})
    assert_refused(Status.INVALID_REQUEST, "inputs[0] data [4, 20) outside the blob of 16 bytes",
                   V.check_graph_compute, scale_graph(inputs=[[0, 4, 16]]), blob, LIMITS, buffer_of, {})
    assert_refused(Status.INVALID_REQUEST, "inputs[0] names tensor 2, not in the graph",
                   V.check_graph_compute, scale_graph(inputs=[[2, 0, 16]]), blob, LIMITS, buffer_of, {})


def test_unsafe_mode_lets_a_missing_input_through():
    run = V.check_graph_compute(scale_graph(inputs=[]), b"", LIMITS, buffer_of, {}, unsafe=True)
    assert run.inputs == [] and run.outputs == [1]


def test_compute_outputs_are_checked():
    assert_refused(Status.INVALID_REQUEST, "outputs[0]=2 is not a tensor of the graph",
                   V.check_graph_compute, scale_graph(outputs=[2]), bytes(16), LIMITS, buffer_of, {})
    assert_refused(Status.INVALID_REQUEST, "outputs names a tensor more than once",
                   V.check_graph_compute, scale_graph(outputs=[1, 1]), bytes(16), LIMITS, buffer_of, {})
    assert V.check_graph_compute(scale_graph(), bytes(16), Limits(max_blob=16), buffer_of, {}).out_size == 16
    assert_refused(Status.LIMIT_EXCEEDED, "outputs: 32 bytes exceed max_blob 31; read large tensors with "
                                          "GET_TENSOR",
                   V.check_graph_compute, scale_graph(outputs=[0, 1], inputs=[[0, 0, 16]]), bytes(16),
                   Limits(max_blob=31), buffer_of, {})


def test_an_output_without_memory_after_compute_is_refused():
    spec = V.check_graph_compute(scale_graph(), bytes(16), LIMITS, buffer_of, {}).spec
    spec.readable = {1}  # as for a leaf no node uses
    assert_refused(Status.INVALID_REQUEST, "outputs: tensor 0 has no memory after compute (a leaf no node uses)",
                   V.check_run, 0, spec, {"inputs": [[0, 0, 16]], "outputs": [0]}, bytes(16), LIMITS, buffer_of)


def test_inline_row_ids_are_checked_with_the_compute():
    h = get_rows_graph()
    assert V.check_graph_compute(h, struct.pack("<2i", 2, 0), LIMITS, buffer_of, {}).inputs == [(1, 0, 8)]
    assert_refused(Status.INVALID_REQUEST, "tensors[1] ('ids'): row id 3 at [1, 0, 0, 0] is outside 0..2, the rows of "
                                           "tensors[0] that GET_ROWS tensors[2] ('rows') indexes",
                   V.check_graph_compute, h, struct.pack("<2i", 0, 3), LIMITS, buffer_of, {})


def test_a_graph_in_a_buffer_not_held_is_refused():
    h = get_rows_graph()
    h["tensors"][0]["buffer"] = 8
    assert_refused(Status.INVALID_REQUEST, "tensors[0]: buffer 8 is not a buffer of this connection",
                   V.check_graph_compute, h, bytes(8), LIMITS, buffer_of, {})


def test_cached_graph_bounds():
    limits = Limits(max_graphs=2, max_cached_tensors=5)
    spec = V.check_graph_compute(scale_graph(), bytes(16), LIMITS, buffer_of, {}).spec  # 2 tensors
    graphs = {1: spec, 2: spec}
    assert_refused(Status.LIMIT_EXCEEDED, "cached graph limit 2 reached; free one",
                   V.check_graph_compute, scale_graph(graph_id=3), bytes(16), limits, buffer_of, graphs)
    # replacing a cached graph, or a one-off graph (id 0), is not one more
    assert V.check_graph_compute(scale_graph(graph_id=2), bytes(16), limits, buffer_of, graphs).graph_id == 2
    assert V.check_graph_compute(scale_graph(graph_id=0), bytes(16), limits, buffer_of, graphs).graph_id == 0
    # tensors of every cached graph but the one replaced, plus this one: 2 + 2 = 4, up to the limit
    assert V.check_graph_compute(scale_graph(graph_id=3), bytes(16), limits, buffer_of, {1: spec}).graph_id == 3
    assert V.check_graph_compute(scale_graph(graph_id=3), bytes(16), Limits(max_cached_tensors=4), buffer_of,
                                 {1: spec}).graph_id == 3
    assert_refused(Status.LIMIT_EXCEEDED, "cached graphs would hold 4 tensors, limit 3; free one",
                   V.check_graph_compute, scale_graph(graph_id=3), bytes(16), Limits(max_cached_tensors=3),
                   buffer_of, {1: spec})
    assert_refused(Status.INVALID_REQUEST, "field 'graph_id' must be an integer, got bool",
                   V.check_graph_compute, scale_graph(graph_id=True), bytes(16), limits, buffer_of, {})


def test_cached_graph_lookup_and_recompute():
    run = V.check_graph_compute(get_rows_graph(), bytes(8), LIMITS, buffer_of, {})
    graphs = {4: run.spec}
    assert V.cached_graph({"graph_id": 4}, graphs) == (4, run.spec)
    assert V.cached_graph({"graph_id": 5}, graphs) == (5, None)
    assert_refused(Status.INVALID_REQUEST, f"field 'graph_id'=0 outside 1..{I64_MAX}",
                   V.cached_graph, {"graph_id": 0}, graphs)
    assert_refused(Status.INVALID_REQUEST, "field 'graph_id' is required", V.cached_graph, {}, graphs)
    h = {"inputs": [[1, 0, 8]], "outputs": [2]}
    again = V.check_graph_recompute(4, run.spec, h, struct.pack("<2i", 1, 1), LIMITS, buffer_of)
    assert (again.graph_id, again.buffers, again.inputs) == (4, {7: (4096, 256)}, [(1, 0, 8)])
    # its buffer freed since the graph was sent: refused as such before its inputs are looked at
    assert_refused(Status.INVALID_REQUEST, "buffer 7 is not a buffer of this connection",
                   V.check_graph_recompute, 4, run.spec, h, bytes(8), LIMITS, {9: BUFS[9]}.get)
    assert_refused(Status.INVALID_REQUEST, "buffer 7 is not a buffer of this connection",
                   V.check_graph_recompute, 4, run.spec, {"inputs": [], "outputs": [2]}, b"", LIMITS,
                   {9: BUFS[9]}.get)
    assert_refused(Status.INVALID_REQUEST, "tensors[1] ('ids'): row id -1 at [0, 0, 0, 0] is outside 0..2, the rows of "
                                           "tensors[0] that GET_ROWS tensors[2] ('rows') indexes",
                   V.check_graph_recompute, 4, run.spec, h, struct.pack("<2i", -1, 1), LIMITS, buffer_of)


# ---------------------------------------------------------------- step links

def test_check_step_peers():
    assert V.check_step_peers({"token": TOKEN}) == (TOKEN, frozenset())
    assert V.check_step_peers({"token": TOKEN, "peers": ["10.0.0.2:50052", "[::1]:1", "10.0.0.2:50052"]}) == (
        TOKEN, frozenset({"10.0.0.2:50052", "[::1]:1"}))
    for bad in (TOKEN[:15], TOKEN + b"\0", bytearray(TOKEN), TOKEN.hex(), None):
        assert_refused(Status.INVALID_REQUEST, "field 'token' must be 16 bytes", V.check_step_peers, {"token": bad})
    assert V.check_step_peers({"token": TOKEN, "peers": [f"h:{i + 1}" for i in range(64)]})[1] == frozenset(
        f"h:{i + 1}" for i in range(64))
    assert_refused(Status.LIMIT_EXCEEDED, "field 'peers' has 65 entries, limit 64",
                   V.check_step_peers, {"token": TOKEN, "peers": [f"h:{i + 1}" for i in range(65)]})
    assert_refused(Status.INVALID_REQUEST, "field 'peers' must be a list",
                   V.check_step_peers, {"token": TOKEN, "peers": "h:1"})


def test_step_peer_endpoints():
    longest = "h" * 250 + ":1234"  # 255 characters
    assert V.check_step_peers({"token": TOKEN, "peers": [longest]})[1] == {longest}
    assert_refused(Status.INVALID_REQUEST, "a peer must be a 'host:port' string of at most 255 characters",
                   V.check_step_peers, {"token": TOKEN, "peers": ["h" + longest]})
    assert_refused(Status.INVALID_REQUEST, "a peer must be a 'host:port' string of at most 255 characters",
                   V.check_step_peers, {"token": TOKEN, "peers": [50052]})
    assert_refused(Status.INVALID_REQUEST, "peer 'h:0': endpoint 'h:0': port 0 is not in 1..65535",
                   V.check_step_peers, {"token": TOKEN, "peers": ["h:0"]})
    assert_refused(Status.INVALID_REQUEST, "peer 'http://h:1': endpoint 'http://h:1' must be host:port (no scheme "
                                           "or path), e.g. 10.0.0.2:50052",
                   V.check_step_peers, {"token": TOKEN, "peers": ["http://h:1"]})


def test_check_step_input():
    assert V.check_step_input({"token": TOKEN, "tag": 0}) == (TOKEN, 0, False)
    assert V.check_step_input({"token": TOKEN, "tag": I64_MAX, "cancel": True}) == (TOKEN, I64_MAX, True)
    assert_refused(Status.INVALID_REQUEST, f"field 'tag'=-1 outside 0..{I64_MAX}",
                   V.check_step_input, {"token": TOKEN, "tag": -1})
    assert_refused(Status.INVALID_REQUEST, "field 'tag' is required", V.check_step_input, {"token": TOKEN})
    assert_refused(Status.INVALID_REQUEST, "field 'cancel' must be a bool, got int",
                   V.check_step_input, {"token": TOKEN, "tag": 1, "cancel": 1})
    assert_refused(Status.INVALID_REQUEST, "field 'token' must be 16 bytes", V.check_step_input, {"tag": 1})


def test_check_step_link_absent():
    assert V.check_step_link({}) == V.StepLink(None, (), False)
    assert V.check_step_link({"forward": [], "reply_output": True}) == V.StepLink(None, (), True)


def test_check_step_link_input():
    h = {"step_input": {"tensor": 3, "tag": 9, "timeout": 2}}
    assert V.check_step_link(h).input == V.StepInput(3, 9, 2.0)
    assert V.check_step_link({"step_input": {"tensor": 0, "tag": 0, "timeout": 3600.0}}).input.timeout == 3600.0
    timeout_refusal = "step_input 'timeout' must be a number of seconds in (0, 3600]"
    for bad in (0, -1, 3600.001, True, "2", None, float("nan"), float("inf")):
        assert_refused(Status.INVALID_REQUEST, timeout_refusal, V.check_step_link,
                       {"step_input": {"tensor": 3, "tag": 9, "timeout": bad}})
    assert_refused(Status.INVALID_REQUEST, "field 'step_input' must be a map", V.check_step_link,
                   {"step_input": [3, 9, 2]})
    assert_refused(Status.INVALID_REQUEST, "field 'tensor' must be an integer, got float", V.check_step_link,
                   {"step_input": {"tensor": 3.0, "tag": 9, "timeout": 2}})


def test_check_step_link_forward():
    f = {"to": "10.0.0.3:50052", "token": TOKEN, "tag": 4}
    link = V.check_step_link({"forward": [f, dict(f, tag=5)], "reply_output": False})
    assert link == V.StepLink(None, (V.Forward("10.0.0.3:50052", TOKEN, 4), V.Forward("10.0.0.3:50052", TOKEN, 5)),
                              False)
    assert len(V.check_step_link({"forward": [f] * 16}).forward) == 16
    assert_refused(Status.LIMIT_EXCEEDED, "field 'forward' has 17 entries, limit 16",
                   V.check_step_link, {"forward": [f] * 17})
    assert_refused(Status.INVALID_REQUEST, "each 'forward' entry must be a map",
                   V.check_step_link, {"forward": [["10.0.0.3:50052", TOKEN, 4]]})
    assert_refused(Status.INVALID_REQUEST, "field 'token' must be 16 bytes",
                   V.check_step_link, {"forward": [dict(f, token=TOKEN[:8])]})
    assert_refused(Status.INVALID_REQUEST, "a peer must be a 'host:port' string of at most 255 characters",
                   V.check_step_link, {"forward": [dict(f, to=None)]})
    assert_refused(Status.INVALID_REQUEST, f"field 'tag'=-2 outside 0..{I64_MAX}",
                   V.check_step_link, {"forward": [dict(f, tag=-2)]})
    for bad in (1, 0, "yes", None):
        assert_refused(Status.INVALID_REQUEST, "field 'reply_output' must be a bool",
                       V.check_step_link, {"reply_output": bad})
