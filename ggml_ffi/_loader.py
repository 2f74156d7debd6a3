"""Open libggml once and expose `ffi` and `lib`."""
from __future__ import annotations

import pathlib

import cffi

_CDEF = pathlib.Path(__file__).with_name("_cdef.h")


def library_path() -> pathlib.Path:
    import libggml

    return pathlib.Path(libggml.__file__).parent / "lib64" / "libggml.so.0"


def include_path() -> pathlib.Path:
    import libggml

    return pathlib.Path(libggml.__file__).parent / "include"


ffi = cffi.FFI()
ffi.cdef(_CDEF.read_text())
lib = ffi.dlopen(str(library_path()))
