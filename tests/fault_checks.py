"""What every fault test checks once a decode has failed with a lost worker
(docs/failure-semantics.md): the worker latched with its kind, later decodes
failing fast with the same code without a byte on any connection, no logits
readable, /health saying so. Shared by the layer split's fault matrix
(coordinator/test_faults.py) and the tensor split's (coordinator/test_tensor_parallel.py), and
when a --test-fault fired."""
from __future__ import annotations

import re
import statistics
import time

import pytest

from conftest import SLACK
from coordinator.api import Batch, Coordinator, DecodeResult


def check_latched(c: Coordinator, endpoint: str, pos: int, kind: str, liveness: float) -> None:
    """After a failure: `endpoint` latched with `kind`, the others healthy; later decodes fail
    fast, with the same code, without a byte on any connection; no logits readable."""
    failed = c.failed_endpoints()
    assert [f.endpoint for f in failed] == [endpoint], failed
    f = failed[0]
    assert f.kind == kind, f
    assert endpoint in f.cause and 0 < time.time() - f.since < 30
    with pytest.raises(RuntimeError):
        c.logits(-1)
    # every connection a step may use: each worker's own, and its step channel (tensor mode) if any
    clients = [cl for p in c._places if p.executor is not None
               for cl in (p.executor.client, getattr(p.executor, "channel", None)) if cl is not None]
    sent = [cl.frames_sent - cl.pings_sent for cl in clients]  # a keepalive ping may go out meanwhile
    times = []
    for _ in range(20):
        t = time.perf_counter()
        code = c.decode(Batch.single([5], pos))
        times.append(time.perf_counter() - t)
        assert code is DecodeResult.ENDPOINT_FAILED
        assert c.last_failed_endpoint == endpoint and c.last_cause == kind
    # no wait on the network: a decode that sent to the worker, or waited for it, would take at least a
    # liveness bound (a stopped worker) or put frames on a connection (checked below); a quarter of it
    # leaves room for a loaded machine's scheduling, where 20 returns of a latched code take microseconds
    assert statistics.median(times) < liveness / 4 * SLACK, times
    assert [cl.frames_sent - cl.pings_sent for cl in clients] == sent, "a latched decode touched the network"
    with pytest.raises(RuntimeError):
        c.logits(-1)
    h = c.health()
    assert h["status"] == "failed"
    assert [e["ok"] for e in h["endpoints"]] == [e["endpoint"] != endpoint for e in h["endpoints"]], h


_FIRED_AT = re.compile(r"at=([0-9.]+)")


def fault_fired_at(daemon) -> float:
    """When the daemon's --test-fault fired (time.time(), from its "test fault fired" log line)."""
    return float(_FIRED_AT.search(daemon.wait_log("test fault fired", timeout=5)).group(1))
