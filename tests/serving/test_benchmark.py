"""coordinator/serving/benchmark.py without workers or a model: which rows
`ggml-coordinator bench` runs and the exact lines it prints (that the product
takes nothing from bench/ is tests/test_module_boundaries.py's)."""
from __future__ import annotations

import json
import os
import shutil
import sys
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
    reference = {"llama.cpp": [{"pp64": 125.0, "tg": 25.0}], "llama.cpp rpc x2": [{"pp64": 100.0, "tg": 20.0}]}
    lines = benchmark.report(results, reference, ["a note"], "rpc x2", (64,), 32, (0.5, 1.25), 2)
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
        "pp: per repetition the median of a prompt's decodes, repeated until 1 s or 5 decodes",
        "tg: full logits read back each step (as llama-bench); greedy: the last worker returns the argmax",
        ("relayed: hidden states come back through the coordinator between stages (--step-links off); the other "
         "rpc rows send them worker to worker")]


def test_report_without_the_reference():
    lines = benchmark.report({"local": [(1.0, 2.0, 3.0)], "local -t 2": [(2.0, 2.0, 6.0)],
                              "rpc x2 head whole": [(1.0, 1.0, 1.0)]}, {},
                             ["llama.cpp reference skipped: not built"], "rpc x2", (8,), 4, (0.0, 0.0), None)
    w = len("rpc x2 head whole") + 20
    assert lines[0] == f"{'setup':<{w}}" + "       pp8 t/s       tg4 t/s    tg4 greedy"
    assert [line[:w].rstrip() for line in lines[1:6]] == [
        "local", "local -t 2", "rpc x2 head whole", "ratio rpc x2 head whole", "ratio rpc x2 head whole / local -t 2"]
    assert lines[5][w:] == "         0.500         0.500         0.167"
    assert lines[6] == "llama.cpp reference skipped: not built"
    assert "on None cores" in lines[7]
    assert lines[-1].startswith("head whole: the last worker computes the whole output head (--no-head-split)")
    assert not any(line.startswith(("targets", "relayed", "llama.cpp:")) for line in lines)


@pytest.mark.parametrize("goal", [benchmark.TENSOR_TG_GOAL, benchmark.TENSOR_TG_GOAL_BUNDLED])
def test_the_tensor_rows_targets_are_the_models(goal):
    """Issue #27's tg target for the tensor split: 1.5x llama.cpp RPC for a 1B-class model, 1.4x for the
    bundled gemma3-270m (bench passes the one for its model); and 0.85x of one process with every core."""
    results = {"local": [(1.0, 10.0, 10.0)], "local -t 2": [(2.0, 20.0, 20.0)], "rpc x2 tensor": [(1.8, 29.0, 29.0)]}
    reference = {"llama.cpp": [{"pp64": 1.0, "tg": 10.0}], "llama.cpp rpc x2": [{"pp64": 1.0, "tg": 20.0}]}
    lines = benchmark.report(results, reference, [], "rpc x2", (64,), 32, (0.0, 0.0), 2, goal)
    verdict = "met" if goal == 1.4 else "MISSED"
    assert f"rpc x2 tensor tg32 1.45x (>= {goal:g}: {verdict})" in next(l for l in lines if l.startswith("targets vs"))
    assert "targets rpc x2 tensor vs local -t 2: pp64 0.90x (>= 0.85: met) | tg32 1.45x (>= 0.85: met)" in lines


def test_two_prompt_sizes_are_two_columns_with_their_targets():
    """--pp 64,512 (--model-1b's default): a column and a target each, in one run (issue #27: pp64 and
    pp512 >= 0.85x of one process with every core), against llama-bench's rows of the same sizes."""
    results = {"local": [(10.0, 8.0, 1.0, 1.0)], "local -t 2": [(20.0, 16.0, 2.0, 2.0)],
               "rpc x2 tensor": [(18.0, 12.0, 1.9, 2.0)]}
    reference = {"llama.cpp": [{"pp64": 10.0, "pp512": 10.0, "tg": 1.0}],
                 "llama.cpp rpc x2": [{"pp64": 10.0, "pp512": 8.0, "tg": 1.0}]}
    lines = benchmark.report(results, reference, [], "rpc x2", (64, 512), 32, (0.0, 0.0), 2)
    w = len("rpc x2 tensor") + 20
    assert lines[0] == f"{'setup':<{w}}" + "      pp64 t/s     pp512 t/s      tg32 t/s   tg32 greedy"
    assert f"{'llama.cpp rpc x2':<{w}}          10.0           8.0           1.0             -" in lines
    assert "targets vs llama.cpp: local pp64 1.00x (>= 0.95: met) | local pp512 0.80x (>= 0.95: MISSED) | " \
           "rpc x2 tensor tg32 1.90x (>= 1.5: met)" in lines
    assert ("targets rpc x2 tensor vs local -t 2: pp64 0.90x (>= 0.85: met) | pp512 0.75x (>= 0.85: MISSED) | "
            "tg32 0.95x (>= 0.85: met)") in lines


def test_reference_rows_are_skipped_saying_why(monkeypatch):
    monkeypatch.setattr(llama_cpp_reference, "bin_dir", lambda: __import__("pathlib").Path("/nonexistent/bin"))
    args = SimpleNamespace(model="m.gguf", threads=1, pp=(64,), tg=32)
    assert benchmark.reference_runner(args, 2) == (
        None, ("llama.cpp reference skipped: llama.cpp reference not built (llama-bench missing in "
               "/nonexistent/bin): python bench/llama_cpp_reference.py build"))


def test_reference_rows_run_llama_bench_when_built(monkeypatch, tmp_path):
    (tmp_path / "llama-bench").write_text("")
    monkeypatch.setattr(llama_cpp_reference, "bin_dir", lambda: tmp_path)
    calls = []
    monkeypatch.setattr(llama_cpp_reference, "reference_rows", lambda *a: calls.append(a) or ({}, []))
    run, why = benchmark.reference_runner(SimpleNamespace(model="m.gguf", threads=3, pp=(64, 512), tg=32), 2)
    assert why is None and calls == []
    assert run() == ({}, [])
    assert calls == [("m.gguf", 3, (64, 512), 32, 1, 2)]


# ---------------------------------------------------------------- the 1B bench model, found by name
def _bench_model_file(cache, name="1b", **info):
    pointer = cache / "bench-models" / f"{name}.json"
    pointer.parent.mkdir(parents=True)
    pointer.write_text(json.dumps(info))
    return pointer


def test_bench_model_not_built_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("GGML_DISTRIBUTED_CACHE", str(tmp_path))
    assert benchmark.bench_model_pointer("1b") == tmp_path / "bench-models" / "1b.json"
    assert benchmark.bench_model("1b") == (
        None, f"the 1b bench model is not built: python bench/bench_models.py build (once; cached in "
              f"{tmp_path / 'bench-models'})")


@pytest.mark.parametrize("info, why", [
    ({"path": "x.gguf"}, "unreadable ('description')"),
    ({"path": "/nonexistent/x.gguf", "description": "d"}, "the 1b bench model /nonexistent/x.gguf is gone"),
])
def test_bench_model_broken_pointer(monkeypatch, tmp_path, info, why):
    monkeypatch.setenv("GGML_DISTRIBUTED_CACHE", str(tmp_path))
    _bench_model_file(tmp_path, **info)
    path, what = benchmark.bench_model("1b")
    assert path is None and why in what and what.endswith(f"python bench/bench_models.py build (once; cached in "
                                                           f"{tmp_path / 'bench-models'})")


def test_model_1b_flag_benches_the_built_model(monkeypatch, tmp_path):
    from coordinator.serving import cli

    monkeypatch.setenv("GGML_DISTRIBUTED_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:  # not built: refused before any worker starts
        cli.parse_args(["bench", "--model-1b"])
    assert exit_.value.code == 2
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    _bench_model_file(tmp_path, path=str(gguf), description="bench-1b: ..., Q4_K_M (llama-quantize)")
    args = cli.parse_args(["bench", "--model-1b"])
    assert (args.model, args.model_description) == (str(gguf), "bench-1b: ..., Q4_K_M (llama-quantize)")
    with pytest.raises(SystemExit):
        cli.parse_args(["bench", "--model-1b", "-m", str(gguf)])
    assert cli.parse_args(["bench", "-m", str(gguf)]).model_1b is False


# ---------------------------------------------------------------- the llama.cpp reference build
@pytest.mark.parametrize("code, words", [
    (1, "exit status 1"), (-9, "killed by SIGKILL"),
    (-4, "killed by SIGILL: an instruction this CPU lists but does not execute"),
])
def test_exit_statuses_in_words(code, words):
    assert llama_cpp_reference.describe_exit(code).startswith(words)


def _reference_script():
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from bench import llama_cpp_reference as script
    return script


def test_reference_build_is_kept_once_built_for_this_recipe_and_cpu(monkeypatch, tmp_path):
    script = _reference_script()
    monkeypatch.setenv("GGML_DISTRIBUTED_CACHE", str(tmp_path))
    assert script.root() == llama_cpp_reference.root() == tmp_path / "llama.cpp-0.3.36"
    assert script.bin_dir() == llama_cpp_reference.bin_dir()
    assert "llama-completion" in script.TARGETS and "llama-quantize" in script.TARGETS  # interop, bench_models
    assert script.built().startswith("not built")
    script.bin_dir().mkdir(parents=True)
    stamp = script.root() / "build" / script.STAMP
    assert script.STAMP == llama_cpp_reference.STAMP
    stamp.write_text(json.dumps(dict(script.recipe(), cmake_flags=["-DGGML_NATIVE=OFF"], cpu_tag="other")))
    assert script.built() == "built from another recipe (cmake_flags, cpu_tag changed)"
    stamp.write_text(json.dumps(script.recipe()))
    assert script.built() == f"{', '.join(script.PRODUCTS)} missing in {script.bin_dir()}"
    for name in script.PRODUCTS:
        (script.bin_dir() / name).write_text("")
    assert script.built() is None
    assert llama_cpp_reference.missing() is None
    stamp.write_text(json.dumps(dict(script.recipe(), cpu_tag="0123456789")))  # a cache shared by another CPU
    assert "was built for another CPU (cpu tag 0123456789" in llama_cpp_reference.missing()


def test_a_failed_quiet_build_prints_its_log_tail(monkeypatch, tmp_path, capsys):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    script = _reference_script()
    monkeypatch.setenv("GGML_DISTRIBUTED_CACHE", str(tmp_path))
    (script.root() / "src").mkdir(parents=True)
    (script.root() / "src" / "CMakeLists.txt").write_text("this is not cmake(\n")
    assert script.main(["build", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "llama.cpp reference build failed" in err and f"the last {script.LOG_TAIL} lines of" in err
    assert "CMake Error" in err and not (script.root() / "build" / script.STAMP).exists()


# ---------------------------------------------------------------- the 1B writer (tests/tiny_models.py)
def test_the_1b_writer_streams_what_write_gguf_writes(tmp_path):
    """write_llama_1b (one tensor at a time) gives write_gguf's tensors, at a small shape."""
    gguf = pytest.importorskip("gguf")
    import tiny_models as tm

    d = tm.Dims(256, 2, 4, 2, 512)
    vocab = tm.filler_spm_vocab(1000)
    assert len(set(vocab.tokens)) == 1000 and vocab.tokens[:3] == ["<unk>", "<s>", "</s>"]
    for wtype in ("f16", "q8_0"):
        streamed = gguf.GGUFReader(tm.write_llama_1b(tmp_path / f"s{wtype}.gguf", wtype, d=d, n_vocab=1000))
        first, last = tm._ends(d, 1000, wtype, wtype)
        layers = tm._layers(d, lambda il: (wtype, wtype))
        for t in layers:
            t.std = 0.02
        meta = tm._common_metadata("llama", d, n_ctx=2048)
        whole = gguf.GGUFReader(tm.write_gguf(tmp_path / f"w{wtype}.gguf", "llama", meta, vocab, first + layers + last))
        assert [t.name for t in streamed.tensors] == [t.name for t in whole.tensors]
        for a, b in zip(streamed.tensors, whole.tensors):
            assert (a.tensor_type, list(a.shape)) == (b.tensor_type, list(b.shape)) and (a.data == b.data).all()
    assert tm.TINYLLAMA_1B == tm.Dims(n_embd=2048, n_layer=22, n_head=32, n_head_kv=4, n_ff=5632)


def _tool(path, script):
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


def test_a_reference_tool_killed_by_sigill_is_named_so(monkeypatch, tmp_path):
    """What a build for another CPU, or AMX a VM lists without granting, does: detected, not assumed."""
    monkeypatch.setattr(llama_cpp_reference, "bin_dir", lambda: tmp_path)
    _tool(tmp_path / "llama-bench", 'kill -ILL $$\n')
    with pytest.raises(RuntimeError, match=r"^llama-bench failed \(killed by SIGILL: an instruction this CPU"):
        llama_cpp_reference.llama_bench("m.gguf", 1, (8,), 4, 1)
    _tool(tmp_path / llama_cpp_reference.RPC_SERVER, 'kill -ILL $$\n')
    with pytest.raises(RuntimeError, match=r"rpc-server on 127\.0\.0\.1:\d+ exited at start \(killed by SIGILL"):
        with llama_cpp_reference.rpc_servers(1, 1):
            pass
