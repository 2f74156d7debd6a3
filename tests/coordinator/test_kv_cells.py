"""coordinator/decode/kv_cells.py: the coordinator's KV cell table (which row
holds which position of which sequences) and what is derived from it: free
rows, n_kv, the attention masks. Pure: no sockets, no daemons."""
from __future__ import annotations

import numpy as np

from coordinator.decode.kv_cells import MAX_POS, MAX_SEQ, PAD, KVCells

NEG_INF = np.float16(-np.inf)


def masks_of(*seq_lists) -> np.ndarray:
    return np.array([sum(1 << s for s in seqs) for seqs in seq_lists], dtype=np.uint64)


def filled(n_ctx: int, *cells: tuple[int, int, list[int]], n_swa: int = 0) -> KVCells:
    """A table holding (row, position, sequences) cells."""
    kv = KVCells(n_ctx, n_swa)
    for row, pos, seqs in cells:
        kv.assign(np.array([row]), np.array([pos]), masks_of(seqs))
    return kv


def test_limits():
    assert (PAD, MAX_SEQ, MAX_POS) == (256, 64, 2**31 - 1)


def test_a_new_table_is_empty():
    kv = KVCells(16)
    assert kv.used() == 0 and kv.seqs_present() == set()
    assert kv.pos.tolist() == [-1] * 16 and kv.seqs.tolist() == [0] * 16
    assert kv.seq_pos_max(0) == -1


def test_n_kv_is_one_past_the_last_used_row_padded_and_capped_at_n_ctx():
    assert KVCells(1024).n_kv() == PAD  # empty: one pad
    assert KVCells(100).n_kv() == 100  # never beyond n_ctx
    assert filled(1024, (255, 0, [0])).n_kv() == 256
    assert filled(1024, (256, 0, [0])).n_kv() == 512
    assert filled(1024, (0, 0, [0]), (700, 1, [0])).n_kv() == 768  # the last used row counts, not how many
    assert filled(600, (599, 0, [0])).n_kv() == 600


def test_find_slot_gives_the_lowest_free_rows_or_none():
    kv = filled(8, (0, 0, [0]), (2, 1, [0]), (3, 2, [0]))
    assert kv.find_slot(3).tolist() == [1, 4, 5]
    assert kv.find_slot(5).tolist() == [1, 4, 5, 6, 7]
    assert kv.find_slot(6) is None
    assert kv.find_slot(0).tolist() == []


def test_assign_and_rollback():
    kv = filled(8, (1, 7, [3]))
    before = (kv.pos.copy(), kv.seqs.copy())
    saved = kv.assign(np.array([0, 1, 2]), np.array([10, 11, 12]), masks_of([0], [0, 1], [2]))
    assert kv.pos[:4].tolist() == [10, 11, 12, -1]
    assert kv.seqs[:4].tolist() == [1, 3, 4, 0]
    assert kv.used() == 3 and kv.seq_pos_max(0) == 11 and kv.seq_pos_max(3) == -1  # row 1 overwritten
    kv.rollback(saved)
    assert np.array_equal(kv.pos, before[0]) and np.array_equal(kv.seqs, before[1])


def test_rollbacks_in_reverse_order_restore_the_table():
    kv = KVCells(4)
    first = kv.assign(np.array([0, 1]), np.array([0, 1]), masks_of([0], [0]))
    second = kv.assign(np.array([1, 2]), np.array([5, 6]), masks_of([1], [1]))
    kv.rollback(second)
    assert kv.pos.tolist() == [0, 1, -1, -1] and kv.seqs.tolist() == [1, 1, 0, 0]
    kv.rollback(first)
    assert kv.used() == 0 and kv.seqs.tolist() == [0] * 4


def test_clear():
    kv = filled(4, (0, 0, [0]), (3, 9, [1, 2]))
    kv.clear()
    assert kv.used() == 0 and kv.seqs_present() == set() and kv.pos.tolist() == [-1] * 4


def test_seq_pos_max_and_seqs_present():
    kv = filled(8, (0, 4, [0]), (1, 9, [0, 63]), (5, 2, [63]))
    assert kv.seq_pos_max(0) == 9 and kv.seq_pos_max(63) == 9 and kv.seq_pos_max(1) == -1
    assert kv.seqs_present() == {0, 63}
    assert KVCells(0).seqs_present() == set()


def test_seq_rm_removes_a_sequence_from_a_range_and_frees_rows_nobody_holds():
    kv = filled(8, (0, 0, [0]), (1, 1, [0]), (2, 2, [0, 1]), (3, 3, [0]), (4, 1, [1]))
    kv.seq_rm(0, 1, 3)  # positions 1 and 2 of sequence 0
    assert kv.pos[:5].tolist() == [0, -1, 2, 3, 1]  # row 2 is still sequence 1's
    assert kv.seqs[:5].tolist() == [1, 0, 2, 1, 2]
    kv.seq_rm(1)  # all of sequence 1 (p1 < 0: to the end)
    assert kv.pos[:5].tolist() == [0, -1, -1, 3, -1] and kv.seqs_present() == {0}


def test_seq_rm_to_the_end_and_of_every_sequence():
    kv = filled(8, (0, 0, [0]), (1, 5, [0]), (2, 6, [2]), (3, 7, [0, 2]))
    kv.seq_rm(0, 5)
    assert kv.pos[:4].tolist() == [0, -1, 6, 7] and kv.seqs[:4].tolist() == [1, 0, 4, 4]
    kv.seq_rm(-1, 0, 7)  # every sequence at positions 0..6
    assert kv.pos[:4].tolist() == [-1, -1, -1, 7] and kv.seqs[:4].tolist() == [0, 0, 0, 4]
    kv.seq_rm(-1)
    assert kv.used() == 0


def test_seq_cp_shares_rows_in_a_range():
    kv = filled(8, (0, 0, [0]), (1, 1, [0]), (2, 2, [0]), (3, 1, [1]))
    kv.seq_cp(0, 5, 1, 2)
    assert kv.seqs[:4].tolist() == [1, 1 | 1 << 5, 1, 2]
    kv.seq_cp(0, 6)
    assert kv.seqs[:3].tolist() == [1 | 1 << 6, 1 | 1 << 5 | 1 << 6, 1 | 1 << 6]
    assert kv.seq_pos_max(6) == 2 and kv.seq_pos_max(5) == 1 and kv.seqs_present() == {0, 1, 5, 6}
    assert kv.pos[:4].tolist() == [0, 1, 2, 1]  # no row moved


def test_masks_attend_to_own_sequences_at_or_before_the_position():
    kv = filled(4, (0, 0, [0]), (1, 1, [0, 1]), (2, 2, [1]))
    causal, swa = kv.masks(4, np.array([1, 2]), masks_of([0], [1]))
    assert causal.dtype == np.float16 and causal.shape == (2, 4)
    z, x = 0.0, NEG_INF
    assert causal.tolist() == [[z, z, x, x],  # sequence 0 at 1: rows 0 and 1 (row 2 is sequence 1's)
                               [x, z, z, x]]  # sequence 1 at 2: rows 1 and 2; the empty row 3 never
    assert np.array_equal(swa, causal)  # no sliding window: one mask for both


def test_masks_only_over_the_first_n_kv_rows():
    kv = filled(8, (0, 0, [0]), (5, 1, [0]))
    causal, _ = kv.masks(2, np.array([3]), masks_of([0]))
    assert causal.tolist() == [[0.0, NEG_INF]]


def test_a_token_in_several_sequences_sees_each():
    kv = filled(3, (0, 0, [0]), (1, 0, [1]), (2, 0, [2]))
    causal, _ = kv.masks(3, np.array([4]), masks_of([0, 2]))
    assert causal.tolist() == [[0.0, NEG_INF, 0.0]]


def test_sliding_window_mask_sees_only_the_last_n_swa_positions():
    kv = filled(5, *[(i, i, [0]) for i in range(5)], n_swa=2)
    causal, swa = kv.masks(5, np.array([4, 2]), masks_of([0], [0]))
    z, x = 0.0, NEG_INF
    assert causal.tolist() == [[z, z, z, z, z], [z, z, z, x, x]]
    assert swa.tolist() == [[x, x, x, z, z], [x, z, z, x, x]]  # 4 - pos < 2; 2 - pos < 2
