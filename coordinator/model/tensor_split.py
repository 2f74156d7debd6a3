"""Tensor-parallel split: which part of every layer each of n members holds, and
the bytes of that part.

Splitting layers over machines leaves all but one idle at every step of a single
sequence; splitting each layer lets them all work on it. Attention splits by
heads (whole KV groups, so a member's query heads find their KV heads, and its
KV cache, at home; a model with one KV head has every member compute it), the
FFN by its hidden rows: rows of ffn_gate/ffn_up and the same columns of
ffn_down (of every expert in a MoE). attn_output and ffn_down then yield partial
sums the members all-reduce. A column cut must fall on a quantization block
boundary, so heads and FFN rows are dealt out in units that keep every boundary
block-aligned for the types the GGUF actually has. Tensors not named here
(norms, embeddings, RoPE factors, Q/K norms, the MoE router) are held whole.

With exact sums (`exact=True`) no product's sum is split: attn_output and
ffn_down are cut by their rows instead (each member its rows of n_embd, the
`out` range), and the members gather the whole input of those products (the
attention's heads, the FFN's hidden rows) and then the whole output, so every
logit is summed in one process's order: the same bits as one process, for
two more exchanges a layer (docs/architecture.md, "Numerics").

Pure: numpy on the GGUF's bytes, no sockets.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from coordinator.model.architectures.common import HParams
from ggml_ffi import type_traits


# Exact sums give each member the rows of every product and activation in the pieces one process
# computes them in, so each element takes the same code path. SwiGLU's SiLU runs in vectors of up to
# 64 floats and a scalar tail with another exp (FFN rows not in 64s changed the tiny llama's bits);
# ggml's tinyBLAS takes f32/f16/bf16 weights in tiles of 4 rows and leaves others to a kernel that sums
# in another order (no difference seen on the development VM; whole tiles cost nothing).
ROW_TILE, FFN_TILE = 4, 64


class TensorSplitError(ValueError):
    """This model cannot be split n ways (the message says why, with the numbers)."""


@dataclass(frozen=True)
class Shard:
    rank: int
    n: int
    heads: range  # the query heads this member computes
    kv_heads: range  # the KV heads it computes and caches (all of them when replicated_kv)
    ffn: range  # its FFN rows: rows of ffn_gate/ffn_up, columns of ffn_down (MoE: of every expert)
    replicated_kv: bool  # the KV heads could not be split (one KV head): every member computes them all
    out: range | None = None  # exact sums: its rows of attn_output and ffn_down (of n_embd); None: columns


@dataclass(frozen=True)
class Cut:
    dim: int  # 1: rows (ne[1]); 0: columns (ne[0], block-aligned)
    ranges: tuple[tuple[int, int], ...]  # element ranges along `dim`, concatenated in this order
    ne: tuple[int, ...]  # the cut tensor's ne (4 entries)


def _block(t: int) -> int:
    return type_traits(t).blck_size


def _unit(elements: int, names: Sequence[str], types: dict) -> int:
    """The fewest consecutive things (heads, groups, rows) `elements` columns wide each
    whose edges fall on a block boundary in every tensor of `names` (those in `types`)."""
    blocks = math.lcm(1, *(_block(types[n]) for n in names if n in types))
    return blocks // math.gcd(blocks, elements)


def _deal(total: int, unit: int, shares: Sequence[float], what: str, things: str,
          where: str = "the quantization blocks of its weights allow") -> list[range]:
    """`total` things in units of `unit` (the last unit may be short), to the members
    in proportion to `shares`, each at least one unit, in rank order."""
    n, n_units = len(shares), -(-total // unit)
    if n_units < n:
        raise TensorSplitError(f"cannot split {what} over {n} members: cut only where {where} "
                               f"(every {unit} {things}), it makes {n_units} piece(s)")
    cum, s = np.cumsum(shares, dtype=float), float(sum(shares))
    bounds = [0]
    for i in range(1, n):
        b = int(math.floor(cum[i - 1] * n_units / s + 0.5))
        bounds.append(min(max(b, bounds[-1] + 1), n_units - (n - i)))
    bounds.append(n_units)
    return [range(min(a * unit, total), min(b * unit, total)) for a, b in zip(bounds, bounds[1:])]


def plan_shards(hp: HParams, types: dict[str, int], shares: Sequence[float], exact: bool = False) -> list[Shard]:
    """One Shard per member (rank order), its heads and FFN rows in proportion to its
    share (`exact`: and its rows of the output projections); TensorSplitError when the
    model cannot be split len(shares) ways."""
    n = len(shares)
    if n < 1 or any(not s > 0 for s in shares):
        raise TensorSplitError(f"every member needs a positive share (got {list(shares)})")
    n_head, n_kv, hd = hp.n_head, hp.n_head_kv, hp.head_dim
    layers = range(hp.n_layer)
    attn_out = [f"blk.{il}.attn_output.weight" for il in layers]
    ffn_down = [f"blk.{il}.{t}.weight" for il in layers for t in ("ffn_down", "ffn_down_exps")]
    if exact and any(name in types for name in ffn_down[1::2]):
        raise TensorSplitError("exact sums are not built for mixture-of-experts FFNs (their experts' outputs are "
                               "summed where they are computed); use the tensor split without exact sums")
    # where a cut may fall: on quantization blocks of the columns ffn_down and attn_output are cut by; with
    # exact sums (rows cut them) on the tiles one process computes rows in (ROW_TILE, FFN_TILE)
    def unit(elements: int, names, tile: int = ROW_TILE) -> int:
        return tile // math.gcd(tile, elements) if exact else _unit(elements, names, types)

    def deal(total: int, unit: int, what: str, things: str) -> list[range]:
        where = ("one process's row tiles allow (exact sums)" if exact
                 else "the quantization blocks of its weights allow")
        return _deal(total, unit, shares, what, things, where)

    if n_head % n_kv:
        raise TensorSplitError(f"{n_head} query heads do not form whole groups over {n_kv} KV heads")
    if n_kv >= n:  # whole KV groups: a member's query heads with their KV head
        group = n_head // n_kv
        kv = deal(n_kv, unit(group * hd, attn_out),
                  f"{n_kv} KV heads (each with {group} query heads of size {hd})", "KV heads")
        heads = [range(k.start * group, k.stop * group) for k in kv]
    elif n_kv == 1 and n_head >= n:  # every member computes the one KV head, the query heads split
        heads = deal(n_head, unit(hd, attn_out), f"{n_head} query heads of size {hd}", "heads")
        kv = [range(0, 1)] * n
    else:
        raise TensorSplitError(f"cannot split {n_head} query heads with {n_kv} KV heads over {n} members: the KV "
                               f"heads split only when there are at least as many as members, or are copied to "
                               f"every member when there is one")
    ffn = deal(hp.n_ff, unit(1, ffn_down, FFN_TILE), f"the FFN's {hp.n_ff} rows", "rows")
    out = deal(hp.n_embd, unit(1, ()), f"the {hp.n_embd} output rows", "rows") if exact else [None] * n
    return [Shard(r, n, h, k, f, n_kv < n, o) for r, (h, k, f, o) in enumerate(zip(heads, kv, ffn, out))]


def local_hparams(hp: HParams, shard: Shard) -> HParams:
    """The hparams of the member's graph: its heads and FFN rows (qwen3moe's n_ff is
    already the per-expert length); everything else as the model's."""
    return dataclasses.replace(hp, n_head=len(shard.heads), n_head_kv=len(shard.kv_heads), n_ff=len(shard.ffn))


def _cut(dim: int, ne, ranges) -> Cut | None:
    """The Cut of `ranges` (adjacent ones merged) along `dim`, None if they are the whole."""
    merged: list[list[int]] = []
    for a, b in ranges:
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        elif b > a:
            merged.append([a, b])
    ne = [int(x) for x in ne] + [1] * (4 - len(ne))
    if [tuple(r) for r in merged] == [(0, ne[dim])]:
        return None
    ne[dim] = sum(b - a for a, b in merged)
    return Cut(dim, tuple((a, b) for a, b in merged), tuple(ne))


def shard_cuts(hp: HParams, shard: Shard, tensors: dict) -> dict[str, Cut]:
    """The Cut of every tensor of `tensors` (name -> .type, .ne) this shard holds only
    part of; the others it holds whole."""
    hd, q_rows, kv_rows = hp.head_dim, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    q = (shard.heads.start * hd, shard.heads.stop * hd)
    kv = (0, kv_rows) if shard.replicated_kv else (shard.kv_heads.start * hd, shard.kv_heads.stop * hd)
    f = (shard.ffn.start, shard.ffn.stop)
    rows = None if shard.out is None else (shard.out.start, shard.out.stop)
    cuts = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk":
            continue
        kind, ne = parts[2], list(t.ne)
        if kind == "attn_q":
            cut = _cut(1 if parts[3] == "weight" else 0, ne, [q])
        elif kind in ("attn_k", "attn_v"):
            cut = _cut(1 if parts[3] == "weight" else 0, ne, [kv])
        elif kind == "attn_qkv":  # rows [q | k | v]
            k_at, v_at = q_rows, q_rows + kv_rows
            cut = _cut(1, ne, [q, (k_at + kv[0], k_at + kv[1]), (v_at + kv[0], v_at + kv[1])])
        elif kind == "attn_output":
            cut = _cut(0, ne, [q]) if rows is None else _cut(1 if parts[3] == "weight" else 0, ne, [rows])
        elif kind == "ffn_up" and ne[1] == 2 * hp.n_ff:  # phi3: rows [gate | up]
            cut = _cut(1, ne, [f, (hp.n_ff + f[0], hp.n_ff + f[1])])
        elif kind in ("ffn_gate", "ffn_up", "ffn_gate_exps", "ffn_up_exps"):
            cut = _cut(1, ne, [f])
        elif kind == "ffn_down" and rows is not None:
            cut = _cut(1 if parts[3] == "weight" else 0, ne, [rows])
        elif kind in ("ffn_down", "ffn_down_exps"):
            cut = _cut(0, ne, [f])
        else:
            continue
        if cut is not None:
            cuts[name] = cut
    return cuts


def cut_bytes(data, ggml_type: int, ne: Sequence[int], cut: Cut) -> bytes:
    """The bytes of `cut` of a tensor (`data`: its bytes, ggml layout), contiguous in
    ggml layout: whole rows of every ne[2]*ne[3] matrix for a row cut, whole blocks
    of every row for a column cut."""
    ne = [int(x) for x in ne] + [1] * (4 - len(ne))
    tr = type_traits(ggml_type)
    blck, size = tr.blck_size, tr.type_size
    if ne[0] % blck:
        raise ValueError(f"ne[0] {ne[0]} is not a whole number of {tr.name} blocks of {blck}")
    for a, b in cut.ranges:
        if not 0 <= a < b <= ne[cut.dim]:
            raise ValueError(f"range {a}:{b} is outside dimension {cut.dim} of ne {ne}")
        if cut.dim == 0 and (a % blck or b % blck):
            raise ValueError(f"column range {a}:{b} does not fall on {tr.name} block boundaries (every {blck})")
    if sum(b - a for a, b in cut.ranges) != cut.ne[cut.dim]:
        raise ValueError(f"the ranges {cut.ranges} do not add up to the cut's ne {cut.ne}")
    n_blocks = ne[0] // blck
    src = np.frombuffer(data, np.uint8, count=ne[3] * ne[2] * ne[1] * n_blocks * size)
    src = src.reshape(ne[3] * ne[2], ne[1], n_blocks, size)
    if cut.dim == 1:
        pieces = [src[:, a:b] for a, b in cut.ranges]
    else:
        pieces = [src[:, :, a // blck:b // blck] for a, b in cut.ranges]
    return np.concatenate(pieces, axis=2 - cut.dim).tobytes()
