"""The CPU backend's extra buffer types (CPU_REPACK, AMX, ...): which of them this
machine can really run.

CPUID is not enough: on a VM that lists amx_tile/amx_int8, the kernel may still
not grant the tile state (arch_prctl answers 0 but the permission never shows),
and ggml's AMX kernel then dies of SIGILL (llama.cpp's repacked q8_0 path does,
on the development VM). So each type is tried in a child process, whose death
costs nothing: a weight in that buffer type times a batch, compared with the
plain CPU buffer's result. The answer is kept per library file, CPU and kernel
release in the ggml cache, so a worker's start does not pay for it again.

Neither our workers nor the in-process path place weights in these buffers
(docs/architecture.md, "Extra buffer types": on x86 only q4_0/q4_K/... are
repacked, and for the bundled model's q4_K tensors it measured no faster):
the probe says what the machine allows, for the logs, DEVICE_INFO and the
decision; `python -m ggml_ffi.extra_buffers` prints it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
from functools import lru_cache

from ggml_ffi import ggml_build
from ggml_ffi._loader import cpu_library, ffi, lib, library_path

PROBE_TIMEOUT = 60.0

_CHILD = r"""
import json, sys
import numpy as np
from ggml_ffi import Context, CpuBackend, ffi, lib
from ggml_ffi.extra_buffers import buffer_types
name, k, rows, n = sys.argv[1], 512, 64, 32
be = CpuBackend(1)
rng = np.random.default_rng(0)
w = rng.standard_normal((rows, k)).astype(np.float32)
x = rng.standard_normal((n, k)).astype(np.float32)
out = {}
for wtype in ("Q8_0", "Q4_0", "Q4_K"):
    results = []
    for buft in (lib.ggml_backend_get_default_buffer_type(be.ptr), buffer_types()[name]):
        with Context(8) as ctx:
            a = ctx.new_tensor(getattr(lib, "GGML_TYPE_" + wtype), [k, rows])
            q = ffi.new("char[]", lib.ggml_nbytes(a))
            lib.ggml_quantize_chunk(a.type, ffi.cast("float *", ffi.from_buffer(w)), q, 0, rows, k, ffi.NULL)
            wbuf = lib.ggml_backend_buft_alloc_buffer(buft, lib.ggml_backend_buft_get_alloc_size(buft, a))
            base = lib.ggml_backend_buffer_get_base(wbuf)
            assert lib.ggml_backend_tensor_alloc(wbuf, a, base) == 0
            if a.extra == ffi.NULL and buft != lib.ggml_backend_get_default_buffer_type(be.ptr):
                lib.ggml_backend_buffer_free(wbuf)  # a type this buffer does not take (its set_tensor would crash)
                break
            lib.ggml_backend_tensor_set(a, q, 0, lib.ggml_nbytes(a))
            b = ctx.new_tensor(lib.GGML_TYPE_F32, [k, n])
            c = lib.ggml_mul_mat(ctx.ptr, a, b)
            gf = ctx.new_graph(8)
            lib.ggml_build_forward_expand(gf, c)
            xbuf = lib.ggml_backend_alloc_ctx_tensors(ctx.ptr, be.ptr)
            lib.ggml_backend_tensor_set(b, ffi.from_buffer(x), 0, x.nbytes)
            assert be.compute(gf) == 0
            res = np.frombuffer(ffi.buffer(c.data, rows * n * 4), np.float32).copy()
            results.append(res)
            lib.ggml_backend_buffer_free(xbuf)
            lib.ggml_backend_buffer_free(wbuf)
    if len(results) == 2:
        out[wtype] = float(np.abs(results[0] - results[1]).max() / (np.abs(results[0]).max() + 1e-30))
print(json.dumps(out))
"""


def buffer_types() -> dict:
    """{name: ggml_backend_buffer_type_t} of the CPU device's extra buffer types."""
    cpu = cpu_library()
    fn = lib.ggml_backend_reg_get_proc_address(cpu.reg, b"ggml_backend_dev_get_extra_bufts")
    if fn == ffi.NULL or lib.ggml_backend_reg_dev_count(cpu.reg) < 1:
        return {}
    bufts = ffi.cast("ggml_backend_dev_get_extra_bufts_t", fn)(lib.ggml_backend_reg_dev_get(cpu.reg, 0))
    out, i = {}, 0
    while bufts != ffi.NULL and bufts[i] != ffi.NULL and i < 64:
        out[ffi.string(lib.ggml_backend_buft_name(bufts[i])).decode()] = bufts[i]
        i += 1
    return out


def probe(name: str) -> str:
    """Run `name`'s kernels in a child: "ok", or why not ("died of SIGILL", "results differ ...")."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        run = subprocess.run([sys.executable, "-c", _CHILD, name], capture_output=True, text=True,
                             timeout=PROBE_TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        return f"no answer in {PROBE_TIMEOUT:g} s"
    if run.returncode < 0:
        return f"died of {signal.Signals(-run.returncode).name}"
    if run.returncode != 0:
        return f"failed (exit {run.returncode}): {run.stderr.strip().splitlines()[-1:]}"
    try:
        errors = json.loads(run.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"no result: {run.stdout[-200:]!r}"
    if not errors:
        return "takes none of q8_0, q4_0, q4_K here"
    worst = max(errors.values())
    if worst >= 0.05:
        return f"results differ from the plain CPU buffer's by {worst:.2g} (relative)"
    return f"ok ({', '.join(sorted(errors)).lower()})"


@functools.lru_cache(maxsize=None)  # the loaded library, the CPU and the kernel do not change while running
def _memo_path() -> str:
    lib_file = library_path()
    st = os.stat(lib_file)
    key = f"{lib_file}|{st.st_size}|{st.st_mtime_ns}|{ggml_build.cpu_tag()}|{platform.release()}"
    return str(ggml_build.cache_root() / f"extra-buffers-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json")


def known() -> dict | None:
    """What an earlier probe of this library, CPU and kernel found, without probing; None if none did."""
    try:
        with open(_memo_path()) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


@lru_cache(maxsize=None)
def usable() -> dict:
    """{extra buffer type: "ok (types)" or why it cannot run here}, probed once per library, CPU
    and kernel release (kept in the ggml cache when it is writable)."""
    found = known()
    if found is not None:
        return found
    path = _memo_path()
    found = {name: probe(name) for name in buffer_types()}
    try:
        ggml_build.write_in_cache(pathlib.Path(path), json.dumps(found).encode())
    except OSError:
        pass  # a read-only cache: probe again at the next start
    return found


if __name__ == "__main__":
    print(json.dumps(usable(), indent=1))
