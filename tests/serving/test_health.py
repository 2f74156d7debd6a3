"""coordinator/serving/health.py's pure parts, without a socket or a model:
what /health answers for a given library health and decode loop, and the
Retry-After of a 503."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordinator.serving import health
from coordinator.serving.health import DECODE_STALL_SECONDS, decode_loop_problems, health_answer

A, B, C = "127.0.0.1:5001", "127.0.0.1:5002", "127.0.0.1:5003"
HEAD = {"choice": "split", "steps_split": 3}


def endpoint(name: str, **extra) -> dict:
    """An entry of Coordinator.endpoints()."""
    return {"endpoint": name, "layers": [0, 9], "rtt": 0.001, **extra}


def lib_entry(name: str, ok: bool = True, **extra) -> dict:
    """An entry of Coordinator.health()["endpoints"]."""
    failure = {} if ok else {"kind": "closed", "cause": "connection closed", "since": 1700000000.0,
                             "attempts": 2, "next_attempt": 1700000005.0}
    return {"endpoint": name, "layers": [0, 9], "ok": ok, **failure, **extra}


def answer(status: str, entries: list[dict], loaded: bool = True, problems: tuple = (), busy: int = 1):
    return health_answer({"status": status, "endpoints": entries}, [endpoint(e["endpoint"]) for e in entries],
                         HEAD, loaded, list(problems), busy, 4)


def test_all_well():
    assert answer("ok", [lib_entry(A), lib_entry(B)]) == (200, {
        "status": "ok", "slots_busy": 1, "slots": 4, "split_mode": "layer", "split_choice": None,
        "endpoints": [endpoint(A), endpoint(B)], "head": HEAD})


def test_the_split_mode_is_the_librarys():
    choice = {"asked": "auto", "chosen": "tensor", "exchanges_ms_per_token": 5.5, "compute_saved_ms_per_token": 15.0}
    status, body = health_answer({"status": "ok", "split_mode": "tensor", "split_choice": choice,
                                  "endpoints": [lib_entry(A)]}, [endpoint(A)], HEAD, True, [], 0, 4)
    assert status == 200 and body["split_mode"] == "tensor" and body["split_choice"] == choice


@pytest.mark.parametrize("status, reasons", [("failed", ["endpoints failed"]),
                                             ("reconnecting", ["endpoints failed", "reconnecting"])])
def test_a_failed_endpoint_is_503_with_its_cause(status, reasons):
    code, body = answer(status, [lib_entry(A), lib_entry(B, ok=False)])
    assert code == 503
    assert body["status"] == "unavailable"
    assert body["reasons"] == reasons
    assert body["endpoints"] == [endpoint(A), endpoint(B, cause="connection closed", failed_since=1700000000.0)]


def test_resuming_is_200_degraded_and_says_requests_pause():
    code, body = answer("resuming", [lib_entry(A, ok=False), lib_entry(B)])
    assert (code, body["status"]) == (200, "degraded")
    assert body["reasons"] == [f"stage on {A} resuming: requests pause"]
    assert body["endpoints"][0] == endpoint(A, cause="connection closed", failed_since=1700000000.0)


def test_a_spare_holding_a_stage_is_degraded():
    code, body = answer("degraded", [lib_entry(C, spare_for=A), lib_entry(B)])
    assert (code, body["status"]) == (200, "degraded")
    assert body["reasons"] == [f"{C} holds the stage of {A} (spare)"]
    assert body["endpoints"] == [endpoint(C, spare_for=A), endpoint(B)]


def test_server_problems_come_before_degradation():
    code, body = answer("resuming", [lib_entry(A, ok=False), lib_entry(C, spare_for=B)], loaded=False,
                        problems=["decode loop stopped"])
    assert (code, body["status"]) == (503, "unavailable")
    assert body["reasons"] == ["model loading", "decode loop stopped", f"stage on {A} resuming: requests pause",
                               f"{C} holds the stage of {B} (spare)"]


def test_decode_loop_problems():
    now = 1000.0
    assert decode_loop_problems(True, None, False, now) == []
    assert decode_loop_problems(False, None, False, now) == ["decode loop stopped"]
    assert decode_loop_problems(True, now - DECODE_STALL_SECONDS, False, now) == []
    assert decode_loop_problems(True, now - DECODE_STALL_SECONDS - 2.4, False, now) == [
        "decode step in flight for 12 s"]
    assert decode_loop_problems(True, now - 60, True, now) == []  # paused for a lost worker: not stuck
    assert decode_loop_problems(False, now - 60, False, now) == ["decode loop stopped",
                                                                 "decode step in flight for 60 s"]


def test_retry_after_is_the_next_reconnect():
    failure = SimpleNamespace
    assert health.retry_after([], 100.0) == 1.0
    assert health.retry_after([failure(next_attempt=None)], 100.0) == 1.0
    assert health.retry_after([failure(next_attempt=107.5), failure(next_attempt=103.0)], 100.0) == 3.0
    assert health.retry_after([failure(next_attempt=100.2)], 100.0) == 1.0  # at least a second


@pytest.mark.parametrize("status, refused", [("ok", False), ("degraded", False), ("resuming", False),
                                             ("reconnecting", True), ("failed", True)])
def test_a_request_is_refused_for_a_worker_exactly_when_health_is_503_for_it(status, refused):
    """One rule for /health and admission (issue #29): while a stage resumes
    (/health 200) a new request is taken and waits; past its outage's deadline
    ("reconnecting") it gets 503 naming the failed worker."""
    lib = {"status": status, "endpoints": [lib_entry(A), lib_entry(B, ok=status in ("ok", "degraded"))]}
    code, body = health_answer(lib, [endpoint(A), endpoint(B)], HEAD, True, [], 1, 4)
    failed = health.refused_for(lib)
    assert (failed is not None) == refused == (code == 503), (status, body)
    if refused:
        assert failed["endpoint"] == B and failed["cause"] == "connection closed"
