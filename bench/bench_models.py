"""Bench models: random-weight GGUFs of real models' shapes, built once into the
cache and found there by name (`ggml-coordinator bench --model-1b`).

    python bench/bench_models.py build [--force]   # build the 1B model once; prints its path and type
    python bench/bench_models.py path              # its path and what it is, or why there is none (exit 1)

1b: TinyLlama 1.1B's shape (llama, 22 layers, n_embd 2048, 32 heads / 4 KV heads,
n_ff 5632, 32000 tokens, an own output head; 1.1 B parameters) with random weights
(tests/tiny_models.py's write_llama_1b, layer weights N(0, 0.02)), written in f16
and quantized to Q4_K_M by llama.cpp's own llama-quantize from the reference build
(`python bench/llama_cpp_reference.py build`). Without that build (or if
llama-quantize fails) it is written in Q8_0 by gguf-py instead, and says so.
Built once: the file is named by a hash of everything it is made from
(`$GGML_DISTRIBUTED_CACHE/bench-models/llama-1b-<type>-<key>.gguf`, default cache
~/.cache/ggml-distributed), and `bench-models/1b.json` names the one `--model-1b`
runs (a Q4_K_M one is preferred: once llama-quantize is built, `build` makes it).
Writing takes about a minute and 2.2 GB of disk for the f16 intermediate (deleted
after); the Q4_K_M file is about 0.65 GB.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from bench import llama_cpp_reference as ref  # noqa: E402  (stdlib only: no libggml)
from coordinator.serving.benchmark import bench_model_pointer  # noqa: E402
from coordinator.serving.llama_cpp_reference import describe_exit  # noqa: E402

NAME = "1b"
WRITER_VERSION = 1  # bump when write_llama_1b's output changes: the key changes and the model is rebuilt
SHAPE = {"arch": "llama", "n_layer": 22, "n_embd": 2048, "n_head": 32, "n_head_kv": 4, "n_ff": 5632,
         "n_vocab": 32000, "n_ctx": 2048, "seed": 0, "layer_std": 0.02, "writer": WRITER_VERSION}
DESCRIPTION = ("bench-1b: TinyLlama 1.1B's shape (llama, 22 layers, n_embd 2048, 32/4 heads, n_ff 5632, "
               "32000 tokens), random weights")
QUANTIZER = f"llama-quantize (llama.cpp of llama-cpp-python {ref.ggml_build.PIN_SDIST_VERSION})"


def key(wtype: str, made_by: str) -> str:
    made_of = json.dumps(dict(SHAPE, type=wtype, made_by=made_by), sort_keys=True)
    return hashlib.sha256(made_of.encode()).hexdigest()[:12]


def model_path(wtype: str, made_by: str) -> pathlib.Path:
    return bench_model_pointer(NAME).parent / f"llama-1b-{wtype.lower()}-{key(wtype, made_by)}.gguf"


def _write(path: pathlib.Path, wtype: str) -> None:
    from tiny_models import Dims, write_llama_1b

    d = Dims(SHAPE["n_embd"], SHAPE["n_layer"], SHAPE["n_head"], SHAPE["n_head_kv"], SHAPE["n_ff"])
    write_llama_1b(path, wtype, seed=SHAPE["seed"], d=d, n_vocab=SHAPE["n_vocab"], n_ctx=SHAPE["n_ctx"],
                   layer_std=SHAPE["layer_std"])


def _tmp(path: pathlib.Path, what: str) -> pathlib.Path:
    return path.with_name(f".{path.stem}.{what}.tmp{os.getpid()}.gguf")


def _quantize(out: pathlib.Path) -> str | None:
    """Write the Q4_K_M model at `out` with llama-quantize: None, or why it could not."""
    tool = ref.bin_dir() / "llama-quantize"
    if not tool.is_file():
        return f"llama-quantize is not built ({tool} missing: python bench/llama_cpp_reference.py build)"
    f16, q = _tmp(out, "f16"), _tmp(out, "q4_k_m")
    log = out.with_suffix(".quantize.log")
    try:
        print(f"writing the f16 model ({f16}) ...", file=sys.stderr)
        _write(f16, "f16")
        print(f"quantizing to Q4_K_M with {tool} (log: {log}) ...", file=sys.stderr)
        with open(log, "w") as f:
            run = subprocess.run([str(tool), str(f16), str(q), "Q4_K_M", str(os.cpu_count() or 1)],
                                 stdout=f, stderr=subprocess.STDOUT)
        if run.returncode != 0:
            return f"llama-quantize failed ({describe_exit(run.returncode)}; log: {log})"
        os.replace(q, out)
        return None
    finally:
        for tmp in (f16, q):
            tmp.unlink(missing_ok=True)


def build(force: bool = False) -> dict:
    """Build the 1B model unless there, name it in the pointer file, and return the pointer's record."""
    pointer = bench_model_pointer(NAME)
    pointer.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    made_by, wtype, note = QUANTIZER, "Q4_K_M", None
    path = model_path(wtype, made_by)
    if force or not path.is_file():
        why = _quantize(path)
        if why is not None:
            made_by, wtype = "gguf-py", "Q8_0"
            note = f"Q8_0 instead of Q4_K_M: {why}"
            print(note, file=sys.stderr)
            path = model_path(wtype, made_by)
            if force or not path.is_file():
                tmp = _tmp(path, "q8_0")
                try:
                    print(f"writing the Q8_0 model ({path}) with gguf-py ...", file=sys.stderr)
                    _write(tmp, "q8_0")
                    os.replace(tmp, path)
                finally:
                    tmp.unlink(missing_ok=True)
    record = {"name": NAME, "path": str(path), "type": wtype, "made_by": made_by, "bytes": path.stat().st_size,
              "description": f"{DESCRIPTION}, {wtype} made by {made_by}", "shape": SHAPE}
    if note:
        record["note"] = note
    tmp = pointer.with_name(f".{pointer.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, pointer)
    print(f"{path} ({wtype}, {record['bytes'] / 2**30:.2f} GiB; {time.monotonic() - started:.0f} s)", file=sys.stderr)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the 1B bench model once (kept in the cache) and print its path")
    b.add_argument("--force", action="store_true", help="write it again even if there")
    sub.add_parser("path", help="print its path and what it is, or why there is none (exit 1)")
    args = p.parse_args(argv)
    if args.cmd == "build":
        print(build(args.force)["path"])
        return 0
    from coordinator.serving.benchmark import bench_model

    path, what = bench_model(NAME)
    print(path or what)
    if path:
        print(what)
    return 0 if path else 1


if __name__ == "__main__":
    sys.exit(main())
