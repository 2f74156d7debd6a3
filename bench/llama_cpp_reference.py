"""llama.cpp's own tools, built from the same pinned source as our ggml, as the
reference our speed is measured against (kept outside the product, in the cache).

    python bench/llama_cpp_reference.py build     # fetch (hash-checked) + build, as below
    python bench/llama_cpp_reference.py bench [--model PATH] [--threads 1] [--pp 64] [--tg 32] [--reps 3]

`build` reproduces the reference build exactly: the llama.cpp tree of the pinned
llama-cpp-python sdist (ggml_ffi/ggml_build.py) unpacked at
`$GGML_DISTRIBUTED_CACHE/llama.cpp-<sdist version>/src`, then

    cmake -S src -B build -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build build -j2 --target llama-bench llama-perplexity ggml-rpc-server llama-tokenize llama-cli

(the rpc-server target is called ggml-rpc-server in this llama.cpp tree).

`bench` runs llama-bench in process and over 2 local rpc-servers (`-ngl 99
--rpc`), `--repack 0`, and prints pp/tg tokens/s. Running the built tools is
the product's (`ggml-coordinator bench` takes its reference rows from
coordinator/serving/llama_cpp_reference.py); building them is this script's.

What each side runs: the same ggml source, built -march=native; weights in
plain CPU buffers on both (our workers and in-process path place none in the
CPU_REPACK buffer type: for the bundled model only its q4_K tensors would be
repacked on x86, which measured no faster, docs/architecture.md "Extra buffer
types"; and llama.cpp's `--repack 1` also places weights in the AMX buffer
type, which dies of SIGILL on VMs that list AMX without granting it); flash
attention (llama-bench's `-fa auto` turns it on for the CPU) over an f16 KV
cache; ggml's tiled K-quant kernel (GGML_CPU_TILED_MM, on by default); in
the last layer the FFN runs for the rows that want logits only. Where the
builds differ: ours edits tinyBLAS to leave float weights to vec_dot
(ggml_build._SOURCE_PATCHES; the bundled model multiplies only quantized matrices,
so this changes nothing here).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.serving.llama_cpp_reference import (  # noqa: E402
    RPC_SERVER, bin_dir, missing, reference_rows, root)
from ggml_ffi import ggml_build  # noqa: E402

CONFIGURE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
TARGETS = ["llama-bench", "llama-perplexity", RPC_SERVER, "llama-tokenize", "llama-cli"]


def build() -> pathlib.Path:
    src = root() / "src"
    if not (src / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory(dir=ggml_build.cache_root()) as tmp:
            tree = ggml_build._unpack_llama_cpp(ggml_build._fetch_sdist(pathlib.Path(tmp)), pathlib.Path(tmp) / "x")
            src.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tree, src)
    subprocess.run(["cmake", "-S", "src", "-B", "build", *CONFIGURE], cwd=root(), check=True)
    subprocess.run(["cmake", "--build", "build", "-j2", "--target", *TARGETS], cwd=root(), check=True)
    return bin_dir()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build")
    b = sub.add_parser("bench")
    b.add_argument("--model", default=None)
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--pp", type=int, default=64)
    b.add_argument("--tg", type=int, default=32)
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--rpc", type=int, default=2)
    args = p.parse_args(argv)
    if args.cmd == "build":
        print(build())
        return 0
    why = missing()
    if why:
        print(why, file=sys.stderr)
        return 1
    from coordinator.model.default_model import default_model_path

    rows, notes = reference_rows(args.model or default_model_path(), args.threads, args.pp, args.tg, args.reps,
                                 args.rpc)
    for name, r in rows.items():
        print(f"{name:<24} pp{args.pp} {r.get('pp', 0):8.1f} t/s   tg{args.tg} {r.get('tg', 0):8.1f} t/s")
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
