"""The daemon side of the compute process: start it, feed it, survive its death.

Calls are serialized on one thread, so the event loop never blocks on compute
and the child computes one graph at a time with all its threads. When the child
dies (abort, segfault) or overruns its deadline, the call fails with a message
that says so, the child is reaped, and the next call starts a fresh one that
maps every live buffer again: no buffer contents are lost.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import structlog

from rpc_daemon import compute_link

log = structlog.get_logger("compute")


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
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ, GGML_NO_BACKTRACE="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rpc_daemon.compute_worker", str(child.fileno()), str(self.n_threads)],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self.sock = parent
        self.sock.settimeout(self.timeout)
        self.generation += 1
        self.mapped.clear()
        self.known_graphs.clear()
        self.pending_unmaps.clear()
        self.pending_drops.clear()
        log.info("compute process started", pid=self.proc.pid, threads=self.n_threads, generation=self.generation)

    def _death_cause(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
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
        self.restarts += 1

    def close(self) -> None:
        self._closed = True
        proc = self.proc
        if proc is not None and self._lock.locked():
            # a call is in flight; its client is gone with the daemon, so do not wait
            # (up to the compute timeout) for a result nobody can receive
            proc.kill()
        with self._lock:
            if self.sock is not None:
                self.sock.close()
                self.sock = None
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                self.proc = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ calls
    def forget_buffer(self, key: int) -> None:
        with self._lock:
            if key in self.mapped:
                self.mapped.discard(key)
                self.pending_unmaps.add(key)

    def forget_graph(self, key: str) -> None:
        with self._lock:
            if key in self.known_graphs:
                self.known_graphs.discard(key)
                self.pending_drops.add(key)

    def _call(self, header: dict, blob, buffers: dict, spec) -> tuple[dict, bytes]:
        """Blocking. `buffers` maps key -> (size, fd) for every buffer the graph uses."""
        with self._lock:
            if self._closed:
                raise ComputeFailed("the daemon is shutting down")
            if self.proc is None:
                self._start()
            maps, fds = [], []
            for key, (size, fd) in buffers.items():
                if key not in self.mapped:
                    maps.append((key, size))
                    fds.append(fd)
            header = dict(header, maps=maps, unmaps=sorted(self.pending_unmaps),
                          drop_graphs=sorted(self.pending_drops))
            key = header.get("graph_key")
            if key is not None and key not in self.known_graphs:
                header["graph"] = spec
            try:
                compute_link.send(self.sock, header, blob, fds)
                self.mapped.update(k for k, _ in maps)
                self.pending_unmaps.clear()
                self.pending_drops.clear()
                if key is not None:
                    self.known_graphs.add(key)
                reply, out, _ = compute_link.recv(self.sock)
            except socket.timeout:
                self.proc.kill()
                cause = f"compute did not finish within {self.timeout:g} s; compute process killed"
                self._death_cause()
                self._discard(cause)
                raise ComputeFailed(cause) from None
            except (compute_link.LinkClosed, OSError):
                cause = self._death_cause()
                self._discard(cause)
                raise ComputeFailed(cause) from None
            return reply, out

    async def call(self, header: dict, blob=b"", buffers: dict | None = None, spec=None) -> tuple[dict, bytes]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._call, header, blob, buffers or {}, spec)
