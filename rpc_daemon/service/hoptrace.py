"""Opt-in timestamps of a compute request's hops across processes.

With GGML_RPC_HOP_TRACE=/path/file in the environment, the client, the daemon
and its compute process each append `pid point microseconds` lines (the
system-wide monotonic clock, so processes on one machine compare) at fixed
points of the compute path. bench/bench_hops.py runs local workers with it
and prints the median time between consecutive points: where a remote step's
time goes besides compute. Unset (the default), a point costs one test of
`ON`; nothing is written.
"""
from __future__ import annotations

import os
import time

_PATH = os.environ.get("GGML_RPC_HOP_TRACE")
ON = bool(_PATH)
_file = None


def mark(point: str) -> None:
    global _file
    if _file is None:
        _file = open(_PATH, "a", buffering=1)
    _file.write(f"{os.getpid()} {point} {time.monotonic() * 1e6:.0f}\n")
