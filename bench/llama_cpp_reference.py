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
--rpc`), `--repack 0`, and prints pp/tg tokens/s. `ggml-coordinator bench`
calls `reference_rows()` for its reference rows.

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
import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ggml_ffi import ggml_build  # noqa: E402

CONFIGURE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
# llama.cpp's rpc-server target and binary are named ggml-rpc-server in this tree (tools/rpc)
TARGETS = ["llama-bench", "llama-perplexity", "ggml-rpc-server", "llama-tokenize", "llama-cli"]
RPC_SERVER = "ggml-rpc-server"


def root() -> pathlib.Path:
    return ggml_build.cache_root() / f"llama.cpp-{ggml_build.PIN_SDIST_VERSION}"


def bin_dir() -> pathlib.Path:
    return root() / "build" / "bin"


def missing(*tools: str) -> str | None:
    """Why these reference tools cannot run here, or None."""
    absent = [t for t in tools or ("llama-bench",) if not (bin_dir() / t).is_file()]
    if absent:
        return f"llama.cpp reference not built ({', '.join(absent)} missing in {bin_dir()}): " \
               f"python bench/llama_cpp_reference.py build"
    return None


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def rpc_servers(n: int, threads: int):
    procs, endpoints = [], []
    try:
        for _ in range(n):
            port = _free_port()
            procs.append(subprocess.Popen([str(bin_dir() / RPC_SERVER), "-H", "127.0.0.1", "-p", str(port),
                                           "-t", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            endpoints.append(f"127.0.0.1:{port}")
        for ep in endpoints:  # bounded wait for each to listen
            host, port = ep.split(":")
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"llama.cpp rpc-server on {ep} did not start")
                    time.sleep(0.1)
        yield endpoints
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def llama_bench(model: str, threads: int, pp: int, tg: int, reps: int, rpc: list[str] | None = None) -> dict:
    """{'pp': t/s, 'tg': t/s} from llama-bench's JSON (the mean over reps)."""
    cmd = [str(bin_dir() / "llama-bench"), "-m", model, "-t", str(threads), "-p", str(pp), "-n", str(tg),
           "-r", str(reps), "--repack", "0", "-o", "json"]
    if rpc:
        cmd += ["-ngl", "99", "--rpc", ",".join(rpc)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({run.returncode}): {run.stderr[-2000:]}")
    out = {}
    for row in json.loads(run.stdout):
        out["pp" if row["n_prompt"] else "tg"] = row["avg_ts"]
    return out


def reference_rows(model: str, threads: int, pp: int, tg: int, reps: int,
                   n_rpc: int) -> tuple[dict[str, dict], list[str]]:
    """({row: {"pp", "tg"}}, notes): in process, and over n_rpc rpc-servers when built."""
    rows, notes = {"llama.cpp": llama_bench(model, threads, pp, tg, reps)}, []
    if n_rpc > 1:
        why = missing(RPC_SERVER)
        if why:
            notes.append(f"llama.cpp rpc row skipped: {why}")
        else:
            with rpc_servers(n_rpc, threads) as eps:
                rows[f"llama.cpp rpc x{n_rpc}"] = llama_bench(model, threads, pp, tg, reps, eps)
    return rows, notes


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
