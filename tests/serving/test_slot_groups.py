"""How many groups of slots serve steps at once (coordinator/serving/batching.py,
SLOT_GROUPS_HEAD_SHARE): one per worker when steps are pipelined and the output
head is under half of the weights a token reads, else one batch of every slot.
Real coordinators over two workers on 127.0.0.1: the tiny llama (a small head)
and the bundled gemma3-270m (a 262k-row head, 72 % of its weights)."""
from __future__ import annotations

import pytest

from conftest import DaemonProcess
from coordinator import Coordinator
from coordinator.model.architectures.common import head_source
from coordinator.serving.batching import SLOT_GROUPS_HEAD_SHARE, Scheduler

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)


@pytest.fixture(scope="module")
def two():
    ws = [DaemonProcess("-t", "1"), DaemonProcess("-t", "1")]
    yield [w.endpoint for w in ws]
    for w in ws:
        w.stop()


def head_fraction(coord) -> float:
    g = coord.gguf
    head = len(g.tensor_data(head_source(g.tensors)))
    return head / (head + g.layer_bytes)


@pytest.mark.parametrize("micro_batch, groups", [(64, 2), (0, 1)])
def test_a_small_head_gets_a_group_per_worker_when_pipelined(two, tiny_model, micro_batch, groups):
    coord = Coordinator(two, model=str(tiny_model), n_ctx=256, micro_batch=micro_batch)
    try:
        assert coord.head_share == pytest.approx(head_fraction(coord)) and coord.head_share < SLOT_GROUPS_HEAD_SHARE
        assert Scheduler(coord, 4, 64).n_groups == groups
        assert Scheduler(coord, 1, 256).n_groups == 1  # never more groups than slots
    finally:
        coord.close()


def test_a_head_heavy_model_steps_every_slot_in_one_batch(two):
    coord = Coordinator(two, n_ctx=256)  # the bundled gemma3-270m
    try:
        assert coord.pipelined and coord.pipeline_stages == 2
        assert coord.head_share == pytest.approx(head_fraction(coord)) and coord.head_share > SLOT_GROUPS_HEAD_SHARE
        assert Scheduler(coord, 4, 64).n_groups == 1
    finally:
        coord.close()
