"""Graph-extent fuzzing: random graphs that rpc_daemon/validation/graph.py accepts, computed
on client buffers fenced by PROT_NONE guard pages, must neither fault nor write
outside what they declare.

Used by tests/daemon/test_graph_extents.py (a few thousand cases in CI) and
bench/fuzz_extents.py (long runs).

* `generate(rnd)` builds one case for an op of graph.OP_RULES (chosen at
  random, NONE aside): sources made by the op rules with random shapes and
  types, from client buffers (random offsets), inline inputs, intermediates
  and views of them (VIEW with padding and offsets, PERMUTE, TRANSPOSE,
  RESHAPE); then, for about a third of the cases, one random mutation of a
  stride, view offset, offset, shape or op parameter. Most cases are accepted.
* `validate(case)` is the daemon's choke point: graph.parse_graph with the
  buffers' sizes, then row_ids on the inline ids.
* `Harness` runs accepted cases in a long-lived child process (this file run
  as a script with `--child`), fed over a pipe. The child keeps one slot per
  client buffer: [guard | area | guard], guards PROT_NONE and larger than any
  reach the generated sizes allow, the buffer placed so that it ends where the
  trailing guard starts. Each area is filled with a canary pattern (the
  buffer's data is the canary), the graph is built with
  graph_codec.build_graph, allocated with Gallocr and computed on CpuBackend
  exactly as rpc_daemon/compute/worker.py does; then every byte of every area
  outside the byte ranges the graph's buffer-writing nodes (CPY, SET_ROWS)
  declare, [offset, offset + extent), must still hold the canary. The graph's
  intermediates are moved into a fenced copy of Gallocr's buffer (ComputeFence)
  and the CPU backend's work memory is placed at the end of a fenced,
  canary-filled area (WorkFence: MUL_MAT_ID's row map, TOP_K's index rows,
  MUL_MAT's converted src1 live there). A fault or abort kills the child: the
  harness reports the case (and its signal) and starts a new child.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import pickle
import random
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ggml_ffi import lib, type_traits  # noqa: E402
from rpc_daemon.validation import graph as G  # noqa: E402
from rpc_daemon.validation import row_ids  # noqa: E402
from rpc_daemon.wire.protocol import Limits, ProtocolError, Status  # noqa: E402

F32, F16, BF16, I32, I64 = (lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_BF16, lib.GGML_TYPE_I32,
                            lib.GGML_TYPE_I64)
QTYPES = [t for t in G.WEIGHT_TYPES if type_traits(t).blck_size > 1]
# docs/protocol.md ("Validation"): a quantized weight type's dot type, and what CPY may write
_T = SimpleNamespace(**{name[len("GGML_TYPE_"):]: getattr(lib, name) for name in dir(lib)
                        if name.startswith("GGML_TYPE_")})
DOT_TYPES = {_T.Q4_0: _T.Q8_0, _T.Q5_0: _T.Q8_0, _T.Q8_0: _T.Q8_0, _T.Q4_1: _T.Q8_1, _T.Q5_1: _T.Q8_1,
             **{t: _T.Q8_K for t in (_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K)}}
CPY_TYPES = list(G.KV_TYPES) + [_T.Q8_1, _T.Q8_K]
INPUT, OUTPUT, COMPUTE = lib.GGML_TENSOR_FLAG_INPUT, lib.GGML_TENSOR_FLAG_OUTPUT, lib.GGML_TENSOR_FLAG_COMPUTE
OP = SimpleNamespace(**{name[len("GGML_OP_"):]: getattr(lib, name) for name in dir(lib)
                        if name.startswith("GGML_OP_") and not name.startswith("GGML_OP_POOL_")})

AREA = 256 << 10  # room for one client buffer
MAX_BUFFERS = 4
# every generated stride is < 2^20 and every ne[i] <= 256, so nothing reaches 4 * 2^28 bytes... in
# practice a few MiB at most: 64 MiB of PROT_NONE on each side of every buffer is plenty (and free)
GUARD = 64 << 20
MAX_NB_MUTATION = 1 << 20


# Written from docs/protocol.md ("Validation"), not imported from graph.py, so the harness also runs
# against other versions of the validator (e.g. the one before the audit, to see it find the bugs).

def canonical_nb(ttype, ne) -> list[int]:
    tr = type_traits(ttype)
    nb = [tr.type_size, tr.type_size * ne[0] // tr.blck_size]
    for i in (2, 3):
        nb.append(nb[-1] * ne[i - 1])
    return nb


def nbytes_canonical(ttype, ne) -> int:
    return canonical_nb(ttype, ne)[3] * ne[3]


def extent(ttype, ne, nb) -> int:
    """Bytes from a tensor's data pointer the kernels may touch (docs/protocol.md)."""
    tr = type_traits(ttype)
    first = max(tr.type_size * ne[0] // tr.blck_size, (ne[0] // tr.blck_size - 1) * nb[0] + tr.type_size)
    return first + sum((ne[i] - 1) * nb[i] for i in range(1, 4))


def is_contiguous(ttype, ne, nb) -> bool:
    tr = type_traits(ttype)
    if ne[0] != tr.blck_size and nb[0] != tr.type_size:
        return False
    expect = tr.type_size * ne[0] // tr.blck_size
    for i in range(1, 4):
        if ne[i] != 1 and nb[i] != expect:
            return False
        expect *= ne[i]
    return True


UNARY_OPS = sorted(getattr(lib, f"GGML_UNARY_OP_{n}") for n in (
    "ABS", "SGN", "NEG", "STEP", "TANH", "ELU", "RELU", "SIGMOID", "GELU", "GELU_QUICK", "SILU", "HARDSWISH",
    "HARDSIGMOID", "EXP", "EXPM1", "SOFTPLUS", "GELU_ERF", "FLOOR", "CEIL", "ROUND", "TRUNC"))
GLU_OPS = sorted(getattr(lib, f"GGML_GLU_OP_{n}") for n in (
    "REGLU", "GEGLU", "SWIGLU", "SWIGLU_OAI", "GEGLU_ERF", "GEGLU_QUICK"))


def canonical_tensor(ttype, ne, **kw) -> dict:
    return dict({"type": ttype, "ne": list(ne), "nb": canonical_nb(ttype, ne)}, **kw)


def f32s(*v) -> bytes:
    return struct.pack(f"<{len(v)}f", *v)


def i32s(*v) -> bytes:
    return struct.pack(f"<{len(v)}i", *v)


# ================================================================ generating cases

@dataclass
class Case:
    op: str
    tensors: list
    buffers: dict  # id -> size
    inputs: list  # (tensor index, bytes)
    outputs: list
    mutation: str = ""

    def request(self) -> tuple[dict, bytes]:
        blob, inputs = b"", []
        for i, data in self.inputs:
            inputs.append([i, len(blob), len(data)])
            blob += data
        return {"tensors": self.tensors, "inputs": inputs, "outputs": self.outputs}, blob

    def describe(self) -> str:
        lines = [f"op {self.op}, buffers {self.buffers}, mutation {self.mutation or 'none'}"]
        for i, t in enumerate(self.tensors):
            lines.append(f"  {i}: {t}")
        return "\n".join(lines)


class Gen:
    def __init__(self, rnd: random.Random):
        self.r = rnd
        self.tensors: list[dict] = []
        self.used: dict[int, int] = {}  # buffer id -> bytes placed so far
        self.inputs: list[tuple[int, bytes]] = []
        self.np = np.random.default_rng(rnd.getrandbits(32))

    # ------------------------------------------------------------ leaves and views

    def add(self, t: dict) -> int:
        self.tensors.append(t)
        return len(self.tensors) - 1

    def data(self, ttype, ne, lo=-2.0, hi=2.0) -> bytes:
        n = math.prod(ne)
        if ttype == F32:
            return self.np.uniform(lo, hi, n).astype(np.float32).tobytes()
        if ttype == F16:
            return self.np.uniform(lo, hi, n).astype(np.float16).tobytes()
        if ttype in (I32, I64):
            return self.np.integers(0, 8, n).astype(np.int32 if ttype == I32 else np.int64).tobytes()
        return self.np.integers(0, 256, nbytes_canonical(ttype, ne), dtype=np.uint8).tobytes()

    def buffer_leaf(self, ttype, ne, buf=None) -> int:
        r = self.r
        size = nbytes_canonical(ttype, ne)
        if buf is None:
            fits = [b for b, used in self.used.items() if used + size + 256 <= AREA]
            if fits and r.random() < 0.6:
                buf = r.choice(fits)
            elif len(self.used) < MAX_BUFFERS:
                buf = len(self.used) + 1
                self.used[buf] = 0
            else:
                buf = min(self.used, key=self.used.get)
        align = r.choice([4, 4, 32, 64, type_traits(ttype).type_size])
        off = self.used[buf] + r.choice([0, 0, 0, 4, 8, 64, r.randrange(0, 200)])
        off = (off + align - 1) // align * align
        self.used[buf] = off + size
        return self.add({"type": ttype, "ne": list(ne), "nb": canonical_nb(ttype, ne), "buffer": buf, "offset": off,
                         "name": f"b{buf}@{off}"})

    def input_leaf(self, ttype, ne, data: bytes | None = None) -> int:
        i = self.add({"type": ttype, "ne": list(ne), "nb": canonical_nb(ttype, ne), "flags": INPUT, "name": "in"})
        self.inputs.append((i, data if data is not None else self.data(ttype, ne)))
        return i

    def leaf(self, ttype, ne, where=None) -> int:
        where = where or self.r.choice(["buf", "buf", "input"])
        return self.buffer_leaf(ttype, ne) if where == "buf" else self.input_leaf(ttype, ne)

    def base(self, ttype, ne) -> int:
        """The root of a view: a leaf, or now and then an intermediate (a view of
        compute-buffer memory Gallocr placed)."""
        if type_traits(ttype).blck_size == 1 and self.r.random() < 0.25:
            return self.node(OP.CONT, ttype, ne, [self.leaf(ttype, ne)])
        return self.leaf(ttype, ne)

    def view(self, parent: int, ne, nb, offs: int, op=None, params=b"") -> int:
        p = self.tensors[parent]
        root = p.get("view_src", -1)
        if root < 0:
            root, base = parent, 0
        else:
            base = p.get("view_offs", 0)
        return self.add({"type": p["type"], "ne": list(ne), "nb": list(nb), "op": op or OP.VIEW, "src": [parent],
                         "view_src": root, "view_offs": base + offs, "params": params, "name": "view"})

    def node(self, op, ttype, ne, src, params=b"", flags=COMPUTE, **kw) -> int:
        return self.add(dict({"type": ttype, "ne": list(ne), "nb": canonical_nb(ttype, ne), "op": op,
                              "src": list(src), "params": params, "flags": flags, "name": f"op{op}"}, **kw))

    def src(self, ttype, ne, strided_ok=False, packed=False) -> int:
        """A tensor of `ttype` and shape `ne`, made one of several ways. `strided_ok`:
        the consumer honours any nb[0] (CPY, CONT); `packed`: it wants a
        contiguous tensor (then only leaves, intermediates and reshapes)."""
        r = self.r
        ne = list(ne)
        block = type_traits(ttype).blck_size > 1
        kinds = ["leaf", "leaf", "padded", "intermediate"]
        if packed:
            kinds = ["leaf", "leaf", "reshape", "intermediate"]
        elif not block:
            kinds += ["permuted", "reshape"] + (["transposed"] if strided_ok else [])
        if block or ttype not in (F32, F16):
            kinds = [k for k in kinds if k != "intermediate"]
        kind = r.choice(kinds)
        if kind == "leaf":
            return self.leaf(ttype, ne)
        if kind == "intermediate":
            # a fresh tensor computed in the compute buffer: SCALE (f32) or CONT of a leaf
            x = self.leaf(ttype, ne)
            if ttype == F32 and r.random() < 0.5:
                return self.node(OP.SCALE, F32, ne, [x], f32s(r.uniform(-2, 2)))
            return self.node(OP.CONT, ttype, ne, [x])
        if kind == "padded":
            # a window of a larger root: rows and planes padded, start anywhere in it
            tr = type_traits(ttype)
            pad = [r.choice([0, 0, tr.blck_size, 2 * tr.blck_size]) if not block else r.choice([0, tr.blck_size])]
            pad += [r.choice([0, 0, 1, 3]) for _ in range(3)]
            pne = [n + p for n, p in zip(ne, pad)]
            parent = self.base(ttype, pne)
            pnb = canonical_nb(ttype, pne)
            start = [r.randrange(0, p + 1) for p in pad]
            start[0] -= start[0] % tr.blck_size
            offs = start[0] // tr.blck_size * tr.type_size + sum(start[i] * pnb[i] for i in range(1, 4))
            return self.view(parent, ne, pnb, offs)
        if kind == "permuted":
            perm = [0, 1, 2, 3]
            rest = perm[1:]
            r.shuffle(rest)
            perm = [0] + rest if not strided_ok or r.random() < 0.7 else r.sample(perm, 4)
            # new dim j is parent dim perm[j]
            pne = [0] * 4
            for j in range(4):
                pne[perm[j]] = ne[j]
            parent = self.base(ttype, pne)
            pnb = canonical_nb(ttype, pne)
            nb = [pnb[perm[j]] for j in range(4)]
            axes = [0] * 4
            for j in range(4):
                axes[perm[j]] = j
            return self.view(parent, ne, nb, 0, OP.PERMUTE, i32s(*axes))
        if kind == "transposed":
            pne = [ne[1], ne[0], ne[2], ne[3]]
            parent = self.base(ttype, pne)
            pnb = canonical_nb(ttype, pne)
            return self.view(parent, ne, [pnb[1], pnb[0], pnb[2], pnb[3]], 0, OP.TRANSPOSE)
        # reshape of a contiguous leaf with the same element count
        n = math.prod(ne)
        pne = [ne[0] * ne[1], 1, ne[2], ne[3]] if r.random() < 0.5 else [n, 1, 1, 1]
        parent = self.base(ttype, pne)
        return self.view(parent, ne, canonical_nb(ttype, ne), 0, OP.RESHAPE)

    # ------------------------------------------------------------ random shapes

    def dim(self, hi=6) -> int:
        return self.r.choice([1, 1, 2, 3, self.r.randint(1, hi)])

    def row(self, ttype=F32, hi=40) -> int:
        b = type_traits(ttype).blck_size
        if b > 1:
            return b * self.r.choice([1, 1, 2]) if b <= 32 else b
        return self.r.choice([1, 2, 4, 7, 8, 16, self.r.randint(1, hi)])

    def shape(self, ttype=F32) -> list[int]:
        return [self.row(ttype), self.dim(5), self.dim(3), self.r.choice([1, 1, 1, 2])]


# ------------------------------------------------------------ one builder per op

def op_binary(g: Gen, op):
    r = g.r
    a_t = r.choice(G.FLOAT_TYPES)
    b_t = r.choice([a_t, F32])
    ne = g.shape()
    bne = [n if r.random() < 0.6 else 1 for n in ne]
    if r.random() < 0.2 and ne[0] % 2 == 0:
        bne[0] = ne[0] // 2  # repeats along rows
    a, b = g.src(a_t, ne), g.src(b_t, bne)
    return g.node(op, a_t, ne, [a, b])


def op_scale(g: Gen):
    ne = g.shape()
    a = g.src(F32, ne, packed=g.r.random() < 0.7)
    params = f32s(g.r.uniform(-3, 3)) + (f32s(g.r.uniform(-1, 1)) if g.r.random() < 0.4 else b"")
    return g.node(OP.SCALE, F32, ne, [a], params)


def op_norm(g: Gen, op):
    ne = g.shape()
    a = g.src(F32, ne)
    return g.node(op, F32, ne, [a], f32s(g.r.choice([0.0, 1e-6, 1e-5, 0.1])))


def op_mul_mat(g: Gen):
    r = g.r
    wt = r.choice(list(G.WEIGHT_TYPES))
    k = g.row(wt) if type_traits(wt).blck_size > 1 else r.choice([1, 4, 8, 16, 32, r.randint(1, 40)])
    m, n = g.dim(8), g.dim(5)
    a2, a3 = g.dim(2), 1
    b2, b3 = a2 * r.choice([1, 1, 2]), a3 * r.choice([1, 2])
    a = g.src(wt, [k, m, a2, a3])
    if wt in DOT_TYPES and r.random() < 0.3:
        # src1 converted to the weights' dot type (a shared input), now and then to another type
        dot = DOT_TYPES[wt] if r.random() < 0.85 else r.choice(list(CPY_TYPES))
        b = cast(g, dot, [k, n, b2, b3])
    else:
        b = g.src(F32, [k, n, b2, b3])
    return g.node(OP.MUL_MAT, F32, [m, n, b2, b3], [a, b])


def ids_input(g: Gen, ttype, ne, rows) -> int:
    dtype = np.int32 if ttype == I32 else np.int64
    vals = g.np.integers(0, rows, math.prod(ne)).astype(dtype)
    r = g.r
    if r.random() < 0.3:
        # a view into a longer inline input, as the coordinator's kv indices sometimes are
        extra = r.randint(1, 4)
        full = np.concatenate([g.np.integers(0, rows, extra).astype(dtype), vals])
        root = g.input_leaf(ttype, [len(full), 1, 1, 1], full.tobytes())
        return g.view(root, ne, canonical_nb(ttype, ne), extra * dtype().itemsize)
    return g.input_leaf(ttype, ne, vals.tobytes())


def op_get_rows(g: Gen):
    r = g.r
    t = r.choice(list(G.WEIGHT_TYPES) + [I32])
    ne0, rows, a2, a3 = g.row(t), g.dim(6), g.dim(3), r.choice([1, 1, 2])
    a = g.src(t, [ne0, rows, a2, a3])
    n = g.dim(5)
    ids = ids_input(g, I32, [n, a2, a3, 1], rows)
    return g.node(OP.GET_ROWS, I32 if t == I32 else F32, [ne0, n, a2, a3], [a, ids])


def buffer_dst(g: Gen, ttype, ne) -> int:
    """A destination in a client buffer: a leaf, or a window of a larger one."""
    r = g.r
    if r.random() < 0.5:
        return g.buffer_leaf(ttype, ne)
    tr = type_traits(ttype)
    pne = [ne[0] + r.choice([0, tr.blck_size]), ne[1] + r.choice([0, 2]), ne[2], ne[3]]
    parent = g.buffer_leaf(ttype, pne)
    pnb = canonical_nb(ttype, pne)
    offs = r.choice([0, 1]) * pnb[1] + (tr.type_size if pne[0] > ne[0] and r.random() < 0.5 else 0)
    return g.view(parent, ne, pnb, offs)


def op_set_rows(g: Gen):
    r = g.r
    t = r.choice(list(G.KV_TYPES))
    ne0, rows, d2, d3 = g.row(t), g.dim(8), g.dim(3), r.choice([1, 1, 2])
    dst = buffer_dst(g, t, [ne0, rows, d2, d3])
    n = r.randint(1, rows)
    src = g.src(F32, [ne0, n, d2, d3])
    i1 = r.choice([x for x in (1, d2) if d2 % x == 0])
    i2 = r.choice([x for x in (1, d3) if d3 % x == 0])
    idt = r.choice([I32, I64])
    ids = ids_input(g, idt, [n, i1, i2, 1], rows)
    d = g.tensors[dst]
    root = d.get("view_src", -1)
    return g.add({"type": t, "ne": d["ne"], "nb": d["nb"], "op": OP.SET_ROWS, "src": [src, ids, dst],
                  "view_src": dst if root < 0 else root, "view_offs": d.get("view_offs", 0), "flags": COMPUTE,
                  "name": "set_rows"})


def cast(g: Gen, ttype, ne) -> int:
    """ggml_cast: a CPY whose destination is itself, a new tensor of `ttype` the copy fills."""
    r = g.r
    block = type_traits(ttype).blck_size > 1
    src = g.src(r.choice(G.FLOAT_TYPES), ne, strided_ok=not block, packed=block and r.random() < 0.7)
    return g.node(OP.CPY, ttype, ne, [src, len(g.tensors)], name="cast")


def op_cpy(g: Gen):
    r = g.r
    if r.random() < 0.3:
        t = r.choice(list(CPY_TYPES))
        return cast(g, t, g.shape(t))
    t = r.choice(list(G.KV_TYPES))
    ne = g.shape(t)
    blck = type_traits(t).blck_size
    src_ne = ne if (blck > 1 or r.random() < 0.6) else [ne[0] * ne[1], 1, ne[2], ne[3]]
    if blck > 1 and r.random() < 0.4:
        # source rows of another length than the destination's: shorter ones are fine, longer ones
        # overran the kernel's work buffer (sized by the result's rows)
        if r.random() < 0.5:  # (two source rows or more: the second thread converts one too)
            m = r.choice([2, 3])
            ne[1], src_ne = 2 * m, [ne[0] * 2, m, ne[2], ne[3]]
        elif ne[0] % (2 * blck) == 0:
            src_ne = [ne[0] // 2, ne[1] * 2, ne[2], ne[3]]
    src = g.src(r.choice(G.FLOAT_TYPES), src_ne, strided_ok=True)
    dst = buffer_dst(g, t, ne)
    d = g.tensors[dst]
    root = d.get("view_src", -1)
    return g.add({"type": t, "ne": d["ne"], "nb": d["nb"], "op": OP.CPY, "src": [src, dst],
                  "view_src": dst if root < 0 else root, "view_offs": d.get("view_offs", 0), "flags": COMPUTE,
                  "name": "cpy"})


def op_cont(g: Gen, via=None):
    r = g.r
    t = r.choice([F32, F32, F16, BF16, I32] + QTYPES[:3])
    ne = g.shape(t)
    a = g.src(t, ne, strided_ok=True)
    if via is not None:
        # the view op under test, of whatever src() made
        a = view_of(g, a, via)
    out = g.tensors[a]["ne"]
    if r.random() < 0.2 and type_traits(t).blck_size == 1:
        out = [math.prod(out), 1, 1, 1]
    return g.node(OP.CONT, t, out, [a])


def op_concat(g: Gen):
    """f32 sources of any strides, equal but in the joined dim."""
    r = g.r
    dim = r.randint(0, 3)
    ne = g.shape()
    bne = list(ne)
    bne[dim] = r.choice([1, 2, 3, ne[dim]])
    a, b = g.src(F32, ne, strided_ok=True), g.src(F32, bne, strided_ok=True)
    out = [n + m if d == dim else n for d, (n, m) in enumerate(zip(ne, bne))]
    return g.node(OP.CONCAT, F32, out, [a, b], i32s(dim))


def op_pad(g: Gen):
    """f32 source of any strides, zeros around it: (left, right) of every dim, mostly small, and
    the circular flag 0 (exact sums' gathers pad dim 0 only; the rule takes any dim)."""
    r = g.r
    ne = g.shape()
    a = g.src(F32, ne, strided_ok=True)
    pads = [r.choice([0, 0, 1, 2, 5]) if d == 0 or r.random() < 0.3 else 0 for d in range(4) for _ in (0, 1)]
    out = [n + pads[2 * d] + pads[2 * d + 1] for d, n in enumerate(ne)]
    return g.node(OP.PAD, F32, out, [a], i32s(*pads, 0))

def view_of(g: Gen, a: int, via) -> int:
    r = g.r
    x = g.tensors[a]
    ne, nb = list(x["ne"]), list(x["nb"])
    if via == OP.TRANSPOSE:
        if type_traits(x["type"]).blck_size > 1:
            return a
        return g.view(a, [ne[1], ne[0], ne[2], ne[3]], [nb[1], nb[0], nb[2], nb[3]], 0, OP.TRANSPOSE)
    if via == OP.PERMUTE:
        perm = [0, 1, 2, 3]
        if type_traits(x["type"]).blck_size > 1:
            rest = perm[1:]
            r.shuffle(rest)
            perm = [0] + rest
        else:
            r.shuffle(perm)
        # new dim perm[i] is old dim i
        nne, nnb = [0] * 4, [0] * 4
        for i in range(4):
            nne[perm[i]], nnb[perm[i]] = ne[i], nb[i]
        return g.view(a, nne, nnb, 0, OP.PERMUTE, i32s(*perm))
    if via == OP.RESHAPE:
        if not is_contiguous(x["type"], ne, nb):
            a = g.node(OP.CONT, x["type"], ne, [a])
        n = math.prod(ne)
        b = type_traits(x["type"]).blck_size
        new = [ne[0], n // ne[0], 1, 1] if r.random() < 0.5 else [ne[0], 1, n // ne[0], 1]
        if b == 1 and r.random() < 0.5:
            new = [n, 1, 1, 1]
        return g.view(a, new, canonical_nb(x["type"], new), 0, OP.RESHAPE)
    # VIEW: a sub-window (fewer rows/planes), offset by whole rows
    sub = [ne[0]] + [r.randint(1, n) for n in ne[1:]]
    start = [0] + [r.randint(0, n - s) for n, s in zip(ne[1:], sub[1:])]
    offs = sum(start[i] * nb[i] for i in range(1, 4))
    return g.view(a, sub, nb, offs)


def op_rope(g: Gen):
    r = g.r
    t = r.choice([F32, F16])
    ne0 = r.choice([2, 4, 6, 8, 16, 2 * r.randint(1, 16)])
    heads, tokens = g.dim(4), g.dim(4)
    x = g.src(t, [ne0, heads, tokens, 1])
    pos = g.leaf(I32, [tokens, 1, 1, 1])
    n_dims = 2 * r.randint(1, ne0 // 2)
    mode = r.choice([0, 2])
    src = [x, pos]
    if r.random() < 0.3:
        src.append(g.src(F32, [ne0 // 2 + r.choice([0, 0, 1, 3]), 1, 1, 1], packed=True))
    params = i32s(0, n_dims, mode, 0, r.choice([0, 4096])) + f32s(
        r.choice([10000.0, 500000.0]), r.choice([1.0, 0.5]), r.choice([0.0, 1.0]), 1.0, 32.0, 1.0)
    return g.node(OP.ROPE, t, [ne0, heads, tokens, 1], src, params)


def op_soft_max(g: Gen):
    r = g.r
    ne = g.shape()
    a = g.src(F32, ne)
    src = [a]
    if r.random() < 0.6:
        mt = r.choice([F16, F32])
        m2 = r.choice([x for x in (1, ne[2]) if ne[2] % x == 0])
        src.append(g.src(mt, [ne[0], ne[1] + r.choice([0, 0, 2]), m2, 1]))
    params = f32s(r.uniform(0.05, 2.0), r.choice([0.0, 0.0, 8.0]))
    return g.node(OP.SOFT_MAX, F32, ne, src, params)


def op_flash(g: Gen):
    r = g.r
    d = r.choice([4, 8, 16, 32, 64])
    dv = r.choice([d, d, 8])
    n, kv = g.dim(4), r.choice([1, 3, 8, 16, r.randint(1, 40)])
    hk = g.dim(2)
    h = hk * r.choice([1, 2])
    kt, vt = r.choice([F16, F32]), r.choice([F16, F32])
    q = g.src(F32, [d, n, h, 1])
    k = g.src(kt, [d, kv, hk, 1])
    v = g.src(vt, [dv, kv, hk, 1])
    src = [q, k, v]
    if r.random() < 0.6:
        src.append(g.src(F16, [kv, n + r.choice([0, 0, 3]), 1, 1]))
    params = f32s(r.uniform(0.05, 1.0), r.choice([0.0, 0.0, 8.0]), r.choice([0.0, 0.0, 30.0])) + \
        i32s(r.choice([lib.GGML_PREC_DEFAULT, lib.GGML_PREC_F32]))
    return g.node(OP.FLASH_ATTN_EXT, F32, [dv, h, n, 1], src, params)


def op_unary(g: Gen):
    r = g.r
    t = r.choice([F32, F16])
    ne = g.shape()
    a = g.src(t, ne)
    return g.node(OP.UNARY, t, ne, [a], i32s(r.choice(UNARY_OPS)))


def op_glu(g: Gen):
    r = g.r
    t = r.choice([F32, F16])
    op = r.choice(GLU_OPS)
    if op == lib.GGML_GLU_OP_SWIGLU_OAI:
        t = F32
    ne = g.shape()
    params = i32s(op, r.choice([0, 0, 1])) + (f32s(1.702, 7.0) if op == lib.GGML_GLU_OP_SWIGLU_OAI else b"")
    if r.random() < 0.5:
        a, b = g.src(t, ne), g.src(t, ne)
        return g.node(OP.GLU, t, ne, [a, b], params)
    a = g.src(t, [2 * ne[0]] + ne[1:])
    return g.node(OP.GLU, t, ne, [a], params)


def op_argmax(g: Gen):
    ne = [g.row(), g.dim(6), 1, 1]
    a = g.src(F32, ne)
    return g.node(OP.ARGMAX, I32, [ne[1], 1, 1, 1], [a])


def op_sum_rows(g: Gen):
    ne = g.shape()
    a = g.src(F32, ne)
    return g.node(OP.SUM_ROWS, F32, [1] + ne[1:], [a])


def op_arange(g: Gen):
    r = g.r
    start = r.choice([0.0, 1.0, -3.5, r.uniform(-10, 10)])
    step = r.choice([1.0, 0.5, 2.0, -1.0, r.uniform(0.1, 3)])
    n = r.randint(1, 50)
    stop = start + step * n - r.choice([0.0, step / 2])
    span = struct.unpack("<f", struct.pack("<f", stop - start))[0]
    steps = math.ceil(struct.unpack("<f", struct.pack("<f", span / step))[0])
    if steps < 1:
        steps, stop = 1, start + step
    return g.node(OP.ARANGE, F32, [steps, 1, 1, 1], [], f32s(start, stop, step))


def op_top_k(g: Gen):
    ne = g.shape()
    a = g.src(F32, ne)
    return g.node(OP.TOP_K, I32, [g.r.randint(1, ne[0])] + ne[1:], [a])


def op_mul_mat_id(g: Gen):
    """ggml_mul_mat_id as build_moe_ffn uses it: experts [k, m, n_as], src1 [k, 1 or n_ids, tokens],
    ids [n_ids, tokens] inline (checked per request) or from a TOP_K over n_as scores (whole, or a view
    of its first columns, as ggml_argsort_top_k takes them)."""
    r = g.r
    wt = r.choice(list(G.WEIGHT_TYPES))
    k = g.row(wt) if type_traits(wt).blck_size > 1 else r.choice([1, 4, 8, 16, 32, r.randint(1, 40)])
    m, n_as, tokens = g.dim(8), r.choice([1, 2, 3, 4, 8, r.randint(1, 12)]), g.dim(4)
    a = g.src(wt, [k, m, n_as, 1])
    if r.random() < 0.5:
        b1 = r.choice([1, 1, 2])
        n_ids = b1 * r.choice([1, 2, 3])
        ids = ids_input(g, I32, [n_ids, tokens, 1, 1], n_as)
    else:
        b1 = 1
        n_ids = r.randint(1, n_as)
        top = g.node(OP.TOP_K, I32, [r.randint(n_ids, n_as), tokens, 1, 1], [g.src(F32, [n_as, tokens, 1, 1])])
        ids = top
        if g.tensors[top]["ne"][0] != n_ids or r.random() < 0.3:
            ids = g.view(top, [n_ids, tokens, 1, 1], g.tensors[top]["nb"], 0)
    b = g.src(F32, [k, b1, tokens, 1])
    return g.node(OP.MUL_MAT_ID, F32, [m, n_ids, tokens, 1], [a, b, ids])


BUILDERS = {
    OP.ADD: lambda g: op_binary(g, OP.ADD), OP.SUB: lambda g: op_binary(g, OP.SUB),
    OP.MUL: lambda g: op_binary(g, OP.MUL), OP.DIV: lambda g: op_binary(g, OP.DIV),
    OP.SCALE: op_scale, OP.NORM: lambda g: op_norm(g, OP.NORM), OP.RMS_NORM: lambda g: op_norm(g, OP.RMS_NORM),
    OP.MUL_MAT: op_mul_mat, OP.GET_ROWS: op_get_rows, OP.SET_ROWS: op_set_rows, OP.CPY: op_cpy,
    OP.CONT: op_cont, OP.RESHAPE: lambda g: op_cont(g, OP.RESHAPE), OP.VIEW: lambda g: op_cont(g, OP.VIEW),
    OP.PERMUTE: lambda g: op_cont(g, OP.PERMUTE), OP.TRANSPOSE: lambda g: op_cont(g, OP.TRANSPOSE),
    OP.ROPE: op_rope, OP.SOFT_MAX: op_soft_max, OP.FLASH_ATTN_EXT: op_flash, OP.UNARY: op_unary,
    OP.GLU: op_glu, OP.ARGMAX: op_argmax, OP.SUM_ROWS: op_sum_rows, OP.ARANGE: op_arange,
    OP.TOP_K: op_top_k, OP.MUL_MAT_ID: op_mul_mat_id, OP.CONCAT: op_concat, OP.PAD: op_pad,
}
OPS = sorted(op for op in G.OP_RULES if op != OP.NONE)
assert set(OPS) == set(BUILDERS), "every op the validator accepts needs a builder here"


# ------------------------------------------------------------ mutations

def ggml_nbytes(ttype, ne, nb) -> int:
    tr = type_traits(ttype)
    if tr.blck_size == 1:
        return tr.type_size + sum((ne[i] - 1) * nb[i] for i in range(4))
    return ne[0] * nb[0] // tr.blck_size + sum((ne[i] - 1) * nb[i] for i in range(1, 4))


def push_to_end(g: Gen, t: dict, buffers: dict) -> str:
    """Move a view (or a buffer leaf) as far towards the end of its storage as
    ggml_nbytes lets it: where an extent the validator underestimates runs out."""
    n = ggml_nbytes(t["type"], t["ne"], t["nb"])
    if "view_src" in t:
        root = g.tensors[t["view_src"]]
        room = buffers[root["buffer"]] - root["offset"] if "buffer" in root else \
            ggml_nbytes(root["type"], root["ne"], root["nb"])
        old, t["view_offs"] = t["view_offs"], max(0, room - n)
        return f"view_offs {old} -> {t['view_offs']} (ggml_nbytes {n} of {room})"
    if "buffer" in t:
        old, t["offset"] = t["offset"], max(0, buffers[t["buffer"]] - n)
        return f"offset {old} -> {t['offset']} (ggml_nbytes {n})"
    return "nothing to move"


def mutate(g: Gen, rnd: random.Random, buffers: dict) -> str:
    """One random change to one tensor: what an attacker (or a buggy client) might send."""
    i = rnd.randrange(len(g.tensors))
    t = g.tensors[i]
    ts = type_traits(t["type"]).type_size
    what = rnd.choice(["nb", "nb", "nb", "view_offs", "offset", "ne", "params", "nb0", "swap", "end", "end", "end"])
    if what == "end":
        # the audit's attack: a stride ggml_nbytes undercounts, then the view moved to the very end
        views = [k for k, x in enumerate(g.tensors) if "view_src" in x]
        if views and rnd.random() < 0.7:
            # mostly a view the op under test reads or writes (the last tensor: itself, or its sources)
            last = len(g.tensors) - 1
            near = [k for k in views if k == last or k in g.tensors[last].get("src", ())]
            i = rnd.choice(near if near and rnd.random() < 0.8 else views)
            t = g.tensors[i]
            d = rnd.choice([0, 0, 0, rnd.randrange(4)])
            old = t["nb"][d]
            t["nb"][d] = rnd.choice([0, 0, 0, 1, old // 2])
            return f"tensors[{i}].nb[{d}] {old} -> {t['nb'][d]}, " + push_to_end(g, t, buffers)
        return f"tensors[{i}] " + push_to_end(g, t, buffers)
    if what == "nb" or (what == "view_offs" and "view_src" not in t) or (what == "offset" and "buffer" not in t):
        d = rnd.randrange(4)
        old = t["nb"][d]
        t["nb"][d] = rnd.choice([0, ts, old + ts, old - ts, old * 2, old // 2, rnd.randrange(0, 4096),
                                 rnd.randrange(0, MAX_NB_MUTATION), 1 << rnd.randrange(2, 20)])
        t["nb"][d] = max(0, t["nb"][d])
        return f"tensors[{i}].nb[{d}] {old} -> {t['nb'][d]}"
    if what == "nb0":
        old = t["nb"][0]
        t["nb"][0] = rnd.choice([0, 1, ts // 2, 2 * ts, old + 1])
        return f"tensors[{i}].nb[0] {old} -> {t['nb'][0]}"
    if what == "swap":
        a, b = rnd.sample(range(4), 2)
        t["nb"][a], t["nb"][b] = t["nb"][b], t["nb"][a]
        return f"tensors[{i}].nb swap {a} {b}"
    if what == "view_offs":
        old = t["view_offs"]
        t["view_offs"] = max(0, old + rnd.choice([-ts, ts, 1, 4, 64, -64, rnd.randrange(-4096, 4096)]))
        return f"tensors[{i}].view_offs {old} -> {t['view_offs']}"
    if what == "offset":
        old = t["offset"]
        t["offset"] = max(0, old + rnd.choice([ts, -ts, 4, 64, rnd.randrange(-2048, 2048)]))
        return f"tensors[{i}].offset {old} -> {t['offset']}"
    if what == "ne":
        d = rnd.randrange(4)
        old = t["ne"][d]
        t["ne"][d] = max(1, old + rnd.choice([-1, 1, 2, old]))
        return f"tensors[{i}].ne[{d}] {old} -> {t['ne'][d]}"
    p = bytearray(t.get("params", b"").ljust(64, b"\0"))
    k = rnd.randrange(12)
    val = rnd.choice([i32s(rnd.randrange(-3, 40)), f32s(rnd.choice([-1.0, 0.0, float("nan"), float("inf"), 1e30])),
                      i32s(10), i32s(1)])
    p[4 * k:4 * k + 4] = val
    t["params"] = bytes(p).rstrip(b"\0")
    return f"tensors[{i}].params[{k}] = {val.hex()}"


def generate(rnd: random.Random, mutate_rate: float = 0.35) -> Case:
    g = Gen(rnd)
    op = rnd.choice(OPS)
    out = BUILDERS[op](g)
    g.tensors[out]["flags"] = g.tensors[out].get("flags", 0) | OUTPUT | COMPUTE
    outputs = [out]
    buffers = {}
    for b, used in g.used.items():
        size = used + rnd.choice([0, 0, 0, 4, 16, 100])
        buffers[b] = max(4, (size + 3) // 4 * 4)
    mutation = mutate(g, rnd, buffers) if rnd.random() < mutate_rate else ""
    return Case(G.op_name(op), g.tensors, buffers, g.inputs, outputs, mutation)


# ================================================================ validating: the daemon's choke point

def validate(case: Case):
    """(spec, request, blob) if the daemon would compute the case, else the ProtocolError."""
    h, blob = case.request()
    try:
        spec = G.parse_graph(h, Limits(), case.buffers.get)
        # as the daemon's handler (server._input_blob): inline data of exactly nbytes for every input leaf
        given = {t for t, _, _ in h["inputs"]}
        for t, _, size in h["inputs"]:
            if t not in spec.inputs or size != spec.tensors[t].nbytes:
                raise ProtocolError(Status.INVALID_REQUEST, f"inputs: tensor {t} needs {spec.tensors[t].nbytes} bytes")
        if set(spec.inputs) - given:
            raise ProtocolError(Status.INVALID_REQUEST, "inputs: missing")
        row_ids.check_inputs(spec.row_groups, spec.tensors, h["inputs"], blob)
    except ProtocolError as exc:
        return exc
    return spec, h, blob


def written_ranges(spec) -> dict:
    """buffer id -> [(lo, hi)]: what the nodes that write into client buffers declare."""
    out: dict = {}
    for i in spec.nodes:
        t = spec.tensors[i]
        if t.buffer and t.op in (OP.CPY, OP.SET_ROWS):
            out.setdefault(t.buffer, []).append((t.offset, t.offset + extent(t.type, t.ne, t.nb)))
    return out


# ================================================================ the compute child

@dataclass
class Result:
    ok: bool
    kind: str = ""  # "", "fault", "canary", "status", "timeout", "error"
    detail: str = ""


@dataclass
class Stats:
    cases: int = 0
    accepted: int = 0
    computed: int = 0
    faults: list = field(default_factory=list)
    by_op: dict = field(default_factory=dict)  # op -> [generated, accepted]


class Harness:
    """Runs accepted cases in a child process; a child that dies is reported and replaced."""

    def __init__(self, threads: int = 1, timeout: float = 20.0):
        self.threads, self.timeout = threads, timeout
        self.proc = None

    def _start(self):
        env = dict(os.environ, GGML_NO_BACKTRACE="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        import tempfile
        self.err = tempfile.TemporaryFile()  # a file, not a pipe: ggml's log lines never block the child
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", str(self.threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=env)

    def _recv(self) -> bytes | str:
        """The reply, or "eof" (the child died) or "timeout"."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + self.timeout
        buf = b""
        want = 4
        while len(buf) < want:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return "timeout"
            chunk = os.read(fd, want - len(buf))
            if not chunk:
                return "eof"
            buf += chunk
            if want == 4 and len(buf) == 4:
                want = 4 + struct.unpack("<I", buf)[0]
        return buf[4:]

    def run(self, spec, h: dict, blob: bytes, buffers: dict) -> Result:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        inputs = [(t, blob[off:off + size]) for t, off, size in h["inputs"]]
        msg = pickle.dumps((SimpleNamespace(tensors=spec.tensors, nodes=spec.nodes), buffers, inputs,
                            h["outputs"], written_ranges(spec)))
        try:
            self.proc.stdin.write(struct.pack("<I", len(msg)) + msg)
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        reply = self._recv()
        if reply == "timeout":
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return Result(False, "timeout", f"no reply within {self.timeout} s")
        if reply == "eof":
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.err.seek(0)
            err = self.err.read().decode(errors="replace")[-2000:]
            code = self.proc.returncode
            name = signal.Signals(-code).name if code < 0 else f"exit {code}"
            self.proc = None
            return Result(False, "fault", f"compute child died of {name}\n{err}")
        return Result(*pickle.loads(reply))

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def run_cases(n: int, seed: int, harness: Harness, stats: Stats, mutate_rate: float = 0.35,
              on_fault=None, stop_after_accepted: int | None = None) -> Stats:
    rnd = random.Random(seed)
    for _ in range(n):
        case_seed = rnd.getrandbits(64)
        one_case(case_seed, harness, stats, mutate_rate, on_fault)
        if stop_after_accepted and stats.accepted >= stop_after_accepted:
            break
    return stats


def one_case(case_seed: int, harness: Harness, stats: Stats, mutate_rate: float = 0.35, on_fault=None):
    case = generate(random.Random(case_seed), mutate_rate)
    stats.cases += 1
    per = stats.by_op.setdefault(case.op, [0, 0])
    per[0] += 1
    v = validate(case)
    if isinstance(v, ProtocolError):
        return None
    spec, h, blob = v
    stats.accepted += 1
    per[1] += 1
    res = harness.run(spec, h, blob, case.buffers)
    stats.computed += 1
    if not res.ok:
        stats.faults.append((case_seed, res, case.describe()))
        if on_fault:
            on_fault(case_seed, res, case)
    return res


# ------------------------------------------------------------ child side

def _child(threads: int) -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints to stderr; stdout carries replies only
    inp = sys.stdin.buffer

    from ggml_ffi import NULL, CpuBackend, Gallocr, ffi
    from rpc_daemon.wire.graph_codec import build_graph, context_size

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    slot = GUARD + AREA
    total = MAX_BUFFERS * slot + GUARD
    region = mmap.mmap(-1, total, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    for k in range(MAX_BUFFERS + 1):
        assert libc.mprotect(base + k * slot, GUARD, 0) == 0, ctypes.get_errno()
    areas = [np.frombuffer(region, np.uint8, AREA, k * slot + GUARD) for k in range(MAX_BUFFERS)]
    rng = np.random.default_rng(12345)
    patterns = [rng.integers(0, 256, AREA, dtype=np.uint8) for _ in range(MAX_BUFFERS)]
    backend = CpuBackend(threads)
    cfence = ComputeFence(libc)
    wfence = WorkFence(libc, backend)

    def reply(res):
        data = pickle.dumps((res.ok, res.kind, res.detail))  # plain values: this module is __main__ here
        out.write(struct.pack("<I", len(data)) + data)
        out.flush()

    while True:
        head = inp.read(4)
        if len(head) < 4:
            break
        spec, buffers, inputs, outputs, written = pickle.loads(inp.read(struct.unpack("<I", head)[0]))
        table, slots, gbufs = {}, {}, []
        for k, (b, size) in enumerate(sorted(buffers.items())):
            areas[k][:] = patterns[k]
            addr = base + k * slot + GUARD + AREA - size  # the buffer ends where the guard starts
            # ggml wants a 32-byte aligned buffer pointer: its buffer starts a little earlier (in the
            # canary area); tensors sit at addr + offset, as in a daemon buffer at any offset
            start = addr & ~63
            gbuf = backend.buffer_from_ptr(start, size + addr - start)
            gbufs.append(gbuf)
            table[b] = (gbuf, addr)
            slots[b] = (k, AREA - size)
        params = ffi.new("struct ggml_init_params *", {"mem_size": context_size(len(spec.tensors)),
                                                       "mem_buffer": NULL, "no_alloc": True})
        ctx = lib.ggml_init(params[0])
        galloc = Gallocr(backend)
        try:
            ptrs, gf = build_graph(ctx, spec, table)
            if not galloc.alloc_graph(gf):
                reply(Result(False, "error", "gallocr failed"))
                continue
            fence = cfence.move(ptrs, gbufs)
            for t, data in inputs:  # the inputs, now in the fenced copy
                ffi.memmove(ptrs[t].data, data, len(data))
            status, stray = wfence.compute(gf)
            stray = stray or (fence() if fence else "")
            if stray:
                reply(Result(False, "canary", stray))
                continue
            for i in outputs:
                bytes(ffi.buffer(ptrs[i].data, lib.ggml_nbytes(ptrs[i])))
            bad = []
            for b, (k, start) in slots.items():
                diff = areas[k] != patterns[k]
                for lo, hi in written.get(b, ()):
                    diff[start + lo:start + hi] = False
                where = np.flatnonzero(diff)
                if where.size:
                    bad.append(f"buffer {b}: {where.size} bytes changed outside the written ranges "
                               f"{written.get(b, [])}, first at buffer offset {int(where[0]) - start}")
            if bad:
                reply(Result(False, "canary", "; ".join(bad)))
            elif status != lib.GGML_STATUS_SUCCESS:
                reply(Result(False, "status", f"ggml_backend_graph_compute returned {status}"))
            else:
                reply(Result(True))
        except Exception as exc:  # noqa: BLE001 - reported with the case
            reply(Result(False, "error", repr(exc)))
        finally:
            galloc.close()
            lib.ggml_free(ctx)
            for gbuf in gbufs:
                lib.ggml_backend_buffer_free(gbuf)
    backend.close()


COMPUTE_AREA = 8 << 20  # room for a case's compute buffer


class ComputeFence:
    """The compute buffer Gallocr lays a graph's inputs and intermediates out in
    is heap memory. After Gallocr has placed them, the fence moves that layout,
    offset for offset, into guarded memory: a copy whose end (rounded up to
    Gallocr's 64-byte alignment) is the start of a PROT_NONE guard, every byte
    no tensor's extent covers filled with a canary. The compute then runs on
    the copy: an overrun past the last tensor faults, a write between tensors
    shows in the canary."""

    def __init__(self, libc):
        total = COMPUTE_AREA + 2 * GUARD
        self.region = mmap.mmap(-1, total, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.region))
        assert libc.mprotect(self.base, GUARD, 0) == 0
        assert libc.mprotect(self.base + GUARD + COMPUTE_AREA, GUARD, 0) == 0
        self.area_end = self.base + GUARD + COMPUTE_AREA

    def move(self, ptrs, client_gbufs):
        """Re-point every tensor Gallocr placed into the fenced copy; returns a
        check for after the compute ("" if clean), or None if there is no
        compute buffer (or it is too large to fence)."""
        from ggml_ffi import NULL, ffi
        own = {int(ffi.cast("uintptr_t", b)) for b in client_gbufs}
        buf = None
        for x in ptrs:
            if x.buffer != NULL and int(ffi.cast("uintptr_t", x.buffer)) not in own:
                buf = x.buffer
                break
        if buf is None:
            return None
        old = int(ffi.cast("uintptr_t", lib.ggml_backend_buffer_get_base(buf)))
        size = int(lib.ggml_backend_buffer_get_size(buf))
        span = (size + 63) // 64 * 64
        if span > COMPUTE_AREA:
            return None
        new = self.area_end - span
        mem = np.frombuffer(self.region, np.uint8, span, new - self.base)
        free = np.ones(span, bool)
        for x in ptrs:
            addr = int(ffi.cast("uintptr_t", x.data)) if x.data != NULL else 0
            if old <= addr < old + size:
                lo = addr - old
                x.data = ffi.cast("void *", new + lo)
                ne = [int(x.ne[i]) for i in range(4)]
                nb = [int(x.nb[i]) for i in range(4)]
                free[lo:lo + extent(x.type, ne, nb)] = False
        pattern = np.frombuffer(b"\xa5\x3c\x5a\xc3" * (span // 4 + 1), np.uint8)[:span]
        mem[:] = pattern

        def check() -> str:
            bad = np.flatnonzero((mem != pattern) & free)
            if bad.size:
                return (f"compute buffer: {bad.size} bytes outside every tensor's extent changed, first at "
                        f"{int(bad[0])} of {size}")
            return ""
        return check


WORK_AREA = 4 << 20  # room for a case's work memory (MUL_MAT's converted src1, MUL_MAT_ID's row map...)


class WorkFence:
    """The CPU backend's work memory (per graph: ggml_graph_plan's work_size) is a heap
    allocation no guard page fences. The fence computes as ggml_backend_graph_compute
    does (plan, then ggml_graph_compute on the backend's threadpool) with the work
    memory at the end of a guarded area: a write past it faults, and the bytes before
    it (and the few of alignment slack after it) hold a canary that must survive."""

    def __init__(self, libc, backend):
        self.backend = backend
        self.region = mmap.mmap(-1, WORK_AREA + 2 * GUARD, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.region))
        assert libc.mprotect(self.base, GUARD, 0) == 0
        assert libc.mprotect(self.base + GUARD + WORK_AREA, GUARD, 0) == 0
        self.area = np.frombuffer(self.region, np.uint8, WORK_AREA, GUARD)
        self.pattern = np.frombuffer(b"\x3c\xa5\xc3\x5a" * (WORK_AREA // 4), np.uint8)

    def compute(self, gf) -> tuple[int, str]:
        from ggml_ffi import ffi
        plan = ffi.new("struct ggml_cplan *", lib.ggml_graph_plan(gf, self.backend.n_threads,
                                                                  self.backend.threadpool))
        size = int(plan.work_size)
        if size > WORK_AREA - 64:
            return self.backend.compute(gf), ""
        start = (WORK_AREA - size) & ~63  # the backend's new[] gives at least 16-byte alignment; 64 is safe
        self.area[:] = self.pattern
        plan.work_data = ffi.cast("uint8_t *", self.base + GUARD + start)
        status = lib.ggml_graph_compute(gf, plan)
        outside = np.ones(WORK_AREA, bool)
        outside[start:start + size] = False
        bad = np.flatnonzero((self.area != self.pattern) & outside)
        if bad.size:
            return status, (f"work memory: {bad.size} bytes outside [{start}, {start + size}) of the work area "
                            f"changed, first at {int(bad[0])}")
        return status, ""


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--child":
    _child(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
