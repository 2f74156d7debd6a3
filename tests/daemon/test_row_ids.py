"""Sans-I/O tests of rpc_daemon.validation.row_ids: which GET_ROWS, SET_ROWS
and MUL_MAT_ID ids are checked up front (plan, group) and how a request's
inline ids are checked against the rows they index (check, check_inputs).
Tensors are built as graph.TensorSpec directly; no daemon, no libggml compute."""
from __future__ import annotations

import struct

import pytest

from ggml_ffi import lib
from rpc_daemon.validation import row_ids
from rpc_daemon.validation.graph import TensorSpec, canonical_nb
from rpc_daemon.wire.protocol import ProtocolError, Status

F32, F16, I32, I64 = lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_I32, lib.GGML_TYPE_I64
NONE, GET_ROWS, SET_ROWS = lib.GGML_OP_NONE, lib.GGML_OP_GET_ROWS, lib.GGML_OP_SET_ROWS
MUL_MAT_ID, VIEW, TOP_K = lib.GGML_OP_MUL_MAT_ID, lib.GGML_OP_VIEW, lib.GGML_OP_TOP_K


def spec(index, ttype, ne, op=NONE, src=(), nb=None, view_src=-1, view_offs=0, buffer=0, name="") -> TensorSpec:
    ne = tuple(ne) + (1,) * (4 - len(ne))
    return TensorSpec(index, ttype, ne, tuple(nb) if nb else canonical_nb(ttype, ne), op, b"", 0, tuple(src),
                      view_src, view_offs, buffer, 0, name or f"t{index}")


def i32s(*v) -> bytes:
    return struct.pack(f"<{len(v)}i", *v)


def i64s(*v) -> bytes:
    return struct.pack(f"<{len(v)}q", *v)


def get_rows(n_rows=5, n_ids=3, id_type=I32):
    """[table f32[4, n_rows] (buffer 1), ids [n_ids] inline, get_rows]."""
    return [spec(0, F32, [4, n_rows], buffer=1, name="table"), spec(1, id_type, [n_ids], name="ids"),
            spec(2, F32, [4, n_ids], GET_ROWS, (0, 1), name="rows")]


def refusal(checks, tensors, data: dict) -> str:
    with pytest.raises(ProtocolError) as info:
        row_ids.check(checks, tensors, lambda t: memoryview(data[t]) if t in data else None)
    assert info.value.status == Status.INVALID_REQUEST
    return info.value.message


def passes(checks, tensors, data: dict) -> None:
    assert row_ids.check(checks, tensors, lambda t: memoryview(data[t]) if t in data else None) is None


# ---------------------------------------------------------------- plan

def test_plan_get_rows_with_inline_ids():
    (c,) = row_ids.plan(get_rows(), inputs=[1])
    assert c == row_ids.RowCheck(node=2, op="GET_ROWS", ids=1, root=1, offs=0, dtype="<i4", ne=(3, 1, 1, 1),
                                 nb=(4, 12, 12, 12), rows=5, rows_of=0, what="rows")


def test_plan_set_rows_reads_src_1_and_indexes_src_2():
    """ggml_set_rows(a=dst, b=src, c=ids) stores src[] = {b, c, a}: ids are src[1], the rows dst's ne[1]."""
    tensors = [spec(0, F16, [8, 32], buffer=1, name="cache"), spec(1, F32, [8, 2], name="k"),
               spec(2, I64, [2], name="kv_rows"), spec(3, F16, [8, 32], SET_ROWS, (1, 2, 0), name="store")]
    (c,) = row_ids.plan(tensors, inputs=[1, 2])
    assert (c.node, c.op, c.ids, c.root, c.dtype, c.rows, c.rows_of) == (3, "SET_ROWS", 2, 2, "<i8", 32, 0)


def test_plan_mul_mat_id_indexes_experts():
    tensors = [spec(0, F32, [4, 6, 8], buffer=1, name="experts"), spec(1, F32, [4, 2, 3], name="x"),
               spec(2, I32, [2, 3], name="chosen"), spec(3, F32, [6, 2, 3], MUL_MAT_ID, (0, 1, 2))]
    (c,) = row_ids.plan(tensors, inputs=[1, 2])
    assert (c.op, c.ids, c.rows, c.rows_of, c.what) == ("MUL_MAT_ID", 2, 8, 0, "experts (ne[2])")


def test_plan_a_view_of_an_inline_input_checks_at_its_offset():
    tensors = [spec(0, F32, [4, 5], buffer=1), spec(1, I32, [6], name="all_ids"),
               spec(2, I32, [3], VIEW, (1,), view_src=1, view_offs=8, name="some"),
               spec(3, F32, [4, 3], GET_ROWS, (0, 2))]
    (c,) = row_ids.plan(tensors, inputs=[1])
    assert (c.ids, c.root, c.offs) == (2, 1, 8)


def test_plan_skips_what_cannot_be_known_up_front():
    tensors = get_rows()
    assert row_ids.plan(tensors, inputs=[]) == []  # ids in a buffer (or computed): not checkable here
    computed = [spec(0, F32, [4, 5], buffer=1), spec(1, F32, [5, 3]), spec(2, I32, [2, 3], TOP_K, (1,)),
                spec(3, I32, [2], VIEW, (2,), view_src=2), spec(4, F32, [4, 2], GET_ROWS, (0, 3))]
    assert row_ids.plan(computed, inputs=[1]) == []  # a view of a node is not a view of an inline input
    f32_ids = get_rows(id_type=F32)
    assert row_ids.plan(f32_ids, inputs=[1]) == []  # not an id type: graph.py refuses it
    short = get_rows()
    short[2] = spec(2, F32, [4, 3], GET_ROWS, (0,))
    assert row_ids.plan(short, inputs=[1]) == []  # too few sources: graph.py refuses it


def test_group_shares_one_read_and_takes_the_fewest_rows():
    """Every layer's SET_ROWS reads the same KV row ids: one group, checked against the smallest cache."""
    tensors = [spec(0, F16, [8, 32], buffer=1), spec(1, F16, [8, 16], buffer=1), spec(2, F32, [8, 2]),
               spec(3, I64, [2], name="kv_rows"),
               spec(4, F16, [8, 32], SET_ROWS, (2, 3, 0)), spec(5, F16, [8, 16], SET_ROWS, (2, 3, 1)),
               spec(6, I32, [2], name="other")]
    tensors.append(spec(7, F32, [8, 2], GET_ROWS, (0, 6)))
    checks = row_ids.plan(tensors, inputs=[2, 3, 6])
    assert [c.node for c in checks] == [4, 5, 7]
    groups = row_ids.group(checks)
    assert [(g.first.node, g.rows, [c.node for c in g.checks]) for g in groups] == [(4, 16, [4, 5]), (7, 32, [7])]


# ---------------------------------------------------------------- check

def test_ids_at_the_bounds_pass():
    tensors = get_rows(n_rows=5)
    checks = row_ids.plan(tensors, [1])
    passes(checks, tensors, {1: i32s(0, 4, 2)})
    passes(row_ids.group(checks), tensors, {1: i32s(4, 4, 4)})


def test_one_past_the_last_row_is_refused_naming_where():
    tensors = get_rows(n_rows=5)
    checks = row_ids.plan(tensors, [1])
    assert refusal(checks, tensors, {1: i32s(0, 5, 1)}) == (
        "tensors[1] ('ids'): row id 5 at [1, 0, 0, 0] is outside 0..4, the rows of tensors[0] that GET_ROWS "
        "tensors[2] ('rows') indexes")


def test_a_negative_id_is_refused_before_a_too_large_one():
    tensors = get_rows(n_rows=5)
    checks = row_ids.plan(tensors, [1])
    assert refusal(checks, tensors, {1: i32s(9, -1, 0)}) == (
        "tensors[1] ('ids'): row id -1 at [1, 0, 0, 0] is outside 0..4, the rows of tensors[0] that GET_ROWS "
        "tensors[2] ('rows') indexes")
    int32_min = -(1 << 31)
    assert f"row id {int32_min} at [2, 0, 0, 0]" in refusal(checks, tensors, {1: i32s(0, 1, int32_min)})


def test_i64_ids_beyond_int32_are_refused_not_wrapped():
    """An id of 2^32 would index row 0 if it were cut to 32 bits."""
    tensors = get_rows(n_rows=5, n_ids=2, id_type=I64)
    checks = row_ids.plan(tensors, [1])
    passes(checks, tensors, {1: i64s(4, 0)})
    assert refusal(checks, tensors, {1: i64s(0, 1 << 32)}).startswith(
        "tensors[1] ('ids'): row id 4294967296 at [1, 0, 0, 0] is outside 0..4")
    assert "row id -9223372036854775808 at [0, 0, 0, 0]" in refusal(checks, tensors, {1: i64s(-(1 << 63), 0)})


def test_a_group_refusal_names_the_check_the_id_breaks():
    """An id in range for the larger cache but not the smaller one names the smaller's SET_ROWS."""
    tensors = [spec(0, F16, [8, 32], buffer=1), spec(1, F16, [8, 16], buffer=1), spec(2, F32, [8, 2]),
               spec(3, I32, [2], name="kv_rows"),
               spec(4, F16, [8, 32], SET_ROWS, (2, 3, 0), name="k_big"),
               spec(5, F16, [8, 16], SET_ROWS, (2, 3, 1), name="k_small")]
    groups = row_ids.group(row_ids.plan(tensors, [2, 3]))
    passes(groups, tensors, {3: i32s(15, 0)})
    assert refusal(groups, tensors, {3: i32s(3, 16)}) == (
        "tensors[3] ('kv_rows'): row id 16 at [1, 0, 0, 0] is outside 0..15, the rows of tensors[1] that SET_ROWS "
        "tensors[5] ('k_small') indexes")


def test_mul_mat_id_refusal_names_experts():
    tensors = [spec(0, F32, [4, 6, 8], buffer=1), spec(1, F32, [4, 2, 3]), spec(2, I32, [2, 3], name="chosen"),
               spec(3, F32, [6, 2, 3], MUL_MAT_ID, (0, 1, 2), name="moe")]
    checks = row_ids.plan(tensors, [1, 2])
    passes(checks, tensors, {2: i32s(0, 7, 7, 0, 3, 4)})
    assert refusal(checks, tensors, {2: i32s(0, 1, 2, 3, 8, 5)}) == (
        "tensors[2] ('chosen'): row id 8 at [0, 2, 0, 0] is outside 0..7, the experts (ne[2]) of tensors[0] that "
        "MUL_MAT_ID tensors[3] ('moe') indexes")


def test_a_view_is_checked_at_its_offset_only():
    tensors = [spec(0, F32, [4, 5], buffer=1), spec(1, I32, [6]),
               spec(2, I32, [3], VIEW, (1,), view_src=1, view_offs=8, name="some"),
               spec(3, F32, [4, 3], GET_ROWS, (0, 2))]
    checks = row_ids.plan(tensors, [1])
    passes(checks, tensors, {1: i32s(99, -7, 0, 1, 4, 99)})  # ids 2..4 of the input; the others are not read
    assert "row id 5 at [1, 0, 0, 0]" in refusal(checks, tensors, {1: i32s(0, 0, 0, 5, 0, 0)})


def test_many_ids_take_the_numpy_path_with_the_same_verdict():
    n = 5000  # over the 4096 ids checked without numpy
    tensors = get_rows(n_rows=n, n_ids=n)
    checks = row_ids.plan(tensors, [1])
    ids = list(range(n))
    passes(checks, tensors, {1: i32s(*ids)})
    ids[4321] = n
    assert refusal(checks, tensors, {1: i32s(*ids)}).startswith(
        f"tensors[1] ('ids'): row id {n} at [4321, 0, 0, 0] is outside 0..{n - 1}")


def test_strided_ids_are_read_at_their_strides():
    """ids [2, 2] with rows 16 bytes apart: the 8 bytes between are not ids."""
    tensors = [spec(0, F32, [4, 5, 2], buffer=1), spec(1, I32, [4, 2], name="raw"),
               spec(2, I32, [2, 2], VIEW, (1,), nb=(4, 16, 32, 32), view_src=1, name="ids"),
               spec(3, F32, [4, 2, 2], GET_ROWS, (0, 2), name="rows")]
    checks = row_ids.plan(tensors, [1])
    passes(checks, tensors, {1: i32s(0, 4, 77, 77, 3, 2, -9, 99)})
    assert refusal(checks, tensors, {1: i32s(0, 4, 77, 77, 3, 6, -9, 99)}) == (
        "tensors[2] ('ids'): row id 6 at [1, 1, 0, 0] is outside 0..4, the rows of tensors[0] that GET_ROWS "
        "tensors[3] ('rows') indexes")


def test_ids_that_cannot_be_read_safely_are_refused():
    # strides reaching past the inline data (graph.py refuses these already; this is the second line)
    c = row_ids.RowCheck(2, "GET_ROWS", 1, 1, 0, "<i4", (2, 2, 1, 1), (4, 64, 128, 128), 5, 0)
    tensors = get_rows()
    assert refusal([c], tensors, {1: i32s(0, 0, 0, 0)}) == (
        "tensors[1]: the row ids of GET_ROWS tensors[2] cannot be checked (strides outside the inline data, "
        "or overlapping)")
    # overlapping strides that would read one id many times over
    overlapping = row_ids.RowCheck(2, "GET_ROWS", 1, 1, 0, "<i4", (64, 64, 1, 1), (4, 4, 4, 4), 5, 0)
    assert "cannot be checked" in refusal([overlapping], tensors, {1: i32s(*range(127))})


def test_zero_strides_repeat_the_same_ids():
    c = row_ids.RowCheck(2, "GET_ROWS", 1, 1, 0, "<i4", (2, 1000, 1, 1), (4, 0, 0, 0), 5, 0)
    assert row_ids.ids_array(c, i32s(1, 2)).tolist() == [[[[1, 2]]]]  # numpy order: i3, i2, i1, i0
    passes([c], get_rows(), {1: i32s(1, 2)})
    assert "row id 7 at [1, 0, 0, 0]" in refusal([c], get_rows(), {1: i32s(1, 7)})


def test_ids_not_sent_are_left_to_the_inputs_check():
    tensors = get_rows()
    passes(row_ids.plan(tensors, [1]), tensors, {})


def test_check_inputs_reads_each_input_at_its_blob_offset():
    tensors = get_rows(n_rows=5, n_ids=2)
    groups = row_ids.group(row_ids.plan(tensors, [1]))
    blob = b"\xff" * 4 + i32s(1, 4)  # another input's bytes first
    assert row_ids.check_inputs(groups, tensors, [(1, 4, 8)], blob) is None
    with pytest.raises(ProtocolError) as info:
        row_ids.check_inputs(groups, tensors, [(1, 0, 8)], blob)  # reads 0xffffffff = -1 as an id
    assert "row id -1 at [0, 0, 0, 0] is outside 0..4" in info.value.message
    assert row_ids.check_inputs(groups, tensors, [], b"") is None  # not sent: the inputs check refuses
    assert row_ids.check_inputs([], tensors, [(1, 0, 8)], object()) is None  # no checks: the blob is not read
