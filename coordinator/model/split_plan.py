"""Planning the split: which endpoint holds which layers and which rows of the
output head (docs/architecture.md, "Splitting the layers")."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def plan_rows(n: int, weights: Sequence[float]) -> list[range]:
    """Contiguous ranges of 0..n-1 proportional to `weights` (some may be empty)."""
    w = np.asarray(weights, dtype=float)
    bounds = [0, *np.round(np.cumsum(w) / w.sum() * n).astype(int)]
    bounds[-1] = n
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def plan_split(n_layer: int, weights: Sequence[float]) -> list[range]:
    """Contiguous layer ranges proportional to `weights`, each at least one layer."""
    if len(weights) > n_layer:
        raise ValueError(f"{len(weights)} endpoints but the model has only {n_layer} layers")
    w = np.asarray(weights, dtype=float)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"split proportions must be non-negative with a positive sum: {list(weights)}")
    bounds = np.round(np.cumsum(w) / w.sum() * n_layer).astype(int)
    ranges, start = [], 0
    for i, b in enumerate(bounds):
        remaining = len(bounds) - i - 1
        stop = min(max(b, start + 1), n_layer - remaining)
        ranges.append(range(start, stop))
        start = stop
    return ranges


def split_weights(split: Sequence[float] | None, infos: list[dict], n_endpoints: int) -> list[float]:
    """`split` if given; else every endpoint's reported free memory (what this client may
    still allocate there) if all are positive; else equal."""
    if split is None:
        free = [_reported_free(i) for i in infos]
        split = free if all(f > 0 for f in free) else [1.0] * n_endpoints
    if len(split) != n_endpoints:
        raise ValueError(f"split has {len(split)} proportions for {n_endpoints} endpoints")
    return list(split)


# ---------------------------------------------------------------- fitting the split in memory
PAGE = 4096  # a worker counts every buffer in whole pages: these, or what its DEVICE_INFO says


def in_pages(n: int, info: dict) -> int:
    """`n` bytes as the worker DEVICE_INFO `info` counts a buffer of them: whole pages of its
    arenas (shared_memory.page: 2 MiB on huge pages; 4 KiB from workers that do not say)."""
    shm = info.get("shared_memory")
    page = shm.get("page") if isinstance(shm, dict) else None
    page = page if isinstance(page, int) and 0 < page <= 1 << 30 else PAGE
    return -(-n // page) * page


def endpoint_free(info: dict) -> int | None:
    """What a stage may take on an endpoint (DEVICE_INFO): None (no bound) in process."""
    if info.get("name") == "local":
        return None
    return int(_reported_free(info))


def _reported_free(info: dict):
    """The free memory DEVICE_INFO reports for this client (older workers: for all)."""
    return info.get("client_free_memory", info.get("free_memory", 0))


class DoesNotFit(ValueError):
    """The model does not fit the endpoints' free memory (raised before any upload)."""


def compute_reserve(hp, n_batch: int, n_ctx: int) -> int:
    """Bytes a stage keeps free for its graphs' intermediates (a worker counts them against
    --mem): an estimate of the largest live set of a step of n_batch tokens (the FFN's or
    the experts' activations, Q/K/V, the masks), for two such graphs (the compute process
    keeps an allocator per cached graph), plus 1 MiB."""
    width = hp.n_ff * max(1, hp.n_expert_used)
    act = 4 * n_batch * (6 * hp.n_embd + 3 * width + hp.n_embd * max(1, hp.n_expert_used)
                         + (hp.n_head + 2 * hp.n_head_kv) * hp.head_dim)
    masks = 2 * 2 * n_ctx * n_batch
    return 2 * (act + masks) + (1 << 20)


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def fit_split(names: Sequence[str], free: Sequence[int | None], n_layer: int, n_vocab: int,
              weights: Sequence[float], head_shards: bool, fixed: bool, need) -> tuple[list[range], list]:
    """Layer ranges and head rows whose stages fit each endpoint's free memory.

    `need(index, layers, head_rows)` is what stage `index` would take (bytes); `free[i]`
    is endpoint i's reported free memory, None where unbounded (`local`). First the
    split proportional to `weights` (as plan_split); if a stage does not fit and the
    split was not given (`fixed`), layers are filled in order, each endpoint taking as
    many as fit while leaving one for each after it. If that fails too, DoesNotFit says
    how many bytes are missing in all and on which endpoints."""
    layers = plan_split(n_layer, weights)
    heads = plan_rows(n_vocab, weights) if head_shards else [None] * len(names)
    needs = [need(i, r, h) for i, (r, h) in enumerate(zip(layers, heads))]
    if all(f is None or n <= f for n, f in zip(needs, free)):
        return layers, heads
    if not fixed:
        greedy = _fill_in_order(free, n_layer, heads, need)
        if greedy is not None:
            return greedy, heads
    total = sum(needs)
    bounded = [f for f in free if f is not None]
    short = [f"{name}: layers {r.start}-{r.stop - 1}{'' if h is None else f' and head rows {h.start}-{h.stop - 1}'} "
             f"need {human(n)}, {human(f)} free ({human(n - f)} short)"
             for name, r, h, n, f in zip(names, layers, heads, needs, free) if f is not None and n > f]
    missing = max(0, total - sum(bounded)) if len(bounded) == len(free) else 0
    stages = f"{len(names)} stage" + ("s" if len(names) != 1 else "")
    raise DoesNotFit(f"the model does not fit the workers' free memory: its {stages} need "
                     f"{human(total)} in all (weights, KV cache and compute reserve), the workers report "
                     f"{human(sum(bounded))} free" + (f", {human(missing)} short" if missing else "")
                     + (" (split as given)" if fixed else "") + "; " + "; ".join(short))


def _fill_in_order(free, n_layer: int, heads, need) -> list[range] | None:
    ranges, start, n = [], 0, len(free)
    for i, f in enumerate(free):
        left_for_others = n - i - 1
        if i == n - 1:
            stop = n_layer
        else:
            stop = start + 1
            while stop < n_layer - left_for_others and (f is None or need(i, range(start, stop + 1), heads[i]) <= f):
                stop += 1
        r = range(start, stop)
        if f is not None and need(i, r, heads[i]) > f:
            return None
        ranges.append(r)
        start = stop
    return ranges
