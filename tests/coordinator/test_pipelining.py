"""Pipeline parallelism (coordinator/decode/microbatch.py, gate.py): batches cut
into micro-batches that follow each other through the stages, and several
steps in flight at once. Real daemons on loopback; the reference is the
unpipelined coordinator (micro_batch=0) decoding the same micro-batches one
after another, which must give the same logits bit for bit."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from conftest import DaemonProcess
from coordinator import Batch, Coordinator, DecodeResult
from coordinator.decode.microbatch import plan_cuts
from coordinator.decode.flow import FlowFailed, flow
from tiny_models import write_tiny_llama

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

OK = DecodeResult.OK
N_CTX = 512
MICRO = 16  # small chunks, so the tiny model's batches are cut into several


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", seed=0)


@pytest.fixture(scope="module")
def workers():
    ws = [DaemonProcess("-t", "1"), DaemonProcess("-t", "1")]
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture(scope="module", params=[True, False], ids=["head-split", "head-whole"])
def pair(request, model, workers):
    """A pipelined coordinator and an unpipelined one on the same two workers."""
    eps = [w.endpoint for w in workers]
    opts = {"model": model, "n_ctx": N_CTX, "head_split": request.param}
    with Coordinator(eps, micro_batch=MICRO, **opts) as on, Coordinator(eps, micro_batch=0, **opts) as off:
        yield on, off


def seqs_of(mask: int) -> list[int]:
    return [s for s in range(64) if mask >> s & 1]


def one_after_another(c: Coordinator, batch: Batch, cuts) -> list[np.ndarray]:
    """`batch` decoded as its micro-batches, each a decode of its own, in order."""
    logits = []
    for a, b in cuts:
        want = [True] * (b - a) if batch.logits is None else list(batch.logits[a:b])
        assert c.decode(Batch(batch.tokens[a:b], batch.pos[a:b], batch.seq_ids[a:b], want)) is OK, c.last_error
        logits += [c.logits(i) for i, w in enumerate(want) if w]
    return logits


def cuts_of(c: Coordinator, batch: Batch):
    masks = np.array([sum(1 << s for s in ids) for ids in batch.seq_ids], dtype=np.uint64)
    return plan_cuts(np.asarray(batch.pos), masks, len(c.endpoints()), c.micro_batch)


# ---------------------------------------------------------------- how batches are cut
def test_plan_cuts():
    one = np.ones(512, np.uint64)
    assert plan_cuts(np.arange(512), one, 2, 64) == [(i, i + 64) for i in range(0, 512, 64)]
    assert plan_cuts(np.arange(100), one[:100], 2, 64) == [(0, 64), (64, 100)]
    assert plan_cuts(np.arange(40), one[:40], 2, 64) == [(0, 40)]  # a short prompt stays whole
    assert plan_cuts(np.arange(512), one, 1, 64) == [(0, 512)]  # one stage: nothing to overlap
    assert plan_cuts(np.arange(512), one, 2, 0) == [(0, 512)]  # off
    streams = np.array([1 << s for s in range(8)], np.uint64)
    assert plan_cuts(np.full(8, 30), streams, 2, 64) == [(0, 8)]  # one token per stream: too small to split
    assert plan_cuts(np.full(8, 30), streams, 2, 8) == [(0, 4), (4, 8)]  # groups of at least micro_batch / 2
    assert plan_cuts(np.full(8, 30), streams, 3, 6) == [(0, 3), (3, 6), (6, 8)]
    prompts = np.repeat(np.array([1 << s for s in range(5)], np.uint64), 20)  # 5 prompts of 20 tokens
    assert plan_cuts(np.tile(np.arange(20), 5), prompts, 2, 64) == [(0, 40), (40, 80), (80, 100)]  # at most 50 each
    assert plan_cuts(np.full(8, 30), streams, 2, 8, group=False) == [(0, 8)]  # the caller groups (the server)
    # a prompt chunk and 4 streams' tokens: the chunk's pieces, the tokens packed behind them
    mixed = np.concatenate([np.full(150, 1 << 5, np.uint64), streams[:4]])
    cuts = plan_cuts(np.concatenate([np.arange(150), np.full(4, 9)]), mixed, 2, 64)
    assert cuts == [(0, 64), (64, 128), (128, 154)]
    # out of causal order (a token before one it attends to, across a cut): kept whole
    assert plan_cuts(np.arange(200)[::-1].copy(), one[:200], 2, 64) == [(0, 200)]


def test_flow_keeps_each_stage_in_order_and_stops_after_a_failure():
    async def go():
        seen = [[], []]

        def stage(k):
            async def run(i, x):
                await asyncio.sleep(0.001 * ((i * 7 + k * 3) % 5))
                seen[k].append(i)
                if k == 1 and i == 3:
                    raise ValueError("item 3 on stage 1")
                return (x or 0) + 1
            return run

        assert await flow(6, [stage(0), stage(1)][:1]) == [1] * 6
        seen = [[], []]
        with pytest.raises(FlowFailed) as failed:
            await flow(6, [stage(0), stage(1)])
        assert [(i, k) for i, k, _ in failed.value.failures] == [(3, 1)]
        assert seen[1] == [0, 1, 2, 3]  # in order; nothing started after the failure
        assert seen[0] == sorted(seen[0])
    asyncio.run(go())


# ---------------------------------------------------------------- the same logits
def test_long_prompt_equals_its_chunks_one_after_another(pair):
    on, off = pair
    rng = np.random.default_rng(1)
    ids = [int(x) for x in rng.integers(3, 290, 150)]
    batch = Batch.single(ids, 0, all_logits=True)
    cuts = cuts_of(on, batch)
    assert len(cuts) == 10  # 9 chunks of MICRO tokens and the rest
    for c in (on, off):
        c.kv_clear()
    before = on.stats["micro_batches"]
    assert on.decode(batch) is OK, on.last_error
    assert on.stats["micro_batches"] - before == len(cuts)
    got = [on.logits(i) for i in range(len(ids))]
    want = one_after_another(off, batch, cuts)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    # the continuation too, greedy (the workers' argmax) and from logits
    pos, tok = len(ids), int(np.argmax(got[-1]))
    for greedy in (True, False):
        for c in (on, off):
            assert c.decode(Batch.single([tok], pos), greedy=greedy) is OK
        assert on.token(-1) == off.token(-1)
        if not greedy:
            assert np.array_equal(on.logits(-1), off.logits(-1))
        tok, pos = on.token(-1), pos + 1


def test_a_prompt_goes_worker_to_worker_in_micro_batches(pair):
    """A prompt wanting only its last logits: every micro-batch's requests are
    sent at once over step links (A pushes each piece's hidden state to B
    itself), and the logits are those of the pieces decoded one after another."""
    on, off = pair
    ids = [int(x) for x in np.random.default_rng(5).integers(3, 290, 5 * MICRO + 3)]
    batch = Batch.single(ids, 0)
    cuts = cuts_of(on, batch)
    assert len(cuts) == 6
    for c in (on, off):
        c.kv_clear()
    before = on.stats["linked_steps"]
    assert on.decode(batch) is OK, on.last_error
    assert on.stats["linked_steps"] - before == len(cuts)
    assert np.array_equal(on.logits(-1), one_after_another(off, batch, cuts)[-1])
    for c in (on, off):
        assert c.decode(Batch.single([7], len(ids)), greedy=True) is OK, c.last_error
    assert on.token(-1) == off.token(-1)


def test_streams_in_groups_equal_the_groups_one_after_another(pair):
    """Six sequences' prompts in one batch, in groups, then steps of one token
    each: the groups' logits are those of the groups decoded one after another."""
    on, off = pair
    rng = np.random.default_rng(2)
    for c in (on, off):
        c.kv_clear()
    tokens, pos, seqs, want = [], [], [], []
    for s in range(6):
        n = 5 + s
        tokens += [int(x) for x in rng.integers(3, 290, n)]
        pos += list(range(n))
        seqs += [[s]] * n
        want += [False] * (n - 1) + [True]
    at = [5 + s for s in range(6)]
    for step in range(4):
        batch = Batch(tokens, pos, seqs, want)
        cuts = cuts_of(on, batch)
        assert (len(cuts) >= 2) if step == 0 else (len(cuts) == 1)  # one-token steps: below MICRO / 2 tokens
        assert on.decode(batch) is OK, on.last_error
        got = [on.logits(i) for i in np.flatnonzero(want)]
        ref = one_after_another(off, batch, cuts)
        assert len(got) == len(ref) == 6 and all(np.array_equal(a, b) for a, b in zip(got, ref)), step
        tokens = [int(np.argmax(x)) for x in got]
        pos, seqs, want = list(at), [[s] for s in range(6)], [True] * 6
        at = [a + 1 for a in at]


def test_steps_in_flight_at_once_equal_them_one_after_another(pair):
    """Two groups' steps submitted at once (as the server's groups do) are both
    in flight; each gets what it gets decoded alone, in the order admitted, and
    its own outputs (adecode_outcome), not the other's."""
    on, off = pair
    for c in (on, off):
        c.kv_clear()
    groups = [[0, 1, 2], [3, 4, 5]]
    pos = {s: 0 for g in groups for s in g}
    last = {s: 7 + 11 * s for s in pos}
    loop = asyncio.new_event_loop()
    try:
        for step in range(5):
            batches = []
            for g in groups:
                n = 4 if step == 0 else 1  # the first step feeds a 4-token prompt per sequence
                tokens = [((last[s] + k * 13) % 280) + 3 for s in g for k in range(n)]
                batches.append(Batch(tokens, [pos[s] + k for s in g for k in range(n)], [[s] for s in g for _ in range(n)],
                                     [k == n - 1 for _ in g for k in range(n)]))

            async def both():
                return await asyncio.gather(*(on.adecode_outcome(b) for b in batches))
            outcomes = loop.run_until_complete(both())
            for g, b, outcome in zip(groups, batches, outcomes):
                assert outcome.code is OK, outcome.error
                ref = one_after_another(off, b, cuts_of(on, b))
                got = [outcome.logits(i) for i in np.flatnonzero(b.logits)]
                assert all(np.array_equal(x, y) for x, y in zip(got, ref)), (step, g)
                for s, x in zip(g, got):
                    last[s] = int(np.argmax(x))
                    pos[s] += len(b.tokens) // len(g)
    finally:
        loop.close()
    assert on._decoder.gate.in_flight == []


# ---------------------------------------------------------------- failures
@pytest.mark.parametrize("victim", [0, 1])
def test_worker_killed_mid_pipeline_is_reported_as_that_worker(model, victim):
    """kill -9 (the worker kills itself at its 4th compute: mid-way through a
    prompt of 12 micro-batches): ENDPOINT_FAILED naming that worker, kind
    closed, no logits, no KV rows kept, the other worker not latched, and the
    latch fails the next decode fast."""
    fault = ("--test-fault", "cmd=GRAPH_COMPUTE|GRAPH_RECOMPUTE,after=3,point=compute,action=kill")
    ws = [DaemonProcess("-t", "1", *(fault if i == victim else ())) for i in range(2)]
    try:
        eps = [w.endpoint for w in ws]
        with Coordinator(eps, model=model, n_ctx=N_CTX, micro_batch=MICRO) as c:
            ids = [int(x) for x in np.random.default_rng(3).integers(3, 290, 12 * MICRO)]
            code = c.decode(Batch.single(ids, 0, all_logits=True))
            assert code is DecodeResult.ENDPOINT_FAILED, (code, c.last_error)
            assert c.last_failed_endpoint == eps[victim] and c.last_cause == "closed", c.last_error
            assert "closed the connection" in c.last_error, c.last_error
            with pytest.raises(Exception):
                c.logits(-1)
            assert c.kv.used() == 0
            assert [f.endpoint for f in c.failed_endpoints()] == [eps[victim]]
            assert c.decode(Batch.single(ids[:4], 0)) is DecodeResult.ENDPOINT_FAILED
            assert "latched" in c.last_error and c.last_failed_endpoint == eps[victim]
            assert c._decoder.gate.in_flight == []
    finally:
        for w in ws:
            w.stop()


def test_compute_failure_in_one_micro_batch_fails_the_decode(model, workers):
    """NaN logits (row 260 of the head is NaN) in every micro-batch's head:
    COMPUTE_FAILED, nothing latched, the rows rolled back, and the coordinator
    decodes the next batch normally."""
    import tempfile
    path = write_tiny_llama(tempfile.mkdtemp() + "/tiny-nan.gguf", seed=0, head="nan")
    with Coordinator([w.endpoint for w in workers], model=path, n_ctx=N_CTX, micro_batch=MICRO) as c:
        ids = [int(x) for x in np.random.default_rng(4).integers(3, 290, 4 * MICRO)]
        assert c.decode(Batch.single(ids, 0, all_logits=True)) is DecodeResult.COMPUTE_FAILED
        assert "NaN" in c.last_error and c.failed_endpoints() == [] and c.kv.used() == 0
        with pytest.raises(Exception):
            c.logits(-1)
        assert c.decode(Batch.single(ids, 0), greedy=True) is DecodeResult.COMPUTE_FAILED  # the sums are checked
        assert c.kv.used() == 0


def test_a_failed_compute_mid_linked_prompt_fails_it_without_latching(model):
    """B's compute process dies at its 3rd compute, mid-way through a prompt
    whose micro-batches all went out over step links at once: COMPUTE_FAILED
    naming B, nothing latched, the rows rolled back, B's later waits
    cancelled, and the same prompt decodes afterwards as on healthy workers."""
    fault = ("--test-fault", "cmd=GRAPH_COMPUTE|GRAPH_RECOMPUTE,after=2,point=compute,action=crash-compute")
    ws = [DaemonProcess("-t", "1"), DaemonProcess("-t", "1", *fault)]
    try:
        eps = [w.endpoint for w in ws]
        ids = [int(x) for x in np.random.default_rng(6).integers(3, 290, 6 * MICRO)]
        with Coordinator(eps, model=model, n_ctx=N_CTX, micro_batch=MICRO, head_split=False) as c:
            assert c.decode(Batch.single(ids, 0)) is DecodeResult.COMPUTE_FAILED
            assert c.last_failed_endpoint == eps[1] and "INPUT_MISSING" not in c.last_error, c.last_error
            assert c.failed_endpoints() == [] and c.kv.used() == 0
            assert c.decode(Batch.single(ids, 0)) is OK, c.last_error
            assert c.stats["linked_steps"] == 6
            got = c.logits(-1).copy()
        with Coordinator(eps, model=model, n_ctx=N_CTX, micro_batch=MICRO, head_split=False,
                         step_links=False) as c:
            assert c.decode(Batch.single(ids, 0)) is OK, c.last_error
            assert np.array_equal(got, c.logits(-1))
    finally:
        for w in ws:
            w.stop()


# ---------------------------------------------------------------- resuming
def test_resume_replays_pipelined_steps_exactly(model, tmp_path):
    """Resuming with pipelining on: three sequences' prompts in chunks, then
    steps of a token each in two groups; kill -9 of the second worker at seeded
    random steps, restarted 0.5 s later: every step's logits are the bits of
    the run without faults (the journal replays the micro-batches as decoded)."""
    import random

    from conftest import WorkerSet

    w = WorkerSet(tmp_path, 2)
    try:
        with Coordinator([w.endpoint(0), w.endpoint(1)], model=model, n_ctx=N_CTX, micro_batch=8,
                         liveness_timeout=1.0, resume_within=20.0) as c:
            def run(fault=None) -> list[np.ndarray]:
                c.kv_clear()
                rng = np.random.default_rng(6)
                prompts = [[int(x) for x in rng.integers(3, 290, 20 + 5 * s)] for s in range(3)]
                batch = Batch([t for p in prompts for t in p], [i for p in prompts for i in range(len(p))],
                              [[s] for s, p in enumerate(prompts) for _ in p],
                              [i == len(p) - 1 for p in prompts for i in range(len(p))])
                out = []
                for step in range(12):
                    if fault:
                        fault(step)
                    assert c.decode_resuming(batch) is OK, c.last_error
                    got = [c.logits(i).copy() for i in np.flatnonzero(batch.logits)]
                    out += got
                    nxt = [int(np.argmax(x)) for x in got]
                    at = [max(q for q, ids in zip(batch.pos, batch.seq_ids) if ids == [s]) + 1 for s in range(3)]
                    batch = Batch(nxt, at, [[s] for s in range(3)], [True] * 3)
                return out

            want = run()
            kill_at = sorted(random.Random(23).sample(range(0, 12), 3))

            def fault(step):
                if step in kill_at:
                    w.join()
                    w.kill(1, restart_after=0.5)
            got = run(fault)
            assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)), kill_at
            assert c.stats["resumes"] == 3 and c.stats["kv_rebuilds"] == 3, c.stats
            assert c.stats["micro_batches"] > c.stats["decodes"]  # the steps were cut
    finally:
        w.close()


def test_a_prompt_goes_linked_only_if_a_mailbox_holds_all_its_pieces():
    """Found by review: 16 pieces of 256 tokens of a 5120-wide model (80 MiB of
    hidden states) could overflow a next stage's 64 MiB mailbox and wait out
    the request timeout; such a step is relayed instead."""
    from types import SimpleNamespace

    from coordinator.decode.microbatch import MAX_LINKED_BYTES, linkable

    def pieces(n, tokens):
        return [SimpleNamespace(shape=SimpleNamespace(n_tokens=tokens), head_in_shares=False) for _ in range(n)]

    assert linkable(pieces(8, 64), 640)  # Gemma 3 270M's 512-token prompt: 1.3 MiB
    assert not linkable(pieces(16, 256), 5120)
    assert linkable(pieces(1, MAX_LINKED_BYTES // (4 * 4096)), 4096)
    assert not linkable(pieces(1, MAX_LINKED_BYTES // (4 * 4096) + 1), 4096)
    assert not linkable(pieces(17, 1), 640)
