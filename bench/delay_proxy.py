"""A userspace TCP delay proxy: a slow network on loopback, for benches and tests.

    python bench/delay_proxy.py UPSTREAM_HOST:PORT [--listen 127.0.0.1:0]
        [--delay 0.02] [--jitter 0.005] [--stall-prob 0] [--stall 0] [--rate BYTES_PER_S]

This VM's kernel has no netem, so latency is made in userspace: the proxy
listens on 127.0.0.1, forwards each accepted connection to the upstream, and
holds every chunk of bytes for a one-way delay before passing it on. Each
direction (client -> upstream, upstream -> client) has its own `Link`:

* `delay` seconds, plus jitter drawn uniformly from [-jitter, +jitter] per
  chunk (a chunk is one read of at most `CHUNK` bytes); a chunk's delay is never
  below 0.
* Bytes are never reordered: a chunk is released no earlier than the chunk
  before it (release = max(arrival + delay + jitter, previous release)), as a
  TCP stream would deliver them. So jitter delays bytes, it never overtakes.
* Stalls: with probability `stall_prob` per chunk the link stops for `stall`
  seconds before that chunk (and so, by the rule above, before every later one).
* Bandwidth cap: a token bucket of `rate` bytes/s holding at most `burst`
  bytes (default 256 KiB); a chunk (then at most min(`CHUNK`, `burst`)
  bytes) leaves, and its delay starts, once the bucket holds its size.
  `rate` None: no cap.
* At most `window` bytes are held per direction; past it the proxy stops
  reading that side, so the sender sees TCP backpressure (a link's
  bandwidth-delay product, like a TCP receive window).
* An end of stream (EOF) or a reset is forwarded after the bytes before it,
  with the same delay (a reset as an abort of the other side's socket); an
  error writing to either side closes both sides at once.

Meant for 127.0.0.1 only; used by tests/daemon/test_network_path.py and
bench/bench_latency.py. `ProxyThread` runs one on a loop thread of its own for
synchronous code.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import random
import sys
import threading
import time

CHUNK = 64 << 10


@dataclasses.dataclass(frozen=True)
class Link:
    """One direction of the simulated network (see the module doc)."""
    delay: float = 0.0
    jitter: float = 0.0
    stall_prob: float = 0.0
    stall: float = 0.0
    rate: float | None = None  # bytes per second
    burst: int = 4 * CHUNK  # absorbs ~20 ms of late timer wake-ups at 100 Mbit/s
    window: int = 64 << 20

    def __post_init__(self):
        if self.delay < 0 or self.jitter < 0 or self.stall < 0 or not 0 <= self.stall_prob <= 1:
            raise ValueError("delay, jitter and stall must be >= 0, stall_prob in [0, 1]")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive (or None for no cap)")
        if self.burst < 1 or self.window < CHUNK:
            raise ValueError(f"burst must be >= 1 and window >= {CHUNK}")


class _TokenBucket:
    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()

    async def take(self, n: int) -> None:
        """Wait until `n` bytes (at most `burst`) may leave."""
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= n:
                self.tokens -= n
                return
            await asyncio.sleep((n - self.tokens) / self.rate)


class _Direction:
    """Bytes from `reader` to `writer` through one Link: a reading task queues
    (release time, chunk) in arrival order, a writing task releases them."""

    def __init__(self, link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rng: random.Random):
        self.link, self.reader, self.writer, self.rng = link, reader, writer, rng
        self.queue: collections.deque = collections.deque()
        self.queued = 0
        self.last_release = 0.0
        self.changed = asyncio.Event()  # something queued, or room freed
        self.bucket = _TokenBucket(link.rate, link.burst) if link.rate else None
        self.forwarded = 0

    def _release_time(self) -> float:
        link = self.link
        t = time.monotonic() + max(0.0, link.delay + self.rng.uniform(-link.jitter, link.jitter))
        if link.stall_prob and self.rng.random() < link.stall_prob:
            t += link.stall
        self.last_release = max(t, self.last_release)  # never overtake the chunk before
        return self.last_release

    async def read_side(self) -> None:
        size = min(CHUNK, self.link.burst) if self.bucket else CHUNK
        while True:
            while self.queued >= self.link.window:
                self.changed.clear()
                await self.changed.wait()
            try:
                data = await self.reader.read(size)
            except OSError:  # reset: passed on as one, after the bytes before it and the delay
                data = None
            if self.bucket is not None and data:
                await self.bucket.take(len(data))
            self.queue.append((self._release_time(), data))  # b"" (EOF), None (reset): delayed like bytes
            self.queued += len(data or b"")
            self.changed.set()
            if not data:
                return

    async def write_side(self) -> None:
        while True:
            while not self.queue:
                self.changed.clear()
                await self.changed.wait()
            release, data = self.queue[0]
            wait = release - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self.queue.popleft()
            self.queued -= len(data or b"")
            self.changed.set()
            if data is None:
                self.writer.transport.abort()
                return
            if not data:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
            self.writer.write(data)
            self.forwarded += len(data)
            await self.writer.drain()


class DelayProxy:
    """Listens on 127.0.0.1 and forwards every connection to `upstream`
    ("host:port") through `up` (client -> upstream) and `down` Links."""

    def __init__(self, upstream: str, up: Link = Link(), down: Link | None = None, seed: int | None = None):
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.up, self.down = up, (down if down is not None else up)
        self.rng = random.Random(seed)
        self.server: asyncio.base_events.Server | None = None
        self.port: int | None = None
        self.connections = 0
        self._tasks: set[asyncio.Task] = set()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> "DelayProxy":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, c_reader, c_writer) -> None:
        self.connections += 1
        task = asyncio.current_task()
        self._tasks.add(task)
        u_writer = None
        try:
            try:
                u_reader, u_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                return  # the client sees its connection closed, as with nothing listening behind
            sides = [_Direction(self.up, c_reader, u_writer, self.rng), _Direction(self.down, u_reader, c_writer, self.rng)]
            jobs = [asyncio.ensure_future(job()) for side in sides for job in (side.read_side, side.write_side)]
            try:
                # both directions run until each has forwarded its EOF, or anything fails
                done, _ = await asyncio.wait(jobs, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                for job in jobs:
                    job.cancel()
                await asyncio.gather(*jobs, return_exceptions=True)
        finally:
            for w in (c_writer, u_writer):
                if w is not None:
                    w.transport.abort() if w.transport.get_write_buffer_size() else w.close()
            self._tasks.discard(task)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class ProxyThread:
    """A DelayProxy on its own event loop thread: `with ProxyThread(...) as p: p.endpoint`."""

    def __init__(self, upstream: str, up: Link = Link(), down: Link | None = None, seed: int | None = None):
        self.proxy = DelayProxy(upstream, up, down, seed)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="delay-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        return self.proxy.endpoint

    def __enter__(self) -> "ProxyThread":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.proxy.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("upstream", help="host:port to forward to")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (127.0.0.1); 0: any free one")
    ap.add_argument("--delay", type=float, default=0.0, help="one-way delay, seconds")
    ap.add_argument("--jitter", type=float, default=0.0, help="uniform jitter +-, seconds")
    ap.add_argument("--stall-prob", type=float, default=0.0, help="probability of a stall per chunk")
    ap.add_argument("--stall", type=float, default=0.0, help="stall duration, seconds")
    ap.add_argument("--rate", type=float, default=None, help="bandwidth cap per direction, bytes/s")
    args = ap.parse_args()
    link = Link(args.delay, args.jitter, args.stall_prob, args.stall, args.rate)

    async def run() -> None:
        proxy = await DelayProxy(args.upstream, link).start(args.port)
        print(f"delay proxy listening on {proxy.endpoint} -> {args.upstream}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
