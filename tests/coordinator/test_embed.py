"""Coordinator.embed: the wanted rows' final hidden states after output_norm, the
output head's own input, so the head's weight times them gives decode()'s
logits; the same in process, over the layer split and over the tensor split."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from coordinator.api import Batch, Coordinator, DecodeResult

from tiny_models import write_tiny_model

pytestmark = pytest.mark.system

PROMPT = "the capital of france is paris"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama.gguf", "llama")


def head_weight(path: str) -> np.ndarray:
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "output.weight")
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0])).astype(np.float64)


@pytest.mark.parametrize("setup", ["local", "layer", "tensor"])
def test_embeddings_are_the_heads_input(setup, model, workers):
    endpoints = ["local"]
    if setup != "local":
        ws = workers(2)
        endpoints = [ws.endpoint(0), ws.endpoint(1)]
    with Coordinator(endpoints, model=model, n_ctx=64, split_mode="tensor" if setup == "tensor" else "layer") as c:
        toks = c.tokenize(PROMPT)
        batch = Batch.single(toks, 0, all_logits=True)
        out = c.embed(batch)
        assert out.code == DecodeResult.OK, out.error
        hidden = np.stack([out.hidden(i) for i in range(len(toks))])
        assert hidden.shape == (len(toks), c.hp.n_embd) and np.isfinite(hidden).all()
        with pytest.raises(RuntimeError, match="embedding step"):
            out.logits(0)
        c.kv_clear()
        assert c.decode(batch) == DecodeResult.OK
        logits = np.stack([c.logits(i) for i in range(len(toks))])
    # ggml's matmul quantizes the hidden state to the weight's dot type (Q8_0 here): 1 % of the logits' scale
    ours = hidden.astype(np.float64) @ head_weight(model).T
    assert np.abs(ours - logits).max() <= 1e-2 * np.abs(logits).max()
    top2 = np.sort(logits, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2e-2 * np.abs(logits).max()
    assert (ours.argmax(1)[clear] == logits.argmax(1)[clear]).all()


def test_embed_keeps_its_kv_rows_and_an_ok_decode_follows(model):
    with Coordinator(["local"], model=model, n_ctx=64) as c:
        toks = c.tokenize(PROMPT)
        assert c.embed(Batch.single(toks, 0)).code == DecodeResult.OK
        assert c.decode(Batch.single([5], len(toks))) == DecodeResult.OK  # attends to the embedded rows
        c.kv_clear()
        assert c.decode(Batch.single(toks + [5], 0)) == DecodeResult.OK
        assert c.embed(Batch.single([1], 0)).code != DecodeResult.OK  # position 0 of sequence 0 is taken
