"""bench/tensor_step.py runs end to end on a tiny model over two real local workers and prints
the breakdown docs/operations.md quotes: wall, each member's compute, exchanges and round trip,
and CPU per token."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from conftest import SLACK
from tiny_models import write_tiny_model

pytestmark = pytest.mark.system  # starts real worker daemons on 127.0.0.1 (pyproject.toml: markers)

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "tensor_step.py"


def test_tensor_step_prints_each_members_compute_exchanges_and_round_trip(tmp_path):
    model = write_tiny_model(tmp_path / "llama.gguf", "llama")
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--tg", "6"],
                         capture_output=True, text=True, timeout=120 * SLACK)
    assert run.returncode == 0, run.stderr[-2000:]
    wall = float(re.search(r"wall per token ([\d.]+) ms", run.stdout).group(1))
    members = re.findall(r"member (\d): compute ([\d.]+) ms, of it exchanges ([\d.]+) ms; "
                         r"round trip besides compute ([\d.]+) ms", run.stdout)
    assert [m[0] for m in members] == ["0", "1"], run.stdout
    for _, compute, exchanges, rtt in members:
        assert 0 < float(exchanges) <= float(compute) < wall and float(rtt) > 0, run.stdout
    assert re.search(r"CPU per token: coordinator [\d.]+ ms, daemons [\d.]+ ms, compute processes [\d.]+ ms",
                     run.stdout), run.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--tg", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--tg must be in 1..200" in bad.stderr
