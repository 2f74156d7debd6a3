"""Blocks shared by the architectures, and the per-step graph inputs.

A stage graph computes a contiguous range of layers. Everything that changes
from one decode step to the next (tokens, positions, KV write rows, masks,
which rows want logits) is an input tensor, so a step with the same shape reuses
the graph the worker already holds and sends only those inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ggml_ffi import NULL, lib, type_traits
from rpc_daemon.wire.graph_limits import DOT_TYPES, WEIGHT_TYPES  # what the workers' matmul and get_rows accept

F32, F16, I32, I64 = lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_I32, lib.GGML_TYPE_I64
# ggml's tiled K-quant kernel reads a weight from memory much slower when its rows are an odd
# number (5 or more) of 256-element blocks apart than an even number, in products of a few to a
# hundred rows of x (2-core EPYC VM, 2048 rows x 2816 columns, the same bits out): Q4_K 2.0x at
# 8-16 rows, 1.6x at 32, 1.2x at 64 and 128, none at 256; Q5_K 1.4x at 8-16, 1.15x at 32, none
# from 64; Q6_K 1.1x at 8-16, none from 32; rows 5 blocks apart (Q4_K) 1.8x at 16, 1.1x at 64;
# 3 apart, none (pairs lose). Below 8 rows ggml takes its other kernel, which does not mind.
# GraphBuilder.product then multiplies by the even rows and by the odd rows (views two rows apart)
# and interleaves the results (CONCAT): per type, the rows of x for which it does.
PAIRED_ROWS = {lib.GGML_TYPE_Q4_K: range(8, 129), lib.GGML_TYPE_Q5_K: range(8, 33), lib.GGML_TYPE_Q6_K: range(8, 17)}
ROPE_NORMAL, ROPE_NEOX = 0, 2
# From this many rows on, an input that several quantized products share is converted to their dot
# type once (GraphBuilder.shared_inputs); below, the extra node costs about what it saves.
SHARED_INPUT_MIN_ROWS = 4


@dataclass
class HParams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rms_eps: float
    rope_type: int
    rope_base: float
    rope_scale: float = 1.0
    n_ctx_train: int = 4096
    # YaRN's extrapolation mix (1.0 with rope.scaling.type "yarn", else 0) and the factor
    # RoPE multiplies cos/sin by (rope.scaling.attn_factor: Phi-3's LongRoPE); as llama.cpp
    rope_ext_factor: float = 0.0
    rope_attn_factor: float = 1.0
    n_ctx_orig: int = 0  # rope.scaling.original_context_length (YaRN, LongRoPE), else n_ctx_train
    # mixture of experts (qwen3moe): experts per layer, experts each token uses, and the factor
    # the chosen experts' weights are scaled by after normalizing them (0: none)
    n_expert: int = 0
    n_expert_used: int = 0
    expert_weights_scale: float = 0.0
    # gemma3
    n_swa: int = 0
    swa_pattern: int = 0
    rope_base_swa: float = 10000.0
    attn_scale: float = 0.0  # Q scaled by this before attention (gemma3)
    embd_scale: float = 0.0  # token embeddings scaled by this (gemma3)

    @property
    def n_embd_kv(self) -> int:
        return self.head_dim * self.n_head_kv

    def is_swa(self, il: int) -> bool:
        return self.n_swa > 0 and self.swa_pattern > 0 and il % self.swa_pattern < self.swa_pattern - 1


@dataclass
class StepShape:
    """What fixes a stage graph's structure; equal shapes reuse one graph."""
    n_tokens: int
    n_kv: int
    n_outputs: int
    # 0: the last stage returns each output row's logits; 1: its argmax token instead; k > 1: also its
    # k highest logits' token ids (best_tokens), for a sampler that bans a few tokens
    argmax: int = 0
    # the last stage computes the whole output head in its layer graph although the head is split
    # (coordinator/decode/head_placement.py chose it for this step); a stage without the whole head ignores it
    head_on_last: bool = False
    # the last stage returns the rows that want outputs normalized (output_norm), not through the head:
    # their embeddings (Coordinator.embed); no head round
    normed: bool = False

    @property
    def head_key(self) -> tuple:
        """What a head shard's compute time depends on: (n_outputs, argmax) (coordinator/decode/head_placement.py)."""
        return (self.n_outputs, self.argmax)


@dataclass
class StepInputs:
    """Input tensors of one stage graph; names are how the executors address them."""
    tensors: dict = field(default_factory=dict)

    def new(self, ctx, name: str, t: int, ne):
        x = ctx.new_tensor(t, ne, name)
        lib.ggml_set_input(x)
        self.tensors[name] = x
        return x


class GraphBuilder:
    """Holds the context of one stage graph and the blocks that build it."""

    def __init__(self, ctx, hp: HParams, weights, kv, shape: StepShape, inputs: StepInputs, gf):
        self.ctx, self.c = ctx, ctx.ptr
        self.hp, self.w, self.kv, self.shape, self.inputs, self.gf = hp, weights, kv, shape, inputs, gf
        self.outputs_only = False  # the rows past the last layer's attention are already the output rows
        # tensor-parallel shard (coordinator/model/tensor_split.py): the partial sums all_reduce marks,
        # summed over the group's members between the graph's segments; None: the whole layers here
        self.exchanges: list | None = None
        self.pieces: list = []  # per exchange: None (summed), or the members' lengths it gathers (exact sums)
        self.embd_sharded = False  # the shard holds some rows of token_embd: the embeddings are all-reduced too
        # exact sums (tensor_split.py): where this shard's part of each gathered tensor starts, its whole
        # length, and every member's part's length in rank order, for "attn" (the heads' outputs), "ffn"
        # (the FFN's hidden rows), "out" (a projection's rows)
        self.gather: dict[str, tuple[int, int, tuple]] | None = None
        # where the graph runs, MUL_MAT takes src1 already in its weights' dot type (a worker that offers
        # "dot_type_inputs", or this process): shared_inputs may convert an input once for several products
        self.dot_type_inputs = False
        # where the graph runs, CONCAT is taken (a worker that offers "concat", or this process): product
        # may multiply by a weight's even and odd rows apart
        self.concat = False

    # ---------------------------------------------------------------- blocks
    def shared_inputs(self, x, weights: list) -> list:
        """x as each of `weights`' products takes it. Each quantized matmul first converts
        its f32 input to its weights' dot type (q8_K for the K-quants); products that share
        x and a dot type (Q, K and V; gate and up) get x converted once instead (ggml_cast),
        with the same bits as each would have made: 5-7 % of a prompt's time in one process,
        more on a tensor-parallel member, which converts the whole x alone."""
        if not self.dot_type_inputs or x.ne[1] < SHARED_INPUT_MIN_ROWS:
            return [x] * len(weights)
        dots = [DOT_TYPES.get(w.type) for w in weights]
        converted = {d: lib.ggml_cast(self.c, x, d) for d in dict.fromkeys(dots)
                     if d is not None and dots.count(d) > 1}
        return [converted.get(d, x) for d in dots]

    def product(self, w, x):
        """w x (MUL_MAT, x 2-D), by the even and the odd rows of w apart where PAIRED_ROWS says
        that is faster: each output row is the same dot product, so the same bits. The two
        products take x converted to their dot type once (where the graph runs takes that),
        not each its own conversion of it."""
        rows = PAIRED_ROWS.get(w.type)
        n0, n1, n = w.ne[0], w.ne[1], x.ne[1]
        blocks = n0 // type_traits(w.type).blck_size if rows is not None else 0
        dot = DOT_TYPES.get(w.type)
        if (not self.concat or rows is None or n not in rows or x.type not in (F32, dot) or n1 % 2
                or blocks % 2 == 0 or blocks < 5 or w.ne[2] * w.ne[3] * x.ne[2] * x.ne[3] != 1):
            return lib.ggml_mul_mat(self.c, w, x)
        c, half = self.c, n1 // 2
        if self.dot_type_inputs and x.type == F32:
            x = lib.ggml_cast(c, x, dot)
        even, odd = (lib.ggml_reshape_3d(c, lib.ggml_mul_mat(c, lib.ggml_view_2d(c, w, n0, half, 2 * w.nb[1],
                                                                                  parity * w.nb[1]), x), 1, half, n)
                     for parity in (0, 1))
        return lib.ggml_reshape_2d(c, lib.ggml_concat(c, even, odd, 0), n1, n)

    def norm(self, x, weight):
        return lib.ggml_mul(self.c, lib.ggml_rms_norm(self.c, x, self.hp.rms_eps), weight)

    def rope(self, x, pos, il: int, factors=None):
        """RoPE over the first n_rot dims of each head; `factors` (llama 3's rope_freqs,
        Phi-3's LongRoPE factors) divide each dimension pair's frequency."""
        hp = self.hp
        swa = hp.is_swa(il)
        base = hp.rope_base_swa if swa else hp.rope_base
        scale = 1.0 if swa else hp.rope_scale
        return lib.ggml_rope_ext(self.c, x, pos, NULL if factors is None else factors, hp.n_rot, hp.rope_type,
                                 hp.n_ctx_orig or hp.n_ctx_train, base, scale, hp.rope_ext_factor,
                                 hp.rope_attn_factor, 32.0, 1.0)

    def attention(self, il: int, q, k, v, kq_scale: float):
        """Write this step's K and V into the layer's cache rows, then attend over
        the first n_kv cache rows with the step's mask (flash attention, f16 cache)."""
        c, hp, n_tokens, n_kv = self.c, self.hp, self.shape.n_tokens, self.shape.n_kv
        k_cache, v_cache = self.kv.layer(il)
        rows = self.inputs.tensors["kv_rows"]
        for cur, cache in ((k, k_cache), (v, v_cache)):
            cur2d = lib.ggml_view_2d(c, cur, hp.n_embd_kv, n_tokens, cur.nb[2], 0)
            lib.ggml_build_forward_expand(self.gf, lib.ggml_set_rows(c, cache, cur2d, rows))
        kk, vv = (self.cache_view(cache, n_kv) for cache in (k_cache, v_cache))
        qq = lib.ggml_permute(c, q, 0, 2, 1, 3)
        kk = lib.ggml_permute(c, kk, 0, 2, 1, 3)
        vv = lib.ggml_permute(c, vv, 0, 2, 1, 3)
        mask = self.inputs.tensors["mask_swa" if hp.is_swa(il) else "mask"]
        out = lib.ggml_flash_attn_ext(c, qq, kk, vv, mask, kq_scale, 0.0, 0.0)
        lib.ggml_flash_attn_ext_set_prec(out, lib.GGML_PREC_F32)
        return lib.ggml_reshape_2d(c, out, out.ne[0] * out.ne[1], out.ne[2] * out.ne[3])

    def cache_view(self, cache, n_kv: int):
        """The first n_kv rows of a layer's K or V cache as [head_dim, heads, n_kv], strided
        by that cache's own type (K and V may hold different types: -ctk, -ctv)."""
        hp = self.hp
        row = lib.ggml_row_size(cache.type, hp.head_dim)
        row_kv = lib.ggml_row_size(cache.type, hp.n_embd_kv)
        return lib.ggml_view_4d(self.c, cache, hp.head_dim, hp.n_head_kv, n_kv, 1, row, row_kv, row_kv * n_kv, 0)

    def output_rows_only(self, il: int, attn, x):
        """In the model's last layer, the projected attention output and the residual of
        the rows that want logits only, as llama.cpp does (inp_out_ids, after the output
        projection): the rest of the layer is per row, so no other row's work reaches a
        logit, and a prompt's FFN runs for its last row alone. Every row's K and V were
        written before. Elsewhere (attn, x) as they are."""
        rows = self.inputs.tensors.get("out_rows")
        if il != self.hp.n_layer - 1 or rows is None:
            return attn, x
        self.outputs_only = True
        return lib.ggml_get_rows(self.c, attn, rows), lib.ggml_get_rows(self.c, x, rows)

    def qkv(self, il: int, x):
        """Q, K, V as [head_dim, heads, n_tokens], with their biases where the layer has
        them (qwen2); from one fused attn_qkv product (phi3) as views of its Q, K, V rows."""
        c, hp, n = self.c, self.hp, self.shape.n_tokens
        p = f"blk.{il}."
        fused = self.w.get(p + "attn_qkv.weight")
        if fused is not None:
            qkv = self.product(fused, x)
            row = lib.ggml_row_size(qkv.type, hp.head_dim)
            q_bytes = lib.ggml_row_size(qkv.type, hp.head_dim * hp.n_head)
            kv_bytes = lib.ggml_row_size(qkv.type, hp.n_embd_kv)
            return (lib.ggml_view_3d(c, qkv, hp.head_dim, hp.n_head, n, row, qkv.nb[1], 0),
                    lib.ggml_view_3d(c, qkv, hp.head_dim, hp.n_head_kv, n, row, qkv.nb[1], q_bytes),
                    lib.ggml_view_3d(c, qkv, hp.head_dim, hp.n_head_kv, n, row, qkv.nb[1], q_bytes + kv_bytes))

        names = ("attn_q", "attn_k", "attn_v")
        weights = [self.w[p + name + ".weight"] for name in names]
        projected = []
        for name, w, x_in, n_head in zip(names, weights, self.shared_inputs(x, weights),
                                         (hp.n_head, hp.n_head_kv, hp.n_head_kv)):
            y = self.product(w, x_in)
            bias = self.w.get(p + name + ".bias")
            if bias is not None:
                y = lib.ggml_add(c, y, bias)
            projected.append(lib.ggml_reshape_3d(c, y, hp.head_dim, n_head, n))
        return tuple(projected)

    def qk_norm(self, il: int, q, k):
        """RMS norm over each head of Q and of K (one head_dim weight each: qwen3, gemma3)."""
        p = f"blk.{il}."
        return self.norm(q, self.w[p + "attn_q_norm.weight"]), self.norm(k, self.w[p + "attn_k_norm.weight"])

    def embedding(self, tokens):
        """The tokens' rows of token_embd. A tensor-parallel member holding some of its rows (and a
        zero row the others read: Stage.token_ids) all-reduces them: one more exchange a step, for
        an embedding that is no longer whole on every member (gemma3-270m's is 60 % of its bytes)."""
        rows = lib.ggml_get_rows(self.c, self.w["token_embd.weight"], tokens)
        return self.all_reduce(rows) if self.embd_sharded else rows

    def all_reduce(self, partial):
        """A shard's partial sum, summed over its group (after the output projections: the only
        places where a tensor-parallel layer's members need each other's work); else as it is."""
        if self.exchanges is not None:  # summed where it is computed: a product's interleaved rows in their CONCAT
            paired = partial.op == lib.GGML_OP_RESHAPE and partial.view_src.op == lib.GGML_OP_CONCAT
            self.exchanges.append(partial.view_src if paired else partial)
            self.pieces.append(None)
        return partial

    def gathered(self, part, what: str):
        """A shard's rows `part` of a tensor as the whole tensor on every member (exact sums): its
        rows padded with zeros, which a worker that gathers never computes (it sends its rows and
        puts each member's in place: tensor.gather) and an older one all-reduces (x + 0 is x).
        Either way the members' rows, bit for bit."""
        lo, whole, lengths = self.gather[what]
        padded = lib.ggml_pad_ext(self.c, lib.ggml_cont(self.c, part) if not lib.ggml_is_contiguous(part) else part,
                                  lo, whole - lo - part.ne[0], 0, 0, 0, 0, 0, 0)
        self.exchanges.append(padded)
        self.pieces.append(lengths)
        return padded

    def whole_input(self, x, what: str):
        """An output projection's input `x` as the shard multiplies it: its own part (split sums),
        or with exact sums the whole tensor gathered from the members."""
        return x if self.gather is None else self.gathered(x, what)

    def summed(self, cur):
        """An output projection's product over the group: its partial sums all-reduced, or with
        exact sums the shard's rows of it gathered."""
        return self.all_reduce(cur) if self.gather is None else self.gathered(cur, "out")

    def projected(self, w, x, what: str):
        """w x of an output projection whose sum a shard splits (whole_input, summed)."""
        return self.summed(self.product(w, self.whole_input(x, what)))

    def attn_output(self, il: int, attn, x):
        """The attention's output projection (summed over a shard's group) and the residual, of
        the output rows only in the last layer (output_rows_only: fewer rows to exchange)."""
        w = self.w[f"blk.{il}.attn_output.weight"]
        cur, x = self.output_rows_only(il, self.product(w, self.whole_input(attn, "attn")), x)
        return self.summed(cur), x

    def attn_residual(self, il: int, attn, x):
        """The attention's output projection plus the layer's input: the FFN's input."""
        cur, x = self.attn_output(il, attn, x)
        return lib.ggml_add(self.c, cur, x)

    def swiglu_residual(self, il: int, ffn_in):
        """The pre-norm SwiGLU FFN block plus its input: the layer's output."""
        cur = self.gated_ffn(il, self.norm(ffn_in, self.w[f"blk.{il}.ffn_norm.weight"]), lib.ggml_swiglu_split)
        return lib.ggml_add(self.c, cur, ffn_in)

    def gated_ffn(self, il: int, x, glu):
        p = f"blk.{il}."
        weights = [self.w[p + "ffn_gate.weight"], self.w[p + "ffn_up.weight"]]
        gate, up = (self.product(w, x_in) for w, x_in in zip(weights, self.shared_inputs(x, weights)))
        return self.projected(self.w[p + "ffn_down.weight"], glu(self.c, gate, up), "ffn")

    def moe_ffn(self, il: int, x):
        """Mixture of experts, as llama.cpp's build_moe_ffn with softmax gating: router logits
        (ffn_gate_inp) -> softmax -> the n_expert_used best experts per token (TOP_K) -> their
        probabilities, normalized to sum 1 (and scaled, if the GGUF says so) -> SwiGLU over
        the chosen experts' slices of the stacked ffn_{gate,up,down}_exps (MUL_MAT_ID) ->
        the experts' outputs weighted and summed. x: [n_embd, n_tokens]."""
        c, hp, p = self.c, self.hp, f"blk.{il}."
        n_embd, n_tokens, n_used = x.ne[0], x.ne[1], hp.n_expert_used
        probs = lib.ggml_soft_max(c, lib.ggml_mul_mat(c, self.w[p + "ffn_gate_inp.weight"], x))  # [n_expert, n_tokens]
        # TOP_K, not llama.cpp's argsort: the same experts, and the only ids the workers accept computed
        selected = lib.ggml_top_k(c, probs, n_used)  # i32 [n_used, n_tokens]
        weights = lib.ggml_get_rows(c, lib.ggml_reshape_3d(c, probs, 1, hp.n_expert, n_tokens), selected)
        weights = lib.ggml_reshape_2d(c, weights, n_used, n_tokens)
        weights = lib.ggml_div(c, weights, lib.ggml_sum_rows(c, weights))
        if hp.expert_weights_scale not in (0.0, 1.0):
            weights = lib.ggml_scale(c, weights, hp.expert_weights_scale)
        cur = lib.ggml_reshape_3d(c, x, n_embd, 1, n_tokens)
        up = lib.ggml_mul_mat_id(c, self.w[p + "ffn_up_exps.weight"], cur, selected)  # [n_ff, n_used, n_tokens]
        gate = lib.ggml_mul_mat_id(c, self.w[p + "ffn_gate_exps.weight"], cur, selected)
        experts = lib.ggml_mul_mat_id(c, self.w[p + "ffn_down_exps.weight"], lib.ggml_swiglu_split(c, gate, up),
                                      selected)  # [n_embd, n_used, n_tokens]
        experts = lib.ggml_mul(c, experts, lib.ggml_reshape_3d(c, weights, 1, n_used, n_tokens))
        out = None
        for i in range(n_used):  # summed in llama.cpp's order: the best expert first
            one = lib.ggml_view_2d(c, experts, n_embd, n_tokens, experts.nb[2], i * experts.nb[1])
            out = one if out is None else lib.ggml_add(c, out, one)
        return self.all_reduce(lib.ggml_cont(c, out) if n_used == 1 else out)

    def fused_ffn(self, il: int, x):
        """SwiGLU over one ffn_up product whose first half is the gate (phi3)."""
        p = f"blk.{il}."
        up = self.product(self.w[p + "ffn_up.weight"], x)
        return self.projected(self.w[p + "ffn_down.weight"], lib.ggml_swiglu(self.c, up), "ffn")

    def final_norm(self, x):
        """The rows that want logits, normalized: what the output head multiplies."""
        if not self.outputs_only:
            x = lib.ggml_get_rows(self.c, x, self.inputs.tensors["out_rows"])
        return self.norm(x, self.w["output_norm.weight"])

    def output_head(self, x):
        out = self.w.get("output.weight")
        if out is None:  # tied output embedding
            out = self.w["token_embd.weight"]
        return lib.ggml_mul_mat(self.c, out, self.final_norm(x))


def embed(b: GraphBuilder, tokens):
    """The token embedding rows (every architecture but gemma3's scaled ones)."""
    return b.embedding(tokens)


def no_extra_weights(tensors) -> list[str]:
    """extra_weights of an architecture whose stages hold only their layers' weights."""
    return []


# ChatML (Qwen): the chat template when the GGUF carries none
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                   "{% endfor %}<|im_start|>assistant\n")


def argmax_first(c, logits):
    """Each column's argmax with ties going to the lowest id, as numpy's argmax
    and llama.cpp's greedy sampler (ggml_argmax alone gives the highest), the
    column's maximum, and its finiteness probe (finite_probe: not finite where
    a logit is a NaN or infinite, which the coordinator refuses as it refuses
    such logits). ggml's TOP_K with k = 1 is
    that argmax in one pass: its partial sort over one element replaces its pick
    only by a strictly greater logit, so the first of equal maxima stays
    (test_greedy_head.py, and the "ties" head of test_head_shards_combine_as_one_head,
    hold it to that). The sgn/scale/arange chain it replaced made about 8 passes
    over the logits, 4 % of a member's compute in a greedy tensor-parallel step."""
    n, cols = logits.ne[0], logits.ne[1]
    first = lib.ggml_top_k(c, logits, 1)  # i32 [1, cols]: the same bytes as one id per column
    best = lib.ggml_get_rows(c, lib.ggml_reshape_3d(c, logits, 1, n, cols), first)
    return first, best, finite_probe(c, logits)


PROBE_MAX_SPAN, PROBE_MIN_SPAN = 1024, 64  # finite_probe's dot products: the longest, and the shortest worth one


def finite_probe(c, logits):
    """f32 [1, cols]: 0 where a column of `logits` (f32 [n, cols], contiguous) is finite
    throughout, NaN where it is not (0 x inf and 0 x NaN are NaN, and so is any sum they
    enter). It is the products of the logits, in spans of d (the longest divisor of n up to
    PROBE_MAX_SPAN), with zeros made from the first span (logit - logit: zeros where those
    are finite, NaN where not: one there makes every column's probe NaN, and the step is
    refused all the same), then each column's n / d products summed. ggml's SUM_ROWS over
    the whole column, which it replaces, adds one float at a time in double precision on
    one thread: over gemma3-270m's 262,144 logits 0.6 ms a row, 4 % of an 8-slot serving
    step; the products run on every thread, 16 floats at a time (12-24 us a row). Where n
    has no divisor from PROBE_MIN_SPAN on, that SUM_ROWS (also not finite where a logit is not)."""
    n, cols = logits.ne[0], logits.ne[1]
    d = next((k for k in range(min(n, PROBE_MAX_SPAN), PROBE_MIN_SPAN - 1, -1) if n % k == 0), None)
    if d is None:
        return lib.ggml_sum_rows(c, logits)
    first = lib.ggml_view_1d(c, logits, d, 0)
    zeros = lib.ggml_sub(c, first, first)  # f32 [d] (not a scale by 0: workers before ef2a3c7 refuse its empty params)
    spans = lib.ggml_mul_mat(c, zeros, lib.ggml_reshape_2d(c, logits, d, n // d * cols))  # f32 [1, n / d * cols]
    return lib.ggml_sum_rows(c, lib.ggml_reshape_2d(c, spans, n // d, cols))


def best_tokens(c, logits, k: int):
    """Each column's k highest logits, in no particular order: their row ids
    (i32 [k, cols]) and values (f32 [1, k, cols]). With the argmax, what a
    greedy sampler that bans up to k - 1 tokens (ignore_eos, a -inf logit_bias)
    needs instead of a megabyte of logits: the best token it allows is among them."""
    n, cols = logits.ne[0], logits.ne[1]
    ids = lib.ggml_top_k(c, logits, k)
    return ids, lib.ggml_get_rows(c, lib.ggml_reshape_3d(c, logits, 1, n, cols), ids)


def head_source(tensors) -> str:
    """The GGUF tensor the output head multiplies by (gemma ties it to the embedding)."""
    return "output.weight" if "output.weight" in tensors else "token_embd.weight"


def default_attn_scale(hp: HParams) -> float:
    return 1.0 / math.sqrt(hp.head_dim)


def standard_hparams(g, arch: str, rope_type: int, rms_eps: float = 1e-5,
                     scaling_types=("none", "linear", "yarn"), **overrides) -> HParams:
    """HParams from the GGUF keys every llama-like architecture shares (`arch`.block_count,
    .attention.head_count, .rope.*, ...); `scaling_types`: the rope.scaling.types it
    computes; `overrides` sets fields an architecture fixes."""
    n_embd, n_head = g.require(f"{arch}.embedding_length"), g.require(f"{arch}.attention.head_count")
    if isinstance(n_head, list) or isinstance(g.get(f"{arch}.attention.head_count_kv"), list):
        raise ValueError(f"{arch}: a head count per layer is not supported")
    head_dim = g.get(f"{arch}.attention.key_length", n_embd // n_head)
    if g.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{arch}: attention.value_length different from key_length is not supported")
    fields = dict(
        arch=arch, n_vocab=g.tensor("token_embd.weight").ne[1], n_embd=n_embd,
        n_layer=g.require(f"{arch}.block_count"), n_ff=g.require(f"{arch}.feed_forward_length"),
        n_head=n_head, n_head_kv=g.get(f"{arch}.attention.head_count_kv", n_head), head_dim=head_dim,
        n_rot=g.get(f"{arch}.rope.dimension_count", head_dim),
        rms_eps=g.get(f"{arch}.attention.layer_norm_rms_epsilon", rms_eps), rope_type=rope_type,
        n_ctx_train=g.get(f"{arch}.context_length", 4096), **rope_hparams(g, arch, scaling_types))
    fields.update(overrides)
    return HParams(**fields)


def rope_hparams(g, arch: str, scaling_types=("none", "linear", "yarn")) -> dict:
    """The RoPE fields of HParams from `arch`'s GGUF keys, as llama.cpp reads them for
    these architectures: rope.scaling.type none, linear (positions divided by
    rope.scaling.factor), yarn (YaRN's mix of interpolation and extrapolation; llama.cpp's
    own mscale cancels out: it divides by the same 1 + 0.1 ln(factor) the kernel multiplies
    by, and it ignores the GGUF's yarn_* keys for them), or longrope where the architecture
    allows it (phi3: its factors are tensors); rope.scaling.attn_factor multiplies cos and
    sin. Any other type is refused here."""
    kind = g.get(f"{arch}.rope.scaling.type", "linear")
    if kind not in scaling_types:
        raise ValueError(f"{arch}: rope.scaling.type {kind!r} is not supported (supported: {', '.join(scaling_types)})")
    factor = g.get(f"{arch}.rope.scaling.factor") or g.get(f"{arch}.rope.scale_linear") or 0.0
    return {"rope_base": g.get(f"{arch}.rope.freq_base", 10000.0),
            "rope_scale": 1.0 / factor if factor and kind != "none" else 1.0,
            "rope_ext_factor": 1.0 if kind == "yarn" else 0.0,
            "rope_attn_factor": g.get(f"{arch}.rope.scaling.attn_factor", 1.0),
            "n_ctx_orig": g.get(f"{arch}.rope.scaling.original_context_length", 0) or 0}


def check_tensors(g, arch: str, layer_tensors, global_tensors, optional=frozenset()) -> None:
    """Refuse, with a message naming it, a GGUF this architecture's graph cannot compute as
    it is: a tensor the graph would ignore (a variant it does not compute: a MoE FFN, an
    output bias, ...) or one it needs and the file lacks. `layer_tensors`: names after
    "blk.N."; `global_tensors`: the other names; `optional`: those of either that may be
    absent."""
    n_layer = g.require(f"{arch}.block_count")
    unknown = []
    for name in g.tensors:
        parts = name.split(".", 2)
        in_layer = parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < n_layer
        if not ((in_layer and parts[2] in layer_tensors) or name in global_tensors):
            unknown.append(name)
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ValueError(f"{arch}: this variant is not supported: tensor(s) {shown} have no place in the {arch} "
                         f"graph (it uses {', '.join(sorted(layer_tensors))} per layer)")
    required = [n for n in global_tensors if n not in optional]
    required += [f"blk.{il}.{n}" for il in range(n_layer) for n in sorted(layer_tensors) if n not in optional]
    odd = [n for n, t in g.tensors.items() if t.type not in WEIGHT_TYPES]
    if odd:
        # (a GGUF's tensor types are live ggml types: gguf_init_from_file refuses others)
        raise ValueError(f"{arch}: tensor {odd[0]!r} is {type_traits(g.tensors[odd[0]].type).name}, a type the "
                         f"workers do not compute (supported: {', '.join(type_traits(t).name for t in WEIGHT_TYPES)})")
    missing = [n for n in required if n not in g.tensors]
    if missing:
        raise ValueError(f"{arch}: tensor {missing[0]!r} is missing" +
                         (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
