"""All-reduce over tensor links, in the compute process.

A tensor-parallel compute is one graph with marked tensors (the partial sums
after the attention's output projection and after the FFN's down projection).
It runs in segments: every node up to a marked tensor, then that tensor is
summed with the other members' (each sends its partial to every peer and
receives theirs; all add them in rank order, so every member holds the same
bits), then on to the next. The links are sockets the daemon connected and
handed over (daemon/tensor_links.py); the bytes go compute process to compute
process, never through a daemon's event loop.

Every wait has a deadline; the daemon ends a wait at once by shutting its
copy of a link down (a peer failed elsewhere: TENSOR_CANCEL). Any failure
drops the link: the coordinator links the group again before its next step.
"""
from __future__ import annotations

import os
import select
import socket
import time

import numpy as np

from ggml_ffi import ffi, lib
from rpc_daemon.wire.tensor_frames import EXCHANGE, LinkBroken, check_exchange_header, exchange_header

_POLL_IN, _POLL_OUT = select.POLLIN, select.POLLOUT
# How long an exchange waits for its peers without sleeping (all_reduce), by
# default (the daemon's --spin-ms): 20 ms covers nearly every wait of a member
# for its peer within a step.
SPIN_S = 0.02


class TensorLink:
    """This process's sockets to the other members of its group, by rank."""

    def __init__(self, link_id: int, rank: int, socks: dict[int, socket.socket], spin_s: float = SPIN_S):
        self.link_id, self.rank, self.socks = link_id, rank, socks
        self.spin_s = spin_s  # how long a wait for the peers spins before it sleeps
        for s in socks.values():
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._inboxes: dict[int, bytearray] = {}
        self._heads = {r: memoryview(bytearray(EXCHANGE.size)) for r in socks}  # each peer's frame header
        self.exchanges = 0
        self.wait_s = 0.0  # time spent in exchanges (sending, waiting for peers, summing)

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        self.socks.clear()

    def all_reduce(self, data, step: int, index: int, deadline: float) -> None:
        """Sum `data` (a writable f32 buffer: this member's partial) with every
        peer's, in rank order, into `data`. The partial goes out from its own
        memory and the peers' come into buffers kept between calls: one pass
        over each partial to sum, none to copy.

        The wait spins (non-blocking reads, yielding the core to any other
        runnable task between them) for up to `spin_s` before it sleeps in
        poll(): a peer doing the same work arrives within microseconds to a
        few milliseconds, and a sleeping core wakes slowly, on a VM slower
        still (loopback, 2-core VM: bench/bench_exchange.py 173-289 us an
        exchange with poll() alone, 42-83 us spinning; a 1.1B llama over 2
        workers 9.1 tokens/s with 1 ms of spin, 11.9 with 20 ms)."""
        started = time.perf_counter()
        nbytes = len(data)
        need = EXCHANGE.size + nbytes
        header = exchange_header(step, index, nbytes)
        mine = memoryview(data).cast("B")
        peers = [_Peer(r, s, self._heads[r], self._inbox(r, nbytes)) for r, s in self.socks.items()]
        for p in peers:
            p.start_send([memoryview(header), mine])
        sleep_after = started + self.spin_s
        busy = peers
        while busy:
            for p in busy:
                if p.out:
                    p.send()
                if p.got < need:
                    p.receive(need, step, index, nbytes)
            busy = [p for p in busy if p.out or p.got < need]
            if not busy:
                break
            if time.perf_counter() < sleep_after:
                os.sched_yield()  # a peer, a daemon or the coordinator waiting for this core runs first
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LinkBroken(f"tensor exchange {index} of step {step}: no answer from rank(s) "
                                     f"{sorted(p.rank for p in busy)} in time")
                poller = select.poll()
                for p in busy:
                    poller.register(p.sock, (_POLL_IN if p.got < need else 0) | (_POLL_OUT if p.out else 0))
                poller.poll(min(left, 1.0) * 1000)
        own = np.frombuffer(data, np.float32)
        if len(peers) == 1:  # two members: a + b is b + a, bit for bit
            np.add(own, np.frombuffer(peers[0].body, np.float32, len(own)), out=own)
        else:  # rank order: the same sum, bit for bit, on every member
            theirs = {p.rank: p.body for p in peers}
            parts = [own if r == self.rank else np.frombuffer(theirs[r], np.float32, len(own))
                     for r in range(len(peers) + 1)]
            total = parts[0] + parts[1]
            for part in parts[2:]:
                np.add(total, part, out=total)
            own[:] = total
        self.exchanges += 1
        self.wait_s += time.perf_counter() - started

    def _inbox(self, r: int, nbytes: int) -> memoryview:
        """A buffer of `nbytes` for rank r's partials, kept between exchanges."""
        buf = self._inboxes.get(r)
        if buf is None or len(buf) < nbytes:
            buf = self._inboxes[r] = bytearray(nbytes)
        return memoryview(buf)[:nbytes]


class _Peer:
    """One exchange's progress with one peer: what is left to send, how much has come."""

    __slots__ = ("rank", "sock", "head", "body", "out", "got")

    def __init__(self, rank: int, sock: socket.socket, head: memoryview, body: memoryview):
        self.rank, self.sock, self.head, self.body = rank, sock, head, body
        self.out: list = []
        self.got = 0

    def start_send(self, parts: list) -> None:
        self.out = parts
        self.send()

    def send(self) -> None:
        try:
            k = self.sock.sendmsg(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            raise LinkBroken(f"tensor link to rank {self.rank}: {exc.strerror or exc}") from None
        parts = self.out
        while k and parts:
            if k >= len(parts[0]):
                k -= len(parts[0])
                parts.pop(0)
            else:
                parts[0] = parts[0][k:]
                k = 0

    def receive(self, need: int, step: int, index: int, nbytes: int) -> None:
        """Read what has come (never blocks); the header is checked as soon as it is whole."""
        hsize = EXCHANGE.size
        while self.got < need:
            pos = self.got
            view = self.head[pos:] if pos < hsize else self.body[pos - hsize:]
            try:
                k = self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise LinkBroken(f"tensor link to rank {self.rank}: {exc.strerror or exc}") from None
            if k == 0:
                raise LinkBroken(f"tensor link to rank {self.rank} closed (the peer failed, or the step was "
                                 "cancelled)")
            self.got = pos + k
            if pos < hsize <= self.got:
                check_exchange_header(bytes(self.head), step, index, nbytes)


class SegmentedGraph:
    """A graph cut after each exchanged tensor: the sub-graphs, each ending at one
    (the last ends the graph), and the exchanged tensors in compute order."""

    def __init__(self, gf, ptrs, exchange: tuple):
        nodes = [lib.ggml_graph_node(gf, i) for i in range(lib.ggml_graph_n_nodes(gf))]
        position = {int(ffi.cast("uintptr_t", n)): i for i, n in enumerate(nodes)}
        marks = sorted((position[int(ffi.cast("uintptr_t", ptrs[t]))], t) for t in exchange)
        bounds = [0] + [p + 1 for p, _ in marks] + [len(nodes)]
        self.exchange = exchange
        self.tensors = [ptrs[t] for _, t in marks]
        size = sum(lib.ggml_graph_overhead_custom(max(b - a, 1), False) for a, b in zip(bounds, bounds[1:]))
        params = ffi.new("struct ggml_init_params *", {"mem_size": size + 4096, "mem_buffer": ffi.NULL,
                                                        "no_alloc": True})
        self.ctx = lib.ggml_init(params[0])
        self.parts = []
        for a, b in zip(bounds, bounds[1:]):
            part = lib.ggml_new_graph_custom(self.ctx, max(b - a, 1), False)
            for node in nodes[a:b]:
                lib.ggml_graph_add_node(part, node)
            self.parts.append(part)

    def close(self) -> None:
        if self.ctx is not None:
            lib.ggml_free(self.ctx)
            self.ctx = None

    def compute(self, backend, link: TensorLink, step: int, timeout: float) -> int:
        """Every segment and exchange in order; ggml's status (an exchange failure raises LinkBroken)."""
        deadline = time.monotonic() + timeout
        for i, part in enumerate(self.parts):
            if lib.ggml_graph_n_nodes(part):
                status = backend.compute(part)
                if status != lib.GGML_STATUS_SUCCESS:
                    return status
            if i < len(self.tensors):
                t = self.tensors[i]
                link.all_reduce(ffi.buffer(t.data, lib.ggml_nbytes(t)), step, i, deadline)
        return lib.GGML_STATUS_SUCCESS
