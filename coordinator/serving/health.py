"""The serving process's health, which tells the truth: GET /health and the
systemd watchdog.

200 "ok" only while the model is loaded, every endpoint is connected and not
latched failed, and the decode loop is alive and not stuck; 200 "degraded"
(with reasons) while a stage resumes (requests pause, then go on) or runs on
a spare; else 503 "unavailable" with the reasons. It starts from the
library's Coordinator.health() (the latch state decodes check) and adds the
server's own. health_answer and decode_loop_problems are pure; ServerHealth
reads the coordinator and the scheduler for them.
"""
from __future__ import annotations

import time

DECODE_STALL_SECONDS = 10.0  # a step in flight longer than this makes /health say so
# the library's health() states in which requests are served: "resuming" too (they wait for the stage, at most
# until its outage's deadline: coordinator/decode/outages.py); any other (an outage past it, or resuming off and
# an endpoint latched) makes /health 503 and refuses new requests with 503
SERVING = ("ok", "degraded", "resuming")


def refused_for(health: dict) -> dict | None:
    """The failed endpoint (its entry in the library's `health`) a new request
    is refused for with 503, or None: the one rule of /health's "endpoints
    failed" and of the server's admission, so no request is refused for a
    failed worker while /health says 200."""
    if health["status"] in SERVING:
        return None
    return next((e for e in health["endpoints"] if not e["ok"]), None)


def decode_loop_problems(alive: bool, decode_started: float | None, resuming: bool, now: float) -> list[str]:
    """What is wrong with the decode loop: stopped, or a step in flight
    (since `decode_started`, a time.monotonic()) for too long. A step paused
    while a stage resumes is not a stuck one."""
    problems = [] if alive else ["decode loop stopped"]
    if decode_started is not None and not resuming and now - decode_started > DECODE_STALL_SECONDS:
        problems.append(f"decode step in flight for {now - decode_started:.0f} s")
    return problems


def health_answer(health: dict, endpoints: list[dict], head: dict, loaded: bool, decode_problems: list[str],
                  slots_busy: int, n_slots: int) -> tuple[int, dict]:
    """(status, body) of GET /health from the library's `health`
    (Coordinator.health()), its `endpoints` (Coordinator.endpoints()) and
    `head` (Coordinator.head_placement()), and the server's own state."""
    reasons = [] if loaded else ["model loading"]
    degraded = []  # serving, with a pause or on a spare: 200
    if health["status"] == "resuming":
        degraded += [f"stage on {e['endpoint']} resuming: requests pause" for e in health["endpoints"]
                     if not e["ok"]]
    elif health["status"] not in SERVING:
        reasons.append("endpoints failed")
        if health["status"] == "reconnecting":
            reasons.append("reconnecting")
    degraded += [f"{e['endpoint']} holds the stage of {e['spare_for']} (spare)" for e in health["endpoints"]
                 if e.get("spare_for")]
    reasons += decode_problems
    failures = {e["endpoint"]: {"cause": e["cause"], "failed_since": e["since"]}
                for e in health["endpoints"] if not e["ok"]}
    spare_for = {e["endpoint"]: {"spare_for": e["spare_for"]} for e in health["endpoints"] if e.get("spare_for")}
    status = "unavailable" if reasons else "degraded" if degraded else "ok"
    body = {"status": status, "slots_busy": slots_busy, "slots": n_slots,
            "split_mode": health.get("split_mode", "layer"), "split_choice": health.get("split_choice"),
            "endpoints": [dict(e, **failures.get(e["endpoint"], {}), **spare_for.get(e["endpoint"], {}))
                          for e in endpoints],
            "head": head}
    if reasons or degraded:
        body["reasons"] = reasons + degraded
    return (200 if not reasons else 503), body


def retry_after(failures, now: float) -> float:
    """Seconds until the next automatic reconnect of a failed worker (`failures`:
    Coordinator.failed_endpoints(), `now`: time.time()), when one is scheduled; else 1."""
    times = [f.next_attempt for f in failures if f.next_attempt is not None]
    return max(1.0, min(times) - now) if times else 1.0


class ServerHealth:
    """The health of a server over `coord` whose requests `scheduler` decodes."""

    def __init__(self, coord, scheduler):
        self.coord, self.scheduler = coord, scheduler
        self.loaded = True

    def state(self) -> tuple[int, dict]:
        health = self.coord.health()
        problems = self._decode_loop_problems(health["status"])
        return health_answer(health, self.coord.endpoints(), self.coord.head_placement(), self.loaded, problems,
                             self.scheduler.busy, self.scheduler.n_slots)

    def _decode_loop_problems(self, status: str | None = None) -> list[str]:
        resuming = (status or self.coord.health()["status"]) == "resuming"
        return decode_loop_problems(self.scheduler.alive, self.scheduler.decode_started, resuming, time.monotonic())

    def decode_loop_healthy(self) -> bool:
        """What the watchdog is petted on: the decode loop runs and is not stuck."""
        return not self._decode_loop_problems()

    def retry_after(self) -> float:
        return retry_after(self.coord.failed_endpoints(), time.time())

    def refused_for(self) -> dict | None:
        """The failed endpoint a new request gets 503 for now (refused_for), or None."""
        return refused_for(self.coord.health())
