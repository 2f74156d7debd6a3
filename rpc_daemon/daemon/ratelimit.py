"""Token buckets: the per-client request rate limit, and a cap on how many
warnings one client can make the daemon log; RateFloor: the slowest an
authenticated client may send a frame it has started. Pure; the clock is
injectable (RateFloor is given the time)."""
from __future__ import annotations

import collections
import time


class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up; starts full.
    rate <= 0 means unlimited."""

    def __init__(self, rate: float, burst: float, clock=time.monotonic):
        self.rate = float(rate)
        self.burst = float(max(burst, 1))
        self.clock = clock
        self.tokens = self.burst
        self.stamp = clock()
        self.refused = 0  # takes refused since the last granted one

    @property
    def unlimited(self) -> bool:
        return self.rate <= 0

    def take(self, n: float = 1.0) -> bool:
        if self.rate <= 0:
            return True
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= n:
            self.tokens -= n
            self.refused = 0
            return True
        self.refused += 1
        return False

    def wait_time(self, n: float = 1.0) -> float:
        """Seconds until `n` tokens are available (0 if they are now)."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        return max(0.0, (n - tokens) / self.rate)


class RateFloor:
    """A frame in progress must keep arriving at `rate` bytes/s or more, averaged
    over the last `window` seconds (--min-rate, --min-rate-window): a client
    that trickles a frame would otherwise keep its connection slot for as long as
    it likes, one byte at a time never idle. `sample` is called about once a
    second with the connection's total bytes received and whether a frame of the
    client's is incomplete (and the daemon is reading: time it spends not
    reading, its own backpressure, is not the client's). A sample without a
    frame in progress starts the measure over. rate <= 0 or window <= 0: off."""

    def __init__(self, rate: float, window: float):
        self.rate = float(rate)
        self.window = float(window)
        self._samples: collections.deque = collections.deque()  # (time, total bytes) while a frame is incomplete

    @property
    def off(self) -> bool:
        return self.rate <= 0 or self.window <= 0

    def sample(self, now: float, total: int, in_frame: bool) -> float | None:
        """The rate (bytes/s) a frame has been arriving at over the last `window`
        seconds if it is below the floor, else None."""
        samples = self._samples
        if self.off or not in_frame:
            samples.clear()
            return None
        samples.append((now, total))
        while len(samples) > 1 and now - samples[1][0] >= self.window:
            samples.popleft()  # the oldest kept is the newest one at least `window` old
        t0, b0 = samples[0]
        span = now - t0
        if span >= self.window and total - b0 < self.rate * span:
            return (total - b0) / span
        return None
