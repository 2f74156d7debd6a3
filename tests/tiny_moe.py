"""A tiny random-weight qwen3moe GGUF (tests/tiny_models.py's writer and blocks, plus
the mixture-of-experts FFN): 2 layers of qwen3 attention, each with 8 experts of which
a token uses 2, stacked as llama.cpp stores them (ffn_{gate,up,down}_exps: one
[n_in, n_out] matrix per expert, the expert in ggml's ne[2]). Deterministic from the seed.

The router is scaled up (std 1.0) so each token's choice of experts is clear-cut and
varies from token to token: ties between expert probabilities would leave the choice
to the last bits of the logits."""
from __future__ import annotations

import os

from tiny_models import MODELS, Dims, W, _attention, _common_metadata, _ends, bpe_vocab, write_gguf

N_EXPERT, N_EXPERT_USED, N_FF_EXP = 8, 2, 64


def _moe_ffn(p: str, d: Dims, kind: str) -> list[W]:
    return [W(p + "ffn_norm.weight", (d.n_embd,), 0.1, norm=True),
            W(p + "ffn_gate_inp.weight", (N_EXPERT, d.n_embd), 1.0),
            W(p + "ffn_gate_exps.weight", (N_EXPERT, N_FF_EXP, d.n_embd), 0.1, kind),
            W(p + "ffn_up_exps.weight", (N_EXPERT, N_FF_EXP, d.n_embd), 0.1, kind),
            W(p + "ffn_down_exps.weight", (N_EXPERT, d.n_embd, N_FF_EXP), 0.05, kind)]


def model_qwen3moe():
    """Qwen 3 MoE-style: qwen3's attention (per-head Q/K norms, head_dim 32 apart from
    n_embd / n_head), 8 experts, 2 used, BPE ("qwen2"), q8_0/f16/q4_0 experts."""
    d = Dims(n_embd=128, n_layer=2, n_head=4, n_head_kv=2, n_ff=N_FF_EXP * N_EXPERT_USED, head_dim=32)
    vocab = bpe_vocab("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 352,
                      bos=None, eos="<|endoftext|>", eot="<|im_end|>")
    first, last = _ends(d, len(vocab.tokens), "q8_0", "q8_0")
    meta = _common_metadata("qwen3moe", d, rope_base=1000000.0, eps=1e-6)
    meta.update({"qwen3moe.attention.key_length": d.head_dim, "qwen3moe.attention.value_length": d.head_dim,
                 "qwen3moe.expert_count": N_EXPERT, "qwen3moe.expert_used_count": N_EXPERT_USED,
                 "qwen3moe.expert_feed_forward_length": N_FF_EXP})
    layers = []
    for il, (big, small, experts) in enumerate([("q8_0", "f16", "q8_0"), ("f16", "q4_0", "f16")]):
        p = f"blk.{il}."
        layers += _attention(p, d, big, small, qk_norm=True) + _moe_ffn(p, d, experts)
    return "qwen3moe", meta, vocab, first + layers + last


MODELS.setdefault("qwen3moe", model_qwen3moe)


def write_tiny_qwen3moe(path: str | os.PathLike, seed: int = 0) -> str:
    arch, metadata, vocab, tensors = model_qwen3moe()
    return write_gguf(path, arch, metadata, vocab, tensors, seed)
