"""What goes into a decode and what comes out: Batch, the result codes,
DecodeError, and a step's outputs."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from rpc_daemon.failure_kind import FailureKind  # noqa: F401  (re-exported: one enum from the client up)


class DecodeResult(enum.IntEnum):
    OK = 0
    NO_KV_SLOT = 1
    ABORTED = 2
    INVALID_BATCH = -1
    COMPUTE_FAILED = -3
    ENDPOINT_FAILED = -4


class DecodeError(RuntimeError):
    """A failed decode step of generate/stream. `cause` is a FailureKind:
    'unreachable', 'timeout', 'closed', 'protocol' (ENDPOINT_FAILED), 'compute',
    'alloc', 'internal' (COMPUTE_FAILED), 'context_full' (NO_KV_SLOT),
    'invalid_batch'."""

    def __init__(self, code: DecodeResult, endpoint: str | None, message: str, cause: FailureKind | None = None):
        super().__init__(f"{DecodeResult(code).name}: {message}")
        self.code, self.endpoint, self.message, self.cause = DecodeResult(code), endpoint, message, cause


@dataclass
class Batch:
    """Tokens to decode. `seq_ids[i]` lists the sequences token i belongs to;
    `logits[i]` says whether its logits are wanted (default: the last token)."""
    tokens: Sequence[int]
    pos: Sequence[int]
    seq_ids: Sequence[Sequence[int]] | None = None
    logits: Sequence[bool] | None = None

    @classmethod
    def single(cls, tokens: Sequence[int], pos0: int, seq: int = 0, all_logits: bool = False) -> "Batch":
        n = len(tokens)
        return cls(list(tokens), list(range(pos0, pos0 + n)), [[seq]] * n,
                   [all_logits or i == n - 1 for i in range(n)])


class StepOutput:
    """What an OK decode left to read: per batch token that wanted logits, its
    logits, or (greedy) its argmax token, or (an embedding step) its final
    hidden state, normalized. None of it after a failed decode."""

    def __init__(self, out_rows: np.ndarray | None = None, logits: np.ndarray | None = None,
                 tokens: np.ndarray | None = None, hidden: np.ndarray | None = None):
        self.logits_, self.tokens, self.hidden_ = logits, tokens, hidden
        self.rows = {} if out_rows is None else {int(i): k for k, i in enumerate(out_rows)}

    def _row(self, i: int) -> int:
        if i < 0:
            k = len(self.rows) + i
            if not 0 <= k < len(self.rows):
                raise IndexError(f"logits index {i} out of range")
            return k
        if i not in self.rows:
            raise IndexError(f"token {i} of the last batch did not request logits")
        return self.rows[i]

    def logits(self, i: int) -> np.ndarray:
        if self.logits_ is None:
            if self.hidden_ is not None:
                raise RuntimeError("no logits: the last decode was an embedding step (read hidden(i))")
            if self.tokens is not None:
                raise RuntimeError("no logits: the last decode ran with greedy=True (read token(i))")
            raise RuntimeError("no logits: the last decode did not return OK")
        return self.logits_[self._row(i)]

    def token(self, i: int) -> int:
        if self.tokens is not None:
            best = self.tokens[self._row(i)]
            return int(best if best.ndim == 0 else best[0])
        return int(np.argmax(self.logits(i)))

    def best_tokens(self, i: int) -> np.ndarray:
        """Token i's best tokens, best first (greedy=k: k of them; greedy=True: the argmax alone)."""
        if self.tokens is None:
            self.logits(i)  # raises, saying why there are none
            raise RuntimeError("no best tokens: the last decode returned logits (read logits(i))")
        best = self.tokens[self._row(i)]
        return best.reshape(-1)

    def hidden(self, i: int) -> np.ndarray:
        if self.hidden_ is None:
            raise RuntimeError("no hidden states: the last decode was not an embedding step (Coordinator.embed)")
        return self.hidden_[self._row(i)]


NO_OUTPUT = StepOutput()


@dataclass
class DecodeOutcome:
    """One decode's own result (Coordinator.adecode_outcome): its code, what it
    left to read (logits(i)/token(i), as the Coordinator's after it) and, if it
    failed, the error, its FailureKind and the endpoint."""
    code: DecodeResult
    output: StepOutput = NO_OUTPUT
    error: str | None = None
    cause: FailureKind | None = None
    endpoint: str | None = None

    def logits(self, i: int = -1) -> np.ndarray:
        return self.output.logits(i)

    def token(self, i: int = -1) -> int:
        return self.output.token(i)

    def best_tokens(self, i: int = -1) -> np.ndarray:
        return self.output.best_tokens(i)

    def hidden(self, i: int = -1) -> np.ndarray:
        """An embedding step's (Coordinator.aembed_outcome) normalized final hidden state of token i."""
        return self.output.hidden(i)
