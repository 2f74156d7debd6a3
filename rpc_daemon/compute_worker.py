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
import time

from ggml_ffi import NULL, CpuBackend, Gallocr, ffi, lib, route_logs_to_structlog
from rpc_daemon import compute_link, hoptrace
from rpc_daemon.graph_codec import build_graph, context_size


class ComputeState:
    def __init__(self, n_threads: int):
        self.backend = CpuBackend(n_threads)
        self.buffers: dict[int, tuple] = {}  # key -> (mmap, cdata ptr, ggml buffer)
        self.arena: mmap.mmap | None = None  # outputs go here when the daemon provides it
        self.arena_ptr = None
        # key -> (ctx, ptrs, gf, allocator). One allocator per graph: a shared one
        # re-plans on every switch, and a plan kept across graphs of equal
        # topology but other sizes overruns its buffer.
        self.graphs: dict[str, tuple] = {}
        # graphs whose allocator has placed every tensor, and the bytes its compute
        # buffer holds: a graph that does not change keeps its addresses, so later
        # computes skip the allocator's pass
        self.allocated: dict[str, int] = {}
        self.compute_bytes = 0  # all graphs' compute buffers: counted against --mem by the daemon

    def map_buffer(self, key: int, size: int, fd: int) -> None:
        mm = mmap.mmap(fd, size)
        os.close(fd)
        ptr = ffi.from_buffer(mm)
        buf = lib.ggml_backend_cpu_buffer_from_ptr(ptr, size)
        self.buffers[key] = (mm, ptr, buf)

    def map_arena(self, size: int, fd: int) -> None:
        if self.arena is not None:
            ffi.release(self.arena_ptr)
            self.arena.close()
        self.arena = mmap.mmap(fd, size)
        os.close(fd)
        self.arena_ptr = ffi.from_buffer(self.arena)

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
        self.compute_bytes -= self.allocated.pop(key, 0)
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
        if key not in self.allocated:
            if not galloc.alloc_graph(gf):
                return {"status": int(lib.GGML_STATUS_ALLOC_FAILED), "error": "cannot allocate the graph's compute buffer"}, b""
            need = galloc.buffer_size()
            self.allocated[key] = need
            self.compute_bytes += need
            # intermediates count against the daemon's --mem cap as client buffers do;
            # their pages are not touched before compute, so refusing here costs nothing
            budget = header.get("budget")
            if budget is not None and self.compute_bytes > budget:
                self.drop_graph(key)
                return {"status": int(lib.GGML_STATUS_ALLOC_FAILED), "graph_dropped": True,
                        "error": f"the graph needs {need} bytes of compute memory and the daemon's memory cap "
                                 f"(--mem) leaves {max(0, budget - self.compute_bytes)}"}, b""
        src = ffi.from_buffer(blob) if blob else None
        for tensor, off, size in header["inputs"]:
            ffi.memmove(ptrs[tensor].data, src + off, size)
        if hoptrace.ON:
            hoptrace.mark("compute start")
        started = time.perf_counter()
        status = self.backend.compute(gf)
        if hoptrace.ON:
            hoptrace.mark("compute end")
        compute_us = int((time.perf_counter() - started) * 1e6)
        if status != lib.GGML_STATUS_SUCCESS:
            return {"status": int(status), "error": f"ggml_backend_graph_compute returned {status}"}, b""
        sizes = [lib.ggml_nbytes(ptrs[i]) for i in header["outputs"]]
        outputs, off = [], 0
        for i, n in zip(header["outputs"], sizes):
            outputs.append([i, off, n])
            off += n
        reply = {"status": 0, "outputs": outputs, "compute_us": compute_us}
        if self.arena is not None and off <= len(self.arena):
            for (i, o, n) in outputs:
                ffi.memmove(self.arena_ptr + o, ptrs[i].data, n)
            reply["arena_bytes"] = off
            return reply, b""
        return reply, b"".join(ffi.buffer(ptrs[i].data, n)[:] for (i, o, n) in outputs)


def serve(sock: socket.socket, n_threads: int) -> None:
    state = ComputeState(n_threads)
    try:
        while True:
            try:
                header, blob, fds = compute_link.recv(sock)
                if hoptrace.ON:
                    hoptrace.mark("compute rx")
            except compute_link.LinkClosed:
                return
            maps = header.get("maps", ())
            for (key, size), fd in zip(maps, fds):
                state.map_buffer(key, size, fd)
            if "arena" in header:
                state.map_arena(header["arena"], fds[len(maps)])
            for key in header.get("unmaps", ()):
                state.unmap_buffer(key)
            for key in header.get("drop_graphs", ()):
                state.drop_graph(key)
            if header.get("kind") == "compute":
                reply, out = state.compute(header, blob)
            else:
                reply, out = {"status": 0}, b""
            reply["compute_bytes"] = state.compute_bytes
            compute_link.send(sock, reply, out)
            if hoptrace.ON and header.get("kind") == "compute":
                hoptrace.mark("compute sent")
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
