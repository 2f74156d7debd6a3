"""qwen3moe (Qwen 3 MoE, e.g. 30B-A3B, 235B-A22B): qwen3's attention (per-head Q/K
norms, NEOX RoPE) and, in place of the dense FFN, a mixture of experts (common.py's
moe_ffn): softmax routing, expert_used_count of expert_count experts per token, their
weights normalized to sum 1 (llama.cpp always normalizes for this architecture), then
scaled by expert_weights_scale if the GGUF has one."""
from __future__ import annotations

import math

from ggml_ffi import lib
from coordinator.model.architectures import qwen3
from coordinator.model.architectures.common import ROPE_NEOX, GraphBuilder, HParams, check_tensors, standard_hparams
from coordinator.model.architectures.common import CHATML_TEMPLATE, embed, no_extra_weights  # noqa: F401 (this module's embed)
from rpc_daemon.wire.graph_limits import MAX_EXPERTS  # what a worker accepts

LAYER_TENSORS = (qwen3.LAYER_TENSORS - {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}) | {
    "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}
GLOBAL_TENSORS = qwen3.GLOBAL_TENSORS
FALLBACK_CHAT_TEMPLATE = CHATML_TEMPLATE  # when the GGUF carries no tokenizer.chat_template
extra_weights = no_extra_weights


def hparams(g) -> HParams:
    check_tensors(g, "qwen3moe", LAYER_TENSORS, GLOBAL_TENSORS)
    n_expert, n_used = g.require("qwen3moe.expert_count"), g.require("qwen3moe.expert_used_count")
    if not 0 < n_used <= n_expert <= MAX_EXPERTS:
        raise ValueError(f"qwen3moe: expert_used_count {n_used} of expert_count {n_expert} (supported: "
                         f"1 <= used <= count <= {MAX_EXPERTS})")
    n_ff = g.get("qwen3moe.expert_feed_forward_length") or g.require("qwen3moe.feed_forward_length") // n_used
    return standard_hparams(g, "qwen3moe", ROPE_NEOX, rms_eps=1e-6, n_ff=n_ff, n_expert=n_expert,
                            n_expert_used=n_used,
                            expert_weights_scale=g.get("qwen3moe.expert_weights_scale", 0.0))


def layer(b: GraphBuilder, il: int, x, pos):
    q, k, v = b.qkv(il, b.norm(x, b.w[f"blk.{il}.attn_norm.weight"]))
    q, k = b.qk_norm(il, q, k)
    cur = b.attention(il, b.rope(q, pos, il), b.rope(k, pos, il), v, 1.0 / math.sqrt(b.hp.head_dim))
    ffn_in = b.attn_residual(il, cur, x)
    return lib.ggml_add(b.c, b.moe_ffn(il, b.norm(ffn_in, b.w[f"blk.{il}.ffn_norm.weight"])), ffn_in)
