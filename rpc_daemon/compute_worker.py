"""The daemon's compute process: the only place libggml computes.

A GGML_ASSERT aborts and a bad pointer segfaults the process that computes;
here that costs nothing: every client buffer lives in shared memory owned by
the daemon, which maps it into this process, reports the death to the client
and starts a new compute process on the next request.

Run as `python -m rpc_daemon.compute_worker FD THREADS` by rpc_daemon.compute.
"""
from __future__ import annotations

import mmap
import os
import socket
import sys

from ggml_ffi import NULL, CpuBackend, Gallocr, ffi, lib, route_logs_to_structlog
from rpc_daemon import compute_link
from rpc_daemon.graph_codec import build_graph, context_size


class ComputeState:
    def __init__(self, n_threads: int):
        self.backend = CpuBackend(n_threads)
        self.buffers: dict[int, tuple] = {}  # key -> (mmap, cdata ptr, ggml buffer)
        # key -> (ctx, ptrs, gf, allocator). One allocator per graph: a shared one
        # re-plans on every switch, and a plan kept across graphs of equal
        # topology but other sizes overruns its buffer.
        self.graphs: dict[str, tuple] = {}

    def map_buffer(self, key: int, size: int, fd: int) -> None:
        mm = mmap.mmap(fd, size)
        os.close(fd)
        ptr = ffi.from_buffer(mm)
        buf = lib.ggml_backend_cpu_buffer_from_ptr(ptr, size)
        self.buffers[key] = (mm, ptr, buf)

    def unmap_buffer(self, key: int) -> None:
        entry = self.buffers.pop(key, None)
        if entry:
            mm, ptr, buf = entry
            lib.ggml_backend_buffer_free(buf)
            # `entry` still references ptr, so `del ptr` alone left the export open
            # and mm.close() raised BufferError, killing this process
            ffi.release(ptr)
            mm.close()

    def drop_graph(self, key: str) -> None:
        entry = self.graphs.pop(key, None)
        if entry:
            entry[3].close()
            lib.ggml_free(entry[0])

    def buffer_table(self) -> dict:
        return {k: (buf, int(ffi.cast("uintptr_t", ptr))) for k, (mm, ptr, buf) in self.buffers.items()}

    def compute(self, header: dict, blob: bytearray) -> tuple[dict, bytes]:
        key = header["graph_key"]
        spec = header.get("graph")
        if spec is not None:
            self.drop_graph(key)
            params = ffi.new("struct ggml_init_params *",
                             {"mem_size": context_size(len(spec.tensors)), "mem_buffer": NULL, "no_alloc": True})
            ctx = lib.ggml_init(params[0])
            ptrs, gf = build_graph(ctx, spec, self.buffer_table())
            self.graphs[key] = (ctx, ptrs, gf, Gallocr(self.backend))
        ctx, ptrs, gf, galloc = self.graphs[key]
        if not galloc.alloc_graph(gf):
            return {"status": int(lib.GGML_STATUS_ALLOC_FAILED), "error": "cannot allocate the graph's compute buffer"}, b""
        src = ffi.from_buffer(blob) if blob else None
        for tensor, off, size in header["inputs"]:
            ffi.memmove(ptrs[tensor].data, src + off, size)
        status = self.backend.compute(gf)
        if status != lib.GGML_STATUS_SUCCESS:
            return {"status": int(status), "error": f"ggml_backend_graph_compute returned {status}"}, b""
        parts, outputs, off = [], [], 0
        for i in header["outputs"]:
            x = ptrs[i]
            n = lib.ggml_nbytes(x)
            parts.append(ffi.buffer(x.data, n)[:])
            outputs.append([i, off, n])
            off += n
        return {"status": 0, "outputs": outputs}, b"".join(parts)


def serve(sock: socket.socket, n_threads: int) -> None:
    state = ComputeState(n_threads)
    try:
        while True:
            try:
                header, blob, fds = compute_link.recv(sock)
            except compute_link.LinkClosed:
                return
            for (key, size), fd in zip(header.get("maps", ()), fds):
                state.map_buffer(key, size, fd)
            for key in header.get("unmaps", ()):
                state.unmap_buffer(key)
            for key in header.get("drop_graphs", ()):
                state.drop_graph(key)
            if header.get("kind") == "compute":
                reply, out = state.compute(header, blob)
            else:
                reply, out = {"status": 0}, b""
            compute_link.send(sock, reply, out)
    finally:
        for key in list(state.graphs):
            state.drop_graph(key)
        state.backend.close()


def main() -> None:
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    route_logs_to_structlog()
    fd, n_threads = int(sys.argv[1]), int(sys.argv[2])
    serve(socket.socket(fileno=fd), n_threads)


if __name__ == "__main__":
    main()
