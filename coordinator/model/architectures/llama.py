"""llama: RMSNorm, GQA attention with RoPE (NORMAL), SwiGLU FFN.

Also Llama 2/3/3.1/3.2, Mistral (dense), SmolLM, TinyLlama and others that convert to
this architecture. Llama 3.1+ carries `rope_freqs` (llama3 RoPE scaling: a frequency
divisor per dimension pair), applied as ggml_rope_ext's freq_factors in every layer.
"""
from __future__ import annotations

import math

from coordinator.model.architectures.common import ROPE_NORMAL, GraphBuilder, HParams, check_tensors, standard_hparams
from coordinator.model.architectures.common import embed  # noqa: F401 (this module's embed)


# the chat template when the GGUF carries none (tokenizer.chat_template)
FALLBACK_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                          "[assistant] ")

LAYER_TENSORS = {f"{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                                         "ffn_gate", "ffn_up", "ffn_down")}
OPTIONAL = {"output.weight", "rope_freqs.weight"}
GLOBAL_TENSORS = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}


def extra_weights(tensors) -> list[str]:
    """Weights every stage holds besides its layers': llama 3.x's RoPE frequency factors."""
    return ["rope_freqs.weight"] if "rope_freqs.weight" in tensors else []


def hparams(g) -> HParams:
    if g.get("llama.expert_count", 0):
        raise ValueError("llama with experts (Mixtral-style MoE) is not supported")
    check_tensors(g, "llama", LAYER_TENSORS, GLOBAL_TENSORS, OPTIONAL)
    hp = standard_hparams(g, "llama", ROPE_NORMAL)
    if hp.n_rot != hp.head_dim:  # llama.cpp refuses it too ("invalid n_rot")
        raise ValueError(f"llama: rope.dimension_count {hp.n_rot} must equal the head size {hp.head_dim}")
    return hp


def layer(b: GraphBuilder, il: int, x, pos):
    q, k, v = b.qkv(il, b.norm(x, b.w[f"blk.{il}.attn_norm.weight"]))
    factors = b.w.get("rope_freqs.weight")
    q, k = b.rope(q, pos, il, factors), b.rope(k, pos, il, factors)
    cur = b.attention(il, q, k, v, 1.0 / math.sqrt(b.hp.head_dim))
    return b.swiglu_residual(il, b.attn_residual(il, cur, x))
