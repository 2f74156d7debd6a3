"""The daemon-wide compute lock, handed out fairly between clients (compute/pool.py
takes it around every call to a compute process; docs/security.md, "Fairness and slots")."""
from __future__ import annotations

import asyncio
import collections
import itertools
import time
from typing import Callable, Hashable

# the longest the compute lock stays free for the client that just released it, when it is owed compute
# time and came back that fast last time (FairLock)
ANTICIPATE_MAX = 1.0


class FairLock:
    """The daemon-wide compute lock, handed out fairly between clients.

    `async with lock(client):` (or `async with lock:`, one anonymous client) is
    mutual exclusion, held for the whole call (a compute is never preempted; a
    tensor-parallel compute that waits for a peer mid-compute keeps holding it).
    Which waiter goes next is start-time fair queuing on the time each client
    has held the lock: every client has a virtual time, the seconds it has held
    the lock; the waiting client with the smallest goes next, ties (and one
    client's own waiters, always) in arrival order. A client that starts waiting
    after being idle starts at the virtual time of the latest grant, not below:
    an idle client banks no credit, and a newcomer cannot lock out the others.
    So two clients computing flat out get half the lock's time each, whatever
    their computes cost (a 20 ms client is no longer served once per 2 s compute
    of the other, as plain FIFO turn-taking did).

    A client with one request in flight (a connection runs its requests one at a
    time) is not waiting at the moment its compute ends: its next request comes a
    moment later (or, in a pipeline, once the other workers' stages are done), and
    a work-conserving lock would hand the machine to the other client at once, for
    that client's whole compute. So when a client that is owed time (no waiter
    has a smaller virtual time) releases the lock, the lock stays free for it for
    a window: three times the gap it took to come back last time plus 5 ms, or
    twice what it is owed (its lead on the least-served other client) but no
    more than twice the longest last compute of another client (what it may be
    waiting behind on another worker of a pipeline), whichever is longer, at
    most ANTICIPATE_MAX. A waiter with
    more time used waits for it meanwhile; a waiter or newcomer with less takes
    the lock at once. The time it stays free while another client waits for it is
    charged to the client it was kept for, so it costs the others nothing of
    their share: each client wanting the lock gets at least an equal share of its
    time. A window the client does not come back in while another waited (it was
    waiting for that other one: two connections of one program used in turn)
    makes the lock skip its next 1, 3, 7, ... 63 chances to keep it for that
    client, until one pays off: such a pattern loses about one window per 64
    turns. Alone, a client has nothing kept for it.

    Cancellation-safe: a waiter cancelled before its turn leaves the line; one
    cancelled after the lock was handed to it releases it (to the next)."""

    def __init__(self, anticipate_max: float = ANTICIPATE_MAX, clock: Callable[[], float] = time.monotonic):
        self.anticipate_max = anticipate_max
        self.clock = clock
        self.used: dict[Hashable, float] = {}  # client -> virtual time (seconds it held the lock, from its floor)
        self._waiting: dict[Hashable, collections.deque] = {}  # client -> its waiters' (seq, future), in order
        self._seq = itertools.count()
        self._now_vt = 0.0  # virtual time of the latest grant: where a client becoming active starts
        self._held = False
        self._holder: Hashable = None
        self._since = 0.0  # when the holder's charge started
        self._kept_for: Hashable = None  # client the free lock is kept for (anticipation), with _kept
        self._kept = False
        self._kept_since: float | None = None  # since when a client waits for the kept lock (what is charged)
        self._keep_timer: asyncio.TimerHandle | None = None
        self._released_at: dict[Hashable, float] = {}
        self._gap: dict[Hashable, float] = {}  # client -> time from its last release to its next acquire
        self._gone: set = set()  # forgotten while holding or waiting: dropped once it does neither
        # client -> windows in a row it did not come back in while another waited, and keeps to skip (backoff)
        self._misses: dict[Hashable, int] = {}
        self._hold: dict[Hashable, float] = {}  # client -> how long its last turn held the lock
        self._skip: dict[Hashable, int] = {}

    def __call__(self, client: Hashable = None) -> "_Turn":
        return _Turn(self, client)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc) -> None:
        self.release()

    def locked(self) -> bool:
        return self._held

    def _active(self, client: Hashable) -> bool:
        return client in self._waiting or (self._held and self._holder == client) or (
            self._kept and self._kept_for == client)

    async def acquire(self, client: Hashable = None) -> bool:
        now = self.clock()
        released = self._released_at.pop(client, None)
        if released is not None:
            self._gap[client] = now - released
        if not self._active(client):  # (re)joining: no credit for the time it was away
            self.used[client] = max(self.used.get(client, self._now_vt), self._now_vt)
        if not self._held:
            if self._kept:
                if self._kept_for == client:  # back in time: the free time counts as its own
                    self._misses.pop(client, None)
                    since = self._unkeep()
                    self._grant(client, now if since is None else since)
                    return True
                if self.used[client] < self.used.get(self._kept_for, 0.0):  # owed more than the one kept for
                    self._drop_keep(now)
                    self._grant(client, now)
                    return True
            elif not self._waiting:
                self._grant(client, now)
                return True
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(client, collections.deque()).append((next(self._seq), fut))
        if self._kept and self._kept_since is None:  # from now on keeping the lock costs someone a wait
            self._kept_since = now
        if not self._held and not self._kept:  # (not reached: a free lock that is not kept has no waiters)
            self._grant_next(now)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the lock was handed to it: pass it on
                self.release(anticipate=False)
            else:
                self._leave(client, fut)
                if self._kept and self._kept_since is not None and not self._waiting:
                    # nobody waits for the kept lock any more: charge what the wait cost so far, no more
                    self.used[self._kept_for] += max(0.0, self.clock() - self._kept_since)
                    self._kept_since = None
                self._tidy(client)
            raise
        return True

    def release(self, anticipate: bool = True) -> None:
        if not self._held:
            raise RuntimeError("FairLock is not held")
        now = self.clock()
        client = self._holder
        self._hold[client] = held = max(0.0, now - self._since)
        self.used[client] += held
        self._held, self._holder = False, None
        if self._tidy(client):
            anticipate = False
        else:
            self._released_at[client] = now
        window = self._keep_window(client) if anticipate else 0.0
        if window > 0:
            self._kept, self._kept_for = True, client
            self._kept_since = now if self._waiting else None
            self._keep_timer = asyncio.get_running_loop().call_later(window, self._keep_expired)
            return
        self._grant_next(now)

    def forget(self, client: Hashable) -> None:
        """The client is gone: its accounting goes (a waiter it may still have keeps its place)."""
        self._released_at.pop(client, None)
        self._gap.pop(client, None)
        if self._kept and self._kept_for == client:
            self._drop_keep(self.clock())
            if not self._held:
                self._grant_next(self.clock())
        self._gone.add(client)
        self._tidy(client)

    def _tidy(self, client: Hashable) -> bool:
        """Drop a forgotten client's accounting once it neither holds nor waits; True if it did."""
        if client not in self._gone or self._active(client):
            return False
        self._gone.discard(client)
        self.used.pop(client, None)
        self._released_at.pop(client, None)
        self._gap.pop(client, None)
        self._misses.pop(client, None)
        self._skip.pop(client, None)
        self._hold.pop(client, None)
        return True

    # ------------------------------------------------------------ internals
    def _keep_window(self, client: Hashable) -> float:
        """How long to keep the lock free for `client`, which just released it (0: not at all)."""
        gap = self._gap.get(client)
        if gap is None or client in self._waiting or self.anticipate_max <= 0:
            return 0.0  # (its own next waiter is chosen like the others)
        skip = self._skip.get(client, 0)
        if skip:  # backing off after windows it did not come back in while another client waited
            self._skip[client] = skip - 1
            return 0.0
        mine = self.used[client]
        # what the others stand at (one that is idle would rejoin at _now_vt); its lead on the least is its credit
        others = [max(u, self._now_vt) for c, u in self.used.items() if c != client]
        if not others or any(self.used[c] < mine for c in self._waiting):
            return 0.0  # alone, or a waiter is owed more
        # what it may be waiting behind elsewhere (a pipeline's other worker): twice another's last compute
        longest = max((h for c, h in self._hold.items() if c != client), default=0.0)
        credit = min(2 * (min(others) - mine), 2 * longest)
        return min(max(3 * gap + 0.005, credit), self.anticipate_max)

    def _grant(self, client: Hashable, since: float) -> None:
        self._held, self._holder, self._since = True, client, since
        self._now_vt = max(self._now_vt, self.used.get(client, self._now_vt))

    def _grant_next(self, now: float) -> None:
        while self._waiting:
            client = min(self._waiting, key=lambda c: (self.used.get(c, 0.0), self._waiting[c][0][0]))
            line = self._waiting[client]
            _, fut = line.popleft()
            if not line:
                del self._waiting[client]
            if fut.cancelled():
                continue
            self._grant(client, now)
            fut.set_result(True)
            return

    def _leave(self, client: Hashable, fut: asyncio.Future) -> None:
        line = self._waiting.get(client)
        if line is None:
            return
        for i, (_, f) in enumerate(line):
            if f is fut:
                del line[i]
                break
        if not line:
            del self._waiting[client]

    def _unkeep(self) -> float | None:
        """Stop keeping the lock; returns since when another client waited for it meanwhile (that time is
        charged to the client it was kept for), None if nobody did."""
        self._kept, self._kept_for = False, None
        if self._keep_timer is not None:
            self._keep_timer.cancel()
            self._keep_timer = None
        return self._kept_since

    def _drop_keep(self, now: float) -> None:
        """Stop keeping the lock: the client it was kept for is charged the time it stayed free."""
        if not self._kept:
            return
        client = self._kept_for
        since = self._unkeep()
        if since is not None and client in self.used:
            self.used[client] += max(0.0, now - since)

    def _keep_expired(self) -> None:
        self._keep_timer = None
        if self._kept:
            now = self.clock()
            if self._kept_since is not None:  # it did not come back, and someone waited: keep it less often
                client = self._kept_for
                misses = self._misses[client] = self._misses.get(client, 0) + 1
                self._skip[client] = (1 << min(misses, 6)) - 1
            self._drop_keep(now)
            if not self._held:
                self._grant_next(now)


class _Turn:
    """`async with lock(client)`: one turn of FairLock for `client`."""
    __slots__ = ("lock", "client")

    def __init__(self, lock: FairLock, client: Hashable):
        self.lock, self.client = lock, client

    async def __aenter__(self) -> None:
        await self.lock.acquire(self.client)

    async def __aexit__(self, *exc) -> None:
        self.lock.release()
