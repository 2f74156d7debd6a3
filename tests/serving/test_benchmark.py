"""coordinator/serving/benchmark.py without workers or a model: which rows
`ggml-coordinator bench` runs and the exact lines it prints (that the product
takes nothing from bench/ is tests/test_module_boundaries.py's)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from coordinator.serving import benchmark, llama_cpp_reference

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
EPS = ["127.0.0.1:1", "127.0.0.1:2"]


def test_default_rows():
    assert benchmark.setups(EPS, 1, None, "both", "on") == {
        "local": (["local"], {}), "local -t 2": (["local"], {"threads": 2}),
        "rpc x2": (EPS, {"split": None, "step_links": True, "head_split": True}),
        "rpc x2 head whole": (EPS, {"split": None, "step_links": True, "head_split": False})}


@pytest.mark.parametrize("endpoints, threads, head, links, names", [
    (EPS, 1, "on", "on", ["local", "local -t 2", "rpc x2"]),
    (EPS, 1, "off", "off", ["local", "local -t 2", "rpc x2 relayed head whole"]),
    (EPS, 2, "on", "both", ["local", "local -t 4", "rpc x2", "rpc x2 relayed"]),
    (EPS[:1], 1, "off", "on", ["local", "rpc x1"]),  # one worker: no head to split, no second local row
])
def test_rows_by_flags(endpoints, threads, head, links, names):
    assert list(benchmark.setups(endpoints, threads, [1, 2], head, links)) == names


def test_report_lines():
    results = {"local": [(100.0, 20.0, 22.0), (110.0, 21.0, 23.0), (90.0, 19.0, 21.0)],
               "rpc x2": [(150.0, 25.0, 30.0)], "rpc x2 relayed": [(120.0, 10.0, 11.0)]}
    reference = {"llama.cpp": [{"pp": 125.0, "tg": 25.0}], "llama.cpp rpc x2": [{"pp": 100.0, "tg": 20.0}]}
    lines = benchmark.report(results, reference, ["a note"], "rpc x2", 64, 32, (0.5, 1.25), 2)
    w = len("rpc x2 relayed") + 20
    assert lines[:11] == [
        f"{'setup':<{w}}" + "      pp64 t/s      tg32 t/s   tg32 greedy",
        f"{'local':<{w}}         100.0          20.0          22.0",
        f"{'rpc x2':<{w}}         150.0          25.0          30.0",
        f"{'rpc x2 relayed':<{w}}         120.0          10.0          11.0",
        f"{'ratio rpc x2':<{w}}         1.500         1.250         1.364",
        f"{'ratio rpc x2 relayed':<{w}}         1.200         0.500         0.500",
        f"{'llama.cpp':<{w}}         125.0          25.0             -",
        f"{'llama.cpp rpc x2':<{w}}         100.0          20.0             -",
        f"{'ratio local / llama.cpp':<{w}}         0.800         0.800             -",
        f"{'ratio rpc x2 / llama.cpp rpc x2':<{w}}         1.500         1.250             -",
        ("targets vs llama.cpp: local pp64 0.80x (>= 0.95: MISSED) | rpc x2 pp64 1.50x (>= 0.95: met) | "
         "rpc x2 tg32 1.25x (>= 1.4: MISSED)")]
    assert lines[11] == "a note"
    assert lines[12].startswith("llama.cpp: llama-bench --repack 0")
    assert lines[13].startswith("both sides: ggml 0.25.3")
    assert lines[14] == ("load average (1 min) 0.50 before, 1.25 after, on 2 cores: other jobs share them with "
                         "every row, so on a busy machine run this more than once")
    assert lines[15:] == [
        ("ratio: against the in-process path with one worker's threads; '/ local -t N': against it with all the "
         "workers' threads"),
        "tg: full logits read back each step (as llama-bench); greedy: the last worker returns the argmax",
        ("relayed: hidden states come back through the coordinator between stages (--step-links off); the other "
         "rpc rows send them worker to worker")]


def test_report_without_the_reference():
    lines = benchmark.report({"local": [(1.0, 2.0, 3.0)], "local -t 2": [(2.0, 2.0, 6.0)],
                              "rpc x2 head whole": [(1.0, 1.0, 1.0)]}, {},
                             ["llama.cpp reference skipped: not built"], "rpc x2", 8, 4, (0.0, 0.0), None)
    w = len("rpc x2 head whole") + 20
    assert lines[0] == f"{'setup':<{w}}" + "       pp8 t/s       tg4 t/s    tg4 greedy"
    assert [line[:w].rstrip() for line in lines[1:6]] == [
        "local", "local -t 2", "rpc x2 head whole", "ratio rpc x2 head whole", "ratio rpc x2 head whole / local -t 2"]
    assert lines[5][w:] == "         0.500         0.500         0.167"
    assert lines[6] == "llama.cpp reference skipped: not built"
    assert "on None cores" in lines[7]
    assert lines[-1].startswith("head whole: the last worker computes the whole output head (--no-head-split)")
    assert not any(line.startswith(("targets", "relayed", "llama.cpp:")) for line in lines)


def test_reference_rows_are_skipped_saying_why(monkeypatch):
    monkeypatch.setattr(llama_cpp_reference, "bin_dir", lambda: __import__("pathlib").Path("/nonexistent/bin"))
    args = SimpleNamespace(model="m.gguf", threads=1, pp=64, tg=32)
    assert benchmark.reference_runner(args, 2) == (
        None, ("llama.cpp reference skipped: llama.cpp reference not built (llama-bench missing in "
               "/nonexistent/bin): python bench/llama_cpp_reference.py build"))


def test_reference_rows_run_llama_bench_when_built(monkeypatch, tmp_path):
    (tmp_path / "llama-bench").write_text("")
    monkeypatch.setattr(llama_cpp_reference, "bin_dir", lambda: tmp_path)
    calls = []
    monkeypatch.setattr(llama_cpp_reference, "reference_rows", lambda *a: calls.append(a) or ({}, []))
    run, why = benchmark.reference_runner(SimpleNamespace(model="m.gguf", threads=3, pp=64, tg=32), 2)
    assert why is None and calls == []
    assert run() == ({}, [])
    assert calls == [("m.gguf", 3, 64, 32, 1, 2)]
