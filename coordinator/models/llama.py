"""llama: RMSNorm, GQA attention with RoPE (NORMAL), SwiGLU FFN."""
from __future__ import annotations

import math

from ggml_ffi import lib
from coordinator.models.common import ROPE_NORMAL, GraphBuilder, HParams


# the chat template when the GGUF carries none (tokenizer.chat_template)
FALLBACK_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                          "[assistant] ")


def extra_weights(tensors) -> list[str]:
    """Weights every stage holds besides its layers': llama 3.x's RoPE frequency factors."""
    return ["rope_freqs.weight"] if "rope_freqs.weight" in tensors else []


def hparams(g) -> HParams:
    n_embd, n_head = g.require("llama.embedding_length"), g.require("llama.attention.head_count")
    head_dim = g.get("llama.attention.key_length", n_embd // n_head)
    factor = g.get("llama.rope.scaling.factor")
    return HParams(
        arch="llama", n_vocab=g.tensor("token_embd.weight").ne[1], n_embd=n_embd,
        n_layer=g.require("llama.block_count"), n_ff=g.require("llama.feed_forward_length"),
        n_head=n_head, n_head_kv=g.get("llama.attention.head_count_kv", n_head), head_dim=head_dim,
        n_rot=g.get("llama.rope.dimension_count", head_dim),
        rms_eps=g.get("llama.attention.layer_norm_rms_epsilon", 1e-5), rope_type=ROPE_NORMAL,
        rope_base=g.get("llama.rope.freq_base", 10000.0), rope_scale=1.0 / factor if factor else 1.0,
        n_ctx_train=g.get("llama.context_length", 4096))


def embed(b: GraphBuilder, tokens):
    return lib.ggml_get_rows(b.c, b.w["token_embd.weight"], tokens)


def layer(b: GraphBuilder, il: int, x, pos):
    c, p = b.c, f"blk.{il}."
    cur = b.norm(x, b.w[p + "attn_norm.weight"])
    q, k, v = b.qkv(il, cur)
    q, k = b.rope(q, pos, il), b.rope(k, pos, il)
    cur = b.attention(il, q, k, v, 1.0 / math.sqrt(b.hp.head_dim))
    ffn_in = lib.ggml_add(c, lib.ggml_mul_mat(c, b.w[p + "attn_output.weight"], cur), x)
    cur = b.gated_ffn(il, b.norm(ffn_in, b.w[p + "ffn_norm.weight"]), lib.ggml_swiglu_split)
    return lib.ggml_add(c, cur, ffn_in)
