"""systemd's notify protocol (sd_notify), without libsystemd.

READY=1 is sent once the service really serves; WATCHDOG=1 is sent from a task
on the event loop, so a wedged loop stops petting the watchdog and systemd
restarts the service. While a long start-up makes progress (the coordinator
uploading a big model), EXTEND_TIMEOUT_USEC keeps TimeoutStartSec= from
expiring. Outside systemd (no NOTIFY_SOCKET) everything is a no-op.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Callable

import structlog

log = structlog.get_logger("systemd")


def notify(message: str, env=os.environ) -> bool:
    """Send one notification; False when not under systemd or it cannot be sent."""
    path = env.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # abstract namespace
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(path)
            s.sendall(message.encode())
        return True
    except OSError as exc:
        log.warning("sd_notify failed", error=str(exc))
        return False


def watchdog_interval(env=os.environ) -> float | None:
    """Half the WatchdogSec systemd asked for, or None without a watchdog."""
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.05, int(usec) / 2e6)
    except ValueError:
        return None


async def watchdog_loop(healthy: Callable[[], bool] = lambda: True, env=os.environ) -> None:
    """Pet the watchdog while the loop runs and `healthy()` holds."""
    interval = watchdog_interval(env)
    if interval is None:
        return
    while True:
        if healthy():
            notify("WATCHDOG=1", env)
        await asyncio.sleep(interval)


def start(healthy: Callable[[], bool] = lambda: True, env=os.environ) -> asyncio.Task | None:
    """READY=1 now (and a STATUS= replacing any start-up progress), and the
    watchdog task if systemd asked for one."""
    if not notify("READY=1\nSTATUS=serving", env):
        return None
    if watchdog_interval(env) is None:
        return None
    return asyncio.get_running_loop().create_task(watchdog_loop(healthy, env))


class StartTimeoutExtender:
    """`extender(done, total)` during a long start-up step (bytes of weights
    uploaded): tells systemd "EXTEND_TIMEOUT_USEC=<extend_by>" with a STATUS=
    line (`systemctl status` shows the percentage) at the start, at least
    every `every` seconds while progress is reported, at each `1/steps` of the
    total and at the end. Only progress extends the timeout: an upload that
    stalls for `extend_by` seconds (past TimeoutStartSec=) fails the start."""

    def __init__(self, what: str = "uploading weights", extend_by: float = 60.0, every: float = 5.0,
                 steps: int = 20, env=os.environ, clock: Callable[[], float] = time.monotonic):
        self.what, self.extend_by, self.every, self.steps = what, extend_by, every, steps
        self.env, self.clock = env, clock
        self.last_sent: float | None = None
        self.last_step = -1

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        step = done * self.steps // total if total > 0 else self.steps
        if self.last_sent is not None and now - self.last_sent < self.every and step == self.last_step:
            return
        self.last_sent, self.last_step = now, step
        percent = 100 * done // total if total > 0 else 100
        notify(f"EXTEND_TIMEOUT_USEC={int(self.extend_by * 1e6)}\n"
               f"STATUS={self.what}: {percent}% of {total / (1 << 20):.0f} MiB", self.env)


def stopping(env=os.environ) -> None:
    notify("STOPPING=1", env)
