"""coordinator/text/sampling.py against hand-computed values and a plain numpy
reference of llama.cpp's sampler chain (logit_bias, penalties, top_k,
typical_p, top_p, min_p, temperature; src/llama-sampling.cpp), without a model."""
from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator.text.sampling import Sampler, TokenLogprob, draw_index, token_logprobs

PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = np.log(PROBS).astype(np.float32)  # softmax(LOGITS) == PROBS


def sampler(**kw) -> Sampler:
    kw = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 0, **kw}
    return Sampler(kw.pop("temperature"), kw.pop("top_k"), kw.pop("top_p"), kw.pop("seed"), **kw)


def kept(s: Sampler, logits=LOGITS) -> set[int]:
    return {int(t) for t in s.candidates(s.adjusted(np.asarray(logits, np.float32)))}


# ------------------------------------------------------------ bias and penalties, by hand
def test_penalties_by_hand():
    """llama.cpp's penalties: a logit > 0 divided by repeat_penalty, <= 0 multiplied,
    then count x frequency_penalty + presence_penalty subtracted."""
    s = sampler(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    s.accept([0, 1, 0])  # token 0 twice, token 1 once
    z = s.adjusted(np.array([2.0, -1.0, 0.5, 3.0], np.float32))
    np.testing.assert_allclose(z, [2.0 / 2 - (2 * 0.5 + 0.25), -1.0 * 2 - (0.5 + 0.25), 0.5, 3.0], rtol=1e-6)


def test_the_penalty_window_is_the_last_n_tokens():
    s = sampler(repeat_penalty=2.0, repeat_last_n=2)
    s.accept([0, 1, 2])  # token 0 fell out of the window
    np.testing.assert_allclose(s.adjusted(np.ones(4, np.float32)), [1.0, 0.5, 0.5, 1.0])
    s = sampler(repeat_penalty=2.0, repeat_last_n=-1)  # every token
    s.accept(range(200))
    assert (s.adjusted(np.ones(300, np.float32))[:200] == 0.5).all()
    s = sampler(repeat_penalty=2.0, repeat_last_n=0)  # none
    s.accept([0])
    assert s.adjusted(np.ones(4, np.float32))[0] == 1.0


def test_sample_remembers_what_it_draws():
    s = sampler(temperature=0, presence_penalty=2.0)
    logits = np.array([1.0, 0.5, 0.0], np.float32)
    assert [s.sample(logits) for _ in range(3)] == [0, 1, 2]  # each drawn token loses 2 the next time


def test_logit_bias_adds_and_false_bans():
    s = sampler(logit_bias={1: 5.0, 3: -math.inf})
    z = s.adjusted(np.zeros(4, np.float32))
    assert list(z) == [0.0, 5.0, 0.0, -math.inf]
    assert 3 not in {s.sample(np.zeros(4, np.float32)) for _ in range(200)}


def test_adjusted_leaves_the_logits_alone_when_nothing_applies():
    logits = np.arange(4, dtype=np.float32)
    assert sampler().adjusted(logits) is logits
    s = sampler(repeat_penalty=1.5)
    assert s.adjusted(logits) is logits  # penalties with nothing seen yet
    s.accept([3])
    assert s.adjusted(logits) is not logits and logits[3] == 3.0  # a copy, the caller's array untouched


def test_greedy_honours_bias_and_penalties():
    logits = np.array([1.0, 5.0, 2.0], np.float32)
    assert sampler(temperature=0).sample(logits) == 1
    assert sampler(temperature=0, logit_bias={1: -100}).sample(logits) == 2
    s = sampler(temperature=0, repeat_penalty=10.0)
    s.accept([1, 1])
    assert s.sample(logits) == 2  # 5 / 10 = 0.5 < 2
    assert sampler(temperature=0).greedy_bans() == frozenset()  # a worker's argmax does
    for kw in ({"logit_bias": {1: 1.0}}, {"repeat_penalty": 1.1}, {"presence_penalty": 0.1},
               {"typical_p": 0.5}, {"temperature": 0.7}):
        assert sampler(**dict({"temperature": 0}, **kw)).greedy_bans() is None, kw
    assert sampler(temperature=0, repeat_penalty=1.1, repeat_last_n=0).greedy_bans() == frozenset()


def test_a_greedy_sampler_that_only_bans_takes_the_best_token_it_allows():
    """greedy_bans: the tokens a sampler never takes when it otherwise takes the highest logit
    (None when it needs the logits); take_best: from a row's best tokens, best first, what
    sample() takes from the logits."""
    logits = np.array([1.0, 5.0, 2.0, 4.0, 3.0], np.float32)
    best = np.argsort(-logits, kind="stable")  # 1, 3, 4, 2, 0
    assert sampler(temperature=0).greedy_bans() == frozenset()
    banned = sampler(temperature=0, logit_bias={1: -np.inf, 3: -np.inf})
    assert banned.greedy_bans() == {1, 3}
    assert banned.take_best(best) == banned.sample(logits) == 4
    with pytest.raises(ValueError, match="every one of the 2 best tokens is banned"):
        banned.take_best(best[:2])
    for kw in ({"logit_bias": {1: -5.0}}, {"logit_bias": {1: -np.inf, 2: 1.0}}, {"repeat_penalty": 1.1},
               {"typical_p": 0.5}, {"temperature": 0.7}):
        assert sampler(**dict({"temperature": 0}, **kw)).greedy_bans() is None, kw


# ------------------------------------------------------------ the filters, by hand
def test_top_k():
    assert kept(sampler(top_k=2)) == {0, 1}
    assert kept(sampler(top_k=0)) == {0, 1, 2, 3}
    assert kept(sampler(top_k=10)) == {0, 1, 2, 3}


@pytest.mark.parametrize("top_p, want", [(0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_smallest_prefix_reaching_it(top_p, want):
    assert kept(sampler(top_p=top_p)) == want


@pytest.mark.parametrize("min_p, want", [(0.05, {0, 1, 2, 3}), (0.25, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0})])
def test_min_p_relative_to_the_most_likely(min_p, want):
    assert kept(sampler(min_p=min_p)) == want


def test_typical_p_by_hand():
    """Entropy H = 1.1421 nats; |-ln p - H| = 0.449, 0.062, 0.755, 1.854: the most
    typical is token 1, then 0, 2, 3; their masses add up 0.3, 0.8, 0.95, 1."""
    h = -(PROBS * np.log(PROBS)).sum()
    assert abs(h - 1.14212) < 1e-4
    assert kept(sampler(typical_p=0.2)) == {1}
    assert kept(sampler(typical_p=0.5)) == {0, 1}
    assert kept(sampler(typical_p=0.9)) == {0, 1, 2}
    assert kept(sampler(typical_p=1.0)) == {0, 1, 2, 3}
    # the only filter that can drop the most likely token: greedy then takes the best of what is left
    assert sampler(temperature=0, typical_p=0.2).sample(LOGITS) == 1


def test_min_keep():
    assert kept(sampler(top_p=0.4, min_keep=3)) == {0, 1, 2}
    assert kept(sampler(min_p=0.9, min_keep=2)) == {0, 1}
    assert kept(sampler(typical_p=0.2, min_keep=2)) == {0, 1}


def test_the_filters_see_untempered_logits_and_the_temperature_comes_last():
    """llama.cpp's order: top_p on the softmax of the logits themselves, the temperature after."""
    s = sampler(top_p=0.75, temperature=2.0)
    ids, p = s.distribution(LOGITS)
    assert list(ids) == [0, 1]
    want = np.exp(LOGITS[:2] / 2.0)
    np.testing.assert_allclose(p, want / want.sum(), rtol=1e-6)
    ids, p = sampler(temperature=0, top_k=3).distribution(LOGITS)
    assert list(ids) == [0] and list(p) == [1.0]


def test_draws_follow_the_distribution():
    s = sampler(temperature=1.0, seed=5)
    counts = np.bincount([s.sample(LOGITS) for _ in range(4000)], minlength=4) / 4000
    np.testing.assert_allclose(counts, PROBS, atol=0.03)


def test_draw_index_is_numpys_choice():
    """A seed gives the draws numpy's Generator.choice gave before draw_index replaced it (whole vocabularies
    and small candidate sets, peaked and flat), and leaves the generator in the same state."""
    rng = np.random.default_rng(0)
    for size, scale in ((262144, 3.0), (262144, 0.01), (40, 5.0), (2, 1.0), (1, 1.0)):
        z = rng.standard_normal(size) * scale
        p = np.exp(z - z.max())
        p /= p.sum()
        ours, theirs = np.random.default_rng(size), np.random.default_rng(size)
        assert [draw_index(ours, p) for _ in range(200)] == [int(theirs.choice(size, p=p)) for _ in range(200)]
        assert ours.random() == theirs.random()


def test_the_seed_fixes_the_draws_and_fork_keeps_the_settings():
    logits = np.random.default_rng(1).normal(size=50).astype(np.float32)
    a = [sampler(seed=9, top_k=20).sample(logits) for _ in range(1)]
    s1, s2 = sampler(seed=9, top_k=20), sampler(seed=9, top_k=20)
    assert [s1.sample(logits) for _ in range(30)] == [s2.sample(logits) for _ in range(30)]
    assert a[0] == sampler(seed=9, top_k=20).sample(logits)
    base = sampler(top_k=7, top_p=0.9, min_p=0.01, typical_p=0.95, repeat_penalty=1.2, repeat_last_n=16,
                   frequency_penalty=0.1, presence_penalty=0.2, logit_bias={2: 1.5}, min_keep=2, seed=1)
    fork = base.fork(11, ban=[4])
    for name in ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n",
                 "frequency_penalty", "presence_penalty", "min_keep"):
        assert getattr(fork, name) == getattr(base, name), name
    assert fork.logit_bias == {2: 1.5, 4: -math.inf} and base.logit_bias == {2: 1.5} and fork.seed == 11


@pytest.mark.parametrize("kw, message", [
    ({"min_p": 1.5}, "min_p must be a finite number in [0.0, 1.0], not 1.5"),
    ({"typical_p": float("nan")}, "typical_p must be a finite number in [0.0, 1.0], not nan"),
    ({"repeat_penalty": 0}, "repeat_penalty must be a finite number in (0.0, inf], not 0"),
    ({"repeat_last_n": -2}, "repeat_last_n must be an integer >= -1 (-1: every token, 0: none), not -2"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty must be a finite number, not inf"),
    ({"min_keep": -1}, "min_keep must be an integer >= 0, not -1"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias keys must be token ids, not 'a'"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias values must be numbers (-inf bans a token), not nan"),
])
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(ValueError) as info:
        sampler(**kw)
    assert str(info.value) == message


# ------------------------------------------------------------ against a plain reference of the chain
def reference_candidates(z: np.ndarray, top_k: int, typical_p: float, top_p: float, min_p: float,
                         min_keep: int) -> set[int]:
    """llama.cpp's filters written out the slow way: sort everything, walk lists."""
    keep = max(min_keep, 1)
    cand = sorted(range(z.size), key=lambda t: (-z[t], t))
    if 0 < top_k < len(cand):
        cand = cand[:top_k]

    def probs(ids):
        v = np.array([z[t] for t in ids], np.float64)
        e = np.exp(v - v.max())
        return e / e.sum()
    if typical_p < 1 and len(cand) > keep:
        p = probs(cand)
        h = -sum(pi * math.log(pi) for pi in p if pi > 0)
        order = sorted(range(len(cand)), key=lambda i: abs(-math.log(p[i]) - h))
        mass, last = 0.0, len(cand)
        for i, j in enumerate(order):
            mass += p[j]
            if mass > typical_p and i + 1 >= keep:
                last = i + 1
                break
        cand = sorted((cand[j] for j in order[:last]), key=lambda t: (-z[t], t))
    if top_p < 1 and len(cand) > keep:
        p = probs(cand)
        mass, last = 0.0, len(cand)
        for i, pi in enumerate(p):
            mass += pi
            if mass >= top_p and i + 1 >= keep:
                last = i + 1
                break
        cand = cand[:last]
    if min_p > 0 and len(cand) > keep:
        top = max(z[t] for t in cand)
        left = [t for t in cand if z[t] >= top + math.log(min_p)]
        cand = left if len(left) >= keep else cand[:keep]
    return set(cand)


@pytest.mark.parametrize("case", range(40))
def test_candidates_match_the_reference(case):
    rng = np.random.default_rng(case)
    n = int(rng.choice([7, 60, 1000]))
    z = (rng.normal(size=n) * rng.uniform(0.5, 4)).astype(np.float32)
    kw = {"top_k": int(rng.choice([0, 1, 5, 40])), "typical_p": float(rng.choice([1.0, 0.3, 0.9])),
          "top_p": float(rng.choice([1.0, 0.5, 0.95])), "min_p": float(rng.choice([0.0, 0.05, 0.2])),
          "min_keep": int(rng.choice([0, 1, 3]))}
    assert kept(sampler(**kw), z) == reference_candidates(z.astype(np.float64), **kw), kw


def test_top_p_over_a_flat_vocabulary_sorts_past_the_first_guess():
    """top_p over a whole vocabulary sorts the highest 256 first; a flat one needs more."""
    z = np.random.default_rng(3).normal(scale=0.01, size=20000).astype(np.float32)
    got = kept(sampler(top_p=0.9), z)
    assert len(got) > 256 and got == reference_candidates(z.astype(np.float64), 0, 1.0, 0.9, 0.0, 0)


# ------------------------------------------------------------ logprobs
def test_token_logprobs_are_the_models_log_softmax():
    logits = np.array([2.0, 1.0, 3.0, 1.0], np.float32)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    lp, top = token_logprobs(logits, 1, 3)
    assert abs(lp - ref[1]) < 1e-12
    assert [t for t, _ in top] == [2, 0, 1]  # most likely first; the tie 1/3 by id
    np.testing.assert_allclose([v for _, v in top], ref[[2, 0, 1]], rtol=1e-12)
    assert token_logprobs(logits, 0, 0) == (pytest.approx(ref[0]), [])
    assert token_logprobs(logits, None, 9)[0] is None and len(token_logprobs(logits, None, 9)[1]) == 4
    big = np.random.default_rng(0).normal(size=262144).astype(np.float32) * 5  # Gemma's vocabulary
    lp, top = token_logprobs(big, int(np.argmax(big)), 5)
    assert top[0] == (int(np.argmax(big)), pytest.approx(lp)) and math.isclose(
        np.exp([v for _, v in token_logprobs(big, None, big.size)[1]]).sum(), 1.0, rel_tol=1e-9)
    assert TokenLogprob(5, None).top == () and TokenLogprob(5, -1.0, ((5, -1.0),), 3).offset == 3


def test_top_k_ids_are_the_k_highest_in_id_order_with_ties_to_the_lowest_ids():
    """The sampler's top_k cut: exactly k ids, ascending, the k highest logits, and where the k-th
    value repeats past the cut, the lowest ids of it (the draw's order of equal logits follows)."""
    from coordinator.text.sampling import top_k_ids

    rng = np.random.default_rng(11)
    for trial in range(400):
        n = int(rng.integers(2, 3000))
        k = int(rng.integers(1, n))
        z = rng.integers(-4, 4, n).astype(np.float32) if trial % 2 else rng.normal(size=n).astype(np.float32)
        if trial % 5 == 0:
            z[rng.integers(0, n, n // 3)] = -np.inf  # banned tokens
        ids = top_k_ids(z, k)
        assert ids.size == k and (np.diff(ids) > 0).all(), (n, k)
        assert sorted(ids.tolist()) == sorted(np.lexsort((np.arange(n), -z))[:k].tolist()), (n, k)
