"""encode_graph reads a graph's tensors as raw structs in bulk: checked here
field by field against cffi's own reading of the same tensors, on a graph with
views of views' sources, a ggml_cast (a CPY naming itself), op parameters,
names, several sources, a gap in the sources and tensors placed in a client
buffer."""
from __future__ import annotations

import numpy as np

from ggml_ffi import Context, NULL, ffi, lib
from rpc_daemon.validation.graph import parse_graph
from rpc_daemon.wire.graph_codec import encode_graph
from rpc_daemon.wire.protocol import Limits


def by_field(x, index_of: dict, placement) -> dict:
    """One tensor's wire form, read through cffi's attribute access (what encode_graph stands in for)."""
    src = [index_of[x.src[k]] if x.src[k] != NULL else -1 for k in range(10)]
    while src and src[-1] == -1:
        src.pop()
    wire = {"type": x.type, "ne": [int(n) for n in x.ne], "nb": [int(n) for n in x.nb], "op": x.op,
            "params": bytes(ffi.buffer(x.op_params, 64)).rstrip(b"\0"), "flags": x.flags, "src": src,
            "view_src": index_of[x.view_src] if x.view_src != NULL else -1, "view_offs": int(x.view_offs),
            "name": ffi.string(x.name).decode()}
    if x.view_src == NULL and placement(x) is not None:
        wire["buffer"], wire["offset"] = placement(x)
    return wire


def test_encode_graph_reads_every_field_as_cffi_does():
    with Context(64) as ctx:
        w = ctx.new_tensor(lib.GGML_TYPE_Q8_0, [64, 8], "weight")
        x = ctx.new_tensor(lib.GGML_TYPE_F32, [64, 3], "x")
        rows = ctx.new_tensor(lib.GGML_TYPE_I32, [3], "rows")
        for t in (x, rows):
            lib.ggml_set_input(t)
        y = lib.ggml_mul_mat(ctx.ptr, w, x)  # [8, 3]
        y = lib.ggml_scale(ctx.ptr, y, 0.5)  # a float in op_params
        v = lib.ggml_view_2d(ctx.ptr, y, 4, 3, y.nb[1], 4 * 4)  # a view at an offset
        t = lib.ggml_transpose(ctx.ptr, lib.ggml_cont(ctx.ptr, v))  # a view of a computed tensor
        c = lib.ggml_cast(ctx.ptr, lib.ggml_cont(ctx.ptr, t), lib.GGML_TYPE_F16)  # src[1] is itself
        got = lib.ggml_get_rows(ctx.ptr, lib.ggml_cont(ctx.ptr, y), rows)
        out = lib.ggml_add(ctx.ptr, lib.ggml_sum_rows(ctx.ptr, got), lib.ggml_sum_rows(ctx.ptr, got))
        lib.ggml_set_name(out, b"out")
        for r in (c, out):
            lib.ggml_set_output(r)
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, c)
        lib.ggml_build_forward_expand(gf, out)
        placed = {w: (7, 4096)}
        tensors, index_of = encode_graph(gf, placed.get)

        assert len(index_of) == len(tensors) and sorted(index_of.values()) == list(range(len(tensors)))
        for x_, i in index_of.items():
            assert tensors[i] == by_field(x_, index_of, placed.get), (i, tensors[i])
        order = sorted(index_of, key=index_of.get)
        for i, x_ in enumerate(order):  # sources and view sources come first
            assert all(s < i for s in tensors[i]["src"] if s != i) and tensors[i]["view_src"] < i
        cast = tensors[index_of[c]]
        assert cast["src"][1] == index_of[c] and cast["op"] == lib.GGML_OP_CPY
        assert tensors[index_of[w]]["buffer"] == 7 and tensors[index_of[w]]["offset"] == 4096
        scale = next(t for t in tensors if t["op"] == lib.GGML_OP_SCALE)
        assert np.frombuffer(scale["params"].ljust(8, b"\0")[:4], "<f4")[0] == 0.5
        assert tensors[index_of[out]]["name"] == "out"
        # and what it encodes passes the daemon's validation
        parse_graph({"tensors": tensors}, Limits(), lambda b: 1 << 20 if b == 7 else None)


def test_encode_graph_keeps_a_gap_in_the_sources():
    """soft_max without a mask and with sinks: src [x, -1, sinks], the -1 kept, trailing ones dropped."""
    with Context(16) as ctx:
        x = ctx.new_tensor(lib.GGML_TYPE_F32, [8, 3, 1], "x")
        sinks = ctx.new_tensor(lib.GGML_TYPE_F32, [1], "sinks")
        probs = lib.ggml_soft_max_ext(ctx.ptr, x, NULL, 0.125, 0.0)
        lib.ggml_soft_max_add_sinks(probs, sinks)
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, probs)
        tensors, index_of = encode_graph(gf, lambda t: None)
        assert tensors[index_of[probs]]["src"] == [index_of[x], -1, index_of[sinks]]
        for x_, i in index_of.items():
            assert tensors[i] == by_field(x_, index_of, lambda t: None), (i, tensors[i])
