"""Token sampling: greedy at temperature 0, else top-k, top-p, temperature."""
from __future__ import annotations

import numpy as np


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95, seed: int | None = None):
        if not temperature >= 0 or temperature == float("inf"):  # NaN fails too
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), not {temperature!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no limit), not {top_k!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {top_p!r}")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.rng = np.random.default_rng(seed)

    def sample(self, logits: np.ndarray) -> int:
        if self.temperature == 0:
            return int(np.argmax(logits))
        k = self.top_k if 0 < self.top_k < logits.size else logits.size
        top = np.argpartition(-logits, k - 1)[:k]
        top = top[np.argsort(-logits[top], kind="stable")]
        z = logits[top].astype(np.float64) / self.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        # the smallest prefix reaching top_p (rounding can leave the total a hair under 1)
        keep = min(int(np.searchsorted(np.cumsum(p), self.top_p) + 1), k)
        p = p[:keep] / p[:keep].sum()
        return int(top[self.rng.choice(keep, p=p)])
