"""A stage: a contiguous range of layers that runs on one endpoint, with the
weights and KV cache those layers need, and its step graphs built once per
shape and reused."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ggml_ffi import Context, lib
from coordinator.models.common import F16, F32, I32, I64, GraphBuilder, HParams, StepInputs, StepShape

MAX_CACHED_GRAPHS = 8
TENSORS_PER_LAYER = 80


@dataclass
class BuiltGraph:
    ctx: Context
    gf: object
    inputs: dict  # name -> tensor
    output: object
    graph_id: int
    wire: object = None  # (tensors, index_of), encoded on first remote use


class StageKV:
    """Per-layer K and V caches of one stage (metadata; placed by the executor)."""

    def __init__(self, hp: HParams, layers: range, n_ctx: int):
        self.ctx = Context(2 * len(layers) + 4)
        self._layers = {}
        for il in layers:
            k = self.ctx.new_tensor(F16, [hp.n_embd_kv, n_ctx], f"cache_k_l{il}")
            v = self.ctx.new_tensor(F16, [hp.n_embd_kv, n_ctx], f"cache_v_l{il}")
            self._layers[il] = (k, v)

    def layer(self, il: int):
        return self._layers[il]

    def tensors(self) -> list:
        return [t for kv in self._layers.values() for t in kv]


@dataclass
class Stage:
    index: int
    arch: object  # module from coordinator.models
    hp: HParams
    layers: range
    first: bool
    last: bool
    weights: dict  # name -> tensor (from the GGUF context)
    kv: StageKV
    graphs: "collections.OrderedDict[tuple, BuiltGraph]" = field(default_factory=collections.OrderedDict)
    _next_graph_id: int = 1

    @classmethod
    def create(cls, index, arch, hp, gguf, layers: range, n_layer: int, n_ctx: int) -> "Stage":
        first, last = layers.start == 0, layers.stop == n_layer
        names = [n for n in gguf.tensors if n.startswith("blk.") and int(n.split(".")[1]) in layers]
        if first:
            names.append("token_embd.weight")
        if last:
            names += ["output_norm.weight", "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"]
        if hp.arch == "llama" and "rope_freqs.weight" in gguf.tensors:  # llama 3.x RoPE frequency factors
            names.append("rope_freqs.weight")
        weights = {n: gguf.tensor(n) for n in dict.fromkeys(names)}
        return cls(index, arch, hp, layers, first, last, weights, StageKV(hp, layers, n_ctx))

    def output_size(self, shape: StepShape) -> int:
        if self.last:
            return (1 if shape.argmax else self.hp.n_vocab) * shape.n_outputs * 4
        return self.hp.n_embd * shape.n_tokens * 4

    def graph(self, shape: StepShape) -> tuple[BuiltGraph, list]:
        """The step graph for `shape` and the graphs evicted to make room for it."""
        key = (shape.n_tokens, shape.n_kv, shape.n_outputs, shape.argmax)
        evicted = []
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            return g, evicted
        g = self._build(shape)
        self.graphs[key] = g
        while len(self.graphs) > MAX_CACHED_GRAPHS:
            evicted.append(self.graphs.popitem(last=False)[1])
        return g, evicted

    def _build(self, shape: StepShape) -> BuiltGraph:
        hp = self.hp
        ctx = Context(TENSORS_PER_LAYER * len(self.layers) + 64)
        gf = ctx.new_graph()
        inputs = StepInputs()
        n = shape.n_tokens
        if self.first:
            tokens = inputs.new(ctx, "tokens", I32, [n])
        else:
            x = inputs.new(ctx, "hidden", F32, [hp.n_embd, n])
        pos = inputs.new(ctx, "positions", I32, [n])
        inputs.new(ctx, "kv_rows", I64, [n])
        inputs.new(ctx, "mask", F16, [shape.n_kv, n])
        if hp.n_swa:
            inputs.new(ctx, "mask_swa", F16, [shape.n_kv, n])
        if self.last:
            inputs.new(ctx, "out_rows", I32, [shape.n_outputs])
        b = GraphBuilder(ctx, hp, self.weights, self.kv, shape, inputs, gf)
        if self.first:
            x = self.arch.embed(b, tokens)
        for il in self.layers:
            x = self.arch.layer(b, il, x, pos)
        out = b.output_head(x) if self.last else x
        if self.last and shape.argmax:
            # greedy decoding needs one token id per row, not a megabyte of logits on the wire
            out = lib.ggml_argmax(ctx.ptr, out)
        lib.ggml_set_output(out)
        lib.ggml_build_forward_expand(gf, out)
        graph_id = self._next_graph_id
        self._next_graph_id += 1
        return BuiltGraph(ctx, gf, inputs.tensors, out, graph_id)
