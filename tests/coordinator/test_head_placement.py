"""Where the output head runs, chosen per step from measured latency
(coordinator/decode/head_placement.py): split over the workers on loopback, the
last worker's share and the rest in the coordinator behind a slow link
(bench/delay_proxy.py), and the same logits whichever runs. Real daemons, real sockets."""
from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.delay_proxy import Link, ProxyThread  # noqa: E402
from coordinator.api import Batch, Coordinator, DecodeResult, default_model_path  # noqa: E402
from coordinator.decode.head_placement import HeadPlacement, checked_mode  # noqa: E402

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

PROMPT = "The capital of France is"
STEPS = 6  # decode steps after the prompt
# one-way delay that the head's saving must lose to: on a quiet machine a Gemma head shard takes ~5 ms
# (bench/bench_latency.py shows the choice at 20 ms), but on this 2-core machine loaded by other jobs 20-30 ms
FAR = 0.05


def trace(c: Coordinator, greedy_steps: int = 2) -> tuple[np.ndarray, list[int]]:
    """The logits of the prompt and of STEPS decode steps (each taking the argmax),
    then greedy steps' tokens: what a placement must not change."""
    ids = c.tokenize(PROMPT)
    assert c.decode(Batch.single(ids, 0)) is DecodeResult.OK, c.last_error
    logits = [c.logits(-1).copy()]
    for i in range(STEPS):
        assert c.decode(Batch.single([int(np.argmax(logits[-1]))], len(ids) + i)) is DecodeResult.OK, c.last_error
        logits.append(c.logits(-1).copy())
    tokens, pos = [int(np.argmax(logits[-1]))], len(ids) + STEPS
    for i in range(greedy_steps):
        assert c.decode(Batch.single([tokens[-1]], pos + i), greedy=True) is DecodeResult.OK, c.last_error
        tokens.append(c.token(-1))
    return np.stack(logits), tokens


def test_the_rule_compares_the_saved_compute_with_the_extra_hops():
    p = HeadPlacement("auto")
    assert p.choose((1, False), 1) == "split", "nothing measured yet: split, which measures the head"
    p.record_rtt("a", 0.002)
    p.record_rtt("b", 0.004)  # the slowest worker's median round trip: one way 2 ms
    assert p.choose((1, False), 1) == "split", "still no head timing"
    p.record_head((1, False), [0.004, 0.003])  # whole ~7 ms, split 4 ms: saves 3 ms
    assert p.one_way() == pytest.approx(0.002) and p.saved((1, False)) == pytest.approx(0.003)
    assert p.choose((1, False), 1) == "split", "4 ms + one 2 ms hop (step links) < 7 ms whole"
    assert p.choose((1, False), 2) == "whole", "4 ms + two 2 ms hops (relayed) > 7 ms whole"
    assert p.choose((8, False), 2) == "split", "8 output rows: not measured, so split"
    assert p.view()["changes"] == 2 and p.view()["steps_whole"] == 1
    for _ in range(8):
        p.record_rtt("b", 0.02)
    assert p.choose((1, False), 1) == "whole", "behind 10 ms one way: whole"
    assert p.choose((1, False), 1, whole_possible=False) == "split", "a last worker with only its share splits"
    assert p.view()["steps_whole"] == 2 and p.view()["choice"] == "split", "and it is counted as split"
    # a share here: measured once, then taken where it beats both (no extra hop over step links)
    assert p.choose((1, False), 1, here_possible=True) == "here", "not measured yet: here, which measures it"
    p.record_head((1, False), [0.0045, 0.003], "here")  # this process's rows 4.5 ms, the last worker's 3 ms
    assert p.choose((1, False), 1, here_possible=True) == "here", "4.5 ms < 7 ms whole < 4 ms + a 10 ms hop"
    assert p.choose((1, False), 2, here_possible=True) == "whole", "relayed: 3 ms + two 10 ms hops > 7 ms"
    p.record_head((1, False), [0.008, 0.003], "here")
    assert p.choose((1, False), 1, here_possible=True) == "here", "the least of the last steps counts"
    slow = HeadPlacement("auto")
    slow.record_rtt("a", 0.02)
    slow.record_head((1, False), [0.004, 0.003])
    slow.record_head((1, False), [0.009, 0.003], "here")  # a slow coordinator: here loses to whole
    assert slow.choose((1, False), 1, here_possible=True) == "whole"
    assert slow.view()["steps_here"] == 0 and p.view()["steps_here"] == 3
    least = 178e6 / 2 / 50e9  # Gemma 3's head over 2 workers saves at least 1.8 ms
    assert p.held_whole(int(178e6), 2), "10 ms one way: held"
    near = HeadPlacement("auto")
    near.record_rtt("a", 0.0002)
    assert not near.held_whole(int(178e6), 2) and near.held_whole(int(0.2e6), 2), (least, near.one_way())
    assert not HeadPlacement("split").held_whole(100, 2) and HeadPlacement("auto").held_whole(int(178e6), 2), \
        "only auto holds it; nothing measured yet: held"
    assert checked_mode(True) == "split" and checked_mode(False) == "whole" and checked_mode("auto") == "auto"
    with pytest.raises(ValueError):
        checked_mode("sideways")
    assert HeadPlacement("split").choose((1, False), 2, here_possible=True) == "split"
    assert HeadPlacement("whole").choose((1, False), 1, here_possible=True) == "whole"


@pytest.fixture(scope="module")
def gemma():
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def test_auto_splits_on_loopback_and_shares_the_head_with_the_coordinator_behind_a_slow_link(gemma, start_daemon):
    """Gemma 3's 262k-row head: split saves milliseconds, which a loopback hop
    (well under one) does not outweigh; behind FAR one way the split's extra hop
    does, so the last worker holds the whole head and this process the rows
    besides its share: a step computes the two shares at once, at no extra hop
    (taking the head whole would cost the other share's compute). The logits
    and tokens are the same bits every way, and as with the head always split."""
    a, b = start_daemon("-t", "1"), start_daemon("-t", "1")
    endpoints = [a.endpoint, b.endpoint]
    with Coordinator(endpoints, model=gemma, n_ctx=128) as c:
        assert c.head_placement()["mode"] == "auto"
        near, near_tokens = trace(c)
        head = c.head_placement()
        assert head["choice"] == "split", head
        assert head["saved_seconds"] > 2 * head["one_way_seconds"], head
        # a loopback hop (well under the 1.8 ms the split saves at least): the last worker holds only its share
        assert not head["whole_held"] or head["one_way_seconds"] > 1e-3, head
    link = Link(FAR, 0.002)
    with ProxyThread(a.endpoint, link, seed=1) as pa, ProxyThread(b.endpoint, link, seed=2) as pb:
        with Coordinator([pa.endpoint, pb.endpoint], model=gemma, n_ctx=128) as c:
            far, far_tokens = trace(c)
            head = c.head_placement()
            assert head["choice"] == "here" and head["whole_held"] and head["here_held"], head
            # the first steps of a shape measure it split, then here (a first compute is cold and slower)
            assert head["one_way_seconds"] >= FAR and head["steps_here"] >= STEPS - 3, head
            assert c.stats["linked_steps"] >= STEPS
    with Coordinator(endpoints, model=gemma, n_ctx=128, head_split=True) as c:
        split, split_tokens = trace(c)
        assert c.head_placement()["steps_whole"] == c.head_placement()["steps_here"] == 0
    assert np.array_equal(near, split) and np.array_equal(far, split)
    assert near_tokens == far_tokens == split_tokens


@pytest.mark.parametrize("links", [True, False], ids=["step-links", "relayed"])
def test_a_placement_that_changes_mid_sequence_keeps_the_logits(tiny_model, start_daemon, links):
    """The tiny model's head saves next to nothing, so auto measures it split on
    the first step, then shared with this process, and takes it whole after
    (on loopback too, unless a loaded machine makes the head slower than a
    hop): the steps of one sequence mix all three, and equal the head always
    split, always whole and always here bit for bit."""
    endpoints = [start_daemon("-t", "1").endpoint, start_daemon("-t", "1").endpoint]
    results = {}
    for mode in ("auto", True, False, "here"):
        with Coordinator(endpoints, model=tiny_model, n_ctx=64, head_split=mode, step_links=links) as c:
            results[mode] = trace(c, greedy_steps=4)
            head = c.head_placement()
            assert head["steps_split"] + head["steps_whole"] + head["steps_here"] == 1 + STEPS + 4, head
            if mode == "here":
                assert head["steps_here"] == 1 + STEPS + 4 and head["here_held"] and not head["whole_held"], head
            if mode == "auto":
                assert head["steps_split"] >= 2, "the first full-logits and greedy steps measure the head split"
                # a small head is held whole by the last worker, so the rest is held here too, and measured
                assert head["here_held"] and head["steps_here"] >= 2, head
    for mode in (True, False, "here"):
        assert np.array_equal(results["auto"][0], results[mode][0]), mode
        assert results["auto"][1] == results[mode][1], mode
