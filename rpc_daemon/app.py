"""Daemon lifecycle: bind, serve, and shut down cleanly on SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import ipaddress
import signal

import structlog

from rpc_daemon.server import Connection, Daemon, DaemonConfig

log = structlog.get_logger("rpc")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve(config: DaemonConfig, ready: asyncio.Event | None = None) -> None:
    loop = asyncio.get_running_loop()
    daemon = Daemon(config)
    server = await loop.create_server(lambda: Connection(daemon), config.host, config.port, reuse_address=True)
    port = server.sockets[0].getsockname()[1]
    if not is_loopback(config.host):
        log.warning("listening on a non-loopback address: anyone who can reach it can use this worker",
                    host=config.host)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("listening", host=config.host, port=port, threads=config.threads,
             mem_bytes=daemon.buffers.max_bytes, cache=config.cache_dir,
             unsafe_no_validation=config.unsafe_no_validation or None)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        server.close()
        daemon.close()
        await server.wait_closed()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("stopped")
