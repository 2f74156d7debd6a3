"""Step links (docs/protocol.md, "Step links"): a step's activations go from
worker to worker. Real daemons on loopback, a real tiny model, real signals.

The linked path must give the relayed path's logits and tokens bit for bit,
report a dead or stopped worker as that worker (never its neighbour) within the
usual bounds, and let nobody without a session's token put bytes into it."""
from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.delay_proxy import Link, ProxyThread  # noqa: E402
from coordinator.api import Batch, Coordinator, DecodeResult  # noqa: E402
from rpc_daemon.client import RpcClient, RpcError  # noqa: E402
from rpc_daemon.testing.faults import FaultSpec, FaultSpecError  # noqa: E402
from rpc_daemon.wire.protocol import Command, Status  # noqa: E402
from conftest import SLACK  # noqa: E402
from rpc_helpers import SECRET, expect_error, small_graph  # noqa: E402

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

PROMPT = "The capital of France is"
GRAPH_CMDS = "GRAPH_COMPUTE|GRAPH_RECOMPUTE"
BOUND = 1.0  # liveness bound of the fault tests
AT_ONCE = 0.5  # s: a step that fails at once (a kill, a refused relay, a failed compute), idle machine


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def decode_trace(endpoints, model, **opts):
    """Logits of a prompt and of four decode steps, a greedy generation, and the linked step count."""
    with Coordinator(endpoints, model=model, n_ctx=64, **opts) as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error
        logits = [c.logits(-1).copy()]
        tok = int(np.argmax(logits[-1]))
        for i in range(4):
            assert c.decode(Batch.single([tok], len(ids) + i)) is DecodeResult.OK, c.last_error
            logits.append(c.logits(-1).copy())
            tok = int(np.argmax(logits[-1]))
        c.kv_clear()
        text = c.generate(PROMPT, max_tokens=6)
        assert c.failed_endpoints() == []
        return np.stack(logits), text, c.stats["linked_steps"]


@pytest.mark.parametrize("head_split", [True, False], ids=["head-split", "head-whole"])
def test_linked_steps_give_the_relayed_logits_and_tokens_bit_for_bit(tiny_model, start_daemon, head_split):
    """Three workers (a middle stage too): every step goes worker to worker,
    and the logits and the greedy text equal the relayed path's exactly."""
    endpoints = [start_daemon("-t", "1").endpoint for _ in range(3)]
    relayed, relayed_text, n_relayed = decode_trace(endpoints, tiny_model, head_split=head_split, step_links=False)
    linked, linked_text, n_linked = decode_trace(endpoints, tiny_model, head_split=head_split)
    assert n_relayed == 0 and n_linked >= 5 + 6, (n_relayed, n_linked)
    assert np.array_equal(relayed, linked)
    assert linked_text == relayed_text


def test_linked_steps_with_a_shared_secret_and_tls(tiny_model, start_daemon, secret_file, tls_files):
    """Peer links authenticate as coordinators do: the shared secret, TLS
    verified against --peer-tls-ca. A TLS worker without it offers no step
    links, and the coordinator relays (same logits)."""
    tls = ("--secret-file", secret_file, "--tls-cert", tls_files.cert, "--tls-key", tls_files.key)
    a = start_daemon("-t", "1", *tls, "--peer-tls-ca", tls_files.ca)
    b = start_daemon("-t", "1", *tls, "--peer-tls-ca", tls_files.ca)
    linked, text, n_linked = decode_trace([a.endpoint, b.endpoint], tiny_model, secret=SECRET, tls_ca=tls_files.ca)
    assert n_linked >= 11
    a.wait_log("peer link opened")  # A pushed to B over a link of its own
    no_ca = start_daemon("-t", "1", *tls)  # no --peer-tls-ca: cannot verify a peer
    relayed, relayed_text, n_relayed = decode_trace([no_ca.endpoint, b.endpoint], tiny_model, secret=SECRET,
                                                    tls_ca=tls_files.ca)
    assert n_relayed == 0
    assert np.array_equal(relayed, linked) and relayed_text == text


def test_a_push_that_fails_is_relayed_and_the_step_succeeds(tiny_model, start_daemon, secret_file, tls_files):
    """A cannot verify B (its --peer-tls-ca signed nothing): its push fails,
    it answers with the bytes, the coordinator delivers them over B's own
    connection, and the step gives the same logits; later steps are relayed
    for a while instead of paying a failed push each. Nothing is latched."""
    tls = ("--secret-file", secret_file, "--tls-cert", tls_files.cert, "--tls-key", tls_files.key)
    a = start_daemon("-t", "1", *tls, "--peer-tls-ca", tls_files.other_ca)
    b = start_daemon("-t", "1", *tls, "--peer-tls-ca", tls_files.ca)
    endpoints = [a.endpoint, b.endpoint]
    opts = dict(secret=SECRET, tls_ca=tls_files.ca)
    linked, text, n_linked = decode_trace(endpoints, tiny_model, **opts)
    assert n_linked == 1  # the first step; then relayed for RELAY_AFTER_FAILED_PUSH seconds
    assert "TLS" in a.wait_log("step forward failed")
    relayed, relayed_text, _ = decode_trace(endpoints, tiny_model, step_links=False, **opts)
    assert np.array_equal(relayed, linked) and relayed_text == text


def test_a_refused_relay_fails_the_step_at_once(tiny_model, start_daemon, secret_file, tls_files):
    """A cannot push to B (its --peer-tls-ca signed nothing) and B refuses the
    coordinator's relay of those bytes (a test fault; in use, e.g., a full
    mailbox): nobody will deliver the input B's request waits for, so the step
    fails at once with COMPUTE_FAILED naming B, nothing latched, instead of
    waiting out the input's timeout; the next decode succeeds, relayed."""
    with pytest.raises(FaultSpecError, match="only action=fail"):  # answered at once: nothing else applies
        FaultSpec.parse("cmd=STEP_INPUT,action=kill")
    tls = ("--secret-file", secret_file, "--tls-cert", tls_files.cert, "--tls-key", tls_files.key)
    a = start_daemon("-t", "1", *tls, "--peer-tls-ca", tls_files.other_ca)
    b = start_daemon("-t", "1", *tls, "--peer-tls-ca", tls_files.ca, "--test-fault", "cmd=STEP_INPUT,action=fail")
    with Coordinator([a.endpoint, b.endpoint], model=tiny_model, n_ctx=64, secret=SECRET, tls_ca=tls_files.ca,
                     request_timeout=60.0) as c:
        ids = c.tokenize(PROMPT)
        started = time.monotonic()
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.COMPUTE_FAILED
        assert time.monotonic() - started <= 10.0 * SLACK  # not the input's 60 s
        assert c.last_failed_endpoint == b.endpoint, c.last_error
        assert "refused the step input" in c.last_error and "INPUT_MISSING" not in c.last_error, c.last_error
        assert c.failed_endpoints() == []
        assert "STEP_INPUT" in b.wait_log("test fault fired")
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error
        assert c.stats["linked_steps"] == 0


def test_linked_generation_behind_a_slow_link_equals_the_direct_one(tiny_model, start_daemon):
    """Both workers behind 20 +- 5 ms links with stalls (worker to worker
    pushes go through the destination's proxy too): the same text, no latch."""
    a, b = start_daemon("-t", "1"), start_daemon("-t", "1")
    link = Link(0.02, 0.005, stall_prob=0.02, stall=0.25)
    with ProxyThread(a.endpoint, link, seed=1) as pa, ProxyThread(b.endpoint, link, seed=2) as pb:
        with Coordinator([pa.endpoint, pb.endpoint], model=tiny_model, n_ctx=64) as c:
            slow = c.generate(PROMPT, max_tokens=6)
            assert c.failed_endpoints() == [] and c.stats["linked_steps"] >= 6
    with Coordinator([a.endpoint, b.endpoint], model=tiny_model, n_ctx=64, step_links=False) as c:
        assert c.generate(PROMPT, max_tokens=6) == slow


# ---------------------------------------------------------------- faults mid-step

# With the head split each worker gets two graph requests per decode (its stage,
# its head shard): after=2 hits decode 2's stage request.
FAULTS = {
    # worker, point, action: which worker must be reported, and how
    "A killed computing": (0, "compute", "kill", "closed"),
    "B killed computing": (1, "compute", "kill", "closed"),
    "B killed before A's push": (1, "request", "kill", "closed"),
    "A stopped computing": (0, "compute", "stop", "timeout"),
    "B stopped before A's push": (1, "request", "stop", "timeout"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_mid_step_is_reported_as_that_worker(tiny_model, start_daemon, fault):
    """kill -9 or SIGSTOP of A or B in the middle of a linked step (B also
    before A pushes to it, so A's next hop fails): ENDPOINT_FAILED naming the
    faulty worker with its kind, within the detection bound; its neighbour is
    neither reported nor latched, and decodes fine after a reconnect."""
    index, point, action, kind = FAULTS[fault]
    spec = f"cmd={GRAPH_CMDS},after=2,point={point},action={action}"
    workers = [start_daemon("-t", "1", "--test-fault", spec) if i == index else start_daemon("-t", "1")
               for i in range(2)]
    faulty, other = workers[index], workers[1 - index]
    with Coordinator([w.endpoint for w in workers], model=tiny_model, n_ctx=64, liveness_timeout=BOUND) as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error
        started = time.monotonic()
        assert c.decode(Batch.single([5], len(ids))) is DecodeResult.ENDPOINT_FAILED
        took = time.monotonic() - started
        assert c.stats["linked_steps"] == 1
        assert (c.last_failed_endpoint, c.last_cause) == (faulty.endpoint, kind), c.last_error
        assert [f.endpoint for f in c.failed_endpoints()] == [faulty.endpoint], c.failed_endpoints()
        # killed: at once; stopped: the liveness bound, even while A's push to a stopped B still
        # waits for its own peer-link bound (A's request is given up when B is lost)
        limit = (AT_ONCE if action == "kill" else BOUND) * SLACK
        assert took <= limit, took
        assert other.alive()
        if action == "stop":
            faulty.signal(signal.SIGCONT)
        faulty.kill()
        with pytest.raises(Exception):
            c.logits(-1)
    # the neighbour serves a new session as if nothing happened
    with Coordinator([other.endpoint], model=tiny_model, n_ctx=64) as c:
        assert c.generate(PROMPT, max_tokens=2)


@pytest.mark.parametrize("after", [2, 3], ids=["B's layers", "B's share"])
@pytest.mark.parametrize("action", ["kill", "stop"])
def test_a_fault_mid_step_with_the_head_here_is_reported_as_the_last_worker(tiny_model, start_daemon, after, action):
    """head_split="here": the last worker B computes its share of the head and
    the coordinator the rest, from the normed rows B replies with. B killed or
    stopped while computing its layers or its share: ENDPOINT_FAILED naming B
    (never `local`, whose rows wait for B's and are not computed) within the
    bound, A not latched; the step before gave the head always split's logits."""
    spec = f"cmd={GRAPH_CMDS},after={after},point=compute,action={action}"
    a, b = start_daemon("-t", "1"), start_daemon("-t", "1", "--test-fault", spec)
    with Coordinator([a.endpoint, b.endpoint], model=tiny_model, n_ctx=64, liveness_timeout=BOUND,
                     head_split="here") as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error
        here = c.logits(-1).copy()
        head = c.head_placement()
        assert head["here_held"] and head["steps_here"] == 1 and c.stats["linked_steps"] == 1, head
        started = time.monotonic()
        assert c.decode(Batch.single([5], len(ids))) is DecodeResult.ENDPOINT_FAILED
        took = time.monotonic() - started
        assert (c.last_failed_endpoint, c.last_cause) == (b.endpoint, "closed" if action == "kill" else "timeout")
        assert [f.endpoint for f in c.failed_endpoints()] == [b.endpoint], c.failed_endpoints()
        assert took <= (AT_ONCE if action == "kill" else BOUND) * SLACK, took
        if action == "stop":
            b.signal(signal.SIGCONT)
    with Coordinator([a.endpoint, start_daemon("-t", "1").endpoint], model=tiny_model, n_ctx=64,
                     head_split=True) as c:
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error
        assert np.array_equal(c.logits(-1), here)


@pytest.mark.parametrize("action", ["stop", "kill"])
def test_a_worker_lost_after_its_push_is_reported_by_the_same_decode_or_the_next(tiny_model, start_daemon, action):
    """A's reply to a linked step only confirms that its push arrived, so the
    step ends when B's output is in, without waiting for it (one one-way delay
    less per token behind slow links). A stopped or killed after its push, in
    place of that reply: the decode returns B's logits (stopped: always, as the
    loss shows only after the liveness bound; killed: unless the loss is seen
    first), equal to a clean run's; the decode after it reports A with its kind
    within the usual bound, B not latched."""
    spec = f"cmd={GRAPH_CMDS},after=1,point=reply,action={action}"  # decode 2's stage request
    a, b = start_daemon("-t", "1", "--test-fault", spec), start_daemon("-t", "1")
    kind = "timeout" if action == "stop" else "closed"
    with Coordinator([a.endpoint, b.endpoint], model=tiny_model, n_ctx=64, liveness_timeout=BOUND,
                     head_split=False) as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error
        code = c.decode(Batch.single([5], len(ids)))
        if code is DecodeResult.OK:
            after_push = c.logits(-1).copy()
            assert c.stats["linked_steps"] == 2
            started = time.monotonic()
            code = c.decode(Batch.single([6], len(ids) + 1))
            assert time.monotonic() - started <= (AT_ONCE if action == "kill" else BOUND) * SLACK
        else:
            assert action == "kill", c.last_error  # a stopped A cannot be seen lost before B's reply
            after_push = None
        assert code is DecodeResult.ENDPOINT_FAILED, c.last_error
        assert (c.last_failed_endpoint, c.last_cause) == (a.endpoint, kind), c.last_error
        assert [f.endpoint for f in c.failed_endpoints()] == [a.endpoint], c.failed_endpoints()
        if action == "stop":
            a.signal(signal.SIGCONT)
    if after_push is not None:
        with Coordinator([start_daemon("-t", "1").endpoint, b.endpoint], model=tiny_model, n_ctx=64,
                         head_split=False) as c:
            assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error
            assert c.decode(Batch.single([5], len(ids))) is DecodeResult.OK, c.last_error
            assert np.array_equal(c.logits(-1), after_push)


def test_a_failed_compute_cancels_the_waiting_stages_without_latching(tiny_model, start_daemon):
    """B's stage compute process dies (a healthy worker's FAILED): COMPUTE_FAILED on B,
    nothing latched, A's head shard stops waiting at once (cancelled), and the
    next decode succeeds on the same connections."""
    b = start_daemon("-t", "1", "--test-fault", f"cmd={GRAPH_CMDS},after=2,point=compute,action=crash-compute")
    a = start_daemon("-t", "1")
    with Coordinator([a.endpoint, b.endpoint], model=tiny_model, n_ctx=64, liveness_timeout=BOUND,
                     head_split=True) as c:  # the fault counts the head round's requests
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error
        started = time.monotonic()
        assert c.decode(Batch.single([5], len(ids))) is DecodeResult.COMPUTE_FAILED
        assert time.monotonic() - started <= AT_ONCE * SLACK
        assert c.last_failed_endpoint == b.endpoint and "INPUT_MISSING" not in c.last_error, c.last_error
        assert c.failed_endpoints() == []
        assert c.decode(Batch.single([5], len(ids))) is DecodeResult.OK, c.last_error
        assert c.stats["linked_steps"] >= 2


# ---------------------------------------------------------------- the protocol, raw

async def _session(endpoint: str, token: bytes, peers=(), secret=None):
    c = await RpcClient.connect(endpoint, secret=secret)
    await c.request(Command.STEP_PEERS, {"token": token, "peers": list(peers)})
    h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 4096})
    return c, h["buffer"]


def test_a_step_input_waits_is_validated_and_lands_only_in_its_session(start_daemon, secret_file):
    """GRAPH_COMPUTE whose inline input comes from the mailbox: it waits for
    the tag (bounded: INPUT_MISSING), takes bytes another connection delivers
    with the session's token, checks them as any inline input (a wrong size is
    INVALID_REQUEST), and computes what the inline request computes. An
    unknown token is NOT_AUTHORIZED; a forward to a worker STEP_PEERS did not
    name is NOT_AUTHORIZED before anything runs."""
    d = start_daemon("-t", "1", "--secret-file", secret_file)
    token = os.urandom(16)

    async def go():
        c, buf = await _session(d.endpoint, token, secret=SECRET)
        peer = await RpcClient.connect(d.endpoint, secret=SECRET)  # authenticated, but holds no session's token
        try:
            x = np.arange(12, dtype=np.float32)
            await c.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": 48}, x.tobytes())
            _, idx, fields, yb, expect = small_graph(buf, 0, x)
            linked = dict(fields, inputs=[], graph_id=1)
            linked["step_input"] = {"tensor": idx["y"], "tag": 7, "timeout": 0.3}
            t = time.monotonic()
            await expect_error(c.request(Command.GRAPH_COMPUTE, linked), Status.INPUT_MISSING, "did not arrive")
            assert 0.25 <= time.monotonic() - t <= 0.3 * SLACK
            await expect_error(peer.request(Command.STEP_INPUT, {"token": os.urandom(16), "tag": 7}, yb),
                               Status.NOT_AUTHORIZED, "no session")
            await peer.request(Command.STEP_INPUT, {"token": token, "tag": 8}, yb[:-4])  # short: refused at use
            linked["step_input"] = dict(linked["step_input"], tag=8)
            await expect_error(c.request(Command.GRAPH_COMPUTE, linked), Status.INVALID_REQUEST)
            waiting = asyncio.ensure_future(c.request(Command.GRAPH_COMPUTE, dict(
                linked, step_input=dict(linked["step_input"], tag=9, timeout=30))))
            await asyncio.sleep(0.1)
            await peer.request(Command.STEP_INPUT, {"token": token, "tag": 9}, yb)
            h, out = await waiting
            assert np.array_equal(np.frombuffer(out, np.float32), expect) and h["outputs"] == [[idx["z"], 0, 48]]
            await expect_error(c.request(Command.GRAPH_RECOMPUTE, {
                "graph_id": 1, "inputs": [[idx["y"], 0, len(yb)]], "outputs": [idx["z"]],
                "forward": [{"to": "127.0.0.1:9", "token": token, "tag": 10}]}, yb), Status.NOT_AUTHORIZED,
                "not a peer")
            # forwarding into a mailbox of this daemon (its own session's): with reply_output the reply
            # carries the outputs too (what the coordinator computes its share of the head from)
            await c.request(Command.STEP_PEERS, {"token": token, "peers": [d.endpoint]})
            fwd = {"graph_id": 1, "inputs": [[idx["y"], 0, len(yb)]], "outputs": [idx["z"]],
                   "forward": [{"to": d.endpoint, "token": token, "tag": 12}]}
            await expect_error(c.request(Command.GRAPH_RECOMPUTE, dict(fwd, reply_output=1), yb),
                               Status.INVALID_REQUEST, "reply_output")
            h, out = await c.request(Command.GRAPH_RECOMPUTE, dict(fwd, reply_output=True), yb)
            assert h["forwarded"] is True and np.array_equal(np.frombuffer(out, np.float32), expect)
            h, out = await c.request(Command.GRAPH_RECOMPUTE, dict(fwd, forward=[dict(fwd["forward"][0], tag=13)]), yb)
            assert h["forwarded"] is True and out == b""
            for tag in (12, 13):  # both pushes landed
                await c.request(Command.GRAPH_RECOMPUTE, {"graph_id": 1, "inputs": [], "outputs": [idx["z"]],
                                "step_input": {"tensor": idx["y"], "tag": tag, "timeout": 2}})
            # the session names other peers under its token; no other session may take that token
            await c.request(Command.STEP_PEERS, {"token": token, "peers": ["127.0.0.1:9"]})
            await expect_error(peer.request(Command.STEP_PEERS, {"token": token, "peers": []}),
                               Status.INVALID_REQUEST, "in use")
            # a cancelled tag ends its wait at once
            await peer.request(Command.STEP_INPUT, {"token": token, "tag": 11, "cancel": True})
            await expect_error(c.request(Command.GRAPH_RECOMPUTE, {
                "graph_id": 1, "inputs": [], "outputs": [idx["z"]],
                "step_input": {"tensor": idx["y"], "tag": 11, "timeout": 30}}), Status.INPUT_MISSING, "cancelled")
        finally:
            await c.aclose()
            await peer.aclose()

    run(go())


def test_an_unauthenticated_peer_is_refused(start_daemon, secret_file):
    """STEP_INPUT from a connection that has not authenticated: NOT_AUTHORIZED
    and closed, as any command before AUTH; with the wrong secret the
    connection never gets that far."""
    d = start_daemon("-t", "1", "--secret-file", secret_file)

    async def go():
        from rpc_helpers import RawConn
        with RawConn(d.port) as raw:
            raw.send({"cmd": int(Command.STEP_INPUT), "id": 1, "token": os.urandom(16), "tag": 1})
            h, _ = raw.recv_frame()
            assert h["status"] == Status.NOT_AUTHORIZED
        with pytest.raises(Exception, match="authentication failed|not authorized"):
            await RpcClient.connect(d.endpoint, secret=b"another secret, 40 bytes long......!!!")

    run(go())



def test_a_mailbox_is_bounded_and_dies_with_its_session(start_daemon):
    """At most 32 step inputs wait untaken (the 33rd: LIMIT_EXCEEDED, the
    connection kept); when the session's connection closes, its token is
    forgotten (a later push: NOT_AUTHORIZED)."""
    d = start_daemon("-t", "1")
    token = os.urandom(16)

    async def go():
        c, _ = await _session(d.endpoint, token)
        peer = await RpcClient.connect(d.endpoint)
        try:
            for tag in range(32):
                await peer.request(Command.STEP_INPUT, {"token": token, "tag": tag}, b"x" * 8)
            await expect_error(peer.request(Command.STEP_INPUT, {"token": token, "tag": 32}, b"x" * 8),
                               Status.LIMIT_EXCEEDED, "32")
            await expect_error(peer.request(Command.STEP_INPUT, {"token": token, "tag": 3}, b"x" * 8),
                               Status.INVALID_REQUEST, "already delivered")
            await c.aclose()
            deadline = time.monotonic() + 10 * SLACK
            while time.monotonic() < deadline:
                try:
                    await peer.request(Command.STEP_INPUT, {"token": token, "tag": 40}, b"x")
                except RpcError as exc:
                    if exc.status == Status.NOT_AUTHORIZED:
                        return
                    assert exc.status == Status.LIMIT_EXCEEDED, exc  # the close has not been seen yet
                await asyncio.sleep(0.05)
            raise AssertionError("the closed session's token still accepts inputs")
        finally:
            await c.aclose()
            await peer.aclose()

    run(go())


def test_cancelled_tags_do_not_fill_a_mailbox():
    """A client cancels every tag of a failed step, also those already taken:
    their markers must not use up the session's room for inputs (found by
    review: after two failed linked prompts every push was refused and the
    next step waited for its request timeout)."""
    from rpc_daemon.daemon.peers import MAX_MAILBOX_ENTRIES, Mailbox

    async def scenario():
        box = Mailbox(1 << 20)
        n = MAX_MAILBOX_ENTRIES + 8
        for tag in range(n):
            box.put(tag, b"x" * 8)
            assert await box.take(tag, 1.0) == b"x" * 8
        for tag in range(n):  # the failed step's cancellations, every tag
            box.cancel(tag)
        box.cancel(n)  # one not yet delivered nor taken: its late input is refused, its request told
        nxt = range(n + 1, n + 1 + MAX_MAILBOX_ENTRIES)
        for tag in nxt[:-1]:  # the next steps' inputs find room beside the one live marker
            box.put(tag, b"y")
        with pytest.raises(Exception) as late:
            box.put(n, b"late")
        assert "cancelled" in str(late.value)
        box.put(nxt[-1], b"y")  # the marker gives way to an input (it outlived the late one): room for one more
        assert [await box.take(tag, 1.0) for tag in nxt] == [b"y"] * MAX_MAILBOX_ENTRIES
        assert box.held == 0

    asyncio.run(scenario())


# ---------------------------------------------------------------- no wait longer than its reason

def test_a_late_input_does_not_undo_a_cancellation(start_daemon):
    """A request queued behind its session's running request has its tag
    cancelled (its step failed elsewhere) and then its input arrives anyway
    (already on its way, e.g. its own worker's push): the input is refused
    and the mark stays, so the request ends with INPUT_MISSING as soon as its
    turn comes, not after its 30 s timeout. Once a tag's request has ended,
    its tag takes no input, no request, and a cancellation of it is moot."""
    d = start_daemon("-t", "1")
    token = os.urandom(16)

    async def go():
        c, buf = await _session(d.endpoint, token)
        peer = await RpcClient.connect(d.endpoint)
        try:
            x = np.arange(12, dtype=np.float32)
            await c.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": 48}, x.tobytes())
            _, idx, fields, yb, expect = small_graph(buf, 0, x)

            def waiting(tag):
                return asyncio.ensure_future(c.request(Command.GRAPH_COMPUTE, dict(
                    fields, inputs=[], step_input={"tensor": idx["y"], "tag": tag, "timeout": 30})))

            first, queued = waiting(21), waiting(22)  # 22 waits its turn behind 21, which waits for its input
            await asyncio.sleep(0.1)
            await peer.request(Command.STEP_INPUT, {"token": token, "tag": 22, "cancel": True})
            await expect_error(peer.request(Command.STEP_INPUT, {"token": token, "tag": 22}, yb),
                               Status.INVALID_REQUEST, "cancelled")
            started = time.monotonic()
            await peer.request(Command.STEP_INPUT, {"token": token, "tag": 21}, yb)
            _, out = await first
            assert np.array_equal(np.frombuffer(out, np.float32), expect)
            await expect_error(queued, Status.INPUT_MISSING, "cancelled")
            assert time.monotonic() - started <= 1.0 * SLACK  # at its turn, not at its 30 s timeout
            await peer.request(Command.STEP_INPUT, {"token": token, "tag": 21, "cancel": True})  # moot: no mark
            await expect_error(peer.request(Command.STEP_INPUT, {"token": token, "tag": 21}, yb),
                               Status.INVALID_REQUEST, "ended")
            await expect_error(waiting(21), Status.INVALID_REQUEST, "one request")
        finally:
            await c.aclose()
            await peer.aclose()

    run(go())


def test_taken_tags_leave_no_marks_and_marks_outlast_late_inputs():
    """Mailbox rules behind the test above, without sockets: a cancellation
    of a tag whose request took its input leaves nothing; a mark survives an
    input that comes after it and ends the request that comes later."""
    from rpc_daemon.daemon.peers import Mailbox
    from rpc_daemon.wire.protocol import ProtocolError

    async def scenario():
        box = Mailbox(1 << 20)
        box.put(1, b"x")
        assert await box.take(1, 1.0) == b"x"
        box.cancel(1)
        assert not box.entries
        with pytest.raises(ProtocolError, match="ended"):
            box.put(1, b"late")
        box.cancel(2)
        with pytest.raises(ProtocolError, match="cancelled"):
            box.put(2, b"late")
        started = time.monotonic()
        with pytest.raises(ProtocolError, match="cancelled") as info:
            await box.take(2, 30.0)
        assert info.value.status == Status.INPUT_MISSING and time.monotonic() - started < 1.0 * SLACK
        assert not box.entries and box.held == 0

    asyncio.run(scenario())


def test_a_step_failed_elsewhere_does_not_hold_a_queued_wait_for_the_request_timeout(tiny_model, start_daemon):
    """Head split over A and B. A is killed right after its push reached B
    (its reply never leaves), while B's stage, input taken, waits for B's
    compute lock (another client's long compute holds it) and B's head share
    is queued behind it. The coordinator, which knows A is gone at once,
    cancels B's head tag; B's own stage pushes that tag to B's head after the
    cancellation. The decode must end once B's stage has computed:
    ENDPOINT_FAILED naming A, B not latched. It used to wait out the
    request_timeout (30 s here) and latch the healthy B as timed out."""
    import threading

    from rpc_helpers import N, chain_graph

    a = start_daemon("-t", "1", "--test-fault", f"cmd={GRAPH_CMDS},after=2,point=reply,action=kill")
    b = start_daemon("-t", "1")
    sent, held = threading.Event(), []

    async def hold_lock():  # another client of B: one long compute
        c = await RpcClient.connect(b.endpoint, liveness_timeout=30.0)
        try:
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 2 * N * N * 4})
            data = np.eye(N, dtype=np.float32).tobytes() + np.ones((N, N), np.float32).tobytes()
            await c.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": len(data)}, data)
            tensors, iz = chain_graph(h["buffer"], 6)
            started = time.monotonic()
            job = asyncio.ensure_future(c.request(Command.GRAPH_COMPUTE, {"tensors": tensors, "inputs": [],
                                                                          "outputs": [iz]}))
            await asyncio.sleep(0.3)  # B validates it and takes its compute lock
            sent.set()
            await job
            held.append(time.monotonic() - started)
        finally:
            await c.aclose()

    with Coordinator([a.endpoint, b.endpoint], model=tiny_model, n_ctx=64, head_split=True,
                     liveness_timeout=BOUND, request_timeout=30.0) as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error
        holder = threading.Thread(target=lambda: run(hold_lock()))
        holder.start()
        try:
            assert sent.wait(30)
            started = time.monotonic()
            code = c.decode(Batch.single([5], len(ids)))
            took = time.monotonic() - started
        finally:
            holder.join(60)
        assert c.stats["linked_steps"] == 1  # the prompt's (a failed step counts nothing); the next one was linked too
        assert "GRAPH" in a.wait_log("test fault fired")
        assert (code, c.last_failed_endpoint, c.last_cause) == (DecodeResult.ENDPOINT_FAILED, a.endpoint, "closed"), \
            c.last_error
        assert [f.endpoint for f in c.failed_endpoints()] == [a.endpoint], c.failed_endpoints()
        assert held, "the long compute did not finish"
        assert took <= held[0] + 2.0 * SLACK, (took, held)  # B's stage's turn, then at once: not 30 s


def test_a_linked_step_cancelled_from_outside_cancels_its_waits(tiny_model, start_daemon):
    """adecode of a linked step cancelled (asyncio.wait_for) while B's stage
    waits for A's push (A's request starts 1.5 s late): the coordinator
    cancels B's wait at once (B answers it INPUT_MISSING, cancelled; A's late
    push is refused), nothing is latched, and the next decode succeeds. Were
    the wait left standing, B would compute the cancelled step when A's push
    came, and a push that never came would hold B's connection for the
    request_timeout."""
    a = start_daemon("-t", "1", "--test-fault", f"cmd={GRAPH_CMDS},after=1,point=request,action=delay:1.5")
    b = start_daemon("-t", "1")
    with Coordinator([a.endpoint, b.endpoint], model=tiny_model, n_ctx=64, head_split=False,
                     request_timeout=30.0) as c:
        ids = c.tokenize(PROMPT)
        assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error  # A's graph request 1
        mark = len(b.log_lines)

        async def cancelled():
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.adecode(Batch.single([5], len(ids))), 0.3)

        started = time.monotonic()
        asyncio.run(cancelled())
        line = b.wait_log("INPUT_MISSING", start=mark, timeout=1.0)
        assert "cancelled" in line and time.monotonic() - started <= 1.3 * SLACK, line
        assert c.failed_endpoints() == [] and c.stats["linked_steps"] == 1
        assert c.decode(Batch.single([5], len(ids))) is DecodeResult.OK, c.last_error  # behind A's late request
        assert c.stats["linked_steps"] == 2
