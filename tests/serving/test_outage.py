"""One outage, one wait (issue #29, points 1 and 3), from outside: a real
`ggml-coordinator serve --parallel 4` over real workers on 127.0.0.1, a real
SIGSTOP or SIGKILL of the worker holding the last stage while 4 streams run
and more requests wait for a slot, and more requests sent during the outage.
docs/failure-semantics.md, "Resuming" (the rule), docs/operations.md
(`GET /health` during and after an outage).

* Not back within --resume-within of its failure: every request waiting on
  it (the streams in flight, the requests queued for a slot, those that came
  during the outage) ends at that one moment, the outage's deadline (SSE
  error event + [DONE], or 503), not one --resume-within later per wave; no
  request is refused before it while /health says 200; after it new requests
  get 503 at once and /health is 503.
* Back (a restart 1.8 s after a kill; a spare taking over from a stopped
  worker): every request, those sent during the outage too, is served with
  the text it has alone, and /health is 200 throughout.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest

from conftest import SLACK
from http_helpers import Server, get, stream_text

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

WITHIN = 4.0  # --resume-within where the worker does not come back
WITHIN_BACK = 10.0  # where it does: ample, nothing waits for it when all goes well
PARALLEL = 4
# prompts the tiny model (tests/tiny_models.py, seed 0) runs on greedily for more than MAX_TOKENS tokens
STREAMS = ["water", "one day", "sound", "long day"]
QUEUED = ["hot word", "people"]  # sent once the 4 streams run: they wait for a slot
LATE = ["many", "first who"]  # sent 0.6 s after the fault
MAX_TOKENS = 160
ENDS_TOGETHER = 0.5  # s (times SLACK): how long after the outage's deadline every request waiting on it has ended
HANG_GUARD = 120.0  # s: a request that takes longer has hung (a guard, not a bound under test)


class Request:
    """One completion request of the schedule: when it was sent and ended (time.time(), comparable with
    /health's failed_since), its HTTP status, and its SSE events or its JSON body."""

    def __init__(self, prompt: str, stream: bool):
        self.prompt, self.stream = prompt, stream
        self.sent = self.ended = self.status = self.body = None
        self.events: list = []
        self.texted = asyncio.Event()  # a stream's first piece of text arrived

    def body_json(self) -> dict:
        return {"prompt": self.prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": self.stream}

    async def run(self, url: str) -> "Request":
        self.sent = time.time()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as s:
            async with s.post(url, json=self.body_json()) as r:
                self.status = r.status
                if self.stream and r.status == 200:
                    async for line in r.content:
                        line = line.strip()
                        if line.startswith(b"data: "):
                            payload = line[6:].decode()
                            self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                            if stream_text(self.events):
                                self.texted.set()
                else:
                    self.body = await r.json(content_type=None)
        self.ended = time.time()
        return self

    @property
    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]

    @property
    def text(self) -> str:
        return stream_text(self.events) if self.stream else self.body["choices"][0]["text"]

    def __repr__(self) -> str:
        return (f"<{self.prompt!r} stream={self.stream} status={self.status} sent={self.sent} ended={self.ended} "
                f"errors={self.errors} body={self.body}>")


class HealthLog:
    """/health polled every 0.05 s: (sent, answered, HTTP status, body) of every answer."""

    def __init__(self, url: str):
        self.url, self.seen = url + "/health", []
        self.task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            sent = time.time()
            status, body = await get(self.url)
            self.seen.append((sent, time.time(), status, body))
            await asyncio.sleep(0.05)

    async def until(self, what, timeout: float) -> tuple:
        """The first answer (sent, answered, status, body) for which `what(status, body)` is true."""
        deadline = time.monotonic() + timeout * SLACK
        checked = 0
        while time.monotonic() < deadline:
            for seen in self.seen[checked:]:
                if what(seen[2], seen[3]):
                    return seen
            checked = len(self.seen)
            await asyncio.sleep(0.01)
        raise AssertionError(f"/health never answered so within {timeout} s: {self.seen[-3:]}")

    async def stop(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


def resuming(status: int, body: dict) -> bool:
    return status == 200 and any("resuming" in r for r in body.get("reasons", []))


def failed_since(seen: list, endpoint: str) -> float:
    """When /health says `endpoint` failed (its outage began)."""
    for _, _, _, body in seen:
        for e in body.get("endpoints", []):
            if e["endpoint"] == endpoint and "failed_since" in e:
                return e["failed_since"]
    raise AssertionError(f"/health never said {endpoint} failed: {seen[-3:]}")


async def schedule(server: Server, fault, during_outage: bool = False) -> tuple[list, list, list, HealthLog]:
    """4 streams; once each has sent text, 2 requests that wait for a slot (a stream and a plain one);
    `fault()`; 0.6 s later 2 more (a stream and a plain one); with `during_outage`, one more (plain) as
    soon as /health says the stage resumes. Every request to its end; /health polled throughout."""
    url = server.url + "/v1/completions"
    streams = [Request(p, True) for p in STREAMS]
    tasks = [asyncio.create_task(r.run(url)) for r in streams]
    await asyncio.wait_for(asyncio.gather(*(r.texted.wait() for r in streams)), 30 * SLACK)
    queued = [Request(QUEUED[0], True), Request(QUEUED[1], False)]
    tasks += [asyncio.create_task(r.run(url)) for r in queued]
    await asyncio.sleep(0.1)
    health = HealthLog(server.url)
    fault()
    await asyncio.sleep(0.6)
    late = [Request(LATE[0], True), Request(LATE[1], False)]
    tasks += [asyncio.create_task(r.run(url)) for r in late]
    if during_outage:
        await health.until(resuming, 10)
        late.append(Request(STREAMS[0], False))
        tasks.append(asyncio.create_task(late[-1].run(url)))
    await asyncio.gather(*tasks)
    await asyncio.sleep(0.3)  # a few answers of /health after the last request ended
    await health.stop()
    return streams, queued, late, health




@pytest.mark.parametrize("how", ["sigstop", "sigkill"])
def test_a_worker_not_back_ends_every_waiting_request_at_its_outage_deadline(tiny_model, workers, how):
    """The worker holding the last stage stopped (its connections stay open,
    the kernel accepts new ones: the hard case) or killed, and not back.
    Every request (4 streams in flight, 2 queued for a slot, 2 sent 0.6 s
    after the fault) ends with the failure at the outage's deadline (the
    latch, /health's failed_since, plus --resume-within), none before it and
    none a wait later; /health is 200 until then and 503 from then on, and a
    new request gets 503 at once."""
    w = workers(2)
    victim = w.endpoint(1)
    server = Server([w.endpoint(0), victim], parallel=PARALLEL,
                    args=("-m", str(tiny_model), "--resume-within", str(WITHIN)))
    try:
        def fault():
            if how == "sigstop":
                w.workers[1].signal(signal.SIGSTOP)
            else:
                w.workers[1].kill()

        streams, queued, late, health = asyncio.run(schedule(server, fault))
        deadline = failed_since(health.seen, victim) + WITHIN
        every = streams + queued + late
        for r in every:
            if r.status == 200:
                assert r.stream and len(r.errors) == 1 and r.events[-1] == "[DONE]", r
                assert r.errors[0]["code"] == "ENDPOINT_FAILED" and r.errors[0]["endpoint"] == victim, r
            else:
                assert r.status == 503 and victim in r.body["error"]["message"], r
        # one outage, one wait: every request ends at its deadline, none before (refused while /health said
        # 200), none a --resume-within later (a second wait, counted from when it came to the outage)
        ends = sorted(r.ended - deadline for r in every)
        assert ends[0] >= -0.05, (ends, every)
        assert ends[-1] < ENDS_TOGETHER * SLACK, (ends, every)
        before = [(status, body) for _, answered, status, body in health.seen if answered < deadline - 0.05]
        after = [(status, body) for sent, _, status, body in health.seen if sent > deadline + 0.05]
        assert before and all(status == 200 for status, _ in before), before
        assert after and all(status == 503 and "endpoints failed" in body["reasons"] for status, body in after), after
        # past the deadline: 503 at once until the stage is back
        started = time.monotonic()
        status, text = asyncio.run(post_plain(server.url, "water"))
        assert status == 503 and f"worker {victim} unavailable" in text, text
        assert time.monotonic() - started < 0.5 * SLACK
    finally:
        server.stop()


async def post_plain(url: str, prompt: str) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as s:
        async with s.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8}) as r:
            return r.status, await r.text()


@pytest.mark.parametrize("how", ["sigkill-restart", "sigstop-spare"])
def test_requests_sent_during_an_outage_are_served_once_the_stage_is_back(tiny_model, workers, how):
    """The stage comes back within --resume-within: the worker killed and
    restarted on its port 1.8 s later, or stopped (and left stopped) with a
    spare taking its stage. The requests sent during the outage (0.6 s after
    the fault, and once /health says the stage resumes) wait like those in
    flight and are served; every request gets the text it has alone, no error
    event, no 503, and /health answers 200 throughout."""
    w = workers(3 if how == "sigstop-spare" else 2)
    args = ["-m", str(tiny_model), "--resume-within", str(WITHIN_BACK)]
    if how == "sigstop-spare":
        args += ["--spares", w.endpoint(2)]
    server = Server([w.endpoint(0), w.endpoint(1)], parallel=PARALLEL, args=tuple(args))
    try:
        url = server.url + "/v1/completions"
        want = {}
        for prompt in dict.fromkeys(STREAMS + QUEUED + LATE):
            alone = asyncio.run(Request(prompt, True).run(url))
            assert alone.status == 200 and not alone.errors, alone
            want[prompt] = alone.text

        def fault():
            if how == "sigstop-spare":
                w.workers[1].signal(signal.SIGSTOP)
            else:
                w.kill(1, restart_after=1.8)

        streams, queued, late, health = asyncio.run(schedule(server, fault, during_outage=True))
        w.join()
        for r in streams + queued + late:
            assert r.status == 200 and not r.errors, r
            assert r.text == want[r.prompt], r
            if r.stream:
                assert r.events[-1] == "[DONE]", r
        assert all(status == 200 for _, _, status, _ in health.seen), [s for s in health.seen if s[2] != 200]
        assert any(resuming(status, body) for _, _, status, body in health.seen)
        _, text = asyncio.run(get(server.url + "/metrics"))
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line and not line.startswith("#")}
        assert values["ggml_resumes_total"] >= 1, values  # the streams in flight did pause
        if how == "sigstop-spare":
            assert values["ggml_spare_takeovers_total"] == 1, values
    finally:
        server.stop()
