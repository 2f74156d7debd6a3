"""Token sampling, as llama.cpp's sampler chain defines it (src/llama-sampling.cpp,
common/sampling.cpp), in its default order:

    logit_bias, penalties, top_k, typical_p, top_p, min_p, temperature, then a draw

* logit_bias adds a bias to given tokens (-inf bans one: ignore_eos bans the
  end-of-generation tokens so).
* penalties: each token seen among the last `repeat_last_n` tokens (the prompt's
  included, as llama-server feeds it; -1: all of them) has its logit divided by
  `repeat_penalty` (multiplied if it is <= 0), then `frequency_penalty` x its count
  and `presence_penalty` subtracted.
* top_k keeps the k highest (0: all); typical_p the tokens whose -log p is
  closest to the entropy, until their mass exceeds typical_p; top_p the smallest
  prefix, highest first, whose mass reaches top_p; min_p the tokens with
  p >= min_p x p_max. Each keeps at least max(min_keep, 1) tokens; the masses are
  of the softmax of the candidates still in (before the temperature).
* temperature divides the logits of what is left; temperature 0 takes the
  highest (so bias and penalties still count; only typical_p can change which
  token that is, the other filters keep the highest).

One deviation: llama.cpp's typical sampler compares `i >= min_keep - 1` in an
unsigned type, so with min_keep 0 (its default) it keeps every token; here it
keeps at least one, which is what it means to do.

`token_logprobs` gives what a reply's logprobs show: the model's own
distribution (the log-softmax of the raw logits, before bias, penalties,
temperature or truncation), as llama-server reports them.
"""
from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

_TOP_P_FIRST = 256  # top_p over a whole vocabulary: sort only the highest first, more if they fall short
_FIT_CHECKS_MAX = 64  # a constrained draw checks at most this many candidates against the grammar, else masks


def _finite(name: str, value, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
        and math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        span = "" if lo is None and hi is None else \
            f" in {'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ValueError(f"{name} must be a finite number{span}, not {value!r}")
    return float(value)


def _int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, not {value!r}")
    return int(value)


class Sampler:
    """One sequence's sampler: its settings, its random state (`seed`) and the
    tokens its penalties look back at (`accept`; `sample` accepts what it draws)."""

    def __init__(self, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95, seed: int | None = None, *,
                 min_p: float = 0.0, typical_p: float = 1.0, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 logit_bias: Mapping[int, float] | None = None, min_keep: int = 0):
        if not temperature >= 0 or temperature == float("inf"):  # NaN fails too
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), not {temperature!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no limit), not {top_k!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {top_p!r}")
        self.temperature, self.top_k, self.top_p = temperature, int(top_k), top_p
        self.min_p = _finite("min_p", min_p, 0.0, 1.0)
        self.typical_p = _finite("typical_p", typical_p, 0.0, 1.0)
        self.repeat_penalty = _finite("repeat_penalty", repeat_penalty, 0.0, lo_open=True)
        if isinstance(repeat_last_n, bool) or not isinstance(repeat_last_n, (int, np.integer)) or repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be an integer >= -1 (-1: every token, 0: none), "
                             f"not {repeat_last_n!r}")
        self.repeat_last_n = int(repeat_last_n)
        self.frequency_penalty = _finite("frequency_penalty", frequency_penalty)
        self.presence_penalty = _finite("presence_penalty", presence_penalty)
        self.min_keep = _int("min_keep", min_keep, 0)
        self.logit_bias: dict[int, float] = {}
        for token, bias in (logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids, not {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias) or bias == math.inf:
                raise ValueError(f"logit_bias values must be numbers (-inf bans a token), not {bias!r}")
            self.logit_bias[int(token)] = self.logit_bias.get(int(token), 0.0) + float(bias)
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        # structured output (coordinator/text/constrained.py): tokens it does not allow are -inf before the chain
        self.constraint = None
        self._recent: deque[int] = deque()
        self._counts: Counter[int] = Counter()

    def fork(self, seed: int | None, ban: Iterable[int] = ()) -> "Sampler":
        """A new sampler with these settings, another seed, and `ban` (ids) never drawn."""
        bias = dict(self.logit_bias)
        for token in ban:
            bias[int(token)] = -math.inf
        return Sampler(self.temperature, self.top_k, self.top_p, seed, min_p=self.min_p, typical_p=self.typical_p,
                       repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n,
                       frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                       logit_bias=bias, min_keep=self.min_keep)

    # ------------------------------------------------------------ state
    @property
    def penalizes(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)

    def greedy_bans(self) -> frozenset[int] | None:
        """The tokens this sampler never takes, when it otherwise takes the highest raw
        logit (temperature 0, typical_p 1, no penalties, no constraint, every logit_bias
        -inf, as ignore_eos sets): its token is then the best one not among them, and a
        worker's few best tokens do instead of the logits. None when it needs the logits."""
        if self.temperature != 0 or self.typical_p < 1.0 or self.penalizes or self.constraint is not None \
                or any(bias != -math.inf for bias in self.logit_bias.values()):
            return None
        return frozenset(self.logit_bias)

    def take_best(self, best: Iterable[int]) -> int:
        """What sample() takes from logits whose highest tokens are `best`, best first (greedy_bans
        is not None, and `best` holds more tokens than it bans): the first it does not ban."""
        best = [int(token) for token in best]
        for token in best:
            if token not in self.logit_bias:
                return token
        raise ValueError(f"every one of the {len(best)} best tokens is banned")

    def accept(self, tokens: Iterable[int]) -> None:
        """Tokens the penalties look back at: the prompt's, then each one drawn."""
        if not self.penalizes:
            return
        for token in tokens:
            if self.repeat_last_n > 0 and len(self._recent) >= self.repeat_last_n:
                old = self._recent.popleft()
                self._counts[old] -= 1
                if not self._counts[old]:
                    del self._counts[old]
            self._recent.append(int(token))
            self._counts[int(token)] += 1

    # ------------------------------------------------------------ the chain
    def adjusted(self, logits: np.ndarray) -> np.ndarray:
        """The logits after logit_bias and the penalties (a copy only when they change something)."""
        touched = self.logit_bias or (self._counts if self.penalizes else None)
        if not touched:
            return logits
        z = np.array(logits, dtype=np.float32)
        n = z.size
        for token, bias in self.logit_bias.items():
            if token < n:
                z[token] += bias
        if self.penalizes and self._counts:
            ids = np.fromiter((t for t in self._counts if t < n), dtype=np.int64)
            counts = np.array([self._counts[int(t)] for t in ids], dtype=np.float32)
            v = z[ids]
            v = np.where(v <= 0, v * np.float32(self.repeat_penalty), v / np.float32(self.repeat_penalty))
            v -= counts * np.float32(self.frequency_penalty) + np.float32(self.presence_penalty)
            z[ids] = v
        return z

    def candidates(self, z: np.ndarray) -> np.ndarray:
        """The token ids top_k, typical_p, top_p and min_p leave, in no particular order."""
        keep = max(self.min_keep, 1)
        n = z.size
        ids = np.arange(n) if not 0 < self.top_k < n else top_k_ids(z, self.top_k)
        if self.typical_p < 1.0 and ids.size > keep:
            ids = self._typical(z, ids, keep)
        if self.top_p < 1.0 and ids.size > keep:
            ids = self._top_p(z, ids, keep)
        if self.min_p > 0.0 and ids.size > keep:
            v = z[ids]
            kept = ids[v >= v.max() + np.float32(math.log(self.min_p))]
            if kept.size >= keep:
                ids = kept
            else:  # the keep highest
                ids = ids[np.argsort(-v, kind="stable")[:keep]]
        return ids

    def _typical(self, z: np.ndarray, ids: np.ndarray, keep: int) -> np.ndarray:
        p = _softmax(z[ids])
        with np.errstate(divide="ignore"):
            nlp = -np.log(p)
        entropy = float(np.sum(p[p > 0] * nlp[p > 0]))
        order = np.argsort(np.abs(nlp - entropy), kind="stable")
        mass = np.cumsum(p[order])
        over = np.flatnonzero(mass[keep - 1:] > self.typical_p)
        last = keep + int(over[0]) if over.size else ids.size
        return ids[order[:last]]

    def _top_p(self, z: np.ndarray, ids: np.ndarray, keep: int) -> np.ndarray:
        v = z[ids].astype(np.float64)
        p = np.exp(v - v.max())
        p /= p.sum()
        m = min(ids.size, max(_TOP_P_FIRST, keep))
        while True:  # sort only the highest m: the prefix reaching top_p is in them unless their mass falls short
            top = np.argpartition(-p, m - 1)[:m] if m < ids.size else np.arange(ids.size)
            top = top[np.argsort(-p[top], kind="stable")]
            mass = np.cumsum(p[top])
            reached = np.flatnonzero(mass[keep - 1:] >= self.top_p)
            if reached.size or m == ids.size:
                last = keep + int(reached[0]) if reached.size else m
                return ids[top[:last]]
            m = min(ids.size, m * 8)

    def sample(self, logits: np.ndarray) -> int:
        """The next token (and the penalties remember it)."""
        if self.constraint is None:
            token = self._draw(self.adjusted(logits))
        else:
            token = self._constrained_draw(self.adjusted(logits))
        self.accept((token,))
        if self.constraint is not None:
            self.constraint.advance(token, checks=self._checks_fit)
        return token

    @property
    def _checks_fit(self) -> bool:
        """Whether a draw can be decided by checking its candidates against the grammar
        (Constraint.fits) instead of masking the logits: where masking first would leave
        the same candidates with the same probabilities whenever every one is allowed.
        That holds for the highest token, and for top_k and min_p (the highest is among
        the allowed, so is the threshold); not for top_p or typical_p, whose cut moves
        with the mass the mask takes away."""
        return self.typical_p >= 1.0 and (self.temperature == 0 or self.top_p >= 1.0)

    def _constrained_draw(self, z: np.ndarray) -> int:
        """The draw from `z` (adjusted logits) with the constraint's mask applied: the same
        token, and the same random state after it, as masking first. (The mask commutes
        with adjusted(): bias and penalties keep -inf at -inf.) Where the candidates of the
        unmasked logits are few and all allowed, the mask would change nothing, so it is
        not needed: a check of each candidate costs microseconds, a mask up to a
        millisecond of the core the workers compute on."""
        c = self.constraint
        if self._checks_fit:
            if self.temperature == 0:
                forced = c.forced()
                if forced is not None and forced < z.size and z[forced] > -np.inf:  # (else the mask decides)
                    return forced
                best = int(np.argmax(z))
                if c.fits((best,)):
                    return best
            elif c.worth_checking:  # (the candidates cost a pass over the logits: not while checks fail)
                ids, p = self._distribution(z)
                if ids.size <= _FIT_CHECKS_MAX and c.fits(ids):
                    return int(ids[draw_index(self.rng, p)])
        return self._draw(c.logits(z))

    def _draw(self, z: np.ndarray) -> int:
        if self.temperature == 0 and self.typical_p >= 1.0:
            return int(np.argmax(z))  # top_k, top_p and min_p all keep the highest
        ids, p = self._distribution(z)
        if self.temperature == 0:
            return int(ids[0])
        return int(ids[draw_index(self.rng, p)])

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What the next draw picks from: token ids and their probabilities (at
        temperature 0, the one token taken, with probability 1)."""
        return self._distribution(self.adjusted(logits))

    def _distribution(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = self.candidates(z)
        v = z[ids]
        if self.temperature == 0:
            return ids[np.argmax(v)][None], np.ones(1)
        if ids.size < z.size:  # highest first; equal logits in the order the cuts left them (top_k: by id)
            order = np.argsort(-v, kind="stable")
            ids, v = ids[order], v[order]
        return ids, _softmax(v, self.temperature)


def top_k_ids(z: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k highest of `z` (0 < k < z.size), in id order; of the values equal to the
    k-th highest, the lowest ids. np.argpartition, before, picked among those arbitrarily and
    returned its pick in no order (the draw's order of equal logits then depended on it), and
    took 480 us over gemma3-270m's 262,144 logits, against 200-230 us for this."""
    kth = np.partition(z, z.size - k)[z.size - k]
    if kth != kth:  # NaN (a penalty past float32's range): argpartition's pick, which puts NaN last
        return np.sort(np.argpartition(-z, k - 1)[:k])
    above = np.flatnonzero(z > kth)  # fewer than k
    return np.sort(np.concatenate([above, np.flatnonzero(z == kth)[: k - above.size]]))


def draw_index(rng: np.random.Generator, p: np.ndarray) -> int:
    """`rng.choice(p.size, p=p)`, the same index for the same generator state (numpy's own steps: the
    cumulative sum scaled to end at 1, one uniform draw, the first entry above it), without choice()'s
    checks of `p`, which our softmax makes valid: over a whole 262k vocabulary they cost 2-3 ms a token."""
    cdf = np.cumsum(p)
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


def _softmax(v: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """softmax(v / temperature) in float64, in place in one new array (a whole vocabulary's temporaries
    cost more than the arithmetic: 3.5 ms a token against 1.3)."""
    p = v.astype(np.float64)
    if temperature != 1.0:
        p /= temperature
    p -= p.max()
    np.exp(p, out=p)
    p /= p.sum()
    return p


def token_logprobs(logits: np.ndarray, token: int | None, top_n: int) -> tuple[float | None, list[tuple[int, float]]]:
    """The log-probability of `token` under the model's own distribution (the
    log-softmax of the raw logits) and the `top_n` most likely tokens with
    theirs, most likely first (ties: lower id first)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    lse = m + math.log(float(np.sum(np.exp(x - m))))
    chosen = None if token is None else float(x[token] - lse)
    if top_n <= 0:
        return chosen, []
    n = min(top_n, x.size)
    top = np.argpartition(-x, n - 1)[:n] if n < x.size else np.arange(x.size)
    top = top[np.lexsort((top, -x[top]))]
    return chosen, [(int(t), float(x[t] - lse)) for t in top]


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a reply's logprobs: its id, its log-probability (None for a
    prompt's first token, which nothing predicts), the most likely tokens with
    theirs, and how many characters of the text come before it."""
    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()
    offset: int = 0
