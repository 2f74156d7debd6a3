"""Windowed requests (rpc_daemon/request_window.py) and the failure semantics
behind a slow network: real daemons reached through bench/delay_proxy.py.

No assertion is about speed; times are only checked against detection bounds
(upper bounds that hold on a loaded machine plus slack)."""
from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import threading
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on sys.path
    sys.path.insert(0, str(ROOT))

from bench.delay_proxy import Link, ProxyThread  # noqa: E402
from conftest import SLACK  # noqa: E402
from coordinator.api import Batch, Coordinator, DecodeResult  # noqa: E402
from rpc_daemon.client import PeerFailed, RpcClient, RpcError  # noqa: E402
from rpc_daemon.request_window import HEADER_ALLOWANCE, RequestWindow  # noqa: E402
from rpc_daemon.wire.protocol import Command, Status  # noqa: E402

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

SLOW = Link(0.1, 0.03)  # the far case: 100 +- 30 ms one way
LAN = Link(0.02, 0.005)
AT_ONCE = 0.2  # s: a killed worker's socket closing, seen on loopback (docs: within ms), idle machine
PROMPT = "The capital of France is"
CHUNK = 128 << 10


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _upload(client: RpcClient, window: RequestWindow, chunks: list[bytes]) -> int:
    reply, _ = await client.request(Command.ALLOC_BUFFER, {"size": CHUNK * len(chunks)})
    buf = reply["buffer"]
    for i, chunk in enumerate(chunks):
        await window.submit(Command.SET_TENSOR, {"buffer": buf, "offset": i * CHUNK, "size": len(chunk)}, chunk)
    await window.drain()
    return buf


def test_window_pipelines_within_its_count_and_byte_bounds(daemon):
    """Through a 20 ms link: every chunk lands where it was sent, several
    requests were in flight at once, never more than the window allows."""
    chunks = [np.random.default_rng(i).bytes(CHUNK) for i in range(48)]

    async def go():
        client = await RpcClient.connect(proxy.endpoint)
        try:
            window = RequestWindow(client, max_requests=8, max_bytes=5 * (CHUNK + HEADER_ALLOWANCE))
            buf = await _upload(client, window, chunks)
            _, back = await client.request(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": CHUNK * 48})
            return window, back
        finally:
            await client.aclose()

    with ProxyThread(daemon.endpoint, LAN) as proxy:
        window, back = run(go())
    assert back == b"".join(chunks)
    assert 2 <= window.peak_requests <= 5, window.peak_requests  # the byte bound binds first here
    assert window.peak_bytes <= 5 * (CHUNK + HEADER_ALLOWANCE)


def test_window_raises_a_refused_request_and_the_connection_stays(daemon):
    async def go():
        client = await RpcClient.connect(daemon.endpoint)
        try:
            reply, _ = await client.request(Command.ALLOC_BUFFER, {"size": 4 * CHUNK})
            buf = reply["buffer"]
            window = RequestWindow(client)
            ok = await window.submit(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": 4}, b"abcd")
            await window.submit(Command.SET_TENSOR, {"buffer": buf, "offset": 4 * CHUNK, "size": 4}, b"efgh")
            with pytest.raises(RpcError) as info:
                for _ in range(4):  # the refusal surfaces from a later submit or from drain
                    await window.submit(Command.PING)
                await window.drain()
            assert info.value.status == Status.INVALID_REQUEST
            assert ok.result()[0]["status"] == Status.SUCCESS
            _, back = await client.request(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": 4})
            assert back == b"abcd" and client.failed is None
        finally:
            await client.aclose()

    run(go())


def test_window_accepts_the_statuses_it_is_told_to(daemon):
    """Hash look-ups on a daemon without a cache: every one NOT_FOUND, as a result."""
    async def go():
        client = await RpcClient.connect(daemon.endpoint)
        try:
            reply, _ = await client.request(Command.ALLOC_BUFFER, {"size": 4096})
            window = RequestWindow(client)
            where = {"buffer": reply["buffer"], "offset": 0, "size": 4096}
            tasks = [await window.submit(Command.SET_TENSOR_HASH, dict(where, hash=f"{i:064x}"),
                                         accept=(Status.NOT_FOUND,)) for i in range(10)]
            await window.drain()
            return [t.result()[0]["status"] for t in tasks]
        finally:
            await client.aclose()

    assert run(go()) == [Status.NOT_FOUND] * 10


def test_worker_killed_mid_windowed_upload_is_that_worker_closed(start_daemon):
    """SIGKILL while many SET_TENSORs are in flight behind a 100 +- 30 ms link:
    the window raises PeerFailed `closed` naming the worker, within the delay
    (plus slack) of the kill; nothing waits for the requests still in flight."""
    d = start_daemon("-t", "1")
    chunks = [bytes(CHUNK)] * 400
    killed = []

    async def go():
        client = await RpcClient.connect(proxy.endpoint)
        window = RequestWindow(client, max_requests=16)
        try:
            async def kill_when_the_window_is_full():
                for _ in range(1000):  # bounded: 10 s
                    if window.peak_requests >= 16:
                        break
                    await asyncio.sleep(0.01)
                killed.append(time.monotonic())
                os.killpg(d.proc.pid, signal.SIGKILL)
            killer = asyncio.ensure_future(kill_when_the_window_is_full())
            with pytest.raises(PeerFailed) as info:
                await _upload(client, window, chunks)
            await killer
            assert window.peak_requests >= 16
            return info.value, time.monotonic()
        finally:
            await client.aclose()

    with ProxyThread(d.endpoint, SLOW) as proxy:
        failure, seen = run(go())
    assert failure.kind == "closed" and proxy.endpoint in failure.message, failure.message
    assert seen - killed[0] <= (SLOW.delay + SLOW.jitter + AT_ONCE) * SLACK, seen - killed[0]


@pytest.fixture
def slow_pair(start_daemon):
    """Two workers, each behind a 100 +- 30 ms link with rare 0.25 s stalls;
    B's second compute takes 3 s (the daemon answers pings meanwhile)."""
    a = start_daemon("-t", "1")
    b = start_daemon("-t", "1", "--test-fault", "cmd=GRAPH_COMPUTE|GRAPH_RECOMPUTE,after=1,point=reply,action=delay:3")
    link = Link(SLOW.delay, SLOW.jitter, stall_prob=0.02, stall=0.25)
    with ProxyThread(a.endpoint, link, seed=1) as pa, ProxyThread(b.endpoint, link, seed=2) as pb:
        yield a, b, pa, pb


def test_generation_behind_100ms_completes_without_a_latch(tiny_model, slow_pair):
    """The default liveness bound (2 s) behind 100 +- 30 ms with stalls and a
    3 s compute: the text is the one generated without the proxies, nothing
    latched, and the long compute was bridged by pings."""
    a, b, pa, pb = slow_pair
    with Coordinator([pa.endpoint, pb.endpoint], model=tiny_model, split=[1, 1], n_ctx=64) as c:
        slow = c.generate(PROMPT, max_tokens=4)
        assert c.failed_endpoints() == [] and c.health()["status"] == "ok"
        assert c._places[1].executor.client.pings_sent >= 2  # the 3 s compute was watched, not given up
    with Coordinator([a.endpoint, b.endpoint], model=tiny_model, split=[1, 1], n_ctx=64) as c:
        assert c.generate(PROMPT, max_tokens=4) == slow


def test_worker_killed_behind_100ms_is_that_worker_within_the_bound(tiny_model, slow_pair):
    """A worker SIGKILLed between decodes, behind the proxy: latched as that
    worker, kind `closed`, within the documented bound plus the one-way delay;
    the next decode fails fast with ENDPOINT_FAILED naming it."""
    a, b, pa, pb = slow_pair
    with Coordinator([pa.endpoint, pb.endpoint], model=tiny_model, split=[1, 1], n_ctx=64) as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error
        killed = time.monotonic()
        b.kill()
        deadline = killed + (SLOW.delay + SLOW.jitter + 0.25 + AT_ONCE) * SLACK  # + one stall
        while not c.failed_endpoints() and time.monotonic() < deadline + 5:
            time.sleep(0.01)
        latched = time.monotonic()
        failed = c.failed_endpoints()
        assert [(f.endpoint, f.kind) for f in failed] == [(pb.endpoint, "closed")], failed
        assert latched <= deadline, latched - killed
        assert c.decode(Batch.single([5], len(ids))) is DecodeResult.ENDPOINT_FAILED
        assert c.last_failed_endpoint == pb.endpoint and c.last_cause == "closed"


def test_worker_stopped_behind_100ms_times_out_within_the_bound_plus_the_delay(tiny_model, slow_pair):
    """SIGSTOP 0.5 s into B's 3 s compute (pings answered until then), behind
    the proxy, with a 1 s bound: `timeout`, as that worker, no sooner than the
    bound minus one ping interval after the stop and no later than the bound
    plus the delay, a stall and slack."""
    a, b, pa, pb = slow_pair
    bound = 1.0
    # head_split off: one GRAPH_COMPUTE on B per decode, so the fault's 2nd compute is decode 2's
    with Coordinator([pa.endpoint, pb.endpoint], model=tiny_model, split=[1, 1], n_ctx=64,
                     liveness_timeout=bound, head_split=False) as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error  # B's compute 1
        stopped = []

        def stop_when_computing():
            b.wait_log("test fault fired", timeout=30)
            time.sleep(0.5)
            stopped.append(time.monotonic())
            b.signal(signal.SIGSTOP)

        stopper = threading.Thread(target=stop_when_computing)
        stopper.start()
        try:
            code = c.decode(Batch.single([5], len(ids)))  # B's compute 2: the 3 s one
            detected = time.monotonic() - stopped[0]
        finally:
            stopper.join(35)
        assert code is DecodeResult.ENDPOINT_FAILED and c.last_cause == "timeout", c.last_error
        assert c.last_failed_endpoint == pb.endpoint
        assert bound * 0.75 - 0.1 <= detected <= (bound + SLOW.delay + SLOW.jitter + 0.25) * SLACK, detected
