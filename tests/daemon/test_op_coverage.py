"""Every op the daemon accepts computes bit for bit what libggml computes in process.

For each op in rpc_daemon.validation.graph.OP_RULES (NONE aside), and for ops that read
weights, each tensor type llama and gemma3 GGUFs use (f32, f16, q8_0, q5_0,
q4_0, q4_K, q6_K), a small graph is built here with libggml's own op
constructors and computed twice:

  (a) in this process: weights in a CPU backend buffer, inputs and
      intermediates placed by ggml's graph allocator, CpuBackend with 1 thread;
  (b) by a real daemon (`-t 1`): the same weight bytes uploaded with SET_TENSOR
      to a remote buffer at the same offsets, the graph sent with
      GRAPH_COMPUTE (encode_graph), inputs inline, outputs read from the reply;
      then once more with GRAPH_RECOMPUTE.

The outputs must be equal byte for byte, and none may be all zeros (that would
mean a node was silently skipped, e.g. one that lost GGML_TENSOR_FLAG_COMPUTE
on the way, or that the test compares nothing). Quantized weights are made by
ggml_quantize_chunk from random f32, so every block is valid.

One daemon and one client serve the whole module.
"""
from __future__ import annotations

import asyncio
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from conftest import DaemonProcess
from ggml_ffi import NULL, Context, CpuBackend, Gallocr, ffi, lib, row_size, type_traits
from rpc_daemon.client import RpcClient
from rpc_daemon.validation.graph import OP_RULES
from rpc_daemon.wire.graph_codec import encode_graph
from rpc_daemon.wire.protocol import Command

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

F32, F16, I32, I64 = lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_I32, lib.GGML_TYPE_I64
Q8_0, Q5_0, Q4_0 = lib.GGML_TYPE_Q8_0, lib.GGML_TYPE_Q5_0, lib.GGML_TYPE_Q4_0
Q4_K, Q6_K = lib.GGML_TYPE_Q4_K, lib.GGML_TYPE_Q6_K

# tensor types found in llama and gemma3 GGUFs (weights)
WEIGHT_TYPES = (F32, F16, Q8_0, Q5_0, Q4_0, Q4_K, Q6_K)
# KV cache types set_rows / cpy may write
CACHE_TYPES = (F32, F16, Q8_0, Q4_0)
TNAME = {t: type_traits(t).name for t in WEIGHT_TYPES + (I32, I64)}


# ---------------------------------------------------------------- data

def random_bytes(rng: np.random.Generator, ttype: int, ne, lo: float = -1.0, hi: float = 1.0) -> bytes:
    """Random contents for a tensor of type `ttype` and shape `ne`; quantized
    types are quantized from random f32 by libggml itself."""
    ne = list(ne) + [1] * (4 - len(ne))
    n = math.prod(ne)
    vals = rng.uniform(lo, hi, n).astype(np.float32)
    if ttype == F32:
        return vals.tobytes()
    if ttype == F16:
        return vals.astype(np.float16).tobytes()
    assert not lib.ggml_quantize_requires_imatrix(ttype)
    nrows = n // ne[0]
    dst = bytearray(row_size(ttype, ne[0]) * nrows)
    written = lib.ggml_quantize_chunk(ttype, ffi.from_buffer("float[]", vals), ffi.from_buffer(dst),
                                      0, nrows, ne[0], NULL)
    assert written == len(dst)
    return bytes(dst)


# ---------------------------------------------------------------- building a case

class Builder:
    """Collects what a case declares: weights (live in a buffer, uploaded with
    SET_TENSOR), inputs (flagged INPUT, sent inline) and outputs."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.wctx = Context(64)
        self.ctx = Context(1024)
        self.weights: list[tuple[object, bytes]] = []
        self.inputs: list[tuple[object, bytes]] = []
        self.outputs: list = []

    @property
    def c(self):
        return self.ctx.ptr

    def weight(self, ttype: int, ne, data: bytes | None = None, name: str = "w", **kw):
        x = self.wctx.new_tensor(ttype, ne, f"{name}{len(self.weights)}")
        data = random_bytes(self.rng, ttype, ne, **kw) if data is None else data
        assert len(data) == lib.ggml_nbytes(x)
        self.weights.append((x, data))
        return x

    def input(self, ttype: int, ne, data: bytes | None = None, name: str = "in", **kw):
        x = self.ctx.new_tensor(ttype, ne, f"{name}{len(self.inputs)}")
        lib.ggml_set_input(x)
        data = random_bytes(self.rng, ttype, ne, **kw) if data is None else data
        assert len(data) == lib.ggml_nbytes(x)
        self.inputs.append((x, data))
        return x

    def ids(self, ttype: int, values, name: str = "ids"):
        dtype = np.int32 if ttype == I32 else np.int64
        return self.input(ttype, [len(values)], np.asarray(values, dtype).tobytes(), name)

    def output(self, x):
        lib.ggml_set_output(x)
        self.outputs.append(x)
        return x

    def close(self) -> None:
        self.ctx.close()
        self.wctx.close()


@dataclass
class Case:
    op: int  # the GGML_OP this case covers
    name: str
    build: Callable[[Builder], None]


CASES: list[Case] = []


def case(op_name: str, variant: str):
    def register(fn):
        CASES.append(Case(getattr(lib, f"GGML_OP_{op_name}"), f"{op_name}-{variant}", fn))
        return fn
    return register


# ---- element-wise binary ops: plain, row broadcast of a weight (norm weight / bias), f16 src0

BINARY = {"ADD": "ggml_add", "SUB": "ggml_sub", "MUL": "ggml_mul", "DIV": "ggml_div"}

for _op, _fn in BINARY.items():
    def _plain(b, fn=_fn):
        a = b.input(F32, [64, 4, 3])
        y = b.input(F32, [64, 4, 3], lo=0.5, hi=2.0)  # away from 0: DIV stays finite
        b.output(getattr(lib, fn)(b.c, a, y))

    def _bcast_weight(b, fn=_fn):
        a = b.input(F32, [64, 4, 3])
        w = b.weight(F32, [64], lo=0.5, hi=2.0)
        b.output(getattr(lib, fn)(b.c, a, w))

    def _bcast_rows(b, fn=_fn):
        a = b.input(F32, [64, 4, 3])
        y = b.input(F32, [64, 1, 3], lo=0.5, hi=2.0)
        b.output(getattr(lib, fn)(b.c, a, y))

    def _f16(b, fn=_fn):
        a = b.input(F16, [64, 4])
        y = b.input(F16, [64, 4], lo=0.5, hi=2.0)
        b.output(getattr(lib, fn)(b.c, a, y))

    def _f16_f32(b, fn=_fn):
        a = b.input(F16, [64, 4])
        y = b.input(F32, [64, 4], lo=0.5, hi=2.0)
        b.output(getattr(lib, fn)(b.c, a, y))

    case(_op, "f32")(_plain)
    case(_op, "f32-weight-bcast")(_bcast_weight)
    case(_op, "f32-row-bcast")(_bcast_rows)
    case(_op, "f16")(_f16)
    case(_op, "f16-f32")(_f16_f32)


@case("SCALE", "f32")
def _(b):
    b.output(lib.ggml_scale(b.c, b.input(F32, [64, 4, 2]), 0.125))


@case("SCALE", "by-zero")
def _(b):  # all its params are zero bytes, which the encoder strips: the worker reads them as zeros
    b.output(lib.ggml_scale(b.c, b.input(F32, [64, 4]), 0.0))


@case("RMS_NORM", "f32")
def _(b):
    b.output(lib.ggml_rms_norm(b.c, b.input(F32, [256, 5]), 1e-6))


@case("RMS_NORM", "f32-times-weight")
def _(b):  # the llama/gemma pattern: norm, then the f32 norm weight
    x = lib.ggml_rms_norm(b.c, b.input(F32, [256, 5]), 1e-6)
    b.output(x)
    b.output(lib.ggml_mul(b.c, x, b.weight(F32, [256])))


@case("NORM", "f32")
def _(b):
    b.output(lib.ggml_norm(b.c, b.input(F32, [256, 5]), 1e-5))


# ---- weights: mul_mat and get_rows with src0 of every weight type

for _t in WEIGHT_TYPES:
    def _mm(b, t=_t, n=5):
        w = b.weight(t, [256, 32])
        b.output(lib.ggml_mul_mat(b.c, w, b.input(F32, [256, n])))

    def _mm_vec(b, t=_t):
        _mm(b, t, 1)

    def _mm_batched(b, t=_t):  # src0 batch broadcast over src1 batches
        w = b.weight(t, [256, 16, 2])
        b.output(lib.ggml_mul_mat(b.c, w, b.input(F32, [256, 3, 4])))

    def _get_rows(b, t=_t):
        w = b.weight(t, [256, 16])
        b.output(lib.ggml_get_rows(b.c, w, b.ids(I32, [3, 0, 15, 3, 7])))

    case("MUL_MAT", f"{TNAME[_t]}")(_mm)
    case("MUL_MAT", f"{TNAME[_t]}-vec")(_mm_vec)
    case("MUL_MAT", f"{TNAME[_t]}-batched")(_mm_batched)
    case("GET_ROWS", f"{TNAME[_t]}")(_get_rows)


# ---- an input converted once to the weights' dot type (ggml_cast: a CPY onto itself), shared by two products

for _t in (Q8_0, Q5_0, Q4_0, Q4_K, Q6_K):
    def _mm_dot_type_src1(b, t=_t):
        from rpc_daemon.wire.graph_limits import DOT_TYPES
        x = lib.ggml_cast(b.c, b.input(F32, [256, 5]), DOT_TYPES[t])
        b.output(lib.ggml_mul_mat(b.c, b.weight(t, [256, 32]), x))
        b.output(lib.ggml_mul_mat(b.c, b.weight(t, [256, 16]), x))

    case("MUL_MAT", f"{TNAME[_t]}-dot-type-src1")(_mm_dot_type_src1)


@case("CPY", "cast-f32-to-q8_K")
def _(b):
    b.output(lib.ggml_cast(b.c, b.input(F32, [512, 3]), lib.GGML_TYPE_Q8_K))


@case("MUL_MAT", "f16-kq-permuted-src1")
def _(b):
    # attention without flash attn: kq = k^T q, k a view of an f16 cache, q permuted
    cache = b.weight(F16, [64, 16, 2])
    k = lib.ggml_view_3d(b.c, cache, 64, 12, 2, cache.nb[1], cache.nb[2], 0)
    q = lib.ggml_permute(b.c, b.input(F32, [64, 4, 3]), 0, 2, 1, 3)  # [64, 3 tokens, 4 heads]
    b.output(lib.ggml_mul_mat(b.c, k, q))


@case("GET_ROWS", "f32-batched")
def _(b):
    w = b.input(F32, [32, 8, 2])
    ids = b.input(I32, [3, 2], np.array([1, 7, 0, 5, 5, 2], np.int32).tobytes())
    b.output(lib.ggml_get_rows(b.c, w, ids))


# ---- KV cache writes: set_rows and cpy into a buffer tensor

for _t in CACHE_TYPES:
    for _idt in (I64, I32):
        def _set_rows(b, t=_t, idt=_idt):
            dst = b.weight(t, [64, 16], data=bytes(row_size(t, 64) * 16))  # zero cache
            src = b.input(F32, [64, 3])
            b.output(lib.ggml_set_rows(b.c, dst, src, b.ids(idt, [7, 2, 11])))

        case("SET_ROWS", f"{TNAME[_t]}-{TNAME[_idt]}")(_set_rows)

    def _cpy(b, t=_t):
        cache = b.weight(t, [64 * 16], data=bytes(row_size(t, 64 * 16)))
        dst = lib.ggml_view_1d(b.c, cache, 64 * 3, row_size(t, 64) * 5)  # rows 5..7
        b.output(lib.ggml_cpy(b.c, b.input(F32, [64, 3]), dst))

    case("CPY", f"f32-to-{TNAME[_t]}")(_cpy)


@case("CPY", "f32-to-f16-2d-view")
def _(b):  # llama's KV store without set_rows: a 2d view of the cache, row stride of the cache
    cache = b.weight(F16, [64, 16], data=bytes(row_size(F16, 64) * 16))
    dst = lib.ggml_view_2d(b.c, cache, 64, 3, cache.nb[1], cache.nb[1] * 4)
    b.output(lib.ggml_cpy(b.c, b.input(F32, [64, 3]), dst))


@case("CPY", "f16-to-f32")
def _(b):
    cache = b.weight(F32, [64, 4], data=bytes(4 * 64 * 4))
    b.output(lib.ggml_cpy(b.c, b.input(F16, [64, 4]), cache))


# ---- layout ops; pure views are observed through the node that consumes them

@case("CONCAT", "dim0-interleave")
def _(b):  # GraphBuilder.product's pairs: a weight's even and odd rows multiplied apart, interleaved
    w = b.weight(Q4_K, [1280, 8])
    x = b.input(F32, [1280, 9])
    halves = [lib.ggml_reshape_3d(b.c, lib.ggml_mul_mat(b.c, lib.ggml_view_2d(b.c, w, 1280, 4, 2 * w.nb[1],
                                                                               parity * w.nb[1]), x), 1, 4, 9)
              for parity in (0, 1)]
    b.output(lib.ggml_concat(b.c, halves[0], halves[1], 0))


@case("CONCAT", "dim2-of-views")
def _(b):
    x = lib.ggml_add(b.c, b.input(F32, [8, 4, 3]), b.input(F32, [8, 4, 3]))
    b.output(lib.ggml_concat(b.c, lib.ggml_permute(b.c, x, 0, 2, 1, 3), b.input(F32, [8, 3, 2]), 2))


@case("PAD", "gathered-rows")
def _(b):  # GraphBuilder.gathered: a member's rows of a product, zeros on both sides (its left and right peers')
    x = lib.ggml_mul_mat(b.c, b.weight(Q8_0, [64, 48]), b.input(F32, [64, 5]))
    b.output(lib.ggml_pad_ext(b.c, x, 16, 64, 0, 0, 0, 0, 0, 0))


@case("PAD", "every-dim-of-a-permuted-view")
def _(b):
    x = lib.ggml_add(b.c, b.input(F32, [8, 4, 3]), b.input(F32, [8, 4, 3]))
    b.output(lib.ggml_pad_ext(b.c, lib.ggml_permute(b.c, x, 0, 2, 1, 3), 1, 2, 0, 1, 2, 0, 1, 1))

@case("CONT", "permuted")
def _(b):
    x = lib.ggml_add(b.c, b.input(F32, [8, 4, 3]), b.input(F32, [8, 4, 3]))
    b.output(lib.ggml_cont(b.c, lib.ggml_permute(b.c, x, 0, 2, 1, 3)))


@case("CONT", "transposed")
def _(b):
    x = lib.ggml_add(b.c, b.input(F32, [16, 8]), b.input(F32, [16, 8]))
    b.output(lib.ggml_cont(b.c, lib.ggml_transpose(b.c, x)))


@case("CONT", "f16-transposed-weight")
def _(b):
    b.output(lib.ggml_cont(b.c, lib.ggml_transpose(b.c, b.weight(F16, [16, 8]))))


@case("RESHAPE", "intermediate")
def _(b):
    x = lib.ggml_add(b.c, b.input(F32, [64, 4]), b.input(F32, [64, 4]))
    r = lib.ggml_reshape_3d(b.c, x, 16, 4, 4)
    b.output(lib.ggml_mul(b.c, r, b.input(F32, [16, 4, 4])))


@case("RESHAPE", "weight")
def _(b):
    r = lib.ggml_reshape_2d(b.c, b.weight(F32, [256]), 64, 4)
    b.output(lib.ggml_add(b.c, r, b.input(F32, [64, 4])))


@case("RESHAPE", "reshape-like")
def _(b):
    x = lib.ggml_scale(b.c, b.input(F32, [8, 6]), 2.0)
    r = lib.ggml_reshape(b.c, x, b.ctx.new_tensor(F32, [12, 4]))  # shape donor only
    b.output(lib.ggml_add(b.c, r, b.input(F32, [12, 4])))


@case("VIEW", "rows-of-intermediate")
def _(b):
    x = lib.ggml_add(b.c, b.input(F32, [32, 6]), b.input(F32, [32, 6]))
    v = lib.ggml_view_2d(b.c, x, 32, 3, x.nb[1], x.nb[1] * 2)  # rows 2..4
    b.output(lib.ggml_add(b.c, v, b.input(F32, [32, 3])))


@case("VIEW", "f16-cache-3d")
def _(b):
    cache = b.weight(F16, [64, 16, 2])
    v = lib.ggml_view_3d(b.c, cache, 32, 8, 2, cache.nb[1], cache.nb[2], 32 * 2)  # cols 32..63, rows 0..7
    b.output(lib.ggml_cont(b.c, v))


@case("PERMUTE", "0213")
def _(b):
    x = lib.ggml_scale(b.c, b.input(F32, [8, 4, 3]), 3.0)
    b.output(lib.ggml_add(b.c, lib.ggml_permute(b.c, x, 0, 2, 1, 3), b.input(F32, [8, 3, 4])))


@case("PERMUTE", "2013-cont")
def _(b):
    x = lib.ggml_scale(b.c, b.input(F32, [8, 4, 3, 2]), 3.0)
    b.output(lib.ggml_cont(b.c, lib.ggml_permute(b.c, x, 2, 0, 1, 3)))


@case("TRANSPOSE", "f32")
def _(b):
    x = lib.ggml_scale(b.c, b.input(F32, [16, 8]), -1.5)
    b.output(lib.ggml_cont(b.c, lib.ggml_transpose(b.c, x)))


@case("TRANSPOSE", "f16-cache-mul-mat")
def _(b):  # v^T kq as llama does without flash attn: transposed f16 cache view, made contiguous
    cache = b.weight(F16, [16, 32])
    vt = lib.ggml_cont(b.c, lib.ggml_transpose(b.c, cache))  # [32, 16]
    b.output(lib.ggml_mul_mat(b.c, vt, b.input(F32, [32, 3])))


# ---- rope

ROPE_NORMAL, ROPE_NEOX = 0, 2


def _rope(b, mode, t=F32, n_dims=64, freq_factors=False, freq_scale=1.0, ext_factor=0.0, n_ctx_orig=0):
    x = b.input(t, [64, 4, 3])  # head dim, heads, tokens
    pos = b.ids(I32, [0, 5, 131], "pos")
    ff = b.weight(F32, [n_dims // 2], lo=1.0, hi=8.0) if freq_factors else NULL
    b.output(lib.ggml_rope_ext(b.c, x, pos, ff, n_dims, mode, n_ctx_orig, 10000.0, freq_scale,
                               ext_factor, 1.0, 32.0, 1.0))


for _mode_name, _mode in (("normal", ROPE_NORMAL), ("neox", ROPE_NEOX)):
    case("ROPE", f"{_mode_name}")(lambda b, m=_mode: _rope(b, m))
    case("ROPE", f"{_mode_name}-f16")(lambda b, m=_mode: _rope(b, m, t=F16))
    case("ROPE", f"{_mode_name}-partial")(lambda b, m=_mode: _rope(b, m, n_dims=32))
    case("ROPE", f"{_mode_name}-freq-factors")(lambda b, m=_mode: _rope(b, m, freq_factors=True))
    case("ROPE", f"{_mode_name}-linear-scale")(lambda b, m=_mode: _rope(b, m, freq_scale=0.125))
    case("ROPE", f"{_mode_name}-yarn")(lambda b, m=_mode: _rope(b, m, freq_scale=0.25, ext_factor=1.0,
                                                                n_ctx_orig=4096))


# ---- softmax and attention

def causal_mask(n_kv: int, n_tokens: int, first_pos: int, ttype: int) -> bytes:
    m = np.zeros((n_tokens, n_kv), np.float32)
    for i in range(n_tokens):
        m[i, first_pos + i + 1:] = -np.inf
    return m.astype(np.float16 if ttype == F16 else np.float32).tobytes()


def _soft_max(b, mask_type=None, max_bias=0.0, mask_heads=1):
    kq = b.input(F32, [16, 3, 4], lo=-4, hi=4)  # n_kv, tokens, heads
    mask = NULL
    if mask_type is not None:
        data = causal_mask(16, 3, 10, mask_type) * mask_heads
        mask = b.input(mask_type, [16, 3, mask_heads], data, "mask")
    b.output(lib.ggml_soft_max_ext(b.c, kq, mask, 0.125, max_bias))


case("SOFT_MAX", "nomask")(lambda b: _soft_max(b))
case("SOFT_MAX", "mask-f16")(lambda b: _soft_max(b, F16))
case("SOFT_MAX", "mask-f32")(lambda b: _soft_max(b, F32))
case("SOFT_MAX", "mask-f16-per-head")(lambda b: _soft_max(b, F16, mask_heads=4))
case("SOFT_MAX", "mask-f16-alibi")(lambda b: _soft_max(b, F16, max_bias=8.0))


def _flash_attn(b, kv_type=F16, n_head=4, n_head_kv=2, n_tokens=3, softcap=0.0, prec_f32=False, mask=True):
    d, n_kv = 64, 16
    # q as llama builds it: [d, heads, tokens] permuted to [d, tokens, heads]
    q = lib.ggml_permute(b.c, b.input(F32, [d, n_head, n_tokens]), 0, 2, 1, 3)
    k_cache = b.weight(kv_type, [d, n_head_kv, 32])  # [d, kv heads, cells]
    v_cache = b.weight(kv_type, [d, n_head_kv, 32])
    esz = type_traits(kv_type).type_size
    # views of the first n_kv cells: [d, n_kv, kv heads]
    k = lib.ggml_view_3d(b.c, k_cache, d, n_kv, n_head_kv, k_cache.nb[2], k_cache.nb[1], 0)
    v = lib.ggml_view_3d(b.c, v_cache, d, n_kv, n_head_kv, v_cache.nb[2], v_cache.nb[1], 0)
    assert esz * d == k_cache.nb[1]
    m = b.input(F16, [n_kv, n_tokens], causal_mask(n_kv, n_tokens, n_kv - n_tokens, F16), "mask") if mask else NULL
    out = lib.ggml_flash_attn_ext(b.c, q, k, v, m, 1.0 / 8.0, 0.0, softcap)
    if prec_f32:
        lib.ggml_flash_attn_ext_set_prec(out, lib.GGML_PREC_F32)
    b.output(out)


case("FLASH_ATTN_EXT", "f16")(lambda b: _flash_attn(b))
case("FLASH_ATTN_EXT", "f16-prec-f32")(lambda b: _flash_attn(b, prec_f32=True))
case("FLASH_ATTN_EXT", "f16-one-token")(lambda b: _flash_attn(b, n_tokens=1))
case("FLASH_ATTN_EXT", "f16-mha")(lambda b: _flash_attn(b, n_head_kv=4))
case("FLASH_ATTN_EXT", "f16-softcap")(lambda b: _flash_attn(b, softcap=50.0))
case("FLASH_ATTN_EXT", "f16-nomask")(lambda b: _flash_attn(b, mask=False))
case("FLASH_ATTN_EXT", "f32-kv")(lambda b: _flash_attn(b, kv_type=F32))


# ---- activations

for _name, _fn in (("gelu", "ggml_gelu"), ("silu", "ggml_silu"), ("tanh", "ggml_tanh")):
    for _t in (F32, F16):
        case("UNARY", f"{_name}-{TNAME[_t]}")(
            lambda b, fn=_fn, t=_t: b.output(getattr(lib, fn)(b.c, b.input(t, [128, 3], lo=-4, hi=4)))
        )

for _name in ("geglu", "swiglu"):
    for _t in (F32, F16):
        case("GLU", f"{_name}-{TNAME[_t]}")(
            lambda b, fn=f"ggml_{_name}", t=_t: b.output(getattr(lib, fn)(b.c, b.input(t, [128, 3], lo=-4, hi=4)))
        )
        case("GLU", f"{_name}_split-{TNAME[_t]}")(
            lambda b, fn=f"ggml_{_name}_split", t=_t: b.output(getattr(lib, fn)(
                b.c, b.input(t, [64, 3], lo=-4, hi=4), b.input(t, [64, 3], lo=-4, hi=4)))
        )


@case("GLU", "swiglu_split-ffn-q4_K")
def _(b):  # a llama FFN: down(silu(gate x) * up x), quantized weights
    x = b.input(F32, [256, 3])
    gate = lib.ggml_mul_mat(b.c, b.weight(Q4_K, [256, 512]), x)
    up = lib.ggml_mul_mat(b.c, b.weight(Q4_K, [256, 512]), x)
    b.output(lib.ggml_mul_mat(b.c, b.weight(Q6_K, [512, 256]), lib.ggml_swiglu_split(b.c, gate, up)))


@case("ARGMAX", "logits-q6_K")
def _(b):  # greedy decoding on the worker: the output head's argmax per row
    logits = lib.ggml_mul_mat(b.c, b.weight(Q6_K, [256, 1000]), b.input(F32, [256, 4]))
    b.output(lib.ggml_argmax(b.c, logits))


@case("TOP_K", "router-8-of-64")
def _(b):  # a mixture of experts picks each token's best experts
    b.output(lib.ggml_top_k(b.c, lib.ggml_soft_max(b.c, b.input(F32, [64, 5], lo=-4, hi=4)), 8))


for _t in (F32, F16, Q8_0, Q4_0, Q4_K):
    def _moe(b, t=_t):  # build_moe_ffn's expert products: ids from a TOP_K, and inline
        x = b.input(F32, [256, 1, 3])
        experts = b.weight(t, [256, 32, 6])
        chosen = lib.ggml_top_k(b.c, b.input(F32, [6, 3], lo=-4, hi=4), 2)
        b.output(lib.ggml_mul_mat_id(b.c, experts, x, chosen))
        ids = b.input(I32, [4, 3], np.array([5, 0, 5, 1, 2, 3, 4, 0, 1, 1, 1, 1], np.int32).tobytes())
        b.output(lib.ggml_mul_mat_id(b.c, experts, b.input(F32, [256, 2, 3]), ids))

    case("MUL_MAT_ID", f"{TNAME[_t]}")(_moe)


@case("MUL_MAT_ID", "moe-ffn-qwen3moe")
def _(b):  # common.moe_ffn as a qwen3moe layer builds it, on 4 tokens
    from coordinator.model.architectures.common import GraphBuilder, HParams
    hp = HParams(arch="qwen3moe", n_vocab=1, n_embd=256, n_layer=1, n_ff=64, n_head=1, n_head_kv=1, head_dim=256,
                 n_rot=256, rms_eps=1e-6, rope_type=2, rope_base=1e6, n_expert=8, n_expert_used=2)
    w = {"blk.0.ffn_gate_inp.weight": b.weight(F32, [256, 8], lo=-2, hi=2),
         "blk.0.ffn_gate_exps.weight": b.weight(Q8_0, [256, 64, 8]),
         "blk.0.ffn_up_exps.weight": b.weight(Q8_0, [256, 64, 8]),
         "blk.0.ffn_down_exps.weight": b.weight(F16, [64, 256, 8])}
    builder = GraphBuilder(b.ctx, hp, w, None, None, None, None)
    b.output(builder.moe_ffn(0, b.input(F32, [256, 4])))


@case("SUM_ROWS", "f32")
def _(b):
    b.output(lib.ggml_sum_rows(b.c, b.input(F32, [1000, 3], lo=-4, hi=4)))


@case("ARANGE", "0-1000")
def _(b):
    b.output(lib.ggml_arange(b.c, 0.0, 1000.0, 1.0))


@case("TOP_K", "argmax_first-ties")
def _(b):  # greedy on the worker (a TOP_K of 1), ties to the lowest id: logits of 4 rows with every value 5 times
    from coordinator.model.architectures.common import argmax_first
    rng = np.random.default_rng(7)
    data = np.repeat(rng.integers(-8, 8, (4, 200)).astype(np.float32), 5, axis=1)
    data[2, 500] = -np.inf  # its finiteness probe: NaN in row 2, 0 in the others (all zeros would prove nothing)
    for out in argmax_first(b.c, b.input(F32, [1000, 4], data=data.tobytes())):
        b.output(out)


# ---------------------------------------------------------------- running a case

@dataclass
class Remote:
    daemon: DaemonProcess
    loop: asyncio.AbstractEventLoop
    client: RpcClient

    def request(self, cmd, fields=None, blob=b""):
        return self.loop.run_until_complete(self.client.request(cmd, fields, blob))


@pytest.fixture(scope="module")
def remote():
    d = DaemonProcess("-t", "1")
    loop = asyncio.new_event_loop()
    try:
        client = loop.run_until_complete(RpcClient.connect(d.endpoint, liveness_timeout=30.0))
        yield Remote(d, loop, client)
        loop.run_until_complete(client.aclose())
    finally:
        loop.close()
        d.stop()
        d.kill()


@pytest.fixture(scope="module")
def backend():
    with CpuBackend(1) as be:
        yield be


def run_local(backend: CpuBackend, b: Builder, gf) -> list[bytes]:
    galloc = Gallocr(backend)
    try:
        assert galloc.alloc_graph(gf), "ggml_gallocr_alloc_graph failed"
        for x, data in b.inputs:
            lib.ggml_backend_tensor_set(x, data, 0, len(data))
        assert backend.compute(gf) == lib.GGML_STATUS_SUCCESS
        return [bytes(ffi.buffer(x.data, lib.ggml_nbytes(x))) for x in b.outputs]
    finally:
        galloc.close()


def run_remote(remote: Remote, b: Builder, gf, wbuf, graph_id: int) -> tuple[list[bytes], list[bytes]]:
    """Outputs of GRAPH_COMPUTE and of a following GRAPH_RECOMPUTE."""
    rbuf, offsets = None, {}
    if wbuf is not None:
        base = int(ffi.cast("uintptr_t", lib.ggml_backend_buffer_get_base(wbuf)))
        h, _ = remote.request(Command.ALLOC_BUFFER, {"size": lib.ggml_backend_buffer_get_size(wbuf)})
        rbuf = h["buffer"]
        for x, data in b.weights:
            off = int(ffi.cast("uintptr_t", x.data)) - base
            offsets[x] = off
            remote.request(Command.SET_TENSOR, {"buffer": rbuf, "offset": off, "size": len(data)}, data)
    try:
        tensors, index_of = encode_graph(gf, lambda x: (rbuf, offsets[x]) if x in offsets else None)
        blob, inputs = bytearray(), []
        for x, data in b.inputs:
            inputs.append([index_of[x], len(blob), len(data)])
            blob += data
        outputs = [index_of[x] for x in b.outputs]

        def unpack(h, out):
            assert [o[0] for o in h["outputs"]] == outputs
            return [bytes(out[off:off + n]) for _, off, n in h["outputs"]]

        h, out = remote.request(Command.GRAPH_COMPUTE, {"graph_id": graph_id, "tensors": tensors,
                                                        "inputs": inputs, "outputs": outputs}, bytes(blob))
        first = unpack(h, out)
        h, out = remote.request(Command.GRAPH_RECOMPUTE, {"graph_id": graph_id, "inputs": inputs,
                                                          "outputs": outputs}, bytes(blob))
        again = unpack(h, out)
        remote.request(Command.GRAPH_FREE, {"graph_id": graph_id})
        return first, again
    finally:
        if rbuf is not None:
            remote.request(Command.FREE_BUFFER, {"buffer": rbuf})


def describe_diff(x, local: bytes, got: bytes) -> str:
    if len(local) != len(got):
        return f"sizes differ: local {len(local)} B, daemon {len(got)} B"
    a, g = np.frombuffer(local, np.uint8), np.frombuffer(got, np.uint8)
    bad = np.flatnonzero(a != g)
    msg = f"{len(bad)} of {len(a)} bytes differ, first at byte {bad[0]}"
    if x.type == F32:
        fa, fg = np.frombuffer(local, np.float32), np.frombuffer(got, np.float32)
        i = bad[0] // 4
        msg += f" (element {i}: local {fa[i]!r}, daemon {fg[i]!r})"
    return msg


@pytest.mark.parametrize("spec", CASES, ids=[c.name for c in CASES])
def test_op_matches_in_process(spec: Case, remote: Remote, backend: CpuBackend):
    b = Builder(seed=zlib.crc32(spec.name.encode()))
    wbuf = None
    try:
        spec.build(b)
        gf = b.ctx.new_graph()
        for x in b.outputs:
            lib.ggml_build_forward_expand(gf, x)
        ops = {lib.ggml_graph_node(gf, i).op for i in range(lib.ggml_graph_n_nodes(gf))}
        assert spec.op in ops, "the case does not exercise the op it is named after"
        if b.weights:
            wbuf = lib.ggml_backend_alloc_ctx_tensors(b.wctx.ptr, backend.ptr)
            assert wbuf != NULL
            for x, data in b.weights:
                lib.ggml_backend_tensor_set(x, data, 0, len(data))

        first, again = run_remote(remote, b, gf, wbuf, graph_id=1)
        local = run_local(backend, b, gf)

        for x, want, got, got2 in zip(b.outputs, local, first, again):
            name = f"output {ffi.string(x.name).decode()!r} ({ffi.string(lib.ggml_op_desc(x)).decode()})"
            assert any(want), f"{name} is all zeros in process: a node was skipped or the case is vacuous"
            assert got == want, f"{name} GRAPH_COMPUTE differs: {describe_diff(x, want, got)}"
            assert got2 == want, f"{name} GRAPH_RECOMPUTE differs: {describe_diff(x, want, got2)}"
    finally:
        if wbuf is not None:
            lib.ggml_backend_buffer_free(wbuf)
        b.close()


def test_every_supported_op_is_covered():
    covered = {c.op for c in CASES}
    missing = [ffi.string(lib.ggml_op_name(op)).decode() for op in OP_RULES
               if op != lib.GGML_OP_NONE and op not in covered]
    assert not missing, f"ops the daemon accepts but no case covers: {missing}"


def test_every_weight_type_is_covered():
    names = {c.name for c in CASES}
    for t in WEIGHT_TYPES:
        assert f"MUL_MAT-{TNAME[t]}" in names and f"GET_ROWS-{TNAME[t]}" in names


def test_set_rows_with_more_src_planes_than_dst_is_refused():
    """The CPU kernel writes src plane (i2, i3) into dst plane (i2, i3); a dst
    with fewer planes than src would be written past its end."""
    from rpc_daemon.validation.graph import parse_graph
    from rpc_daemon.wire.protocol import Limits, ProtocolError

    with Context(16) as ctx:
        dst = ctx.new_tensor(F32, [64, 16, 2], "dst")
        src = ctx.new_tensor(F32, [64, 3, 2], "src")
        ids = ctx.new_tensor(I64, [3, 1], "ids")
        lib.ggml_set_input(src)
        lib.ggml_set_input(ids)
        r = lib.ggml_set_rows(ctx.ptr, dst, src, ids)
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, r)
        tensors, index_of = encode_graph(gf, lambda x: (1, 0) if x == dst else None)
    buffer_size = lambda key: 64 * 16 * 2 * 4 if key == 1 else None  # noqa: E731
    parse_graph({"tensors": tensors}, Limits(), buffer_size)  # as built by ggml: accepted
    for i in (index_of[dst], index_of[r]):  # dst (and its view) shrunk to one plane
        tensors[i]["ne"][2] = 1
    with pytest.raises(ProtocolError, match="batch dims"):
        parse_graph({"tensors": tensors}, Limits(), buffer_size)



def test_arange_whose_length_the_kernel_would_assert_on_is_refused():
    from rpc_daemon.validation.graph import parse_graph
    from rpc_daemon.wire.protocol import Limits, ProtocolError

    with Context(8) as ctx:
        r = lib.ggml_arange(ctx.ptr, 0.5, 10.0, 0.75)  # ceil(9.5 / 0.75) = 13 elements
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, r)
        tensors, index_of = encode_graph(gf, lambda x: None)
    assert tensors[index_of[r]]["ne"][0] == 13
    parse_graph({"tensors": tensors}, Limits(), lambda key: None)  # as built by ggml: accepted
    for ne0 in (12, 14):
        tensors[index_of[r]]["ne"][0] = ne0
        tensors[index_of[r]]["nb"][1:] = [4 * ne0] * 3
        with pytest.raises(ProtocolError, match=r"ARANGE: result must be f32 \[13\]"):
            parse_graph({"tensors": tensors}, Limits(), lambda key: None)
    tensors[index_of[r]]["params"] = struct.pack("<3f", -3e38, 3e38, 1e-30)  # (stop - start) overflows f32
    with pytest.raises(ProtocolError, match="overflows f32"):
        parse_graph({"tensors": tensors}, Limits(), lambda key: None)


BF16 = lib.GGML_TYPE_BF16
ABORTING = {  # graphs libggml's CPU backend aborts on (SIGABRT in the compute process): refuse them
    "SCALE-f16": (lambda c, i: lib.ggml_scale(c, i(F16, [64]), 2.0), "SCALE: src0 type f16"),
    "ADD-f32-f16": (lambda c, i: lib.ggml_add(c, i(F32, [64]), i(F16, [64])), "ADD: src1 type must equal"),
    "MUL-f32-bf16": (lambda c, i: lib.ggml_mul(c, i(F32, [64]), i(BF16, [64])), "MUL: src1 type must equal"),
    "UNARY-gelu-bf16": (lambda c, i: lib.ggml_gelu(c, i(BF16, [64])), "UNARY: src0 type bf16"),
    "GLU-swiglu-bf16": (lambda c, i: lib.ggml_swiglu(c, i(BF16, [64])), "GLU: src0 type bf16"),
}


@pytest.mark.parametrize("name", ABORTING)
def test_validator_refuses_what_the_cpu_backend_aborts_on(name):
    from rpc_daemon.validation.graph import parse_graph
    from rpc_daemon.wire.protocol import Limits, ProtocolError

    make, message = ABORTING[name]
    with Context(16) as ctx:
        def inp(t, ne):
            x = ctx.new_tensor(t, ne, "x")
            lib.ggml_set_input(x)
            return x
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, make(ctx.ptr, inp))
        tensors, _ = encode_graph(gf, lambda t: None)
    with pytest.raises(ProtocolError, match=message):
        parse_graph({"tensors": tensors}, Limits(), lambda key: None)
