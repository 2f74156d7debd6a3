"""cffi (ABI mode) binding of libggml from the pinned libggml-python wheel.

Only `lib64/libggml.so.0` is opened, once; every symbol, including the CPU
backend's and libggml-base's, is taken through that one handle. The wheel ships
copies, not links, so opening libggml-base.so as well would load a second,
separate libggml whose globals (logging, backend registry) disagree with ours.
"""
from ggml_ffi._loader import ffi, include_path, lib, library_path
from ggml_ffi.core import (
    NULL,
    Context,
    CpuBackend,
    Gallocr,
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
    "NULL", "ffi", "lib", "library_path", "include_path", "Context", "CpuBackend",
    "Gallocr", "graph_nodes", "nbytes", "route_logs_to_structlog", "row_size",
    "tensor_array", "tensor_bytes", "tensor_name", "type_traits",
]
