"""The live view of the cluster behind the web page: GET /cluster (a
snapshot) and GET /cluster/events (Server-Sent Events: snapshots, and the
workers' failures and recoveries as they happen). docs/operations.md ("The
web page and the cluster view") documents every field.

Two loops run on the server's event loop, apart, so neither waits for the
other and neither holds up a decode:

* watch, every WATCH_INTERVAL seconds: the coordinator's own state (latches,
  reconnect attempts, the scheduler's counters), read without network
  traffic. A change becomes an event and wakes every stream at once.
* probe, every PROBE_INTERVAL seconds: a PING and a DEVICE_INFO to every
  connected worker, each bounded by PROBE_TIMEOUT (Coordinator.aprobe). Every
  figure it yields carries its age: a figure from an earlier probe is shown
  as that old, never as live.
"""
from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass, field

import structlog
from aiohttp import web

log = structlog.get_logger("cluster")

WATCH_INTERVAL = 0.1  # latches show within this (plus the page's render)
PROBE_INTERVAL = 1.0
PROBE_TIMEOUT = 1.0  # each of a probe's two requests; the whole probe is given twice that and a second
SNAPSHOT_INTERVAL = 1.0  # a stream gets a snapshot at least this often, so ages move on
RATE_WINDOW = 3.0  # tokens/s and compute busy: over the last this many seconds
MAX_EVENTS = 200  # kept for GET /cluster and for a stream's replay


@dataclass
class Probe:
    """What the probes found about one endpoint, each figure with the
    time.monotonic() it was had."""
    ping_rtt: float | None = None
    ping_at: float | None = None
    total_memory: int | None = None
    free_memory: int | None = None
    memory_at: float | None = None
    error: str | None = None
    error_at: float | None = None
    compute: collections.deque = field(default_factory=collections.deque)  # (monotonic, compute seconds)

    def record(self, found: dict, now: float) -> None:
        if found.get("ping_rtt") is not None:
            self.ping_rtt, self.ping_at = found["ping_rtt"], now
        if found.get("free_memory") is not None:
            self.total_memory, self.free_memory, self.memory_at = found["total_memory"], found["free_memory"], now
        self.error, self.error_at = (found["error"], now) if found.get("error") else (None, None)
        seconds = found.get("compute_seconds")
        if seconds is None or (self.compute and seconds < self.compute[-1][1]):
            self.compute.clear()  # none to tell, or a new connection counts from zero again
        if seconds is not None:
            self.compute.append((now, seconds))
            _trim(self.compute, now)

    def busy(self) -> float | None:
        """The fraction of wall time the worker computed for us over the window."""
        return _rate(self.compute)


def _trim(samples: collections.deque, now: float) -> None:
    while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW:
        samples.popleft()


def _rate(samples: collections.deque) -> float | None:
    if len(samples) < 2 or samples[-1][0] - samples[0][0] < 0.5:
        return None
    (t0, v0), (t1, v1) = samples[0], samples[-1]
    return (v1 - v0) / (t1 - t0)


def _aged(now: float, at: float | None, **figures) -> dict | None:
    return None if at is None else dict(figures, age_seconds=round(now - at, 3))


def _sse(event: str, data: dict, event_id: int | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class ClusterView:
    def __init__(self, coord, scheduler, model_name: str):
        self.coord, self.scheduler, self.model_name = coord, scheduler, model_name
        self.probes = {e["endpoint"]: Probe() for e in coord.endpoints()}
        self.events: collections.deque = collections.deque(maxlen=MAX_EVENTS)
        self._next_id = 1
        self._latched: dict[str, dict] = {}  # endpoint -> its health entry while latched, as last seen
        self._spares_seen: dict[str, str] = {}  # spare endpoint -> the endpoint whose stage it holds
        stats = getattr(coord, "stats", {})
        self._resumes_seen = (stats.get("resumes", 0), stats.get("resume_seconds", 0.0))
        self._tokens: collections.deque = collections.deque()  # (monotonic, tokens generated so far)
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.closed = False

    # ------------------------------------------------------------ running
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._watch_once()  # latched before the server answered: an event now, not a transition missed
        self._tasks = [loop.create_task(self._every(WATCH_INTERVAL, self._watch)),
                       loop.create_task(self._every(PROBE_INTERVAL, self._probe))]

    async def close(self, app=None) -> None:
        """Stop the loops and end every stream (so a shutdown does not wait for them)."""
        self.closed = True
        self._notify()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _every(self, interval: float, step) -> None:
        while not self.closed:
            started = time.monotonic()
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception:  # e.g. a latch cleared while it was read: the next round reads it again
                log.exception("cluster view update failed")
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------ watching
    async def _watch(self) -> None:
        self._watch_once()

    def _watch_once(self) -> None:
        now = time.monotonic()
        self._tokens.append((now, self.scheduler.generated))
        _trim(self._tokens, now)
        changed = False
        health = self.coord.health()
        for e in health["endpoints"]:
            name = e["endpoint"]
            before = self._latched.get(name)
            if before is not None and (e["ok"] or e["since"] != before["since"]):
                del self._latched[name]  # it recovered (and maybe failed again since)
                self._event("recovered", name, f"worker {name} is back (reconnected after "
                                               f"{time.time() - before['since']:.1f} s)",
                            down_seconds=round(time.time() - before["since"], 3))
                before, changed = None, True
            if e["ok"]:
                continue
            if before is None:
                self._event("failed", name, f"worker {name} failed ({e['kind']}): {e['cause']}",
                            failure_kind=str(e["kind"]), cause=e["cause"])
                changed = True
            elif e["attempts"] > before["attempts"]:
                self._event("reconnect_failed", name, f"reconnect attempt {e['attempts']} to worker {name} "
                                                      f"failed: {e['cause']}",
                            failure_kind=str(e["kind"]), cause=e["cause"], attempts=e["attempts"])
                changed = True
            self._latched[name] = e
        changed |= self._watch_resumes(health)
        if changed:
            self._notify()

    def _watch_resumes(self, health: dict) -> bool:
        """Events of the coordinator's resuming (coordinator/decode/resume.py): a spare
        that took over a stage, and generations that paused and went on."""
        changed = False
        for e in health["endpoints"]:
            held = e.get("spare_for")
            if held and self._spares_seen.get(e["endpoint"]) != held:
                self._event("spare_took_over", e["endpoint"], f"spare {e['endpoint']} took over the stage of "
                                                              f"worker {held}", spare_for=held)
                changed = True
            if held:
                self._spares_seen[e["endpoint"]] = held
            else:
                self._spares_seen.pop(e["endpoint"], None)
        stats = getattr(self.coord, "stats", {})
        resumes, seconds = stats.get("resumes", 0), stats.get("resume_seconds", 0.0)
        if resumes > self._resumes_seen[0]:
            n, paused = resumes - self._resumes_seen[0], seconds - self._resumes_seen[1]
            self._event("resumed", "", f"{n} decode step{'s' if n != 1 else ''} resumed after a worker failure "
                                       f"({paused:.1f} s paused), with the same text", resumes=n,
                        paused_seconds=round(paused, 3))
            changed = True
        self._resumes_seen = (resumes, seconds)
        return changed

    def _event(self, kind: str, endpoint: str, message: str, **fields) -> None:
        self.events.append({"id": self._next_id, "time": round(time.time(), 3), "kind": kind,
                            "endpoint": endpoint, "message": message, **fields})
        self._next_id += 1
        log.info("cluster event", kind=kind, endpoint=endpoint)

    # ------------------------------------------------------------ probing
    async def _probe(self) -> None:
        # the endpoints now, in the order aprobe answers: a spare may have taken a stage since the start
        names = [e["endpoint"] for e in self.coord.endpoints()]
        try:
            found = await asyncio.wait_for(self.coord.aprobe(PROBE_TIMEOUT), 2 * PROBE_TIMEOUT + 1)
        except asyncio.TimeoutError:
            found = [{"error": "the probe did not finish in time"}] * len(names)
        now = time.monotonic()
        for endpoint, result in zip(names, found):
            self.probes.setdefault(endpoint, Probe()).record(result, now)
        self._notify()

    # ------------------------------------------------------------ assembling
    def snapshot(self) -> dict:
        now = time.monotonic()
        health = self.coord.health()
        places = self.coord.endpoints()
        n_vocab = self.coord.hp.n_vocab
        workers = []
        for index, (place, state) in enumerate(zip(places, health["endpoints"])):
            probe = self.probes.setdefault(place["endpoint"], Probe())  # a spare's first: nothing yet
            head = place["head_rows"]
            if head is not None:
                head_share = (head[1] - head[0]) / n_vocab
            else:  # no head split: the last worker computes all of it
                head_share = 1.0 if index == len(places) - 1 else 0.0
            failure = None
            if not state["ok"]:
                failure = {"kind": str(state["kind"]), "cause": state["cause"], "since": state["since"],
                           "down_seconds": round(time.time() - state["since"], 3), "attempts": state["attempts"],
                           "next_attempt_in_seconds": None if state["next_attempt"] is None
                           else round(max(0.0, state["next_attempt"] - time.time()), 3)}
            memory = _aged(now, probe.memory_at, total_bytes=probe.total_memory, free_bytes=probe.free_memory,
                           used_bytes=None if probe.total_memory is None
                           else max(0, probe.total_memory - probe.free_memory))
            busy = None if failure else probe.busy()  # of a connection that is gone
            workers.append({
                "index": index, "endpoint": place["endpoint"], "layers": place["layers"], "head_rows": head,
                "shard": place.get("shard"),
                "head_share": round(head_share, 4), "state": "ok" if state["ok"] else "failed", "failure": failure,
                "ping": _aged(now, probe.ping_at, rtt_seconds=probe.ping_rtt),
                "step_rtt": None if place["rtt"] is None or failure
                else _aged(now, self.scheduler.last_step_end, seconds=place["rtt"]),
                "memory": memory,
                "compute_busy": None if busy is None else _aged(now, probe.compute[-1][0], fraction=round(busy, 4)),
                "probe_error": _aged(now, probe.error_at, message=probe.error)})
        rate = _rate(self._tokens)
        return {"time": round(time.time(), 3), "status": health["status"], "model": self.model_name,
                "n_layer": self.coord.hp.n_layer, "split_mode": health.get("split_mode", "layer"),
                "split_choice": health.get("split_choice"), "slots": self.scheduler.n_slots,
                "slots_busy": self.scheduler.busy, "requests_waiting": self.scheduler.waiting,
                "tokens_per_second": None if rate is None else round(rate, 2),
                "tokens_generated": self.scheduler.generated, "reconnects": self.coord.stats["reconnects"],
                "last_event_id": self._next_id - 1, "workers": workers, "head": self.coord.head_placement()}

    # ------------------------------------------------------------ HTTP
    async def handle_snapshot(self, request) -> web.Response:
        return web.json_response(dict(self.snapshot(), events=list(self.events)),
                                 headers={"Cache-Control": "no-store"})

    async def handle_stream(self, request) -> web.StreamResponse:
        """Events after Last-Event-ID (all kept ones without it), then a
        snapshot; afterwards new events and a snapshot on every change, and a
        snapshot at least every SNAPSHOT_INTERVAL seconds."""
        try:
            last_id = int(request.headers.get("Last-Event-ID", "0"))
        except ValueError:
            last_id = 0
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        try:
            while not self.closed:
                changed = self._changed
                for event in [e for e in self.events if e["id"] > last_id]:
                    await resp.write(_sse("cluster_event", event, event["id"]))
                    last_id = event["id"]
                await resp.write(_sse("snapshot", self.snapshot()))
                try:
                    await asyncio.wait_for(changed.wait(), SNAPSHOT_INTERVAL)
                except asyncio.TimeoutError:
                    pass
            await resp.write_eof()
        except ConnectionResetError:
            log.info("cluster stream client went away")
        return resp
