"""The serving process's Prometheus metrics (GET /metrics): decode steps as
the scheduler reports them, HTTP requests as the server answers them, and
the coordinator's own counters copied in when scraped. docs/operations.md
lists every name; they are an interface: keep them."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from coordinator.decode.values import DecodeResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """The metrics of a server over `coord`, in a registry of their own."""

    def __init__(self, coord):
        self.registry = r = CollectorRegistry()
        self.tokens_generated = Counter("ggml_tokens_generated", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("ggml_prompt_tokens", "Prompt tokens processed", registry=r)
        self.decode_latency = Histogram("ggml_decode_seconds", "Decode step latency", registry=r,
                                        buckets=(.005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10))
        self.decode_failures = Counter("ggml_decode_failures", "Failed decode steps by code", ["code"], registry=r)
        self.decode_outputs = Counter("ggml_decode_outputs", "Decode steps by what their sampled rows read from "
                                      "the workers: logits, argmax or best_tokens (greedy requests; bans), none "
                                      "(a prompt's chunk)", ["outputs"], registry=r)
        self.tokens_per_second = Gauge("ggml_tokens_per_second", "Tokens per second of the last step", registry=r)
        self.endpoint_up = Gauge("ggml_endpoint_up", "1 if the endpoint is connected and not latched failed",
                                 ["endpoint"], registry=r)
        self.endpoint_rtt = Gauge("ggml_endpoint_rtt_seconds", "Last ping round trip", ["endpoint"], registry=r)
        self.reconnects = Counter("ggml_reconnects", "Successful reconnects", registry=r)
        self.slots_busy = Gauge("ggml_slots_busy", "Slots serving a request", registry=r)
        self.requests_waiting = Gauge("ggml_requests_waiting", "Requests waiting for a free slot", registry=r)
        self.requests = Counter("ggml_http_requests", "HTTP requests answered, by route and status",
                                ["path", "status"], registry=r)
        self.request_seconds = Histogram("ggml_http_request_seconds", "HTTP request duration (a stream: to its end)",
                                         ["path"], registry=r,
                                         buckets=(.005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.ttft = Histogram("ggml_time_to_first_token_seconds", "Request arrival to its first sampled token "
                              "(queueing and prompt processing included)", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.tpot = Histogram("ggml_time_per_output_token_seconds", "A request's mean time between its tokens "
                              "after the first", registry=r,
                              buckets=(.005, .01, .02, .05, .1, .2, .5, 1, 2))
        self.resumes = Counter("ggml_resumes", "Decode steps that paused for a lost worker and went on", registry=r)
        self.resume_seconds = Counter("ggml_resume_seconds", "Seconds decode steps were paused for a lost worker",
                                      registry=r)
        self.replayed_tokens = Counter("ggml_replayed_tokens", "Tokens replayed to rebuild a lost KV cache",
                                       registry=r)
        self.spare_takeovers = Counter("ggml_spare_takeovers", "Stages moved to a spare worker", registry=r)
        self.linked_steps = Counter("ggml_linked_steps", "Decode steps whose activations went worker to worker "
                                                         "(step links; the others were relayed)", registry=r)
        self.head_steps = Counter("ggml_head_steps", "Decode steps by where their output head ran (split over "
                                  "every worker, whole on the last, or here: the last worker's share and the rest "
                                  "in the coordinator)", ["placement"], registry=r)
        self.head_split = Gauge("ggml_head_split", "1 if the last step's output head was split (over the workers, "
                                "or here), 0 if whole on the last worker", registry=r)
        self.head_one_way = Gauge("ggml_head_one_way_seconds", "The one-way delay the head placement was chosen by "
                                  "(half the slowest worker's median ping)", registry=r)
        self.coord = coord
        self._seen = {}  # the coordinator's counters as last copied into the metrics

    def observe_decode(self, seconds: float, code: DecodeResult, n_tokens: int, outputs: str | None = None) -> None:
        """A decode step; `outputs` (a serve step): what its sampled rows read (ggml_decode_outputs)."""
        self.decode_latency.observe(seconds)
        if code != DecodeResult.OK:
            self.decode_failures.labels(code=DecodeResult(code).name).inc()
            return
        if seconds > 0:
            self.tokens_per_second.set(n_tokens / seconds)
        if outputs is not None:
            self.decode_outputs.labels(outputs=outputs).inc()

    def _advance(self, counter, key: str, value) -> None:
        """Bring `counter` up to the coordinator's count `value` (copied under `key` last time)."""
        if value > self._seen.get(key, 0):
            counter.inc(value - self._seen.get(key, 0))
            self._seen[key] = value

    def refresh(self, scheduler) -> None:
        """Copy the coordinator's and the scheduler's state into the metrics (before /metrics answers)."""
        failed = {f.endpoint for f in self.coord.failed_endpoints()}
        for e in self.coord.endpoints():
            self.endpoint_up.labels(endpoint=e["endpoint"]).set(0 if e["endpoint"] in failed else 1)
            if e.get("rtt") is not None:
                self.endpoint_rtt.labels(endpoint=e["endpoint"]).set(e["rtt"])
        self.slots_busy.set(scheduler.busy)
        self.requests_waiting.set(scheduler.waiting)
        for key, counter in (("reconnects", self.reconnects), ("resumes", self.resumes),
                             ("resume_seconds", self.resume_seconds), ("replayed_tokens", self.replayed_tokens),
                             ("spare_takeovers", self.spare_takeovers), ("linked_steps", self.linked_steps)):
            self._advance(counter, key, self.coord.stats.get(key, 0))
        head = self.coord.head_placement()
        for placement in ("split", "whole", "here"):
            self._advance(self.head_steps.labels(placement=placement), f"head_{placement}",
                          head[f"steps_{placement}"])
        if head["choice"] is not None:
            self.head_split.set(0 if head["choice"] == "whole" else 1)
        if head["one_way_seconds"] is not None:
            self.head_one_way.set(head["one_way_seconds"])

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        """One answered HTTP request (`route`: its canonical path, "other" for an unknown one)."""
        self.requests.labels(path=route, status=str(status)).inc()
        self.request_seconds.labels(path=route).observe(seconds)

    def observe_latency(self, arrived: float, slot) -> None:
        """A request's time to first token and time per output token (time.monotonic() times)."""
        if slot.first_token_at is None:
            return
        self.ttft.observe(slot.first_token_at - arrived)
        if slot.finished_at is not None and slot.generated > 1:
            self.tpot.observe((slot.finished_at - slot.first_token_at) / (slot.generated - 1))

    def render(self, scheduler) -> bytes:
        """The exposition text /metrics answers, brought up to date."""
        self.refresh(scheduler)
        return generate_latest(self.registry)
