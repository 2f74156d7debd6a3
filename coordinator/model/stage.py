"""A stage: a contiguous range of layers that runs on one endpoint, with the
weights and KV cache those layers need, and its step graphs built once per
shape and reused.

With the output head in shares (the coordinator's `head_shards`), every stage also
holds a shard of the output head: a range of vocabulary rows. The last stage's
layer graph then ends at the normalized rows that want logits, and every stage
multiplies them by its rows in a separate head graph, all at the same time. On
a model whose head is a large part of the work (Gemma 3: a 262k vocabulary)
this turns the slowest serial part of a step into a parallel one; the logits
are the same bits, row for row, since each is the same dot product."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from ggml_ffi import Context, lib
from coordinator.model.architectures.common import (F16, F32, I32, I64, GraphBuilder, HParams, StepInputs, StepShape,
                                       argmax_first, best_tokens, head_source)

MAX_CACHED_GRAPHS = 8
TENSORS_PER_LAYER = 80


@dataclass
class StageOutput:
    """A stage's reply taken apart (Stage.read_output); what is not in it is None."""
    hidden: np.ndarray | None = None  # f32: the next stage's (or the head round's) input
    logits: np.ndarray | None = None  # f32[n_outputs, rows]
    tokens: np.ndarray | None = None  # i32[n_outputs]: each row's argmax (in this shard)
    best: np.ndarray | None = None  # f32[n_outputs]: that token's logit (head shards: to compare them)
    probes: np.ndarray | None = None  # f32[n_outputs]: finite_probe per row (not finite: a NaN or infinite logit)
    best_ids: np.ndarray | None = None  # i32[n_outputs, k]: each row's k best tokens (in this shard), any order
    best_values: np.ndarray | None = None  # f32[n_outputs, k]: their logits


@dataclass
class BuiltGraph:
    ctx: Context
    gf: object
    inputs: dict  # name -> tensor
    outputs: list  # tensors whose data the step returns, concatenated in this order
    graph_id: int
    wire: object = None  # (tensors, index_of), encoded on first remote use
    wire_ids: tuple = ()  # with wire: the inputs' indices by name (None: unused), the outputs', the exchanges'
    exchanges: list = field(default_factory=list)  # a tensor-parallel member's all-reduced partials, in order
    pieces: list = field(default_factory=list)  # per exchange: None, or the members' lengths it gathers (exact sums)


KV_TYPES = {"f16": F16, "q8_0": lib.GGML_TYPE_Q8_0, "q4_0": lib.GGML_TYPE_Q4_0}  # -ctk/-ctv, llama.cpp's names


class StageKV:
    """Per-layer K and V caches of one stage (metadata; placed by the executor), of the types
    `kv_types` (K's, V's: f16, or q8_0/q4_0 as llama.cpp's -ctk/-ctv)."""

    def __init__(self, hp: HParams, layers: range, n_ctx: int, kv_types: tuple = (F16, F16)):
        self.n_ctx = n_ctx  # cache rows; what Phi-3 picks its LongRoPE factors by
        self.ctx = Context(2 * len(layers) + 4)
        self._layers = {}
        for il in layers:
            k = self.ctx.new_tensor(kv_types[0], [hp.n_embd_kv, n_ctx], f"cache_k_l{il}")
            v = self.ctx.new_tensor(kv_types[1], [hp.n_embd_kv, n_ctx], f"cache_v_l{il}")
            self._layers[il] = (k, v)

    def layer(self, il: int):
        return self._layers[il]

    def tensors(self) -> list:
        return [t for kv in self._layers.values() for t in kv]


@dataclass(frozen=True)
class RowRange:
    """A weight that is a byte range of a GGUF tensor's rows (a stage's rows of the output head,
    a tensor-parallel member's rows of the embedding), then `zero_bytes` of zeros (the zero row
    every token the member does not hold reads: Stage.token_ids)."""
    source: str
    start: int
    stop: int
    zero_bytes: int = 0


@dataclass
class Stage:
    index: int
    arch: object  # module from coordinator.model.architectures
    hp: HParams
    layers: range
    first: bool
    last: bool
    weights: dict  # name -> tensor (from the GGUF context, or cut from one: see `cuts`)
    kv: StageKV
    # vocabulary rows of the output head this stage computes in its head graph
    # (None: the head is not split; the last stage's layer graph computes it whole)
    head_rows: range | None = None
    # the last stage holds the whole head besides (its rows are a view of it): a step may have it
    # computed whole here instead of split (StepShape.head_on_last; coordinator/decode/head_placement.py)
    holds_whole_head: bool = False
    head_weight: str | None = None  # the weight the head graph multiplies by (all its rows, or a cut)
    # name -> the part of a GGUF tensor a weight holds: a RowRange (a stage's rows of the head, a tensor of
    # their own), or a tensor-parallel shard's Cut of the GGUF tensor of the same name (model/tensor_split.py)
    cuts: dict = field(default_factory=dict)
    own_ctx: Context | None = None  # holds the tensors of `cuts`
    graphs: "collections.OrderedDict[tuple, BuiltGraph]" = field(default_factory=collections.OrderedDict)
    _next_graph_id: int = 1
    # a member of a tensor-parallel group (model/tensor_split.Shard): every layer, its share of each, its
    # rows of the head; `hp` is then the shard's (its head counts and FFN rows)
    shard: object = None
    tensor_group: int = 0  # which group of a pipeline of tensor-parallel groups (Coordinator(tensor_group=))
    # a tensor-parallel member of the first group holds these rows of token_embd and a zero row after
    # them (None: the whole embedding, or none): the members' embeddings summed are the tokens' rows
    embd_rows: range | None = None
    held_rows: dict = field(default_factory=dict)  # a weight of some rows of a GGUF tensor -> its first row
    # a member with exact sums: where its part of each tensor the members gather starts, the whole
    # tensor's length, and every member's part's length (GraphBuilder.gather); None: its output
    # projections' partial sums are all-reduced
    gather: dict | None = None

    @classmethod
    def create(cls, index, arch, hp, gguf, layers: range, n_layer: int, n_ctx: int,
               head_rows: range | None = None, holds_whole_head: bool = False, kv_types: tuple = (F16, F16)) -> "Stage":
        """`holds_whole_head` (with `head_rows`): the last stage holds the whole head too (others ignore it)."""
        first, last = layers.start == 0, layers.stop == n_layer
        holds_whole_head = last and (head_rows is None or holds_whole_head)
        names = [n for n in gguf.tensors if n.startswith("blk.") and int(n.split(".")[1]) in layers]
        if first:
            names.append("token_embd.weight")
        if last:
            names.append("output_norm.weight")
            if holds_whole_head:
                names.append(head_source(gguf.tensors))
        names += arch.extra_weights(gguf.tensors)  # on every stage, e.g. llama 3.x's RoPE frequency factors
        weights = {n: gguf.tensor(n) for n in dict.fromkeys(names)}
        stage = cls(index, arch, hp, layers, first, last, weights, StageKV(hp, layers, n_ctx, kv_types), head_rows,
                    holds_whole_head)
        if head_rows is not None and len(head_rows):
            src = head_source(gguf.tensors)
            # a stage that holds the whole tensor anyway (the first, with a tied embedding)
            # multiplies by a view of its rows; the others hold only their rows
            stage.head_weight = src if src in weights else stage._cut_head(gguf, src)
        return stage

    @classmethod
    def tensor_member(cls, index, arch, hp, gguf, shard, n_ctx: int, head_rows: range | None,
                      kv_types: tuple = (F16, F16), layers: range | None = None, group: int = 0,
                      embd_rows: range | None = None, group_shards: list | None = None) -> "Stage":
        """Member `shard.rank` of tensor-parallel group `group`: its `layers` (default: every
        layer), each cut to its shard (model/tensor_split.py); with the first layer `embd_rows`
        of the embedding (None: all of it), with the last the output norm whole and `head_rows`
        of the head (a view of its embedding rows where the head is tied to them). With exact sums
        (`shard.out`), `group_shards`: every member's Shard in rank order, whose lengths its gathers
        name."""
        from coordinator.model.tensor_split import local_hparams, shard_cuts
        layers = range(hp.n_layer) if layers is None else layers
        first, last = layers.start == 0, layers.stop == hp.n_layer
        local = local_hparams(hp, shard)
        names = [n for n in gguf.tensors if n.startswith("blk.") and int(n.split(".")[1]) in layers]
        names += (["token_embd.weight"] if first else []) + (["output_norm.weight"] if last else [])
        names += arch.extra_weights(gguf.tensors)
        weights = {n: gguf.tensor(n) for n in dict.fromkeys(names)}
        cuts = {name: cut for name, cut in shard_cuts(hp, shard, gguf.tensors).items() if name in weights}
        stage = cls(index, arch, local, layers, first, last, weights, StageKV(local, layers, n_ctx, kv_types),
                    head_rows if last else None, shard=shard, tensor_group=group)
        if shard.out is not None:
            stage.gather = {"attn": (shard.heads.start * hp.head_dim, hp.n_head * hp.head_dim,
                                     tuple(len(s.heads) * hp.head_dim for s in group_shards)),
                            "ffn": (shard.ffn.start, hp.n_ff, tuple(len(s.ffn) for s in group_shards)),
                            "out": (shard.out.start, hp.n_embd, tuple(len(s.out) for s in group_shards))}
        stage.own_ctx = Context(len(cuts) + 2)
        for name, cut in cuts.items():
            src = gguf.tensor(name)
            stage.weights[name] = stage.own_ctx.new_tensor(src.type, list(cut.ne), name)
            stage.cuts[name] = cut
        if first and embd_rows is not None:
            stage._hold_embedding_rows(gguf, embd_rows)
        if last:
            src = head_source(gguf.tensors)
            if src == "token_embd.weight" and stage.embd_rows is not None:
                held = stage.embd_rows
            else:
                held = range(gguf.tensor(src).ne[1] if src in stage.weights else 0)
            # a tied head multiplies by a view of the embedding rows the member holds, if its rows are among them
            within = held.start <= head_rows.start and head_rows.stop <= held.stop
            stage.head_weight = src if within else stage._cut_head(gguf, src)
        return stage

    def _hold_embedding_rows(self, gguf, rows: range) -> None:
        """Hold only `rows` of token_embd, and a zero row after them: a token this member does not
        hold reads zeros (Stage.token_ids), so the members' embeddings summed are each token's row
        (x + 0 is x: the same bits as one member holding it whole)."""
        name = "token_embd.weight"
        src = gguf.tensor(name)
        self.weights[name] = self.own_ctx.new_tensor(src.type, [src.ne[0], len(rows) + 1], name)
        self.cuts[name] = RowRange(name, rows.start * src.nb[1], rows.stop * src.nb[1], zero_bytes=src.nb[1])
        self.embd_rows, self.held_rows[name] = rows, rows.start

    @classmethod
    def head_share(cls, arch, hp, gguf, head_rows: range) -> "Stage":
        """No layers, only rows of the output head, as a tensor of their own:
        the share the coordinator computes itself (head_placement.py, "here")."""
        stage = cls(-1, arch, hp, range(0), False, False, {}, StageKV(hp, range(0), 1), head_rows)
        stage.head_weight = stage._cut_head(gguf, head_source(gguf.tensors))
        return stage

    def _cut_head(self, gguf, src_name: str) -> str:
        """Hold only this stage's rows of the head weight, as a tensor of their own."""
        src = gguf.tensor(src_name)
        rows = self.head_rows
        if self.own_ctx is None:
            self.own_ctx = Context(1)
        name = f"{src_name}[{rows.start}:{rows.stop}]"
        self.weights[name] = self.own_ctx.new_tensor(src.type, [src.ne[0], len(rows)], name)
        self.cuts[name] = RowRange(src_name, rows.start * src.nb[1], rows.stop * src.nb[1])
        self.held_rows[name] = rows.start
        return name

    def bytes_of(self, name: str) -> tuple:
        """Which bytes of the GGUF file weight `name` holds, as a key: the tensor's name, and for a
        part of it (a member's shard, a stage's rows of the head) which part: members' shards of one
        weight share its name and size (the tensor cache's look-ups tell them apart by this)."""
        cut = self.cuts.get(name)
        if cut is None:
            return (name,)
        if isinstance(cut, RowRange):
            return (cut.source, "bytes", cut.start, cut.stop) + ((cut.zero_bytes,) if cut.zero_bytes else ())
        return (name, "cut", cut.dim, cut.ranges)

    def weight_data(self, gguf, name: str) -> memoryview:
        """The bytes of weight `name`, straight from the GGUF file's memory map."""
        cut = self.cuts.get(name)
        if cut is None:
            return gguf.tensor_data(name)
        if isinstance(cut, RowRange) and cut.zero_bytes:
            return memoryview(bytes(gguf.tensor_data(cut.source)[cut.start:cut.stop]) + bytes(cut.zero_bytes))
        if isinstance(cut, RowRange):
            return gguf.tensor_data(cut.source)[cut.start:cut.stop]
        from coordinator.model.tensor_split import cut_bytes  # a tensor-parallel shard's part of it
        src = gguf.tensor(name)
        return memoryview(cut_bytes(gguf.tensor_data(name), src.type, [int(src.ne[i]) for i in range(4)], cut))

    def head_here(self, shape: StepShape) -> bool:
        """This stage's layer graph ends in the whole output head (else the
        hidden state, or with the head split the normed rows for the shards)."""
        return self.last and not shape.normed and (self.head_rows is None or
                                                   (shape.head_on_last and self.holds_whole_head))

    def member_head(self, shape: StepShape) -> bool:
        """A tensor-parallel member of the last group: its step graph ends in its rows of the head."""
        return self.shard is not None and self.last and not shape.normed

    # ------------------------------------------------------------ the reply's layout
    # Outputs come back concatenated in BuiltGraph.outputs' order: argmax_first's
    # token (i32) and maximum, then finite_probe (f32), one value per output row;
    # with shape.argmax = k > 1 then best_tokens' k ids (i32) and k logits per row.
    @staticmethod
    def best_k(shape: StepShape, rows: int) -> int:
        """How many best tokens per row a head of `rows` rows returns (0: the argmax alone)."""
        return min(shape.argmax, rows) if shape.argmax > 1 else 0

    def output_size(self, shape: StepShape, head: bool = False) -> int:
        if head or self.member_head(shape):  # a last group member's step ends in its head rows
            # argmax: each row's best token in this shard, its logit (to compare shards) and the row's finiteness probe
            rows = len(self.head_rows)
            return (3 + 2 * self.best_k(shape, rows) if shape.argmax else rows) * shape.n_outputs * 4
        if self.head_here(shape):  # argmax: token and finiteness probe
            rows = self.hp.n_vocab
            return (2 + 2 * self.best_k(shape, rows) if shape.argmax else rows) * shape.n_outputs * 4
        if self.last:
            return self.hp.n_embd * shape.n_outputs * 4
        return self.hp.n_embd * shape.n_tokens * 4

    def read_output(self, data: bytes, shape: StepShape, head: bool = False) -> StageOutput:
        """The arrays in a reply of output_size(shape, head) bytes."""
        n_out = shape.n_outputs
        head = head or self.member_head(shape)
        if head and shape.argmax:  # argmax_first: token, its logit, the row's finiteness probe
            return StageOutput(tokens=np.frombuffer(data, np.int32, n_out),
                               best=np.frombuffer(data, np.float32, n_out, n_out * 4),
                               probes=np.frombuffer(data, np.float32, n_out, 2 * n_out * 4),
                               **_best_of(data, 3 * n_out * 4, n_out, self.best_k(shape, len(self.head_rows))))
        if head:
            return StageOutput(logits=np.frombuffer(data, np.float32).reshape(n_out, len(self.head_rows)))
        if self.head_here(shape) and shape.argmax:  # the argmax token and the row's finiteness probe
            return StageOutput(tokens=np.frombuffer(data, np.int32, n_out),
                               probes=np.frombuffer(data, np.float32, n_out, n_out * 4),
                               **_best_of(data, 2 * n_out * 4, n_out, self.best_k(shape, self.hp.n_vocab)))
        if self.head_here(shape):
            return StageOutput(logits=np.frombuffer(data, np.float32).reshape(n_out, self.hp.n_vocab))
        return StageOutput(hidden=np.frombuffer(data, np.float32))

    def graph(self, shape: StepShape, head: bool = False, dot_type_inputs: bool = False,
              concat: bool = False) -> tuple[BuiltGraph, list]:
        """The step graph for `shape` (its head graph if `head`) and the graphs
        evicted to make room for it. `dot_type_inputs`: where it runs takes matmul
        inputs converted to the weights' dot type (GraphBuilder.shared_inputs);
        `concat`: it takes CONCAT (GraphBuilder.product)."""
        if head:
            key = ("head", shape.n_outputs, shape.argmax)
        else:
            whole = self.head_here(shape)
            key = (shape.n_tokens, shape.n_kv, shape.n_outputs, shape.argmax if whole or self.shard is not None else 0,
                   whole, shape.normed, dot_type_inputs, concat)
        evicted = []
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            return g, evicted
        g = self._build_head(shape) if head else self._build(shape, dot_type_inputs, concat)
        self.graphs[key] = g
        while len(self.graphs) > MAX_CACHED_GRAPHS:
            evicted.append(self.graphs.popitem(last=False)[1])
        return g, evicted

    def _new_id(self) -> int:
        graph_id = self._next_graph_id
        self._next_graph_id += 1
        return graph_id

    def _build(self, shape: StepShape, dot_type_inputs: bool = False, concat: bool = False) -> BuiltGraph:
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
        b.dot_type_inputs, b.concat = dot_type_inputs, concat
        if self.shard is not None:
            b.exchanges = []
            b.embd_sharded = self.embd_rows is not None
            b.gather = self.gather
        if self.first:
            x = self.arch.embed(b, tokens)
        for il in self.layers:
            x = self.arch.layer(b, il, x, pos)
        if self.shard is not None and not self.last:  # a group before the last: the hidden state, alike on all
            return self._finish(ctx, gf, inputs, [x], b.exchanges, b.pieces)
        if self.shard is not None and shape.normed:  # every member holds the same normed rows
            return self._finish(ctx, gf, inputs, [b.final_norm(x)], b.exchanges, b.pieces)
        if self.shard is not None:  # every member holds the whole hidden state: its rows of the head from it
            logits = lib.ggml_mul_mat(ctx.ptr, self._head_rows_weight(ctx.ptr), b.final_norm(x))
            outputs = self._argmax_outputs(ctx.ptr, logits, shape, len(self.head_rows)) if shape.argmax else [logits]
            return self._finish(ctx, gf, inputs, outputs, b.exchanges, b.pieces)
        if self.head_here(shape):
            out = b.output_head(x)
            if shape.argmax:
                # greedy decoding needs one token id per row, not a megabyte of logits on the wire
                first, _, total = argmax_first(ctx.ptr, out)
                k = self.best_k(shape, hp.n_vocab)
                return self._finish(ctx, gf, inputs, [first, total, *(best_tokens(ctx.ptr, out, k) if k else ())])
        elif self.last:
            out = b.final_norm(x)  # the head shards, this stage's among them, take it from here
        else:
            out = x
        return self._finish(ctx, gf, inputs, [out])

    def _build_head(self, shape: StepShape) -> BuiltGraph:
        """This stage's shard of the output head: its vocabulary rows times the
        normalized rows that want logits; with argmax, each row's best token in
        the shard and that token's logit."""
        hp, rows, n_out = self.hp, self.head_rows, shape.n_outputs
        ctx = Context(32)
        c = ctx.ptr
        gf = ctx.new_graph()
        inputs = StepInputs()
        x = inputs.new(ctx, "head_in", F32, [hp.n_embd, n_out])
        logits = lib.ggml_mul_mat(c, self._head_rows_weight(c), x)
        if not shape.argmax:
            return self._finish(ctx, gf, inputs, [logits])
        return self._finish(ctx, gf, inputs, self._argmax_outputs(c, logits, shape, len(rows)))

    def _argmax_outputs(self, c, logits, shape: StepShape, rows: int) -> list:
        """A head shard's greedy outputs: argmax_first's, then best_tokens' if shape.argmax > 1."""
        k = self.best_k(shape, rows)
        return [*argmax_first(c, logits), *(best_tokens(c, logits, k) if k else ())]

    def _head_rows_weight(self, c):
        """This stage's rows of the head weight: its own cut, or a view of the rows it holds."""
        w, rows = self.weights[self.head_weight], self.head_rows
        first = self.held_rows.get(self.head_weight, 0)  # the GGUF row its row 0 is
        if (first, w.ne[1]) != (rows.start, len(rows)):
            w = lib.ggml_view_2d(c, w, w.ne[0], len(rows), w.nb[1], (rows.start - first) * w.nb[1])
        return w

    def token_ids(self, tokens) -> np.ndarray:
        """The first stage's "tokens" input: the ids, or on a member holding some rows of the
        embedding (`embd_rows`) each id's row there, and its zero row for the ids it does not hold."""
        ids = np.asarray(tokens, dtype=np.int32)
        rows = self.embd_rows
        if rows is None:
            return ids
        held = (ids >= rows.start) & (ids < rows.stop)
        return np.where(held, ids - rows.start, len(rows)).astype(np.int32)

    def _finish(self, ctx, gf, inputs: StepInputs, outputs: list, exchanges=(), pieces=None) -> BuiltGraph:
        for out in outputs:
            lib.ggml_set_output(out)
            lib.ggml_build_forward_expand(gf, out)
        return BuiltGraph(ctx, gf, inputs.tensors, outputs, self._new_id(), exchanges=list(exchanges),
                          pieces=list(pieces or [None] * len(exchanges)))


def _best_of(data: bytes, offset: int, n_out: int, k: int) -> dict:
    """best_tokens' ids and logits in a reply from `offset` on (none when k is 0)."""
    if not k:
        return {}
    return {"best_ids": np.frombuffer(data, np.int32, n_out * k, offset).reshape(n_out, k),
            "best_values": np.frombuffer(data, np.float32, n_out * k, offset + n_out * k * 4).reshape(n_out, k)}
