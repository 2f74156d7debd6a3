"""GGUF reading through libggml's own gguf API (tens of milliseconds for the
metadata of a real model; the pure-Python reader takes seconds).

Tensor metadata becomes ggml tensors in a no_alloc context, so graph builders
use them directly; tensor data stays in a read-only memory map of the file and
is streamed from there to wherever the weights live, never copied whole.
"""
from __future__ import annotations

import mmap
import os
import pathlib

import numpy as np

from ggml_ffi import NULL, ffi, lib

GGUF_TYPE_ARRAY = 9
GGUF_TYPE_STRING = 8
_SCALAR_GETTERS = {
    0: lib.gguf_get_val_u8, 1: lib.gguf_get_val_i8, 2: lib.gguf_get_val_u16, 3: lib.gguf_get_val_i16,
    4: lib.gguf_get_val_u32, 5: lib.gguf_get_val_i32, 6: lib.gguf_get_val_f32, 7: lib.gguf_get_val_bool,
    10: lib.gguf_get_val_u64, 11: lib.gguf_get_val_i64, 12: lib.gguf_get_val_f64,
}
_ARRAY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class GGUFError(ValueError):
    pass


class GGUFFile:
    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        if not self.path.exists():
            raise GGUFError(f"model file {self.path} does not exist")
        if not self.path.is_file():
            raise GGUFError(f"model {self.path} is not a file (give the path of a .gguf file)")
        ctx_out = ffi.new("struct ggml_context **")
        params = ffi.new("struct gguf_init_params *", {"no_alloc": True, "ctx": ctx_out})
        self.gguf = lib.gguf_init_from_file(str(self.path).encode(), params[0])
        if self.gguf == NULL:
            raise GGUFError(f"{self.path} is not a readable GGUF file")
        self.ctx = ctx_out[0]
        self.data_offset = lib.gguf_get_data_offset(self.gguf)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.tensors: dict[str, object] = {}
        self.offsets: dict[str, int] = {}
        for i in range(lib.gguf_get_n_tensors(self.gguf)):
            name = ffi.string(lib.gguf_get_tensor_name(self.gguf, i)).decode()
            self.tensors[name] = lib.ggml_get_tensor(self.ctx, name.encode())
            self.offsets[name] = self.data_offset + lib.gguf_get_tensor_offset(self.gguf, i)
        for name, t in self.tensors.items():
            if self.offsets[name] + lib.ggml_nbytes(t) > len(self._mm):
                raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")

    # ------------------------------------------------------------ metadata
    def get(self, key: str, default=None):
        kid = lib.gguf_find_key(self.gguf, key.encode())
        if kid < 0:
            return default
        kind = lib.gguf_get_kv_type(self.gguf, kid)
        if kind == GGUF_TYPE_STRING:
            return ffi.string(lib.gguf_get_val_str(self.gguf, kid)).decode(errors="replace")
        if kind == GGUF_TYPE_ARRAY:
            n = lib.gguf_get_arr_n(self.gguf, kid)
            atype = lib.gguf_get_arr_type(self.gguf, kid)
            if atype == GGUF_TYPE_STRING:
                get = lib.gguf_get_arr_str
                return [ffi.string(get(self.gguf, kid, i)).decode(errors="replace") for i in range(n)]
            dtype = _ARRAY_DTYPES[atype]
            raw = ffi.buffer(lib.gguf_get_arr_data(self.gguf, kid), n * np.dtype(dtype).itemsize)
            return np.frombuffer(raw, dtype=dtype).copy().tolist()
        getter = _SCALAR_GETTERS.get(kind)
        return getter(self.gguf, kid) if getter else default

    def require(self, key: str):
        v = self.get(key)
        if v is None:
            raise GGUFError(f"{self.path.name}: metadata key {key!r} is missing")
        return v

    @property
    def architecture(self) -> str:
        return self.require("general.architecture")

    # ------------------------------------------------------------ tensors
    def tensor(self, name: str, required: bool = True):
        t = self.tensors.get(name)
        if t is None and required:
            raise GGUFError(f"{self.path.name}: tensor {name!r} is missing")
        return t

    def tensor_data(self, name: str) -> memoryview:
        """The tensor's bytes in the file, as a zero-copy view of the memory map."""
        t = self.tensors[name]
        off = self.offsets[name]
        return memoryview(self._mm)[off: off + lib.ggml_nbytes(t)]

    @property
    def layer_bytes(self) -> int:
        """The bytes of every repeating layer's tensors (blk.*): what a token reads besides the
        embeddings and the output head."""
        return sum(len(self.tensor_data(n)) for n in self.tensors if n.startswith("blk."))

    def close(self) -> None:
        if getattr(self, "gguf", None) not in (None, NULL):
            lib.gguf_free(self.gguf)
            lib.ggml_free(self.ctx)
            self.gguf = None
        mm = getattr(self, "_mm", None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views still alive; the map goes with them
                pass
            self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
