"""Token sampling: greedy at temperature 0, else top-k, top-p, temperature."""
from __future__ import annotations

import numpy as np


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95, seed: int | None = None):
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
            raise ValueError("need temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
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
