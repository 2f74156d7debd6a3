"""`ggml-rpc-server`: command line to DaemonConfig, then run the daemon.

Flags follow llama.cpp's rpc-server (-H, -p, -t, -m in MiB, -c) with long forms.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

from rpc_daemon.daemon import security_cli
from rpc_daemon.daemon.config import DaemonConfig
from rpc_daemon.service.shared_memory import shm_dir_problem
from rpc_daemon.service.version import VersionAction

_C = DaemonConfig()  # every default below is DaemonConfig's (security_cli: Limits' too)
DEFAULT_CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "ggml-rpc"


def build_parser(prog: str = "ggml-rpc-server") -> argparse.ArgumentParser:
    """The production flags; rpc_daemon/testing/daemon_cli.py adds the test-only ones to the same parser."""
    p = argparse.ArgumentParser(prog=prog, description="ggml RPC worker daemon")
    p.add_argument("--version", action=VersionAction)
    p.add_argument("-H", "--host", default=_C.host, help=f"address to bind (default {_C.host})")
    p.add_argument("-p", "--port", type=int, default=_C.port, help=f"port (default {_C.port}; 0 picks a free one)")
    # not DaemonConfig's 1: on the command line, half the cores (the other half for the event loop and peers)
    p.add_argument("-t", "--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="compute threads")
    p.add_argument("-m", "--mem", type=int, default=_C.mem >> 20, metavar="MiB",
                   help="cap on bytes allocated for clients, in MiB (default: physical memory)")
    p.add_argument("-c", "--cache", nargs="?", const=str(DEFAULT_CACHE), default=None, metavar="DIR",
                   help=f"enable the tensor cache (default dir {DEFAULT_CACHE})")
    p.add_argument("--cache-max", type=int, default=_C.cache_max >> 20, metavar="MiB",
                   help="bytes the tensor cache may hold on disk, in MiB; past it the least recently used "
                        "entries are deleted (default: twice --mem, at most half the cache's file system)")
    p.add_argument("--log-format", choices=("console", "json"), default="console")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    p.add_argument("--idle-timeout", type=float, default=_C.idle_timeout,
                   help=f"seconds before an idle client is dropped (default {_C.idle_timeout:g})")
    p.add_argument("--compute-timeout", type=float, default=_C.compute_timeout,
                   help=f"seconds one graph compute may take (default {_C.compute_timeout:g})")
    p.add_argument("--spin-ms", type=float, default=_C.spin_ms, metavar="MS",
                   help=f"tensor-parallel steps: the longest a compute process waits for a peer's partial sum "
                        f"without sleeping, keeping its core busy (a quarter of it for the next step); 0 always "
                        f"sleeps, which costs speed (default {_C.spin_ms:g})")
    p.add_argument("--max-clients", type=int, default=_C.max_clients)
    p.add_argument("--shm-dir", default=_C.shm_dir, metavar="DIR",
                   help="keep the clients' memory (weights, KV cache) in files on this tmpfs, e.g. one mounted "
                        "with huge=within_size (default: memfds, or a private tmpfs of the daemon's own with huge "
                        "pages where the kernel gives memfds none)")
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                   help="keep the clients' memory in memfds, on whatever pages the kernel gives them, instead of "
                        "a private tmpfs with 2 MiB pages (token generation up to 8%% slower)")
    p.add_argument("--min-rate", type=float, default=_C.min_rate, metavar="BYTES_PER_S",
                   help=f"an authenticated client that sends a frame it has started slower than this, averaged "
                        f"over --min-rate-window, is disconnected (and loses its --max-clients slot) "
                        f"(default {_C.min_rate:g}; 0 = no floor)")
    p.add_argument("--min-rate-window", type=float, default=_C.min_rate_window, metavar="S",
                   help=f"seconds the --min-rate floor is averaged over (default {_C.min_rate_window:g})")
    p.add_argument("--metrics-port", type=int, default=_C.metrics_port,
                   help="serve Prometheus metrics over HTTP on this port (same --host)")
    security_cli.add_args(p)
    return p


def config_from(p: argparse.ArgumentParser, args: argparse.Namespace) -> DaemonConfig:
    """The DaemonConfig the production flags in `args` ask for (p.error on a bad one)."""
    if not 0 <= args.port <= 65535:
        p.error("--port must be 0..65535")
    if args.threads < 1 or args.mem < 0 or args.cache_max < 0:
        p.error("--threads must be >= 1, --mem and --cache-max >= 0")
    if args.min_rate < 0 or args.min_rate_window <= 0:
        p.error("--min-rate must be >= 0 (0: no floor), --min-rate-window > 0")
    if not 0 <= args.spin_ms <= 1000:
        p.error("--spin-ms must be 0..1000")
    if args.cache_max and args.cache is None:
        p.error("--cache-max bounds the tensor cache: give --cache [DIR] too")
    problem = args.shm_dir is not None and shm_dir_problem(args.shm_dir, args.huge_pages)
    if problem:
        p.error(problem)
    config = DaemonConfig(host=args.host, port=args.port, threads=args.threads, mem=args.mem << 20,
                          cache_dir=args.cache, cache_max=args.cache_max << 20, idle_timeout=args.idle_timeout,
                          compute_timeout=args.compute_timeout, max_clients=args.max_clients,
                          metrics_port=args.metrics_port, min_rate=args.min_rate,
                          min_rate_window=args.min_rate_window, spin_ms=args.spin_ms, shm_dir=args.shm_dir,
                          huge_pages=args.huge_pages)
    return security_cli.apply(p, args, config)  # secret, TLS, --insecure, limits


def parse_args(argv=None) -> tuple[DaemonConfig, argparse.Namespace]:
    p = build_parser()
    args = p.parse_args(argv)
    return config_from(p, args), args


def main(argv=None) -> int:
    config, args = parse_args(argv)
    return run_daemon(config, args)


def run_daemon(config: DaemonConfig, args: argparse.Namespace) -> int:
    """Configure logging and serve `config` until SIGTERM/SIGINT; the exit status."""
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    from rpc_daemon.service import logs
    logs.configure(args.log_format, args.log_level)
    # the first compute process starts up (~0.2 s of imports) alongside this process's own imports, on
    # another core: a restarted worker's first requests do not share the CPU with it after listening
    from rpc_daemon.compute.pool import spawn_child
    spare = spawn_child(config.threads, config.spin_ms)
    from rpc_daemon.daemon.app import serve
    from rpc_daemon.service.loop import run
    try:
        run(serve(config, spare=spare))
    except OSError as exc:
        print(f"ggml-rpc-server: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
