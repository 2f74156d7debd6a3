"""coordinator/model/tensor_split.py: which heads, KV heads and FFN rows each member
of a tensor-parallel split holds (plans for real models' dims and types, and the
refusals), the Cut of every weight, and the bytes of those cuts checked on real
quantized tensors (gguf-py's quantizer, ggml's own for the K-quants) against
numpy slicing of the dequantized whole. Pure: no sockets, no daemons."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from coordinator.model.architectures.common import HParams
from coordinator.model.tensor_split import (FFN_TILE, ROW_TILE, Cut, Shard, TensorSplitError, cut_bytes, local_hparams,
                                            plan_shards, shard_cuts)
from ggml_ffi import Context, ffi, lib, type_traits

F32, F16, Q8_0, Q4_K, Q6_K = (lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_Q8_0, lib.GGML_TYPE_Q4_K,
                              lib.GGML_TYPE_Q6_K)


def hparams(arch="llama", **kw) -> HParams:
    fields = dict(arch=arch, n_vocab=32000, n_embd=2048, n_layer=22, n_ff=5632, n_head=32, n_head_kv=4, head_dim=64,
                  n_rot=64, rms_eps=1e-5, rope_type=0, rope_base=10000.0)
    fields.update(kw)
    return HParams(**fields)


TINYLLAMA = hparams()
GEMMA3_270M = hparams("gemma3", n_vocab=262144, n_embd=640, n_layer=18, n_ff=2048, n_head=4, n_head_kv=1,
                      head_dim=256, n_rot=256)


def q4_k_m_types(hp: HParams) -> dict[str, int]:
    """Q4_K_M's mix: Q4_K mostly, Q6_K for some layers' ffn_down and attn_v."""
    types = {}
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        types.update({p + n + ".weight": Q4_K for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")})
        types.update({p + n + ".weight": Q6_K if il % 3 == 0 else Q4_K for n in ("attn_v", "ffn_down")})
        types.update({p + n + ".weight": F32 for n in ("attn_norm", "ffn_norm")})
    return types


def ranges_of(shards, field):
    return [(getattr(s, field).start, getattr(s, field).stop) for s in shards]


def check_plan(hp: HParams, types: dict, shards: list[Shard]):
    """Every member has something; heads, KV heads and FFN rows covered once in rank
    order; every column boundary on a block boundary of every layer's type."""
    assert [s.rank for s in shards] == list(range(len(shards))) and {s.n for s in shards} == {len(shards)}
    for field, total in (("heads", hp.n_head), ("ffn", hp.n_ff)) + (() if shards[0].replicated_kv else
                                                                     (("kv_heads", hp.n_head_kv),)):
        assert [i for s in shards for i in getattr(s, field)] == list(range(total)), field
        assert all(len(getattr(s, field)) > 0 for s in shards)
    for il in range(hp.n_layer):
        out, down = (type_traits(types[f"blk.{il}.{n}.weight"]).blck_size for n in ("attn_output", "ffn_down"))
        assert all(s.heads.start * hp.head_dim % out == 0 and s.ffn.start % down == 0 for s in shards)
    for s in shards:
        if not s.replicated_kv:  # each member's query heads are the groups of its KV heads
            group = hp.n_head // hp.n_head_kv
            assert s.heads == range(s.kv_heads.start * group, s.kv_heads.stop * group)


# ---------------------------------------------------------------- plans

def test_tinyllama_two_equal():
    types = q4_k_m_types(TINYLLAMA)
    shards = plan_shards(TINYLLAMA, types, [1, 1])
    check_plan(TINYLLAMA, types, shards)
    assert ranges_of(shards, "kv_heads") == [(0, 2), (2, 4)]
    assert ranges_of(shards, "heads") == [(0, 16), (16, 32)]
    assert ranges_of(shards, "ffn") == [(0, 2816), (2816, 5632)]  # 22 blocks of 256: 11 each
    assert not any(s.replicated_kv for s in shards)


def test_tinyllama_two_to_one():
    types = q4_k_m_types(TINYLLAMA)
    shards = plan_shards(TINYLLAMA, types, [2.0, 1.0])
    check_plan(TINYLLAMA, types, shards)
    assert ranges_of(shards, "kv_heads") == [(0, 3), (3, 4)]  # round(4 * 2/3) = 3
    assert ranges_of(shards, "heads") == [(0, 24), (24, 32)]
    assert ranges_of(shards, "ffn") == [(0, 3840), (3840, 5632)]  # round(22 * 2/3) = 15 blocks


def test_tinyllama_three_and_four():
    types = q4_k_m_types(TINYLLAMA)
    three = plan_shards(TINYLLAMA, types, [1, 1, 1])
    check_plan(TINYLLAMA, types, three)
    assert ranges_of(three, "kv_heads") == [(0, 1), (1, 3), (3, 4)]
    assert ranges_of(three, "ffn") == [(0, 1792), (1792, 3840), (3840, 5632)]
    four = plan_shards(TINYLLAMA, types, [5, 5, 5, 5])
    check_plan(TINYLLAMA, types, four)
    assert ranges_of(four, "kv_heads") == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert ranges_of(four, "heads") == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert ranges_of(four, "ffn") == [(0, 1536), (1536, 2816), (2816, 4352), (4352, 5632)]


def test_every_member_gets_one_unit_however_small_its_share():
    types = q4_k_m_types(TINYLLAMA)
    shards = plan_shards(TINYLLAMA, types, [1000, 1, 1, 1])
    check_plan(TINYLLAMA, types, shards)
    assert [len(s.kv_heads) for s in shards] == [1, 1, 1, 1]
    assert [len(s.ffn) for s in shards] == [4864, 256, 256, 256]


def test_one_member_holds_everything():
    types = q4_k_m_types(TINYLLAMA)
    [shard] = plan_shards(TINYLLAMA, types, [3.5])
    assert shard == Shard(0, 1, range(0, 32), range(0, 4), range(0, 5632), False)


def test_gemma3_270m_copies_its_one_kv_head():
    types = {f"blk.{il}.{n}.weight": Q8_0 for il in range(18) for n in ("attn_output", "ffn_down")}
    shards = plan_shards(GEMMA3_270M, types, [1, 1])
    check_plan(GEMMA3_270M, types, shards)
    assert all(s.replicated_kv and s.kv_heads == range(0, 1) for s in shards)
    assert ranges_of(shards, "heads") == [(0, 2), (2, 4)]
    assert ranges_of(shards, "ffn") == [(0, 1024), (1024, 2048)]
    four = plan_shards(GEMMA3_270M, types, [1, 2, 3, 4])
    check_plan(GEMMA3_270M, types, four)
    assert ranges_of(four, "heads") == [(0, 1), (1, 2), (2, 3), (3, 4)]
    local = local_hparams(GEMMA3_270M, shards[1])
    assert (local.n_head, local.n_head_kv, local.n_ff, local.n_embd_kv) == (2, 1, 1024, 256)
    assert dataclasses.replace(local, n_head=4, n_head_kv=1, n_ff=2048) == GEMMA3_270M


def test_float_types_cut_anywhere():
    hp = hparams(n_ff=100, n_head=4, n_head_kv=4, head_dim=8, n_layer=1)
    types = {"blk.0.attn_output.weight": F16, "blk.0.ffn_down.weight": F32}
    shards = plan_shards(hp, types, [1, 1, 1])
    check_plan(hp, types, shards)
    assert ranges_of(shards, "ffn") == [(0, 33), (33, 67), (67, 100)]
    assert ranges_of(shards, "kv_heads") == [(0, 1), (1, 3), (3, 4)]


def test_block_alignment_picks_the_unit():
    # groups of 2 heads of 64 = 128 columns: a Q4_K block of 256 takes two groups, a Q8_0 one of 32 one
    hp = hparams(n_head=16, n_head_kv=8, n_ff=1024, n_layer=2)
    mixed = {"blk.0.attn_output.weight": Q8_0, "blk.1.attn_output.weight": Q4_K,
             "blk.0.ffn_down.weight": Q8_0, "blk.1.ffn_down.weight": Q8_0}
    assert ranges_of(plan_shards(hp, mixed, [1, 1, 1]), "kv_heads") == [(0, 2), (2, 6), (6, 8)]
    only_q8 = dict(mixed, **{"blk.1.attn_output.weight": Q8_0})
    assert ranges_of(plan_shards(hp, only_q8, [1, 1, 1]), "kv_heads") == [(0, 3), (3, 5), (5, 8)]
    with pytest.raises(TensorSplitError, match=r"8 KV heads.* over 5 members.*every 2 KV heads.* 4 piece"):
        plan_shards(hp, mixed, [1] * 5)


def test_moe_ffn_unit_from_the_experts_down_projection():
    hp = hparams("qwen3moe", n_ff=768, n_expert=128, n_expert_used=8, n_layer=2, head_dim=128)
    types = {"blk.0.ffn_down_exps.weight": Q6_K, "blk.1.ffn_down_exps.weight": Q4_K,
             "blk.0.attn_output.weight": Q4_K, "blk.1.attn_output.weight": Q4_K}
    shards = plan_shards(hp, types, [1, 1])
    assert ranges_of(shards, "ffn") == [(0, 512), (512, 768)]  # 3 blocks of 256: round(1.5) = 2
    assert local_hparams(hp, shards[1]).n_ff == 256  # qwen3moe's n_ff is the experts' FF length


def test_refuses_kv_heads_it_can_neither_split_nor_copy():
    hp = hparams(n_head=8, n_head_kv=2, n_layer=1)
    with pytest.raises(TensorSplitError, match=r"8 query heads with 2 KV heads over 4 members"):
        plan_shards(hp, {}, [1, 1, 1, 1])
    with pytest.raises(TensorSplitError, match=r"4 query heads with 1 KV heads over 5 members"):
        plan_shards(GEMMA3_270M, {}, [1] * 5)
    with pytest.raises(TensorSplitError, match=r"32 query heads with 4 KV heads over 5 members"):
        plan_shards(TINYLLAMA, q4_k_m_types(TINYLLAMA), [1] * 5)


def test_refuses_too_few_ffn_units():
    hp = hparams(n_ff=2048, n_head=32, n_head_kv=32, head_dim=128, n_layer=1)
    types = {"blk.0.ffn_down.weight": Q4_K, "blk.0.attn_output.weight": Q4_K}
    assert len(plan_shards(hp, types, [1] * 8)) == 8
    with pytest.raises(TensorSplitError, match=r"FFN's 2048 rows over 9 members.*every 256 rows.* 8 piece"):
        plan_shards(hp, types, [1] * 9)


def test_refuses_a_share_that_is_not_positive():
    with pytest.raises(TensorSplitError, match="positive share"):
        plan_shards(TINYLLAMA, {}, [1, 0])


# ---------------------------------------------------------------- cuts of a layer

def layer_tensors(ctx, hp: HParams, wtype=Q4_K, fused=False, moe=False, bias=False, il=0, types=None) -> dict:
    """Real (no_alloc) ggml tensors with the shapes one layer of `hp` has in a GGUF (`wtype`
    for the matrices, but `types`: name after "blk.N." -> type)."""
    p, e, q, kv = f"blk.{il}.", hp.n_embd, hp.n_head * hp.head_dim, hp.n_embd_kv
    shapes = {"attn_norm.weight": (F32, [e]), "attn_output.weight": (wtype, [q, e]), "ffn_norm.weight": (F32, [e]),
              "attn_q_norm.weight": (F32, [hp.head_dim]), "attn_k_norm.weight": (F32, [hp.head_dim])}
    if fused:
        shapes["attn_qkv.weight"] = (wtype, [e, q + 2 * kv])
    else:
        shapes.update({"attn_q.weight": (wtype, [e, q]), "attn_k.weight": (wtype, [e, kv]),
                       "attn_v.weight": (wtype, [e, kv])})
    if bias:
        shapes.update({"attn_q.bias": (F32, [q]), "attn_k.bias": (F32, [kv]), "attn_v.bias": (F32, [kv])})
    if moe:
        shapes.update({"ffn_gate_inp.weight": (F32, [e, hp.n_expert]),
                       "ffn_gate_exps.weight": (wtype, [e, hp.n_ff, hp.n_expert]),
                       "ffn_up_exps.weight": (wtype, [e, hp.n_ff, hp.n_expert]),
                       "ffn_down_exps.weight": (wtype, [hp.n_ff, e, hp.n_expert])})
    elif fused:
        shapes.update({"ffn_up.weight": (wtype, [e, 2 * hp.n_ff]), "ffn_down.weight": (wtype, [hp.n_ff, e])})
    else:
        shapes.update({"ffn_gate.weight": (wtype, [e, hp.n_ff]), "ffn_up.weight": (wtype, [e, hp.n_ff]),
                       "ffn_down.weight": (wtype, [hp.n_ff, e])})
    types = types or {}
    return {p + n: ctx.new_tensor(types.get(n, t), ne, p + n) for n, (t, ne) in shapes.items()}


def test_cuts_of_a_llama_layer():
    with Context(64) as ctx:
        tensors = layer_tensors(ctx, TINYLLAMA) | {"token_embd.weight": ctx.new_tensor(Q4_K, [2048, 32000])}
        shard = plan_shards(TINYLLAMA, {n: t.type for n, t in tensors.items()}, [1, 1])[1]
        cuts = shard_cuts(TINYLLAMA, shard, tensors)
    assert cuts == {
        "blk.0.attn_q.weight": Cut(1, ((1024, 2048),), (2048, 1024, 1, 1)),
        "blk.0.attn_k.weight": Cut(1, ((128, 256),), (2048, 128, 1, 1)),
        "blk.0.attn_v.weight": Cut(1, ((128, 256),), (2048, 128, 1, 1)),
        "blk.0.attn_output.weight": Cut(0, ((1024, 2048),), (1024, 2048, 1, 1)),
        "blk.0.ffn_gate.weight": Cut(1, ((2816, 5632),), (2048, 2816, 1, 1)),
        "blk.0.ffn_up.weight": Cut(1, ((2816, 5632),), (2048, 2816, 1, 1)),
        "blk.0.ffn_down.weight": Cut(0, ((2816, 5632),), (2816, 2048, 1, 1)),
    }


def test_cuts_with_a_copied_kv_head_and_biases():
    hp = dataclasses.replace(GEMMA3_270M, n_layer=1)
    with Context(64) as ctx:
        tensors = layer_tensors(ctx, hp, Q8_0, bias=True)
        shard = plan_shards(hp, {n: t.type for n, t in tensors.items()}, [1, 3])[0]
        cuts = shard_cuts(hp, shard, tensors)
    assert shard.heads == range(0, 1) and shard.replicated_kv
    assert cuts["blk.0.attn_q.weight"] == Cut(1, ((0, 256),), (640, 256, 1, 1))
    assert cuts["blk.0.attn_q.bias"] == Cut(0, ((0, 256),), (256, 1, 1, 1))
    assert cuts["blk.0.attn_output.weight"] == Cut(0, ((0, 256),), (256, 640, 1, 1))
    assert not {"blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.attn_k.bias", "blk.0.attn_v.bias",
                "blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight", "blk.0.attn_norm.weight"} & cuts.keys()


def test_cuts_of_phi3_fused_products():
    hp = hparams("phi3", n_embd=3072, n_head=24, n_head_kv=8, head_dim=128, n_ff=8192, n_layer=1)
    with Context(64) as ctx:
        tensors = layer_tensors(ctx, hp, fused=True)
        shards = plan_shards(hp, {n: t.type for n, t in tensors.items()}, [1, 1])
        cuts = [shard_cuts(hp, s, tensors) for s in shards]
    assert cuts[0]["blk.0.attn_qkv.weight"] == Cut(1, ((0, 1536), (3072, 3584), (4096, 4608)), (3072, 2560, 1, 1))
    assert cuts[1]["blk.0.attn_qkv.weight"] == Cut(1, ((1536, 3072), (3584, 4096), (4608, 5120)), (3072, 2560, 1, 1))
    assert cuts[1]["blk.0.ffn_up.weight"] == Cut(1, ((4096, 8192), (12288, 16384)), (3072, 8192, 1, 1))
    assert cuts[1]["blk.0.ffn_down.weight"] == Cut(0, ((4096, 8192),), (4096, 3072, 1, 1))
    copied = dataclasses.replace(hp, n_head_kv=1)  # q split, k and v (adjacent, whole) in one range
    with Context(64) as ctx:
        tensors = layer_tensors(ctx, copied, fused=True)
        first, second = plan_shards(copied, {}, [1, 1])
        assert shard_cuts(copied, first, tensors)["blk.0.attn_qkv.weight"] == Cut(
            1, ((0, 1536), (3072, 3328)), (3072, 1792, 1, 1))
        assert shard_cuts(copied, second, tensors)["blk.0.attn_qkv.weight"] == Cut(
            1, ((1536, 3328),), (3072, 1792, 1, 1))  # its q rows run on into k and v


def test_cuts_of_moe_experts():
    hp = hparams("qwen3moe", n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_ff=768, n_expert=128,
                 n_expert_used=8, n_layer=1)
    with Context(64) as ctx:
        tensors = layer_tensors(ctx, hp, moe=True)
        shard = plan_shards(hp, {n: t.type for n, t in tensors.items()}, [1, 1])[1]
        cuts = shard_cuts(hp, shard, tensors)
    assert cuts["blk.0.ffn_gate_exps.weight"] == Cut(1, ((512, 768),), (2048, 256, 128, 1))
    assert cuts["blk.0.ffn_up_exps.weight"] == Cut(1, ((512, 768),), (2048, 256, 128, 1))
    assert cuts["blk.0.ffn_down_exps.weight"] == Cut(0, ((512, 768),), (256, 2048, 128, 1))
    assert "blk.0.ffn_gate_inp.weight" not in cuts


# ---------------------------------------------------------------- bytes

def quantized(rng, t: int, ne) -> bytes:
    """A random tensor of ne in type t: quantized by gguf-py, or by ggml for the K-quants
    (gguf-py has no K-quant quantizer)."""
    x = rng.standard_normal(list(reversed(ne))).astype(np.float32)
    if t in (Q4_K, Q6_K):
        rows = x.size // ne[0]
        out = ffi.new("char[]", rows * ne[0] // type_traits(t).blck_size * type_traits(t).type_size)
        lib.ggml_quantize_chunk(t, ffi.cast("float *", ffi.from_buffer(x)), out, 0, rows, ne[0], ffi.NULL)
        return bytes(ffi.buffer(out))
    return quants.quantize(x, GGMLQuantizationType(t)).tobytes()


def dequantized(data: bytes, t: int, ne) -> np.ndarray:
    """[ne2, ne1, ne0] floats of a tensor's bytes."""
    ne = list(ne) + [1] * (4 - len(ne))
    tr = type_traits(t)
    raw = np.frombuffer(data, np.uint8).reshape(ne[3] * ne[2], ne[1], ne[0] // tr.blck_size * tr.type_size)
    return quants.dequantize(raw, GGMLQuantizationType(t)).reshape(ne[3] * ne[2], ne[1], ne[0])


def sliced(whole: np.ndarray, cut: Cut) -> np.ndarray:
    axis = 2 - cut.dim  # ne[1] is numpy's axis 1, ne[0] axis 2
    return np.concatenate([whole.take(range(a, b), axis=axis) for a, b in cut.ranges], axis=axis)


def check_cut(data: bytes, t: int, ne, cut: Cut):
    part = cut_bytes(memoryview(data), t, ne, cut)
    tr = type_traits(t)
    assert len(part) == cut.ne[0] // tr.blck_size * tr.type_size * cut.ne[1] * cut.ne[2] * cut.ne[3]
    assert np.array_equal(dequantized(part, t, cut.ne), sliced(dequantized(data, t, ne), cut))


@pytest.mark.parametrize("t", [F32, F16, Q8_0, Q4_K, Q6_K])
def test_cut_bytes_rows_and_columns(t):
    rng = np.random.default_rng(t)
    ne = [1024, 12, 1, 1]
    data = quantized(rng, t, ne)
    check_cut(data, t, ne, Cut(1, ((2, 5), (7, 12)), (1024, 8, 1, 1)))
    check_cut(data, t, ne, Cut(1, ((0, 1),), (1024, 1, 1, 1)))
    check_cut(data, t, ne, Cut(0, ((256, 512), (768, 1024)), (512, 12, 1, 1)))
    check_cut(data, t, ne, Cut(0, ((0, 256),), (256, 12, 1, 1)))
    moe_ne = [512, 6, 3, 1]  # three experts of 6 rows
    moe = quantized(rng, t, moe_ne)
    check_cut(moe, t, moe_ne, Cut(1, ((1, 4),), (512, 3, 3, 1)))
    check_cut(moe, t, moe_ne, Cut(0, ((256, 512),), (256, 6, 3, 1)))


def test_cut_bytes_refuses_a_column_range_off_block_boundaries():
    rng = np.random.default_rng(0)
    data = quantized(rng, Q4_K, [512, 2])
    with pytest.raises(ValueError, match="block boundaries"):
        cut_bytes(data, Q4_K, [512, 2], Cut(0, ((128, 512),), (384, 2, 1, 1)))
    data = quantized(rng, Q8_0, [64, 2])
    with pytest.raises(ValueError, match="block boundaries"):
        cut_bytes(data, Q8_0, [64, 2], Cut(0, ((0, 16),), (16, 2, 1, 1)))
    assert len(cut_bytes(data, Q8_0, [64, 2], Cut(0, ((32, 64),), (32, 2, 1, 1)))) == 2 * 34


@pytest.mark.parametrize("shares", [[1, 1], [2, 1], [1, 1, 1], [1, 2, 3, 4]])
def test_shards_cover_every_weight(shares):
    """Each shard's cut of every weight is the source's slice (dequantized, exact); the
    row cuts of the members, concatenated in rank order, are the source's bytes, and
    the column cuts side by side its columns."""
    hp = hparams(n_embd=512, n_head=16, n_head_kv=4, head_dim=64, n_ff=1280, n_layer=1)
    rng = np.random.default_rng(len(shares))
    with Context(64) as ctx:
        tensors = layer_tensors(ctx, hp, bias=True, types={"ffn_down.weight": Q6_K, "attn_v.weight": Q6_K})
        meta = {n: (t.type, tuple(t.ne)) for n, t in tensors.items()}
        shards = plan_shards(hp, {n: t for n, (t, _) in meta.items()}, shares)
        cuts = [shard_cuts(hp, s, tensors) for s in shards]
    data = {n: quantized(rng, t, ne) for n, (t, ne) in meta.items()}
    rows = {"blk.0." + n for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight",
                                   "ffn_up.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias")}
    columns = {"blk.0.attn_output.weight", "blk.0.ffn_down.weight"}
    assert all(c.keys() == rows | columns for c in cuts)
    for name in rows:
        t, ne = meta[name]
        assert b"".join(cut_bytes(data[name], t, ne, c[name]) for c in cuts) == data[name]
    for name in rows | columns:
        for c in cuts:
            check_cut(data[name], t := meta[name][0], meta[name][1], c[name])
    for name in columns:
        t, ne = meta[name]
        parts = [dequantized(cut_bytes(data[name], t, ne, c[name]), t, c[name].ne) for c in cuts]
        assert np.array_equal(np.concatenate(parts, axis=2), dequantized(data[name], t, ne))


def test_the_trade_auto_weighs_does_not_depend_on_the_number_of_groups():
    """A token passes every layer either way: two equal members save half of every layer's time and
    pay two exchanges a layer, one group or a pipeline of them alike (auto once divided the saving
    by the number of groups, so a pipeline of 2 groups of 2 leaned to the layer split)."""
    from coordinator.model.loading import tensor_trade
    cost, saved = tensor_trade(22, 2e-3, 20e-6, [1.0, 1.0])
    assert saved == pytest.approx(22 * 1e-3)
    assert cost == pytest.approx(45 * 20e-6)  # two a layer, and the embedding's
    assert tensor_trade(22, 2e-3, 100e-6, [3.0, 1.0])[1] == pytest.approx(22 * 2e-3 * 0.25)  # the larger share rules


# ---------------------------------------------------------------- exact sums: the output projections by rows

def tiny_gguf(tmp_path, name: str):
    """The GGUF of tests/tiny_models.py's `name`, its hparams and its tensors' types (a file read, no sockets)."""
    from coordinator.model.architectures import architecture
    from coordinator.model.gguf_file import GGUFFile
    from tiny_models import write_tiny_model
    gguf = GGUFFile(write_tiny_model(tmp_path / f"{name}.gguf", name))
    return gguf, architecture(gguf.architecture).hparams(gguf), {n: t.type for n, t in gguf.tensors.items()}


def check_exact_plan(hp: HParams, shards: list[Shard]):
    """Exact sums: the output rows covered once in rank order, every member some; every cut of the
    rows of a product (heads' rows, FFN rows, output rows) on a tile one process computes in."""
    assert [i for s in shards for i in s.out] == list(range(hp.n_embd))
    assert [i for s in shards for i in s.ffn] == list(range(hp.n_ff))
    assert all(len(s.out) > 0 and len(s.ffn) > 0 and len(s.heads) > 0 for s in shards)
    for s in shards[1:]:
        assert s.out.start % ROW_TILE == 0 and s.heads.start * hp.head_dim % ROW_TILE == 0, s
        assert s.ffn.start % FFN_TILE == 0, s


@pytest.mark.parametrize("shares, want", [
    ([1, 1], [(0, 1024), (1024, 2048)]),
    ([2.0, 1.0], [(0, 1364), (1364, 2048)]),  # 2048 * 2/3 = 1365.3: the nearest whole tile of 4 rows
    ([1, 1, 1], [(0, 684), (684, 1364), (1364, 2048)]),
    ([1000, 1, 1, 1], [(0, 2036), (2036, 2040), (2040, 2044), (2044, 2048)]),  # a tile each at least
])
def test_exact_sums_deal_the_output_rows_in_proportion(shares, want):
    types = q4_k_m_types(TINYLLAMA)
    shards = plan_shards(TINYLLAMA, types, shares, exact=True)
    assert ranges_of(shards, "out") == want
    check_exact_plan(TINYLLAMA, shards)
    assert all(s.out is None for s in plan_shards(TINYLLAMA, types, shares))  # split sums: no row ranges


def test_exact_sums_deal_heads_and_ffn_rows_off_block_boundaries():
    """The output projections are cut by rows: their columns (heads, FFN rows) need no longer fall on
    a q4_K block boundary of 256, only on the tiles one process computes in (FFN_TILE, ROW_TILE).
    Three members: FFN rows 1856 + 1920 + 1856 (29, 30 and 29 tiles of 64; 1792/2048/1792 with split sums)."""
    types = q4_k_m_types(TINYLLAMA)
    split, exact = plan_shards(TINYLLAMA, types, [1, 1, 1]), plan_shards(TINYLLAMA, types, [1, 1, 1], exact=True)
    assert ranges_of(split, "ffn") == [(0, 1792), (1792, 3840), (3840, 5632)]
    assert ranges_of(exact, "ffn") == [(0, 1856), (1856, 3776), (3776, 5632)]
    assert ranges_of(exact, "kv_heads") == ranges_of(split, "kv_heads") == [(0, 1), (1, 3), (3, 4)]
    assert ranges_of(exact, "heads") == [(0, 8), (8, 24), (24, 32)]  # whole KV groups still
    check_exact_plan(TINYLLAMA, exact)
    # 8 KV heads of 2 query heads of 64 over 5: groups of 128 columns, half a q4_K block: split sums
    # cut every 2 groups (4 pieces: refused), exact sums every group
    hp = hparams(n_head=16, n_head_kv=8, n_ff=1024, n_layer=1)
    q4 = {"blk.0.attn_output.weight": Q4_K, "blk.0.ffn_down.weight": Q4_K}
    with pytest.raises(TensorSplitError, match=r"8 KV heads.* over 5 members.*every 2 KV heads"):
        plan_shards(hp, q4, [1] * 5)
    five = plan_shards(hp, q4, [1] * 5, exact=True)
    assert ranges_of(five, "kv_heads") == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 8)]
    assert ranges_of(five, "ffn") == [(0, 192), (192, 384), (384, 640), (640, 832), (832, 1024)]
    check_exact_plan(hp, five)


def test_exact_sums_cut_float_weights_on_whole_tiles():
    """f32/f16 weights, which split sums cut anywhere: exact sums cut the FFN on tiles of 64 rows
    (SiLU's vectors) and the output rows on tiles of 4 (tinyBLAS's), as one process computes them."""
    hp = hparams(n_ff=100, n_head=4, n_head_kv=4, head_dim=8, n_layer=1, n_embd=36)
    floats = {"blk.0.attn_output.weight": F16, "blk.0.ffn_down.weight": F32}
    assert ranges_of(plan_shards(hp, floats, [1, 1]), "ffn") == [(0, 50), (50, 100)]
    exact = plan_shards(hp, floats, [1, 1], exact=True)
    assert ranges_of(exact, "ffn") == [(0, 64), (64, 100)] and ranges_of(exact, "out") == [(0, 20), (20, 36)]
    assert ranges_of(exact, "heads") == [(0, 2), (2, 4)]
    check_exact_plan(hp, exact)
    with pytest.raises(TensorSplitError, match=r"the FFN's 100 rows over 3 members.*every 64 rows.* 2 piece"):
        plan_shards(hp, floats, [1, 1, 1], exact=True)  # split sums take it: 33 + 34 + 33
    assert len(plan_shards(hp, floats, [1, 1, 1])) == 3


def test_exact_sums_split_the_tiny_qwen3_that_split_sums_refuse(tmp_path):
    """The tiny qwen3 (tests/tiny_models.py): 2 KV groups of 2 x 64 = 128 columns of its q4_K/q6_K
    attn_output, half a block: split sums cannot cut it in two; exact sums cut attn_output by rows."""
    gguf, hp, types = tiny_gguf(tmp_path, "qwen3")
    with gguf:
        assert (hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff) == (256, 4, 2, 64, 512)
        with pytest.raises(TensorSplitError, match=r"2 KV heads.* over 2 members.*quantization blocks.*1 piece"):
            plan_shards(hp, types, [1, 1])
        shards = plan_shards(hp, types, [1, 1], exact=True)
        assert ranges_of(shards, "kv_heads") == [(0, 1), (1, 2)] and ranges_of(shards, "heads") == [(0, 2), (2, 4)]
        assert ranges_of(shards, "ffn") == [(0, 256), (256, 512)] and ranges_of(shards, "out") == [(0, 128), (128, 256)]
        assert not any(s.replicated_kv for s in shards)
        # and the bytes: every member's rows of attn_output and ffn_down (q4_K, q6_K, q4_0), in rank
        # order, are the whole tensor; every other cut is a row cut as well (no column cut is left)
        cuts = [shard_cuts(hp, s, gguf.tensors) for s in shards]
        assert {c.dim for per in cuts for c in per.values()} == {1}
        for il in range(hp.n_layer):
            for name in (f"blk.{il}.attn_output.weight", f"blk.{il}.ffn_down.weight"):
                t = gguf.tensors[name]
                ne = [int(t.ne[i]) for i in range(4)]
                data = bytes(gguf.tensor_data(name))
                assert [c[name] for c in cuts] == [Cut(1, ((0, 128),), (ne[0], 128, 1, 1)),
                                                   Cut(1, ((128, 256),), (ne[0], 128, 1, 1))], name
                assert b"".join(cut_bytes(data, t.type, ne, c[name]) for c in cuts) == data, name


def test_exact_sums_refuse_mixture_of_experts(tmp_path):
    hp = hparams("qwen3moe", n_ff=768, n_expert=128, n_expert_used=8, n_layer=2, head_dim=128)
    types = {"blk.0.ffn_down_exps.weight": Q6_K, "blk.1.ffn_down_exps.weight": Q4_K,
             "blk.0.attn_output.weight": Q4_K, "blk.1.attn_output.weight": Q4_K}
    assert len(plan_shards(hp, types, [1, 1])) == 2  # split sums take it
    with pytest.raises(TensorSplitError, match=r"exact sums are not built for mixture-of-experts.*without exact sums"):
        plan_shards(hp, types, [1, 1], exact=True)
    gguf, hp, types = tiny_gguf(tmp_path, "qwen3moe")  # the tiny one too, its experts in one layer f16
    with gguf, pytest.raises(TensorSplitError, match="mixture-of-experts"):
        plan_shards(hp, types, [1, 1], exact=True)


def test_exact_sums_keep_the_other_refusals():
    with pytest.raises(TensorSplitError, match=r"8 query heads with 2 KV heads over 4 members"):
        plan_shards(hparams(n_head=8, n_head_kv=2, n_layer=1), {}, [1, 1, 1, 1], exact=True)
    with pytest.raises(TensorSplitError, match="positive share"):
        plan_shards(TINYLLAMA, {}, [1, -1], exact=True)
    with pytest.raises(TensorSplitError, match=r"cannot split the 4 output rows over 2 members.*every 4 rows"):
        plan_shards(hparams(n_embd=4, n_head=2, n_head_kv=2, head_dim=4, n_ff=128, n_layer=1), {}, [1, 1],
                    exact=True)


def test_exact_cuts_of_a_llama_layer():
    """attn_output and ffn_down by their rows (dim 1: ne[1] is n_embd), the member's `out` range;
    every other cut as with split sums."""
    with Context(64) as ctx:
        tensors = layer_tensors(ctx, TINYLLAMA) | {"token_embd.weight": ctx.new_tensor(Q4_K, [2048, 32000])}
        types = {n: t.type for n, t in tensors.items()}
        split = shard_cuts(TINYLLAMA, plan_shards(TINYLLAMA, types, [1, 1])[1], tensors)
        shards = plan_shards(TINYLLAMA, types, [3, 1], exact=True)
        cuts = [shard_cuts(TINYLLAMA, s, tensors) for s in shards]
    assert ranges_of(shards, "out") == [(0, 1536), (1536, 2048)]
    assert cuts[1]["blk.0.attn_output.weight"] == Cut(1, ((1536, 2048),), (2048, 512, 1, 1))
    assert cuts[1]["blk.0.ffn_down.weight"] == Cut(1, ((1536, 2048),), (5632, 512, 1, 1))
    assert cuts[0]["blk.0.attn_output.weight"] == Cut(1, ((0, 1536),), (2048, 1536, 1, 1))
    assert cuts[0]["blk.0.ffn_down.weight"] == Cut(1, ((0, 1536),), (5632, 1536, 1, 1))
    assert split["blk.0.attn_output.weight"].dim == split["blk.0.ffn_down.weight"].dim == 0  # columns otherwise
    # [3, 1]: KV heads 3 + 1, FFN rows 4224 + 1408 (not whole q4_K blocks: 16.5 of them)
    assert cuts[1]["blk.0.attn_q.weight"] == Cut(1, ((1536, 2048),), (2048, 512, 1, 1))
    assert cuts[1]["blk.0.ffn_gate.weight"] == Cut(1, ((4224, 5632),), (2048, 1408, 1, 1))
    assert cuts[1].keys() == split.keys()


def test_exact_cuts_of_phi3_fused_products_and_biases():
    hp = hparams("phi3", n_embd=3072, n_head=24, n_head_kv=8, head_dim=128, n_ff=8192, n_layer=1)
    with Context(64) as ctx:
        tensors = layer_tensors(ctx, hp, fused=True)
        tensors["blk.0.attn_output.bias"] = ctx.new_tensor(F32, [3072], "blk.0.attn_output.bias")
        tensors["blk.0.ffn_down.bias"] = ctx.new_tensor(F32, [3072], "blk.0.ffn_down.bias")
        shards = plan_shards(hp, {n: t.type for n, t in tensors.items()}, [1, 1], exact=True)
        cuts = shard_cuts(hp, shards[1], tensors)
    assert cuts["blk.0.ffn_down.weight"] == Cut(1, ((1536, 3072),), (8192, 1536, 1, 1))
    assert cuts["blk.0.attn_output.weight"] == Cut(1, ((1536, 3072),), (3072, 1536, 1, 1))
    assert cuts["blk.0.ffn_down.bias"] == cuts["blk.0.attn_output.bias"] == Cut(0, ((1536, 3072),), (1536, 1, 1, 1))
    assert cuts["blk.0.ffn_up.weight"] == Cut(1, ((4096, 8192), (12288, 16384)), (3072, 8192, 1, 1))  # gate | up


@pytest.mark.parametrize("shares", [[1, 1], [2, 1], [1, 2, 3, 4]])
def test_exact_row_cuts_of_the_output_projections_are_the_whole(shares):
    """Each member's rows of attn_output and ffn_down (q4_K, q6_K), concatenated in rank order, are
    the source's bytes; each one's dequantized is the source's slice."""
    hp = hparams(n_embd=512, n_head=16, n_head_kv=4, head_dim=64, n_ff=1280, n_layer=1)
    rng = np.random.default_rng(10 + len(shares))
    with Context(64) as ctx:
        tensors = layer_tensors(ctx, hp, types={"ffn_down.weight": Q6_K})
        meta = {n: (t.type, tuple(t.ne)) for n, t in tensors.items()}
        shards = plan_shards(hp, {n: t for n, (t, _) in meta.items()}, shares, exact=True)
        cuts = [shard_cuts(hp, s, tensors) for s in shards]
    for name in ("blk.0.attn_output.weight", "blk.0.ffn_down.weight"):
        t, ne = meta[name]
        data = quantized(rng, t, ne)
        assert all(c[name].dim == 1 for c in cuts)
        assert b"".join(cut_bytes(data, t, ne, c[name]) for c in cuts) == data
        for c in cuts:
            check_cut(data, t, ne, c[name])


def test_exact_sums_cost_four_exchanges_a_layer():
    from coordinator.model.loading import exchanges_per_token, tensor_trade
    cost, saved = tensor_trade(22, 2e-3, 20e-6, [1.0, 1.0], exact=True)
    assert cost == pytest.approx(89 * 20e-6)  # four a layer, and the embedding's
    assert saved == tensor_trade(22, 2e-3, 20e-6, [1.0, 1.0])[1]
    assert (exchanges_per_token(22, True), exchanges_per_token(22, False)) == (89, 45)
