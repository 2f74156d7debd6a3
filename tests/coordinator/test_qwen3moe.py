"""qwen3moe end to end: a tiny random mixture-of-experts GGUF (tests/tiny_models.py) in
process and over real workers. The routing (TOP_K over the router's softmax) and the
expert products (MUL_MAT_ID) run on the workers, validated as every other op; with
one thread everywhere the logits are bitwise equal to the in-process path, and the
greedy continuation is the same."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DaemonProcess
from coordinator import Batch, Coordinator, DecodeResult
from coordinator.model.gguf_file import GGUFFile
from coordinator.model.architectures import architecture
from tiny_models import MODELS, N_EXPERT, N_EXPERT_USED, write_gguf, write_tiny_model

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

N_CTX, N_GREEDY = 128, 24
PROMPT = "the capital of france is paris and the"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-qwen3moe.gguf", "qwen3moe")


@pytest.fixture(scope="module")
def workers():
    ds = [DaemonProcess("-t", "1") for _ in range(2)]
    yield ds
    for d in ds:
        d.stop()


def run(c: Coordinator, n: int):
    """The prompt's logits (every position), then n greedy tokens."""
    ids = c.tokenize(PROMPT)
    assert c.decode(Batch.single(ids, 0, all_logits=True)) is DecodeResult.OK
    prompt_logits = np.stack([c.logits(i).copy() for i in range(len(ids))])
    tok, pos, out = int(prompt_logits[-1].argmax()), len(ids), []
    for _ in range(n):
        out.append(tok)
        assert c.decode(Batch.single([tok], pos)) is DecodeResult.OK
        tok, pos = int(c.logits(-1).argmax()), pos + 1
    return prompt_logits, out


@pytest.fixture(scope="module")
def in_process(model):
    with Coordinator(["local"], model=model, n_ctx=N_CTX) as c:
        return run(c, N_GREEDY)


def test_hparams_and_the_routing_varies(model, in_process):
    with GGUFFile(model) as g:
        hp = architecture("qwen3moe").hparams(g)
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff, hp.head_dim) == (N_EXPERT, N_EXPERT_USED, 64, 32)
    logits, tokens = in_process
    assert np.isfinite(logits).all() and logits.std() > 0.1
    assert len(set(tokens)) > 3, f"degenerate continuation {tokens}"


@pytest.mark.parametrize("split,head_split", [([1, 1], True), ([1, 1], False)])
def test_two_workers_equal_in_process(model, workers, in_process, split, head_split):
    ref_logits, ref_tokens = in_process
    with Coordinator([d.endpoint for d in workers], model=model, split=split, n_ctx=N_CTX,
                     head_split=head_split) as c:
        logits, tokens = run(c, N_GREEDY)
    assert np.array_equal(logits, ref_logits), f"max abs diff {np.abs(logits - ref_logits).max()}"
    assert tokens == ref_tokens


def test_moe_tensors_in_a_dense_architecture_are_refused(tmp_path):
    """A qwen3 GGUF carrying expert tensors would have them ignored: refused, naming them."""
    arch, meta, vocab, tensors = MODELS["qwen3moe"]()
    meta = {k.replace("qwen3moe.", "qwen3."): v for k, v in meta.items()}
    path = write_gguf(tmp_path / "wrong.gguf", "qwen3", meta, vocab, tensors)
    with GGUFFile(path) as g, pytest.raises(ValueError, match="ffn_gate_inp"):
        architecture("qwen3").hparams(g)
