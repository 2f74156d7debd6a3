"""The pinned ggml and how it is built for this machine.

ggml comes from the llama.cpp tree vendored in one pinned llama-cpp-python
sdist (fetched with pip, hash-checked). It is built with cmake into a cache
directory per ggml version and variant,
`$GGML_DISTRIBUTED_CACHE/ggml-<version>-<variant>/` (default cache
`~/.cache/ggml-distributed`), holding `lib/` (libggml.so.0, libggml-base,
the CPU backend) and `include/` (the headers the cdef is generated from), and
`build-info.json`, written last: a directory without it is not a build.

Variants (docs/architecture.md, "The binding", says which is the default and why):
  native-<cpu>  GGML_NATIVE=ON: the CPU backend compiled for this CPU only;
                <cpu> is a hash of the CPU's model and flags, so a cache shared
                by machines of different CPUs never loads another's build.
  cpu-all       GGML_BACKEND_DL=ON + GGML_CPU_ALL_VARIANTS=ON: one CPU backend
                per x86 ISA level, the best one picked when loaded.

Stdlib only: the install's build backend (`_build_backend.py`) runs this before
any dependency is installed. `python -m ggml_ffi.ggml_build [--variant V]`
builds (or finds) the library and prints its directory.

Upgrading ggml: change the three PIN_ constants, run
`python -m ggml_ffi.ggml_build && python -m ggml_ffi.gen_cdef`, commit `_cdef.h`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

PIN_SDIST = "llama_cpp_python"
PIN_SDIST_VERSION = "0.3.36"
PIN_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
GGML_VERSION = "0.25.3"  # the ggml version in that sdist's llama.cpp tree (ggml/CMakeLists.txt)

DEFAULT_VARIANT = "native"
VARIANTS = ("native", "cpu-all")
INFO_FILE = "build-info.json"
# what the build needs: no llama.cpp tools, no tests, no network clients
_CMAKE_COMMON = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",  # the libraries find each other where they are copied to
    "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF",
    # llamafile's tinyBLAS: its kernels for the 32-element quants (q8_0, q5_0, q4_0, ...) sum each
    # output exactly as ggml's vec_dot does (tests/ffi/test_kernels.py), 1.5x faster from 2 batch rows on
    # (gemma3's q5_0 and q8_0 tensors); _SOURCE_PATCHES keeps it off the float types, where it does not
    "-DGGML_LLAMAFILE=ON",
]
# Edits to the pinned source before it is built: (file under the llama.cpp tree, text, replacement).
# tinyBLAS's f32/f16/bf16 kernels sum in another order than vec_dot and take only some shapes (rows
# a multiple of 4): a worker's share of an f16 output head and the whole head, or a row decoded
# alone and in a batch, would differ in the last bits. With this edit they go to vec_dot as before.
# Its quantized kernels sum exactly as vec_dot does, but with fewer than 12 columns over weights far
# larger than the caches they ran up to 2.6x slower than vec_dot (gemma3's 168 MB q8_0 head times 2
# rows: 32 ms against 12 at 1 thread; 9-11 columns 1.3-1.5x, 8 about even; at 16.7 MB 1.7x; at 11 MB
# and below tinyBLAS is faster, and at 12 and 16 columns): such products go to vec_dot too, with the
# same bits (tests/ffi/test_kernels.py).
SGEMM_SMALL_N, SGEMM_LARGE_WEIGHT_BYTES = 12, 16 << 20
_SOURCE_PATCHES = [
    ("ggml/src/ggml-cpu/llamafile/sgemm.cpp",
     "    if (Ctype != GGML_TYPE_F32)\n        return false;\n",
     "    if (Ctype != GGML_TYPE_F32)\n        return false;\n"
     "    // ggml-distributed: float weights stay on vec_dot (the same sums for every batch shape)\n"
     "    if (Atype == GGML_TYPE_F32 || Atype == GGML_TYPE_F16 || Atype == GGML_TYPE_BF16)\n"
     "        return false;\n"
     "    // ggml-distributed: a few columns times weights beyond the caches stream faster through\n"
     "    // vec_dot, which adds exactly as tinyBLAS's quantized kernels do\n"
     f"    if (n < {SGEMM_SMALL_N} && (size_t) m * (size_t) k * ggml_type_size((enum ggml_type) Atype) > "
     f"{SGEMM_LARGE_WEIGHT_BYTES}u)\n"
     "        return false;\n"),
]
_CMAKE_VARIANT = {
    "native": ["-DGGML_NATIVE=ON"],
    "cpu-all": ["-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON"],
}


class BuildUnavailable(RuntimeError):
    """The build cannot run here (no cmake or compiler, the sdist cannot be fetched)."""


def cache_root() -> pathlib.Path:
    root = os.environ.get("GGML_DISTRIBUTED_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ggml-distributed")
    return pathlib.Path(root)


def write_in_cache(path: pathlib.Path, data: bytes) -> None:
    """Write a file of the cache whole or not at all: processes starting at the
    same time read the old file or the new one, never a part. Raises OSError
    (a read-only cache) and leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")  # per writer
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def cpu_tag() -> str:
    """A short hash of what a native build depends on: the CPU model and its flags."""
    facts = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and line not in facts:
                    facts.append(line)
                if key in ("flags", "Features"):
                    break  # the first processor's block says it all
    except OSError:
        pass
    return hashlib.sha256("".join(facts).encode()).hexdigest()[:10]


def recipe(variant: str) -> dict:
    """What a build of `variant` is made with besides the source: its cmake flags and source edits."""
    return {"cmake_flags": _CMAKE_COMMON + _CMAKE_VARIANT[variant], "source_patches": _SOURCE_PATCHES}


def recipe_tag(variant: str) -> str:
    """A short hash of recipe(variant): builds with other flags or edits live in other directories,
    so changing them never reuses (nor replaces) a build made the old way."""
    return hashlib.sha256(json.dumps(recipe(variant), sort_keys=True).encode()).hexdigest()[:8]


def variant_dir_name(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"unknown ggml build variant {variant!r} (one of {', '.join(VARIANTS)})")
    suffix = f"native-{cpu_tag()}" if variant == "native" else variant
    return f"ggml-{GGML_VERSION}-{suffix}-{recipe_tag(variant)}"


def requested_variant() -> str:
    return os.environ.get("GGML_DISTRIBUTED_GGML_VARIANT") or DEFAULT_VARIANT


def build_dir(variant: str | None = None) -> pathlib.Path:
    return cache_root() / variant_dir_name(variant or requested_variant())


def is_finished(d: pathlib.Path) -> bool:
    """A finished build: its build-info.json (written last) reads, and its libggml is there. The flags
    and edits it was made with are today's: the directory's name carries their hash (recipe_tag)."""
    try:
        json.loads((d / INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (d / "lib" / "libggml.so.0").exists()


def find_build() -> pathlib.Path | None:
    """The finished build of the pinned ggml for this machine, or None.
    The requested variant first, then any other finished one."""
    order = [requested_variant()] + [v for v in VARIANTS if v != requested_variant()]
    for variant in order:
        if is_finished(build_dir(variant)):
            return build_dir(variant)
    return None


def say(msg: str) -> None:
    """Progress for whoever installs: pip captures a build backend's output (shown
    only with -v), so it goes to the terminal as well when there is one."""
    line = f"[ggml-distributed] {msg}\n"
    sys.stderr.write(line)
    sys.stderr.flush()
    if not sys.stderr.isatty():
        try:
            with open("/dev/tty", "w") as tty:
                tty.write(line)
        except OSError:
            pass


def _fetch_sdist(dest: pathlib.Path) -> pathlib.Path:
    name = f"{PIN_SDIST}-{PIN_SDIST_VERSION}.tar.gz"
    cached = cache_root() / name
    if not cached.is_file() or _sha256(cached) != PIN_SDIST_SHA256:
        say(f"fetching {PIN_SDIST}=={PIN_SDIST_VERSION} (its llama.cpp tree carries ggml {GGML_VERSION}) with pip")
        req = dest / "requirements.txt"
        req.write_text(f"{PIN_SDIST.replace('_', '-')}=={PIN_SDIST_VERSION} --hash=sha256:{PIN_SDIST_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--require-hashes", "-r", str(req), "-d", str(dest), "--disable-pip-version-check"]
        # inside pip's build of this package: its isolation (PYTHONPATH, ...) hides the environment's own
        # pip, and its hook variables (_PYPROJECT_HOOKS_BACKEND_PATH) would be taken by the sdist's build
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")
               and not k.startswith(("_PYPROJECT_HOOKS", "PEP517_", "PIP_BUILD_TRACKER", "PIP_REQ_TRACKER"))}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        found = sorted(dest.glob(f"{PIN_SDIST}-{PIN_SDIST_VERSION}.tar.gz"))
        if run.returncode != 0 or not found:
            raise BuildUnavailable(f"cannot fetch the ggml source: {' '.join(cmd)}\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(found[0], cached)
    if _sha256(cached) != PIN_SDIST_SHA256:
        raise BuildUnavailable(f"{cached} does not have the pinned sha256 {PIN_SDIST_SHA256}")
    return cached


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _unpack_llama_cpp(sdist: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    prefix = f"{PIN_SDIST}-{PIN_SDIST_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        tar.extractall(dest, members=members, filter="data") if hasattr(tarfile, "data_filter") \
            else tar.extractall(dest, members=members)
    src = dest / prefix
    if not (src / "ggml" / "CMakeLists.txt").is_file():
        raise BuildUnavailable(f"{sdist} has no llama.cpp tree with ggml under {prefix}")
    return src


def _patch_source(src: pathlib.Path) -> None:
    """Apply _SOURCE_PATCHES; a text that is not there exactly once fails the build (a new pin
    must be looked at again, not built without the edit)."""
    for rel, text, replacement in _SOURCE_PATCHES:
        path = src / rel
        code = path.read_text()
        if code.count(text) != 1:
            raise BuildUnavailable(f"cannot apply the source edit to {rel}: its anchor is not there exactly once "
                                   f"(ggml {GGML_VERSION}); see _SOURCE_PATCHES in {__file__}")
        path.write_text(code.replace(text, replacement))


def _tools() -> tuple[str, str]:
    cmake = shutil.which("cmake")
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    missing = [n for n, p in (("cmake", cmake), ("a C compiler", cc), ("a C++ compiler", cxx)) if p is None]
    if missing:
        raise BuildUnavailable(f"cannot build ggml: {' and '.join(missing)} not found")
    return cmake, "Ninja" if shutil.which("ninja") else "Unix Makefiles"


def _run_with_progress(cmd: list[str], log: pathlib.Path, what: str) -> None:
    """Run a build command; echo its progress lines ([12/34] ...) so a long
    install is not silent; keep the whole output in `log`."""
    with open(log, "a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        last = 0.0
        for line in proc.stdout:
            out.write(line)
            if line.startswith("[") and time.monotonic() - last > 2.0:
                say(f"{what}: {line.strip()[:100]}")
                last = time.monotonic()
        if proc.wait() != 0:
            raise BuildUnavailable(f"{what} failed (exit {proc.returncode}); the full log is {log}")


def build(variant: str | None = None, jobs: int | None = None) -> pathlib.Path:
    """Build the pinned ggml into its cache directory (a no-op when it is there)."""
    variant = variant or requested_variant()
    final = build_dir(variant)
    if is_finished(final):
        return final
    cmake, generator = _tools()
    jobs = jobs or max(1, os.cpu_count() or 1)
    cache_root().mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    say(f"building ggml {GGML_VERSION} ({variant}) into {final}; this takes minutes once, then it is cached")
    with tempfile.TemporaryDirectory(prefix="ggml-build-", dir=cache_root()) as tmp:
        tmp = pathlib.Path(tmp)
        src = _unpack_llama_cpp(_fetch_sdist(tmp), tmp / "src")
        _patch_source(src)
        bdir, log = tmp / "build", cache_root() / f"{final.name}.build.log"
        log.write_text("")
        flags = _CMAKE_COMMON + _CMAKE_VARIANT[variant]
        _run_with_progress([cmake, "-S", str(src), "-B", str(bdir), "-G", generator, *flags], log, "configure")
        _run_with_progress([cmake, "--build", str(bdir), "-j", str(jobs), "--target", "ggml"], log, "build")
        stage = tmp / "out"
        (stage / "lib").mkdir(parents=True)
        # what is loaded: the sonames (libggml.so.0, ...) and GGML_BACKEND_DL's CPU variants
        # (libggml-cpu-haswell.so, ...), as plain files (a wheel cannot hold symlinks)
        libs = [p for p in (bdir / "bin").glob("libggml*.so*") if p.name.endswith(".so.0")
                or (p.name.startswith("libggml-cpu-") and p.name.endswith(".so"))]
        if not any(p.name == "libggml.so.0" for p in libs):
            raise BuildUnavailable(f"the build made no libggml.so.0 (see {log})")
        for p in libs:
            shutil.copyfile(p, stage / "lib" / p.name)
        shutil.copytree(src / "ggml" / "include", stage / "include")
        info = {"ggml_version": GGML_VERSION, "variant": variant, "source": f"{PIN_SDIST}=={PIN_SDIST_VERSION}",
                "sdist_sha256": PIN_SDIST_SHA256, "cmake_flags": flags, "source_patches": _SOURCE_PATCHES,
                "cpu_tag": cpu_tag(),
                "build_seconds": round(time.monotonic() - started, 1)}
        (stage / INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
        if final.exists():  # an unfinished earlier attempt
            shutil.rmtree(final)
        os.replace(stage, final)
    say(f"built ggml {GGML_VERSION} ({variant}) in {time.monotonic() - started:.0f} s")
    return final


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ggml_ffi.ggml_build", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=VARIANTS, default=None, help=f"default: $GGML_DISTRIBUTED_GGML_VARIANT or {DEFAULT_VARIANT}")
    p.add_argument("--jobs", type=int, default=None)
    args = p.parse_args(argv)
    try:
        print(build(args.variant, args.jobs))
    except BuildUnavailable as exc:
        say(str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
