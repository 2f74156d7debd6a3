"""Fault semantics end to end (docs/failure-semantics.md), with real processes.

The fault matrix runs one coordinator over two workers, A (stage 0) and B
(stage 1). With the output head split (head_split=True: the default "auto"
may take it whole) each answers two graph requests per decode: its layers, then its share of the logits, B's and A's at
the same time; the `after=` counts below are of B's. Only B is ever faulted; it is
restarted on the same port for every repetition with a `--test-fault` spec
that starts disarmed. Each repetition first checks recovery (reconnect, re-feed
the prompt, same greedy text as the undisturbed run), then arms the fault with
SIGUSR1 and drives decodes into it:

    faults: kill -9 (the daemon SIGKILLs itself and its compute process),
            SIGSTOP (the daemon stops itself), the worker closes the socket;
    phases: weight upload (during reconnect()), GRAPH_COMPUTE of B's layers
            (while the compute process works), of its share of the output
            head (while A computes its share too), the logits reply in flight
            (half of it sent).

The coordinator runs in this process, so a crash of it would end the run.
A subprocess variant runs with SIGPIPE at its default action.
"""
from __future__ import annotations

import asyncio
import signal
import socket
import statistics
import struct
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import numpy as np
import pytest

from conftest import SLACK, DaemonProcess, free_port
from fault_checks import check_latched, fault_fired_at
from coordinator.api import Batch, Coordinator, DecodeError, DecodeResult, EndpointUnavailable
from rpc_daemon.wire import framing as F
from rpc_daemon.wire import protocol as P
from rpc_daemon.client import PeerFailed, RpcClient
from rpc_daemon.wire.protocol import Command, Status
from rpc_helpers import N, assert_served, chain_graph

from tiny_models import write_tiny_llama

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

OK, ENDPOINT_FAILED, COMPUTE_FAILED = DecodeResult.OK, DecodeResult.ENDPOINT_FAILED, DecodeResult.COMPUTE_FAILED
LIVENESS = 1.0  # the matrix's detection bound (the default bound, 2 s, has a test of its own)
AT_ONCE = 0.2  # s: detection of a killed worker or a closed socket (docs: within ms), idle machine
CONNECT_TIMEOUT = 5.0  # Coordinator's default connect_timeout, which the rig keeps
PROMPT = "The capital of France is"
N_GEN = 8
N_CTX = 64
REPS = 5
GRAPH_CMDS = "GRAPH_COMPUTE|GRAPH_RECOMPUTE"
UPLOAD_CMDS = "SET_TENSOR|SET_TENSOR_HASH"


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", seed=0)


def greedy(c: Coordinator, n: int, prompt: str = PROMPT) -> list[int]:
    """Greedy token ids after `prompt`, by hand, from an empty sequence 0."""
    c.kv_seq_rm(0)
    ids = c.tokenize(prompt)
    assert c.decode(Batch.single(ids, 0)) is OK, c.last_error
    out, pos = [], len(ids)
    for _ in range(n):
        out.append(int(c.logits(-1).argmax()))
        assert c.decode(Batch.single([out[-1]], pos)) is OK, c.last_error
        pos += 1
    return out


class Rig:
    """Workers A (stable) and B (faulted, restarted on its port) and one coordinator."""

    def __init__(self, model, cache_dir):
        self.model, self.cache_dir = model, str(cache_dir)
        self.a = DaemonProcess("-t", "1", "--cache", self.cache_dir)
        self.b = DaemonProcess("-t", "1", "--cache", self.cache_dir)
        self.port_b = self.b.port
        self.b_faulted = False
        self.c = Coordinator([self.a.endpoint, self.b.endpoint], model=model, split=[1, 1], n_ctx=N_CTX, head_split=True,
                             liveness_timeout=LIVENESS)
        self.baseline_text = self.c.generate(PROMPT, max_tokens=N_GEN)
        self.baseline_ids = greedy(self.c, N_GEN)
        self.detections: dict[str, list[float]] = {}

    @property
    def eb(self) -> str:
        return self.b.endpoint

    def restart_b(self, *faults: str) -> None:
        self.b.kill()  # SIGKILL to the process group: works on a stopped daemon too
        args = ["-t", "1", "--cache", self.cache_dir]
        for f in faults:
            args += ["--test-fault", f + ",armed=0"]
        self.b = DaemonProcess(*args, port=self.port_b)
        self.b_faulted = bool(faults)

    def settle(self) -> None:
        """Undo what a failed test left behind (B faulted or dead, B latched, a sequence to
        re-feed), so that one failure is reported once, not again by every test after it."""
        if self.b_faulted or not self.b.alive():
            self.restart_b()
            self.c.reconnect(self.eb)  # the old B's end may not have reached the coordinator yet
        if self.c.failed_endpoints():
            self.c.reconnect()
        if self.c.needs_refeed():
            self.c.kv_seq_rm(-1)
            self.c.generate(PROMPT, max_tokens=1)  # sequence 0 filled, as the tests leave it

    def arm(self) -> None:
        mark = len(self.b.log_lines)
        self.b.signal(signal.SIGUSR1)
        self.b.wait_log("test fault armed", start=mark)

    def fault_time(self) -> float:
        return fault_fired_at(self.b)

    def recover(self, expect_lost=(0,)) -> None:
        """reconnect() + re-feed the prompt: the undisturbed run's greedy text."""
        lost = self.c.reconnect(self.eb)
        assert lost == list(expect_lost), lost
        assert self.c.failed_endpoints() == []
        assert self.c.generate(PROMPT, max_tokens=N_GEN) == self.baseline_text
        assert self.c.needs_refeed() == []

    def clients(self):
        return [p.executor.client for p in self.c._places if p.executor is not None]

    def close(self) -> None:
        self.c.close()
        for d in (self.a, self.b):
            d.stop()
            d.kill()


@pytest.fixture(scope="module")
def module_rig(model, tmp_path_factory):
    r = Rig(model, tmp_path_factory.mktemp("tensor-cache"))
    yield r
    r.close()
    if r.detections:
        print("\ndetection latency (s) from the fault to decode/reconnect returning:")
        for cell, xs in sorted(r.detections.items()):
            print(f"  {cell:<16} median {statistics.median(xs):.3f} max {max(xs):.3f} (n={len(xs)})")


@pytest.fixture
def rig(module_rig):
    module_rig.settle()
    return module_rig


# ---------------------------------------------------------------- the matrix

FAULTS = {  # name: (action, the kind of failure the coordinator must report, detection bound)
    "kill9": ("kill", "closed", None),
    "sigstop": ("stop", "timeout", LIVENESS),
    "close": ("close", "closed", None),
}
PHASES = {  # name: fault spec without the action; B's graph requests 4 and 5 are the third decode's
    "upload": f"cmd={UPLOAD_CMDS},after=3,point=request",
    "compute": f"cmd={GRAPH_CMDS},after=4,point=compute",
    "head": f"cmd={GRAPH_CMDS},after=5,point=compute",
    "reply": f"cmd={GRAPH_CMDS},after=5,point=half",
}


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_matrix(rig, fault, phase):
    action, kind, bound = FAULTS[fault]
    spec = f"{PHASES[phase]},action={action}"
    limit = (bound or AT_ONCE) * SLACK
    c = rig.c
    for rep in range(REPS):
        rig.restart_b(spec)
        rig.recover()  # also the recovery check of the previous repetition
        rig.arm()
        if phase == "upload":
            t0 = time.perf_counter()
            with pytest.raises(EndpointUnavailable) as info:
                c.reconnect(rig.eb)  # fresh connection, weights uploaded again: the fault hits that
            took = time.perf_counter() - t0
            assert info.value.endpoint == rig.eb and info.value.kind == kind, info.value
            assert rig.eb in str(info.value)
            detected = time.time() - rig.fault_time()  # reconnect returned just now
            pos = 3
        else:
            ids = c.tokenize(PROMPT)
            c.kv_seq_rm(0)  # recover() left its text there
            assert c.decode(Batch.single(ids, 0)) is OK  # graph request 1 on B
            pos, tok = len(ids), int(c.logits(-1).argmax())
            assert c.decode(Batch.single([tok], pos)) is OK  # 2
            assert int(c.logits(-1).argmax()) == rig.baseline_ids[1]
            pos, tok = pos + 1, int(c.logits(-1).argmax())
            t0 = time.perf_counter()
            code = c.decode(Batch.single([tok], pos))  # 3: the fault
            took = time.perf_counter() - t0
            assert code is ENDPOINT_FAILED, (code, c.last_error)
            assert c.last_cause == kind and c.last_failed_endpoint == rig.eb
            detected = time.time() - rig.fault_time()
        rig.detections.setdefault(f"{fault}/{phase}", []).append(detected)
        assert detected <= limit and took <= limit + 0.5 * SLACK, (detected, took, limit)
        if bound:  # it was the liveness bound that caught it, not something else
            assert detected >= bound * 0.8, detected
        check_latched(rig.c, rig.eb, pos, kind, LIVENESS)
    rig.restart_b()
    rig.recover()


# ---------------------------------------------------------------- around the matrix

def test_generate_raises_and_emits_nothing_from_the_failed_step(rig):
    """stream() yields the pieces of good steps only, then DecodeError with the
    code, the endpoint and the cause."""
    c = rig.c
    rig.restart_b(f"cmd={GRAPH_CMDS},after=4,point=half,action=kill")
    rig.recover()
    rig.arm()
    pieces = []
    with pytest.raises(DecodeError) as info:
        for piece in c.stream(PROMPT, max_tokens=N_GEN):
            pieces.append(piece)
    e = info.value
    assert e.code is ENDPOINT_FAILED and e.endpoint == rig.eb and e.cause == "closed"
    assert "closed the connection" in e.message and rig.eb in str(e)
    assert rig.baseline_text.startswith("".join(pieces))
    # latched: generate fails at once with the same cause
    with pytest.raises(DecodeError) as again:
        c.generate(PROMPT, max_tokens=2)
    assert again.value.code is ENDPOINT_FAILED and again.value.cause == "closed"
    rig.restart_b()
    rig.recover(expect_lost=())  # generate() started sequence 0 over: nothing left to re-feed


def test_refeed_required_after_reconnect(rig):
    """Continuing a sequence whose KV cache died with the worker would attend to
    nothing: refused until it is re-fed from position 0."""
    c = rig.c
    ids = c.tokenize(PROMPT)
    c.kv_seq_rm(0)
    assert c.decode(Batch.single(ids, 0)) is OK
    rig.b.kill()
    assert c.decode(Batch.single([5], len(ids))) is ENDPOINT_FAILED
    rig.restart_b()
    assert c.reconnect() == [0] and c.needs_refeed() == [0]
    assert c.decode(Batch.single([5], len(ids))) is DecodeResult.INVALID_BATCH
    assert "re-feed" in c.last_error
    assert c.decode(Batch.single(ids, 0)) is OK
    assert c.needs_refeed() == []
    assert greedy(c, N_GEN) == rig.baseline_ids


@pytest.mark.parametrize("how", ["crash-compute", "fail"])
def test_compute_failure_keeps_the_connection(rig, how):
    """A worker that reports a failed compute (here: its compute process killed,
    or an injected FAILED reply) costs one COMPUTE_FAILED; nothing latches, and
    retrying the same batch on the same connection continues the text."""
    c = rig.c
    point = "compute" if how == "crash-compute" else "reply"
    rig.restart_b(f"cmd={GRAPH_CMDS},after=2,point={point},action={how}")
    rig.recover()
    rig.arm()
    client = rig.clients()[1]
    ids = c.tokenize(PROMPT)
    c.kv_seq_rm(0)  # recover() left its text there
    assert c.decode(Batch.single(ids, 0)) is OK
    toks, pos = [], len(ids)
    failures = 0
    while len(toks) < N_GEN:
        toks.append(int(c.logits(-1).argmax()))
        code = c.decode(Batch.single([toks[-1]], pos))
        while code is COMPUTE_FAILED:
            failures += 1
            assert "compute failed" in c.last_error and c.last_failed_endpoint == rig.eb, c.last_error
            assert c.failed_endpoints() == [] and c.health()["status"] == "ok"
            with pytest.raises(RuntimeError):
                c.logits(-1)
            code = c.decode(Batch.single([toks[-1]], pos))  # the same step again
        assert code is OK, (code, c.last_error)
        pos += 1
    assert failures == 1
    assert toks == rig.baseline_ids
    assert rig.clients()[1] is client and client.failed is None
    if how == "crash-compute":
        assert any("compute process" in line and "SIGKILL" in line for line in rig.b.log_lines)
    rig.restart_b(f"cmd={GRAPH_CMDS},after=3,point=reply,action=fail")  # the second decode's logits
    rig.recover()
    rig.arm()
    with pytest.raises(DecodeError) as info:  # through generate: the cause is named
        c.generate(PROMPT, max_tokens=N_GEN)
    assert info.value.code is COMPUTE_FAILED and info.value.cause == "compute"
    assert "compute failed" in str(info.value) and info.value.endpoint == rig.eb
    rig.restart_b()
    rig.recover()


def test_no_kv_slot_means_context_full(rig):
    c = rig.c
    c.kv_clear()
    assert c.decode(Batch.single(list(range(10, 10 + N_CTX)), 0)) is OK
    assert c.decode(Batch.single([5], N_CTX)) is DecodeResult.NO_KV_SLOT
    assert c.last_error.startswith("context full") and c.last_cause == "context_full"
    assert c.failed_endpoints() == []
    with pytest.raises(DecodeError) as info:
        c.generate(PROMPT, max_tokens=N_CTX)
    assert info.value.code is DecodeResult.NO_KV_SLOT and "context full" in str(info.value)
    c.kv_clear()
    assert c.generate(PROMPT, max_tokens=N_GEN) == rig.baseline_text


def test_long_compute_is_not_a_timeout(rig):
    """A reply delayed 2.5 x the liveness bound by a slow (but alive) worker: the
    client keeps pinging, the daemon's event loop keeps answering, decode is OK."""
    c = rig.c
    rig.restart_b(f"cmd={GRAPH_CMDS},after=1,point=reply,action=delay:{LIVENESS * 2.5}")
    rig.recover()
    rig.arm()
    client = rig.clients()[1]
    pings = client.pings_sent
    t0 = time.perf_counter()
    assert greedy(c, N_GEN) == rig.baseline_ids
    assert time.perf_counter() - t0 >= LIVENESS * 2.5
    assert client.pings_sent - pings >= 3 and client.failed is None


def test_sigstop_detected_within_the_default_bound(rig, model):
    """The default bound (2 s) holds even while a long compute is in progress:
    the worker is stopped 0.5 s into a reply delayed by 5 s."""
    rig.restart_b(f"cmd={GRAPH_CMDS},after=2,point=reply,action=delay:5")  # the second decode's layers
    c2 = Coordinator([rig.a.endpoint, rig.b.endpoint], model=model, split=[1, 1], n_ctx=N_CTX, head_split=True)
    try:
        bound = c2.config.liveness_timeout
        assert bound <= 2.0
        rig.arm()
        ids = c2.tokenize(PROMPT)
        assert c2.decode(Batch.single(ids, 0)) is OK
        mark = len(rig.b.log_lines)
        stopped = []

        def stop_when_delaying():
            rig.b.wait_log("test fault fired", start=mark)
            time.sleep(0.5)
            stopped.append(time.monotonic())
            rig.b.signal(signal.SIGSTOP)

        t = threading.Thread(target=stop_when_delaying)
        t.start()
        code = c2.decode(Batch.single([5], len(ids)))
        detected = time.monotonic() - stopped[0]
        t.join()
        assert code is ENDPOINT_FAILED and c2.last_cause == "timeout", c2.last_error
        assert "timed out" in c2.last_error
        # the last pong came at most one ping interval (bound / 4) before the stop
        assert bound * 0.75 - 0.1 <= detected <= bound * SLACK, detected
    finally:
        c2.close()
        rig.restart_b()
        rig.recover()


def test_auto_reconnect(rig):
    c = rig.c
    c.set_auto_reconnect(True, backoff=(0.05, 0.4))
    try:
        ids = c.tokenize(PROMPT)
        c.kv_seq_rm(0)
        assert c.decode(Batch.single(ids, 0)) is OK
        rig.b.kill()
        assert c.decode(Batch.single([5], len(ids))) is ENDPOINT_FAILED
        time.sleep(0.6)  # a few attempts against a closed port
        h = c.health()
        assert h["status"] == "reconnecting" and h["endpoints"][1]["attempts"] >= 2, h
        assert c.decode(Batch.single([5], len(ids))) is ENDPOINT_FAILED  # still fast-failing meanwhile
        rig.restart_b()
        assert c.wait_healthy(10.0), c.health()
        assert c.needs_refeed() == [0] and c.health()["status"] == "ok"
        assert c.decode(Batch.single([5], len(ids))) is DecodeResult.INVALID_BATCH
        assert c.generate(PROMPT, max_tokens=N_GEN) == rig.baseline_text
    finally:
        c.set_auto_reconnect(False)
        rig.recover()


def test_reconnect_to_a_dead_worker_keeps_the_latch(rig):
    c = rig.c
    rig.b.kill()
    t0 = time.perf_counter()
    with pytest.raises(EndpointUnavailable) as info:
        c.reconnect(rig.eb)
    # refused at once: not a connect timeout (5 s, the coordinator's default) nor retries, whatever the slack
    assert time.perf_counter() - t0 < min(CONNECT_TIMEOUT / 2 * SLACK, 0.9 * CONNECT_TIMEOUT)
    assert info.value.kind == "unreachable" and "refused" in str(info.value) and rig.eb in str(info.value)
    [f] = c.failed_endpoints()
    assert f.endpoint == rig.eb and f.kind == "unreachable"
    assert c.decode(Batch.single([5], 0)) is ENDPOINT_FAILED and c.last_cause == "unreachable"
    with pytest.raises(EndpointUnavailable):
        c.reconnect(rig.eb)  # another failed attempt: the cause is the latest, the time the first failure's
    [g] = c.failed_endpoints()
    assert g.since == f.since and g.kind == "unreachable"
    rig.restart_b()
    rig.recover()


# ---------------------------------------------------------------- construction

def test_daemon_never_started(model):
    endpoint = f"127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError) as info:
        Coordinator([endpoint], model=model, n_ctx=N_CTX)
    assert time.perf_counter() - t0 < min(2.0 * SLACK, 0.9 * CONNECT_TIMEOUT)  # not the connect timeout
    assert endpoint in str(info.value) and "refused" in str(info.value)
    assert isinstance(info.value, EndpointUnavailable) and info.value.endpoint == endpoint


class FakeServer:
    """A tiny asyncio server on 127.0.0.1 that misbehaves in one way."""

    def __init__(self, mode: str):
        self.mode = mode
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        assert self.ready.wait(5)

    def _main(self):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _client(self, reader, writer):
        try:
            if self.mode == "garbage":
                writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" * 4)
                await writer.drain()
                await asyncio.sleep(30)
                return
            prefix = await reader.readexactly(F.PREFIX.size)
            header_len, blob_len = F.PREFIX.unpack(prefix)
            header = msgpack.unpackb(await reader.readexactly(header_len))
            await reader.readexactly(blob_len)
            if self.mode == "version":
                reply = P.reply_header(header["id"], Status.VERSION_MISMATCH,
                                       f"protocol version {header['version']} not supported; this daemon speaks 99",
                                       version=99)
                writer.write(F.encode_frame(reply))
                await writer.drain()
                writer.close()
            elif self.mode == "silent":
                await asyncio.sleep(30)
            elif self.mode in ("hangup", "reset"):  # a peer of another protocol: it hangs up on our HELLO
                if self.mode == "reset":  # RST, as a peer does that closes with our bytes unread
                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                                struct.pack("ii", 1, 0))
                writer.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.port}"

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.mark.parametrize("mode, fragment, kind", [
    ("version", "is incompatible: protocol version", "protocol"),
    ("garbage", "sent a bad frame", "protocol"),
    ("silent", "did not answer HELLO", "timeout"),
    ("hangup", "probably not a ggml-distributed worker: it hung up on our HELLO (EOF), as llama.cpp's", "closed"),
    ("reset", "probably not a ggml-distributed worker: it hung up on our HELLO (connection reset by peer), as",
     "closed"),
])
def test_wrong_peer_is_a_clear_error(model, mode, fragment, kind):
    fake = FakeServer(mode)
    try:
        t0 = time.perf_counter()
        with pytest.raises(EndpointUnavailable) as info:
            Coordinator([fake.endpoint], model=model, n_ctx=N_CTX, connect_timeout=1.0)
        assert time.perf_counter() - t0 < 2.5 * SLACK
        assert fake.endpoint in str(info.value) and fragment in str(info.value), str(info.value)
        assert info.value.kind == kind
    finally:
        fake.close()


def test_a_worker_that_lies_about_a_reply_size_is_latched_as_a_protocol_error(model):
    """A worker (scripted, on a real socket: it speaks HELLO and takes the
    weights) answers the step's GRAPH_COMPUTE with a prefix claiming 1 GiB of
    data, far above the logits the graph's outputs make: ENDPOINT_FAILED at
    once, kind protocol, naming the worker, the claim and the bound; the
    endpoint latched (the next decode fails fast); and the coordinator
    allocated nothing near the lie (it used to allocate the whole GiB and then
    wait for it)."""
    import tracemalloc

    from coordinator.cluster.executors import GRAPH_OPS
    from rpc_helpers import FakeWorker

    GiB = 1 << 30

    def answer(h, blob):
        if h.get("cmd") in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE):
            reply = P.reply_header(h["id"], Status.SUCCESS, outputs=[[h["outputs"][0], 0, GiB]], compute_us=1)
            return F.encode_frame(reply, GiB) + bytes(4096)
        return FakeWorker.default_answer(worker, h, blob)

    worker = FakeWorker(answer, ops=GRAPH_OPS)
    try:
        with Coordinator([worker.endpoint], model=model, n_ctx=N_CTX, liveness_timeout=LIVENESS) as c:
            ids = c.tokenize(PROMPT)
            tracemalloc.start()
            try:
                t0 = time.perf_counter()
                code = c.decode(Batch.single(ids, 0))
                took = time.perf_counter() - t0
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert code is ENDPOINT_FAILED, (code, c.last_error)
            assert (c.last_failed_endpoint, c.last_cause) == (worker.endpoint, "protocol"), c.last_error
            for fragment in (worker.endpoint, f"{GiB} bytes of data", "GRAPH_COMPUTE", "nothing was allocated"):
                assert fragment in c.last_error, c.last_error
            assert [(f.endpoint, f.kind) for f in c.failed_endpoints()] == [(worker.endpoint, "protocol")]
            assert took < 1.0 * SLACK, took  # at once: not the liveness bound, nor a wait for the GiB
            assert peak < 64 << 20, f"{peak} bytes allocated for a reply that claimed {GiB}"
            sent = len(worker.requests)
            assert c.decode(Batch.single(ids, 0)) is ENDPOINT_FAILED and len(worker.requests) == sent  # latched
    finally:
        worker.close()


# ---------------------------------------------------------------- client and daemon level

async def load_chain(c: RpcClient, steps: int):
    h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 2 * N * N * 4})
    buf = h["buffer"]
    x0 = np.random.default_rng(3).standard_normal((N, N)).astype(np.float32)
    data = np.eye(N, dtype=np.float32).tobytes() + x0.tobytes()
    await c.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": len(data)}, data)
    tensors, iz = chain_graph(buf, steps)
    return buf, tensors, iz, x0


def test_head_round_failures_latch_every_endpoint(model, start_daemon):
    """Both workers die while computing their shares of the output head: the
    decode reports the first, and both are latched (none is left looking healthy)."""
    spec = f"cmd={GRAPH_CMDS},after=5,point=compute,action=kill"  # the third decode's head, on each
    a = start_daemon("-t", "1", "--test-fault", spec)
    b = start_daemon("-t", "1", "--test-fault", spec)
    # the relayed head round, where both shards always compute; in a linked step a shard whose input
    # was cancelled (the other worker died first) does not compute at all (tests/coordinator/test_step_links.py)
    with Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=N_CTX, head_split=True, step_links=False) as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is OK
        assert c.decode(Batch.single([5], len(ids))) is OK
        assert c.decode(Batch.single([6], len(ids) + 1)) is ENDPOINT_FAILED
        assert c.last_failed_endpoint == a.endpoint and c.last_cause == "closed", c.last_error
        assert [f.endpoint for f in c.failed_endpoints()] == [a.endpoint, b.endpoint]
        assert all(f.kind == "closed" for f in c.failed_endpoints())
        assert c.health()["status"] == "failed" and c.needs_refeed() == [0]
        with pytest.raises(RuntimeError):
            c.logits(-1)


def test_a_busy_loop_here_is_not_a_silent_worker(start_daemon):
    """This process's event loop blocked for 1 s (as a large step's logits checked on it) during a
    real compute of about a second, against a liveness bound of 0.3 s: the pongs the daemon sent in
    time sit unread meanwhile, and the watchdog's late tick looks again after reading them instead
    of declaring the worker silent (it did: 'sent nothing for 1.0 s'). A worker that is silent is
    still caught: test_stopped_daemon_blocks_large_send and the fault matrix."""
    d = start_daemon("-t", "1")

    async def scenario():
        c = await RpcClient.connect(d.endpoint, liveness_timeout=0.3)
        try:
            _, tensors, iz, x0 = await load_chain(c, steps=40)
            fut = asyncio.ensure_future(c.request(Command.GRAPH_COMPUTE, {"tensors": tensors, "outputs": [iz]}))
            await asyncio.sleep(0.1)  # the request is out, the watchdog armed
            time.sleep(1.0)  # the loop blocked: no read, no tick, for 3 liveness bounds
            h, out = await fut
            assert np.array_equal(np.frombuffer(out, np.float32).reshape(N, N), x0)
            return c.pings_sent
        finally:
            await c.aclose()

    assert run(scenario()) >= 1


async def answer_after_50_ms(reader, writer):
    """A worker that answers every request 50 ms after reading it (SUCCESS, no fields)."""
    try:
        while True:
            header_len, blob_len = F.PREFIX.unpack(await reader.readexactly(F.PREFIX.size))
            header = msgpack.unpackb(await reader.readexactly(header_len))
            await reader.readexactly(blob_len)
            await asyncio.sleep(0.05)
            writer.write(F.encode_frame(P.reply_header(header["id"], Status.SUCCESS, "")))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass


def test_a_busy_loop_between_pings_is_not_a_silent_worker():
    """A step over a step channel: the coordinator PINGs the daemon connection with silence counted
    from the step's start (executors.keep_pinging), nothing else pending there. This loop blocked for
    0.6 s (2 liveness bounds) between two PINGs; the second, answered in 50 ms, must not find the
    worker silent (it failed 0.2 ms after it went out: 'sent nothing for 0.6 s'): silence counts from
    at most a ping interval before a request goes out."""
    from rpc_daemon.service.loop import run as run_on_uvloop  # the coordinator's loop kind

    async def scenario():
        server = await asyncio.start_server(answer_after_50_ms, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, c = await asyncio.get_running_loop().create_connection(
            lambda: RpcClient(f"127.0.0.1:{port}", 0.3, None, P.Limits()), "127.0.0.1", port)
        c.keepalive_interval = 5.0  # as connect() sets it from a HELLO's idle_timeout
        try:
            started = time.monotonic()
            await c.request(Command.PING, silent_since=started)
            time.sleep(0.6)
            await c.request(Command.PING, silent_since=started)
        finally:
            await c.aclose()
            server.close()

    run_on_uvloop(scenario())


def test_real_long_compute_with_a_short_bound(start_daemon):
    """A real compute of about a second against a liveness bound of 0.3 s: the
    daemon's event loop answers the pings while its compute process works."""
    d = start_daemon("-t", "1")

    async def scenario():
        c = await RpcClient.connect(d.endpoint, liveness_timeout=0.3)
        try:
            _, tensors, iz, x0 = await load_chain(c, steps=40)
            t0 = time.monotonic()
            h, out = await c.request(Command.GRAPH_COMPUTE, {"tensors": tensors, "outputs": [iz]})
            took = time.monotonic() - t0
            assert np.array_equal(np.frombuffer(out, np.float32).reshape(N, N), x0)
            return took, c.pings_sent
        finally:
            await c.aclose()

    took, pings = run(scenario())
    assert took > 0.6, f"compute too short ({took:.2f} s) to show anything"
    assert pings >= 2


def test_stopped_worker_while_sending(start_daemon):
    """SIGSTOP, then a 64 MiB SET_TENSOR: the kernel buffers fill, the send
    stalls, and the stall is detected within the bound (no reply is even due)."""
    d = start_daemon("-t", "1")

    async def scenario():
        c = await RpcClient.connect(d.endpoint, liveness_timeout=0.5)
        h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 64 << 20})
        d.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            await c.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": 64 << 20},
                            bytes(64 << 20))
        except PeerFailed as exc:
            return exc, time.monotonic() - t0
        finally:
            await c.aclose()
        raise AssertionError("SET_TENSOR to a stopped daemon succeeded")

    exc, took = run(scenario())
    d.signal(signal.SIGCONT)
    assert exc.kind == "timeout" and "took nothing" in exc.message, exc.message
    assert 0.4 <= took <= 0.5 * SLACK, took
    assert_served(d)


def test_client_vanishing_mid_request_frees_its_buffers(start_daemon):
    """A client gone while its compute runs: once the compute ends the daemon
    frees its buffers, and the next client gets all the memory and is served."""
    d = start_daemon("-t", "1", "-m", "17")
    cap = 17 << 20

    async def free_memory(c):
        h, _ = await c.request(Command.DEVICE_INFO)
        return h["free_memory"]

    async def scenario():
        gone = await RpcClient.connect(d.endpoint)
        _, tensors, iz, _ = await load_chain(gone, steps=30)
        fut = asyncio.ensure_future(gone.request(Command.GRAPH_COMPUTE, {"tensors": tensors, "outputs": [iz]}))
        await asyncio.sleep(0.3)  # the compute is under way
        gone.transport.abort()  # vanish: RST, no goodbye
        with pytest.raises(PeerFailed):
            await fut
        await gone.aclose()
        watcher = await RpcClient.connect(d.endpoint)
        try:
            deadline = time.monotonic() + 15 * SLACK
            while await free_memory(watcher) != cap:
                assert time.monotonic() < deadline, "the vanished client's buffers were not freed"
                await asyncio.sleep(0.05)
            # 8 MiB of buffers and 8 MiB of intermediates: all of the cap but 1 MiB
            _, tensors, iz, x0 = await load_chain(watcher, steps=2)
            h, out = await watcher.request(Command.GRAPH_COMPUTE, {"tensors": tensors, "outputs": [iz]})
            assert np.array_equal(np.frombuffer(out, np.float32).reshape(N, N), x0)
        finally:
            await watcher.aclose()

    run(scenario())
    assert_served(d)
    assert any("client disconnected" in line for line in d.log_lines)


# ---------------------------------------------------------------- a subprocess with SIGPIPE at its default

SUBPROCESS = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a crash by SIGPIPE would now be visible
    from coordinator.api import Batch, Coordinator, DecodeResult, EndpointUnavailable
    model, ea, eb, pid_b = sys.argv[1] or None, sys.argv[2], sys.argv[3], int(sys.argv[4])
    c = Coordinator([ea, eb], model=model, split=[1, 1], n_ctx=64, head_split=True, liveness_timeout=1.0)
    async def mask():
        return signal.pthread_sigmask(signal.SIG_BLOCK, [])
    blocked = c._run(mask())
    print("sigpipe blocked on the I/O thread:", signal.SIGPIPE in blocked)
    ids = c.tokenize("The capital of France is")
    codes = [c.decode(Batch.single(ids, 0))]
    pos = len(ids)
    while codes[-1] == DecodeResult.OK and pos < 40:
        codes.append(c.decode(Batch.single([int(c.logits(-1).argmax())], pos)))
        pos += 1
    print("codes:", [int(x) for x in codes])
    try:
        c.reconnect(eb)
    except EndpointUnavailable as exc:  # the dead worker's port: refused (or reset, racing its exit)
        print("reconnect failed:", exc.kind in ("unreachable", "closed"))
    c.close()
    print("survived")
""")


@pytest.mark.parametrize("spec", [f"cmd={GRAPH_CMDS},after=7,point=half,action=kill",  # the 4th decode: logits
                                  f"cmd={GRAPH_CMDS},after=6,point=compute,action=exit"])  # its layers
def test_coordinator_process_survives_with_default_sigpipe(model, start_daemon, spec):
    a = start_daemon("-t", "1")
    b = start_daemon("-t", "1", "--test-fault", spec)
    proc = subprocess.run([sys.executable, "-c", SUBPROCESS, str(model or ""), a.endpoint, b.endpoint,
                           str(b.proc.pid)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "sigpipe blocked on the I/O thread: True" in proc.stdout
    assert "codes: [0, 0, 0, -4]" in proc.stdout, proc.stdout
    assert "reconnect failed: True" in proc.stdout and "survived" in proc.stdout


# ---------------------------------------------------------------- a worker that misbehaves at the byte level

def _scripted_worker(after_hello):
    """A loopback listener that answers HELLO, then runs `after_hello(sock, frame_reader)` on its thread."""
    lsock = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve():
        s, _ = lsock.accept()
        reader = F.FrameReader(P.Limits())

        def next_header():
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                buf = reader.buffer()
                n = s.recv_into(buf)
                if not n:
                    return None
                frames = reader.received(n)
                if frames:
                    return frames[0][0]
            return None

        h = next_header()
        s.sendall(F.encode_frame({"id": h["id"], "status": 0, "version": P.PROTOCOL_VERSION}))
        try:
            after_hello(s, next_header)
            done.wait(10)
        finally:
            s.close()
            lsock.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{lsock.getsockname()[1]}", done


def _first_failure(endpoint: str, done: threading.Event, liveness, cmd, fields=None, blob=b""):
    """Connect to a scripted worker, send one request, return (the PeerFailed it raised, seconds taken)."""
    async def scenario():
        c = await RpcClient.connect(endpoint, liveness_timeout=liveness)
        try:
            started = time.monotonic()
            with pytest.raises(PeerFailed) as info:
                await asyncio.wait_for(c.request(cmd, fields, blob), 5)
            return info.value, time.monotonic() - started
        finally:
            done.set()
            await c.aclose()

    return run(scenario())


@pytest.mark.parametrize("liveness", [None, 2.0])
def test_reply_with_a_bad_id_fails_the_request(liveness):
    """A reply whose id is not an integer (here a list: unhashable) is a protocol failure at once, with or
    without liveness pings; it used to escape into connection_lost and leave the request waiting forever."""
    def bad_id(s, next_header):
        h = next_header()
        s.sendall(F.encode_frame({"id": [h["id"]], "status": 0}))

    exc, took = _first_failure(*_scripted_worker(bad_id), liveness, Command.DEVICE_INFO)
    assert exc.kind == "protocol" and "id [" in exc.message, exc.message
    assert took < 1.0 * SLACK, took


def test_older_daemon_is_refused_at_connect(model):
    """A worker whose DEVICE_INFO lists no ops (a daemon from before the list, without TOP_K) is refused
    when the coordinator connects, naming the ops and the fix, not at the first greedy step."""
    def old_device_info(s, next_header):
        h = next_header()
        s.sendall(F.encode_frame({"id": h["id"], "status": 0, "name": "CPU", "free_memory": 1 << 30}))

    endpoint, done = _scripted_worker(old_device_info)
    try:
        with pytest.raises(EndpointUnavailable) as info:
            Coordinator([endpoint], model=model, n_ctx=N_CTX, connect_timeout=2.0)
    finally:
        done.set()
    e = info.value
    assert e.kind == "protocol" and e.endpoint == endpoint, e
    assert "older ggml-rpc-server" in e.message and "TOP_K" in e.message and "upgrade" in e.message, e.message


def test_worker_half_close_with_our_request_unsent_fails_at_once():
    """The worker sends FIN and reads nothing more while 64 MiB of our request still sit in the write
    buffer: the request fails 'closed' at the EOF instead of waiting for a drain that never comes."""
    def half_close(s, next_header):
        time.sleep(0.3)  # the request fills the socket buffers; none of it is read
        s.shutdown(socket.SHUT_WR)

    exc, took = _first_failure(*_scripted_worker(half_close), None, Command.SET_TENSOR,
                               {"buffer": 1, "offset": 0, "size": 64 << 20}, bytes(64 << 20))
    assert exc.kind == "closed" and "closed the connection" in exc.message, exc.message
    assert took < 2.0 * SLACK, took


@pytest.mark.parametrize("half_sent", [False, True])
def test_worker_reset_reads_as_a_closed_connection(half_sent):
    """A worker killed with bytes of ours unread (a ping, the next request) ends with RST, not FIN: a race
    the kill cannot choose. Both must read as the table's 'closed the connection' (with ' in the middle of a
    reply' when half of it came), the reset named as well; it once read 'connection to worker … lost'."""
    def reset(s, next_header):
        h = next_header()
        if half_sent:
            frame = F.encode_frame({"id": h["id"], "status": 0, "pad": "x" * 4096})
            s.sendall(frame[: len(frame) // 2])
        s.recv(1)  # our second request arrives, and stays unread
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # RST, as the kernel sends for a killed process with unread bytes

    async def scenario(endpoint, done):
        c = await RpcClient.connect(endpoint)
        try:
            first = asyncio.ensure_future(c.request(Command.DEVICE_INFO))
            await asyncio.sleep(0.05)
            second = asyncio.ensure_future(c.request(Command.DEVICE_INFO))
            failures = []
            for fut in (first, second):
                with pytest.raises(PeerFailed) as info:
                    await asyncio.wait_for(fut, 5)
                failures.append(info.value)
            assert failures[0] is failures[1]  # one failure, the connection's
            return failures[0]
        finally:
            done.set()
            await c.aclose()

    exc = run(scenario(*_scripted_worker(reset)))
    where = " in the middle of a reply" if half_sent else ""
    assert exc.kind == "closed" and exc.how == "connection reset by peer", exc.message
    assert exc.message.startswith("worker 127.0.0.1:") and exc.message.endswith(
        f"closed the connection{where} (connection reset by peer: crashed, killed or restarted?)"), exc.message
    assert exc.mid_reply is half_sent


def test_kv_calls_from_another_thread_wait_for_the_step_in_flight(model, start_daemon):
    """KV management called from another thread while a decode step is in flight
    runs after the step, not into it: the cell table is the step's until it
    ends (a seq_rm interleaved with find_slot/assign once emptied rows a step had
    just claimed, and batched texts went wrong). B holds its layers' reply for
    a second, so the step is certainly in flight when the calls are made."""
    b = start_daemon("-t", "1", "--test-fault", f"cmd={GRAPH_CMDS},after=4,point=reply,action=delay:1.0")
    a = start_daemon("-t", "1")
    with Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=N_CTX, head_split=True) as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is OK  # B's graph requests 1 and 2: layers, head
        assert c.decode(Batch.single(ids[:2], 0, seq=1)) is OK  # 3 and 4
        results = []
        decodes = c.stats["decodes"]  # counts a step when it ends
        t = threading.Thread(target=lambda: results.append(c.decode(Batch.single([5], len(ids)))))
        t.start()  # B's graph request 5 (its layers) is held
        try:
            b.wait_log("test fault fired", timeout=10)
            seen = (c.kv_seq_pos_max(0), c.stats["decodes"] - decodes)
            c.kv_seq_rm(1)
        finally:
            t.join(timeout=30)
        assert results == [OK], c.last_error
        assert seen == (len(ids), 1), "the KV call ran while the step was in flight"
        assert c.kv_seq_pos_max(1) == -1 and c.kv_seq_pos_max(0) == len(ids)


def test_a_bug_in_one_head_shard_still_latches_the_endpoint_lost_in_another(model, start_daemon, monkeypatch):
    """In the head round, shard A's request raises an unexpected error (a bug of
    ours, injected) while B dies computing its share: the decode reports the
    internal error as COMPUTE_FAILED, and B is latched all the same."""
    b = start_daemon("-t", "1", "--test-fault", f"cmd={GRAPH_CMDS},after=1,point=compute,action=kill")
    a = start_daemon("-t", "1")
    # the relayed head round (a linked step does not call run(); its reports: tests/coordinator/test_step_links.py)
    with Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=N_CTX, head_split=True, step_links=False) as c:
        ids = c.tokenize(PROMPT)
        executor = c._places[0].executor
        real_run = executor.run

        async def run_with_a_bug(stage, shape, inputs, head=False):
            if head:
                await asyncio.sleep(0.2)  # let B's failure arrive first: the bug must still win the report
                raise RuntimeError("injected bug")
            return await real_run(stage, shape, inputs, head)

        monkeypatch.setattr(executor, "run", run_with_a_bug)
        assert c.decode(Batch.single(ids, 0)) is COMPUTE_FAILED
        assert c.last_cause == "internal" and "injected bug" in c.last_error, c.last_error
        assert [f.endpoint for f in c.failed_endpoints()] == [b.endpoint]
        assert c.health()["status"] != "ok"


# ---------------------------------------------------------------- cancellation

def test_cancelled_request_keeps_the_connection_and_gives_back_its_buffer(start_daemon):
    """A caller cancelled while its request is in flight: the connection stays
    up, the late reply is dropped (not taken for the next request's), and a
    buffer the cancelled ALLOC_BUFFER created is freed when its reply comes."""
    d = start_daemon("-t", "1", "-m", "17", "--test-fault", "cmd=ALLOC_BUFFER,point=reply,action=delay:0.5")
    cap = 17 << 20

    async def scenario():
        c = await RpcClient.connect(d.endpoint)
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.request(Command.ALLOC_BUFFER, {"size": 4 << 20}), 0.1)
            assert c.failed is None
            h, _ = await c.request(Command.DEVICE_INFO)  # answered after the late ALLOC reply, and not mixed up
            assert "free_memory" in h and "buffer" not in h
            deadline = time.monotonic() + 10 * SLACK
            while (await c.request(Command.DEVICE_INFO))[0]["free_memory"] != cap:
                assert time.monotonic() < deadline, "the abandoned buffer was not freed"
                await asyncio.sleep(0.05)
            assert c.failed is None
        finally:
            await c.aclose()

    run(scenario())
    assert_served(d)


def test_cancelled_adecode_leaves_every_endpoint_healthy(model, start_daemon):
    """adecode cancelled mid-step (asyncio.wait_for): CancelledError to the
    caller, the step rolled back, no endpoint latched, and the same text as an
    undisturbed run afterwards."""
    b = start_daemon("-t", "1", "--test-fault", f"cmd={GRAPH_CMDS},after={2 * (N_GEN + 2)},point=reply,action=delay:0.5")
    a = start_daemon("-t", "1")
    with Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=N_CTX, head_split=True) as c:
        expected = greedy(c, N_GEN)  # N_GEN + 1 decodes, two graph requests each on B
        c.kv_seq_rm(0)
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is OK
        out = [c.token(-1)]

        async def cancelled():  # B holds this step's layers reply for 0.5 s
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.adecode(Batch.single(out[:1], len(ids))), 0.1)

        asyncio.run(cancelled())
        assert c.failed_endpoints() == [] and c.health()["status"] == "ok"
        assert c.kv_seq_pos_max(0) == len(ids) - 1  # the cancelled step's row was rolled back
        with pytest.raises(RuntimeError):
            c.logits(-1)
        for pos in range(len(ids), len(ids) + N_GEN - 1):
            assert c.decode(Batch.single(out[-1:], pos)) is OK, c.last_error
            out.append(c.token(-1))
        assert out == expected


# ---------------------------------------------------------------- between decodes

def wait_latched(c: Coordinator, timeout: float = 10.0) -> list:
    """The latched endpoints, once there are any within `timeout` (times SLACK)."""
    deadline = time.monotonic() + timeout * SLACK
    while not c.failed_endpoints():
        assert time.monotonic() < deadline, "no endpoint latched"
        time.sleep(0.02)
    return c.failed_endpoints()


@pytest.mark.parametrize("liveness", [2.0, 20.0])
def test_idle_connections_outlive_the_workers_idle_timeout(model, start_daemon, liveness):
    """A coordinator idle longer than the workers' --idle-timeout keeps its
    connections (and so its weights and KV cache): it pings them. Also when the
    last request's liveness timer (ping interval liveness / 4) would only fire
    after the idle timeout."""
    a, b = (start_daemon("-t", "1", "--idle-timeout", "1") for _ in range(2))
    with Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=N_CTX, head_split=True,
                     liveness_timeout=liveness) as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is OK
        time.sleep(2.5)
        assert c.failed_endpoints() == []
        assert c.decode(Batch.single([c.token(-1)], len(ids))) is OK, c.last_error
    assert not any("closing idle client" in line for d in (a, b) for line in d.log_lines)


@pytest.mark.parametrize("fault, kind", [(signal.SIGKILL, "closed"), (signal.SIGSTOP, "timeout")])
def test_worker_lost_between_decodes_is_latched_without_a_decode(model, start_daemon, fault, kind):
    """A worker killed or stopped while the coordinator is idle: failed_endpoints()
    and health() say so within the bounds (a stopped one: an unanswered
    keepalive ping, every idle_timeout / 3, given up after liveness_timeout),
    before any decode tries it; the next decode fails fast."""
    a = start_daemon("-t", "1")
    b = start_daemon("-t", "1", "--idle-timeout", "1.5")
    with Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=N_CTX, head_split=True,
                     liveness_timeout=LIVENESS) as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is OK
        assert c.failed_endpoints() == []
        b.kill() if fault == signal.SIGKILL else b.signal(fault)
        failed = wait_latched(c, timeout=0.5 + LIVENESS)  # one keepalive interval, then the liveness bound
        assert [(f.endpoint, f.kind) for f in failed] == [(b.endpoint, kind)], failed
        assert c.health()["status"] == "failed" and c.needs_refeed() == [0]
        if fault == signal.SIGSTOP:
            assert "keepalive" in failed[0].cause
        assert c.decode(Batch.single([5], len(ids))) is ENDPOINT_FAILED
        assert c.last_failed_endpoint == b.endpoint


def test_a_worker_that_names_no_idle_timeout_gets_no_keepalive_and_no_errors():
    """HELLO without idle_timeout (an older worker): no keepalive, and the
    watchdog's idle ticks raise nothing (they once raised a TypeError)."""
    def answer_pings(s, next_header):
        for _ in range(20):  # bounded: the client sends a few requests and stops
            h = next_header()
            if h is None:
                return
            s.sendall(F.encode_frame({"id": h["id"], "status": 0}))

    endpoint, done = _scripted_worker(answer_pings)

    async def scenario():
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        c = await RpcClient.connect(endpoint, liveness_timeout=0.4)
        try:
            assert c.keepalive_interval is None
            for _ in range(3):
                await c.request(Command.PING)
                await asyncio.sleep(0.3)  # the request's timer fires while idle
            assert c.failed is None and errors == [], errors
        finally:
            done.set()
            await c.aclose()

    run(scenario())
