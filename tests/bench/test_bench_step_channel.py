"""bench/bench_step_channel.py runs end to end on a tiny model over two real local workers: both
modes timed, the steps of one mode over the step channels and of the other through the daemons."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from conftest import SLACK
from tiny_models import write_tiny_model

pytestmark = pytest.mark.system  # starts real worker daemons on 127.0.0.1 (pyproject.toml: markers)

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_step_channel.py"


def test_bench_step_channel_times_both_paths(tmp_path):
    model = write_tiny_model(tmp_path / "llama.gguf", "llama")
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--rounds", "2", "--per", "5"],
                         capture_output=True, text=True, timeout=120 * SLACK)
    assert run.returncode == 0, run.stderr[-2000:]
    for mode in ("step channels", "daemons"):
        assert re.search(rf"^{mode} +median +[\d.]+ ms a token; rounds: [\d.]+ [\d.]+$", run.stdout, re.M), run.stdout
    over = re.search(r"tokens/s with step channels / through the daemons: [\d.]+ \(steps over the channels: "
                     r"\[(\d+), (\d+)\]\)", run.stdout)
    assert over and min(int(over.group(1)), int(over.group(2))) >= 2 * 5, run.stdout  # the channel rounds' steps
    bad = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--rounds must be 1..100" in bad.stderr
