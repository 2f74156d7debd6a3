"""Between ggml's own structs and the wire form of a graph (see graph.py).

`encode_graph` runs on clients: it walks a ggml graph built with the real op
constructors and emits its tensors in topological order. `build_graph` runs in
the daemon's compute process on a graph that graph.py already validated.
"""
from __future__ import annotations

import struct
from typing import Callable

import numpy as np

from ggml_ffi import NULL, ffi, lib

GGML_OP_NONE = 0


# A graph's tensors are read as raw structs, in one numpy pass, not field by field through cffi: a
# member's gemma3-270m graph of 1,023 tensors took 8-15 ms to encode that way (a new prompt length's
# first step waits for it), 5-9 ms so. The layout is the cdef's, which is generated from the loaded
# ggml's headers (tests/ffi/test_ffi_layout.py checks it against the library).
_TENSOR_SIZE = ffi.sizeof("struct ggml_tensor")
_TENSOR_PTR = ffi.typeof("struct ggml_tensor *")
_FIELDS = dict(ffi.typeof("struct ggml_tensor").fields)
_OFFSETS = {name: f.offset for name, f in _FIELDS.items()}
_POINTER, _SIZE_T = ffi.sizeof("void *"), ffi.sizeof("size_t")  # 4 on a 32-bit board, 8 elsewhere
_UNSIGNED = {4: "u4", 8: "u8"}
_STRUCT = np.dtype({"names": ["type", "ne", "nb", "op", "flags", "src", "view_src", "view_offs"],
                    "formats": [f"i{ffi.sizeof(_FIELDS['type'].type)}", ("i8", 4), (_UNSIGNED[_SIZE_T], 4),
                                f"i{ffi.sizeof(_FIELDS['op'].type)}", "i4", (_UNSIGNED[_POINTER], 10),
                                _UNSIGNED[_POINTER], _UNSIGNED[_SIZE_T]],
                    "offsets": [_OFFSETS[f] for f in ("type", "ne", "nb", "op", "flags", "src", "view_src",
                                                      "view_offs")],
                    "itemsize": _TENSOR_SIZE})  # in this machine's byte order, as the structs are
# src[10] and view_src, read as one run while walking the graph (C puts no padding between pointers)
_SOURCES = struct.Struct("=" + ("Q" if _POINTER == 8 else "I") * 11)
assert _OFFSETS["view_src"] == _OFFSETS["src"] + 10 * _POINTER
_PARAMS = slice(_OFFSETS["op_params"], _OFFSETS["op_params"] + ffi.sizeof(_FIELDS["op_params"].type))
_NAME = slice(_OFFSETS["name"], _OFFSETS["name"] + ffi.sizeof(_FIELDS["name"].type))


def _address(t) -> int:
    return int(ffi.cast("uintptr_t", t))


def encode_graph(gf, placement: Callable) -> tuple[list[dict], dict]:
    """Wire tensors of graph `gf` (sources and view sources before the tensors
    that use them) and the map from tensor pointer to index. `placement(tensor)`
    gives (buffer_id, offset) for tensors held in a remote buffer, None for
    inputs and intermediates."""
    raw: dict[int, bytes] = {}  # address -> the struct's bytes
    pointer: dict[int, object] = {}  # address -> the tensor's cffi pointer (placement's and index_of's keys)
    index_of: dict[int, int] = {}
    order: list[int] = []

    def visit(root: int) -> None:
        # iterative post-order over addresses: sources (and the view source) before the tensor
        stack = [(root, False)]
        while stack:
            a, done = stack.pop()
            if a in index_of:
                continue
            if done:
                index_of[a] = len(order)
                order.append(a)
                continue
            r = raw.get(a)
            if r is None:
                p = pointer[a] = ffi.cast(_TENSOR_PTR, a)
                r = raw[a] = ffi.buffer(p, _TENSOR_SIZE)[:]
            stack.append((a, True))
            *src, view_src = _SOURCES.unpack_from(r, _OFFSETS["src"])
            if view_src and view_src not in index_of:
                stack.append((view_src, False))
            for s in reversed(src):
                if s and s != a and s not in index_of:  # ggml_cast names itself
                    stack.append((s, False))

    for i in range(lib.ggml_graph_n_nodes(gf)):
        visit(_address(lib.ggml_graph_node(gf, i)))
    records = [raw[a] for a in order]
    table = np.frombuffer(b"".join(records), _STRUCT)
    used = table["src"] != 0
    n_src = np.where(used.any(axis=1), used.shape[1] - np.argmax(used[:, ::-1], axis=1), 0)  # up to the last one
    columns = zip(table["type"].tolist(), table["ne"].tolist(), table["nb"].tolist(), table["op"].tolist(),
                  table["flags"].tolist(), table["src"].tolist(), n_src.tolist(), table["view_src"].tolist(),
                  table["view_offs"].tolist())
    wire = []
    for a, r, (ttype, ne, nb, op, flags, src, n, view_src, view_offs) in zip(order, records, columns):
        src = [index_of[s] if s else -1 for s in src[:n]]
        t = {"type": ttype, "ne": ne, "nb": nb, "op": op, "params": r[_PARAMS].rstrip(b"\0"),
             "flags": flags, "src": src, "view_src": index_of[view_src] if view_src else -1, "view_offs": view_offs,
             "name": r[_NAME].split(b"\0", 1)[0].decode(errors="replace")}
        if not view_src:
            where = placement(pointer[a])
            if where is not None:
                t["buffer"], t["offset"] = where
        wire.append(t)
    return wire, {pointer[a]: i for a, i in index_of.items()}


def context_size(n_tensors: int) -> int:
    return n_tensors * lib.ggml_tensor_overhead() + lib.ggml_graph_overhead_custom(max(n_tensors, 16), False) + 4096


def build_graph(ctx, spec, buffers: dict):
    """Create the ggml tensors of a validated GraphSpec in `ctx` and return
    (tensor pointers, cgraph). `buffers[id]` is (ggml buffer, base address) of a
    client buffer mapped into this process."""
    ptrs = []
    ne = ffi.new("int64_t[4]")
    for t in spec.tensors:
        ne[0:4] = t.ne
        x = lib.ggml_new_tensor(ctx, t.type, 4, ne)
        for i in range(4):
            x.nb[i] = t.nb[i]
        x.op = t.op
        ffi.memmove(x.op_params, t.params.ljust(64, b"\0"), 64)
        for k, s in enumerate(t.src):
            x.src[k] = x if s == t.index else ptrs[s] if s >= 0 else NULL  # (s == index: ggml_cast)
        if t.is_view:
            x.view_src = ptrs[t.view_src]
            x.view_offs = t.view_offs
        if t.buffer:
            buf, base = buffers[t.buffer]
            x.buffer = buf
            x.data = ffi.cast("void *", base + t.offset)  # validated: inside the buffer
        lib.ggml_set_name(x, t.name.encode())
        ptrs.append(x)
    gf = lib.ggml_new_graph_custom(ctx, max(len(spec.tensors), 16), False)
    for i in spec.nodes:
        lib.ggml_build_forward_expand(gf, ptrs[i])
    # flags exactly as the client's graph had them; build_forward_expand may add COMPUTE
    for t, x in zip(spec.tensors, ptrs):
        x.flags = t.flags
    return ptrs, gf
