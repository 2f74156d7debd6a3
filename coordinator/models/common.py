"""Blocks shared by the architectures, and the per-step graph inputs.

A stage graph computes a contiguous range of layers. Everything that changes
from one decode step to the next (tokens, positions, KV write rows, masks,
which rows want logits) is an input tensor, so a step with the same shape reuses
the graph the worker already holds and sends only those inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ggml_ffi import NULL, lib

F32, F16, I32, I64 = lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_I32, lib.GGML_TYPE_I64
ROPE_NORMAL, ROPE_NEOX = 0, 2


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
    argmax: bool = False  # the last stage returns each output row's argmax token, not its logits


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

    # ---------------------------------------------------------------- blocks
    def norm(self, x, weight):
        return lib.ggml_mul(self.c, lib.ggml_rms_norm(self.c, x, self.hp.rms_eps), weight)

    def rope(self, x, pos, il: int):
        hp = self.hp
        swa = hp.is_swa(il)
        base = hp.rope_base_swa if swa else hp.rope_base
        scale = 1.0 if swa else hp.rope_scale
        factors = self.w.get("rope_freqs.weight")  # only where the architecture asks for it (extra_weights)
        return lib.ggml_rope_ext(self.c, x, pos, factors if factors is not None else NULL, hp.n_rot, hp.rope_type, hp.n_ctx_train,
                                 base, scale, 0.0, 1.0, 32.0, 1.0)

    def attention(self, il: int, q, k, v, kq_scale: float):
        """Write this step's K and V into the layer's cache rows, then attend over
        the first n_kv cache rows with the step's mask (flash attention, f16 cache)."""
        c, hp, n_tokens, n_kv = self.c, self.hp, self.shape.n_tokens, self.shape.n_kv
        k_cache, v_cache = self.kv.layer(il)
        rows = self.inputs.tensors["kv_rows"]
        for cur, cache in ((k, k_cache), (v, v_cache)):
            cur2d = lib.ggml_view_2d(c, cur, hp.n_embd_kv, n_tokens, cur.nb[2], 0)
            lib.ggml_build_forward_expand(self.gf, lib.ggml_set_rows(c, cache, cur2d, rows))
        row = lib.ggml_row_size(k_cache.type, hp.head_dim)
        row_kv = lib.ggml_row_size(k_cache.type, hp.n_embd_kv)
        kk = lib.ggml_view_4d(c, k_cache, hp.head_dim, hp.n_head_kv, n_kv, 1, row, row_kv, row_kv * n_kv, 0)
        vv = lib.ggml_view_4d(c, v_cache, hp.head_dim, hp.n_head_kv, n_kv, 1, row, row_kv, row_kv * n_kv, 0)
        qq = lib.ggml_permute(c, q, 0, 2, 1, 3)
        kk = lib.ggml_permute(c, kk, 0, 2, 1, 3)
        vv = lib.ggml_permute(c, vv, 0, 2, 1, 3)
        mask = self.inputs.tensors["mask_swa" if hp.is_swa(il) else "mask"]
        out = lib.ggml_flash_attn_ext(c, qq, kk, vv, mask, kq_scale, 0.0, 0.0)
        lib.ggml_flash_attn_ext_set_prec(out, lib.GGML_PREC_F32)
        return lib.ggml_reshape_2d(c, out, out.ne[0] * out.ne[1], out.ne[2] * out.ne[3])

    def qkv(self, il: int, x):
        c, hp, n = self.c, self.hp, self.shape.n_tokens
        p = f"blk.{il}."
        q = lib.ggml_reshape_3d(c, lib.ggml_mul_mat(c, self.w[p + "attn_q.weight"], x), hp.head_dim, hp.n_head, n)
        k = lib.ggml_reshape_3d(c, lib.ggml_mul_mat(c, self.w[p + "attn_k.weight"], x), hp.head_dim, hp.n_head_kv, n)
        v = lib.ggml_reshape_3d(c, lib.ggml_mul_mat(c, self.w[p + "attn_v.weight"], x), hp.head_dim, hp.n_head_kv, n)
        return q, k, v

    def gated_ffn(self, il: int, x, glu):
        p = f"blk.{il}."
        gate = lib.ggml_mul_mat(self.c, self.w[p + "ffn_gate.weight"], x)
        up = lib.ggml_mul_mat(self.c, self.w[p + "ffn_up.weight"], x)
        return lib.ggml_mul_mat(self.c, self.w[p + "ffn_down.weight"], glu(self.c, gate, up))

    def final_norm(self, x):
        """The rows that want logits, normalized: what the output head multiplies."""
        x = lib.ggml_get_rows(self.c, x, self.inputs.tensors["out_rows"])
        return self.norm(x, self.w["output_norm.weight"])

    def output_head(self, x):
        out = self.w.get("output.weight")
        if out is None:  # tied output embedding
            out = self.w["token_embd.weight"]
        return lib.ggml_mul_mat(self.c, out, self.final_norm(x))


def argmax_first(c, logits):
    """Each column's argmax with ties going to the lowest id, as numpy's argmax
    and llama.cpp's greedy sampler (ggml_argmax alone gives the highest), the
    column's maximum, and its sum (not finite: a NaN or infinite logit, which the
    coordinator refuses as it refuses such logits). Exact for finite logits:
    x - max is 0 only where x equals the max, so sgn(x - max) * n - id is above
    -n exactly there, highest at the first."""
    n, cols = logits.ne[0], logits.ne[1]
    last = lib.ggml_argmax(c, logits)
    # the maximum of column j is row last[j] of the [1, n] slice j: a get_rows per column
    best = lib.ggml_get_rows(c, lib.ggml_reshape_3d(c, logits, 1, n, cols), lib.ggml_reshape_2d(c, last, 1, cols))
    below = lib.ggml_sgn(c, lib.ggml_sub(c, logits, lib.ggml_reshape_2d(c, best, 1, cols)))  # -1 or 0
    score = lib.ggml_sub(c, lib.ggml_scale(c, below, float(n)), lib.ggml_arange(c, 0.0, float(n), 1.0))
    return lib.ggml_argmax(c, score), best, lib.ggml_sum_rows(c, logits)


def head_source(tensors) -> str:
    """The GGUF tensor the output head multiplies by (gemma ties it to the embedding)."""
    return "output.weight" if "output.weight" in tensors else "token_embd.weight"


def default_attn_scale(hp: HParams) -> float:
    return 1.0 / math.sqrt(hp.head_dim)
