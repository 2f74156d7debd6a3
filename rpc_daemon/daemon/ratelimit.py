"""Token buckets: the per-client request rate limit, and a cap on how many
warnings one client can make the daemon log. Pure; the clock is injectable."""
from __future__ import annotations

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
