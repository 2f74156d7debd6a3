"""coordinator/decode/microbatch.py's plan_cuts: how a decode batch is cut into
micro-batches for pipelining (the module docstring's rules). Pure: no
sockets, no daemons."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.decode.microbatch import DEFAULT_MICRO_BATCH, plan_cuts


def seqs(*masks_and_counts: tuple[int, int]) -> np.ndarray:
    """Token sequence masks: (mask, how many tokens) runs."""
    return np.concatenate([np.full(n, mask, np.uint64) for mask, n in masks_and_counts])


def prompt(n: int, seq: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(n), np.full(n, 1 << seq, np.uint64)


def test_default_micro_batch():
    assert DEFAULT_MICRO_BATCH == 64


def test_nothing_to_cut():
    pos, seq = prompt(512)
    assert plan_cuts(pos, seq, 1, 64) == [(0, 512)]  # one stage: nothing to overlap
    assert plan_cuts(pos, seq, 0, 64) == [(0, 512)]
    assert plan_cuts(pos, seq, 2, 0) == [(0, 512)]  # micro_batch 0: pipelining off
    assert plan_cuts(pos, seq, 2, -1) == [(0, 512)]
    assert plan_cuts(*prompt(1), 4, 1) == [(0, 1)]  # one token
    assert plan_cuts(*prompt(0), 4, 1) == [(0, 0)]


def test_a_long_prompt_in_pieces_of_micro_batch_tokens_and_the_rest():
    assert plan_cuts(*prompt(512), 2, 64) == [(i, i + 64) for i in range(0, 512, 64)]
    assert plan_cuts(*prompt(150), 2, 64) == [(0, 64), (64, 128), (128, 150)]
    assert plan_cuts(*prompt(100), 4, 64) == [(0, 64), (64, 100)]  # not more pieces for more stages
    assert plan_cuts(*prompt(65), 2, 64) == [(0, 64), (64, 65)]
    cuts = plan_cuts(*prompt(150), 2, 64)
    assert all(type(a) is int and type(b) is int for a, b in cuts)


def test_a_prompt_not_longer_than_micro_batch_stays_whole():
    assert plan_cuts(*prompt(64), 2, 64) == [(0, 64)]
    assert plan_cuts(*prompt(40), 3, 64) == [(0, 40)]


def test_every_long_prompt_in_pieces_of_one_size():
    """Two prompts of 100 tokens (sequences 0 and 1): 64 and 36 each, never
    re-balanced into other shapes."""
    pos = np.concatenate([np.arange(100), np.arange(100)])
    assert plan_cuts(pos, seqs((1, 100), (2, 100)), 2, 64) == [(0, 64), (64, 100), (100, 164), (164, 200)]


def test_five_prompts_of_20_tokens_over_2_stages():
    """The docstring's example: 40, 40, 20 (about max(2, 100 / 64) = 2
    micro-batches of at most 50 tokens)."""
    pos = np.tile(np.arange(20), 5)
    mask = seqs(*[(1 << s, 20) for s in range(5)])
    assert plan_cuts(pos, mask, 2, 64) == [(0, 40), (40, 80), (80, 100)]
    assert plan_cuts(pos, mask, 5, 64) == [(i, i + 20) for i in range(0, 100, 20)]  # 5 stages: 5 groups


def test_one_token_for_each_of_8_sequences_is_one_micro_batch():
    """Groups are not below micro_batch / 2 tokens: 8 tokens stay whole at 64."""
    pos, mask = np.full(8, 30), seqs(*[(1 << s, 1) for s in range(8)])
    assert plan_cuts(pos, mask, 2, 64) == [(0, 8)]
    assert plan_cuts(pos, mask, 2, 16) == [(0, 8)]  # 8 = micro_batch / 2: one group
    assert plan_cuts(pos, mask, 2, 8) == [(0, 4), (4, 8)]  # groups of micro_batch / 2 = 4
    assert plan_cuts(pos, mask, 4, 8) == [(0, 4), (4, 8)]  # more stages: still not below 4
    assert plan_cuts(pos, mask, 3, 6) == [(0, 3), (3, 6), (6, 8)]


def test_without_grouping_only_into_about_n_tokens_per_micro_batch():
    """group=False (the server steps its own groups at once): tokens of many
    sequences are not put in groups for the stages; long runs still are cut."""
    pos, mask = np.full(8, 30), seqs(*[(1 << s, 1) for s in range(8)])
    assert plan_cuts(pos, mask, 2, 8, group=False) == [(0, 8)]
    assert plan_cuts(pos, mask, 2, 4, group=False) == [(0, 4), (4, 8)]
    assert plan_cuts(*prompt(150), 2, 64, group=False) == [(0, 64), (64, 128), (128, 150)]
    # below micro_batch / 2 when n_tokens / micro_batch says so (grouped: never)
    pos20 = np.tile(np.arange(20), 5)
    mask20 = seqs(*[(1 << s, 20) for s in range(5)])
    assert plan_cuts(pos20, mask20, 2, 32, group=False) == [(i, i + 20) for i in range(0, 100, 20)]


def test_a_prompt_chunk_and_other_streams_tokens_are_packed_behind_its_pieces():
    pos = np.concatenate([np.arange(150), np.full(4, 9)])
    mask = seqs((1 << 5, 150), *[(1 << s, 1) for s in range(4)])
    assert plan_cuts(pos, mask, 2, 64) == [(0, 64), (64, 128), (128, 154)]


def test_a_shared_prefix_then_one_token_per_sequence():
    pos = np.concatenate([np.arange(100), [100, 100]])
    mask = seqs((0b11, 100), (0b01, 1), (0b10, 1))
    assert plan_cuts(pos, mask, 2, 64) == [(0, 64), (64, 102)]


def test_a_batch_out_of_causal_order_stays_whole():
    """A token that attends to (shares a sequence with, at a position not
    after its own) a token of a later micro-batch: no cut is used."""
    assert plan_cuts(np.arange(200)[::-1].copy(), prompt(200)[1], 2, 64) == [(0, 200)]
    pos = np.concatenate([np.arange(8, 16), np.arange(8)])  # one run: the second half comes first
    assert plan_cuts(pos, seqs((1, 16)), 2, 8) == [(0, 16)]
    # a later micro-batch at the same position of a shared sequence: attended to, so whole too
    pos = np.concatenate([np.arange(8), [7, 8, 9, 10]])
    assert plan_cuts(pos, seqs((1, 8), (0b11, 4)), 2, 8) == [(0, 12)]
    # lower positions of *other* sequences in a later micro-batch are fine
    pos = np.concatenate([np.arange(100, 108), np.arange(8)])
    assert plan_cuts(pos, seqs((1, 8), (2, 8)), 2, 8) == [(0, 8), (8, 16)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 7), st.integers(0, 40), st.integers(1, 30)), min_size=1, max_size=8),
       st.integers(0, 4), st.integers(0, 40), st.booleans())
def test_cuts_cover_the_batch_in_order_and_keep_it_causal(runs, n_stages, micro_batch, group):
    """Any batch: contiguous [start, stop) ranges covering it in batch order;
    when cut, no micro-batch over micro_batch tokens and no token attending to
    a token of a later micro-batch."""
    tok_seq = np.concatenate([np.full(n, mask, np.uint64) for mask, _, n in runs])
    tok_pos = np.concatenate([np.arange(p0, p0 + n) for _, p0, n in runs])
    n = len(tok_pos)
    cuts = plan_cuts(tok_pos, tok_seq, n_stages, micro_batch, group)
    assert cuts[0][0] == 0 and cuts[-1][1] == n
    assert all(a < b for a, b in cuts) and all(b == a2 for (_, b), (a2, _) in zip(cuts, cuts[1:]))
    if len(cuts) == 1:
        return
    assert n_stages >= 2 and micro_batch >= 1
    assert all(b - a <= micro_batch for a, b in cuts)
    which = np.repeat(np.arange(len(cuts)), [b - a for a, b in cuts])
    for t in range(n):
        for u in range(n):
            if which[u] > which[t] and int(tok_seq[t]) & int(tok_seq[u]):
                assert tok_pos[u] > tok_pos[t], (t, u, cuts)
