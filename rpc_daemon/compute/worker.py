"""The daemon's compute process: the only place libggml computes.

A GGML_ASSERT aborts and a bad pointer segfaults the process that computes;
here that costs nothing: every client buffer lives in shared memory owned by
the daemon, which maps it into this process, reports the death to the client
and gives it a new compute process on its next request.

One process serves one client: it maps that client's arena (one memfd holding
all its buffers, rpc_daemon/daemon/buffers.py) once, and wraps each buffer, a range of
it, as a ggml CPU buffer. No other client's memory is ever mapped here, so a
graph that strays out of bounds can only fault or touch its own client's data.

Run as `python -m rpc_daemon.compute.worker FD THREADS` by rpc_daemon.compute.pool.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import re
import select
import signal
import socket
import sys
import time

import structlog

from ggml_ffi import NULL, CpuBackend, Gallocr, ffi, lib, route_logs_to_structlog
from rpc_daemon.compute import link as compute_link
from rpc_daemon.compute import link_tls
from rpc_daemon.compute.channel import ChannelEnded, StepChannelServer
from rpc_daemon.compute.exchange import SPIN_S, SegmentedGraph, TensorLink
from rpc_daemon.service import hoptrace
from rpc_daemon.service.memory import advise_huge_pages, libc, map_pages
from rpc_daemon.service.shared_memory import shmem_thp
from rpc_daemon.wire.graph_codec import build_graph, context_size
from rpc_daemon.wire.protocol import Status
from rpc_daemon.wire.tensor_frames import LinkBroken

log = structlog.get_logger("compute")
MADV_POPULATE_READ = 22  # Linux 5.14+; older kernels refuse it (EINVAL) and pages fault in one by one
SHMEM_ASKS = shmem_thp() == "advise"
_RESIDENT_RUN = re.compile(rb"[^\x00]+")  # mincore sets bit 0 of a resident page's byte


def map_shared(fd: int, size: int) -> int:
    """Address of a shared mapping of `size` bytes of `fd`. Python's mmap will not
    map past the end of the file, and the client's arena file is only as long as
    its highest live buffer: the rest of the range faults until it grows."""
    addr = map_pages(size, mmap.MAP_SHARED, fd)
    # memfds get 2 MiB pages under shmem_enabled "advise" only where their mappers ask (the daemon
    # does); a huge tmpfs's are mapped as such without asking. Best effort: refused, the mapping stands
    if SHMEM_ASKS:
        advise_huge_pages(addr, size)
    return addr


def populate_resident(addr: int, size: int) -> None:
    """Map into this process the pages of [addr, addr+size) that exist in the
    shared memory (the weights the daemon wrote), one madvise per run of them,
    not one fault per page at the first compute that reads them (a restarted
    worker's first resumed step took 65-75 ms instead of ~35, mostly for
    that). Pages never written (the KV cache beyond what is used) are left
    alone, so they take no memory before they are. Best effort: a refusal
    leaves the pages to fault in as before."""
    first = addr - addr % mmap.PAGESIZE
    n = -(-(addr + size - first) // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(n)
    if libc.mincore(first, n * mmap.PAGESIZE, vec) != 0:
        return
    for run in _RESIDENT_RUN.finditer(vec.raw):
        libc.madvise(first + run.start() * mmap.PAGESIZE, (run.end() - run.start()) * mmap.PAGESIZE,
                      MADV_POPULATE_READ)


class ComputeState:
    def __init__(self, n_threads: int, spin_s: float = SPIN_S):
        self.backend = CpuBackend(n_threads)
        self.spin_s = spin_s  # an exchange's wait without sleeping (--spin-ms)
        # this process serves ONE client: its arena (every buffer of it) is mapped here
        # once, and nothing of any other client ever is
        self.client_arena: tuple[int, int] | None = None  # (address, size)
        self.buffers: dict[int, tuple] = {}  # key -> (ggml buffer, address)
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
        self.tensor_link: TensorLink | None = None  # to the other members of a tensor-parallel group
        self.segmented: dict[str, SegmentedGraph] = {}  # graph key -> the graph cut at its exchanges
        self.specs: dict = {}  # graph key -> its validated GraphSpec (a step channel's requests are checked against it)
        self.buffer_ranges: dict[int, tuple[int, int]] = {}  # key -> (offset, size) in the arena: the buffers mapped
        self.channel: StepChannelServer | None = None  # the client's step channel, while it has one
        # computes, compute_us, errors, bytes in and out over step channels: told to the daemon
        self.channel_counts = [0, 0, 0, 0, 0]

    def map_client_arena(self, size: int, fd: int) -> None:
        if self.client_arena is not None:  # the daemon maps a client's arena once: never a second one
            raise RuntimeError("a compute process serves one client arena")
        addr = map_shared(fd, size)
        os.close(fd)
        self.client_arena = (addr, size)

    def map_buffer(self, key: int, offset: int, size: int) -> None:
        base, arena_size = self.client_arena
        if offset + size > arena_size:
            raise RuntimeError(f"buffer {key} lies outside the client's arena")
        addr = base + offset
        populate_resident(addr, size)
        buf = self.backend.buffer_from_ptr(addr, size)
        self.buffers[key] = (buf, addr)
        self.buffer_ranges[key] = (offset, size)

    def map_arena(self, size: int, fd: int) -> None:
        if self.arena is not None:
            ffi.release(self.arena_ptr)
            self.arena.close()
        self.arena = mmap.mmap(fd, size)
        os.close(fd)
        self.arena_ptr = ffi.from_buffer(self.arena)

    def unmap_buffer(self, key: int) -> None:
        entry = self.buffers.pop(key, None)
        self.buffer_ranges.pop(key, None)
        if entry:
            lib.ggml_backend_buffer_free(entry[0])  # the memory stays: it is the arena's

    def set_tensor_link(self, header: dict, fds: list[int]) -> dict:
        """The sockets the daemon connected to the group's other members (one per peer, in header
        order), TLS run over them first when the header has `tls` (link_tls.py); the reply."""
        if self.tensor_link is not None:
            self.tensor_link.close()
            self.tensor_link = None
        socks = {r: socket.socket(fileno=fd) for r, fd in zip(header["peers"], fds)}
        sessions = None
        if header.get("tls") is not None:
            try:
                sessions = link_tls.secure(socks, header["link"], header["rank"], header["tls"])
            except link_tls.LinkSetupFailed as exc:  # the sockets are closed
                reply = {"status": int(Status.LINK_FAILED), "error": str(exc)}
                if exc.peer_rank is not None:
                    reply["peer_rank"] = exc.peer_rank
                return reply
        self.tensor_link = TensorLink(header["link"], header["rank"], socks, self.spin_s, sessions)
        return {"status": 0}

    def set_step_channel(self, header: dict, fds: list[int]) -> None:
        self.close_step_channel()
        self.channel = StepChannelServer(socket.socket(fileno=fds[0]), header["key_prefix"], header["limits"],
                                         header["compute_timeout"], self.channel_counts, header.get("unsafe", False))

    def close_step_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def serve_channel(self) -> bool:
        """Answer the step channel's next request if one is whole; whether it was a tensor step."""
        try:
            request = self.channel.next_request()
            if request is not None:
                self.channel.answer(*request, self)
                return "tensor" in request[0]
        except ChannelEnded as exc:
            log.info("step channel closed", reason=str(exc))
            self.close_step_channel()
        return False

    def drop_graph(self, key: str) -> None:
        self.specs.pop(key, None)
        seg = self.segmented.pop(key, None)
        if seg is not None:
            seg.close()
        entry = self.graphs.pop(key, None)
        self.compute_bytes -= self.allocated.pop(key, 0)
        if entry:
            entry[3].close()
            lib.ggml_free(entry[0])

    def _compute_linked(self, key: str, gf, ptrs, tensor: dict):
        """The graph in segments with its all-reduces (exchange.py); a failed exchange is a
        LINK_FAILED reply and drops the link (the coordinator links the group again)."""
        link = self.tensor_link
        if link is None or link.link_id != tensor["link"]:
            return {"status": int(Status.LINK_FAILED), "link_missing": True,
                    "error": f"tensor link {tensor['link']} is not set up in this compute process (it was "
                             f"replaced, or the link dropped)"}
        exchange = tuple(tensor["exchange"])
        gather = tuple(None if g is None else tuple(g) for g in tensor.get("gather") or ())
        seg = self.segmented.get(key)
        if seg is None or not seg.serves(exchange, gather):
            if seg is not None:
                seg.close()
                del self.segmented[key]
            try:
                seg = SegmentedGraph(gf, ptrs, exchange, gather, link.rank, len(link.socks) + 1)
            except ValueError as exc:  # this member's pieces are not where the request says
                return {"status": int(Status.INVALID_REQUEST), "error": str(exc)}
            self.segmented[key] = seg
        try:
            return seg.compute(self.backend, link, tensor["step"], tensor["timeout"])
        except LinkBroken as exc:
            link.close()
            self.tensor_link = None
            return {"status": int(Status.LINK_FAILED), "error": f"tensor link: {exc}"}

    def buffer_table(self) -> dict:
        return self.buffers

    def compute(self, header: dict, blob: bytearray, to_arena: bool = True) -> tuple[dict, bytes]:
        key = header["graph_key"]
        spec = header.get("graph")
        if spec is not None:
            self.drop_graph(key)
            params = ffi.new("struct ggml_init_params *",
                             {"mem_size": context_size(len(spec.tensors)), "mem_buffer": NULL, "no_alloc": True})
            ctx = lib.ggml_init(params[0])
            ptrs, gf = build_graph(ctx, spec, self.buffer_table())
            self.graphs[key] = (ctx, ptrs, gf, Gallocr(self.backend))
            self.specs[key] = spec
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
        tensor = header.get("tensor")
        waited = self.tensor_link.wait_s if self.tensor_link is not None else 0.0
        if tensor is not None:
            status = self._compute_linked(key, gf, ptrs, tensor)
            if isinstance(status, dict):
                return status, b""
        else:
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
        if tensor is not None and self.tensor_link is not None:  # of compute_us: sending, waiting, summing
            reply["exchange_us"] = int((self.tensor_link.wait_s - waited) * 1e6)
        if to_arena and self.arena is not None and off <= len(self.arena):
            for (i, o, n) in outputs:
                ffi.memmove(self.arena_ptr + o, ptrs[i].data, n)
            reply["arena_bytes"] = off
            return reply, b""
        if not to_arena and len(outputs) == 1:  # sent at once (a step channel's reply): no copy
            return reply, ffi.buffer(ptrs[outputs[0][0]].data, outputs[0][2])
        return reply, b"".join(ffi.buffer(ptrs[i].data, n)[:] for (i, o, n) in outputs)


def warm_up(state: ComputeState) -> None:
    """Compute one tiny graph and drop it: a spare process is started ahead, so the first-use costs
    of a fresh process (symbol lookups, first allocations) are paid before a client needs it."""
    from ggml_ffi import Context
    from rpc_daemon.validation.graph import parse_graph
    from rpc_daemon.wire.graph_codec import encode_graph
    from rpc_daemon.wire.protocol import Limits

    try:
        ctx = Context(8)
        try:
            a = ctx.new_tensor(lib.GGML_TYPE_F32, [4], "a")
            lib.ggml_set_input(a)
            z = lib.ggml_add(ctx.ptr, a, a)
            lib.ggml_set_output(z)
            gf = ctx.new_graph()
            lib.ggml_build_forward_expand(gf, z)
            tensors, index = encode_graph(gf, lambda t: None)
        finally:
            ctx.close()
        spec = parse_graph({"tensors": tensors, "outputs": [index[z]]}, Limits(), lambda b: None)
        state.compute({"graph_key": "warm-up", "graph": spec, "inputs": [(index[a], 0, 16)],
                       "outputs": [index[z]]}, bytearray(16))
    except Exception:  # best effort: a failure here costs only the first compute's latency
        pass
    finally:
        state.drop_graph("warm-up")


# After a tensor-parallel step the next one usually follows within a round trip to
# the coordinator: the process waits for it awake, as an exchange waits for its
# peers (exchange.SPIN_S), because a sleeping core wakes slowly (a 1.1B llama over
# 2 workers on a 2-core VM, the same run: 9.6 tokens/s sleeping at once, 13.4
# waiting 5 ms awake first), for this share of the exchanges' spin (--spin-ms:
# 5 ms of the default 20). After a layer-split step the next one waits for the
# other workers' layers: that wait sleeps at once.
NEXT_STEP_SPIN_SHARE = 0.25


def await_without_sleep(ready, seconds: float) -> None:
    """Return when `ready` (a poll object) has an event or after `seconds`, yielding
    the core to any other runnable task meanwhile instead of sleeping."""
    until = time.perf_counter() + seconds
    while not ready.poll(0) and time.perf_counter() < until:
        os.sched_yield()


def serve(sock: socket.socket, n_threads: int, spin_s: float = SPIN_S) -> None:
    """Serve the daemon's requests on `sock`; `spin_s`: how long an exchange waits for a peer
    without sleeping (TensorLink), the wait for the step after a tensor-parallel one a quarter of it."""
    state = ComputeState(n_threads, spin_s)
    warm_up(state)
    try:
        request_ready = select.poll()
        request_ready.register(sock, select.POLLIN)
        tensor_step = False
        channel_fd = None
        while True:
            if hoptrace.ON:
                hoptrace.flush()  # about to wait: the points written off the hops they time
            if tensor_step and not (state.channel is not None and state.channel.waiting):
                await_without_sleep(request_ready, spin_s * NEXT_STEP_SPIN_SHARE)
            fd_now = state.channel.fileno() if state.channel is not None else None
            if fd_now != channel_fd:  # a channel came or went: wait on it too, or no more
                if channel_fd is not None:
                    request_ready.unregister(channel_fd)
                if fd_now is not None:
                    request_ready.register(fd_now, select.POLLIN)
                channel_fd = fd_now
            if channel_fd is not None:
                # a whole request already waiting is answered without waiting; the daemon's
                # requests go first (they may unmap, drop, or take the channel back)
                ready = {fd for fd, _ in request_ready.poll(0 if state.channel.waiting else None)}
                if sock.fileno() not in ready:
                    if ready or state.channel.waiting:
                        tensor_step = state.serve_channel()
                    continue
            try:
                header, blob, fds = compute_link.recv(sock)
                if hoptrace.ON:
                    hoptrace.mark("compute rx")
            except compute_link.LinkClosed:
                return
            fds = list(fds)
            if "client_arena" in header:
                state.map_client_arena(header["client_arena"], fds.pop(0))
            if "arena" in header:
                state.map_arena(header["arena"], fds.pop(0))
            for key, offset, size in header.get("maps", ()):
                state.map_buffer(key, offset, size)
            for key in header.get("unmaps", ()):
                state.unmap_buffer(key)
            for key in header.get("drop_graphs", ()):
                state.drop_graph(key)
            if header.get("kind") == "tensor_link":
                reply, out = state.set_tensor_link(header, fds), b""
            elif header.get("kind") == "step_channel":
                state.set_step_channel(header, fds)
                reply, out = {"status": 0}, b""
            elif header.get("kind") == "close_step_channel":
                state.close_step_channel()
                reply, out = {"status": 0}, b""
            elif header.get("kind") == "compute":
                reply, out = state.compute(header, blob)
            else:
                reply, out = {"status": 0}, b""
            reply["compute_bytes"] = state.compute_bytes
            reply["channel_counts"] = state.channel_counts
            reply["channel_open"] = state.channel is not None
            compute_link.send(sock, reply, out)
            tensor_step = "tensor" in header
            if hoptrace.ON and header.get("kind") == "compute":
                hoptrace.mark("compute sent")
    finally:
        for key in list(state.graphs):
            state.drop_graph(key)
        if state.tensor_link is not None:
            state.tensor_link.close()
        state.close_step_channel()
        state.backend.close()


def main() -> None:
    # SIGINT arrives blocked (compute/pool.py spawns us so); ignored too, in case a
    # library unblocks it: the daemon ends this process itself at shutdown
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    route_logs_to_structlog()
    fd, n_threads = int(sys.argv[1]), int(sys.argv[2])
    spin_s = float(sys.argv[3]) / 1000 if len(sys.argv) > 3 else SPIN_S
    serve(socket.socket(fileno=fd), n_threads, spin_s)


if __name__ == "__main__":
    main()
