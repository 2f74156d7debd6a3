# Over 400 lines: ComputePool and ComputeProcess share the lock, the memory budget and the spare.
"""The daemon side of the compute processes: start them, feed them, survive their deaths.

Each client computes in a process of its own, which maps that client's arena
(rpc_daemon/daemon/buffers.py) and no other memory of any client: a graph that gets
past validation and reads or writes out of bounds in libggml can reach only its
own client's data. A process that has ever served a client is never given to
another; it is killed when its client leaves.

`ComputePool` keeps one spare process started ahead (the first compute of a new
client, or the restart after a crash, takes it and a new spare starts), a
daemon-wide lock that serializes computes (each process computes with all the
daemon's threads: one graph at a time uses the machine) and hands them out
fairly between clients (`FairLock`: the client that has used the least compute
time goes next), and the sum of the processes' intermediates, counted against --mem.

Calls are driven by the event loop itself, so the loop never blocks on compute
and pays no thread hop per call. When a child dies (abort, segfault) or
overruns its deadline, the call fails with a message that says so, the child is
reaped, and the client's next call takes a fresh one that maps its arena again:
no buffer contents are lost.
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

from rpc_daemon.compute import link as compute_link
from rpc_daemon.compute.fair_lock import FairLock
from rpc_daemon.service import hoptrace
from rpc_daemon.service.loop import within

log = structlog.get_logger("compute")
LINK_BUFFER = 8 << 20
CHANNEL_COUNTS_EVERY = 1.0  # seconds between the daemon's asks for a step channel's counts
FLUSH_ROUNDS = 4  # syncs one flush sends at most, while frees keep coming during them


class ComputeFailed(Exception):
    pass


def spawn_child(n_threads: int, spin_ms: float | None = None) -> tuple[subprocess.Popen, socket.socket]:
    """A compute process on one end of a socket pair (the other returned); `spin_ms`: its
    --spin-ms (None: the compute process's own default, exchange.SPIN_S)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end in (parent, child):  # a whole logits reply fits: no ping-pong of partial reads
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LINK_BUFFER)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, LINK_BUFFER)
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    # Ctrl-C in a terminal reaches the whole process group, the compute processes too;
    # the daemon ends them itself when it shuts down. The child is forked with SIGINT
    # blocked and keeps it blocked (a blocked signal stays blocked across exec), so it
    # never prints a KeyboardInterrupt traceback, even while still starting up.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rpc_daemon.compute.worker", str(child.fileno()), str(n_threads),
             *(() if spin_ms is None else (repr(spin_ms),))],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
    except BaseException:
        parent.close()
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
    parent.setblocking(False)
    log.info("compute process started", pid=proc.pid, threads=n_threads)
    return proc, parent


class ComputePool:
    """Every compute process of the daemon: one per client that computes, and a spare."""

    def __init__(self, n_threads: int, timeout: float = 600.0, spin_ms: float | None = None):
        self.n_threads = n_threads
        self.spin_ms = spin_ms  # DaemonConfig.spin_ms, for every compute process started
        self.timeout = timeout
        self.by_client: dict[int, ComputeProcess] = {}
        self._spare: tuple[subprocess.Popen, socket.socket] | None = None
        self._dying: list[subprocess.Popen] = []  # killed, not reaped yet
        self._reaper: asyncio.TimerHandle | None = None
        self._lock: FairLock | None = None
        self.channel_holder: ComputeProcess | None = None  # the one process with a step channel (daemon/step_channel.py)
        # computes, compute_us, errors, bytes in and out over step channels (told by the processes in
        # their replies)
        self.channel_counts = [0, 0, 0, 0, 0]
        self._channel_poll: asyncio.TimerHandle | None = None
        self._closed = False
        self._respawn = False
        # --mem left for buffers' neighbours (set by the daemon): max_bytes - client buffers
        self.budget_base: Callable[[], int] | None = None

    @property
    def lock(self) -> FairLock:
        """Daemon-wide: one graph computes at a time, whoever's it is. A connection
        asks for it once per request, as `lock(client_id)`: among the clients
        waiting, the one that has held it least goes next (FairLock), so a client
        with long computes cannot take the machine from one with short ones."""
        if self._lock is None:
            self._lock = FairLock()
        return self._lock

    @property
    def compute_bytes(self) -> int:
        return sum(p.compute_bytes for p in self.by_client.values())

    @property
    def restarts(self) -> int:
        return sum(p.restarts for p in self.by_client.values())

    def adopt(self, child: tuple[subprocess.Popen, socket.socket]) -> None:
        """`child` (spawn_child's) as the spare: one started before the pool was."""
        if self._spare is None and not self._closed:
            self._spare = child
        else:
            child[1].close()
            self._bury(child[0])

    def warm(self) -> None:
        """Start the spare now, so a client's first compute need not wait for a process to start."""
        if self._spare is None and not self._closed:
            self._spare = spawn_child(self.n_threads, self.spin_ms)

    def take_child(self, client_id: int) -> tuple[subprocess.Popen, socket.socket]:
        """A fresh process for a client: the spare (then a new spare starts), else a new one."""
        child, self._spare = self._spare, None
        if child is None or child[0].poll() is not None:
            if child is not None:
                child[1].close()
            child = spawn_child(self.n_threads, self.spin_ms)
        self._respawn = True  # the next spare starts once this call is done: not on its critical path
        log.info("compute process assigned", pid=child[0].pid, client=client_id)
        return child

    def poll_channel_counts(self) -> None:
        """While a process has a step channel, ask it for its counts every CHANNEL_COUNTS_EVERY
        seconds (its steps pass the daemon by): the metrics lag them by at most that."""
        if self._channel_poll is not None or self._closed:
            return

        def tick():
            self._channel_poll = None
            holder = self.channel_holder
            if holder is not None and not self._closed:
                task = asyncio.get_running_loop().create_task(holder.sync())
                task.add_done_callback(lambda _: self.poll_channel_counts())
        self._channel_poll = asyncio.get_running_loop().call_later(CHANNEL_COUNTS_EVERY, tick)

    def call_done(self) -> None:
        if self._respawn:  # after the reply has gone out (the caller replies before it yields)
            self._respawn = False
            asyncio.get_running_loop().call_soon(self.warm)

    def for_client(self, client_id: int) -> ComputeProcess:
        proc = self.by_client.get(client_id)
        if proc is None:
            proc = self.by_client[client_id] = ComputeProcess(self, client_id)
        return proc

    def get(self, client_id: int) -> ComputeProcess | None:
        return self.by_client.get(client_id)

    def release(self, client_id: int) -> None:
        """The client left: its process (which has seen its memory) is killed."""
        proc = self.by_client.pop(client_id, None)
        if proc is not None and self.channel_holder is proc:
            self.channel_holder = None
        if proc is not None:
            self._bury(proc.shut())
        if self._lock is not None:
            self._lock.forget(client_id)

    def _bury(self, child: subprocess.Popen | None) -> None:
        if child is None:
            return
        try:
            child.kill()
        except ProcessLookupError:
            pass
        self._dying.append(child)
        self._reap()

    def _reap(self) -> None:
        self._reaper = None
        self._dying = [p for p in self._dying if p.poll() is None]
        if self._dying and not self._closed:
            self._reaper = asyncio.get_running_loop().call_later(0.05, self._reap)

    async def allocations_settled(self) -> None:
        for proc in list(self.by_client.values()):
            await proc.allocations_settled()

    def close(self) -> None:
        """Stop every child now: at shutdown every client is gone, so a compute in
        flight has nobody to deliver to. Each is killed and reaped."""
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
        if self._channel_poll is not None:
            self._channel_poll.cancel()
        children = [p.shut() for p in self.by_client.values()]
        self.by_client.clear()
        if self._spare is not None:
            children.append(self._spare[0])
            self._spare[1].close()
            self._spare = None
        children = [c for c in children if c is not None] + self._dying
        for child in children:
            if child.poll() is None:
                child.kill()
        for child in children:
            child.wait()
        self._dying = []


class ComputeProcess:
    """One client's compute process (restarted after a death, for that client only)."""

    def __init__(self, pool: ComputePool, client_id: int):
        self.pool = pool
        self.client_id = client_id
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.restarts = 0
        self.generation = 0  # bumps with every new child: its graph cache starts empty
        self.mapped: set[int] = set()  # buffer keys the current child has a ggml buffer for
        self.arena_mapped = False  # the current child has mapped the client's arena
        self.known_graphs: set[str] = set()
        self.pending_unmaps: set[int] = set()
        self.pending_drops: set[str] = set()
        self.compute_bytes = 0  # the child's graph allocators' buffers, as its last reply said
        self.channel_counts_seen = (0, 0, 0, 0, 0)  # the current child's channel counts, as its last reply said
        # graphs whose allocation the daemon has seen (so compute_bytes holds them), and calls in
        # flight that may allocate: buffer allocations wait for those, so the two cannot both take
        # the same free memory
        self.sized: set[str] = set()
        self._sizing = 0
        self._settled: asyncio.Event | None = None
        # outputs come back through this shared area, not through the link: a
        # megabyte of logits per step costs a memcpy instead of a socket round
        self.arena: mmap.mmap | None = None
        self.arena_fd: int | None = None
        self.arena_generation = 0  # the child generation that has it mapped
        self._busy = False
        self._closed = False
        self._flush_task: asyncio.Task | None = None
        self._taking_back: asyncio.Task | None = None  # its step channel being closed (another client computes)
        # a death found by a call whose caller tells no client (a sync, a take-back): the cause, which
        # the client's next compute gets as its answer
        self.unreported: str | None = None

    # ------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        self.proc, self.sock = self.pool.take_child(self.client_id)
        self.generation += 1
        self.mapped.clear()
        self.arena_mapped = False
        self.known_graphs.clear()
        self.pending_unmaps.clear()
        self.pending_drops.clear()
        self.sized.clear()
        self.compute_bytes = 0
        self.channel_counts_seen = (0, 0, 0, 0, 0)

    def budget(self) -> int | None:
        """--mem left for this process's intermediates: the cap less every buffer and
        the other processes' intermediates."""
        if self.pool.budget_base is None:
            return None
        return self.pool.budget_base() - (self.pool.compute_bytes - self.compute_bytes)

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

    async def take_channel_back(self) -> None:
        """Close this process's step channel (after the step it is in, if any): another client
        computes, so this one's steps go through the daemon's fair lock again. Concurrent
        callers share one close."""
        if self._taking_back is None or self._taking_back.done():
            self._taking_back = asyncio.get_running_loop().create_task(self._close_channel())
        await asyncio.shield(self._taking_back)

    async def _close_channel(self) -> None:
        try:
            await self.call({"kind": "close_step_channel"})
        except ComputeFailed as exc:
            self.unreported = str(exc)  # a lost child took its channel with it; its client hears of it
        if self.pool.channel_holder is self:
            self.pool.channel_holder = None
        log.info("step channel taken back", client=self.client_id)

    def _discard(self, cause: str) -> None:
        if self.pool.channel_holder is self:  # its channel died with it
            self.pool.channel_holder = None
        log.error("compute process lost", cause=cause, generation=self.generation, client=self.client_id,
                  pid=self.proc.pid if self.proc is not None else None)
        if self.sock is not None:
            self.sock.close()
        self.sock = None
        self.proc = None
        self.compute_bytes = 0  # its memory went with it
        self.restarts += 1

    def shut(self) -> subprocess.Popen | None:
        """No more calls; returns the child for the pool to kill and reap. A call in flight (a
        flush) keeps the link and the output area until the child's death ends it: closing a
        socket the loop is reading from would leave that call, and the daemon-wide lock, hanging."""
        self._closed = True
        self.compute_bytes = 0
        proc, self.proc = self.proc, None
        if not self._busy:
            self._close_link()
        return proc

    def _close_link(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.arena is not None:
            self.arena.close()
            os.close(self.arena_fd)
            self.arena = None

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
        # frees that came while a sync was out are taken by another now, not at the client's next
        # compute (until then their memory would count against --mem); a bounded number of rounds
        for _ in range(FLUSH_ROUNDS):
            await self.sync()
            if (self.proc is None or self._closed or self.unreported is not None
                    or not (self.pending_unmaps or self.pending_drops)):
                return  # done, or the child is lost (its client hears of it; a new one starts empty)

    async def sync(self) -> None:
        """Tell the child about freed buffers and graphs, and return once it has taken them."""
        try:
            await self.call({"kind": "sync"})
        except ComputeFailed as exc:
            self.unreported = str(exc)  # a lost child holds nothing any more; its client hears of it

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
                   out_size: int = 0, client_arena: tuple[int, int] | None = None,
                   fds: tuple = ()) -> tuple[dict, bytes]:
        """Run one request in the child. `buffers` maps key -> (offset, size) in the
        client's arena for every buffer the graph uses; `client_arena` is the
        arena's (size, fd); `spec` is sent only if the child lacks the graph;
        `fds` go to the child after those of the arenas (tensor links' sockets)."""
        if header.get("kind") == "tensor_link" and header.get("tls") is not None:
            # a TLS link's setup waits on the peers (handshakes, up to the join's deadline), not on
            # the CPU: under the daemon-wide lock another client's compute would wait on it, and two
            # coordinators sharing these workers, their joins granted in opposite orders, would each
            # hold a lock the other's handshake needs until the deadlines. A TLS daemon grants no step
            # channel, and the session's requests come one at a time: no other call is in flight here.
            return await self._call_locked(header, blob, buffers, spec, out_size, client_arena, fds)
        while True:  # no compute of another client beside a channel's: taken back first
            holder = self.pool.channel_holder
            if holder is not None and holder is not self:
                await holder.take_channel_back()
            if header.get("kind") == "step_channel":
                # the holder from now on: a free syncs with the process before the channel can be used
                self.pool.channel_holder = self
            async with self.pool.lock(self.client_id):
                holder = self.pool.channel_holder
                if holder is not None and holder is not self:
                    continue  # handed over while this call waited for the lock: again
                return await self._call_locked(header, blob, buffers, spec, out_size, client_arena, fds)

    async def _call_locked(self, header: dict, blob, buffers, spec, out_size: int, client_arena, fds):
        """call(), the daemon-wide lock held (but for a TLS link's setup: call())."""
        if self._closed:
            raise ComputeFailed("the daemon is shutting down")
        if header.get("kind") == "compute" and self.unreported is not None:
            cause, self.unreported = self.unreported, None  # found by a call that could not say it
            raise ComputeFailed(cause)
        if self.proc is None:
            self._start()
        loop = asyncio.get_running_loop()
        maps = [(k, offset, size) for k, (offset, size) in (buffers or {}).items() if k not in self.mapped]
        unmaps, drops = sorted(self.pending_unmaps), sorted(self.pending_drops)
        header = dict(header, maps=maps, unmaps=unmaps, drop_graphs=drops)
        extra_fds, fds = fds, []
        if buffers and not self.arena_mapped:  # the client's memory: mapped once per child
            header["client_arena"] = client_arena[0]
            fds.append(client_arena[1])
        arena = self._arena_for(out_size) if out_size else None
        if arena is not None:
            header["arena"] = arena[0]
            fds.append(arena[1])
        fds.extend(extra_fds)
        key = header.get("graph_key")
        if key is not None and key not in self.known_graphs:
            header["graph"] = spec
        sizing = key is not None and key not in self.sized
        if sizing:
            budget = self.budget()
            if budget is not None:
                header["budget"] = budget
            self._sizing += 1  # from here on the finally below undoes it
        self._busy = True
        try:
            if hoptrace.ON:
                hoptrace.mark("daemon to compute")
            sending = compute_link.asend(loop, self.sock, header, blob, fds)
            if len(blob) > LINK_BUFFER // 2:
                # only a message larger than the link's buffers can block on a child that stopped
                # reading; bounded, it cannot hold the lock (nor ALLOC_BUFFER, waiting for a graph
                # being sized) for ever. Smaller ones skip wait_for's extra task on the hot path.
                await asyncio.wait_for(sending, self.pool.timeout)
            else:
                await sending
            if "client_arena" in header:
                self.arena_mapped = True
            self.mapped.update(k for k, _, _ in maps)
            # only what this message took: a free that came while it was being sent waits for the next
            self.pending_unmaps.difference_update(unmaps)
            self.pending_drops.difference_update(drops)
            if key is not None:
                self.known_graphs.add(key)
            reply, out = await within(compute_link.arecv(loop, self.sock), self.pool.timeout)
        except asyncio.TimeoutError:
            if self._closed:
                raise ComputeFailed("the daemon is shutting down") from None
            self.proc.kill()
            cause = f"compute did not finish within {self.pool.timeout:g} s; compute process killed"
            await self._death_cause()
            self._discard(cause)
            raise ComputeFailed(cause) from None
        except asyncio.CancelledError:
            # the link is mid-message and cannot be resynchronized
            if self.proc is not None:
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
            if self._closed:
                self._close_link()
            self.pool.call_done()
            if sizing:
                self._sizing -= 1
                if not self._sizing and self._settled is not None:
                    self._settled.set()
        if hoptrace.ON:
            hoptrace.mark("daemon from compute")
        self.compute_bytes = reply.get("compute_bytes", self.compute_bytes)
        counts = reply.get("channel_counts")
        if counts is not None:
            self.pool.channel_counts = [t + now - seen for t, now, seen in
                                        zip(self.pool.channel_counts, counts, self.channel_counts_seen)]
            self.channel_counts_seen = tuple(counts)
        if not reply.get("channel_open", True) and self.pool.channel_holder is self:
            self.pool.channel_holder = None  # closed, by the process (client gone, error) or by us
        elif header.get("kind") == "step_channel" and reply.get("status") == 0:
            self.pool.poll_channel_counts()
        if reply.get("graph_dropped") and key is not None:
            self.known_graphs.discard(key)  # refused for memory: the spec goes again next time
        elif sizing and reply.get("status") == 0:
            self.sized.add(key)
        if self._closed:
            raise ComputeFailed("the client is gone")
        if reply.get("arena_bytes"):
            out = self.arena[: reply["arena_bytes"]]  # a copy: the next call reuses the area
        return reply, out
