"""Open libggml once and expose `ffi`, `lib` and the library's origin.

Which library: the pinned ggml built for this machine at install (carried
in `ggml_ffi/_ggml/` by a non-editable install, else ggml_build.find_build()'s
cache), else, as a fallback, the pinned libggml-python wheel's. `GGML_DISTRIBUTED_GGML=wheel` forces the wheel;
`GGML_DISTRIBUTED_GGML=/path/to/dir` a build directory of the same layout.
Whichever it is gets logged once, loudly, at the first CPU backend.

One dlopen of `libggml.so.0`; ggml-base's symbols are reached through that
handle (it links libggml-base). The CPU backend's own symbols come from
`cpu_library()`: the same handle when the CPU backend is linked in (a native
build, the wheel), or, in a GGML_BACKEND_DL build, the handle of the CPU
variant that ggml itself chose and loaded (dlopen of an already loaded file
returns that same object, never a second copy).
"""
from __future__ import annotations

import os
import pathlib
import re
from dataclasses import dataclass, field
from functools import lru_cache

import cffi

from ggml_ffi import ggml_build



@dataclass(frozen=True)
class LibraryOrigin:
    kind: str  # "build" (made for this machine from the pinned sdist) or "wheel" (the fallback)
    directory: pathlib.Path  # holds lib/ (or lib64/) and include/
    info: dict = field(default_factory=dict)

    @property
    def library(self) -> pathlib.Path:
        for sub in ("lib", "lib64"):
            if (self.directory / sub / "libggml.so.0").exists():
                return self.directory / sub / "libggml.so.0"
        return self.directory / "lib" / "libggml.so.0"

    @property
    def include(self) -> pathlib.Path:
        return self.directory / "include"


def _wheel() -> LibraryOrigin:
    import libggml

    return LibraryOrigin("wheel", pathlib.Path(libggml.__file__).parent,
                         {"variant": "wheel", "why": "no ggml build for this machine"})


def _read_info(d: pathlib.Path) -> dict:
    import json

    try:
        return json.loads((d / ggml_build.INFO_FILE).read_text())
    except (OSError, ValueError):
        return {}


def find_origin() -> LibraryOrigin:
    choice = os.environ.get("GGML_DISTRIBUTED_GGML", "")
    if choice == "wheel":
        return LibraryOrigin("wheel", _wheel().directory, {"variant": "wheel", "why": "GGML_DISTRIBUTED_GGML=wheel"})
    if choice:
        d = pathlib.Path(choice).expanduser()
        return LibraryOrigin("build", d, _read_info(d))
    bundled = pathlib.Path(__file__).with_name("_ggml")  # a non-editable install carries its build
    if (bundled / ggml_build.INFO_FILE).is_file():
        return LibraryOrigin("build", bundled, _read_info(bundled))
    d = ggml_build.find_build()
    if d is None:
        return _wheel()
    return LibraryOrigin("build", d, _read_info(d))


def _cdef_for(origin: LibraryOrigin) -> tuple[LibraryOrigin, pathlib.Path]:
    """The declarations generated from this library's own headers (gen_cdef.py); a build
    of another ggml than `_cdef.h` was generated from is not loaded: the wheel is."""
    if origin.kind == "wheel":
        return origin, pathlib.Path(__file__).with_name("_cdef_wheel.h")
    cdef = pathlib.Path(__file__).with_name("_cdef.h")
    head = cdef.read_text()[:300] if cdef.is_file() else ""
    m = re.search(r"ggml (\S+)\. Do not edit", head)
    built = origin.info.get("ggml_version")
    if m is None or m.group(1) != built:
        wheel = _wheel()
        why = f"{cdef.name} is for ggml {m.group(1) if m else '(none)'}, the build in {origin.directory} is " \
              f"ggml {built}: run `python -m ggml_ffi.gen_cdef`"
        return LibraryOrigin("wheel", wheel.directory, {"variant": "wheel", "why": why}), \
            pathlib.Path(__file__).with_name("_cdef_wheel.h")
    return origin, cdef


ORIGIN, _CDEF = _cdef_for(find_origin())
# ggml 0.25's tiled K-quant matmul (1.25x the prompt speed of vec_dot): it runs from 8 batch rows
# on and vec_dot below, so a K-quant row's result has two classes of batch sizes, 1-7 and 8+
# (docs/architecture.md, "Kernels"). Read by ggml once, at the first matmul; =0 opts out.
os.environ.setdefault("GGML_CPU_TILED_MM", "1")


def library_path() -> pathlib.Path:
    return ORIGIN.library


def include_path() -> pathlib.Path:
    return ORIGIN.include


def _declared_ffi(cdef: pathlib.Path):
    """An FFI with the declarations in `cdef`. Parsing its 90 kB of C takes
    pycparser ~0.13 s at every start of a process (a restarted worker is back,
    and its compute process ready, that much later); cffi's out-of-line ABI
    form of the same declarations loads in ~5 ms. It is made once per text and
    cffi version into the cache (`ggml_build.cache_root()/cffi`, where the
    ggml build lives); where that cannot be written, the text is parsed."""
    import hashlib
    import io

    text = cdef.read_text()
    key = hashlib.sha256(f"cffi {cffi.__version__}\n{text}".encode()).hexdigest()[:32]
    saved = ggml_build.cache_root() / "cffi" / f"ggml_cdef_{key}.py"
    try:
        return _load_abi(saved)
    except (OSError, SyntaxError, KeyError):  # not made yet (or a bad file): made again below
        pass
    builder = cffi.FFI()
    builder.cdef(text)
    try:
        from cffi.recompiler import make_py_source

        source = io.StringIO()
        make_py_source(builder, "_ggml_cdef", source)
        ggml_build.write_in_cache(saved, source.getvalue().encode())
        return _load_abi(saved)
    except (OSError, SyntaxError, KeyError):
        return builder


def _load_abi(path: pathlib.Path):
    namespace: dict = {}
    exec(compile(path.read_bytes(), str(path), "exec"), namespace)
    return namespace["ffi"]


ffi = _declared_ffi(_CDEF)
lib = ffi.dlopen(str(library_path()))


@dataclass(frozen=True)
class CpuLibrary:
    """The CPU backend: where its symbols come from and what it was built for."""
    lib: object  # a cffi library with the CPU backend's symbols (ggml_backend_cpu_init, ...)
    reg: object  # its ggml_backend_reg_t
    path: pathlib.Path  # the file holding it
    variant: str  # "x64".."sapphirerapids" of a GGML_BACKEND_DL build, else the build's variant
    features: dict  # ggml_backend_get_features: {"AVX2": "1", "LLAMAFILE": "1", ...}


def _address_file(addr) -> pathlib.Path | None:
    """The shared object holding a code address (dladdr). Through ctypes: a
    cffi.FFI() of its own would parse its declaration with pycparser (~30 ms
    at every process start, a restarted worker's and its compute process's)."""
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    dladdr = ctypes.CDLL(None).dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    info = DlInfo()
    if dladdr(int(ffi.cast("uintptr_t", addr)), ctypes.byref(info)) == 0 or not info.dli_fname:
        return None
    return pathlib.Path(info.dli_fname.decode())


def _features(reg) -> dict:
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_get_features")
    if fn == ffi.NULL:
        return {}
    out, feats = {}, ffi.cast("ggml_backend_get_features_t", fn)(reg)
    i = 0
    while feats[i].name != ffi.NULL and i < 256:
        out[ffi.string(feats[i].name).decode()] = ffi.string(feats[i].value).decode()
        i += 1
    return out


@lru_cache(maxsize=None)
def cpu_library() -> CpuLibrary:
    """Register the CPU backend (in a GGML_BACKEND_DL build: ggml loads the
    best variant this CPU runs from the build's lib/ directory) and return it."""
    reg = lib.ggml_backend_reg_by_name(b"CPU")
    if reg == ffi.NULL:
        lib.ggml_backend_load_all_from_path(str(library_path().parent).encode())
        reg = lib.ggml_backend_reg_by_name(b"CPU")
    if reg == ffi.NULL:
        raise RuntimeError(f"no CPU backend could be loaded from {library_path().parent}")
    path = _address_file(lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_get_features")) or library_path()
    if path.name.startswith("libggml-cpu-"):  # a GGML_BACKEND_DL variant: libggml-cpu-haswell.so
        variant, cpu = path.name[len("libggml-cpu-"):].split(".so")[0], ffi.dlopen(str(path))
    else:
        variant, cpu = ORIGIN.info.get("variant", ORIGIN.kind), lib
        if variant == "native" and ORIGIN.info.get("cpu_tag"):
            variant = f"native-{ORIGIN.info['cpu_tag']}"  # as its directory is named
    return CpuLibrary(cpu, reg, path, variant, _features(reg))


def kernels() -> dict:
    """The matrix-product kernels in use (docs/architecture.md, "Kernels and what a result depends on")."""
    if cpu_library().features.get("LLAMAFILE") != "1":
        llamafile = "off"
    else:  # the build's source edit keeps tinyBLAS to quantized weights (ggml_build._SOURCE_PATCHES)
        llamafile = "quantized" if ORIGIN.info.get("source_patches") else "all"
    tiled = ORIGIN.kind == "build" and os.environ.get("GGML_CPU_TILED_MM", "1") != "0"  # the wheel's 0.20 has none
    return {"llamafile": llamafile, "tiled_k_quants": tiled}


def describe() -> dict:
    """Which ggml this process runs, for logs, DEVICE_INFO and metrics."""
    cpu = cpu_library()
    return {"ggml_version": ffi.string(lib.ggml_version()).decode(), "origin": ORIGIN.kind,
            "library": str(library_path()), "cpu_variant": cpu.variant, "cpu_library": str(cpu.path),
            "cpu_features": sorted(k for k, v in cpu.features.items() if v == "1"), "kernels": kernels()}
