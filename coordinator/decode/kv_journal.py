"""The KV journal: every decode step that succeeded, as it was decoded, so a
worker's lost KV cache can be rebuilt bit for bit (coordinator/decode/resume.py).

A step is recorded with everything that fixed its computation: its tokens,
the KV rows it wrote, positions, sequence masks, n_kv, output rows, greedy,
and its attention masks (as bits). Replaying the same steps in the same order
computes the same graphs on the same inputs, so every KV row that matters gets
the same bits it had; a one-shot re-prefill would not (ggml's kernels round
differently for other batch shapes).

Only steps something still depends on are kept (`needed`): a step is needed if
one of its tokens wrote a row that is live now, or a row that a needed token
of a later step (or of the same step) attended to. A token of a needed step
that is not itself needed is recomputed anyway (the step's shape must be the
same) and writes a row nobody reads. Its value does not touch a needed token:
every per-token op sees only its own token, and attention gives a masked row
exactly 0 weight (the rows hold finite numbers: workers zero new buffers).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coordinator.model.architectures.common import StepShape

MIN_PRUNE = 64  # steps recorded before the first pruning pass


def _bits(mask: np.ndarray) -> np.ndarray:
    return np.packbits(mask == 0, axis=None)


@dataclass
class JournalStep:
    tokens: np.ndarray  # int32[n]
    rows: np.ndarray  # int64[n]: the KV rows it wrote
    pos: np.ndarray  # int64[n]
    seqs: np.ndarray  # uint64[n] sequence masks
    out_rows: np.ndarray  # int32: the rows the last stage returned
    greedy: bool
    n_kv: int
    visible: np.ndarray  # packed bits of [n, n_kv]: the causal mask
    visible_swa: np.ndarray | None  # packed bits of the sliding-window mask, if the model has one

    @property
    def shape(self) -> StepShape:
        return StepShape(len(self.tokens), self.n_kv, len(self.out_rows), self.greedy)

    def _unpack(self, bits: np.ndarray) -> np.ndarray:
        n = len(self.tokens)
        return np.unpackbits(bits, count=n * self.n_kv).reshape(n, self.n_kv).astype(bool)

    def visible_rows(self) -> np.ndarray:
        return self._unpack(self.visible)

    def masks(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The f16 masks the step was decoded with."""
        def f16(bits):
            return np.where(self._unpack(bits), 0.0, -np.inf).astype(np.float16)
        return f16(self.visible), (f16(self.visible_swa) if self.visible_swa is not None else None)


class StepJournal:
    def __init__(self):
        self.steps: list[JournalStep] = []
        self._prune_at = MIN_PRUNE

    def __len__(self) -> int:
        return len(self.steps)

    def record(self, tokens, rows, pos, seqs, out_rows, greedy: bool, n_kv: int, mask, mask_swa,
               live) -> None:
        """A step that succeeded; `live()` (bool per KV row): the rows in use after
        it, asked for only when the journal is pruned."""
        self.steps.append(JournalStep(np.asarray(tokens, np.int32).copy(), rows.copy(), pos.copy(), seqs.copy(),
                                      out_rows.copy(), bool(greedy), int(n_kv), _bits(mask),
                                      None if mask_swa is None else _bits(mask_swa)))
        if len(self.steps) >= self._prune_at:  # amortized: the pass is linear in what is kept
            self.prune(live())
            self._prune_at = max(MIN_PRUNE, 2 * len(self.steps))

    def clear(self) -> None:
        self.steps.clear()

    def prune(self, live: np.ndarray) -> list[JournalStep]:
        """Keep only the steps the live rows depend on (in order); returns them."""
        need = np.asarray(live, bool).copy()  # row contents needed after the step being looked at
        kept: list[JournalStep] = []
        for step in reversed(self.steps):
            tok_need = need[step.rows]
            if tok_need.any():
                vis = step.visible_rows()
                own = vis[:, step.rows]  # own[t, u]: token t attends to the row token u writes
                for _ in range(len(step.tokens)):  # tokens a needed token of this step attends to
                    grown = tok_need | own[tok_need].any(axis=0)
                    if (grown == tok_need).all():
                        break
                    tok_need = grown
                need[:step.n_kv] |= vis[tok_need].any(axis=0)
                kept.append(step)
            need[step.rows] = False  # written by this step: what they held before is nobody's input
        kept.reverse()
        self.steps = kept
        return kept

    def replay_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.steps)
