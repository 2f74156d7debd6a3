"""bench/machine_ceiling.py runs end to end on a tiny model: one decoder alone, two at once in two
processes, and the tensor split over two real local workers, each row with its tokens/s."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from conftest import SLACK
from tiny_models import write_tiny_model

pytestmark = pytest.mark.system  # starts real worker daemons on 127.0.0.1 (pyproject.toml: markers)

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "machine_ceiling.py"


def test_machine_ceiling_prints_alone_two_at_once_and_the_tensor_split(tmp_path):
    model = write_tiny_model(tmp_path / "llama.gguf", "llama")
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--tg", "6", "--rounds", "1"],
                         capture_output=True, text=True, timeout=180 * SLACK)
    assert run.returncode == 0, run.stderr[-2000:]
    alone = float(re.search(r"alone \(1 decoder, 1 thread\) +([\d.]+) tokens/s", run.stdout).group(1))
    both = re.search(r"2 at once \(2 decoders, together\) +([\d.]+) tokens/s +\(([\d.]+)x alone\)", run.stdout)
    tensor = re.search(r"tensor split, 2 workers x 1 thread +([\d.]+) tokens/s +\(([\d.]+)x alone, "
                       r"([\d.]+)x of 2 at once\)", run.stdout)
    assert alone > 0 and both and tensor, run.stdout
    assert float(both.group(2)) == pytest.approx(float(both.group(1)) / alone, abs=0.01), run.stdout
    assert float(tensor.group(3)) == pytest.approx(float(tensor.group(1)) / float(both.group(1)), abs=0.01)
    bad = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "11"], capture_output=True, text=True,
                         timeout=60 * SLACK)
    assert bad.returncode == 2 and "--rounds must be in 1..10" in bad.stderr
