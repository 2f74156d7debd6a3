"""The hop trace (rpc_daemon/service/hoptrace.py) writes its points where a
process waits, not at each point, and loses none a process that exits keeps."""
from __future__ import annotations

import subprocess
import sys

from conftest import SLACK
from rpc_daemon.service import hoptrace

SCRIPT = r"""
import os, sys
from rpc_daemon.service import hoptrace
path = os.environ["GGML_RPC_HOP_TRACE"]
hoptrace.mark("a"); hoptrace.mark("b words")
assert open(path).read() == "", "a point was written at the point"
hoptrace.flush()
lines = open(path).read().splitlines()
assert [l.split(" ", 1)[1].rsplit(" ", 1)[0] for l in lines] == ["a", "b words"], lines
assert all(l.split()[0] == str(os.getpid()) for l in lines), lines
t = [int(l.rsplit(" ", 1)[1]) for l in lines]
assert t == sorted(t), t
for i in range(hoptrace.FLUSH_EVERY):
    hoptrace.mark("many")
assert len(open(path).read().splitlines()) == 2 + hoptrace.FLUSH_EVERY  # a full buffer is written
hoptrace.mark("at exit")
"""


def test_points_are_written_when_flushed_when_the_buffer_fills_and_at_exit(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env={"GGML_RPC_HOP_TRACE": str(trace), "PATH": "/usr/bin"},
                          capture_output=True, text=True, timeout=30 * SLACK)
    assert done.returncode == 0, done.stderr
    lines = trace.read_text().splitlines()
    assert len(lines) == 2 + hoptrace.FLUSH_EVERY + 1 and lines[-1].split(" ", 1)[1].startswith("at exit ")


SCRIPT_THREADS = r"""
import os
from rpc_daemon.service import hoptrace
path = os.environ["GGML_RPC_HOP_TRACE"]
real_open = open


class StampingWhileWritten:
    # the file's write releases the GIL: another thread's point may come then
    def __init__(self, f):
        self.f = f
    def write(self, text):
        hoptrace.mark("during")
        return self.f.write(text)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()


hoptrace.open = lambda p, mode: StampingWhileWritten(real_open(p, mode))
hoptrace.mark("before")
hoptrace.flush()
hoptrace.open = real_open
hoptrace.flush()
points = [l.split(" ", 1)[1].rsplit(" ", 1)[0] for l in real_open(path).read().splitlines()]
assert points == ["before", "during"], points
"""


def test_a_point_stamped_while_the_points_are_written_is_written_once(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("")
    done = subprocess.run([sys.executable, "-c", SCRIPT_THREADS],
                          env={"GGML_RPC_HOP_TRACE": str(trace), "PATH": "/usr/bin"},
                          capture_output=True, text=True, timeout=30 * SLACK)
    assert done.returncode == 0, done.stderr
