"""Numerics truth: every architecture against llama.cpp itself.

tests/fixtures/reference/CASE.npz holds what llama.cpp (llama-cpp-python 0.3.36, built
from the pinned sdist) computed for the tiny random-weight GGUF of tests/tiny_models.py:
the logits at every position of a prompt and a greedy continuation
(bench/record_reference_logits.py records them; docs/architecture.md, "Numerics
truth", says how to re-record). Each case runs in process and over 2 real workers
(split 1:1, so the layers and the output head's rows are spread over both), and must
give: logits within TOLERANCE of llama.cpp's at every position (max abs diff), the same
argmax at every position (the recorder picked prompts whose top-2 gap is at least 0.05,
far above TOLERANCE), and the same greedy continuation.

Why a tolerance at all: llama.cpp and our workers compute with different builds of
ggml (its own, compiled native with llamafile's sgemm and weight repacking, and the
libggml-python wheel), so sums are ordered differently; the measured max abs diff is
printed on failure and stated in docs/architecture.md.
"""
from __future__ import annotations

import hashlib
import pathlib

import numpy as np
import pytest

from conftest import DaemonProcess
from coordinator import Batch, Coordinator, DecodeResult
from tiny_models import REFERENCE_CASES, W, model_llama3, model_phi3, spm_vocab, write_gguf, write_tiny_model

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "reference"
TOLERANCE = 0.02  # max abs logit difference; logits here are O(1..10) (std 2.4-3.5)
# K-quant weights (qwen3: q4_K, q6_K): measured max 0.34 on logits of std 4.9 (qwen3-wide, the same
# with 8 query heads: 0.14) with the libggml-python wheel, 0 with the libggml built from llama.cpp's
# source, at a few positions, argmax and continuation equal (docs/architecture.md, "Numerics truth": a lone
# K-quant matmul agrees between the two ggml builds; the cause is not pinned down)
# qwen3moe: its prompt logits are bitwise llama.cpp's and 5 of 6 continuation steps too; one
# step differs by 0.026 (also with the experts picked by argsort as llama.cpp does, and with
# the step computed in one batch with the prompt: not the routing, not the batching)
K_QUANT_TOLERANCE = {"qwen3": 0.5, "qwen3-wide": 0.5, "qwen3moe": 0.05}
RERECORD = "re-record with: python bench/record_reference_logits.py"


@pytest.fixture(scope="module")
def workers():
    ds = []
    try:
        for _ in range(2):
            ds.append(DaemonProcess("-t", "1"))
        yield [d.endpoint for d in ds]
    finally:
        for d in ds:
            d.stop()
            d.kill()


def load_case(name: str, tmp_path) -> tuple[dict, str]:
    """The fixture and the tiny GGUF it was recorded from, written anew (same bytes)."""
    path = FIXTURES / f"{name}.npz"
    assert path.exists(), f"missing fixture {path}; {RERECORD} {name}"
    ref = dict(np.load(path))
    model, n_ctx = REFERENCE_CASES[name]
    assert str(ref["model"]) == model and int(ref["n_ctx"]) == n_ctx, f"{name}: fixture is of another case; {RERECORD}"
    gguf = write_tiny_model(tmp_path / f"{name}.gguf", model)
    sha = hashlib.sha256(pathlib.Path(gguf).read_bytes()).hexdigest()
    assert sha == str(ref["gguf_sha256"]), f"tests/tiny_models.py writes another {model} GGUF now; {RERECORD} {name}"
    return ref, gguf


def run(c: Coordinator, tokens, n_continue: int):
    """Our prompt logits (every position), greedy continuation and its logits."""
    assert c.decode(Batch.single([int(t) for t in tokens], 0, all_logits=True)) is DecodeResult.OK, c.last_error
    logits = np.stack([c.logits(i).copy() for i in range(len(tokens))])
    tok, pos, cont, after = int(logits[-1].argmax()), len(tokens), [], []
    for _ in range(n_continue):
        cont.append(tok)
        assert c.decode(Batch.single([tok], pos)) is DecodeResult.OK, c.last_error
        after.append(c.logits(-1).copy())
        tok, pos = int(after[-1].argmax()), pos + 1
    return logits, cont, np.array(after)


@pytest.mark.parametrize("where", ["local", pytest.param("2 workers", marks=pytest.mark.system)])
@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_logits_match_llama_cpp(name, where, tmp_path, request):
    ref, gguf = load_case(name, tmp_path)
    tolerance = K_QUANT_TOLERANCE.get(name, TOLERANCE)
    endpoints = ["local"] if where == "local" else request.getfixturevalue("workers")
    with Coordinator(endpoints, model=gguf, n_ctx=int(ref["n_ctx"]), split=None if where == "local" else [1, 1]) as c:
        logits, cont, after = run(c, ref["tokens"], len(ref["continuation"]))
    diff = np.abs(logits - ref["logits"]).max()
    assert diff <= tolerance, f"{name} ({where}): prompt logits differ from llama.cpp's by {diff:.5f}"
    assert (logits.argmax(1) == ref["logits"].argmax(1)).all(), f"{name} ({where}): argmax differs"
    assert cont == ref["continuation"].tolist(), f"{name} ({where}): greedy continuation differs"
    diff_after = np.abs(after - ref["continuation_logits"]).max()
    assert diff_after <= tolerance, f"{name} ({where}): continuation logits differ by {diff_after:.5f}"


def plain_rope_llama3(tmp_path):
    """llama3 with every rope_freqs factor 1: plain RoPE."""
    arch, meta, vocab, tensors = model_llama3()
    assert tensors[0].name == "rope_freqs.weight"
    tensors[0] = W("rope_freqs.weight", tensors[0].shape, values=np.ones(tensors[0].shape))
    return write_gguf(tmp_path / "plain-rope.gguf", arch, meta, vocab, tensors), 64


@pytest.mark.parametrize("name, without", [
    ("llama3", plain_rope_llama3),
    ("qwen2-yarn", lambda tmp_path: (write_tiny_model(tmp_path / "no-yarn.gguf", "qwen2"), 64)),
    ("phi3-long", lambda tmp_path: (write_tiny_model(tmp_path / "phi3.gguf", "phi3"), 256)),  # short factors
])
def test_rope_scaling_is_not_vacuous(name, without, tmp_path):
    """The RoPE scaling cases would pass vacuously if the scaling had no effect: the same
    weights without it (rope_freqs all 1, no YaRN, Phi-3's short factors for the long)
    must land far outside the tolerance of llama.cpp's logits with it."""
    ref, _ = load_case(name, tmp_path)
    path, n_ctx = without(tmp_path)
    with Coordinator(["local"], model=path, n_ctx=n_ctx) as c:
        logits, _, _ = run(c, ref["tokens"], 0)
    diff = np.abs(logits - ref["logits"]).max()
    assert diff > 5 * TOLERANCE, f"{name} without its RoPE scaling differs by only {diff:.4f}"


# ---------------------------------------------------------------- refused at load
def tiny_gguf(tmp_path, arch: str, metadata: dict | None = None, extra: list[W] | None = None,
              vocab=None) -> str:
    """A 1-layer llama-shaped GGUF under `arch`'s keys, with `extra` tensors."""
    d = 64
    meta = {f"{arch}.{k}": v for k, v in {"context_length": 64, "embedding_length": d, "block_count": 1,
                                          "feed_forward_length": 128, "attention.head_count": 4,
                                          "attention.head_count_kv": 4}.items()}
    meta.update(metadata or {})
    names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    tensors = [W("token_embd.weight", (300, d)), W("output_norm.weight", (d,), norm=True)]
    for n in names:
        shape = (d,) if n.endswith("norm") else ((d, 128) if n == "ffn_down" else (128 if n.startswith("ffn") else d, d))
        tensors.append(W(f"blk.0.{n}.weight", shape))
    return write_gguf(tmp_path / f"{arch}.gguf", arch, meta, vocab or spm_vocab(300), tensors + (extra or []))


@pytest.mark.parametrize("arch", ["falcon", "mamba", "qwen3moe-unknown"])
def test_unknown_architecture_is_refused_naming_the_supported(tmp_path, arch):
    path = tiny_gguf(tmp_path, arch)
    with pytest.raises(ValueError, match=rf"architecture '{arch}' is not supported \(supported: llama, qwen2, qwen3, "
                                         r"phi3, gemma3"):
        Coordinator(["local"], model=path)


def test_unknown_tokenizer_is_refused_naming_the_supported(tmp_path):
    vocab = spm_vocab(300)
    vocab.model = "bert"
    path = tiny_gguf(tmp_path, "llama", vocab=vocab)
    with pytest.raises(ValueError, match=r"unsupported tokenizer model.*'bert'.*supported: 'llama'.*'gpt2'"):
        Coordinator(["local"], model=path)


@pytest.mark.parametrize("arch, metadata, extra, message", [
    ("qwen2", {}, [W("output.bias", (300,))], r"qwen2: this variant is not supported: tensor\(s\) output.bias"),
    ("llama", {}, [W("blk.0.ffn_gate_inp.weight", (4, 64))], r"tensor\(s\) blk.0.ffn_gate_inp.weight have no place"),
    ("llama", {"llama.expert_count": 8}, [], r"llama with experts \(Mixtral-style MoE\) is not supported"),
    ("llama", {"llama.rope.scaling.type": "longrope"}, [], r"rope.scaling.type 'longrope' is not supported"),
    ("qwen2", {}, [W("blk.0.attn_q.bias", (64,), kind="iq4_nl")],
     r"qwen2: tensor 'blk.0.attn_q.bias' is iq4_nl, a type the workers do not compute \(supported: f32, f16"),
    ("qwen3", {}, [], r"qwen3: tensor 'blk.0.attn_k_norm.weight' is missing \(and 1 more\)"),
])
def test_unsupported_variant_is_refused(tmp_path, arch, metadata, extra, message):
    path = tiny_gguf(tmp_path, arch, metadata, extra)
    with pytest.raises(ValueError, match=message):
        Coordinator(["local"], model=path)


def test_phi3_partial_rotary_with_longrope_factors_is_refused(tmp_path):
    """ggml's RoPE reads a factor for every pair of the head; a GGUF with fewer rotated
    dims than the head carries fewer (n_rot / 2) factors: refused, not read past."""
    arch, meta, vocab, tensors = model_phi3()
    meta["phi3.rope.dimension_count"] = 16  # of 32
    path = write_gguf(tmp_path / "phi3-partial.gguf", arch, meta, vocab, tensors)
    with pytest.raises(ValueError, match=r"phi3: partial rotary dims with LongRoPE factors are not supported"):
        Coordinator(["local"], model=path)


@pytest.mark.system
@pytest.mark.parametrize("exact_sums", [None, False], ids=["default_sums", "split_sums"])
@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_tensor_split_agrees_with_llama_cpp_where_its_margin_is_clear(name, exact_sums, tmp_path, workers):
    """The tensor split, with exact sums (the default where they can be: one process's order) and
    with split sums (another order, docs/architecture.md, "Tensor parallelism"): its logits are
    compared with llama.cpp's recorded ones, the max abs deviation printed (the figures in
    docs/architecture.md), bounded as the 2-worker layer split's, and the argmax equal wherever
    llama.cpp's top-2 margin exceeds that deviation."""
    ref, gguf = load_case(name, tmp_path)
    options = dict(model=gguf, n_ctx=int(ref["n_ctx"]), split=[1, 1], split_mode="tensor", exact_sums=exact_sums)
    if name == "qwen3" and exact_sums is False:  # its Q4_K attn_output: a KV group is half a block, no column cut
        with pytest.raises(ValueError, match="quantization blocks"):
            Coordinator(workers, **options)
        return
    with Coordinator(workers, **options) as c:
        assert c.health()["split_mode"] == "tensor"
        logits, _, after = run(c, ref["tokens"], len(ref["continuation"]))
    ours = np.concatenate([logits, after])
    theirs = np.concatenate([ref["logits"], ref["continuation_logits"]])
    deviation = float(np.abs(ours - theirs).max())
    print(f"\n{name}: tensor split ({exact_sums=}) vs llama.cpp, max abs logit deviation {deviation:.5f}")
    # measured: 0 (bit-equal) for every case but qwen2, 0.0238 (its f32 biases are added to partial sums)
    bound = {"qwen2": 0.03}.get(name, K_QUANT_TOLERANCE.get(name, TOLERANCE))
    assert deviation <= bound, f"{name}: tensor split differs by {deviation:.5f}"
    top2 = np.sort(theirs, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > deviation
    assert (ours.argmax(1)[clear] == theirs.argmax(1)[clear]).all(), f"{name}: argmax differs where the margin is clear"
