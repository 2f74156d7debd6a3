"""The daemon's security and limit flags (docs/security.md), kept out of cli.py.

    add_args(parser)                  registers the flags
    apply(parser, args, config)       checks them and returns the DaemonConfig to run

A non-loopback --host without a shared secret is refused (exit status 2, before
anything listens) unless --insecure is given. The secret never comes from the
command line (it would show in `ps`): --secret-file, else systemd's credential
$CREDENTIALS_DIRECTORY/rpc-secret, else the environment variable
GGML_RPC_SECRET, which is then removed from the environment so the compute
process does not inherit it. A weak or example secret is refused
(auth.check_secret).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from rpc_daemon.wire import auth
from rpc_daemon.wire.protocol import Limits
from rpc_daemon.daemon.config import DaemonConfig, is_loopback

MiB = 1 << 20
_L = Limits()
_C = DaemonConfig()


def add_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("security (docs/security.md)")
    s.add_argument("--secret-file", metavar="PATH",
                   help="shared secret clients must prove they know (HMAC challenge-response); else "
                        f"$CREDENTIALS_DIRECTORY/{auth.CREDENTIAL} (systemd's LoadCredential=), else "
                        f"${auth.ENV_VAR}; at least {auth.MIN_SECRET_LEN} random bytes")
    s.add_argument("--tls-cert", metavar="PEM", help="serve TLS on the port with this certificate (chain)")
    s.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    s.add_argument("--peer-tls-ca", metavar="PEM",
                   help="CA that the other workers this one links with (step links, tensor links) are "
                        "verified against; a worker serving TLS offers step links and tensor links only with it")
    s.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without a shared secret (anyone who can reach the port "
                        "can use the worker)")
    g = p.add_argument_group("limits (per client unless noted; docs/security.md)")
    g.add_argument("--max-blob", type=int, default=_L.max_blob // MiB, metavar="MiB",
                   help=f"largest data part of one frame (default {_L.max_blob // MiB})")
    g.add_argument("--max-header", type=int, default=_L.max_header // MiB, metavar="MiB",
                   help=f"largest msgpack part of one frame (default {_L.max_header // MiB})")
    g.add_argument("--max-buffers", type=int, default=_L.max_buffers,
                   help=f"buffers one client may hold (default {_L.max_buffers})")
    g.add_argument("--max-client-mem", type=int, default=_L.max_client_bytes // MiB, metavar="MiB",
                   help="bytes of buffers one client may hold (default 0: up to the daemon-wide --mem)")
    g.add_argument("--max-graph-tensors", type=int, default=_L.max_graph_tensors,
                   help=f"tensors in one graph (default {_L.max_graph_tensors})")
    g.add_argument("--max-graphs", type=int, default=_L.max_graphs,
                   help=f"graphs one client may keep cached (default {_L.max_graphs})")
    g.add_argument("--max-cached-tensors", type=int, default=_L.max_cached_tensors,
                   help=f"tensors of all the graphs one client keeps cached, about 1.5 KiB of memory each "
                        f"(default {_L.max_cached_tensors})")
    g.add_argument("--max-requests-per-second", type=float, default=_C.max_requests_per_second, metavar="R",
                   help=f"sustained request rate of one client; past it requests get LIMIT_EXCEEDED "
                        f"(default {_C.max_requests_per_second:g}; 0 = unlimited)")
    g.add_argument("--request-burst", type=int, default=_C.request_burst, metavar="N",
                   help=f"requests one client may send at once above the rate (default {_C.request_burst})")
    g.add_argument("--hello-timeout", type=float, default=_C.hello_timeout, metavar="S",
                   help=f"seconds a new connection has to complete HELLO (and authentication, TLS handshake) "
                        f"(default {_C.hello_timeout:g})")


def apply(p: argparse.ArgumentParser, args: argparse.Namespace, config: DaemonConfig,
          environ=os.environ) -> DaemonConfig:
    for name in ("max_blob", "max_header", "max_buffers", "max_graph_tensors", "max_graphs", "max_cached_tensors",
                 "request_burst"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_client_mem < 0 or args.max_requests_per_second < 0 or args.hello_timeout <= 0:
        p.error("--max-client-mem and --max-requests-per-second must be >= 0, --hello-timeout > 0")
    try:
        secret = auth.load_secret(secret_file=args.secret_file, environ=environ)
    except auth.SecretError as exc:
        p.error(str(exc))
    environ.pop(auth.ENV_VAR, None)  # the compute process (and anything else we start) must not inherit it
    if args.secret_file and auth.secret_file_too_open(args.secret_file):
        print(f"ggml-rpc-server: warning: secret file {args.secret_file} is readable by group or others "
              f"(chmod 600 it)", file=sys.stderr)
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if args.tls_cert:
        from rpc_daemon.wire.tls import TlsConfigError, server_context
        try:
            server_context(args.tls_cert, args.tls_key)
        except TlsConfigError as exc:
            p.error(str(exc))
    if args.peer_tls_ca:
        from rpc_daemon.wire.tls import TlsConfigError, client_context
        try:
            client_context(args.peer_tls_ca)
        except TlsConfigError as exc:
            p.error(str(exc))
    if not is_loopback(config.host) and secret is None and not args.insecure:
        p.error(f"refusing to listen on {config.host} without a shared secret: anyone who can reach the port "
                f"could read and write this worker's memory and run graphs on it. Give --secret-file PATH (or "
                f"${auth.ENV_VAR}), ideally with --tls-cert/--tls-key, or --insecure to accept the risk on a "
                f"network you trust")
    limits = dataclasses.replace(config.limits, max_blob=args.max_blob * MiB, max_header=args.max_header * MiB,
                                 max_buffers=args.max_buffers, max_graph_tensors=args.max_graph_tensors,
                                 max_graphs=args.max_graphs, max_cached_tensors=args.max_cached_tensors,
                                 max_client_bytes=args.max_client_mem * MiB)
    return dataclasses.replace(config, limits=limits, secret=secret, tls_cert=args.tls_cert, tls_key=args.tls_key,
                               peer_tls_ca=args.peer_tls_ca,
                               insecure=args.insecure, max_requests_per_second=args.max_requests_per_second,
                               request_burst=args.request_burst, hello_timeout=args.hello_timeout)
