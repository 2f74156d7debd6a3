"""coordinator/model/split_plan.py: which endpoint holds which layers and which
rows of the output head, the weights taken from the endpoints' free memory,
and fitting the split into it (DoesNotFit and its message). Pure: no sockets,
no daemons."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.model.split_plan import (PAGE, DoesNotFit, compute_reserve, endpoint_free, fit_split, human,
                                          in_pages, plan_rows, plan_split, split_weights)

MiB = 1 << 20


# ---------------------------------------------------------------- rows of the head

def test_plan_rows_proportional_and_contiguous():
    assert plan_rows(10, [1, 1]) == [range(0, 5), range(5, 10)]
    assert plan_rows(7, [1, 1, 1]) == [range(0, 2), range(2, 5), range(5, 7)]
    assert plan_rows(262144, [3, 1]) == [range(0, 196608), range(196608, 262144)]


def test_plan_rows_may_leave_one_empty():
    assert plan_rows(10, [1, 0, 1]) == [range(0, 5), range(5, 5), range(5, 10)]
    assert plan_rows(3, [1, 1, 1, 1, 1]) == [range(0, 1), range(1, 1), range(1, 2), range(2, 2), range(2, 3)]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300_000), st.lists(st.floats(0.01, 100), min_size=1, max_size=6))
def test_plan_rows_covers_every_row_once(n, weights):
    rows = plan_rows(n, weights)
    assert len(rows) == len(weights)
    assert [r for rs in rows for r in rs] == list(range(n))


# ---------------------------------------------------------------- layers

def test_plan_split_proportional():
    assert plan_split(4, [1, 1]) == [range(0, 2), range(2, 4)]
    assert plan_split(26, [1, 1, 1]) == [range(0, 9), range(9, 17), range(17, 26)]
    assert plan_split(12, [3, 1]) == [range(0, 9), range(9, 12)]
    assert plan_split(5, [1]) == [range(0, 5)]


def test_plan_split_gives_every_endpoint_at_least_one_layer():
    assert plan_split(10, [100, 1]) == [range(0, 9), range(9, 10)]
    assert plan_split(10, [1, 100]) == [range(0, 1), range(1, 10)]
    assert plan_split(3, [0, 1, 0]) == [range(0, 1), range(1, 2), range(2, 3)]
    assert plan_split(2, [1, 1]) == [range(0, 1), range(1, 2)]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 80), st.lists(st.floats(0, 100), min_size=1, max_size=8))
def test_plan_split_covers_every_layer_once(n_layer, weights):
    if len(weights) > n_layer or sum(weights) <= 0:
        return
    layers = plan_split(n_layer, weights)
    assert len(layers) == len(weights) and all(len(r) >= 1 for r in layers)
    assert [i for r in layers for i in r] == list(range(n_layer))


def test_plan_split_refuses_more_endpoints_than_layers():
    with pytest.raises(ValueError) as info:
        plan_split(2, [1, 1, 1])
    assert str(info.value) == "3 endpoints but the model has only 2 layers"


@pytest.mark.parametrize("weights", [[0, 0], [-1, 2], [1, -0.5]])
def test_plan_split_refuses_negative_or_zero_proportions(weights):
    with pytest.raises(ValueError) as info:
        plan_split(8, weights)
    assert str(info.value) == f"split proportions must be non-negative with a positive sum: {weights}"


# ---------------------------------------------------------------- weights from free memory

def test_split_weights_as_given():
    assert split_weights([2, 1], [], 2) == [2, 1]
    assert split_weights((1.5, 0.5, 1), [{}, {}, {}], 3) == [1.5, 0.5, 1]


def test_split_weights_of_the_wrong_length():
    with pytest.raises(ValueError) as info:
        split_weights([1], [{}, {}], 2)
    assert str(info.value) == "split has 1 proportions for 2 endpoints"


def test_split_weights_from_the_free_memory_reported_for_this_client():
    infos = [{"client_free_memory": 300, "free_memory": 1000}, {"free_memory": 100}]
    assert split_weights(None, infos, 2) == [300, 100]


@pytest.mark.parametrize("infos", [[{"free_memory": 100}, {"free_memory": 0}], [{"free_memory": 100}, {}],
                                   [{"client_free_memory": 0, "free_memory": 100}, {"free_memory": 5}]])
def test_split_weights_equal_unless_every_endpoint_reports_free_memory(infos):
    assert split_weights(None, infos, 2) == [1.0, 1.0]


def test_endpoint_free():
    assert endpoint_free({"name": "local", "free_memory": 5}) is None  # in process: no bound
    assert endpoint_free({"name": "CPU", "client_free_memory": 7, "free_memory": 9}) == 7
    assert endpoint_free({"name": "CPU", "free_memory": 9.0}) == 9  # an older worker: the total
    assert endpoint_free({}) == 0


# ---------------------------------------------------------------- sizes

def test_page():
    assert PAGE == 4096


@pytest.mark.parametrize("info, n, counted", [
    ({}, 1, 4096), ({"shared_memory": {"page": 2 * MiB}}, 1, 2 * MiB), ({"shared_memory": {"page": 2 * MiB}},
                                                                         2 * MiB + 1, 4 * MiB),
    ({"shared_memory": {"page": 4096}}, 8192, 8192), ({"shared_memory": {"page": 0}}, 1, 4096),
    ({"shared_memory": {"page": "2M"}}, 1, 4096), ({"shared_memory": None}, 1, 4096), ({"shared_memory": 5}, 1, 4096)])
def test_a_stage_is_planned_in_the_pages_its_worker_counts(info, n, counted):
    """A worker on huge pages counts a buffer in whole 2 MiB pages (DEVICE_INFO shared_memory.page);
    one that does not say, or says nonsense, in 4 KiB ones."""
    assert in_pages(n, info) == counted


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536 * 1024, "1.50 MiB"),
                                     (3 << 30, "3.00 GiB"), (5 << 40, "5120.00 GiB"), (-2048, "-2.00 KiB")])
def test_human(n, text):
    assert human(n) == text


def test_compute_reserve():
    """Two graphs' estimated live set (4-byte activations, 2-byte masks of
    two kinds) plus 1 MiB."""
    dense = SimpleNamespace(n_ff=8, n_expert_used=0, n_embd=4, n_head=2, n_head_kv=1, head_dim=2)
    # activations 4 * 1 * (6*4 + 3*8 + 4*1 + (2 + 2*1)*2) = 240 bytes, masks 2 * 2 * 3 * 1 = 12
    assert compute_reserve(dense, 1, 3) == 2 * (240 + 12) + MiB
    assert compute_reserve(dense, 0, 4096) == MiB  # no tokens: nothing but the MiB
    moe = SimpleNamespace(n_ff=8, n_expert_used=2, n_embd=4, n_head=2, n_head_kv=1, head_dim=2)
    # the experts' activations: width 8 * 2, and n_embd per expert used
    assert compute_reserve(moe, 1, 3) == 2 * (4 * (24 + 48 + 8 + 8) + 12) + MiB
    assert compute_reserve(dense, 10, 3) - MiB == 10 * (compute_reserve(dense, 1, 3) - MiB)  # per token


# ---------------------------------------------------------------- fitting the split

def per_layer(nbytes: int, head_row: int = 0):
    """need(): nbytes per layer, head_row per head row."""
    return lambda i, layers, rows: nbytes * len(layers) + (head_row * len(rows) if rows is not None else 0)


def test_fit_split_proportional_when_it_fits():
    layers, heads = fit_split(["a", "b"], [30, 30], 6, 10, [1, 1], False, False, per_layer(10))
    assert layers == [range(0, 3), range(3, 6)] and heads == [None, None]
    layers, heads = fit_split(["a", "b"], [100, 300], 4, 1000, [1, 3], True, False, per_layer(10))
    assert layers == [range(0, 1), range(1, 4)] and heads == [range(0, 250), range(250, 1000)]


def test_fit_split_fills_layers_in_order_when_the_proportional_split_does_not_fit():
    layers, heads = fit_split(["a", "b"], [20, 100], 6, 10, [1, 1], False, False, per_layer(10))
    assert layers == [range(0, 2), range(2, 6)] and heads == [None, None]
    # an unbounded endpoint (local) takes all it can, leaving one layer for each after it
    layers, _ = fit_split(["local", "b"], [None, 25], 6, 10, [1, 1], False, False, per_layer(10))
    assert layers == [range(0, 5), range(5, 6)]
    layers, _ = fit_split(["a", "b", "c"], [100, 10, 100], 6, 10, [1, 1, 1], False, False, per_layer(10))
    assert layers == [range(0, 4), range(4, 5), range(5, 6)]


def test_fit_split_as_given_does_not_move_layers():
    with pytest.raises(DoesNotFit) as info:
        fit_split(["a", "b"], [20, 100], 6, 10, [1, 1], False, True, per_layer(10))
    assert str(info.value) == (
        "the model does not fit the workers' free memory: its 2 stages need 60 B in all (weights, KV cache and "
        "compute reserve), the workers report 120 B free (split as given); a: layers 0-2 need 30 B, 20 B free "
        "(10 B short)")
    assert isinstance(info.value, ValueError)


def test_does_not_fit_says_how_much_is_missing_and_where():
    with pytest.raises(DoesNotFit) as info:
        fit_split(["a:1", "b:2"], [15 * MiB, 15 * MiB], 6, 10, [1, 1], False, False, per_layer(10 * MiB))
    assert str(info.value) == (
        "the model does not fit the workers' free memory: its 2 stages need 60.00 MiB in all (weights, KV cache "
        "and compute reserve), the workers report 30.00 MiB free, 30.00 MiB short; a:1: layers 0-2 need "
        "30.00 MiB, 15.00 MiB free (15.00 MiB short); b:2: layers 3-5 need 30.00 MiB, 15.00 MiB free "
        "(15.00 MiB short)")


def test_does_not_fit_names_the_head_rows_and_no_total_shortfall_with_an_unbounded_endpoint():
    with pytest.raises(DoesNotFit) as info:
        fit_split(["local", "b"], [None, 10], 6, 8, [1, 1], True, True, per_layer(10, head_row=1))
    assert str(info.value) == (
        "the model does not fit the workers' free memory: its 2 stages need 68 B in all (weights, KV cache and "
        "compute reserve), the workers report 10 B free (split as given); b: layers 3-5 and head rows 4-7 need "
        "34 B, 10 B free (24 B short)")
