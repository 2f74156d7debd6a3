# Over 400 lines: the tensor schema and OP_RULES (one small rule per op) are the one choke point, kept whole.
"""Graph schema and validation: the one choke point every tensor a client names
passes before anything touches memory. Pure functions over decoded msgpack.

A graph on the wire is a list of tensors in topological order (every `src` and
`view_src` index refers to an earlier tensor, so a cycle cannot be expressed).
Its nodes are the tensors whose op is not NONE, computed in list order.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Callable

from ggml_ffi import lib, nbytes as ggml_nbytes, type_traits
from rpc_daemon.validation import row_ids
from rpc_daemon.wire.graph_limits import DOT_TYPES, FLOAT_TYPES, MAX_EXPERTS, WEIGHT_TYPES
from rpc_daemon.wire.protocol import ProtocolError, Status, field_list

MAX_NE = 1 << 40
MAX_ELEMENTS = 1 << 42
MAX_NB = 1 << 48
KNOWN_FLAGS = (lib.GGML_TENSOR_FLAG_INPUT | lib.GGML_TENSOR_FLAG_OUTPUT | lib.GGML_TENSOR_FLAG_PARAM
               | lib.GGML_TENSOR_FLAG_LOSS | lib.GGML_TENSOR_FLAG_COMPUTE)
F32, F16, BF16 = lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_BF16
I32, I64 = lib.GGML_TYPE_I32, lib.GGML_TYPE_I64
# FLOAT_TYPES, WEIGHT_TYPES and MAX_EXPERTS are the coordinator's too: rpc_daemon/wire/graph_limits.py
KV_TYPES = (F32, F16, BF16, lib.GGML_TYPE_Q8_0, lib.GGML_TYPE_Q4_0)
# what CPY converts float rows into: a KV cache's types, and the matmuls' dot types (DOT_TYPES)
CPY_TYPES = tuple(dict.fromkeys(KV_TYPES + tuple(DOT_TYPES.values())))


@dataclass
class TensorSpec:
    index: int
    type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op: int
    params: bytes
    flags: int
    src: tuple[int, ...]
    view_src: int  # -1: not a view
    view_offs: int
    buffer: int  # 0: not in a client buffer
    offset: int
    name: str
    nbytes: int = 0

    @property
    def is_view(self) -> bool:
        return self.view_src >= 0

    @property
    def is_inline_input(self) -> bool:
        """A leaf outside every buffer: its data comes inline with every compute."""
        return self.op == lib.GGML_OP_NONE and not self.buffer and not self.is_view

    def nelements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]

    def param_i32(self, i: int) -> int:
        return struct.unpack_from("<i", self.params.ljust(64, b"\0"), 4 * i)[0]

    def param_f32(self, i: int) -> float:
        return struct.unpack_from("<f", self.params.ljust(64, b"\0"), 4 * i)[0]

    def row_bytes(self) -> int:
        tr = type_traits(self.type)
        return tr.type_size * self.ne[0] // tr.blck_size

    def _elements_packed(self) -> bool:
        """Dim 0's elements are adjacent (or it is one block)."""
        tr = type_traits(self.type)
        return self.ne[0] == tr.blck_size or self.nb[0] == tr.type_size

    def _packed_from(self, dim: int, expect: int) -> bool:
        """Dims `dim`..3 of more than one element each start where the one below ends (`expect` bytes on)."""
        for i in range(dim, 4):
            if self.ne[i] != 1 and self.nb[i] != expect:
                return False
            expect *= self.ne[i]
        return True

    def is_contiguous(self) -> bool:
        """ggml_is_contiguous: canonical strides in every dim of more than one element."""
        return self._elements_packed() and self._packed_from(1, self.row_bytes())

    def is_contiguous_1(self) -> bool:
        """ggml_is_contiguous_1: rows contiguous, dims 2 and 3 packed after dim 1
        (so the kernels that walk rows as one flat index stay inside)."""
        return self._elements_packed() and self._packed_from(2, self.ne[1] * self.nb[1])

    def is_canonical(self) -> bool:
        """Exactly the strides ggml_new_tensor gives, in every dim (ne == 1 included)."""
        return self.nb == canonical_nb(self.type, self.ne)

    def rows_contiguous(self) -> bool:
        return self.nb[0] == type_traits(self.type).type_size

    def extent(self) -> int:
        """Bytes from the data pointer that any kernel may touch: rows of ne[0]
        contiguous elements (how most kernels read and write them) or ne[0]
        elements nb[0] apart (how the copy kernels walk them), whichever reaches
        further, at every index of dims 1..3. >= ggml_nbytes."""
        tr = type_traits(self.type)
        first = max(self.row_bytes(), (self.ne[0] // tr.blck_size - 1) * self.nb[0] + tr.type_size)
        return first + sum((self.ne[i] - 1) * self.nb[i] for i in range(1, 4))


@dataclass
class GraphSpec:
    tensors: list[TensorSpec]
    nodes: list[int]
    inputs: list[int]  # tensors whose data comes inline with every compute
    buffers: set[int] = field(default_factory=set)
    row_groups: list = field(default_factory=list)  # row_ids.RowGroup: inline GET_ROWS/SET_ROWS ids to check,
    # grouped by the ids they read
    readable: set[int] | None = None  # tensors with memory after compute (None: any, unsafe mode)
    checked_exchanges: set = field(default_factory=set)  # tensor-parallel exchange lists already checked


def canonical_nb(ttype: int, ne) -> tuple[int, int, int, int]:
    """The strides ggml_new_tensor gives a tensor of type `ttype` and shape `ne`."""
    tr = type_traits(ttype)
    nb = [tr.type_size, tr.type_size * ne[0] // tr.blck_size]
    for i in range(2, 4):
        nb.append(nb[i - 1] * ne[i - 1])
    return tuple(nb)


def _bad(i: int, what: str) -> ProtocolError:
    return ProtocolError(Status.INVALID_REQUEST, f"tensors[{i}]: {what}")


def _ints(v, n: int, i: int, key: str, lo: int, hi: int) -> tuple[int, ...]:
    if not (isinstance(v, list) and len(v) == n and all(type(x) is int for x in v)):
        raise _bad(i, f"{key} must be a list of {n} integers")
    for x in v:
        if not lo <= x <= hi:
            raise _bad(i, f"{key} value {x} outside {lo}..{hi}")
    return tuple(v)


def parse_tensor(i: int, t) -> TensorSpec:
    """Schema check of one wire tensor (a msgpack map)."""
    if not isinstance(t, dict):
        raise _bad(i, "must be a map")
    ttype = t.get("type")
    if type(ttype) is not int or type_traits(ttype) is None:
        raise _bad(i, f"type {ttype!r} is not a ggml type")
    ne = _ints(t.get("ne"), 4, i, "ne", 1, MAX_NE)
    nb = _ints(t.get("nb"), 4, i, "nb", 0, MAX_NB)
    op = t.get("op", 0)
    if type(op) is not int or not 0 <= op < lib.GGML_OP_COUNT:
        raise _bad(i, f"op {op!r} is not a ggml op")
    params = t.get("params", b"")
    if not isinstance(params, bytes) or len(params) > 64:
        raise _bad(i, "params must be at most 64 bytes")
    flags = t.get("flags", 0)
    if type(flags) is not int or flags & ~KNOWN_FLAGS or flags < 0:
        raise _bad(i, f"flags {flags!r} has unknown bits")
    src = t.get("src", [])
    if not (isinstance(src, list) and len(src) <= 10 and all(type(s) is int for s in src)):
        raise _bad(i, "src must be a list of at most 10 integers")
    for k, s in enumerate(src):
        # the one self-reference: ggml_cast, a CPY whose destination (src[1]) is its own result
        if not (-1 <= s < i or (s == i and k == 1 and op == lib.GGML_OP_CPY)):
            raise _bad(i, f"src index {s} must name an earlier tensor (0..{i - 1}) or be -1"
                          + (" (only CPY's src[1] may name the tensor itself)" if s == i else ""))
    view_src = t.get("view_src", -1)
    if type(view_src) is not int or not -1 <= view_src < i:
        raise _bad(i, f"view_src index {view_src!r} must name an earlier tensor or be -1")
    name = t.get("name", "")
    if not isinstance(name, str) or len(name.encode()) >= 64:
        raise _bad(i, "name must be a string shorter than 64 bytes")
    vals = {}
    for key in ("view_offs", "buffer", "offset"):
        v = t.get(key, 0)
        if type(v) is not int or not 0 <= v <= MAX_NB:
            raise _bad(i, f"{key} {v!r} outside 0..{MAX_NB}")
        vals[key] = v
    tr = type_traits(ttype)
    if ne[0] % tr.blck_size:
        raise _bad(i, f"ne[0]={ne[0]} is not a multiple of the {tr.name} block size {tr.blck_size}")
    # (also keeps ggml 0.25's ggml_new_tensor assert, element count < 2^63, from aborting)
    if ne[0] * ne[1] * ne[2] * ne[3] > MAX_ELEMENTS:
        raise _bad(i, f"ne {list(ne)} has more than {MAX_ELEMENTS} elements")
    if nb[0] < tr.type_size or (tr.blck_size > 1 and nb[0] != tr.type_size):
        # a zero (or shorter) element stride makes ggml_nbytes count one element per row while the
        # kernels still read and write ne[0] of them; blocks of quantized types are never strided
        raise _bad(i, f"nb[0]={nb[0]} must be at least the {tr.name} element size"
                      + (" (exactly: a block type)" if tr.blck_size > 1 else ""))
    while len(src) and src[-1] == -1:
        src = src[:-1]
    spec = TensorSpec(i, ttype, ne, nb, op, bytes(params), flags, tuple(src), view_src,
                      vals["view_offs"], vals["buffer"], vals["offset"], name)
    spec.nbytes = ggml_nbytes(ttype, ne, nb)
    return spec


def parse_graph(h: dict, limits, buffer_size: Callable[[int], int | None]) -> GraphSpec:
    """Schema and semantic check of a whole graph. `buffer_size(id)` returns the
    size of the connection's own buffer `id`, or None if it owns no such buffer."""
    raw = field_list(h, "tensors", limits.max_graph_tensors)
    if not raw:
        raise ProtocolError(Status.INVALID_REQUEST, "graph has no tensors")
    tensors: list[TensorSpec] = []
    for i, t in enumerate(raw):
        spec = parse_tensor(i, t)
        check_placement(spec, tensors, buffer_size)
        check_op(spec, tensors)
        tensors.append(spec)
    # strides of dims with one element, once every op rule has passed (an op's own reason, e.g.
    # SET_ROWS' "batch dims", says more than the stride of a dim a test shrank to 1)
    for spec in tensors:
        check_canonical(spec)
    nodes = [t.index for t in tensors if t.op != lib.GGML_OP_NONE]
    if not nodes:
        raise ProtocolError(Status.INVALID_REQUEST, "graph has no op to compute")
    inputs = [t.index for t in tensors if t.is_inline_input]
    # only what the nodes reach gets memory: an unreached input would be written through NULL
    used = {s for n in nodes for s in tensors[n].src if s >= 0} | \
           {tensors[n].view_src for n in nodes if tensors[n].is_view}
    for i in inputs:
        if not tensors[i].flags & lib.GGML_TENSOR_FLAG_INPUT:
            raise _bad(i, "a leaf outside every buffer must be flagged INPUT and sent inline")
        if i not in used:
            raise _bad(i, "input leaf is not used by any node")
    readable = set(nodes) | used | {t.index for t in tensors if t.buffer}
    return GraphSpec(tensors, nodes, inputs, {t.buffer for t in tensors if t.buffer},
                     row_ids.group(row_ids.plan(tensors, inputs)), readable)


def parse_unchecked(h: dict, buffer_size) -> GraphSpec:
    """Schema only, no semantic checks: for --unsafe-no-validation, which exists so
    tests can reach libggml's own aborts and crashes. Never use it in production."""
    tensors = []
    for i, t in enumerate(field_list(h, "tensors", 1 << 20)):
        spec = parse_tensor(i, t)
        if spec.is_view:
            root = tensors[spec.view_src]
            spec.buffer, spec.offset = root.buffer, root.offset + spec.view_offs
        if spec.buffer and buffer_size(spec.buffer) is None:
            raise _bad(i, f"buffer {spec.buffer} is not a buffer of this connection")
        tensors.append(spec)
    nodes = [t.index for t in tensors if t.op != lib.GGML_OP_NONE]
    inputs = [t.index for t in tensors if t.is_inline_input]
    return GraphSpec(tensors, nodes, inputs, {t.buffer for t in tensors if t.buffer})


def storage_size(t: TensorSpec, buffer_size) -> int:
    """Bytes available behind a non-view tensor's data pointer."""
    if t.buffer:
        return buffer_size(t.buffer) - t.offset
    return t.nbytes


def check_placement(t: TensorSpec, earlier: list[TensorSpec], buffer_size) -> None:
    """Where the tensor's data lives, and that all of it lies inside memory the
    client may use: its own buffers, or an intermediate the daemon allocates."""
    if t.offset and not t.buffer:
        # never a raw address (CVE-2026-34159 in llama.cpp's rpc-server: buffer 0 + data pointer)
        raise _bad(t.index, f"offset {t.offset} without a buffer: data outside a client buffer is the daemon's "
                            f"to place")
    if t.is_view:
        root = earlier[t.view_src]
        if t.op == lib.GGML_OP_NONE:
            raise _bad(t.index, "a view must be made by an op")
        if root.is_view:
            raise _bad(t.index, "view_src must be a tensor that is not itself a view (ggml flattens view chains)")
        if t.buffer and t.buffer != root.buffer:
            raise _bad(t.index, "a view lies in its view_src's buffer")
        t.buffer, t.offset = root.buffer, root.offset + t.view_offs if root.buffer else 0
        ext = t.extent()
        if t.view_offs + ext > storage_size(root, buffer_size):
            raise _bad(t.index, f"view of {ext} bytes at view_offs {t.view_offs} runs past its view_src "
                                f"({storage_size(root, buffer_size)} bytes)")
        return
    if t.view_offs:
        raise _bad(t.index, "view_offs without view_src")
    if t.buffer:
        size = buffer_size(t.buffer)
        if size is None:
            raise _bad(t.index, f"buffer {t.buffer} is not a buffer of this connection")
        if t.offset + t.extent() > size:
            raise _bad(t.index, f"data [{t.offset}, {t.offset + t.extent()}) runs past the end of buffer "
                                f"{t.buffer} ({size} bytes)")
    if not t.is_contiguous():
        # kernels write their results as contiguous rows; only views may have other strides
        raise _bad(t.index, f"nb {list(t.nb)} are not the contiguous strides of a {type_traits(t.type).name} "
                            f"tensor of ne {list(t.ne)}; only views may have other strides")


def check_canonical(t: TensorSpec) -> None:
    """A tensor that is not a view has exactly ggml_new_tensor's strides, in every dim (ne == 1
    included): the kernels write results as packed rows, some walk all rows with one flat index
    (SCALE, GLU, FLASH_ATTN_EXT's output) and several assert nb[0] <= nb[1] <= nb[2] <= nb[3]
    whatever ne is. Only views may have other strides."""
    if not t.is_view and not t.is_canonical():
        raise _bad(t.index, f"nb {list(t.nb)} are not the strides {list(canonical_nb(t.type, t.ne))} of a "
                            f"{type_traits(t.type).name} tensor of ne {list(t.ne)} (only views may have other "
                            f"strides)")


# ---------------------------------------------------------------- per-op rules

def _need(cond: bool, t: TensorSpec, what: str) -> None:
    if not cond:
        raise _bad(t.index, f"{op_name(t.op)}: {what}")


def op_name(op: int) -> str:
    from ggml_ffi import ffi
    return ffi.string(lib.ggml_op_name(op)).decode() if 0 <= op < lib.GGML_OP_COUNT else str(op)


def _srcs(t: TensorSpec, tensors, n_min: int, n_max: int | None = None) -> list[TensorSpec]:
    n_max = n_min if n_max is None else n_max
    _need(n_min <= len(t.src) <= n_max, t, f"takes {n_min}..{n_max} sources, got {len(t.src)}")
    for k in range(n_min):
        _need(t.src[k] >= 0, t, f"src[{k}] is required")
    return [tensors[s] if s >= 0 else None for s in t.src]


def _same_shape(t: TensorSpec, a: TensorSpec) -> None:
    _need(t.ne == a.ne, t, f"result ne {list(t.ne)} must equal src ne {list(a.ne)}")


def _types(t: TensorSpec, x: TensorSpec, allowed, role: str) -> None:
    _need(x.type in allowed, t, f"{role} type {type_traits(x.type).name} not supported")


def _is_view_of(t: TensorSpec, a: TensorSpec) -> None:
    root = a.view_src if a.is_view else a.index
    _need(t.view_src == root, t, "result must be a view of its source")


def _rows(t: TensorSpec, x: TensorSpec, role: str) -> None:
    """The kernel reads (or writes) x's rows as ne[0] packed elements and ignores nb[0] (most assert it)."""
    _need(x.rows_contiguous(), t, f"{role} rows must be contiguous (nb[0] = {type_traits(x.type).type_size}, "
                                  f"got {x.nb[0]})")


def _flat_rows(t: TensorSpec, x: TensorSpec, role: str) -> None:
    """ggml_is_contiguous_1 and packed rows: kernels that walk all rows with one index times nb[1]."""
    _rows(t, x, role)
    _need(x.is_contiguous_1(), t, f"{role} must have packed rows (ggml_is_contiguous_1): nb {list(x.nb)}")


def _finite(t: TensorSpec, i: int, what: str, lo: float | None = None) -> float:
    v = t.param_f32(i)
    _need(math.isfinite(v) and (lo is None or v >= lo), t,
          f"{what} (params[{i}]) must be finite" + (f" and >= {lo:g}" if lo is not None else "") + f", got {v!r}")
    return v


def rule_none(t, tensors):
    _need(not t.src, t, "a leaf has no sources")


def rule_binary(t, tensors):
    a, b = _srcs(t, tensors, 2)
    _types(t, a, FLOAT_TYPES, "src0"); _types(t, b, FLOAT_TYPES, "src1")
    # the CPU kernels take src1 of src0's type or f32 (f32 + f16 aborts)
    _need(b.type in (a.type, F32), t, "src1 type must equal src0 type or be f32")
    _need(t.type == a.type, t, "result type must equal src0 type")
    _same_shape(t, a)
    _need(all(a.ne[i] % b.ne[i] == 0 for i in range(4)), t, f"src1 ne {list(b.ne)} does not broadcast to {list(a.ne)}")
    _rows(t, a, "src0")  # GGML_ASSERT(nb00 == sizeof(src0_t))
    _rows(t, b, "src1")


def rule_unary_like(t, tensors):
    (a,) = _srcs(t, tensors, 1)
    _types(t, a, FLOAT_TYPES, "src0")
    _need(t.type == a.type, t, "result type must equal src type")
    _same_shape(t, a)


def rule_scale(t, tensors):
    rule_unary_like(t, tensors)
    a = tensors[t.src[0]]
    _types(t, a, (F32,), "src0")  # the CPU kernel aborts on anything else
    # GGML_ASSERT(ggml_is_contiguous(src0)), and it walks all rows as i * nb[1] (with a bias: dst's nb[1])
    _need(a.is_contiguous() and a.is_contiguous_1(), t, f"src0 must be contiguous: nb {list(a.nb)}")
    _need(a.nb[1] == a.row_bytes() or a.ne[1] * a.ne[2] * a.ne[3] == 1, t, "src0 rows must be packed (nb[1])")


def rule_norm(t, tensors):
    (a,) = _srcs(t, tensors, 1)
    _types(t, a, (F32,), "src0")
    _need(t.type == F32, t, "result must be f32")
    _same_shape(t, a)
    _rows(t, a, "src0")  # RMS_NORM: GGML_ASSERT(src0->nb[0] == sizeof(float))
    _finite(t, 0, "eps", 0.0)  # GGML_ASSERT(eps >= 0.0f); NaN fails it too


# the unary ops the CPU backend computes for f32 and f16 (XIELU: f32 only, and no model here uses it)
UNARY_OPS = frozenset(getattr(lib, f"GGML_UNARY_OP_{n}") for n in (
    "ABS", "SGN", "NEG", "STEP", "TANH", "ELU", "RELU", "SIGMOID", "GELU", "GELU_QUICK", "SILU", "HARDSWISH",
    "HARDSIGMOID", "EXP", "EXPM1", "SOFTPLUS", "GELU_ERF", "FLOOR", "CEIL", "ROUND", "TRUNC"))
GLU_OPS = frozenset(getattr(lib, f"GGML_GLU_OP_{n}") for n in (
    "REGLU", "GEGLU", "SWIGLU", "SWIGLU_OAI", "GEGLU_ERF", "GEGLU_QUICK"))


def rule_unary(t, tensors):
    rule_unary_like(t, tensors)
    a = tensors[t.src[0]]
    _types(t, a, (F32, F16), "src0")  # gelu, silu... abort on bf16
    _need(t.param_i32(0) in UNARY_OPS, t, f"unary op {t.param_i32(0)} not supported")
    _flat_rows(t, a, "src0")  # asserts nb00 == sizeof(src0_t); some ops ggml_is_contiguous_1


def rule_glu(t, tensors):
    srcs = _srcs(t, tensors, 1, 2)
    a = srcs[0]
    _types(t, a, (F32, F16), "src0")  # the CPU kernels abort on bf16
    op = t.param_i32(0)
    _need(op in GLU_OPS, t, f"glu op {op} not supported")
    _need(op != lib.GGML_GLU_OP_SWIGLU_OAI or a.type == F32, t, "swiglu_oai takes f32 only")
    _flat_rows(t, a, "src0")  # GGML_ASSERT(ggml_is_contiguous_1(src0)); rows walked as i * nb[1]
    if len(srcs) == 2 and srcs[1] is not None:
        b = srcs[1]
        _need(b.ne == a.ne and b.type == a.type, t, "split glu halves must match")
        _flat_rows(t, b, "src1")
        _need(t.ne == a.ne, t, "result ne must equal src ne")
    else:
        _need(a.ne[0] % 2 == 0 and t.ne == (a.ne[0] // 2,) + a.ne[1:], t, "result must be half of src0 in ne[0]")
    _need(t.type == a.type, t, "result type must equal src type")


def _mul_mat_operands(t, a, b, role: str, dot_type_src1: bool = False) -> None:
    """What MUL_MAT and MUL_MAT_ID ask alike of the weights `a` (as `role`) and src1 `b`;
    `dot_type_src1`: src1 may also come converted already, in a's dot type (DOT_TYPES):
    the kernel then reads it in place as whole packed rows (its ggml_is_contiguous branch)."""
    _types(t, a, WEIGHT_TYPES, role)
    if dot_type_src1 and b.type != F32:
        _need(b.type == DOT_TYPES.get(a.type), t, f"src1 type {type_traits(b.type).name} not supported (f32, or "
                                                  f"src0's dot type: {_dot_type_name(a.type)})")
        # canonical, not just contiguous: the tiled K-quant kernel steps through its rows (all of
        # dims 1..3 as one index) by nb[1], which ggml_is_contiguous ignores where ne[1] is 1
        _need(b.is_canonical(), t, f"a src1 in src0's dot type must be contiguous, with the strides "
                                   f"{list(canonical_nb(b.type, b.ne))} of its shape: nb {list(b.nb)}")
    else:
        _types(t, b, (F32,), "src1")
    _rows(t, a, "src0"); _rows(t, b, "src1")  # GGML_ASSERT(nb00 == type size), (nb10 == type size)
    _need(a.ne[0] == b.ne[0], t, f"src0 ne[0]={a.ne[0]} != src1 ne[0]={b.ne[0]}")
    _need(a.nb[0] <= a.nb[1], t, "src0 must not be transposed")


def _dot_type_name(weight_type: int) -> str:
    dot = DOT_TYPES.get(weight_type)
    return type_traits(dot).name if dot is not None else "none"


def rule_mul_mat(t, tensors):
    a, b = _srcs(t, tensors, 2)
    _mul_mat_operands(t, a, b, "src0", dot_type_src1=True)
    _need(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, t, "src1 batch dims must be multiples of src0's")
    # op_params[1] == GGML_HINT_SRC0_IS_HADAMARD switches the CPU kernel to a Walsh-Hadamard transform
    _need(t.param_i32(1) == lib.GGML_HINT_NONE, t, f"hint {t.param_i32(1)} not supported")
    _need(t.param_i32(0) in (lib.GGML_PREC_DEFAULT, lib.GGML_PREC_F32), t, f"precision {t.param_i32(0)} unknown")
    _need(t.type == F32 and t.ne == (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), t,
          f"result must be f32 [{a.ne[1]}, {b.ne[1]}, {b.ne[2]}, {b.ne[3]}]")


def rule_get_rows(t, tensors):
    a, b = _srcs(t, tensors, 2)
    _types(t, a, WEIGHT_TYPES + (I32,), "src0"); _types(t, b, (I32,), "src1 (row ids)")
    # the kernel reads row ids[i10, i11, i12] of src0 plane (i11, i12): as ggml_get_rows asserts
    _need(a.ne[2] == b.ne[1] and a.ne[3] == b.ne[2] and b.ne[3] == 1, t, "row id tensor does not match src0 batches")
    _rows(t, a, "src0")  # rows are copied / dequantized as ne[0] packed elements
    _need(t.ne == (a.ne[0], b.ne[0], b.ne[1], b.ne[2]), t, "result shape must be [src0.ne0, ids.ne0, ids.ne1, ids.ne2]")
    _need(t.type in (F32, I32) and (t.type == I32) == (a.type == I32), t, "result must be f32 (i32 for i32 rows)")


def rule_set_rows(t, tensors):
    src, ids, dst = _srcs(t, tensors, 3)  # ggml_set_rows(a=dst, b=src, c=ids) stores src[] = {b, c, a}
    _types(t, dst, KV_TYPES, "dst"); _types(t, src, (F32,), "src"); _types(t, ids, (I64, I32), "row ids")
    _is_view_of(t, dst)
    _need(t.ne == dst.ne and t.type == dst.type, t, "result is a view of dst")
    _need(src.ne[0] == dst.ne[0] and ids.ne[0] == src.ne[1], t, "src rows do not match dst rows / ids")
    # the CPU kernel writes src plane (i2, i3) into dst plane (i2, i3): fewer dst planes = write past dst
    _need(src.ne[2] == dst.ne[2] and src.ne[3] == dst.ne[3], t, "src and dst batch dims must be equal")
    _need(src.ne[2] % ids.ne[1] == 0 and src.ne[3] % ids.ne[2] == 0 and ids.ne[3] == 1, t, "ids batch dims")
    # rows are converted from ne[0] packed floats into ne[0] packed elements of the result
    _rows(t, src, "src"); _rows(t, t, "result")


def rule_cpy(t, tensors):
    # ggml_cast: src[1] is the result itself, a new tensor the daemon allocates and the copy fills whole
    cast = len(t.src) == 2 and t.src[1] == t.index
    if cast:
        _need(t.src[0] >= 0, t, "src[0] is required")
        a, b = tensors[t.src[0]], t
    else:
        a, b = _srcs(t, tensors, 2)
    _types(t, a, FLOAT_TYPES, "src0"); _types(t, b, CPY_TYPES, "dst")
    _need(a.nelements() == b.nelements(), t, "src and dst element counts differ")
    if cast:
        _need(not t.is_view, t, "a cast's result (its own destination) must be a new tensor, not a view")
    else:
        _is_view_of(t, b)
        # the kernel copies nelements(src) into the result: it must be dst itself (found by tests/fuzz_protocol.py)
        _need(t.ne == b.ne and t.type == b.type, t, "result is a view of dst (same type and shape)")
    tr = type_traits(t.type)
    if tr.blck_size > 1:
        # float -> quantized: packed src rows quantized into a contiguous result, else GGML_ABORT
        _rows(t, a, "src0")
        _need(t.is_contiguous(), t, f"a quantized result must be contiguous: nb {list(t.nb)}")
        _need(a.ne[0] % tr.blck_size == 0, t, f"src0 rows must be whole {tr.name} blocks")
        # the kernel widens each src0 row into a work buffer that ggml sizes by the result's ne[0]
        # (per thread): a longer src0 row would overrun it
        _need(a.ne[0] <= t.ne[0], t, f"src0 rows ({a.ne[0]} elements) must not be longer than the result's "
                                     f"({t.ne[0]})")


def rule_cont(t, tensors):
    (a,) = _srcs(t, tensors, 1)
    _need(t.type == a.type and t.nelements() == a.nelements(), t, "result must hold src's elements")
    _need(t.is_contiguous(), t, "result must be contiguous")
    if type_traits(a.type).blck_size > 1:
        # the strided byte copy counts quantized rows in elements, not blocks: only a plain copy is safe
        _need(a.is_contiguous(), t, "a quantized src must be contiguous")


def rule_concat(t, tensors):
    """f32 only: the kernel copies element by element through every stride (its f32 path
    asserts a 4-byte type; the others are not taken)."""
    a, b = _srcs(t, tensors, 2)
    _types(t, a, (F32,), "src0"); _types(t, b, (F32,), "src1")
    dim = t.param_i32(0)
    _need(0 <= dim < 4, t, f"dim {dim} not in 0..3")
    _need(all(a.ne[d] == b.ne[d] for d in range(4) if d != dim), t, f"sources must match in every dim but {dim}")
    ne = tuple(a.ne[d] + b.ne[d] if d == dim else a.ne[d] for d in range(4))
    _need(t.type == F32 and t.ne == ne, t, f"result must be f32 {list(ne)}")  # a new tensor: check_op


def rule_pad(t, tensors):
    """f32 only (the kernel aborts on any other type), zeros around the source: params are
    8 paddings (left, right per dim), none negative, and a 0 for "not circular" (the circular
    variant is not taken); the result is the source's ne plus its paddings."""
    (a,) = _srcs(t, tensors, 1)
    _types(t, a, (F32,), "src0")
    pads = [t.param_i32(i) for i in range(8)]
    _need(all(p >= 0 for p in pads), t, f"paddings {pads} must not be negative")
    _need(t.param_i32(8) == 0, t, "circular padding is not supported")
    ne = tuple(a.ne[d] + pads[2 * d] + pads[2 * d + 1] for d in range(4))
    _need(t.type == F32 and t.ne == ne, t, f"result must be f32 {list(ne)}")  # a new tensor: check_op


def rule_view(t, tensors):
    (a,) = _srcs(t, tensors, 1)
    _need(t.type == a.type, t, "a view keeps its source's type")
    _is_view_of(t, a)


def rule_reshape(t, tensors):
    rule_view(t, tensors)
    a = tensors[t.src[0]]
    _need(t.nelements() == a.nelements() and a.is_contiguous(), t, "reshape needs a contiguous source of equal size")


def rule_rope(t, tensors):
    srcs = _srcs(t, tensors, 2, 3)
    a, pos = srcs[0], srcs[1]
    _types(t, a, (F32, F16), "src0"); _types(t, pos, (I32,), "positions")
    mode, n_dims = t.param_i32(2), t.param_i32(1)
    _need(mode in (0, 2), t, f"rope mode {mode} not supported (NORMAL 0 or NEOX 2)")
    _need(0 < n_dims <= a.ne[0] and n_dims % 2 == 0, t, f"n_dims {n_dims} must be even and <= ne[0]")
    # ggml 0.25 rotates dims [n_offs, n_offs + n_dims) with n_offs = op_params[15] (0.20 ignores it):
    # only 0 means the same on both
    _need(t.param_i32(15) == 0, t, f"rope offset (op_params[15]) {t.param_i32(15)} not supported")
    # the kernel copies the dims past n_dims in pairs: an odd ne[0] writes one element past the row
    _need(a.ne[0] % 2 == 0, t, "src0 ne[0] must be even")
    _rows(t, a, "src0")  # GGML_ASSERT(nb0 == nb00 && nb0 == sizeof(T))
    _need(pos.ne[0] == a.ne[2], t, "one position per row (positions ne[0] == src0 ne[2])")
    _rows(t, pos, "positions")  # read as a flat int32 array
    if len(srcs) == 3 and srcs[2] is not None:
        ff = srcs[2]
        _types(t, ff, (F32,), "freq factors")
        # ggml_rope_cache_init reads freq_factors[i0/2] for every even i0 < ne0, not just < n_dims
        _need(ff.ne[0] >= a.ne[0] // 2, t, f"freq factors too short (need {a.ne[0] // 2})")
        _rows(t, ff, "freq factors")
    _same_shape(t, a)
    _need(t.type == a.type, t, "result type must equal src type")


def rule_soft_max(t, tensors):
    srcs = _srcs(t, tensors, 1, 3)
    a = srcs[0]
    _types(t, a, (F32,), "src0")
    _rows(t, a, "src0")
    if len(srcs) > 1 and srcs[1] is not None:
        m = srcs[1]
        _types(t, m, (F16, F32), "mask")
        _need(m.ne[0] == a.ne[0] and m.ne[1] >= a.ne[1], t, "mask shape")
        _need(a.ne[2] % m.ne[2] == 0 and a.ne[3] % m.ne[3] == 0, t, "mask does not broadcast")
        _rows(t, m, "mask")
    _need(len(srcs) < 3 or srcs[2] is None, t, "sinks not supported")
    _same_shape(t, a)
    _need(t.type == F32, t, "result must be f32")


FA_KV_TYPES = (F16, F32, lib.GGML_TYPE_Q8_0, lib.GGML_TYPE_Q4_0)


def rule_flash_attn(t, tensors):
    srcs = _srcs(t, tensors, 3, 5)
    q, k, v = srcs[:3]
    # K by its type's vec_dot (q converted to its dot type), V by to_float: a quantized KV cache (-ctk/-ctv)
    _types(t, q, (F32,), "q"); _types(t, k, FA_KV_TYPES, "k"); _types(t, v, FA_KV_TYPES, "v")
    _need(k.ne[0] == q.ne[0] and v.ne[1] == k.ne[1], t, "q/k/v head dims")
    for x, role in ((k, "k"), (v, "v")):  # a head's row is whole blocks, else the dot or the conversion overruns
        _need(x.ne[0] % type_traits(x.type).blck_size == 0, t, f"{role} head size must be whole blocks")
    # heads: q's k-head = iq2 / (q.ne2 / k.ne2), likewise for v and dim 3: a ratio of 0 divides by zero
    _need(q.ne[2] % k.ne[2] == 0 and q.ne[3] % k.ne[3] == 0 and k.ne[2] == v.ne[2] and k.ne[3] == v.ne[3], t,
          "q/k/v heads")
    _rows(t, q, "q"); _rows(t, k, "k"); _rows(t, v, "v")  # GGML_ASSERT(nbq0/nbk0/nbv0 == type size)
    if len(srcs) > 3 and srcs[3] is not None:
        m = srcs[3]
        _types(t, m, (F16,), "mask")
        _need(m.ne[0] == k.ne[1] and m.ne[1] >= q.ne[1], t, "mask shape")
        _need(q.ne[2] % m.ne[2] == 0 and q.ne[3] % m.ne[3] == 0, t, "mask does not broadcast")
        _rows(t, m, "mask")
    _need(len(srcs) < 5 or srcs[4] is None, t, "sinks not supported")
    prec = t.param_i32(3)  # anything but these: GGML_ABORT
    _need(prec in (lib.GGML_PREC_DEFAULT, lib.GGML_PREC_F32), t, f"precision {prec} unknown (0 or 10)")
    _need(t.type == F32 and t.ne == (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), t,
          "result must be f32 [v.ne0, q.ne2, q.ne1, q.ne3]")


def rule_argmax(t, tensors):
    (a,) = _srcs(t, tensors, 1)
    _types(t, a, (F32,), "src0")
    _need(a.ne[2] == 1 and a.ne[3] == 1, t, "src0 must be a matrix")
    _rows(t, a, "src0")
    _need(t.type == I32 and t.ne == (a.ne[1], 1, 1, 1), t, "result must be i32 [src0.ne1]")


def rule_sum_rows(t, tensors):
    (a,) = _srcs(t, tensors, 1)
    _types(t, a, (F32,), "src0")
    _rows(t, a, "src0")
    _need(t.type == F32 and t.ne == (1,) + a.ne[1:], t, "result must be f32 [1, src0.ne1, ne2, ne3]")


def rule_arange(t, tensors):
    _srcs(t, tensors, 0)
    _need(t.type == F32, t, "result must be f32")
    start, stop, step = (t.param_f32(i) for i in range(3))
    _need(all(math.isfinite(x) for x in (start, stop, step)) and step != 0, t, "start, stop, step must be finite, "
                                                                               "step non-zero")
    # the kernel asserts nelements == ceilf((stop - start) / step), computed in f32
    span = _f32(stop - start)
    steps = None if span is None else _f32(span / step)
    _need(steps is not None, t, "(stop - start) / step overflows f32")
    steps = math.ceil(steps)
    _need(t.ne == (steps, 1, 1, 1), t, f"result must be f32 [{steps}] (ceil((stop - start) / step))")


# MUL_MAT_ID's kernel keeps a row map of n_as * ids.ne0 * ids.ne1 entries of 8 bytes in its work
# memory (not counted against --mem) and holds n_as (at most MAX_EXPERTS), ids.ne0 and the row index
# in C ints
MAX_EXPERT_ROW_MAP = 256 << 20
INT32_MAX = (1 << 31) - 1


def rule_top_k(t, tensors):
    (a,) = _srcs(t, tensors, 1)
    _types(t, a, (F32,), "src0")  # the kernel aborts on anything else
    # rows read as i * nb[1] over all rows, ne[0] packed floats each
    _flat_rows(t, a, "src0")
    # the kernel numbers a row's entries 0..ne0-1 in int32 (a wider row would wrap to negative indices)
    _need(a.ne[0] <= INT32_MAX, t, f"src0 rows longer than {INT32_MAX}")
    _need(t.type == I32 and 1 <= t.ne[0] <= a.ne[0] and t.ne[1:] == a.ne[1:], t,
          f"result must be i32 [k <= {a.ne[0]}, {a.ne[1]}, {a.ne[2]}, {a.ne[3]}]")


def rule_mul_mat_id(t, tensors):
    a, b, ids = _srcs(t, tensors, 3)  # ggml_mul_mat_id(as, b, ids): one matrix of `as` per expert (ne[2])
    _mul_mat_operands(t, a, b, "src0 (experts)"); _types(t, ids, (I32,), "ids")
    # the kernel walks src1 and the result as 3-D and the ids as 2-D: a fourth dim would be read past
    _need(a.ne[3] == 1 and b.ne[3] == 1 and ids.ne[2] == 1 and ids.ne[3] == 1, t,
          "src0 and src1 must be 3-D, ids 2-D")
    _need(ids.ne[1] == b.ne[2], t, "one row of ids per src1 column group (ids ne[1] == src1 ne[2])")
    _need(ids.ne[0] % b.ne[1] == 0, t, "ids ne[0] must be a multiple of src1 ne[1]")
    n_as = a.ne[2]
    _need(n_as <= MAX_EXPERTS, t, f"at most {MAX_EXPERTS} experts (src0 ne[2]), got {n_as}")
    _need(n_as * ids.ne[0] * ids.ne[1] * 8 <= MAX_EXPERT_ROW_MAP, t,
          f"experts x ids ({n_as} x {ids.ne[0]} x {ids.ne[1]}) need a row map over {MAX_EXPERT_ROW_MAP} bytes")
    _need(t.type == F32 and t.ne == (a.ne[1], ids.ne[0], b.ne[2], 1), t,
          f"result must be f32 [{a.ne[1]}, {ids.ne[0]}, {b.ne[2]}, 1]")
    _expert_ids_in_range(t, ids, tensors, n_as)


def _expert_ids_in_range(t, ids, tensors, n_as: int) -> None:
    """The kernel turns each id into a slot of its row map with no check in a release build
    (a plain assert): an id outside 0..n_as-1 writes outside its work memory. So every id
    must be proven in range before compute: it comes inline (row_ids checks the values of
    each request), or it is an element of a TOP_K result over rows of n_as entries that
    nothing else can write between its compute and this read: a node flagged COMPUTE, in
    the compute buffer (not a client buffer, which other tensors may alias), read whole
    elements at a time (a view of it with offsets and strides in whole int32s)."""
    root = tensors[ids.view_src] if ids.is_view else ids
    if root.is_inline_input:
        return  # row_ids.plan checks its values on every compute
    _need(root.op == lib.GGML_OP_TOP_K, t, "ids must come inline or from a TOP_K of this graph (anything else "
                                          "cannot be proven to name existing experts)")
    _need(tensors[root.src[0]].ne[0] == n_as, t, f"the TOP_K giving the ids must rank rows of exactly {n_as} "
                                                 f"entries, one per expert")
    _need(bool(root.flags & lib.GGML_TENSOR_FLAG_COMPUTE), t, "the TOP_K giving the ids must be flagged COMPUTE")
    _need(not root.buffer, t, "the TOP_K giving the ids must not live in a client buffer")
    if ids.is_view:
        _need(ids.view_offs % 4 == 0 and all(x % 4 == 0 for x in ids.nb), t,
              "a view of TOP_K ids must read whole int32 elements (view_offs and nb multiples of 4)")


def _f32(x: float) -> float | None:
    """x rounded to f32 as the kernel computes it; None where f32 overflows."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return None


OP_RULES: dict[int, Callable] = {
    lib.GGML_OP_NONE: rule_none,
    lib.GGML_OP_ADD: rule_binary,
    lib.GGML_OP_SUB: rule_binary,
    lib.GGML_OP_MUL: rule_binary,
    lib.GGML_OP_DIV: rule_binary,
    lib.GGML_OP_SCALE: rule_scale,
    lib.GGML_OP_RMS_NORM: rule_norm,
    lib.GGML_OP_NORM: rule_norm,
    lib.GGML_OP_MUL_MAT: rule_mul_mat,
    lib.GGML_OP_GET_ROWS: rule_get_rows,
    lib.GGML_OP_SET_ROWS: rule_set_rows,
    lib.GGML_OP_CPY: rule_cpy,
    lib.GGML_OP_CONT: rule_cont,
    lib.GGML_OP_CONCAT: rule_concat,
    lib.GGML_OP_PAD: rule_pad,
    lib.GGML_OP_RESHAPE: rule_reshape,
    lib.GGML_OP_VIEW: rule_view,
    lib.GGML_OP_PERMUTE: rule_view,
    lib.GGML_OP_TRANSPOSE: rule_view,
    lib.GGML_OP_ROPE: rule_rope,
    lib.GGML_OP_SOFT_MAX: rule_soft_max,
    lib.GGML_OP_FLASH_ATTN_EXT: rule_flash_attn,
    lib.GGML_OP_UNARY: rule_unary,
    lib.GGML_OP_GLU: rule_glu,
    lib.GGML_OP_ARGMAX: rule_argmax,
    lib.GGML_OP_ARANGE: rule_arange,
    lib.GGML_OP_SUM_ROWS: rule_sum_rows,
    lib.GGML_OP_TOP_K: rule_top_k,
    lib.GGML_OP_MUL_MAT_ID: rule_mul_mat_id,
}
SUPPORTED_OPS = frozenset(OP_RULES)
SUPPORTED_OP_NAMES = sorted(op_name(op) for op in SUPPORTED_OPS)


# ops whose result is a view: no compute (VIEW...), or written into dst's memory (CPY, SET_ROWS)
VIEW_RESULT_OPS = frozenset((lib.GGML_OP_VIEW, lib.GGML_OP_PERMUTE, lib.GGML_OP_TRANSPOSE, lib.GGML_OP_RESHAPE,
                             lib.GGML_OP_CPY, lib.GGML_OP_SET_ROWS))


def check_op(t: TensorSpec, earlier: list[TensorSpec]) -> None:
    rule = OP_RULES.get(t.op)
    if rule is None:
        raise _bad(t.index, f"op {op_name(t.op)} is not supported by this daemon")
    if t.op != lib.GGML_OP_NONE and t.op not in VIEW_RESULT_OPS:
        # a computing op writes a new tensor with ggml_new_tensor's strides (check_placement), so the
        # kernels' asserts on the result's strides (nb0 == type size, nb0 <= nb1 <= nb2 <= nb3) hold
        _need(not t.is_view, t, "the result of a computing op must be a new tensor, not a view")
    rule(t, earlier)
