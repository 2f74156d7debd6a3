"""Opt-in timestamps of a compute request's hops across processes.

With GGML_RPC_HOP_TRACE=/path/file in the environment, the client, the daemon
and its compute process each append `pid point microseconds` lines (the
system-wide monotonic clock, so processes on one machine compare) at fixed
points of the compute path. bench/bench_hops.py runs local workers with it
and prints the median time between consecutive points: where a remote step's
time goes besides compute. Unset (the default), a point costs one test of
`ON`; nothing is written.

Points are kept in memory and written by `flush()`, which each process
calls where it is about to wait anyway (the compute process before it waits
for its next request, the daemon after a handler's reply; a bench between its steps),
or when FLUSH_EVERY have gathered, and at exit. A write per point put its own
cost between the points: a coordinator's hand-over to its loop thread read
375 us with a line-buffered write per point, 197 us with one os.write, 50 us
with none. A killed process loses the points it has not written (a compute
process is killed when its client leaves: it writes before every wait).
"""
from __future__ import annotations

import atexit
import collections
import os
import time

_PATH = os.environ.get("GGML_RPC_HOP_TRACE")
ON = bool(_PATH)
FLUSH_EVERY = 256
# a deque: its append and popleft are atomic, so a thread may stamp points while another
# flushes (a bench's main thread, atexit), and none is lost or written twice
_points: collections.deque = collections.deque()


def mark(point: str) -> None:
    _points.append((point, time.monotonic()))
    if len(_points) >= FLUSH_EVERY:
        flush()


def flush() -> None:
    if not _points:
        return
    taken = []
    while True:  # until empty: two threads flushing at once share the points out
        try:
            taken.append(_points.popleft())
        except IndexError:
            break
    pid = os.getpid()
    with open(_PATH, "a") as f:
        f.write("".join(f"{pid} {point} {t * 1e6:.0f}\n" for point, t in taken))


if ON:
    atexit.register(flush)
