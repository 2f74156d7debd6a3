"""Coordinator.close gives back what the constructor took: its event loop's descriptors
(epoll, self-pipe, eventfd) too, so a program that opens coordinators one after another
does not run out of file descriptors (a test process hit select()'s 1024 limit)."""
from __future__ import annotations

import gc
import os

from coordinator.api import Coordinator


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_leaves_no_descriptor_behind():
    Coordinator(["local"], n_ctx=64).close()  # first use: imports, libggml, the model's own files
    gc.collect()  # an earlier test's garbage closes its descriptors now, not in the middle (CI: 16 after, 17 before)
    before = open_fds()
    for _ in range(3):
        with Coordinator(["local"], n_ctx=64):
            pass
    gc.collect()
    assert open_fds() == before
