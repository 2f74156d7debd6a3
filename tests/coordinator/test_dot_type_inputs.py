"""An input several quantized products share (Q, K and V; gate and up) is converted
to the weights' dot type once (ggml_cast), not by each product: the same bits,
less work. Workers that offer "dot_type_inputs" get such graphs; a daemon from
before the feature (the test entry point's --test-older) gets the plain ones and
the same logits. Real daemons on 127.0.0.1, real libggml."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.api import Batch, Coordinator, DecodeResult
from coordinator.model.architectures.common import SHARED_INPUT_MIN_ROWS, StepShape
from ggml_ffi import lib
from rpc_daemon.wire.graph_limits import DOT_TYPES

from older_workers import assert_an_older_worker_changes_no_logit
from tiny_models import write_tiny_model

pytestmark = pytest.mark.system

PROMPT = "the capital of france is paris and the capital of germany is"


def all_logits(c: Coordinator) -> np.ndarray:
    c.kv_clear()
    toks = c.tokenize(PROMPT)
    assert len(toks) >= SHARED_INPUT_MIN_ROWS
    assert c.decode(Batch.single(toks, 0, all_logits=True)) == DecodeResult.OK, c.last_error
    return np.stack([c.logits(i) for i in range(len(toks))])


def casts(gf) -> list:
    """The graph's ggml_cast nodes (a CPY whose destination is itself)."""
    nodes = [lib.ggml_graph_node(gf, i) for i in range(lib.ggml_graph_n_nodes(gf))]
    return [n for n in nodes if n.op == lib.GGML_OP_CPY and n.src[1] == n]


def test_a_shared_input_is_converted_once_where_the_rows_are_enough(tmp_path):
    """The tiny qwen3's layers mix q4_K, q6_K (dot type q8_K) and q4_0 (q8_0): a cast per
    dot type that two or more of a layer's products share, read by those products, and
    none for one token or where it is not asked for."""
    model = write_tiny_model(tmp_path / "qwen3.gguf", "qwen3")
    with Coordinator(["local"], model=model, n_ctx=64) as c:
        stage = c._places[0].stage
        # (rows, where it runs takes dot-type inputs, casts wanted): too few rows, or not asked, get none
        for rows, offered, wanted in ((SHARED_INPUT_MIN_ROWS, True, True), (SHARED_INPUT_MIN_ROWS - 1, True, False),
                                      (8, False, False)):
            g, _ = stage.graph(StepShape(rows, 64, 1), dot_type_inputs=offered)
            found = casts(g.gf)
            if not wanted:
                assert not found
                continue
            expected = 0
            for il in stage.layers:
                for names in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up")):
                    dots = [DOT_TYPES.get(stage.weights[f"blk.{il}.{n}.weight"].type) for n in names]
                    expected += len({d for d in dots if d is not None and dots.count(d) > 1})
            assert expected >= stage.hp.n_layer and len(found) == expected, (len(found), expected)
            nodes = [lib.ggml_graph_node(g.gf, i) for i in range(lib.ggml_graph_n_nodes(g.gf))]
            for cast in found:
                readers = [n for n in nodes if n.op == lib.GGML_OP_MUL_MAT and n.src[1] == cast]
                assert len(readers) >= 2 and all(DOT_TYPES[r.src[0].type] == cast.type for r in readers)


def test_workers_with_and_without_the_feature_give_the_in_process_logits(tmp_path, start_daemon):
    """A layer split over a current worker and one from before "dot_type_inputs", which
    refuses casts as it did: every logit of an 11-token prompt equals in process's, bit
    for bit (the cast makes the bits each product made), so the older worker got plain
    graphs and the current one computed the same."""
    model = write_tiny_model(tmp_path / "qwen3.gguf", "qwen3")
    assert_an_older_worker_changes_no_logit(model, "dot_type_inputs", start_daemon, all_logits)


def test_an_older_daemon_refuses_a_cast_and_does_not_offer_the_feature(start_daemon):
    """What the test above leans on: --test-older dot_type_inputs really acts as a daemon
    from before it (else that test could not fail)."""
    from rpc_helpers import RawConn
    from rpc_daemon.wire.protocol import Command, Status
    from graph_helpers import F32, INPUT, OUTPUT, COMPUTE, T, f32s
    older = start_daemon("-t", "1", "--test-older", "dot_type_inputs")
    conn = RawConn(older.port)
    hello = conn.hello()
    assert "dot_type_inputs" not in hello["features"] and "graph_reuse" in hello["features"], hello
    tensors = [T(F32, [256, 2], flags=INPUT),
               T(lib.GGML_TYPE_Q8_K, [256, 2], op=lib.GGML_OP_CPY, src=[0, 1], flags=OUTPUT | COMPUTE)]
    h, _ = conn.call(Command.GRAPH_COMPUTE, {"tensors": tensors, "inputs": [[0, 0, 2048]], "outputs": [1]},
                     f32s(*[1.0] * 512))
    assert h["status"] == Status.INVALID_REQUEST and "CPY" in h["error"], h
    current = start_daemon("-t", "1")
    conn = RawConn(current.port)
    assert "dot_type_inputs" in conn.hello()["features"]
    h, out = conn.call(Command.GRAPH_COMPUTE, {"tensors": tensors, "inputs": [[0, 0, 2048]], "outputs": [1]},
                       f32s(*[1.0] * 512))
    assert h["status"] == Status.SUCCESS and len(out) == 2 * 292, h
