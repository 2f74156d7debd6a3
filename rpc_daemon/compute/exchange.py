"""All-reduces and gathers over tensor links, in the compute process.

A tensor-parallel compute is one graph with marked tensors (the partial sums
after the attention's output projection and after the FFN's down projection).
It runs in segments: every node up to a marked tensor, then that tensor is
summed with the other members' (each sends its partial to every peer and
receives theirs; all add them in rank order, so every member holds the same
bits), then on to the next. A gathered tensor (exact sums: a PAD of this
member's piece) is not computed at all: each member sends its piece and puts
every member's piece in its place. The links are sockets the daemon connected and
handed over (daemon/tensor_links.py); the bytes go compute process to compute
process, never through a daemon's event loop.

Every wait has a deadline; the daemon ends a wait at once by shutting its
copy of a link down (a peer failed elsewhere: TENSOR_CANCEL). Any failure
drops the link: the coordinator links the group again before its next step.

Between TLS workers the links are TLS sessions this process set up itself
(link_tls.py): the same frames, encrypted and decrypted by OpenSSL in memory,
the ciphertext sent and received on the same sockets (_TlsPeer).
"""
from __future__ import annotations

import os
import select
import socket
import ssl
import time
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np

from ggml_ffi import ffi, lib
from rpc_daemon.wire.tensor_frames import EXCHANGE, LinkBroken, check_exchange_header, exchange_header

if TYPE_CHECKING:
    from rpc_daemon.compute.link_tls import TlsSession

_POLL_IN, _POLL_OUT = select.POLLIN, select.POLLOUT
# How long an exchange waits for its peers without sleeping (all_reduce), by
# default (the daemon's --spin-ms): 20 ms covers nearly every wait of a member
# for its peer within a step.
SPIN_S = 0.02
TLS_RECEIVE = 1 << 18  # bytes of ciphertext one receive over a TLS link takes at most


class TensorLink:
    """This process's sockets to the other members of its group, by rank."""

    def __init__(self, link_id: int, rank: int, socks: dict[int, socket.socket], spin_s: float = SPIN_S,
                 sessions: dict[int, TlsSession] | None = None):
        """`sessions`: the TLS session over each socket, by rank (link_tls.secure), or None."""
        self.link_id, self.rank, self.socks = link_id, rank, socks
        self.spin_s = spin_s  # how long a wait for the peers spins before it sleeps
        for s in socks.values():
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if sessions is None:
            self._peers = [_Peer(r, s) for r, s in sorted(socks.items())]  # kept between exchanges
        else:
            scratch = memoryview(bytearray(TLS_RECEIVE))  # the peers' ciphertext passes through it one at a time
            self._peers = [_TlsPeer(r, s, sessions[r], scratch) for r, s in sorted(socks.items())]
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
        workers 9.1 tokens/s with 1 ms of spin, 11.9 with 20 ms).

        Every exchange of a step runs on the critical path of every member (a
        1.1B llama: 44 a token), so its own work is kept to the system calls:
        one send of header and partial, one receive of the peer's header and
        partial, one comparison of the headers (both sides' are the same
        bytes), one sum."""
        started = time.perf_counter()
        nbytes = len(data)
        header = exchange_header(step, index, nbytes)
        mine = memoryview(data).cast("B")
        peers = self._peers
        for p in peers:
            p.start(header, mine, header, nbytes)
        self._finish_exchange(step, index, deadline)
        own = np.frombuffer(data, np.float32)
        if len(peers) == 1:  # two members: a + b is b + a, bit for bit
            np.add(own, peers[0].partial(), out=own)
        else:  # rank order: the same sum, bit for bit, on every member
            theirs = {p.rank: p.partial() for p in peers}
            parts = [own if r == self.rank else theirs[r] for r in range(len(peers) + 1)]
            total = parts[0] + parts[1]
            for part in parts[2:]:
                np.add(total, part, out=total)
            own[:] = total
        self.exchanges += 1
        self.wait_s += time.perf_counter() - started

    def all_gather(self, whole, piece, lengths: tuple, rows: int, step: int, index: int, deadline: float) -> None:
        """Fill `whole` (a writable f32 buffer of `rows` rows of sum(lengths) floats) with every
        member's piece of each row, member r's `lengths[r]` floats after the lower ranks': this
        member's from `piece` (its rows, contiguous), the peers' as they send theirs. Each member
        sends only its piece, and nothing is summed (exact sums: the members' values, bit for bit).
        Waits as all_reduce does."""
        started = time.perf_counter()
        header, mine = exchange_header(step, index, len(piece)), memoryview(piece).cast("B")
        for p in self._peers:
            nbytes = 4 * rows * lengths[p.rank]
            p.start(header, mine, exchange_header(step, index, nbytes), nbytes)
        out = np.frombuffer(whole, np.float32).reshape(rows, -1)
        starts = (0, *accumulate(lengths))
        lo, n = starts[self.rank], lengths[self.rank]
        out[:, lo:lo + n] = np.frombuffer(piece, np.float32).reshape(rows, n)  # while the peers' pieces travel
        self._finish_exchange(step, index, deadline)
        for p in self._peers:
            lo, n = starts[p.rank], lengths[p.rank]
            out[:, lo:lo + n] = p.partial().reshape(rows, n)
        self.exchanges += 1
        self.wait_s += time.perf_counter() - started

    def _finish_exchange(self, step: int, index: int, deadline: float) -> None:
        """Send what is left to send and receive every peer's frame: spinning for `spin_s`, then
        sleeping in poll() until the deadline."""
        busy = self._peers
        sleep_after = time.perf_counter() + self.spin_s
        while True:
            for p in busy:
                if p.out:
                    p.send()
                if p.got < p.need:
                    p.receive()
            busy = [p for p in busy if p.out or p.got < p.need]
            if not busy:
                return
            if time.perf_counter() < sleep_after:
                os.sched_yield()  # a peer, a daemon or the coordinator waiting for this core runs first
            else:
                self._sleep_until_ready(busy, step, index, deadline)

    @staticmethod
    def _sleep_until_ready(busy: list, step: int, index: int, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LinkBroken(f"tensor exchange {index} of step {step}: no answer from rank(s) "
                             f"{sorted(p.rank for p in busy)} in time")
        poller = select.poll()
        for p in busy:
            poller.register(p.sock, (_POLL_IN if p.got < p.need else 0) | (_POLL_OUT if p.out else 0))
        poller.poll(min(left, 1.0) * 1000)


class _Peer:
    """One peer of the link, and the current exchange's progress with it: what is left to
    send, how much of its frame has come (into its header and a body kept between calls)."""

    __slots__ = ("rank", "sock", "head", "inbox", "body", "out", "got", "need", "expect")

    def __init__(self, rank: int, sock: socket.socket):
        self.rank, self.sock = rank, sock
        self.head = memoryview(bytearray(EXCHANGE.size))
        self.inbox = bytearray()
        self.body = memoryview(self.inbox)
        self.out: list = []
        self.got = self.need = 0
        self.expect = b""  # the header the peer's frame must carry

    def start(self, header: bytes, mine: memoryview, expect: bytes, nbytes: int) -> None:
        """Send `header` and `mine`; receive a frame whose header is `expect`, with `nbytes` after it."""
        self._expect(expect, nbytes)
        self.out = [header, mine]
        self.send()

    def _expect(self, expect: bytes, nbytes: int) -> None:
        """Ready to receive a frame of `nbytes` of partial (the body kept between exchanges)."""
        self.expect = expect
        if len(self.body) != nbytes:
            if len(self.inbox) < nbytes:
                self.inbox = bytearray(nbytes)
            self.body = memoryview(self.inbox)[:nbytes]
        self.got, self.need = 0, EXCHANGE.size + nbytes

    def _took(self, pos: int, k: int) -> None:
        """`k` more bytes of the frame came after `pos`; its header, once whole, must be the expected one."""
        self.got = pos + k
        if pos < EXCHANGE.size <= self.got and self.head != self.expect:
            step, index, nbytes = EXCHANGE.unpack(self.expect)
            check_exchange_header(bytes(self.head), step, index, nbytes)

    def _broken(self, why) -> LinkBroken:
        return LinkBroken(f"tensor link to rank {self.rank}: {why}")

    def _closed(self) -> LinkBroken:
        return LinkBroken(f"tensor link to rank {self.rank} closed (the peer failed, or the step was cancelled)")

    def partial(self) -> np.ndarray:
        return np.frombuffer(self.body, np.float32)

    def send(self) -> None:
        try:
            k = self.sock.sendmsg(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            raise self._broken(exc.strerror or exc) from None
        parts = self.out
        while k and parts:
            if k >= len(parts[0]):
                k -= len(parts[0])
                parts.pop(0)
            else:
                parts[0] = memoryview(parts[0])[k:]
                k = 0

    def receive(self) -> None:
        """Read what has come (never blocks), the header and the partial in one call; the
        header, as soon as it is whole, must be the expected one (the same step and index, the
        size this peer's part has)."""
        hsize = EXCHANGE.size
        while self.got < self.need:
            pos = self.got
            views = [self.head[pos:], self.body] if pos < hsize else [self.body[pos - hsize:]]
            try:
                k = self.sock.recvmsg_into(views)[0]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise self._broken(exc.strerror or exc) from None
            if k == 0:
                raise self._closed()
            self._took(pos, k)


class _TlsPeer(_Peer):
    """A peer over TLS. Its session (link_tls.TlsSession) is an SSLObject over memory BIOs: a
    frame is encrypted whole into the outgoing BIO (header and partial, two records) and leaves
    in the socket sends of _Peer; a receive takes all the socket has into the incoming BIO in one
    call and decrypts from there (an SSLSocket reads each record's header and body in a system
    call of its own: two processes exchanging alone on the 2-core VM took 85-97 us for 2 KiB
    and 1.4-2.8 ms for 512 KiB through SSLSockets, 19-22 us and 0.56-0.76 ms this way, against
    11-19 us and 0.1-0.17 ms without TLS). A receive decrypts until it has the frame or
    OpenSSL wants bytes the socket has not got, so no whole record waits in memory while poll()
    waits on the socket; what it took of the next frame stays in the BIO for the next exchange,
    whose first receive comes before any wait."""

    __slots__ = ("tls", "scratch")

    def __init__(self, rank: int, sock: socket.socket, tls: TlsSession, scratch: memoryview):
        super().__init__(rank, sock)
        self.tls, self.scratch = tls, scratch

    def start(self, header: bytes, mine: memoryview, expect: bytes, nbytes: int) -> None:
        self._expect(expect, nbytes)
        try:
            self.tls.obj.write(header)
            self.tls.obj.write(mine)
        except ssl.SSLError as exc:
            raise self._broken(exc) from None
        self.out = [self.tls.outgoing.read()]
        self.send()

    def receive(self) -> None:
        hsize = EXCHANGE.size
        obj = self.tls.obj
        while self.got < self.need:
            pos = self.got
            view = self.head[pos:] if pos < hsize else self.body[pos - hsize:]
            try:
                k = obj.read(len(view), view)
            except ssl.SSLWantReadError:  # a record not all here: the socket's next bytes
                try:
                    n = self.sock.recv_into(self.scratch)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:
                    raise self._broken(exc.strerror or exc) from None
                if n == 0:
                    raise self._closed()
                self.tls.incoming.write(self.scratch[:n])
                continue
            except ssl.SSLError as exc:  # a record that does not decrypt, an alert
                raise self._broken(exc) from None
            if k == 0:  # the peer ended its TLS session
                raise self._closed()
            self._took(pos, k)


class SegmentedGraph:
    """A graph cut after each exchanged tensor: the sub-graphs, each ending at one
    (the last ends the graph), and the exchanged tensors in compute order. A gathered
    tensor (`gather`: every member's length, else None) is a PAD of the member's piece
    that is never computed: its sub-graph ends before it, and the exchange fills it."""

    def __init__(self, gf, ptrs, exchange: tuple, gather: tuple = (), rank: int = 0, n: int = 1):
        """`rank`, `n`: this member's place in its group, which each gathered tensor's PAD must match
        (ValueError, naming the tensor, if it does not)."""
        nodes = [lib.ggml_graph_node(gf, i) for i in range(lib.ggml_graph_n_nodes(gf))]
        position = {int(ffi.cast("uintptr_t", n)): i for i, n in enumerate(nodes)}
        gather = _gather_or_none(gather, exchange)
        marks = sorted(((position[int(ffi.cast("uintptr_t", ptrs[t]))], t, g) for t, g in zip(exchange, gather)),
                       key=lambda m: m[0])
        for _, t, lengths in marks:
            if lengths is not None:
                _check_piece(ptrs[t], t, lengths, rank, n)
        spans = list(zip([0] + [p + 1 for p, _, _ in marks],
                         [p + (lengths is None) for p, _, lengths in marks] + [len(nodes)]))
        self.exchange, self.gather = exchange, gather
        self.tensors = [ptrs[t] for _, t, _ in marks]
        self.lengths = [lengths for _, _, lengths in marks]
        size = sum(lib.ggml_graph_overhead_custom(max(b - a, 1), False) for a, b in spans)
        params = ffi.new("struct ggml_init_params *", {"mem_size": size + 4096, "mem_buffer": ffi.NULL,
                                                        "no_alloc": True})
        self.ctx = lib.ggml_init(params[0])
        self.parts = []
        for a, b in spans:
            part = lib.ggml_new_graph_custom(self.ctx, max(b - a, 1), False)
            for node in nodes[a:b]:
                lib.ggml_graph_add_node(part, node)
            self.parts.append(part)

    def serves(self, exchange: tuple, gather: tuple) -> bool:
        """Whether this cut is the one for `exchange` and `gather` (a request's)."""
        return self.exchange == exchange and self.gather == _gather_or_none(gather, exchange)

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
                t, lengths = self.tensors[i], self.lengths[i]
                whole = ffi.buffer(t.data, lib.ggml_nbytes(t))
                if lengths is None:
                    link.all_reduce(whole, step, i, deadline)
                else:
                    piece = t.src[0]
                    link.all_gather(whole, ffi.buffer(piece.data, lib.ggml_nbytes(piece)), lengths,
                                    lib.ggml_nrows(t), step, i, deadline)
        return lib.GGML_STATUS_SUCCESS


def _gather_or_none(gather: tuple, exchange: tuple) -> tuple:
    """A request's gather entries, one per exchange (none given: every exchange summed)."""
    return tuple(gather) or (None,) * len(exchange)


def _check_piece(t, index: int, lengths: tuple, rank: int, n: int) -> None:
    """A gathered tensor's PAD puts this member's piece where `lengths` says rank `rank` of `n` has it."""
    if len(lengths) != n:
        raise ValueError(f"tensor.gather for tensor {index}: {len(lengths)} lengths for a group of {n}")
    lo, piece = ffi.cast("int32_t *", t.op_params)[0], t.src[0].ne[0]
    if (lo, piece) != (sum(lengths[:rank]), lengths[rank]):
        raise ValueError(f"tensor.gather for tensor {index}: rank {rank}'s piece is {lengths[rank]} floats from "
                         f"{sum(lengths[:rank])}, the graph pads {piece} floats from {lo}")
