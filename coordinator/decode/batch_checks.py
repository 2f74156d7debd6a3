"""Pure checks of a Batch against the model and the KV cell table: what a
decode refuses with INVALID_BATCH (a message), before anything is sent. Also
the argument checks of the KV calls."""
from __future__ import annotations

import numpy as np

from coordinator.decode.kv_cells import MAX_POS, MAX_SEQ, KVCells
from coordinator.config import is_int
from coordinator.decode.values import Batch


MAX_BEST_TOKENS = 64  # decode(greedy=k): the most best tokens a row may ask for


def checked_greedy(greedy) -> int:
    """decode's `greedy` as a count of best tokens per row (0: logits; True: 1)."""
    if not is_int(greedy) and not isinstance(greedy, bool) or not 0 <= int(greedy) <= MAX_BEST_TOKENS:
        raise ValueError(f"greedy must be a bool or a count of best tokens 0..{MAX_BEST_TOKENS}, not {greedy!r}")
    return int(greedy)


def seq_ids_of(batch: Batch) -> list:
    return batch.seq_ids or [[0]] * len(batch.tokens)


def seq_masks(seq_ids) -> np.ndarray:
    """Each token's sequences as a bitmask (bit s: sequence s)."""
    masks = np.zeros(len(seq_ids), dtype=np.uint64)
    for i, ids in enumerate(seq_ids):
        for s in ids:
            masks[i] |= np.uint64(1 << int(s))
    return masks


def _lowest_seq(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def batch_problem(batch: Batch, n_batch: int, n_vocab: int, kv: KVCells) -> str | None:
    """What is wrong with `batch`, or None; a malformed batch (None, strings,
    ragged lists...) is a problem too, never an exception."""
    try:
        return _batch_problem(batch, n_batch, n_vocab, kv)
    except Exception as exc:
        return f"malformed batch: {type(exc).__name__}: {exc}"


def _batch_problem(batch: Batch, n_batch: int, n_vocab: int, kv: KVCells) -> str | None:
    n = len(batch.tokens)
    if n == 0:
        return "batch is empty"
    if n > n_batch:
        return f"batch of {n} tokens exceeds n_batch {n_batch}"
    if len(batch.pos) != n or (batch.seq_ids is not None and len(batch.seq_ids) != n) \
            or (batch.logits is not None and len(batch.logits) != n):
        return "tokens, pos, seq_ids and logits must have the same length"
    toks = np.asarray(batch.tokens)
    if toks.dtype.kind not in "iu" or (toks < 0).any() or (toks >= n_vocab).any():
        return f"token ids must be integers in 0..{n_vocab - 1}"
    pos = np.asarray(batch.pos)
    if pos.dtype.kind not in "iu" or (pos < 0).any() or (pos > MAX_POS).any():
        return f"positions must be integers in 0..{MAX_POS}"
    for ids in batch.seq_ids or ():
        if not ids or any(not is_int(s) or not 0 <= s < MAX_SEQ for s in ids):
            return f"every token needs sequence ids in 0..{MAX_SEQ - 1}"
        if len(set(ids)) != len(ids):
            return f"a token lists sequence {next(s for s in ids if list(ids).count(s) > 1)} twice"
    return position_clash(pos.astype(np.int64), seq_ids_of(batch), kv)


def position_clash(tok_pos: np.ndarray, seq_ids, kv: KVCells) -> str | None:
    """A (sequence, position) given twice, in the batch or already in the KV
    cache: the sequence would attend to two different tokens at one place."""
    tok_seq = seq_masks(seq_ids)
    twice = (tok_pos[:, None] == tok_pos[None, :]) & ((tok_seq[:, None] & tok_seq[None, :]) != 0)
    np.fill_diagonal(twice, False)
    if twice.any():
        i, j = (int(k) for k in np.argwhere(twice)[0])
        s = _lowest_seq(int(tok_seq[i] & tok_seq[j]))
        return f"tokens {i} and {j} both put sequence {s} at position {int(tok_pos[i])}"
    # only the cells at the batch's positions (empty ones are -1); a few positions (a token step) compared
    # one by one: np.isin costs ~50 us for one position, a comparison ~3
    if 0 < len(tok_pos) <= 8:
        used = kv.pos == tok_pos[0]
        for p in tok_pos[1:]:
            used |= kv.pos == p
    else:
        used = np.isin(kv.pos, tok_pos)
    cached = (tok_pos[:, None] == kv.pos[used][None, :]) & ((tok_seq[:, None] & kv.seqs[used][None, :]) != 0)
    if cached.any():
        i, cell = (int(k) for k in np.argwhere(cached)[0])
        s = _lowest_seq(int(tok_seq[i] & kv.seqs[used][cell]))
        return (f"sequence {s} already has position {int(tok_pos[i])} in the KV cache; remove it first "
                f"(kv_seq_rm) to decode that position again")
    return None


def refeed_problem(batch: Batch, needs_refeed: set[int], kv: KVCells) -> str | None:
    """A batch that continues a sequence whose KV cache was lost would attend
    to nothing and produce a wrong token: refuse it."""
    first: dict[int, int] = {}
    for ids, pos in zip(seq_ids_of(batch), batch.pos):
        for s in ids:
            if s in needs_refeed:
                first[s] = min(first.get(s, pos), pos)
    for s, pos in first.items():
        if pos != 0 and kv.seq_pos_max(s) < 0:
            return (f"sequence {s} lost its KV cache when an endpoint failed; re-feed it from position 0 "
                    f"(this batch starts it at {pos})")
    return None


def checked_seq(seq, allow_all: bool = False) -> int:
    low = -1 if allow_all else 0
    if not is_int(seq) or not low <= seq < MAX_SEQ:
        raise ValueError(f"sequence id must be an integer in {low}..{MAX_SEQ - 1}"
                         f"{' (-1: every sequence)' if allow_all else ''}, not {seq!r}")
    return int(seq)


def checked_range(p0, p1) -> tuple[int, int]:
    for name, p in (("p0", p0), ("p1", p1)):
        if not is_int(p):
            raise ValueError(f"{name} must be an integer position, not {p!r}")
    return max(int(p0), 0), int(p1)
