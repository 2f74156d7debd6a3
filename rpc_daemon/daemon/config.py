"""The daemon's configuration (DaemonConfig: every default the CLI shows) and
the open-files limit it reads from the machine (its memory: service/memory.py)."""
from __future__ import annotations

import ipaddress
import resource
from dataclasses import dataclass, field

import structlog

from rpc_daemon.wire.protocol import Limits

log = structlog.get_logger("rpc")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class DaemonConfig:
    host: str = "127.0.0.1"
    port: int = 50052
    threads: int = 1
    mem: int = 0  # bytes; 0 = physical memory
    metrics_port: int | None = None  # Prometheus metrics over HTTP on host:metrics_port
    cache_dir: str | None = None
    cache_max: int = 0  # bytes the tensor cache may hold; 0 = tensor_cache.default_max_bytes
    idle_timeout: float = 300.0
    hello_timeout: float = 10.0
    compute_timeout: float = 600.0
    # the longest a tensor-parallel member's compute process waits for a peer's partial sum without
    # sleeping (compute/exchange.py); it waits a quarter of it for the next step. 0: always sleep
    spin_ms: float = 20.0
    max_clients: int = 64
    # the clients' arenas: files on this tmpfs (None: memfds, or a private tmpfs for huge pages;
    # service/shared_memory.py); huge_pages False: memfds, whatever pages the kernel gives them
    shm_dir: str | None = None
    huge_pages: bool = True
    limits: Limits = Limits()
    unsafe_no_validation: bool = False  # tests only: lets graphs reach libggml unchecked
    test_faults: tuple = ()  # tests only: fault specs for rpc_daemon/testing/faults.py (--test-fault)
    test_older: tuple = ()  # tests only: features this daemon lacks, as one from before them (--test-older)
    # security (docs/security.md)
    secret: bytes | None = field(default=None, repr=False)  # set: HELLO runs auth.py's challenge-response
    tls_cert: str | None = None  # set (with tls_key): TLS on the listening port
    tls_key: str | None = None
    # TLS to peer workers (the step links of docs/protocol.md): verify them against this CA. A TLS worker
    # without it does not offer step links (its coordinator relays activations instead)
    peer_tls_ca: str | None = None
    peer_timeout: float = 2.0  # a peer worker's connect + HELLO, and its liveness bound (as a coordinator's)
    insecure: bool = False  # a non-loopback bind without a secret, acknowledged
    max_requests_per_second: float = 2000.0  # per client, token bucket; 0 = unlimited
    request_burst: int = 4000
    # the slowest an authenticated client may send a frame it has started: bytes/s over min_rate_window
    # seconds (ratelimit.RateFloor); below it the connection, and its --max-clients slot, goes. 0 = off
    min_rate: float = 16384.0
    min_rate_window: float = 10.0


# Descriptors the daemon holds per connected client, whatever its buffer count: its socket,
# its arena (the memfd and the mmap's duplicate), its compute process's link, and that
# process's output area (memfd + mmap); plus 2 in passing (a tensor-cache file, a process spawn).
FDS_PER_CLIENT = 8
# and for itself: stdio, the listening socket(s), the event loop, the metrics server, the
# spare compute process's link, libraries' own
FDS_BASE = 64


def fd_client_limit(max_clients: int) -> int:
    """How many clients the open-files limit lets the daemon serve: raises the soft
    RLIMIT_NOFILE up to the hard one if `max_clients` needs it, and if even that is
    too low, says so and returns the smaller number it can serve."""
    need = FDS_BASE + max_clients * FDS_PER_CLIENT
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else hard  # headroom: all the hard limit allows
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_clients
    served = max(1, (soft - FDS_BASE) // FDS_PER_CLIENT)
    log.warning("the open-files limit cannot cover --max-clients: refusing clients past the limit it can",
                rlimit_nofile=soft, hard_limit=hard, max_clients=max_clients, effective_max_clients=served,
                fds_per_client=FDS_PER_CLIENT, fds_base=FDS_BASE,
                fix=f"raise the limit to {need} (ulimit -n, systemd LimitNOFILE=) or lower --max-clients")
    return served
