"""Reference logits from llama.cpp itself, for tests/coordinator/test_model_reference.py.

    python bench/record_reference_logits.py [CASE ...]   # (re)record tests/fixtures/reference/CASE.npz

For each case of tests/tiny_models.py's REFERENCE_CASES (default: all) this writes the
tiny random-weight GGUF with the same writer the tests use, has llama.cpp evaluate
fixed token sequences with it, and saves what llama.cpp computed:

* ``tokens``: the prompt; ``logits``: llama.cpp's logits at every prompt position
  (f32, [n_prompt, n_vocab], one batch with logits_all);
* ``continuation``: N_CONTINUE greedy tokens (the first is the argmax after the
  prompt) and ``continuation_logits``: the logits after feeding each of them, one
  token per step;
* ``gguf_sha256`` of the file evaluated (a writer change is detected by the test,
  which then asks for a re-recording), ``n_ctx``, ``model`` and ``llama_cpp``'s version.

The prompt is drawn from seeded random candidates: the first one whose top-1 / top-2
logit gap is at least MIN_GAP at every position of prompt and continuation, so that
the test's "argmax equal everywhere" cannot flip on rounding (its logit tolerance is
far below MIN_GAP).

llama.cpp is llama-cpp-python 0.3.36 built from the pinned sdist (the one
bench/vocab_fixtures.py fetches with pip) into a venv of its own outside the repo,
``$GGML_DISTRIBUTED_CACHE/reference-venv`` (default ``~/.cache/ggml-distributed``),
created on first use (a ~10 minute build on 2 cores); evaluation runs there, one
thread, KV cache f16, flash attention on (as our graphs), no extra buffer types (no
weight repacking, as on our workers; and llama.cpp's AMX kernels, which GGML_NATIVE
enables on CPUs that have AMX, crash where the OS does not grant AMX state).
$REFERENCE_PYTHON names another python to evaluate with (one where `import llama_cpp`
works), instead of the reference venv.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import zlib

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "reference"
N_PROMPT = 10
N_CONTINUE = 6
N_CANDIDATES = 24
MIN_GAP = 0.05


# ---------------------------------------------------------------- in the reference venv
def evaluate(job_path: str) -> None:
    """Runs under the reference venv's python: every candidate prompt of the job through
    llama.cpp, prompt logits and greedy continuation, into job["out"] (npz)."""
    import numpy as np
    import llama_cpp
    import llama_cpp.llama_cpp as low_level

    # no extra buffer types: no weight repacking (the workers compute on plain buffers too),
    # and no AMX buffers, whose kernels crash where the OS does not grant AMX state
    defaults = low_level.llama_model_default_params

    def plain_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = plain_buffers
    from llama_cpp import Llama

    job = json.loads(pathlib.Path(job_path).read_text())
    llm = Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_batch=64, n_ubatch=64, n_threads=1,
                n_threads_batch=1, logits_all=True, flash_attn=True, verbose=False)
    logits, conts, cont_logits = [], [], []
    for tokens in job["candidates"]:
        llm.reset()
        llm.eval(tokens)
        rows = np.array(llm.scores[:len(tokens)], dtype=np.float32)
        tok, cont, after = int(rows[-1].argmax()), [], []
        for _ in range(job["n_continue"]):
            cont.append(tok)
            llm.eval([tok])
            after.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
            tok = int(after[-1].argmax())
        logits.append(rows)
        conts.append(cont)
        cont_logits.append(np.stack(after))
    np.savez(job["out"], logits=np.stack(logits), continuation=np.array(conts, np.int32),
             continuation_logits=np.stack(cont_logits), version=np.array(llama_cpp.__version__))


# ---------------------------------------------------------------- in the project's python
def reference_python() -> pathlib.Path:
    """The reference venv's python, creating the venv and building llama-cpp-python from
    the pinned sdist into it if it is missing."""
    sys.path.insert(0, str(REPO / "bench"))
    import vocab_fixtures

    venv = vocab_fixtures.cache_dir() / "reference-venv"
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import llama_cpp, numpy"],
                                          capture_output=True).returncode == 0:
        return python
    sdist = vocab_fixtures.sdist_path()
    print(f"building llama-cpp-python {vocab_fixtures.SDIST_VERSION} into {venv} (about 10 minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF", CMAKE_BUILD_PARALLEL_LEVEL="2")
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(sdist), "numpy"], check=True, env=env)
    return python


def top_gap(rows):
    """Per row: the largest logit minus the second largest."""
    import numpy as np

    part = np.sort(rows, axis=-1)
    return part[..., -1] - part[..., -2]


def record(name: str, python: pathlib.Path, tmp: pathlib.Path) -> None:
    import numpy as np

    sys.path.insert(0, str(REPO / "tests"))
    import tiny_models

    model, n_ctx = tiny_models.REFERENCE_CASES[name]
    gguf = tiny_models.write_tiny_model(tmp / f"{name}.gguf", model)
    sha = hashlib.sha256(pathlib.Path(gguf).read_bytes()).hexdigest()
    n_vocab = len(tiny_models.MODELS[model]()[2].tokens)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    candidates = [rng.integers(0, n_vocab, N_PROMPT).tolist() for _ in range(N_CANDIDATES)]
    job = tmp / f"{name}.json"
    out = tmp / f"{name}-out.npz"
    job.write_text(json.dumps({"gguf": gguf, "n_ctx": n_ctx, "candidates": candidates, "n_continue": N_CONTINUE,
                               "out": str(out)}))
    subprocess.run([str(python), __file__, "--evaluate", str(job)], check=True)
    got = np.load(out)
    gaps = [min(top_gap(got["logits"][k]).min(), top_gap(got["continuation_logits"][k]).min())
            for k in range(N_CANDIDATES)]
    best = next((k for k in range(N_CANDIDATES) if gaps[k] >= MIN_GAP), None)
    if best is None:
        raise SystemExit(f"{name}: no candidate prompt keeps a top-2 gap of {MIN_GAP} (best {max(gaps):.4f})")
    FIXTURES.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(FIXTURES / f"{name}.npz", tokens=np.array(candidates[best], np.int32),
                        logits=got["logits"][best], continuation=got["continuation"][best],
                        continuation_logits=got["continuation_logits"][best], gguf_sha256=np.array(sha),
                        n_ctx=np.array(n_ctx), model=np.array(model), llama_cpp=got["version"])
    print(f"{name}: {model} n_ctx={n_ctx}, candidate {best}, min top-2 gap {gaps[best]:.3f}, "
          f"continuation {got['continuation'][best].tolist()} -> {FIXTURES / (name + '.npz')}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--evaluate"]:
        evaluate(argv[1])
        return 0
    sys.path.insert(0, str(REPO / "tests"))
    import tiny_models

    names = argv or list(tiny_models.REFERENCE_CASES)
    unknown = [n for n in names if n not in tiny_models.REFERENCE_CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; cases: {', '.join(tiny_models.REFERENCE_CASES)}", file=sys.stderr)
        return 2
    python = pathlib.Path(os.environ["REFERENCE_PYTHON"]) if os.environ.get("REFERENCE_PYTHON") else reference_python()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            record(name, python, pathlib.Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
