"""cffi (ABI mode) binding of libggml: the pinned ggml built for this machine
(ggml_build), or the libggml-python wheel as a fallback (_loader says which).

`libggml.so.0` is opened once; libggml-base's symbols are taken through that
handle, the CPU backend's through `cpu_library()` (the same handle, or the CPU
variant ggml loaded). Never open another copy of a libggml file: the wheel ships
copies, not links, and a second copy has its own globals (logging, registry).
"""
from ggml_ffi._loader import ORIGIN, cpu_library, describe, ffi, include_path, lib, library_path
from ggml_ffi.core import (
    NULL,
    Context,
    CpuBackend,
    Gallocr,
    ggml_identity,
    graph_nodes,
    nbytes,
    route_logs_to_structlog,
    row_size,
    tensor_array,
    tensor_bytes,
    tensor_name,
    type_traits,
)

__all__ = [
    "NULL", "ORIGIN", "ffi", "lib", "library_path", "include_path", "cpu_library", "describe", "ggml_identity",
    "Context", "CpuBackend",
    "Gallocr", "graph_nodes", "nbytes", "route_logs_to_structlog", "row_size",
    "tensor_array", "tensor_bytes", "tensor_name", "type_traits",
]
