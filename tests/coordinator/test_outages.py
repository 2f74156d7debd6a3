"""One outage, one wait (issue #29): coordinator/decode/outages.py's rule, and
the Resumer waiting by it, without a worker: a fake decoder that fails while
a fake endpoint is latched. docs/failure-semantics.md, "Resuming"."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from conftest import SLACK
from coordinator.decode.outages import Outages
from coordinator.decode.resume import Resumer
from coordinator.decode.values import NO_OUTPUT, DecodeOutcome, DecodeResult, FailureKind

A, B = "127.0.0.1:5001", "127.0.0.1:5002"
FIRST = "worker 127.0.0.1:5002 timed out: it sent nothing for 2.0 s"


def test_an_outage_deadline_is_its_first_failure_plus_the_bound():
    o = Outages(4.0)
    assert o.first() is None and o.given_up(100.0) is None
    b = o.begin(1, B, FIRST, FailureKind.TIMEOUT, 10.0)
    assert (b.since, b.deadline) == (10.0, 14.0)
    assert b.left(12.5) == 1.5 and not b.given_up(13.999) and b.given_up(14.0) and b.left(20.0) == 0.0
    assert o.given_up(13.9) is None and o.given_up(14.0) is b
    # a second stage lost later: every wait ends at the first deadline
    a = o.begin(0, A, "closed", FailureKind.CLOSED, 12.0)
    assert o.first() is b and o.given_up(14.0) is b
    assert o.end(1) is b  # the stage is back: the other outage is the bound now
    assert o.first() is a and o.given_up(15.9) is None and o.given_up(16.0) is a
    assert o.end(1) is None
    o.end(0)
    assert o.first() is None
    # the stage lost again after it was back: a new outage, a new deadline
    assert o.begin(1, B, "closed", FailureKind.CLOSED, 30.0).deadline == 34.0


def test_an_outage_needs_a_positive_bound():
    with pytest.raises(ValueError):
        Outages(0)


class Cluster:
    """What the Resumer waits on: an EndpointSet's failed() and places, and a
    Decoder whose decode fails fast while an endpoint is latched."""

    def __init__(self, within: float):
        self.places = [SimpleNamespace(endpoint=e, home=e, failure=None) for e in (A, B)]
        self.resumer = Resumer(within)
        self.resumer.attach(self, self)
        self.decodes = 0
        self.last = None

    # the EndpointSet's face
    def failed(self):
        return [p.failure for p in self.places if p.failure is not None]

    # the Decoder's face
    async def decode(self, batch, greedy=False, group=True) -> DecodeOutcome:
        self.decodes += 1
        await asyncio.sleep(0)
        f = self.failed()
        if f:
            return DecodeOutcome(DecodeResult.ENDPOINT_FAILED, NO_OUTPUT, f[0].cause + " [latched 0.1 s ago]",
                                 f[0].kind, f[0].endpoint)
        return DecodeOutcome(DecodeResult.OK)

    def latch(self, i: int, cause: str = FIRST, kind=FailureKind.TIMEOUT) -> None:
        """EndpointSet._set_failure: the first failure begins the outage; a failed reconnect attempt
        only replaces the latch's cause."""
        p = self.places[i]
        first = p.failure is None
        failure = SimpleNamespace(endpoint=p.endpoint, cause=cause, kind=kind, since=time.time())
        self.resumer.kv_lost(i, failure if first else None)
        p.failure = failure

    async def back(self, i: int) -> None:
        """A reconnect cleared the latch (nothing to rebuild here)."""
        self.places[i].failure = None
        self.resumer.lost.clear()
        await self.resumer.reconnected(self.places, None)

    def status(self) -> str:
        return self.resumer.health({"status": "reconnecting" if self.failed() else "ok",
                                    "endpoints": [{} for _ in self.places]}, self.places)["status"]


async def ended_at(c: Cluster, start_after: float, t0: float) -> tuple[float, DecodeOutcome]:
    await asyncio.sleep(start_after)
    outcome = await c.resumer.decode(object())
    return time.monotonic() - t0, outcome


def test_every_decode_waiting_on_an_outage_gives_up_at_its_deadline():
    """Decodes that came to the outage at 0, 0.3 and 0.5 s all end at its
    deadline (0.8 s after the first failure), with the first failure's cause;
    one that comes after it fails at once; health says resuming until then.
    The old rule gave each decode resume_within of its own (a wave each)."""
    within = 0.8

    async def go():
        c = Cluster(within)
        t0 = time.monotonic()
        c.latch(1)
        assert c.status() == "resuming"
        waits = [asyncio.create_task(ended_at(c, s, t0)) for s in (0.0, 0.3, 0.5)]
        await asyncio.sleep(0.4)
        c.latch(1, cause="reconnect attempt failed: accepted the connection but did not answer HELLO")
        assert c.status() == "resuming"
        ends = await asyncio.gather(*waits)
        assert c.status() == "reconnecting"  # past the deadline: /health 503, new requests 503
        late_start = time.monotonic()
        late = await c.resumer.decode(object())
        return ends, time.monotonic() - late_start, late

    ends, late_took, late = asyncio.run(go())
    times = [t for t, _ in ends]
    assert all(within <= t for t in times), times  # none before the deadline
    assert max(times) - min(times) < 0.05 * SLACK, times  # all at the same moment
    assert max(times) < within + 0.1 * SLACK, times
    for _, outcome in [*ends, (0, late)]:
        assert outcome.code == DecodeResult.ENDPOINT_FAILED and outcome.endpoint == B
        assert outcome.error == FIRST and outcome.cause == FailureKind.TIMEOUT  # the first failure, not a later one
    assert late_took < 0.05 * SLACK, late_took


def test_a_stage_back_in_time_wakes_every_waiting_decode_and_ends_its_outage():
    """Back before the deadline: the waits end with OK at once; the next
    failure is a new outage with a deadline of its own."""
    within = 0.6

    async def go():
        c = Cluster(within)
        t0 = time.monotonic()
        c.latch(1)
        waits = [asyncio.create_task(ended_at(c, s, t0)) for s in (0.0, 0.2)]
        await asyncio.sleep(0.4)
        await c.back(1)
        ends = await asyncio.gather(*waits)
        assert c.status() == "ok" and c.resumer.outages.first() is None
        await asyncio.sleep(0.4)  # past the first outage's deadline
        c.latch(1)
        assert c.status() == "resuming"
        t1 = time.monotonic()
        second = await ended_at(c, 0.0, t1)
        return ends, second, c

    ends, (took, outcome), c = asyncio.run(go())
    assert all(o.code == DecodeResult.OK for _, o in ends), ends
    assert all(0.4 <= t < 0.4 + 0.1 * SLACK for t, _ in ends), ends
    assert c.resumer.stats["resumes"] == 2
    assert outcome.code == DecodeResult.ENDPOINT_FAILED and within <= took < within + 0.1 * SLACK, took


def test_two_stages_lost_one_after_the_other_end_the_waits_at_the_first_deadline():
    """B lost at 0, A at 0.3: a decode waiting on both gives up at B's
    deadline, with B's failure; if B is back first, A's deadline is the bound."""
    within = 0.8

    async def go(b_back: bool):
        c = Cluster(within)
        t0 = time.monotonic()
        c.latch(1)
        wait = asyncio.create_task(ended_at(c, 0.0, t0))
        await asyncio.sleep(0.3)
        c.latch(0, cause="closed", kind=FailureKind.CLOSED)
        if b_back:
            await asyncio.sleep(0.2)
            await c.back(1)
        return await wait

    took, outcome = asyncio.run(go(False))
    assert outcome.endpoint == B and within <= took < within + 0.1 * SLACK, took
    took, outcome = asyncio.run(go(True))
    assert outcome.endpoint == A and outcome.error == "closed", outcome
    assert 0.3 + within <= took < 0.3 + within + 0.1 * SLACK, took
