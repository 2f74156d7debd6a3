"""What every ggml-coordinator command starts from its flags: the workers
(--endpoints, or --local-workers daemons started for the command and stopped
after it) and the Coordinator's options for reaching them (the shared
secret, TLS) and for resuming through a lost one."""
from __future__ import annotations

import contextlib

from rpc_daemon.service.logs import say  # stderr lines: plain, or JSON under --log-format json

EXIT_CONNECT_FAILED = 3


@contextlib.contextmanager
def endpoints_for(args, supervise: bool = False):
    if args.endpoints:
        yield [e.strip() for e in args.endpoints.split(",") if e.strip()]
        return
    from coordinator.serving.local_workers import LocalWorkers

    extra = ("--secret-file", args.secret_file) if args.secret_file else ()
    with LocalWorkers(args.local_workers, args.threads, extra) as workers:
        if supervise:  # a server restarts a local worker that dies; generate and bench report it and stop
            workers.supervise()
        yield workers.endpoints


def security_options(args) -> dict:
    """Coordinator options for the workers' shared secret and TLS (docs/security.md)."""
    return {"secret": args.secret, "tls_ca": args.tls_ca}


def resume_options(args) -> dict:
    """Coordinator options for resuming through a lost worker (docs/failure-semantics.md, "Resuming")."""
    return {"resume_within": args.resume_within or None, "spare_after": args.spare_after,
            "spares": [e.strip() for e in (args.spares or "").split(",") if e.strip()]}


def cannot_start(exc: Exception) -> int:
    """Say why the Coordinator could not start (workers unreachable, a bad model or split): the exit status."""
    say(f"cannot start: {exc}", "error")
    return EXIT_CONNECT_FAILED
