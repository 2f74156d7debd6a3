"""Between ggml's own structs and the wire form of a graph (see graph.py).

`encode_graph` runs on clients: it walks a ggml graph built with the real op
constructors and emits its tensors in topological order. `build_graph` runs in
the daemon's compute process on a graph that graph.py already validated.
"""
from __future__ import annotations

from typing import Callable

from ggml_ffi import NULL, ffi, lib

GGML_OP_NONE = 0


def tensor_to_wire(x, index_of: dict, placement) -> dict:
    src = []
    for k in range(10):
        s = x.src[k]
        src.append(index_of[s] if s != NULL else -1)
    while src and src[-1] == -1:
        src.pop()
    view_src = index_of[x.view_src] if x.view_src != NULL else -1
    wire = {
        "type": x.type,
        "ne": [int(x.ne[i]) for i in range(4)],
        "nb": [int(x.nb[i]) for i in range(4)],
        "op": x.op,
        "params": bytes(ffi.buffer(x.op_params, 64)).rstrip(b"\0"),
        "flags": x.flags,
        "src": src,
        "view_src": view_src,
        "view_offs": int(x.view_offs),
        "name": ffi.string(x.name).decode(errors="replace"),
    }
    if view_src < 0:
        where = placement(x)
        if where is not None:
            wire["buffer"], wire["offset"] = where
    return wire


def encode_graph(gf, placement: Callable) -> tuple[list[dict], dict]:
    """Wire tensors of graph `gf` and the map from tensor pointer to index.
    `placement(tensor)` gives (buffer_id, offset) for tensors held in a remote
    buffer, None for inputs and intermediates."""
    order: list = []
    index_of: dict = {}

    def visit(x):
        # iterative post-order: sources (and view sources) before the tensor
        stack = [(x, False)]
        while stack:
            t, done = stack.pop()
            if t in index_of:
                continue
            if done:
                index_of[t] = len(order)
                order.append(t)
                continue
            stack.append((t, True))
            if t.view_src != NULL and t.view_src not in index_of:
                stack.append((t.view_src, False))
            for k in reversed(range(10)):
                s = t.src[k]
                if s != NULL and s != t and s not in index_of:  # ggml_cast names itself
                    stack.append((s, False))

    for i in range(lib.ggml_graph_n_nodes(gf)):
        visit(lib.ggml_graph_node(gf, i))
    return [tensor_to_wire(x, index_of, placement) for x in order], index_of


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
