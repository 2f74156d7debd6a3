"""CPU time of processes from /proc, for the benchmarks that split a token's CPU by process."""
from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK")


def stat_cpu(path: str) -> float:
    """User + system CPU seconds from a /proc/.../stat file (0 if the process or thread is gone)."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except OSError:
        return 0.0


def children(pid: int) -> list[int]:
    """The child processes of every thread of process `pid`."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    return stat_cpu(f"/proc/{pid}/stat")
