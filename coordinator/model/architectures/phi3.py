"""phi3 (Phi-3, Phi-3.5 mini, Phi-4 mini): one fused QKV product (attn_qkv) and one
fused gate-up product (ffn_up: the gate's half first) with SwiGLU, NEOX RoPE, Q scaled
before attention. Long-context models carry LongRoPE factors: rope_factors_short, or
rope_factors_long when the context is longer than rope.scaling.original_context_length
(llama.cpp's choice by context size), and rope.scaling.attn_factor.

As llama.cpp does, a sliding window in the GGUF is ignored (full attention: llama.cpp
disabled Phi-3's SWA). Not supported, refused at load: MoE layers (that is phimoe),
biases, and partial rotary dims together with LongRoPE factors.
"""
from __future__ import annotations

import math

from ggml_ffi import lib
from coordinator.model.architectures.common import ROPE_NEOX, GraphBuilder, HParams, check_tensors, standard_hparams
from coordinator.model.architectures.common import embed  # noqa: F401 (this module's embed)

# the chat template when the GGUF carries none (tokenizer.chat_template)
FALLBACK_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                          "<|assistant|>\n")

SEPARATE_QKV = ("attn_q.weight", "attn_k.weight", "attn_v.weight")  # llama.cpp takes these instead of attn_qkv
LAYER_TENSORS = {f"{n}.weight" for n in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")}
LAYER_TENSORS |= set(SEPARATE_QKV)
FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
OPTIONAL = {"output.weight", "attn_qkv.weight", *SEPARATE_QKV, *FACTORS}
GLOBAL_TENSORS = {"token_embd.weight", "output_norm.weight", "output.weight", *FACTORS}


def extra_weights(tensors) -> list[str]:
    """Weights every stage holds besides its layers': the LongRoPE factors."""
    return [n for n in FACTORS if n in tensors]


def hparams(g) -> HParams:
    check_tensors(g, "phi3", LAYER_TENSORS, GLOBAL_TENSORS, OPTIONAL)
    hp = standard_hparams(g, "phi3", ROPE_NEOX, scaling_types=("none", "linear", "longrope"))
    for il in range(hp.n_layer):
        if f"blk.{il}.attn_qkv.weight" not in g.tensors:
            for n in SEPARATE_QKV:
                g.tensor(f"blk.{il}.{n}")  # names the one missing
    if hp.n_rot != hp.head_dim and any(n in g.tensors for n in FACTORS):
        # ggml's RoPE reads a factor for every pair of the head, the GGUF has n_rot / 2
        raise ValueError("phi3: partial rotary dims with LongRoPE factors are not supported")
    return hp


def layer(b: GraphBuilder, il: int, x, pos):
    c, p, hp = b.c, f"blk.{il}.", b.hp
    long = b.kv.n_ctx > (hp.n_ctx_orig or hp.n_ctx_train)
    factors = b.w.get(FACTORS[1] if long else FACTORS[0])
    q, k, v = b.qkv(il, b.norm(x, b.w[p + "attn_norm.weight"]))  # views of the fused product
    q = lib.ggml_scale(c, b.rope(q, pos, il, factors), 1.0 / math.sqrt(hp.head_dim))
    cur = b.attention(il, q, b.rope(k, pos, il, factors), v, 1.0)
    ffn_in = b.attn_residual(il, cur, x)
    cur = b.fused_ffn(il, b.norm(ffn_in, b.w[p + "ffn_norm.weight"]))
    return lib.ggml_add(c, cur, ffn_in)
