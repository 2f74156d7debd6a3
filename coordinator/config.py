"""The coordinator's configuration and its checks, before the model is read or anything is connected."""
from __future__ import annotations

import math

import numpy as np

from rpc_daemon.client import parse_endpoint


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


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
