"""`ggml-coordinator serve`, start to stop: the listening sockets bound first
(a port that is taken fails before any worker is started or the model read),
then the workers and the Coordinator, the HTTP app (http_server.py) served
until SIGTERM/SIGINT, requests in flight drained, and everything stopped."""
from __future__ import annotations

import asyncio
import errno
import os
import sys

import structlog
from aiohttp import web

from coordinator.api import Coordinator
from coordinator.serving.cluster_setup import cannot_start, endpoints_for, resume_options, security_options
from coordinator.serving.http_server import CompletionServer
from rpc_daemon.service.lifecycle import serve_until_signalled
from rpc_daemon.service.logs import say

log = structlog.get_logger("http")

EXIT_LISTEN_FAILED = 4


def listen_sockets(host: str, port: int) -> list:
    """Bound, listening sockets for host:port (every address `host` resolves
    to), made before any worker is started or the model read, so a port that
    is taken fails at once. OSError if it cannot be bound."""
    import socket

    socks = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart while old connections linger
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:  # the same free port on every address
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
            sock.listen(128)
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def serving_url(host: str, sock, https: bool = False) -> str:
    port = sock.getsockname()[1]
    shown = host or "0.0.0.0"
    scheme = "https" if https else "http"
    return f"{scheme}://[{shown}]:{port}" if ":" in shown else f"{scheme}://{shown}:{port}"


def model_id(c, alias: str | None) -> str:
    """The id clients see in /v1/models and every response's `model`: --alias,
    else the GGUF's general.name lowercased with spaces as '-', else the file's stem."""
    if alias:
        return alias
    name = str(c.gguf.get("general.name") or "").strip()
    if not name:
        name = os.path.splitext(os.path.basename(c.model_path))[0]
    return "-".join(name.lower().split())


def server_options(args) -> dict:
    """CompletionServer's options from serve's flags."""
    return {"api_key": args.api_key, "cors_origin": args.cors_origin, "max_queue": args.max_queue,
            "chat_template": args.chat_template, "metrics_endpoint": args.metrics,
            "n_predict": args.n_predict if args.n_predict > 0 else None, "slots_endpoint": args.slots,
            "pooling": args.pooling if args.embeddings else None,
            "context_shift": bool(getattr(args, "context_shift", False))}


def cmd_serve(args) -> int:
    os.environ.pop("GGML_COORDINATOR_API_KEY", None)  # read by parse_args; local workers need not inherit it
    try:
        socks = listen_sockets(args.host, args.port)
    except OSError as exc:
        say(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
            f"{' (another server on that port? choose one with --port)' if exc.errno == errno.EADDRINUSE else ''}",
            "error")
        return EXIT_LISTEN_FAILED
    try:
        return _serve(args, socks)
    finally:
        for sock in socks:
            sock.close()


def _serve(args, socks) -> int:
    from coordinator.cluster.loop import run_async
    from rpc_daemon.service.systemd import StartTimeoutExtender

    with endpoints_for(args, supervise=True) as endpoints:
        try:  # under systemd, a big model's upload extends the start timeout while it progresses
            c = Coordinator(endpoints, model=args.model, split=args.split, threads=args.threads,
                            **security_options(args), n_ctx=args.parallel * args.ctx_per_slot,
                            progress=sys.stderr.isatty(), head_split=args.head_split, step_links=args.step_links,
                            step_channels=args.step_channels,
                            **resume_options(args), on_upload=StartTimeoutExtender(), micro_batch=args.micro_batch,
                            split_mode=args.split_mode, tensor_group=args.tensor_group,
                            exact_sums=args.exact_sums,
                            cache_type_k=args.cache_type_k,
                            cache_type_v=args.cache_type_v, warmup=args.warmup)
        except (ConnectionError, OSError, ValueError) as exc:
            return cannot_start(exc)
        with c:
            name = model_id(c, args.alias)

            def announce() -> None:
                slots = f"{args.parallel} slot{'s' if args.parallel != 1 else ''}"
                url = serving_url(args.host, socks[0], https=args.ssl_context is not None)
                say(f"serving {url} (model {name}, {slots} x {args.ctx_per_slot} tokens)", url=url, model=name)

            run_async(serve_http(c, socks, args.parallel, args.ctx_per_slot, name, announce=announce,
                                 ssl_context=args.ssl_context, **server_options(args)))
    return 0


async def serve_http(coord, socks, n_slots: int, n_ctx_slot: int, model_name: str,
                     ready: asyncio.Event | None = None, announce=None, ssl_context=None, **options) -> None:
    """Serve on `socks` (bound, listening sockets: listen_sockets) until
    SIGTERM/SIGINT, HTTPS with `ssl_context` (--ssl-cert-file, --ssl-key-file).
    `announce()` is called once requests are answered; `options`: CompletionServer's
    api_key, cors_origin, max_queue, chat_template, metrics_endpoint, n_predict, slots_endpoint, pooling."""
    server = CompletionServer(coord, model_name, n_slots, n_ctx_slot, **options)
    # handler_cancellation: a client that goes away cancels its handler, which frees its slot
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    for sock in socks:
        await web.SockSite(runner, sock, ssl_context=ssl_context).start()
    log.info("serving", addresses=[sock.getsockname()[:2] for sock in socks], slots=n_slots,
             ctx_per_slot=n_ctx_slot, model=model_name)

    async def shutdown() -> None:
        # requests in flight end with an error event (and [DONE]) or a 503, not a cut connection
        await server.scheduler.drain("the server is shutting down")
        await runner.cleanup()

    # the watchdog is petted only while the decode loop runs and is not stuck
    await serve_until_signalled(shutdown, log, ready, healthy=server.health_check.decode_loop_healthy,
                                announce=announce)
