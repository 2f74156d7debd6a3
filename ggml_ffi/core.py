"""Thin Pythonic helpers over the raw binding: contexts, tensors, graphs, the
CPU backend with a persistent threadpool, log routing and orderly teardown."""
from __future__ import annotations

import atexit
import hashlib
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import structlog

from ggml_ffi._loader import ORIGIN, cpu_library, describe, ffi, lib

if TYPE_CHECKING:
    import numpy as np

log = structlog.get_logger("ggml")

NULL = ffi.NULL
MAX_DIMS = 4
MAX_SRC = 10
MAX_OP_PARAMS = 64
MAX_NAME = 64

# numpy dtypes of the element types that have one (quantized types have none). By name:
# numpy is imported where an array is made, not here (the worker daemon's parent process,
# which imports this module, never needs it on its hot path, and starts ~50 ms sooner)
NUMPY_DTYPES = {
    lib.GGML_TYPE_F32: "float32",
    lib.GGML_TYPE_F16: "float16",
    lib.GGML_TYPE_I8: "int8",
    lib.GGML_TYPE_I16: "int16",
    lib.GGML_TYPE_I32: "int32",
    lib.GGML_TYPE_I64: "int64",
    lib.GGML_TYPE_F64: "float64",
}


@dataclass(frozen=True)
class TypeTraits:
    type: int
    name: str
    type_size: int  # bytes per block
    blck_size: int  # elements per block


@lru_cache(maxsize=None)
def type_traits(t: int) -> TypeTraits | None:
    """Traits of ggml type `t`, or None for ids that are not live types
    (removed types keep their numbers but have block size 0)."""
    if not 0 <= t < lib.GGML_TYPE_COUNT:
        return None
    blck = lib.ggml_blck_size(t)
    if blck <= 0:
        return None
    return TypeTraits(t, ffi.string(lib.ggml_type_name(t)).decode(), lib.ggml_type_size(t), blck)


def nbytes(t: int, ne, nb) -> int:
    """ggml_nbytes in Python integers (so it cannot overflow)."""
    tr = type_traits(t)
    if any(n <= 0 for n in ne):
        return 0
    if tr.blck_size == 1:
        return tr.type_size + sum((ne[i] - 1) * nb[i] for i in range(MAX_DIMS))
    return ne[0] * nb[0] // tr.blck_size + sum((ne[i] - 1) * nb[i] for i in range(1, MAX_DIMS))


def row_size(t: int, ne0: int) -> int:
    tr = type_traits(t)
    return tr.type_size * ne0 // tr.blck_size


class Context:
    """A ggml context. no_alloc=True (the default) holds tensor metadata only;
    data lives in backend buffers."""

    def __init__(self, n_tensors: int = 4096, no_alloc: bool = True, mem_size: int | None = None):
        if mem_size is None:
            mem_size = n_tensors * lib.ggml_tensor_overhead() + lib.ggml_graph_overhead_custom(n_tensors, False) * 2
        params = ffi.new("struct ggml_init_params *", {"mem_size": mem_size, "mem_buffer": NULL, "no_alloc": no_alloc})
        self.ptr = lib.ggml_init(params[0])
        if self.ptr == NULL:
            raise MemoryError("ggml_init failed")
        self.n_tensors = n_tensors

    def new_tensor(self, t: int, ne, name: str | None = None):
        ne = list(ne)
        arr = ffi.new("int64_t[4]", ne + [1] * (4 - len(ne)))
        x = lib.ggml_new_tensor(self.ptr, t, len(ne), arr)
        if name:
            lib.ggml_set_name(x, name.encode())
        return x

    def new_graph(self, size: int | None = None):
        return lib.ggml_new_graph_custom(self.ptr, size or self.n_tensors, False)

    def close(self) -> None:
        if self.ptr not in (None, NULL):
            lib.ggml_free(self.ptr)
        self.ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


def tensor_name(x) -> str:
    return ffi.string(x.name).decode(errors="replace")


def tensor_array(x) -> np.ndarray:
    """A numpy view of an allocated, contiguous host tensor (shape in numpy order)."""
    import numpy as np

    dtype = NUMPY_DTYPES.get(x.type)
    if dtype is None or not lib.ggml_is_contiguous(x):
        raise TypeError(f"tensor {tensor_name(x)!r} has no contiguous numpy view")
    n = lib.ggml_nbytes(x)
    shape = tuple(int(x.ne[i]) for i in reversed(range(lib.ggml_n_dims(x))))
    return np.frombuffer(ffi.buffer(x.data, n), dtype=dtype).reshape(shape or (1,))


def tensor_bytes(x) -> bytes:
    return bytes(ffi.buffer(x.data, lib.ggml_nbytes(x)))


def graph_nodes(gf) -> list:
    return [lib.ggml_graph_node(gf, i) for i in range(lib.ggml_graph_n_nodes(gf))]


class CpuBackend:
    """The CPU backend with a persistent threadpool: small graphs are dozens of
    times slower when every compute spawns its threads anew."""

    def __init__(self, n_threads: int = 1):
        _announce_library()
        self.cpu = cpu_library().lib
        self.n_threads = max(1, int(n_threads))
        self.ptr = self.cpu.ggml_backend_cpu_init()
        if self.ptr == NULL:
            raise RuntimeError("ggml_backend_cpu_init failed")
        params = lib.ggml_threadpool_params_default(self.n_threads)
        self.threadpool = self.cpu.ggml_threadpool_new(ffi.new("struct ggml_threadpool_params *", params))
        if self.threadpool == NULL:
            lib.ggml_backend_free(self.ptr)
            raise RuntimeError("ggml_threadpool_new failed")
        self.cpu.ggml_backend_cpu_set_n_threads(self.ptr, self.n_threads)
        self.cpu.ggml_backend_cpu_set_threadpool(self.ptr, self.threadpool)
        _live_backends.add(self)

    def buffer_from_ptr(self, addr: int, size: int):
        """A CPU buffer over memory the caller owns (and keeps alive)."""
        return self.cpu.ggml_backend_cpu_buffer_from_ptr(ffi.cast("void *", addr), size)

    def compute(self, gf) -> int:
        return lib.ggml_backend_graph_compute(self.ptr, gf)

    def buffer_type(self):
        return lib.ggml_backend_get_default_buffer_type(self.ptr)

    def alloc_buffer(self, size: int):
        buf = lib.ggml_backend_buft_alloc_buffer(self.buffer_type(), max(1, size))
        if buf == NULL:
            raise MemoryError(f"cannot allocate a CPU buffer of {size} bytes")
        return buf

    def close(self) -> None:
        # the threadpool must go before the backend, both before interpreter exit
        if self.threadpool is not None:
            self.cpu.ggml_threadpool_free(self.threadpool)
            self.threadpool = None
        if self.ptr is not None:
            lib.ggml_backend_free(self.ptr)
            self.ptr = None
        _live_backends.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_live_backends: "weakref.WeakSet[CpuBackend]" = weakref.WeakSet()
_announced: list = []


def _announce_library() -> None:
    """Say once per process which libggml computes: the fallback wheel is half
    as fast at prompt processing, so running on it must never go unnoticed."""
    if _announced:
        return
    _announced.append(True)
    facts = describe()
    if ORIGIN.kind == "wheel":
        log.warning("libggml: FALLBACK to the libggml-python wheel (generic x86-64 build, slower); "
                    "build ggml for this machine with `python -m ggml_ffi.ggml_build`",
                    why=ORIGIN.info.get("why"), **facts)
    else:
        log.info("libggml: built for this machine", **facts)


@atexit.register
def _close_backends() -> None:
    for backend in list(_live_backends):
        backend.close()


class Gallocr:
    """ggml's graph allocator: places a graph's intermediate tensors in one
    compute buffer it owns, reusing memory between nodes."""

    def __init__(self, backend: CpuBackend):
        self.ptr = lib.ggml_gallocr_new(backend.buffer_type())

    def alloc_graph(self, gf) -> bool:
        return bool(lib.ggml_gallocr_alloc_graph(self.ptr, gf))

    def buffer_size(self) -> int:
        """Bytes of the compute buffer it holds (0 before the first allocation)."""
        return int(lib.ggml_gallocr_get_buffer_size(self.ptr, 0))

    def close(self) -> None:
        if self.ptr is not None:
            lib.ggml_gallocr_free(self.ptr)
            self.ptr = None

    def __del__(self):
        self.close()


_LOG_LEVELS = {
    lib.GGML_LOG_LEVEL_DEBUG: "debug",
    lib.GGML_LOG_LEVEL_INFO: "info",
    lib.GGML_LOG_LEVEL_WARN: "warning",
    lib.GGML_LOG_LEVEL_ERROR: "error",
}
_log_state: dict = {"pending": ""}


@ffi.callback("void(enum ggml_log_level, const char *, void *)")
def _on_ggml_log(level, text, _user):
    # ggml emits partial lines (CONT level); join them before logging
    try:
        chunk = ffi.string(text).decode(errors="replace")
        _log_state["pending"] += chunk
        if level != lib.GGML_LOG_LEVEL_CONT:
            _log_state["level"] = _LOG_LEVELS.get(level, "info")
        if _log_state["pending"].endswith("\n"):
            msg, _log_state["pending"] = _log_state["pending"].rstrip(), ""
            if msg:
                getattr(log, _log_state.get("level", "info"))(msg)
    except Exception:  # never let an exception cross back into C
        pass


def route_logs_to_structlog() -> None:
    lib.ggml_log_set(_on_ggml_log, NULL)


@lru_cache(maxsize=None)
def ggml_identity() -> dict:
    """What a graph on the wire means depends on: the ggml version and its op
    table (ops, unary and GLU ops, types with their block layouts, by number).
    Two processes may exchange graphs only if `op_table` is equal."""
    h = hashlib.sha256()
    tables = ((lib.GGML_OP_COUNT, lib.ggml_op_name), (lib.GGML_UNARY_OP_COUNT, lib.ggml_unary_op_name),
              (lib.GGML_GLU_OP_COUNT, lib.ggml_glu_op_name))
    for count, name in tables:
        h.update(b"|".join(ffi.string(name(i)) for i in range(count)) + b"\n")
    for t in range(lib.GGML_TYPE_COUNT):
        tr = type_traits(t)
        h.update(f"{t}:{tr.name}:{tr.type_size}:{tr.blck_size};".encode() if tr else f"{t}:-;".encode())
    return {"version": ffi.string(lib.ggml_version()).decode(), "op_table": h.hexdigest()[:16]}
