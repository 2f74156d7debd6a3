"""A daemon's own memory after clients that held a stage have come and gone
(issue #29's soak: the spare's RSS +18 % over an hour, 12 takeovers).

Serving a stage raises the daemon's heap once, to the high-water mark of its
requests; it must not keep growing with every client that loads, computes and
leaves (a spare takes a stage and gives it back again and again). And what the
C heap holds free once a client has left is given back to the system
(rpc_daemon/service/memory.py, give_back_free_heap)."""
from __future__ import annotations

import os
import time

import pytest

from coordinator import Coordinator
from conftest import SLACK
from rpc_daemon.service.memory import give_back_free_heap

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

MiB = 1 << 20


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _cycle(endpoint: str, model: str) -> None:
    """A client as a spare sees one: load a stage, decode, leave."""
    with Coordinator([endpoint], model=model, n_ctx=64) as c:
        c.generate("Hello there", max_tokens=4)


def _idle(pid: int, fds: int) -> bool:
    """Whether the daemon is back to `fds` descriptors (its last client's
    release runs on its loop a moment after the client has closed), within
    10 s (times SLACK)."""
    deadline = time.monotonic() + 10 * SLACK
    while _fds(pid) > fds and time.monotonic() < deadline:
        time.sleep(0.05)
    return _fds(pid) <= fds


def test_clients_that_load_and_leave_do_not_grow_the_daemon(tiny_model, start_daemon, tmp_path):
    d = start_daemon("-t", "1", "--cache", str(tmp_path / "cache"))
    pid = d.proc.pid
    fresh_fds = _fds(pid)
    for _ in range(3):  # warm-up: imports, the heap's first high-water mark, the tensor cache filled
        _cycle(d.endpoint, tiny_model)
    assert _idle(pid, fresh_fds), "descriptors left behind by clients that left"
    base = _status(pid, "RssAnon")
    n = 40
    for _ in range(n):
        _cycle(d.endpoint, tiny_model)
    assert _idle(pid, fresh_fds), "descriptors left behind by clients that left"
    grown = _status(pid, "RssAnon") - base
    # measured: +64 KiB over 40 clients after the warm-up (18.8 MiB fresh, 19.0 after it); a leak of
    # 50 KiB a client would show as 2 MiB
    assert grown < 2 * MiB, f"the daemon's own (anonymous) memory grew {grown / MiB:.1f} MiB over {n} clients"


def test_free_heap_is_given_back():
    """glibc keeps a freed chunk below a live one mapped (only the top of the
    heap shrinks by itself); give_back_free_heap returns its pages."""
    pid = os.getpid()
    blocks = [bytearray(96 << 10) for _ in range(512)]  # 48 MiB in chunks under mmap's threshold: the heap
    del blocks[::2]  # half of them free, each between two live ones: the heap cannot shrink from its top
    before = _status(pid, "RssAnon")
    if not give_back_free_heap():
        pytest.skip("the C library has no malloc_trim (not glibc)")
    after = _status(pid, "RssAnon")
    assert before - after > 8 * MiB, (before >> 20, after >> 20)
    del blocks
