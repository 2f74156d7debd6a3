"""bench/soak.py in a reduced mode: one minute of load with a fault every 15-25 s
(every kind of fault comes up in shuffled rounds, so about 3 of the 5 here).
Asserts what must hold however loaded the machine is: nothing lost or cut
without an error event, every text equal to its reference (one slot), every
fault's in-flight requests accounted for, and every process cleaned up.
TTFT drift and resource drift are reported, not asserted (one minute is too
short for either)."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _children_of(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def test_soak_one_minute(tmp_path):
    report = tmp_path / "soak.json"
    # --parallel 1: every request decoded alone, in its reference's shapes, so every text must equal its
    # reference (with more slots a sequence's greedy text also depends on its batch: bench/soak.py's doc)
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "1", "--clients", "4", "--parallel", "1",
           "--fault-every", "15:25", "--sample-every", "10", "--seed", "1", "--json", str(report)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert report.exists(), out
    rep = json.loads(report.read_text())
    c = rep["requests"]
    assert c.get("lost", 0) == 0, (rep["lost"], out)
    assert c.get("completed", 0) > 0, out
    assert rep["checks"]["texts"], ([m for m in rep["mismatches"] if m["suspect"]], out)
    assert rep["faults"], out
    for kind in rep["fault_kinds"].values():
        done = kind["completed_equal"] + kind["completed_differ"] + kind["errored"] + kind["timeout"] + kind["lost"]
        assert done == kind["inflight"], (kind, out)
    assert rep["samples"] and rep["samples"][-1]["serve"], out
    assert _children_of(os.getpid()) == [], "soak.py left processes behind"
