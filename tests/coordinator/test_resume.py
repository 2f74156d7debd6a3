"""Resuming through the loss of a worker (Coordinator(resume_within=...),
docs/failure-semantics.md "Resuming"): real daemons, real signals, and the
tokens (and logits, bit for bit) compared with a run without faults."""
from __future__ import annotations

import asyncio
import hashlib
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import SLACK, DaemonProcess, WorkerSet
from coordinator.api import Batch, Coordinator, DecodeError, DecodeResult
from coordinator.text.sampling import Sampler

from tiny_models import write_tiny_llama

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

OK, ENDPOINT_FAILED = DecodeResult.OK, DecodeResult.ENDPOINT_FAILED
LIVENESS = 1.0
PROMPT = "water"  # the tiny model's greedy text after it runs 24 tokens without an end of generation
N_GEN = 24
N_CTX = 64
RESTART_AFTER = 0.5
KILLED = re.compile(r"closed the connection")  # how a kill -9 reaches us, by FIN or by RST


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", seed=0)


@pytest.fixture
def cluster(tmp_path_factory):
    made = []

    def make(n: int) -> WorkerSet:
        made.append(WorkerSet(tmp_path_factory.mktemp("tensor-cache"), n))
        return made[-1]

    yield make
    for c in made:
        c.close()


def decode_run(c: Coordinator, n: int, sampled: bool, fault=None, prompt: str = PROMPT):
    """n tokens after `prompt` by decode_resuming, greedy (the workers' argmax)
    or sampled (seeded, from the logits); `fault(step)` runs before each step's
    decode. The token ids, and the logits when sampled."""
    c.kv_clear()
    ids = c.tokenize(prompt)
    sampler = Sampler(0.9, 40, 0.95, seed=7)
    tokens, logits, pos, pending = [], [], 0, ids
    for step in range(n):
        if fault:
            fault(step)
        code = c.decode_resuming(Batch.single(pending, pos), greedy=not sampled)
        assert code == OK, c.last_error
        pos += len(pending)
        if sampled:
            logits.append(c.logits(-1).copy())
            tokens.append(sampler.sample(logits[-1]))
        else:
            tokens.append(c.token(-1))
        pending = [tokens[-1]]
    return tokens, logits


def coordinator(model, endpoints, **kw) -> Coordinator:
    kw = {"split": [1] * len(endpoints), "n_ctx": N_CTX, "liveness_timeout": LIVENESS, "resume_within": 20.0,
          **kw}
    return Coordinator(endpoints, model=model, **kw)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_kill_and_restart_at_random_steps_gives_the_same_tokens(model, cluster, sampled):
    """kill -9 the second worker at three seeded random steps, restart it on its
    port 0.5 s later: the same tokens, and (sampled) the same logits bit for bit."""
    w = cluster(2)
    with coordinator(model, [w.endpoint(0), w.endpoint(1)]) as c:
        want_tokens, want_logits = decode_run(c, N_GEN, sampled)
        kill_at = sorted(random.Random(17 + sampled).sample(range(1, N_GEN), 3))

        def fault(step):
            if step in kill_at:
                w.join()  # the previous restart is done
                w.kill(1, restart_after=RESTART_AFTER)
        tokens, logits = decode_run(c, N_GEN, sampled, fault)
        assert tokens == want_tokens, kill_at
        assert all(np.array_equal(a, b) for a, b in zip(logits, want_logits))
        assert c.stats["resumes"] == 3 and c.stats["kv_rebuilds"] == 3, c.stats
        assert c.stats["replayed_tokens"] > 0 and c.needs_refeed() == [] and c.failed_endpoints() == []


def test_stream_pauses_and_gives_the_same_text(model, cluster):
    """stream(): the worker holding the last layers (and half the head) is
    killed after the 4th piece and back 0.5 s later; the text is the same."""
    w = cluster(2)
    with coordinator(model, [w.endpoint(0), w.endpoint(1)]) as c:
        want = c.generate(PROMPT, max_tokens=N_GEN)
        got = []
        for i, piece in enumerate(c.stream(PROMPT, max_tokens=N_GEN)):
            got.append(piece)
            if i == 3:
                w.kill(1, restart_after=RESTART_AFTER)
        assert "".join(got) == want
        assert c.stats["resumes"] == 1


def test_astream_pauses_and_gives_the_same_seeded_text(model, cluster):
    w = cluster(2)
    with coordinator(model, [w.endpoint(0), w.endpoint(1)]) as c:
        want = c.generate(PROMPT, max_tokens=N_GEN, temperature=0.8, seed=3)

        async def go():
            got = []
            async for piece in c.astream(PROMPT, max_tokens=N_GEN, temperature=0.8, seed=3):
                got.append(piece)
                if len(got) == 2:
                    w.kill(0, restart_after=RESTART_AFTER)  # the first worker this time
            return "".join(got)
        assert asyncio.run(asyncio.wait_for(go(), 60)) == want
        assert c.stats["resumes"] == 1


def test_not_back_within_resume_within_fails_with_the_original_cause(model, cluster):
    """No restart: after resume_within the stream raises the original
    ENDPOINT_FAILED (the kill), emits nothing more, and once the worker is back
    the next generation gives the fault-free text."""
    w = cluster(2)
    within = 1.5
    with coordinator(model, [w.endpoint(0), w.endpoint(1)], resume_within=within) as c:
        want = c.generate(PROMPT, max_tokens=N_GEN)
        got = []
        with pytest.raises(DecodeError) as err:
            for i, piece in enumerate(c.stream(PROMPT, max_tokens=N_GEN)):
                got.append(piece)
                if i == 3:
                    killed = time.monotonic()  # before kill(): the bound counts from the failure, which it may see first
                    w.kill(1)
        waited = time.monotonic() - killed
        assert err.value.code == ENDPOINT_FAILED and err.value.endpoint == w.endpoint(1)
        assert err.value.cause == "closed" and KILLED.search(err.value.message), err.value.message
        assert within <= waited < within * SLACK, waited
        assert want.startswith("".join(got)) and len(got) == 4
        assert c.health()["status"] == "reconnecting"
        w.restart(1)
        deadline = time.monotonic() + 20 * SLACK
        while c.failed_endpoints() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.failed_endpoints() == []
        assert c.generate(PROMPT, max_tokens=N_GEN) == want


def test_stopped_then_continued_worker_resumes(model, cluster):
    """SIGSTOP: detected by the liveness bound, the connection dropped; SIGCONT
    1.5 s later and the reconnect finds the worker: the same text."""
    w = cluster(2)
    with coordinator(model, [w.endpoint(0), w.endpoint(1)], connect_timeout=1.0) as c:
        want = c.generate(PROMPT, max_tokens=N_GEN)
        got = []
        for i, piece in enumerate(c.stream(PROMPT, max_tokens=N_GEN)):
            got.append(piece)
            if i == 2:
                w.workers[1].signal(signal.SIGSTOP)
                timer = threading.Timer(LIVENESS + 1.5, w.workers[1].signal, (signal.SIGCONT,))
                timer.start()
        timer.join()
        assert "".join(got) == want
        assert c.stats["resumes"] == 1


def test_spare_takes_over_and_several_losses_in_a_row(model, cluster):
    """A worker that does not come back: the spare takes its stage (layers and
    head rows) and the tokens are the same. Then the spare dies too, the first
    worker is back on its port by then and takes the stage back as a spare."""
    w = cluster(3)
    with coordinator(model, [w.endpoint(0), w.endpoint(1)], spares=[w.endpoint(2)]) as c:
        want, _ = decode_run(c, N_GEN, False)
        layers = c.endpoints()[1]["layers"]

        def fault(step):
            if step == 5:
                w.kill(1)
            elif step == 12:
                assert c.health()["status"] == "degraded"
                w.restart(1)
                w.kill(2)
        tokens, _ = decode_run(c, N_GEN, False, fault)
        assert tokens == want
        assert c.stats["spare_takeovers"] == 2 and c.stats["resumes"] == 2, c.stats
        e = c.endpoints()[1]
        assert e["endpoint"] == w.endpoint(1) and e["layers"] == layers
        assert c.health()["status"] == "ok" and c.spares() == [w.endpoint(2)]


def test_spare_after_spare_took_it_over(model, cluster):
    """First the spare takes over, status degraded with spare_for."""
    w = cluster(3)
    with coordinator(model, [w.endpoint(0), w.endpoint(1)], spares=[w.endpoint(2)]) as c:
        want, _ = decode_run(c, N_GEN, False)
        tokens, _ = decode_run(c, N_GEN, False, lambda step: step == 3 and w.kill(1))
        assert tokens == want
        h = c.health()
        assert h["status"] == "degraded"
        assert h["endpoints"][1]["endpoint"] == w.endpoint(2) and h["endpoints"][1]["spare_for"] == w.endpoint(1)
        assert c.spares() == [w.endpoint(1)]


def wait_for(what, timeout: float = 20.0) -> None:
    """Until `what()` is true; bounded (`timeout` times SLACK)."""
    deadline = time.monotonic() + timeout * SLACK
    while not what():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what.__doc__ or what}"
        time.sleep(0.05)


def test_stage_moves_back_home_when_its_worker_returns(model, cluster):
    """The spare took the stage; once its own worker is back the stage moves
    back there between two steps (KV rows replayed: the same tokens), the
    spare's connection is closed (its buffers freed) and it is a spare again;
    health is ok, not degraded."""
    w = cluster(3)
    # relayed steps: with step links worker 0 would also hold a peer link to the spare (a client the
    # spare's log counts too), and this test counts the spare's clients to see the coordinator's closed
    with coordinator(model, [w.endpoint(0), w.endpoint(1)], spares=[w.endpoint(2)], spare_after=0.2,
                     step_links=False) as c:
        want, _ = decode_run(c, N_GEN, False)

        def fault(step):
            if step == 4:
                w.kill(1)
            elif step == 8:
                assert c.endpoints()[1]["endpoint"] == w.endpoint(2) and c.health()["status"] == "degraded"
                w.restart(1)
            elif step == 9:
                wait_for(lambda: c.endpoints()[1]["endpoint"] == w.endpoint(1))
        tokens, _ = decode_run(c, N_GEN, False, fault)
        assert tokens == want
        assert c.stats["spare_takeovers"] == 1 and c.stats["moves_home"] == 1 and c.stats["kv_rebuilds"] == 2
        assert c.health()["status"] == "ok" and c.spares() == [w.endpoint(2)]
        spare_log = w.workers[2].log_lines
        wait_for(lambda: sum("client disconnected" in x for x in spare_log)
                 == sum("client connected" in x for x in spare_log) == 1)
        # and it can take the stage over again
        tokens, _ = decode_run(c, N_GEN, False, lambda step: step == 3 and w.kill(1))
        assert tokens == want and c.endpoints()[1]["endpoint"] == w.endpoint(2)


def test_two_stages_lost_at_once_never_share_a_spare(model, cluster):
    """Both workers killed at the same step, one spare: one stage takes the
    spare, the other waits; the first worker comes back 2 s later and holds a
    stage again (its own, or the other one as a spare). Never two stages on one
    worker, never one stage resumed twice; the same tokens."""
    w = cluster(3)
    with coordinator(model, [w.endpoint(0), w.endpoint(1)], spares=[w.endpoint(2)], spare_after=0.2) as c:
        want, _ = decode_run(c, N_GEN, False)

        def fault(step):
            if step == 5:
                w.kill(0, 2.0)
                w.kill(1)
        tokens, _ = decode_run(c, N_GEN, False, fault)
        w.join()
        assert tokens == want
        holders = [e["endpoint"] for e in c.endpoints()]
        assert sorted(holders) == sorted([w.endpoint(0), w.endpoint(2)]), holders
        assert c.stats["kv_rebuilds"] == 1 and c.stats["resumes"] == 1, c.stats
        assert c.health()["status"] == "degraded"


@pytest.mark.parametrize("phase, fault, takeovers", [
    ("upload", "cmd=SET_TENSOR|SET_TENSOR_HASH,after=1,action=kill", 1),
    # it takes the weights, then its third compute, in the middle of the replay, kills it: it
    # is latched in turn and the second spare takes over from it
    ("replay", "cmd=GRAPH_COMPUTE|GRAPH_RECOMPUTE,after=2,action=kill", 2),
])
def test_a_spare_that_dies_during_takeover(model, cluster, phase, fault, takeovers):
    """The first spare is killed while it takes over (its upload, or the KV
    rebuild); the second takes the stage and the tokens are the same."""
    w = cluster(4)
    w.restart(2, "--test-fault", fault)
    with coordinator(model, [w.endpoint(0), w.endpoint(1)], spares=[w.endpoint(2), w.endpoint(3)]) as c:
        want, _ = decode_run(c, N_GEN, False)
        tokens, _ = decode_run(c, N_GEN, False, lambda step: step == 10 and w.kill(1))
        assert tokens == want
        assert c.endpoints()[1]["endpoint"] == w.endpoint(3)
        assert not w.workers[2].alive()
        assert c.stats["spare_takeovers"] == takeovers and c.stats["kv_rebuilds"] == 1, c.stats


def test_batched_sequences_with_removals_replay_exactly(model, cluster):
    """Steps that mix sequences, sequences removed and new ones started (as the
    HTTP server's batching does): after a kill and restart the logits of every
    later step are the same bits, and the journal kept only what live rows need."""
    w = cluster(2)
    rng = random.Random(5)
    script = []  # (new sequences this step, sequences removed before it)
    for step in range(30):
        script.append((rng.sample(range(4), rng.randint(0, 1)), rng.sample(range(4), rng.randint(0, 1))))

    def run(c, fault=None):
        c.kv_clear()
        pos, logits = {}, []
        for step, (start, remove) in enumerate(script):
            for s in remove:
                c.kv_seq_rm(s)
                pos.pop(s, None)
            if fault:
                fault(step)
            tokens, positions, seqs = [], [], []
            for s in sorted(set(pos) | set(start)):
                n = 3 if s not in pos else 1
                p0 = pos.get(s, 0)
                if p0 + n > 12:  # keep within n_ctx: the sequence starts over
                    c.kv_seq_rm(s)
                    p0 = 0
                tokens += [(17 * s + 5 * (p0 + k)) % 250 + 3 for k in range(n)]
                positions += list(range(p0, p0 + n))
                seqs += [[s]] * n
                pos[s] = p0 + n
            if not tokens:
                continue
            assert c.decode_resuming(Batch(tokens, positions, seqs, [True] * len(tokens))) == OK, c.last_error
            logits.append(c.logits(-1).copy())
        return logits

    with coordinator(model, [w.endpoint(0), w.endpoint(1)]) as c:
        want = run(c)
        got = run(c, lambda step: step in (11, 23) and w.kill(1, restart_after=RESTART_AFTER))
        w.join()
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
        assert c.stats["resumes"] == 2
        assert len(c._resume.journal) < 30  # pruned: steps of removed sequences are gone


# Over HTTP the client may read the first event after the server has sent them all, so the
# worker kills itself mid-stream: at its 4th compute after arm_self_kill().
SELF_KILL = "cmd=GRAPH_COMPUTE|GRAPH_RECOMPUTE,after=3,action=kill,armed=0"


def arm_self_kill(w, i: int, restart_after: float | None = None) -> None:
    """Arm worker i's SELF_KILL fault; with `restart_after`, start it again (without the
    fault) on its port that much after it died."""
    mark = len(w.workers[i].log_lines)
    w.workers[i].signal(signal.SIGUSR1)
    w.workers[i].wait_log("test fault armed", start=mark)
    if restart_after is not None:
        def restart():
            deadline = time.monotonic() + 30
            while w.workers[i].alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            w.restart(i, after=restart_after)
        t = threading.Thread(target=restart, daemon=True)
        t.start()
        w.restarts.append(t)


def test_cli_generate_resumes_through_a_killed_and_restarted_worker(model, cluster):
    """ggml-coordinator generate --resume-within: a worker killed in the
    middle of the generation and back 0.5 s later; it pauses (says so), exits
    0 and prints the text of the run without a fault."""
    w = cluster(2)
    w.restart(1, "--test-fault", SELF_KILL)
    cmd = [sys.executable, "-m", "coordinator", "generate", "--endpoints", f"{w.endpoint(0)},{w.endpoint(1)}",
           "-m", str(model), "-c", str(N_CTX), "-p", PROMPT, "-n", str(N_GEN)]
    run = dict(capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    want = subprocess.run(cmd, **run)
    assert want.returncode == 0 and want.stdout, want.stderr
    arm_self_kill(w, 1, RESTART_AFTER)
    got = subprocess.run(cmd + ["--resume-within", "20"], **run)
    w.join()
    assert got.returncode == 0, got.stderr
    assert "decode paused" in got.stderr, got.stderr  # the kill did hit the generation
    assert got.stdout == want.stdout


def test_a_failed_warm_up_leaves_its_worker_latched_and_the_start_goes_on(model, cluster, capfd):
    """Coordinator(warmup=True) with a worker that dies on its first compute: the start completes and
    logs the failed step, and the dead worker is latched and named, as after any failed decode."""
    w = cluster(2)
    w.restart(1, "--test-fault", "cmd=GRAPH_COMPUTE|GRAPH_RECOMPUTE,after=0,action=kill,armed=0")
    arm_self_kill(w, 1)
    with Coordinator([w.endpoint(0), w.endpoint(1)], model=model, n_ctx=N_CTX, warmup=True) as c:
        assert [f.endpoint for f in c.failed_endpoints()] == [w.endpoint(1)]
        assert "warm-up step failed" in "".join(capfd.readouterr())
        assert c.stats["decodes"] == 0 and c.kv_seq_pos_max(0) == -1
        assert c.decode(Batch.single([1, 2, 3], 0)) == DecodeResult.ENDPOINT_FAILED
        assert c.last_failed_endpoint == w.endpoint(1)


def test_http_stream_survives_a_killed_and_restarted_worker(model, cluster):
    """serve (resuming on by default): a worker killed during two streaming
    requests and back 0.5 s later; /health says degraded (200) meanwhile; both
    streams complete with no error event, the greedy one with the text it has
    alone without a fault."""
    from http_helpers import Server, get, stream, stream_text

    w = cluster(2)
    w.restart(1, "--test-fault", SELF_KILL)
    server = Server([w.endpoint(0), w.endpoint(1)], parallel=2, args=("-m", str(model)))
    try:
        url = server.url + "/v1/completions"
        greedy = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0}
        seeded = {"prompt": "one day", "max_tokens": 64, "temperature": 0.9, "seed": 4}
        want = stream_text(asyncio.run(stream(url, greedy)))

        async def scenario():
            first = asyncio.create_task(stream(url, greedy))
            second = asyncio.create_task(stream(url, seeded))
            seen = []
            while not first.done():
                status, body = await get(server.url + "/health")
                seen.append((status, body.get("status"), body.get("reasons")))
                await asyncio.sleep(0.05)
            return await first, await second, seen

        arm_self_kill(w, 1, RESTART_AFTER)
        first, second, seen = asyncio.run(scenario())
        w.join()
        for events in (first, second):
            assert not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
            assert events[-1] == "[DONE]"
        assert stream_text(first) == want
        assert all(status == 200 for status, _, _ in seen), seen
        assert any(s == "degraded" and any("resuming" in r for r in reasons) for _, s, reasons in seen), seen
        status, text = asyncio.run(get(server.url + "/metrics"))
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line and not line.startswith("#")}
        assert values["ggml_resumes_total"] >= 1 and values["ggml_replayed_tokens_total"] > 0, values
    finally:
        server.stop()


@pytest.mark.parametrize("kw, fragment", [
    ({"resume_within": 0}, "resume_within must be a positive number"),
    ({"resume_within": -1}, "resume_within must be a positive number"),
    ({"spares": ["127.0.0.1:1"]}, "spares need resume_within"),
    ({"resume_within": 5, "spares": ["nohost"]}, "nohost"),
    ({"resume_within": 5, "spare_after": -1}, "spare_after must be"),
])
def test_bad_resume_settings_are_refused_before_connecting(model, kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        Coordinator(["127.0.0.1:1"], model=model, **kw)  # nothing listens there: refused before connecting


def test_http_spare_takes_over_and_health_says_degraded(model, cluster):
    from http_helpers import Server, get, stream, stream_text

    w = cluster(3)
    w.restart(1, "--test-fault", SELF_KILL)
    server = Server([w.endpoint(0), w.endpoint(1)], parallel=2,
                    args=("-m", str(model), "--spares", w.endpoint(2)))
    try:
        body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0}
        want = stream_text(asyncio.run(stream(server.url + "/v1/completions", body)))
        arm_self_kill(w, 1)
        events = asyncio.run(stream(server.url + "/v1/completions", body))
        assert not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
        assert stream_text(events) == want
        status, health = asyncio.run(get(server.url + "/health"))
        assert status == 200 and health["status"] == "degraded", health
        assert health["reasons"] == [f"{w.endpoint(2)} holds the stage of {w.endpoint(1)} (spare)"], health
        assert [e.get("spare_for") for e in health["endpoints"]] == [None, w.endpoint(1)], health
        status, text = asyncio.run(get(server.url + "/metrics"))
        assert "ggml_spare_takeovers_total 1.0" in text and "ggml_resumes_total 1.0" in text
        # the web page's live view says so too (its watcher samples every 0.1 s)
        kinds, deadline = {}, time.monotonic() + 5 * SLACK
        while time.monotonic() < deadline and not {"spare_took_over", "resumed"} <= kinds.keys():
            status, view = asyncio.run(get(server.url + "/cluster"))
            assert status == 200, view
            kinds = {e["kind"]: e for e in view["events"]}
            time.sleep(0.2)
        assert kinds["spare_took_over"]["endpoint"] == w.endpoint(2), view["events"]
        assert kinds["spare_took_over"]["spare_for"] == w.endpoint(1), view["events"]
        assert kinds["resumed"]["resumes"] >= 1, view["events"]
    finally:
        server.stop()


def test_http_gives_up_after_resume_within_with_the_original_cause(model, cluster):
    from http_helpers import Server, get, stream

    w = cluster(2)
    w.restart(1, "--test-fault", SELF_KILL)
    server = Server([w.endpoint(0), w.endpoint(1)], parallel=2,
                    args=("-m", str(model), "--resume-within", "1.5"))
    try:
        arm_self_kill(w, 1)
        events = asyncio.run(stream(server.url + "/v1/completions",
                                    {"prompt": PROMPT, "max_tokens": 64, "temperature": 0}))
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == "ENDPOINT_FAILED", events[-3:]
        assert errors[0]["endpoint"] == w.endpoint(1) and KILLED.search(errors[0]["message"]), errors
        assert "latched" not in errors[0]["message"]  # the failure itself, not a later fast-fail
        assert events[-1] == "[DONE]"
        status, health = asyncio.run(get(server.url + "/health"))
        assert status == 503 and "endpoints failed" in health["reasons"], health
    finally:
        server.stop()


def test_journal_keeps_exactly_the_steps_live_rows_depend_on():
    """Pruning, on the KV bookkeeping alone: a step is kept while a live row,
    or a row a kept token attended to, was written by it."""
    from coordinator.decode.kv_cells import KVCells
    from coordinator.decode.kv_journal import StepJournal

    kv, journal = KVCells(32), StepJournal()

    def step(seq_tokens: dict[int, int]) -> None:
        """One step: n new tokens for each sequence, after its last position."""
        pos = [kv.seq_pos_max(s) + 1 + k for s, n in seq_tokens.items() for k in range(n)]
        seqs = np.array([1 << s for s, n in seq_tokens.items() for _ in range(n)], dtype=np.uint64)
        rows = kv.find_slot(len(pos))
        tok_pos = np.array(pos, dtype=np.int64)
        kv.assign(rows, tok_pos, seqs)
        mask, _ = kv.masks(kv.n_kv(), tok_pos, seqs)
        journal.record(np.zeros(len(pos), np.int32), rows, tok_pos, seqs, np.array([0], np.int32), True,
                       kv.n_kv(), mask, None, lambda: kv.pos >= 0)

    step({0: 3})  # 0: seq 0's prompt
    step({1: 2})  # 1: seq 1's prompt
    step({0: 1, 1: 1})  # 2: both
    step({1: 1})  # 3: seq 1 alone
    step({2: 2})  # 4: seq 2's prompt
    kv.seq_rm(1)
    kept = journal.prune(kv.pos >= 0)
    # seq 1's own steps go; the mixed step stays whole (seq 0's token in it is live)
    assert [len(s.tokens) for s in kept] == [3, 2, 2], [len(s.tokens) for s in kept]
    kv.seq_rm(0)
    assert [len(s.tokens) for s in journal.prune(kv.pos >= 0)] == [2]
    kv.seq_rm(2)
    assert journal.prune(kv.pos >= 0) == [] and len(journal) == 0


def test_a_reconnect_does_not_hash_the_weights_again(tmp_path):
    """The coordinator hashes each chunk of the model file once: a reconnect
    (or a spare's takeover) looks the stage up in the worker's tensor cache
    with the digests it has, and gives the same text."""
    d = DaemonProcess("-t", "1", "--cache", str(tmp_path / "cache"))
    try:
        with Coordinator([d.endpoint]) as c:  # the bundled Gemma 3 270M: chunks large enough to look up
            digests = c._loader.executor_options["digests"]
            hashed = digests.hashed
            text = c.generate("The capital of France is", max_tokens=8)
            c.reconnect(d.endpoint)
            stats = c._places[0].executor.load_stats
            assert stats["cache_hits"] == stats["lookups"] == hashed > 1, (stats, hashed)
            assert digests.hashed == hashed
            assert c.generate("The capital of France is", max_tokens=8) == text
    finally:
        d.stop()


def test_chunk_digests_follow_the_file_on_disk(tmp_path):
    """A model file changed on disk (another mtime, size or inode) is hashed
    afresh; the same file is not."""
    import os
    from types import SimpleNamespace

    from coordinator.cluster.executors import ChunkDigests

    path = tmp_path / "model.gguf"
    path.write_bytes(b"a" * 1000)
    model, digests = SimpleNamespace(path=path), ChunkDigests()
    chunk = path.read_bytes()[:500]
    first = digests.digest(digests.of_file(model), "w", 0, chunk)
    assert first == hashlib.sha256(chunk).hexdigest() and digests.hashed == 1
    assert digests.digest(digests.of_file(model), "w", 0, chunk) == first and digests.hashed == 1
    path.write_bytes(b"b" * 1000)
    os.utime(path, ns=(1, 1))  # another mtime, whatever the clock's granularity
    chunk = path.read_bytes()[:500]
    assert digests.digest(digests.of_file(model), "w", 0, chunk) == hashlib.sha256(chunk).hexdigest() != first
    assert digests.hashed == 2
