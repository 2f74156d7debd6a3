"""Many requests in flight on one RpcClient: bulk transfers bound by bandwidth,
not by round trips.

The protocol lets a client pipeline requests (docs/protocol.md, Ordering and
pipelining): the daemon runs them in arrival order and every reply carries its
request's id. A RequestWindow sends requests without waiting for the earlier
ones' replies, holding at most `max_requests` requests and `max_bytes` request
bytes (header allowance plus blob) unanswered at once. The defaults stay at
half of the daemon's per-connection bounds (64 queued requests, 64 MiB in
flight), so the daemon never has to stop reading a windowed connection.

Failure semantics are RpcClient's, unchanged: every request keeps the
connection's liveness bound and its own deadline, and a dead peer fails every
pending request with the same PeerFailed. The window raises the first failure
in send order (a PeerFailed, or an RpcError whose status the caller did not
accept) from the next submit() or from drain(), and gives up the requests
still in flight (their replies are dropped when they come).
"""
from __future__ import annotations

import asyncio

from rpc_daemon.client import RpcClient, RpcError

HEADER_ALLOWANCE = 1024  # bytes counted per request for its header (a SET_TENSOR header is ~60)


class RequestWindow:
    def __init__(self, client: RpcClient, max_requests: int = 32, max_bytes: int = 32 << 20,
                 deadline: float | None = None):
        if max_requests < 1 or max_bytes < 1:
            raise ValueError("a window holds at least one request and one byte")
        self.client = client
        self.max_requests, self.max_bytes, self.deadline = max_requests, max_bytes, deadline
        self._inflight: dict[asyncio.Task, int] = {}  # task -> bytes it counts, in send order
        self._bytes = 0
        self.peak_requests = 0  # the most requests ever in flight at once (tests, benches)
        self.peak_bytes = 0

    async def submit(self, cmd: int, fields: dict | None = None, blob=b"",
                     accept: tuple[int, ...] = ()) -> asyncio.Task:
        """Wait for room, send the request, and return a task that resolves to
        its (header, blob). An error reply whose status is in `accept` resolves
        to its header (status included) instead of failing the window."""
        size = len(blob) + HEADER_ALLOWANCE
        try:
            while self._inflight and (len(self._inflight) >= self.max_requests
                                      or self._bytes + size > self.max_bytes):
                await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
                self._settle()
            self._settle()
        except BaseException:
            self._abandon()
            raise
        task = asyncio.ensure_future(self._one(cmd, fields, blob, accept))
        self._inflight[task] = size
        self._bytes += size
        self.peak_requests = max(self.peak_requests, len(self._inflight))
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        await asyncio.sleep(0)  # let the task write its frame now, in submit order
        return task

    async def _one(self, cmd, fields, blob, accept):
        try:
            return await self.client.request(cmd, fields, blob, self.deadline)
        except RpcError as exc:
            if exc.status in accept:
                return exc.header, b""
            raise

    def _settle(self) -> None:
        """Forget answered requests; raise the first failure among them in send order."""
        for task in list(self._inflight):
            if not task.done():
                continue
            self._bytes -= self._inflight.pop(task)
            if task.exception() is not None:
                self._abandon()
                raise task.exception()

    def _abandon(self) -> None:
        for task in self._inflight:
            if task.done():
                task.cancelled() or task.exception()  # retrieved: the first failure is the one raised
            else:
                task.cancel()  # RpcClient keeps it pending and drops its reply (or fails it with the peer)
        self._inflight.clear()
        self._bytes = 0

    async def drain(self) -> None:
        """Wait for every request in flight; raise the first failure in send order."""
        try:
            while self._inflight:
                first = next(iter(self._inflight))
                await asyncio.wait([first])
                self._settle()
        except BaseException:
            self._abandon()
            raise
