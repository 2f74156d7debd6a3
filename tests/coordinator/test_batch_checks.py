"""coordinator/decode/batch_checks.py: what a decode refuses with INVALID_BATCH
(the message), before anything is sent, and the argument checks of the KV
calls. Pure: no sockets, no daemons."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.decode.batch_checks import (batch_problem, checked_range, checked_seq, position_clash,
                                             refeed_problem, seq_ids_of, seq_masks)
from coordinator.decode.kv_cells import MAX_POS, MAX_SEQ, KVCells
from coordinator.decode.values import Batch

N_BATCH, N_VOCAB = 8, 100


def problem(batch: Batch, kv: KVCells | None = None, n_batch: int = N_BATCH) -> str | None:
    return batch_problem(batch, n_batch, N_VOCAB, kv if kv is not None else KVCells(32))


def kv_with(*cells: tuple[int, int, list[int]]) -> KVCells:
    """A table holding (row, position, sequences) cells."""
    kv = KVCells(32)
    for row, pos, seqs in cells:
        kv.assign(np.array([row]), np.array([pos]), seq_masks([seqs]))
    return kv


# ---------------------------------------------------------------- well-formed batches

def test_good_batches_have_no_problem():
    assert problem(Batch.single([1, 2, 3], 0)) is None
    assert problem(Batch([5], [0])) is None  # seq_ids None: sequence 0
    assert problem(Batch([0, N_VOCAB - 1], [0, MAX_POS], [[0], [MAX_SEQ - 1]], [True, True])) is None
    assert problem(Batch(np.array([7, 8], np.int32), np.array([3, 4], np.int64))) is None  # numpy integers
    assert problem(Batch([1] * N_BATCH, list(range(N_BATCH)))) is None  # exactly n_batch
    # one position in two different sequences is no clash
    assert problem(Batch([1, 2], [4, 4], [[0], [1]])) is None
    # one token in several sequences
    assert problem(Batch([1], [0], [[0, 5, 63]])) is None


def test_seq_ids_default_to_sequence_0():
    assert seq_ids_of(Batch([1, 2], [0, 1])) == [[0], [0]]
    assert seq_ids_of(Batch([1, 2], [0, 1], [[3], [4, 5]])) == [[3], [4, 5]]


def test_seq_masks_are_bitmasks():
    masks = seq_masks([[0], [1, 3], [63]])
    assert masks.dtype == np.uint64
    assert masks.tolist() == [1, 0b1010, 1 << 63]


# ---------------------------------------------------------------- refusals, message by message

def test_an_empty_batch():
    assert problem(Batch([], [])) == "batch is empty"


def test_more_tokens_than_n_batch():
    assert problem(Batch([1] * 9, list(range(9)))) == "batch of 9 tokens exceeds n_batch 8"
    assert problem(Batch([1, 2], [0, 1]), n_batch=1) == "batch of 2 tokens exceeds n_batch 1"


@pytest.mark.parametrize("batch", [
    Batch([1, 2], [0]),
    Batch([1, 2], [0, 1, 2]),
    Batch([1, 2], [0, 1], [[0]]),
    Batch([1, 2], [0, 1], None, [True]),
], ids=["short pos", "long pos", "short seq_ids", "short logits"])
def test_ragged_fields(batch):
    assert problem(batch) == "tokens, pos, seq_ids and logits must have the same length"


@pytest.mark.parametrize("tokens", [[-1], [N_VOCAB], [1.0], [True], ["a"]],
                         ids=["negative", "n_vocab", "float", "bool", "string"])
def test_token_ids_outside_the_vocabulary(tokens):
    assert problem(Batch(tokens, [0])) == f"token ids must be integers in 0..{N_VOCAB - 1}"


@pytest.mark.parametrize("pos", [[-1], [MAX_POS + 1], [0.5]], ids=["negative", "past int32", "float"])
def test_positions_outside_int32(pos):
    assert problem(Batch([1], pos)) == f"positions must be integers in 0..{MAX_POS}"


@pytest.mark.parametrize("ids", [[], None, [-1], [MAX_SEQ], [True], [1.0], ["0"]],
                         ids=["empty", "None", "negative", "64", "bool", "float", "string"])
def test_sequence_ids_outside_0_to_63(ids):
    assert problem(Batch([1], [0], [ids])) == f"every token needs sequence ids in 0..{MAX_SEQ - 1}"


def test_a_token_listing_a_sequence_twice():
    assert problem(Batch([1, 2], [0, 1], [[0], [2, 3, 2]])) == "a token lists sequence 2 twice"


def test_two_tokens_at_one_place_of_a_sequence():
    assert problem(Batch([1, 2, 3], [5, 6, 5], [[0, 1], [1], [2, 1]])) == \
        "tokens 0 and 2 both put sequence 1 at position 5"
    # the lowest sequence they share is named
    assert problem(Batch([1, 2], [7, 7], [[9, 4, 3], [3, 4]])) == "tokens 0 and 1 both put sequence 3 at position 7"


def test_a_place_the_kv_cache_already_holds():
    kv = kv_with((0, 3, [0]), (1, 4, [2, 5]))
    assert problem(Batch([1], [3], [[0]]), kv) == (
        "sequence 0 already has position 3 in the KV cache; remove it first (kv_seq_rm) to decode that "
        "position again")
    assert problem(Batch([1, 2], [5, 4], [[5], [1, 5]]), kv).startswith("sequence 5 already has position 4 ")
    # other sequences at those positions, or those sequences elsewhere: fine
    assert problem(Batch([1], [3], [[1]]), kv) is None
    assert problem(Batch([1], [5], [[0]]), kv) is None


def test_position_clash_alone():
    kv = kv_with((4, 10, [1]))
    assert position_clash(np.array([10], np.int64), [[1]], kv).startswith("sequence 1 already has position 10")
    assert position_clash(np.array([10, 11], np.int64), [[0], [1]], kv) is None


@pytest.mark.parametrize("batch, kind", [
    (Batch(None, [0]), "TypeError"),
    (Batch([1], None), "TypeError"),
    (Batch([[1, 2], [3]], [0, 1]), "ValueError"),
    (Batch([1], [0], 5), "TypeError"),
], ids=["tokens None", "pos None", "ragged tokens", "seq_ids a number"])
def test_a_malformed_batch_is_a_problem_never_an_exception(batch, kind):
    assert problem(batch).startswith(f"malformed batch: {kind}: ")


# ---------------------------------------------------------------- a sequence whose KV cache was lost

def test_a_lost_sequence_must_be_re_fed_from_position_0():
    kv = KVCells(32)
    assert refeed_problem(Batch([1, 2], [4, 5], [[1], [1]]), {1}, kv) == (
        "sequence 1 lost its KV cache when an endpoint failed; re-feed it from position 0 "
        "(this batch starts it at 4)")
    # the batch's lowest position of that sequence counts, wherever it is in the batch
    assert refeed_problem(Batch([1, 2], [3, 2], [[1], [0, 1]]), {1}, kv).endswith("(this batch starts it at 2)")
    assert refeed_problem(Batch([1], [1], [[1]]), {1}, kv).endswith("(this batch starts it at 1)")


def test_re_feeding_or_other_sequences_pass():
    kv = KVCells(32)
    assert refeed_problem(Batch([1, 2], [0, 1], [[1], [1]]), {1}, kv) is None  # from position 0
    assert refeed_problem(Batch([1, 2], [5, 0], [[1], [1]]), {1}, kv) is None  # it starts at 0 too
    assert refeed_problem(Batch([1], [7], [[2]]), {1}, kv) is None  # another sequence
    assert refeed_problem(Batch([1], [7], [[1]]), set(), kv) is None  # nothing lost
    # re-fed already (the table has some of it again): continuing is fine
    assert refeed_problem(Batch([1], [7], [[1]]), {1}, kv_with((0, 0, [1]))) is None


def test_a_lost_sequence_0_by_default():
    assert refeed_problem(Batch([1], [3]), {0}, KVCells(8)).startswith("sequence 0 lost its KV cache")


# ---------------------------------------------------------------- the KV calls' arguments

def test_checked_seq():
    assert checked_seq(0) == 0 and checked_seq(MAX_SEQ - 1) == MAX_SEQ - 1
    assert checked_seq(-1, allow_all=True) == -1
    got = checked_seq(np.int64(5))
    assert got == 5 and type(got) is int


@pytest.mark.parametrize("seq", [-1, MAX_SEQ, True, 1.0, "1", None])
def test_checked_seq_refuses(seq):
    with pytest.raises(ValueError) as info:
        checked_seq(seq)
    assert str(info.value) == f"sequence id must be an integer in 0..{MAX_SEQ - 1}, not {seq!r}"


@pytest.mark.parametrize("seq", [-2, MAX_SEQ, False])
def test_checked_seq_refuses_with_all(seq):
    with pytest.raises(ValueError) as info:
        checked_seq(seq, allow_all=True)
    assert str(info.value) == f"sequence id must be an integer in -1..{MAX_SEQ - 1} (-1: every sequence), not {seq!r}"


def test_checked_range():
    assert checked_range(2, 9) == (2, 9)
    assert checked_range(-5, -1) == (0, -1)  # p0 clamped to 0; p1 < 0 (to the end) kept
    got = checked_range(np.int32(1), np.int64(4))
    assert got == (1, 4) and all(type(p) is int for p in got)


@pytest.mark.parametrize("p0, p1, name, bad", [(1.5, 2, "p0", 1.5), (0, "9", "p1", "9"), (True, 2, "p0", True),
                                               (0, None, "p1", None)])
def test_checked_range_refuses(p0, p1, name, bad):
    with pytest.raises(ValueError) as info:
        checked_range(p0, p1)
    assert str(info.value) == f"{name} must be an integer position, not {bad!r}"
