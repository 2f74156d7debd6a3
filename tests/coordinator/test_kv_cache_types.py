"""A quantized KV cache (cache_type_k/cache_type_v, llama.cpp's -ctk/-ctv): the rows take about
half (q8_0) or a quarter (q4_0) of f16's memory, and decoding works with it in process and on
workers (whose validation accepts a quantized K and V in flash attention), the logits close to f16's."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.api import Batch, Coordinator, DecodeResult
from coordinator.cluster.executors import stage_tensors
from ggml_ffi import lib

PROMPT = "The capital of France is Paris. The capital of Germany is"


def kv_bytes(c: Coordinator) -> int:
    return sum(lib.ggml_nbytes(t) for p in c._places for t in stage_tensors(p.stage)[1])


def all_logits(c: Coordinator) -> np.ndarray:
    toks = c.tokenize(PROMPT)
    assert c.decode(Batch.single(toks, 0, all_logits=True)) == DecodeResult.OK, c.last_error
    return np.stack([c.logits(i) for i in range(len(toks))])


@pytest.mark.system
def test_quantized_kv_cache_in_process_and_on_workers(workers):
    with Coordinator(["local"], n_ctx=256) as c:
        f16_bytes, ref = kv_bytes(c), all_logits(c)
    ws = workers(2)
    for kind, share, tolerance in (("q8_0", 34 / 64, 0.1), ("q4_0", 18 / 64, 0.3)):
        for endpoints in (["local"], [ws.endpoint(0), ws.endpoint(1)]):
            with Coordinator(endpoints, n_ctx=256, cache_type_k=kind, cache_type_v=kind) as c:
                assert kv_bytes(c) == pytest.approx(f16_bytes * share, rel=0.01)
                ours = all_logits(c)
            scale = np.abs(ref).max()
            assert np.abs(ours - ref).max() < tolerance * scale, (kind, endpoints, np.abs(ours - ref).max(), scale)
            if kind == "q8_0":  # q4_0 moves logits more (measured perplexity: docs/architecture.md, "KV cache")
                assert ours[-1].argmax() == ref[-1].argmax()


@pytest.mark.system
def test_k_and_v_of_different_types_each_read_with_their_own_row_size(workers):
    """-ctk and -ctv apart: V is viewed with V's strides, not K's (a q8_0 K with an f16 V read V
    with q8_0's row size: garbage logits, and NaN with q4_0 K and q8_0 V)."""
    with Coordinator(["local"], n_ctx=256) as c:
        ref = all_logits(c)
    scale = np.abs(ref).max()
    ws = workers(2)
    for k_type, v_type in (("q8_0", "f16"), ("f16", "q8_0"), ("q4_0", "q8_0"), ("q8_0", "q4_0")):
        for endpoints in (["local"], [ws.endpoint(0), ws.endpoint(1)]):
            with Coordinator(endpoints, n_ctx=256, cache_type_k=k_type, cache_type_v=v_type) as c:
                ours = all_logits(c)
            assert np.isfinite(ours).all(), (k_type, v_type, endpoints)
            assert np.abs(ours - ref).max() < 0.3 * scale, (k_type, v_type, endpoints, np.abs(ours - ref).max(), scale)
            if "q4_0" not in (k_type, v_type):
                assert ours[-1].argmax() == ref[-1].argmax(), (k_type, v_type, endpoints)


def test_an_unknown_kv_type_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="cache_type_k must be 'f16', 'q8_0' or 'q4_0'"):
        Coordinator(["local"], cache_type_k="q5_1")
