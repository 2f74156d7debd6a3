"""A weight whose rows are an odd number of 256-element blocks is multiplied by its
even and its odd rows apart, and the two results interleaved (CONCAT), for the
batch sizes where ggml's tiled kernel reads it faster so (common.PAIRED_ROWS): the
same bits. Workers that offer "concat" get such graphs; a daemon from before the
feature (the test entry point's --test-older) gets the plain ones and the same
logits. Real daemons on 127.0.0.1, real libggml."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.api import Batch, Coordinator, DecodeResult
from coordinator.model.architectures.common import PAIRED_ROWS, StepShape
from ggml_ffi import lib

from older_workers import assert_an_older_worker_changes_no_logit
from tiny_models import Dims, write_plain_llama

pytestmark = pytest.mark.system

PROMPT = "the capital of france is paris and the capital of germany is"
# ffn_down's rows: 1280 columns, 5 q4_K blocks (odd); every other weight's: 256, one block
ODD_ROWS = Dims(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=1280)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_plain_llama(tmp_path_factory.mktemp("paired") / "odd-rows.gguf", ODD_ROWS, "q4_K")


def all_logits(c: Coordinator) -> np.ndarray:
    c.kv_clear()
    toks = c.tokenize(PROMPT)
    assert len(toks) in PAIRED_ROWS[lib.GGML_TYPE_Q4_K], len(toks)
    assert c.decode(Batch.single(toks, 0, all_logits=True)) == DecodeResult.OK, c.last_error
    return np.stack([c.logits(i) for i in range(len(toks))])


def concats(gf) -> int:
    return sum(lib.ggml_graph_node(gf, i).op == lib.GGML_OP_CONCAT for i in range(lib.ggml_graph_n_nodes(gf)))


def test_a_graph_pairs_the_odd_rows_only_for_the_batches_that_gain(model):
    """In process: ffn_down's product in pairs at 8..128 rows of x (one CONCAT in the first
    layer; the last one's FFN runs for the output row alone), not at 1 or 7 or 256, and
    not where CONCAT is not taken."""
    with Coordinator(["local"], model=model, n_ctx=512) as c:
        stage = c._places[0].stage
        for rows, want in ((1, 0), (7, 0), (8, 1), (64, 1), (128, 1), (256, 0)):
            g, _ = stage.graph(StepShape(rows, 256, 1), dot_type_inputs=True, concat=True)
            assert concats(g.gf) == want, rows
        g, _ = stage.graph(StepShape(64, 256, 1), dot_type_inputs=True, concat=False)
        assert concats(g.gf) == 0


def test_workers_with_and_without_the_feature_give_the_in_process_logits(model, start_daemon):
    """A layer split over a current worker and one from before "concat", which refuses
    CONCAT as it did: every logit of the prompt equals in process's, bit for bit (each
    output row is the same dot product), so the older worker got plain graphs and the
    current one computed the same in pairs."""
    assert_an_older_worker_changes_no_logit(model, "concat", start_daemon, all_logits)


def test_an_older_daemon_refuses_concat_and_does_not_offer_the_feature(start_daemon):
    """What the test above leans on: --test-older concat really acts as a daemon from
    before it (else that test could not fail)."""
    from rpc_helpers import RawConn
    from rpc_daemon.wire.protocol import Command, Status
    from graph_helpers import F32, INPUT, OUTPUT, COMPUTE, T, f32s
    import struct
    tensors = [T(F32, [1, 4], flags=INPUT), T(F32, [1, 4], flags=INPUT),
               T(F32, [2, 4], op=lib.GGML_OP_CONCAT, src=[0, 1], params=struct.pack("<i", 0),
                 flags=OUTPUT | COMPUTE)]
    request = {"tensors": tensors, "inputs": [[0, 0, 16], [1, 16, 16]], "outputs": [2]}
    blob = f32s(1, 2, 3, 4) + f32s(5, 6, 7, 8)
    older = RawConn(start_daemon("-t", "1", "--test-older", "concat").port)
    hello = older.hello()
    assert "concat" not in hello["features"] and "dot_type_inputs" in hello["features"], hello
    h, _ = older.call(Command.GRAPH_COMPUTE, request, blob)
    assert h["status"] == Status.INVALID_REQUEST and "CONCAT" in h["error"], h
    current = RawConn(start_daemon("-t", "1").port)
    assert "concat" in current.hello()["features"]
    h, out = current.call(Command.GRAPH_COMPUTE, request, blob)
    assert h["status"] == Status.SUCCESS, h
    assert np.frombuffer(out, np.float32).tolist() == [1, 5, 2, 6, 3, 7, 4, 8]
