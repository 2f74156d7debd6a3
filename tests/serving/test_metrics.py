"""coordinator/serving/metrics.py without a socket or a model: the /metrics
names (an interface: docs/operations.md lists them) and what each
observation and refresh counts."""
from __future__ import annotations

import os
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from coordinator.decode.values import DecodeResult
from coordinator.serving.metrics import Metrics

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "operations.md")
NAMES = {  # family name -> type, as docs/operations.md's table gives them (counters there with _total)
    "ggml_tokens_generated": "counter", "ggml_prompt_tokens": "counter", "ggml_tokens_per_second": "gauge",
    "ggml_decode_seconds": "histogram", "ggml_decode_failures": "counter", "ggml_decode_outputs": "counter",
    "ggml_endpoint_up": "gauge",
    "ggml_endpoint_rtt_seconds": "gauge", "ggml_reconnects": "counter", "ggml_resumes": "counter",
    "ggml_resume_seconds": "counter", "ggml_replayed_tokens": "counter", "ggml_spare_takeovers": "counter",
    "ggml_linked_steps": "counter", "ggml_head_steps": "counter", "ggml_head_split": "gauge",
    "ggml_head_one_way_seconds": "gauge", "ggml_slots_busy": "gauge", "ggml_requests_waiting": "gauge",
    "ggml_http_requests": "counter", "ggml_http_request_seconds": "histogram",
    "ggml_time_to_first_token_seconds": "histogram", "ggml_time_per_output_token_seconds": "histogram",
}


class FakeCoordinator:
    def __init__(self):
        self.failed = []
        self.stats = {"reconnects": 0, "resumes": 0, "resume_seconds": 0.0, "replayed_tokens": 0,
                      "spare_takeovers": 0, "linked_steps": 0}
        self.head = {"choice": None, "one_way_seconds": None, "steps_split": 0, "steps_whole": 0, "steps_here": 0}

    def failed_endpoints(self):
        return [SimpleNamespace(endpoint=e) for e in self.failed]

    def endpoints(self):
        return [{"endpoint": "a:1", "rtt": 0.002}, {"endpoint": "b:2", "rtt": None}]

    def head_placement(self):
        return dict(self.head)


SCHEDULER = SimpleNamespace(busy=2, waiting=3)


def samples(metrics: Metrics) -> dict:
    text = metrics.render(SCHEDULER).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_names_and_types_are_the_documented_ones():
    metrics = Metrics(FakeCoordinator())
    families = {f.name: f.type for f in text_string_to_metric_families(metrics.render(SCHEDULER).decode())
                if not f.name.endswith("_created")}  # prometheus_client's creation times, one per counter/histogram
    assert families == NAMES
    with open(DOCS, encoding="utf-8") as f:
        docs = f.read()
    for name, kind in NAMES.items():
        assert f"`{name}{'_total' if kind == 'counter' else ''}" in docs, name


def test_requests_and_latency():
    metrics = Metrics(FakeCoordinator())
    metrics.observe_request("/v1/completions", 200, 0.3)
    metrics.observe_request("/v1/completions", 200, 0.1)
    metrics.observe_request("other", 404, 0.001)
    slot = SimpleNamespace(first_token_at=10.5, finished_at=12.5, generated=5)
    metrics.observe_latency(10.0, slot)
    metrics.observe_latency(10.0, SimpleNamespace(first_token_at=None, finished_at=None, generated=0))
    metrics.observe_latency(10.0, SimpleNamespace(first_token_at=11.0, finished_at=11.0, generated=1))
    got = samples(metrics)
    assert got[("ggml_http_requests_total", (("path", "/v1/completions"), ("status", "200")))] == 2
    assert got[("ggml_http_requests_total", (("path", "other"), ("status", "404")))] == 1
    assert got[("ggml_http_request_seconds_count", (("path", "/v1/completions"),))] == 2
    assert abs(got[("ggml_http_request_seconds_sum", (("path", "/v1/completions"),))] - 0.4) < 1e-9
    assert got[("ggml_time_to_first_token_seconds_count", ())] == 2  # a request without a token: none
    assert got[("ggml_time_to_first_token_seconds_sum", ())] == 1.5
    assert got[("ggml_time_per_output_token_seconds_count", ())] == 1  # one token: no time between tokens
    assert got[("ggml_time_per_output_token_seconds_sum", ())] == 0.5


def test_decode_steps():
    metrics = Metrics(FakeCoordinator())
    metrics.observe_decode(0.5, DecodeResult.OK, 4, "best_tokens")
    metrics.observe_decode(0.1, DecodeResult.ENDPOINT_FAILED, 4, "best_tokens")
    metrics.observe_decode(0.1, DecodeResult.ENDPOINT_FAILED, 1)
    got = samples(metrics)
    assert got[("ggml_tokens_per_second", ())] == 8.0
    assert got[("ggml_decode_failures_total", (("code", "ENDPOINT_FAILED"),))] == 2
    assert got[("ggml_decode_seconds_count", ())] == 3
    assert got[("ggml_decode_outputs_total", (("outputs", "best_tokens"),))] == 1  # steps that succeeded


def test_refresh_copies_the_coordinators_state_and_only_counts_up():
    coord = FakeCoordinator()
    metrics = Metrics(coord)
    coord.failed = ["b:2"]
    coord.stats.update(reconnects=2, resumes=1, resume_seconds=1.5, linked_steps=10)
    coord.head.update(choice="whole", one_way_seconds=0.004, steps_whole=7, steps_split=2)
    got = samples(metrics)
    assert got[("ggml_endpoint_up", (("endpoint", "a:1"),))] == 1
    assert got[("ggml_endpoint_up", (("endpoint", "b:2"),))] == 0
    assert got[("ggml_endpoint_rtt_seconds", (("endpoint", "a:1"),))] == 0.002
    assert ("ggml_endpoint_rtt_seconds", (("endpoint", "b:2"),)) not in got  # not known: not shown
    assert (got[("ggml_slots_busy", ())], got[("ggml_requests_waiting", ())]) == (2, 3)
    assert (got[("ggml_reconnects_total", ())], got[("ggml_resumes_total", ())]) == (2, 1)
    assert (got[("ggml_resume_seconds_total", ())], got[("ggml_linked_steps_total", ())]) == (1.5, 10)
    assert got[("ggml_head_steps_total", (("placement", "whole"),))] == 7
    assert got[("ggml_head_steps_total", (("placement", "split"),))] == 2
    assert (got[("ggml_head_split", ())], got[("ggml_head_one_way_seconds", ())]) == (0, 0.004)
    coord.stats.update(reconnects=5)
    coord.head.update(choice="here", steps_whole=7)
    got = samples(metrics)
    assert got[("ggml_reconnects_total", ())] == 5  # advanced by the difference, not added again
    assert got[("ggml_head_steps_total", (("placement", "whole"),))] == 7
    assert got[("ggml_head_split", ())] == 1  # here: the head's rows are split
