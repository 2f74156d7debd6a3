"""What every long-running service of ours does between start and stop:
SIGTERM/SIGINT end it cleanly, systemd hears READY=1 once it serves and
WATCHDOG=1 while its event loop (and `healthy()`) are fine, then STOPPING=1."""
from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Awaitable, Callable

from rpc_daemon.service import systemd


@contextlib.asynccontextmanager
async def until_signalled(healthy: Callable[[], bool] = lambda: True):
    """Yields an Event that SIGTERM or SIGINT sets; call on entry once serving."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchdog = systemd.start(healthy=healthy)
    try:
        yield stop
    finally:
        systemd.stopping()
        if watchdog is not None:
            watchdog.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def serve_until_signalled(shutdown: Callable[[], Awaitable[None]], log, ready: asyncio.Event | None = None,
                                healthy: Callable[[], bool] = lambda: True,
                                announce: Callable[[], None] | None = None) -> None:
    """The skeleton of a service that is already listening: ready (systemd's
    READY=1, then `announce()`, then `ready` set) until SIGTERM/SIGINT, then
    "shutting down" and `shutdown()`, even if waiting was cancelled."""
    async with until_signalled(healthy=healthy) as stop:
        if announce is not None:
            announce()
        if ready is not None:
            ready.set()
        try:
            await stop.wait()
        finally:
            log.info("shutting down")
            await shutdown()
