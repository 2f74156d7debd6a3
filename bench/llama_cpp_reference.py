"""llama.cpp's own tools, built from the same pinned source as our ggml, as the
reference our speed is measured against (kept outside the product, in the cache).

    python bench/llama_cpp_reference.py build [--quiet]   # fetch (hash-checked) + build once, as below
    python bench/llama_cpp_reference.py status            # built (exit 0), or why not (exit 1)
    python bench/llama_cpp_reference.py bench [--model PATH] [--threads 1] [--pp 64] [--tg 32] [--reps 3]

`build` reproduces the reference build exactly: the llama.cpp tree of the pinned
llama-cpp-python sdist (ggml_ffi/ggml_build.py) unpacked at
`$GGML_DISTRIBUTED_CACHE/llama.cpp-<sdist version>/src`, then

    cmake -S src -B build -DCMAKE_BUILD_TYPE=Release -DGGML_RPC=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \\
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    cmake --build build -j<cores> --target llama-bench llama-perplexity ggml-rpc-server llama-tokenize \\
          llama-completion llama-quantize llama-server

(the rpc-server target is called ggml-rpc-server in this llama.cpp tree; tests/interop
runs llama-completion, llama-cli's one-shot mode; llama-quantize makes
bench/bench_models.py's Q4_K_M model; llama-server is bench/bench_serve.py's reference). About 8 minutes on 2 cores. Built once:
`build/reference-build.json`, written last, records the recipe (sdist, flags,
targets) and the CPU it was built for (-march=native), and a build of the same
recipe for this CPU is kept (`--force` builds anyway). `--quiet` sends the tools'
output to `build.log` beside the build and prints its tail if it fails (exit 1);
.ci/run builds it so. The `build` path needs only the standard library (it runs
before the project is installed) and cmake and a C++ compiler.

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
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _ggml_build():
    """ggml_ffi/ggml_build.py alone, stdlib only (as the install's build backend loads it): `build`
    runs before the project is installed (.ci/run), and `import ggml_ffi` would load libggml."""
    if "ggml_ffi.ggml_build" in sys.modules:
        return sys.modules["ggml_ffi.ggml_build"]
    spec = importlib.util.spec_from_file_location("_reference_ggml_build", os.path.join(ROOT, "ggml_ffi",
                                                                                          "ggml_build.py"))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ggml_build = _ggml_build()

RPC_SERVER = "ggml-rpc-server"  # llama.cpp's rpc-server target in this tree (tools/rpc)
CONFIGURE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"]
# llama-completion is llama-cli's one-shot mode, which tests/interop runs; llama-quantize makes
# bench/bench_models.py's Q4_K_M; llama-server is bench/bench_serve.py's reference row
TARGETS = ["llama-bench", "llama-perplexity", RPC_SERVER, "llama-tokenize", "llama-completion", "llama-quantize",
           "llama-server"]
PRODUCTS = TARGETS + ["libggml-rpc.so"]  # what a build leaves in build/bin (the library: tests/interop)
STAMP = "reference-build.json"  # in build/, written last: what the binaries were built from, and for which CPU
LOG_TAIL = 60


def root() -> pathlib.Path:
    """coordinator.serving.llama_cpp_reference.root(), without importing the product (tested equal)."""
    return ggml_build.cache_root() / f"llama.cpp-{ggml_build.PIN_SDIST_VERSION}"


def bin_dir() -> pathlib.Path:
    return root() / "build" / "bin"


def recipe() -> dict:
    """What the binaries are a function of: the source, the flags, the targets, the CPU (-march=native)."""
    return {"sdist": f"{ggml_build.PIN_SDIST}=={ggml_build.PIN_SDIST_VERSION}",
            "sdist_sha256": ggml_build.PIN_SDIST_SHA256, "cmake_flags": CONFIGURE, "targets": TARGETS,
            "cpu_tag": ggml_build.cpu_tag()}


def built() -> str | None:
    """Why the reference must be (re)built, or None when build/bin holds this recipe's binaries."""
    try:
        stamp = json.loads((root() / "build" / STAMP).read_text())
    except (OSError, ValueError):
        return f"not built ({root() / 'build' / STAMP} missing)"
    stale = sorted(k for k, v in recipe().items() if stamp.get(k) != v)
    if stale:
        return f"built from another recipe ({', '.join(stale)} changed)"
    absent = [p for p in PRODUCTS if not (bin_dir() / p).is_file()]
    return f"{', '.join(absent)} missing in {bin_dir()}" if absent else None


def _run(cmd: list[str], log) -> None:
    if log is not None:
        log.write(f"+ {' '.join(cmd)}\n")
        log.flush()
    subprocess.run(cmd, cwd=root(), check=True, stdout=log, stderr=subprocess.STDOUT if log else None)


def build(log_path: pathlib.Path | None = None, force: bool = False) -> pathlib.Path:
    """Fetch (hash-checked), unpack and build once: a build of this recipe already there is kept.
    log_path: the tools' output goes there instead of the terminal."""
    why = "forced" if force else built()
    if why is None:
        ggml_build.say(f"llama.cpp reference already built in {bin_dir()}")
        return bin_dir()
    ggml_build.say(f"building the llama.cpp reference ({why}) into {root()}"
                   + (f"; log: {log_path}" if log_path else ""))
    started = time.monotonic()
    src = root() / "src"
    if not (src / "CMakeLists.txt").is_file():
        ggml_build.cache_root().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=ggml_build.cache_root()) as tmp:
            tree = ggml_build._unpack_llama_cpp(ggml_build._fetch_sdist(pathlib.Path(tmp)), pathlib.Path(tmp) / "x")
            src.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tree, src)
    (root() / "build" / STAMP).unlink(missing_ok=True)
    log = open(log_path, "w") if log_path else None
    try:
        _run(["cmake", "-S", "src", "-B", "build", *CONFIGURE], log)
        _run(["cmake", "--build", "build", f"-j{os.cpu_count() or 2}", "--target", *TARGETS], log)
    finally:
        if log is not None:
            log.close()
    absent = [p for p in PRODUCTS if not (bin_dir() / p).is_file()]
    if absent:
        raise ggml_build.BuildUnavailable(f"the build left no {', '.join(absent)} in {bin_dir()}")
    info = dict(recipe(), build_seconds=round(time.monotonic() - started, 1))
    (root() / "build" / STAMP).write_text(json.dumps(info, indent=1) + "\n")
    ggml_build.say(f"built the llama.cpp reference in {time.monotonic() - started:.0f} s: {bin_dir()}")
    return bin_dir()


def _tail(path: pathlib.Path, n: int = LOG_TAIL) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-n:])
    except OSError:
        return ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    bl = sub.add_parser("build", help="build once into the cache (a build of this recipe there is kept)")
    bl.add_argument("--quiet", action="store_true",
                    help="the tools' output to build.log beside the build, its tail printed if it fails")
    bl.add_argument("--force", action="store_true", help="build even if built")
    sub.add_parser("status", help="say whether it is built (exit 0) or why not (exit 1)")
    b = sub.add_parser("bench")
    b.add_argument("--model", default=None)
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--pp", type=int, default=64)
    b.add_argument("--tg", type=int, default=32)
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--rpc", type=int, default=2)
    args = p.parse_args(argv)
    if args.cmd == "status":
        why = built()
        print(f"llama.cpp reference: {why or 'built'} ({bin_dir()})")
        return 1 if why else 0
    if args.cmd == "build":
        log = root() / "build.log" if args.quiet else None
        try:
            print(build(log, args.force))
        except (subprocess.CalledProcessError, OSError, ggml_build.BuildUnavailable) as exc:
            print(f"llama.cpp reference build failed: {exc}", file=sys.stderr)
            if log is not None:
                print(f"--- the last {LOG_TAIL} lines of {log}:\n{_tail(log)}", file=sys.stderr)
            return 1
        return 0
    from coordinator.model.default_model import default_model_path
    from coordinator.serving.llama_cpp_reference import missing, reference_rows

    why = missing()
    if why:
        print(why, file=sys.stderr)
        return 1
    rows, notes = reference_rows(args.model or default_model_path(), args.threads, (args.pp,), args.tg, args.reps,
                                 args.rpc)
    for name, r in rows.items():
        print(f"{name:<24} pp{args.pp} {r.get(f'pp{args.pp}', 0):8.1f} t/s   tg{args.tg} {r.get('tg', 0):8.1f} t/s")
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
