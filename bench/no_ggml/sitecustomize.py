"""For `bench/cpu_per_token.py --no-ggml` only: put on PYTHONPATH (with
BENCH_NO_GGML=1) for the benchmark and the worker daemons and compute
processes it starts. Each graph computes for real on its first use; every later
compute of it skips libggml and only writes the first compute's outputs back
(the next step's inputs may share their memory), so what a decode step costs
besides ggml's kernels is measured alone, without the kernels' time and their
noise on a loaded machine. Never for real use: every later result is stale."""
import os

if os.environ.get("BENCH_NO_GGML"):
    import ggml_ffi.core as _core

    _ffi, _lib = _core.ffi, _core.lib
    _compute = _core.CpuBackend.compute
    _outputs: dict = {}  # graph address -> [(tensor, its bytes after the first compute)]

    def _replayed(self, gf):
        key = int(_ffi.cast("uintptr_t", gf))
        outs = _outputs.get(key)
        if outs is None:
            status = _compute(self, gf)
            outs = _outputs[key] = []
            for i in range(_lib.ggml_graph_n_nodes(gf)):
                t = _lib.ggml_graph_node(gf, i)
                if t.flags & _lib.GGML_TENSOR_FLAG_OUTPUT:
                    outs.append((t, bytes(_ffi.buffer(t.data, _lib.ggml_nbytes(t)))))
            return status
        for t, data in outs:
            _ffi.memmove(t.data, data, len(data))
        return _lib.GGML_STATUS_SUCCESS

    _core.CpuBackend.compute = _replayed
