"""The daemon side of the compute process: start it, feed it, survive its death.

Calls are serialized by a lock on the event loop (the child computes one graph
at a time with all its threads) and the link is driven by the loop itself, so
the loop never blocks on compute and pays no thread hop per call. When the
child dies (abort, segfault) or overruns its deadline, the call fails with a
message that says so, the child is reaped, and the next call starts a fresh one
that maps every live buffer again: no buffer contents are lost.
"""
from __future__ import annotations

import asyncio
import mmap
import os
import signal
import socket
import subprocess
import sys
from typing import Callable

import structlog

from rpc_daemon import compute_link, hoptrace

log = structlog.get_logger("compute")
LINK_BUFFER = 8 << 20
FDS_PER_MESSAGE = 200  # the kernel passes at most 253 descriptors with one message (SCM_MAX_FD)


class ComputeFailed(Exception):
    pass


class ComputeProcess:
    def __init__(self, n_threads: int, timeout: float = 600.0):
        self.n_threads = n_threads
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.restarts = 0
        self.generation = 0  # bumps with every new child: its graph cache starts empty
        self.mapped: set[int] = set()  # buffer keys the current child has mapped
        self.known_graphs: set[str] = set()
        self.pending_unmaps: set[int] = set()
        self.pending_drops: set[str] = set()
        self.compute_bytes = 0  # the child's graph allocators' buffers, as its last reply said
        # --mem left for intermediates (set by the daemon), taken under the lock right before a call
        self.budget: Callable[[], int] | None = None
        # graphs whose allocation the daemon has seen (so compute_bytes holds them), and calls in
        # flight that may allocate: buffer allocations wait for those, so the two cannot both take
        # the same free memory
        self.sized: set[str] = set()
        self._sizing = 0
        self._settled: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        # outputs come back through this shared area, not through the link: a
        # megabyte of logits per step costs a memcpy instead of a socket round
        self.arena: mmap.mmap | None = None
        self.arena_fd: int | None = None
        self.arena_generation = 0  # the child generation that has it mapped
        self._busy = False
        self._closed = False
        self._flush_task: asyncio.Task | None = None

    # ------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (parent, child):  # a whole logits reply fits: no ping-pong of partial reads
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LINK_BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, LINK_BUFFER)
        env = dict(os.environ, GGML_NO_BACKTRACE="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rpc_daemon.compute_worker", str(child.fileno()), str(self.n_threads)],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self.sock = parent
        self.sock.setblocking(False)
        self.generation += 1
        self.mapped.clear()
        self.known_graphs.clear()
        self.pending_unmaps.clear()
        self.pending_drops.clear()
        self.sized.clear()
        self.compute_bytes = 0
        log.info("compute process started", pid=self.proc.pid, threads=self.n_threads, generation=self.generation)

    def warm(self) -> None:
        """Start the compute process now rather than at the first compute."""
        if self.proc is None and not self._closed:
            self._start()

    async def _death_cause(self) -> str:
        for _ in range(100):  # the link closed, so the child is gone or going: up to 1 s
            code = self.proc.poll()
            if code is not None:
                break
            await asyncio.sleep(0.01)
        else:
            self.proc.kill()
            code = self.proc.wait()
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"compute process died of {name}"
        return f"compute process exited with code {code}"

    def _discard(self, cause: str) -> None:
        log.error("compute process lost", cause=cause, generation=self.generation)
        if self.sock is not None:
            self.sock.close()
        self.sock = None
        self.proc = None
        self.compute_bytes = 0  # its memory went with it
        self.restarts += 1

    def close(self) -> None:
        """Stop the child now: at shutdown every client is gone, so a compute in
        flight has nobody to deliver to."""
        self._closed = True
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.arena is not None:
            self.arena.close()
            os.close(self.arena_fd)
            self.arena = None
        if self.proc is not None:
            if self._busy:
                self.proc.kill()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    # ------------------------------------------------------------ calls
    def forget_buffer(self, key: int) -> None:
        if key in self.mapped:
            self.mapped.discard(key)
            self.pending_unmaps.add(key)

    def flush_soon(self) -> None:
        """Tell the child about freed buffers and graphs now, not at the next
        compute, so their memory is returned while the daemon idles."""
        if self.proc is None or self._closed or not (self.pending_unmaps or self.pending_drops):
            return
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            await self.call({"kind": "sync"})
        except ComputeFailed:
            pass  # a lost child holds nothing any more

    async def allocations_settled(self) -> None:
        """Return once no call that may allocate a new graph's intermediates is in
        flight, and freed graphs have been dropped (so their memory counts free)."""
        if self._flush_task is not None and not self._flush_task.done():
            await asyncio.shield(self._flush_task)
        while self._sizing:
            if self._settled is None:
                self._settled = asyncio.Event()
            self._settled.clear()
            await self._settled.wait()

    def forget_graph(self, key: str) -> None:
        self.sized.discard(key)
        if key in self.known_graphs:
            self.known_graphs.discard(key)
            self.pending_drops.add(key)

    def _arena_for(self, size: int) -> tuple[int, int] | None:
        """(size, fd) of the output area if the child must map it anew, else None."""
        if self.arena is not None and len(self.arena) >= size:
            if self.arena_generation == self.generation:
                return None
            self.arena_generation = self.generation
            return len(self.arena), self.arena_fd
        size = max(size, 1 << 20, 2 * len(self.arena) if self.arena is not None else 0)
        if self.arena is not None:
            self.arena.close()
            os.close(self.arena_fd)
        self.arena_fd = os.memfd_create("compute-outputs", os.MFD_CLOEXEC)
        os.ftruncate(self.arena_fd, size)
        self.arena = mmap.mmap(self.arena_fd, size)
        self.arena_generation = self.generation
        return size, self.arena_fd

    async def call(self, header: dict, blob=b"", buffers: dict | None = None, spec=None,
                   out_size: int = 0) -> tuple[dict, bytes]:
        """Run one request in the child. `buffers` maps key -> (size, fd) for every
        buffer the graph uses; `spec` is sent only if the child lacks the graph."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._closed:
                raise ComputeFailed("the daemon is shutting down")
            if self.proc is None:
                self._start()
            loop = asyncio.get_running_loop()
            maps, fds = [], []
            for key, (size, fd) in (buffers or {}).items():
                if key not in self.mapped:
                    maps.append((key, size))
                    fds.append(fd)
            header = dict(header, maps=maps, unmaps=sorted(self.pending_unmaps),
                          drop_graphs=sorted(self.pending_drops))
            arena = self._arena_for(out_size) if out_size else None
            if arena is not None:
                header["arena"] = arena[0]
                fds.append(arena[1])
            key = header.get("graph_key")
            if key is not None and key not in self.known_graphs:
                header["graph"] = spec
            sizing = key is not None and key not in self.sized
            if sizing:
                if self.budget is not None:
                    header["budget"] = self.budget()
                self._sizing += 1  # from here on the finally below undoes it
            self._busy = True
            try:
                while len(header["maps"]) > FDS_PER_MESSAGE:  # a graph over many buffers: map them in batches
                    batch, header["maps"] = header["maps"][:FDS_PER_MESSAGE], header["maps"][FDS_PER_MESSAGE:]
                    batch_fds, fds = fds[:FDS_PER_MESSAGE], fds[FDS_PER_MESSAGE:]
                    await compute_link.asend(loop, self.sock, {"kind": "sync", "maps": batch}, b"", batch_fds)
                    await asyncio.wait_for(compute_link.arecv(loop, self.sock), self.timeout)
                    self.mapped.update(k for k, _ in batch)
                if hoptrace.ON:
                    hoptrace.mark("daemon to compute")
                sending = compute_link.asend(loop, self.sock, header, blob, fds)
                if len(blob) > LINK_BUFFER // 2:
                    # only a message larger than the link's buffers can block on a child that stopped
                    # reading; bounded, it cannot hold the lock (nor ALLOC_BUFFER, waiting for a graph
                    # being sized) for ever. Smaller ones skip wait_for's extra task on the hot path.
                    await asyncio.wait_for(sending, self.timeout)
                else:
                    await sending
                self.mapped.update(k for k, _ in header["maps"])
                self.pending_unmaps.clear()
                self.pending_drops.clear()
                if key is not None:
                    self.known_graphs.add(key)
                reply, out = await asyncio.wait_for(compute_link.arecv(loop, self.sock), self.timeout)
            except asyncio.TimeoutError:
                self.proc.kill()
                cause = f"compute did not finish within {self.timeout:g} s; compute process killed"
                await self._death_cause()
                self._discard(cause)
                raise ComputeFailed(cause) from None
            except asyncio.CancelledError:
                # the link is mid-message and cannot be resynchronized
                self.proc.kill()
                self._discard("call cancelled")
                raise
            except (compute_link.LinkClosed, OSError):
                if self._closed:
                    raise ComputeFailed("the daemon is shutting down") from None
                cause = await self._death_cause()
                self._discard(cause)
                raise ComputeFailed(cause) from None
            finally:
                self._busy = False
                if sizing:
                    self._sizing -= 1
                    if not self._sizing and self._settled is not None:
                        self._settled.set()
            if hoptrace.ON:
                hoptrace.mark("daemon from compute")
            self.compute_bytes = reply.get("compute_bytes", self.compute_bytes)
            if reply.get("graph_dropped") and key is not None:
                self.known_graphs.discard(key)  # refused for memory: the spec goes again next time
            elif sizing and reply.get("status") == 0:
                self.sized.add(key)
            if reply.get("arena_bytes"):
                out = self.arena[: reply["arena_bytes"]]  # a copy: the next call reuses the area
            return reply, out
