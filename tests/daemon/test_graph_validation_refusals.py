"""Regression tests for the graph-validation audit (docs/security.md, findings
table): graphs that passed rpc_daemon/validation/graph.py and then let one client read or
write past its buffer (A), or aborted the compute process on a GGML_ASSERT (C),
plus the ones tests/daemon/test_graph_extents.py's fuzzer and a read of the kernels
found next to them.

Every case runs against a real daemon: the request must get INVALID_REQUEST,
the compute process must not have died (no "compute process lost" in the log),
and a second client's buffer must be unchanged and never appear in a reply.
"""
from __future__ import annotations

import struct

import pytest

from ggml_ffi import lib
from rpc_daemon.validation.graph import parse_graph
from rpc_daemon.wire.protocol import Limits, ProtocolError
from graph_helpers import (COMPUTE, F16, F32, I32, I64, INPUT, KiB, OUTPUT, Q8_0, VICTIM_FILL, Session, T, f32s,  # noqa: F401
                           i32s, lost)

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)


@pytest.fixture
def s(d):
    sess = Session(d)
    yield sess
    sess.close()


# ================================================================ A: another client's buffer

def read_past_end(buf: int, nb0: int = 0):
    """Audit A (read): a view of 1024 f32 with nb[0] = 0 at the last float of a
    64 KiB buffer; ggml_nbytes counts 4 bytes, GET_ROWS copies 4096."""
    return [
        T(F32, [16384], [4, 65536, 65536, 65536], buffer=buf),
        T(F32, [1024], [nb0, 4096, 4096, 4096], op=lib.GGML_OP_VIEW, src=[0], view_src=0, view_offs=65532),
        T(I32, [1], flags=INPUT),
        T(F32, [1024], op=lib.GGML_OP_GET_ROWS, src=[1, 2], flags=OUTPUT | COMPUTE),
    ]


def test_a_read_through_zero_stride_view_is_refused(s):
    s.refused(read_past_end(s.buf), inputs=[(2, 0, 4)], blob=i32s(0), outputs=[3], fragment="tensors[1]")


def test_a_write_through_zero_stride_set_rows_result_is_refused(s):
    """Audit A (write): SET_ROWS into f32 [64, 1] at 65280 of a 64 KiB buffer
    through a result view with nb [0, 256, ...] at view_offs 252: 63 floats
    would land past the buffer."""
    tensors = [
        T(F32, [64, 1], [4, 256, 256, 256], buffer=s.buf, offset=65280),
        T(F32, [64, 1], flags=INPUT),
        T(I64, [1], flags=INPUT),
        T(F32, [64, 1], [0, 256, 256, 256], op=lib.GGML_OP_SET_ROWS, src=[1, 2, 0], view_src=0, view_offs=252,
          flags=COMPUTE),
    ]
    blob = f32s(*[7.0] * 64) + struct.pack("<q", 0)
    s.refused(tensors, inputs=[(1, 0, 256), (2, 256, 8)], blob=blob, fragment="tensors[3]")


def test_a_extent_counts_rows_not_ggml_nbytes():
    """The choke point's extent is the bytes the kernels touch, whatever nb[0]:
    a view whose rows (ne[0] packed elements) run past its view_src is refused
    even where ggml_nbytes would fit. nb[0] = 0 itself is refused at the schema."""
    from rpc_daemon.validation.graph import TensorSpec
    t = TensorSpec(0, F32, (1024, 1, 1, 1), (0, 4096, 4096, 4096), 0, b"", 0, (), -1, 0, 0, 0, "")
    assert t.extent() == 4096
    t = TensorSpec(0, F32, (16, 3, 1, 1), (8, 4, 12, 12), 0, b"", 0, (), -1, 0, 0, 0, "")
    assert t.extent() == 15 * 8 + 4 + 2 * 4  # strided elements reach further than a packed row
    t = TensorSpec(0, Q8_0, (64, 2, 1, 1), (34, 68, 136, 136), 0, b"", 0, (), -1, 0, 0, 0, "")
    assert t.extent() == 68 + 68
    bs = lambda b: 64 * KiB if b == 1 else None  # noqa: E731
    with pytest.raises(ProtocolError, match=r"tensors\[1\]: nb\[0\]=0 must be at least"):
        parse_graph({"tensors": read_past_end(1)}, Limits(), bs)
    # the same graph with an honest nb[0] = 4 runs 4092 bytes past the buffer: the extent check says so
    with pytest.raises(ProtocolError, match=r"tensors\[1\]: view of 4096 bytes at view_offs 65532 runs past"):
        parse_graph({"tensors": read_past_end(1, nb0=4)}, Limits(), bs)


# ================================================================ C: GGML_ASSERT in the compute process

def unary_graph(buf, op, params, ttype=F32, ne=(8, 2)) -> list:
    return [T(ttype, ne, buffer=buf), T(ttype, ne, op=op, src=[0], params=params, flags=OUTPUT)]


@pytest.mark.parametrize("op, eps", [
    (lib.GGML_OP_NORM, float("nan")), (lib.GGML_OP_RMS_NORM, float("nan")),
    (lib.GGML_OP_NORM, -1.0), (lib.GGML_OP_RMS_NORM, -1e-6), (lib.GGML_OP_RMS_NORM, float("-inf")),
])
def test_c_norm_eps_nan_or_negative_is_refused(s, op, eps):
    s.refused(unary_graph(s.buf, op, f32s(eps)), outputs=[1], fragment="eps")


def flash_graph(buf, prec=0, out_nb=None, v_ne3=1, q_ne3=1) -> list:
    """q f32 [4, 1 token, 1 head], k, v f16 [4, 8 kv]; result [4, 1, 1, q_ne3]."""
    return [
        T(F32, [4, 1, 1, q_ne3], buffer=buf),
        T(F16, [4, 8, 1, 1], buffer=buf, offset=1024),
        T(F16, [4, 8, 1, v_ne3], buffer=buf, offset=2048),
        T(F32, [4, 1, 1, q_ne3], out_nb, op=lib.GGML_OP_FLASH_ATTN_EXT, src=[0, 1, 2],
          params=f32s(1.0, 0.0, 0.0) + i32s(prec), flags=OUTPUT),
    ]


def test_c_flash_attn_precision_out_of_range_is_refused(s):
    s.refused(flash_graph(s.buf, prec=5), outputs=[3], fragment="precision 5")


def test_c_flash_attn_result_stride_order_is_refused(s):
    # ne [4, 1, 1, 1]: ggml_is_contiguous skips the unit dims, the kernel asserts nb2 <= nb3
    s.refused(flash_graph(s.buf, out_nb=[4, 16, 4096, 16]), outputs=[3], fragment="tensors[3]: nb [4, 16, 4096, 16]")


def test_c_mul_mat_result_stride_order_is_refused(s):
    tensors = [
        T(F32, [4, 2], buffer=s.buf), T(F32, [4, 1], buffer=s.buf, offset=64),
        T(F32, [2, 1, 1, 1], [4, 4096, 8, 8], op=lib.GGML_OP_MUL_MAT, src=[0, 1], flags=OUTPUT),
    ]
    s.refused(tensors, outputs=[2], fragment="tensors[2]: nb [4, 4096, 8, 8] are not the strides [4, 8, 8, 8]")


def zero_stride_view(buf) -> dict:
    return T(F32, [8, 2], [0, 32, 64, 64], op=lib.GGML_OP_VIEW, src=[0], view_src=0, view_offs=0)


@pytest.mark.parametrize("name", ["SCALE", "RMS_NORM", "UNARY", "ADD", "GLU"])
def test_c_zero_stride_view_into_a_kernel_is_refused(s, name):
    base = T(F32, [8, 2], buffer=s.buf)
    view = zero_stride_view(s.buf)
    node = {
        "SCALE": T(F32, [8, 2], op=lib.GGML_OP_SCALE, src=[1], params=f32s(2.0), flags=OUTPUT),
        "RMS_NORM": T(F32, [8, 2], op=lib.GGML_OP_RMS_NORM, src=[1], params=f32s(1e-6), flags=OUTPUT),
        "UNARY": T(F32, [8, 2], op=lib.GGML_OP_UNARY, src=[1], params=i32s(lib.GGML_UNARY_OP_NEG), flags=OUTPUT),
        "ADD": T(F32, [8, 2], op=lib.GGML_OP_ADD, src=[1, 0], flags=OUTPUT),
        "GLU": T(F32, [4, 2], op=lib.GGML_OP_GLU, src=[1], params=i32s(lib.GGML_GLU_OP_SWIGLU), flags=OUTPUT),
    }[name]
    s.refused([base, view, node], outputs=[2], fragment="tensors[1]: nb[0]=0")


# ================================================================ found next to them (kernel reading, fuzzer)

def test_get_rows_ids_planes_past_src0_are_refused(s):
    """get_rows reads src0 plane i12 < ids.ne2 in dim 3: ids with more planes than
    src0 read past it (ggml_get_rows asserts a.ne3 == ids.ne2)."""
    tensors = [
        T(F32, [4, 2, 1, 1], buffer=s.buf, offset=s.size - 32),
        T(I32, [1, 1, 64, 1], flags=INPUT),
        T(F32, [4, 1, 1, 64], op=lib.GGML_OP_GET_ROWS, src=[0, 1], flags=OUTPUT),
    ]
    s.refused(tensors, inputs=[(1, 0, 256)], blob=i32s(*[0] * 64), outputs=[2], fragment="src0 batches")


def rope_graph(buf, ne0=6, n_dims=4, ff_ne0=None) -> list:
    tensors = [T(F32, [ne0, 1, 2, 1], buffer=buf), T(I32, [2], flags=INPUT)]
    src = [0, 1]
    if ff_ne0 is not None:
        tensors.append(T(F32, [ff_ne0], buffer=buf, offset=64 * KiB - 4 * ff_ne0))  # at the buffer's end
        src.append(2)
    params = i32s(0, n_dims, 0, 0, 0) + f32s(10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    tensors.append(T(F32, [ne0, 1, 2, 1], op=lib.GGML_OP_ROPE, src=src, params=params, flags=OUTPUT))
    return tensors


def test_rope_odd_row_is_refused(s):
    """The pair loop past n_dims writes element ne0 of each row when ne0 is odd."""
    s.refused(rope_graph(s.buf, ne0=5, n_dims=4), inputs=[(1, 0, 8)], blob=i32s(0, 1), outputs=[2],
              fragment="ne[0] must be even")


def test_rope_freq_factors_shorter_than_half_a_row_are_refused(s):
    """ggml_rope_cache_init reads freq_factors[i0/2] for every even i0 < ne0, not
    only < n_dims: 2 factors at the end of the buffer for ne0 = 64 read 120
    bytes past it."""
    s.refused(rope_graph(s.buf, ne0=64, n_dims=4, ff_ne0=2), inputs=[(1, 0, 8)], blob=i32s(0, 1), outputs=[3],
              fragment="freq factors too short")


def test_rope_offset_of_ggml_025_is_refused(s):
    """ggml 0.25 rotates dims [n_offs, n_offs + n_dims) with n_offs = op_params[15]
    (0.20 ignores it; 0.25 aborts past the row): only 0 means the same on both."""
    tensors = rope_graph(s.buf, ne0=8, n_dims=4)
    tensors[-1]["params"] = tensors[-1]["params"] + bytes(4 * (15 - len(tensors[-1]["params"]) // 4)) + i32s(6)
    s.refused(tensors, inputs=[(1, 0, 8)], blob=i32s(0, 1), outputs=[2], fragment="rope offset")


def test_flash_attn_v_planes_that_do_not_divide_q_are_refused(s):
    """v.ne3 > q.ne3 makes the kernel's q.ne3 / v.ne3 zero, then divides by it."""
    s.refused(flash_graph(s.buf, v_ne3=2), outputs=[3], fragment="q/k/v heads")


def test_mul_mat_hadamard_hint_is_refused(s):
    tensors = [
        T(F32, [4, 4], buffer=s.buf), T(F32, [4, 1], buffer=s.buf, offset=64),
        T(F32, [4, 1], op=lib.GGML_OP_MUL_MAT, src=[0, 1], params=i32s(0, 1), flags=OUTPUT),
    ]
    s.refused(tensors, outputs=[2], fragment="hint 1")


def test_scale_of_a_view_with_unit_dim_stride_is_refused(s):
    """SCALE walks all rows as i * nb[1]; with ne[1] = 1 ggml_is_contiguous does
    not look at nb[1], so rows of planes 1.. would be read at i * 32 KiB."""
    tensors = [
        T(F32, [8, 1, 4, 1], buffer=s.buf),
        T(F32, [8, 1, 4, 1], [4, 32 * KiB, 32, 128], op=lib.GGML_OP_VIEW, src=[0], view_src=0),
        T(F32, [8, 1, 4, 1], op=lib.GGML_OP_SCALE, src=[1], params=f32s(2.0), flags=OUTPUT),
    ]
    s.refused(tensors, outputs=[2], fragment="SCALE")


def test_cont_of_a_strided_quantized_view_is_refused(s):
    """The strided byte copy counts a quantized row in elements, not blocks: it
    would copy 32 times the row."""
    tensors = [
        T(Q8_0, [64, 4], buffer=s.buf, offset=s.size - 4 * 68),
        T(Q8_0, [64, 2], [34, 136, 272, 272], op=lib.GGML_OP_VIEW, src=[0], view_src=0),
        T(Q8_0, [64, 2], op=lib.GGML_OP_CONT, src=[1], flags=OUTPUT),
    ]
    s.refused(tensors, outputs=[2], fragment="quantized src must be contiguous")


@pytest.mark.parametrize("case,fragment", [
    ("f16 source", "src1 type f16 not supported"),
    ("dim 4", "dim 4 not in 0..3"),
    ("shapes differ", "sources must match in every dim but 0"),
    ("short result", "result must be f32 [8, 2, 1, 1]"),
    ("strided result", "must be a new tensor, not a view"),
])
def test_concat_outside_its_rule_is_refused(s, case, fragment):
    """CONCAT's kernel (f32 only) copies element by element through every stride and
    asserts the type size: each way out of the rule is refused before it runs."""
    src1 = T(F16 if case == "f16 source" else F32, [4, 3 if case == "shapes differ" else 2], flags=INPUT)
    out = T(F32, [6 if case == "short result" else 8, 2], op=lib.GGML_OP_CONCAT, src=[0, 1], flags=OUTPUT,
            params=struct.pack("<i", 4 if case == "dim 4" else 0))
    tensors = [T(F32, [4, 2], flags=INPUT), src1, out]
    if case == "strided result":
        tensors = [T(F32, [16, 2], buffer=s.buf), tensors[0], tensors[1],
                   T(F32, [8, 2], [4, 64, 128, 128], op=lib.GGML_OP_CONCAT, src=[1, 2], view_src=0, flags=OUTPUT,
                     params=struct.pack("<i", 0))]
    n = len(tensors) - 1
    s.refused(tensors, inputs=[(n - 2, 0, 32), (n - 1, 0, 16 if case == "f16 source" else 32)],
              blob=f32s(*[1.0] * 8) + (bytes(16) if case == "f16 source" else f32s(*[1.0] * 8)), outputs=[n],
              fragment=fragment)


def pad_params(*pads, circular: int = 0) -> bytes:
    """ggml_pad_ext's op params: (left, right) of each of the 4 dims, then 1 for circular, 0 not."""
    return i32s(*(list(pads) + [0] * (8 - len(pads))), circular)


def test_pad_computes_zeros_around_its_source_and_the_connection_goes_on(s):
    """Exact sums' gather (GraphBuilder.gathered): zeros left and right of a member's rows, in two
    dims here; the result is numpy's pad of the source, and a refused PAD on the same connection
    does not stop the next one."""
    import numpy as np
    from rpc_daemon.wire.protocol import Command, Status
    x = np.arange(1, 7, dtype=np.float32).reshape(2, 3)  # ne [3, 2]
    good = [T(F32, [3, 2], flags=INPUT),
            T(F32, [6, 3], op=lib.GGML_OP_PAD, src=[0], params=pad_params(1, 2, 1, 0), flags=OUTPUT | COMPUTE)]
    request = {"tensors": good, "inputs": [[0, 0, 24]], "outputs": [1]}
    for attempt in range(2):
        h, out = s.conn.call(Command.GRAPH_COMPUTE, request, x.tobytes())
        assert h["status"] == Status.SUCCESS, h
        assert np.array_equal(np.frombuffer(out, np.float32).reshape(3, 6), np.pad(x, ((1, 0), (1, 2)))), out
        if attempt == 0:  # the same graph with one padding too many in its result: refused, then served again
            bad = [good[0], dict(good[1], ne=[7, 3, 1, 1], nb=[4, 28, 84, 84])]
            s.refused(bad, inputs=[(0, 0, 24)], blob=x.tobytes(), outputs=[1],
                      fragment="tensors[1]: PAD: result must be f32 [6, 3, 1, 1]")


@pytest.mark.parametrize("case,fragment", [
    ("f16 source", "tensors[1]: PAD: src0 type f16 not supported"),
    ("negative left padding", "tensors[1]: PAD: paddings [-1, 1, 0, 0, 0, 0, 0, 0] must not be negative"),
    ("negative padding of dim 1", "tensors[1]: PAD: paddings [0, 0, 1, -1, 0, 0, 0, 0] must not be negative"),
    ("circular", "tensors[1]: PAD: circular padding is not supported"),
    ("result ne", "tensors[1]: PAD: result must be f32 [6, 2, 1, 1]"),
    ("result ne of dim 3", "tensors[1]: PAD: result must be f32 [6, 2, 1, 1]"),
    ("f16 result", "tensors[1]: PAD: result must be f32 [6, 2, 1, 1]"),
    ("view result", "tensors[2]: PAD: the result of a computing op must be a new tensor, not a view"),
])
def test_pad_outside_its_rule_is_refused(s, case, fragment):
    """PAD's kernel is f32 only (another type aborts the compute process), reads the source at
    (i - left) for every result element inside the paddings (a negative one reads past it), writes
    the result's ne as a packed new tensor, and its circular variant is not taken: each way out of
    the rule is refused before it runs, and the daemon serves on (the fixture checks it)."""
    pads = {"negative left padding": (-1, 1), "negative padding of dim 1": (0, 0, 1, -1)}.get(case, (1, 1))
    src_type = F16 if case == "f16 source" else F32
    ne = {"result ne": [7, 2], "result ne of dim 3": [6, 2, 1, 2],
          "negative left padding": [4, 2], "negative padding of dim 1": [4, 2]}.get(case, [6, 2])
    out = T(F16 if case in ("f16 source", "f16 result") else F32, ne, op=lib.GGML_OP_PAD, src=[0], flags=OUTPUT,
            params=pad_params(*pads, circular=int(case == "circular")))
    tensors = [T(src_type, [4, 2], flags=INPUT), out]
    if case == "view result":  # a PAD written into a buffer tensor's rows, strided
        tensors = [T(F32, [16, 2], buffer=s.buf), tensors[0],
                   T(F32, [6, 2], [4, 64, 128, 128], op=lib.GGML_OP_PAD, src=[1], view_src=0, flags=OUTPUT,
                     params=pad_params(1, 1))]
    n = len(tensors) - 1
    size = 16 if src_type == F16 else 32
    s.refused(tensors, inputs=[(n - 1, 0, size)], blob=bytes(size) if src_type == F16 else f32s(*[1.0] * 8),
              outputs=[n], fragment=fragment)


def test_cpy_into_a_strided_quantized_view_is_refused(s):
    tensors = [
        T(Q8_0, [64, 4], buffer=s.buf),
        T(F32, [64, 2], flags=INPUT),
        T(Q8_0, [64, 2], [34, 136, 272, 272], op=lib.GGML_OP_VIEW, src=[0], view_src=0),
        T(Q8_0, [64, 2], [34, 136, 272, 272], op=lib.GGML_OP_CPY, src=[1, 2], view_src=0),
    ]
    s.refused(tensors, inputs=[(1, 0, 512)], blob=f32s(*[1.0] * 128), fragment="quantized result must be contiguous")


def test_computing_op_with_a_strided_view_result_is_refused(s):
    """A SCALE whose result is a strided view (nb[0] 8) of a buffer tensor:
    GGML_ASSERT(ggml_is_contiguous(dst)). Only VIEW-like ops, CPY and SET_ROWS
    have view results now."""
    tensors = [
        T(F32, [8, 2], buffer=s.buf),
        T(F32, [4, 2], buffer=s.buf, offset=256),
        T(F32, [4, 2], [8, 32, 64, 64], op=lib.GGML_OP_SCALE, src=[1], params=f32s(2.0), view_src=0, flags=OUTPUT),
    ]
    s.refused(tensors, outputs=[2], fragment="not a view")


def test_cpy_of_rows_longer_than_the_result_rows_is_refused(s):
    """CPY f32 [4096, 1] into a q8_0 [32, 128] tensor: the kernel widens each
    source row in a work buffer that ggml sizes by the result's ne[0] (32
    floats a thread), so the 4096-float row ran 16 KiB past it: heap corruption
    in the compute process (found reading the kernel for casts; the same
    graph computed in process segfaults at exit)."""
    tensors = [
        T(Q8_0, [32, 128], buffer=s.buf),
        T(F32, [4096, 1], flags=INPUT),
        T(Q8_0, [32, 128], op=lib.GGML_OP_CPY, src=[1, 0], view_src=0),
    ]
    s.refused(tensors, inputs=[(1, 0, 4096 * 4)], blob=f32s(*[1.0] * 4096), fragment="must not be longer")


def test_a_tensor_naming_itself_is_refused_except_as_a_casts_destination(s):
    """ggml_cast is a CPY whose src[1] is its own result: the one source that may
    name the tensor itself. Anywhere else a self-reference is refused."""
    x = T(F32, [256, 2], flags=INPUT)
    blob = f32s(*[1.0] * 512)
    s.refused([x, T(F32, [256, 2], op=lib.GGML_OP_ADD, src=[0, 1], flags=OUTPUT)], inputs=[(0, 0, 2048)],
              blob=blob, outputs=[1], fragment="only CPY's src[1] may name the tensor itself")
    s.refused([x, T(F32, [256, 2], op=lib.GGML_OP_CPY, src=[1, 1], flags=OUTPUT)], inputs=[(0, 0, 2048)],
              blob=blob, outputs=[1], fragment="only CPY's src[1] may name the tensor itself")
    # a cast's result is a new tensor the copy fills whole: never a view of a buffer tensor
    tensors = [T(lib.GGML_TYPE_Q8_K, [256, 2], buffer=s.buf), x,
               T(lib.GGML_TYPE_Q8_K, [256, 2], op=lib.GGML_OP_CPY, src=[1, 2], view_src=0, flags=OUTPUT)]
    s.refused(tensors, inputs=[(1, 0, 2048)], blob=blob, outputs=[2], fragment="must be a new tensor, not a view")


def test_mul_mat_src1_in_another_dot_type_or_strided_is_refused(s):
    """MUL_MAT reads a src1 already in src0's dot type in place, as packed rows of
    that type: another quantized type (q8_0 for q4_K weights, whose dot type is
    q8_K; any for f16 weights) or a strided view of one is refused."""
    Q4_K, Q8_K = lib.GGML_TYPE_Q4_K, lib.GGML_TYPE_Q8_K
    x = T(F32, [256, 2], flags=INPUT)
    blob = f32s(*[1.0] * 512)
    for wtype, dot, fragment in ((Q4_K, Q8_0, "src1 type q8_0 not supported (f32, or src0's dot type: q8_K)"),
                                 (F16, Q8_0, "src1 type q8_0 not supported (f32, or src0's dot type: none)")):
        tensors = [T(wtype, [256, 4], buffer=s.buf), x,
                   T(dot, [256, 2], op=lib.GGML_OP_CPY, src=[1, 2]),
                   T(F32, [4, 2], op=lib.GGML_OP_MUL_MAT, src=[0, 2], flags=OUTPUT)]
        s.refused(tensors, inputs=[(1, 0, 2048)], blob=blob, outputs=[3], fragment=fragment)
    q8k_row = 292
    tensors = [T(Q4_K, [256, 4], buffer=s.buf), T(F32, [256, 4], flags=INPUT),
               T(Q8_K, [256, 4], op=lib.GGML_OP_CPY, src=[1, 2]),
               T(Q8_K, [256, 2], [q8k_row, 2 * q8k_row, 4 * q8k_row, 4 * q8k_row], op=lib.GGML_OP_VIEW, src=[2],
                 view_src=2),
               T(F32, [4, 2], op=lib.GGML_OP_MUL_MAT, src=[0, 3], flags=OUTPUT)]
    s.refused(tensors, inputs=[(1, 0, 4096)], blob=f32s(*[1.0] * 1024), outputs=[4],
              fragment="dot type must be contiguous")
    # contiguous as ggml_is_contiguous sees it (ne[1] is 1, so nb[1] is not looked at), yet the tiled
    # kernel steps through its 3 rows by nb[1]: 100 rows apart, past the cast (found by a review)
    tensors = [T(Q4_K, [256, 4], buffer=s.buf), T(F32, [256, 3], flags=INPUT),
               T(Q8_K, [256, 3], op=lib.GGML_OP_CPY, src=[1, 2]),
               T(Q8_K, [256, 1, 3, 1], [q8k_row, 100 * q8k_row, q8k_row, 3 * q8k_row], op=lib.GGML_OP_VIEW,
                 src=[2], view_src=2),
               T(F32, [4, 1, 3, 1], op=lib.GGML_OP_MUL_MAT, src=[0, 3], flags=OUTPUT)]
    s.refused(tensors, inputs=[(1, 0, 3072)], blob=f32s(*[1.0] * 768), outputs=[4],
              fragment="dot type must be contiguous, with the strides")
