"""qwen2 (Qwen 2 / 2.5): llama's blocks with biases on Q, K and V, NEOX RoPE, and the
output head often tied to the token embedding (the small models)."""
from __future__ import annotations

import math

from coordinator.model.architectures.common import ROPE_NEOX, GraphBuilder, HParams, check_tensors, standard_hparams
from coordinator.model.architectures.common import CHATML_TEMPLATE, embed, no_extra_weights  # noqa: F401 (this module's embed)

FALLBACK_CHAT_TEMPLATE = CHATML_TEMPLATE  # when the GGUF carries no tokenizer.chat_template
extra_weights = no_extra_weights

LAYER_TENSORS = {f"{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                                         "ffn_gate", "ffn_up", "ffn_down")} | {
                 "attn_q.bias", "attn_k.bias", "attn_v.bias"}
OPTIONAL = {"output.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias"}
GLOBAL_TENSORS = {"token_embd.weight", "output_norm.weight", "output.weight"}


def hparams(g) -> HParams:
    check_tensors(g, "qwen2", LAYER_TENSORS, GLOBAL_TENSORS, OPTIONAL)
    return standard_hparams(g, "qwen2", ROPE_NEOX, rms_eps=1e-6)


def layer(b: GraphBuilder, il: int, x, pos):
    q, k, v = b.qkv(il, b.norm(x, b.w[f"blk.{il}.attn_norm.weight"]))  # the biases are added there
    cur = b.attention(il, b.rope(q, pos, il), b.rope(k, pos, il), v, 1.0 / math.sqrt(b.hp.head_dim))
    return b.swiglu_residual(il, b.attn_residual(il, cur, x))
