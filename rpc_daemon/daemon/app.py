"""Daemon lifecycle: bind, serve, and shut down cleanly on SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import functools

import structlog

from ggml_ffi import describe, extra_buffers
from rpc_daemon.daemon.config import DaemonConfig, is_loopback
from rpc_daemon.daemon.connection import Connection, Daemon
from rpc_daemon.service.lifecycle import serve_until_signalled

log = structlog.get_logger("rpc")


async def serve(config: DaemonConfig, ready: asyncio.Event | None = None, spare=None) -> None:
    """`spare`: a compute process started ahead (rpc_daemon/compute/pool.py, spawn_child)."""
    loop = asyncio.get_running_loop()
    ssl_context = None
    if config.tls_cert:
        from rpc_daemon.wire.tls import server_context
        ssl_context = server_context(config.tls_cert, config.tls_key)
    daemon = Daemon(config)
    connection = functools.partial(Connection, daemon)
    if config.test_faults or config.test_older:  # tests only: connections that misbehave on purpose (rpc_daemon/testing/)
        from rpc_daemon.testing.faulty_connection import connections
        connection = connections(daemon)
    if spare is not None:
        daemon.compute.adopt(spare)
    metrics_server = None
    if config.metrics_port is not None:
        from rpc_daemon.daemon.metrics import serve_metrics
        metrics_server = serve_metrics(daemon, config.host, config.metrics_port)
    server = await loop.create_server(connection, config.host, config.port, reuse_address=True,
                                      ssl=ssl_context,
                                      ssl_handshake_timeout=config.hello_timeout if ssl_context else None)
    port = server.sockets[0].getsockname()[1]
    if not is_loopback(config.host):
        if config.secret is None:
            log.warning("listening on a non-loopback address WITHOUT a shared secret (--insecure): anyone who "
                        "can reach it can use this worker", host=config.host)
        elif ssl_context is None:
            log.warning("listening on a non-loopback address without TLS: clients must authenticate, but "
                        "traffic is neither encrypted nor integrity-protected", host=config.host)
    ggml = describe()  # which libggml and CPU variant computes here (docs/operations.md)
    log.info("ggml", version=ggml["ggml_version"], origin=ggml["origin"], cpu_variant=ggml["cpu_variant"],
             cpu_features=",".join(ggml["cpu_features"]), library=ggml["library"],
             **ggml["kernels"])
    shm = daemon.shm  # the clients' weights on 2 MiB pages or not: tokens/s depend on it (docs/operations.md)
    (log.info if shm.huge_pages else log.warning)("shared memory", source=shm.source, huge_pages=shm.huge_pages,
                                                   why=shm.why)
    log.info("listening", host=config.host, port=port, threads=config.threads,
             mem_bytes=daemon.buffers.max_bytes, cache=config.cache_dir,
             auth="hmac-sha256" if config.secret else None, tls=bool(ssl_context) or None,
             unsafe_no_validation=config.unsafe_no_validation or None)
    daemon.compute.warm()  # the first client's first compute need not wait for the process to start
    # which extra buffer types (CPU_REPACK, AMX) this machine really runs: probed in child processes
    # (their crash costs nothing), once per library, CPU and kernel, without holding up the start
    probing = asyncio.get_running_loop().run_in_executor(None, extra_buffers.usable)
    probing.add_done_callback(lambda f: None if f.cancelled() else
                              log.info("ggml extra buffer types", **(f.result() if not f.exception() else
                                                                     {"probe_failed": repr(f.exception())})))

    async def shutdown() -> None:
        server.close()
        if metrics_server is not None:
            metrics_server.shutdown()
        daemon.close()
        await server.wait_closed()

    # systemd: ready once listening; the watchdog is petted from this event loop
    await serve_until_signalled(shutdown, log, ready)
    log.info("stopped")
