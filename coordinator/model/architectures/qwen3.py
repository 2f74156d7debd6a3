"""qwen3 (Qwen 3 dense): llama's blocks plus an RMS norm over each head of Q and of K
(attn_q_norm, attn_k_norm: one weight of head_dim, shared by the heads) before RoPE,
NEOX RoPE, no biases; head_dim (attention.key_length) need not be n_embd / n_head."""
from __future__ import annotations

import math

from coordinator.model.architectures.common import ROPE_NEOX, GraphBuilder, HParams, check_tensors, standard_hparams
from coordinator.model.architectures.common import CHATML_TEMPLATE, embed, no_extra_weights  # noqa: F401 (this module's embed)

LAYER_TENSORS = {f"{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                                         "attn_k_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
OPTIONAL = {"output.weight"}
GLOBAL_TENSORS = {"token_embd.weight", "output_norm.weight", "output.weight"}
FALLBACK_CHAT_TEMPLATE = CHATML_TEMPLATE  # when the GGUF carries no tokenizer.chat_template
extra_weights = no_extra_weights


def hparams(g) -> HParams:
    check_tensors(g, "qwen3", LAYER_TENSORS, GLOBAL_TENSORS, OPTIONAL)
    return standard_hparams(g, "qwen3", ROPE_NEOX, rms_eps=1e-6)


def layer(b: GraphBuilder, il: int, x, pos):
    q, k, v = b.qkv(il, b.norm(x, b.w[f"blk.{il}.attn_norm.weight"]))
    q, k = b.qk_norm(il, q, k)
    cur = b.attention(il, b.rope(q, pos, il), b.rope(k, pos, il), v, 1.0 / math.sqrt(b.hp.head_dim))
    return b.swiglu_residual(il, b.attn_residual(il, cur, x))
