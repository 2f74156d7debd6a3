"""systemd's notify protocol (sd_notify), without libsystemd.

READY=1 is sent once the service really serves; WATCHDOG=1 is sent from a task
on the event loop, so a wedged loop stops petting the watchdog and systemd
restarts the service. Outside systemd (no NOTIFY_SOCKET) everything is a no-op.
"""
from __future__ import annotations

import asyncio
import os
import socket
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
    """READY=1 now, and the watchdog task if systemd asked for one."""
    if not notify("READY=1", env):
        return None
    if watchdog_interval(env) is None:
        return None
    return asyncio.get_running_loop().create_task(watchdog_loop(healthy, env))


def stopping(env=os.environ) -> None:
    notify("STOPPING=1", env)
