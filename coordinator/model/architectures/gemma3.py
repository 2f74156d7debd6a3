"""gemma3: llama's blocks plus scaled embeddings, Q/K norms, post-attention and
post-FFN norms, GELU-gated FFN, and sliding-window layers (every
`swa_pattern`-th layer is global) with their own RoPE base. The GGUF's norm
weights already include gemma's +1, and the output embedding is tied."""
from __future__ import annotations

import math

from ggml_ffi import lib
from coordinator.model.architectures.common import ROPE_NEOX, GraphBuilder, HParams, check_tensors, no_extra_weights


# the chat template when the GGUF carries none (tokenizer.chat_template)
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "{% if m['role'] == 'system' %}<start_of_turn>user\n{{ m['content'] }}\n"
    "{% else %}{% if not (loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'system') %}"
    "<start_of_turn>{{ role }}\n{% endif %}{{ m['content'] }}<end_of_turn>\n{% endif %}"
    "{% endfor %}<start_of_turn>model\n")

extra_weights = no_extra_weights
LAYER_TENSORS = {f"{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                                         "attn_k_norm", "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up",
                                         "ffn_down", "post_ffw_norm")}
OPTIONAL = {"output.weight"}
GLOBAL_TENSORS = {"token_embd.weight", "output_norm.weight", "output.weight"}


def hparams(g) -> HParams:
    check_tensors(g, "gemma3", LAYER_TENSORS, GLOBAL_TENSORS, OPTIONAL)
    n_embd, n_head = g.require("gemma3.embedding_length"), g.require("gemma3.attention.head_count")
    head_dim = g.get("gemma3.attention.key_length", n_embd // n_head)
    n_layer = g.require("gemma3.block_count")
    factor = g.get("gemma3.rope.scaling.factor")
    n_swa = g.get("gemma3.attention.sliding_window", 0) or 0
    # llama.cpp: 1/sqrt(head_dim), except the 27B (62 layers) scales by n_embd/n_head
    attn_scale = 1.0 / math.sqrt(n_embd / n_head if n_layer == 62 else head_dim)
    return HParams(
        arch="gemma3", n_vocab=g.tensor("token_embd.weight").ne[1], n_embd=n_embd, n_layer=n_layer,
        n_ff=g.require("gemma3.feed_forward_length"), n_head=n_head,
        n_head_kv=g.get("gemma3.attention.head_count_kv", n_head), head_dim=head_dim,
        n_rot=g.get("gemma3.rope.dimension_count", head_dim),
        rms_eps=g.get("gemma3.attention.layer_norm_rms_epsilon", 1e-6), rope_type=ROPE_NEOX,
        rope_base=g.get("gemma3.rope.freq_base", 1e6), rope_scale=1.0 / factor if factor else 1.0,
        n_ctx_train=g.get("gemma3.context_length", 32768), n_swa=n_swa,
        swa_pattern=g.get("gemma3.attention.sliding_window_pattern", 6) if n_swa else 0,
        rope_base_swa=g.get("gemma3.rope.freq_base_swa", 10000.0),
        attn_scale=attn_scale, embd_scale=math.sqrt(n_embd))


def embed(b: GraphBuilder, tokens):
    return lib.ggml_scale(b.c, b.embedding(tokens), b.hp.embd_scale)


def layer(b: GraphBuilder, il: int, x, pos):
    c, p = b.c, f"blk.{il}."
    cur = b.norm(x, b.w[p + "attn_norm.weight"])
    q, k, v = b.qkv(il, cur)
    q, k = b.qk_norm(il, q, k)
    q, k = lib.ggml_scale(c, b.rope(q, pos, il), b.hp.attn_scale), b.rope(k, pos, il)
    cur = b.attention(il, q, k, v, 1.0)
    cur, x = b.attn_output(il, cur, x)
    cur = b.norm(cur, b.w[p + "post_attention_norm.weight"])
    attn_out = lib.ggml_add(c, cur, x)
    cur = b.gated_ffn(il, b.norm(attn_out, b.w[p + "ffn_norm.weight"]), lib.ggml_geglu_split)
    cur = b.norm(cur, b.w[p + "post_ffw_norm.weight"])
    return lib.ggml_add(c, cur, attn_out)
