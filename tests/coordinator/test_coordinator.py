"""The coordinator end to end: real ggml-rpc-server daemons, real libggml.

The in-process path (`Coordinator(["local"])`) is the reference: spreading the
layers over workers must not change a single greedy token, and with the same
thread count (1 everywhere here) the logits are bitwise equal.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SLACK, DaemonProcess, free_port
from coordinator import Batch, Coordinator, DecodeError, DecodeResult, default_model_path
from tiny_models import write_tiny_llama

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

OK = DecodeResult.OK
N_GREEDY = 64
N_CTX = 256
PROMPTS = {
    "gemma3": "Once upon a time, in a small village by the sea, there lived",
    "tiny": "The capital of France is",
}


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def daemons():
    ds: list[DaemonProcess] = []
    try:
        for _ in range(3):
            ds.append(DaemonProcess("-t", "1"))
        yield ds
    finally:
        for d in ds:
            d.stop()
            d.kill()


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    return {"gemma3": default_model_path(),
            "tiny": write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", seed=0)}


@pytest.fixture(scope="module")
def local(model_paths):
    """One in-process coordinator per model, shared (every test clears the KV first)."""
    cs = {name: Coordinator(["local"], model=path, n_ctx=N_CTX) for name, path in model_paths.items()}
    yield cs
    for c in cs.values():
        c.close()


@pytest.fixture(scope="module")
def remote(daemons, model_paths):
    """One coordinator per model over two workers (split 1:1), shared, made on first use."""
    cs: dict[str, Coordinator] = {}

    def get(model: str) -> Coordinator:
        if model not in cs:
            cs[model] = Coordinator([d.endpoint for d in daemons[:2]], model=model_paths[model], split=[1, 1],
                                    n_ctx=N_CTX)
        return cs[model]

    yield get
    for c in cs.values():
        c.close()


@pytest.fixture(scope="module")
def reference(local):
    """In-process greedy run per model: (prompt logits, 64 tokens, last step logits)."""
    cache = {}

    def get(model: str):
        if model not in cache:
            c = local[model]
            c.kv_clear()
            cache[model] = greedy(c, c.tokenize(PROMPTS[model]), N_GREEDY)
        return cache[model]

    return get


@pytest.fixture(params=["local", "2 workers"])
def gemma(request, local):
    """The shared Gemma 3 coordinator, in process or over two workers."""
    c = local["gemma3"] if request.param == "local" else request.getfixturevalue("remote")("gemma3")
    c.kv_clear()
    return c


# ---------------------------------------------------------------- helpers
def ok(c: Coordinator, batch: Batch) -> None:
    code = c.decode(batch)
    assert code is OK, f"decode returned {code!r}: {getattr(c, 'last_error', None)}"


def greedy(c: Coordinator, ids, n: int, seq: int = 0, pos0: int = 0):
    """Decode `ids` then n-1 greedy steps (argmax) on `seq`: (logits after the
    prompt, the n tokens, logits of the last step)."""
    ok(c, Batch.single(ids, pos0, seq))
    first = c.logits(-1).copy()
    tok, pos, out = int(first.argmax()), pos0 + len(ids), []
    out.append(tok)
    for _ in range(n - 1):
        ok(c, Batch.single([tok], pos, seq))
        tok, pos = int(c.logits(-1).argmax()), pos + 1
        out.append(tok)
    return first, out, c.logits(-1).copy()


def endpoints_for(daemons, workers):
    return ["local", "local"] if workers == "local x2" else [d.endpoint for d in daemons[:workers]]


# ---------------------------------------------------------------- split == in process
# 1:3 gives gemma3's first stage layers 0-3, all sliding-window: that stage's graph
# never uses the global mask input (it used to crash the in-process path and make the
# remote one raise KeyError). "local x2" is two in-process stages. The output head is
# split over the endpoints (head_split, the default) except where the id says "whole".
SPLITS = [("local x2", [1, 3], True), (2, [1, 1], True), (2, [1, 1], False), (2, [1, 3], True),
          (3, [3, 1, 1], True), (3, [1, 1, 1], True)]


@pytest.mark.parametrize("workers,split,head_split", SPLITS,
                         ids=[f"{w}-{':'.join(map(str, s))}{'' if h else '-head-whole'}" for w, s, h in SPLITS])
@pytest.mark.parametrize("model", ["gemma3", "tiny"])
def test_split_greedy_equals_in_process(model, workers, split, head_split, daemons, model_paths, reference):
    ref_first, ref_tokens, ref_last = reference(model)
    with Coordinator(endpoints_for(daemons, workers), model=model_paths[model], split=split, n_ctx=N_CTX,
                     head_split=head_split) as c:
        bounds = [e["layers"] for e in c.endpoints()]
        assert len(bounds) == len(split)
        starts, stops = [b[0] for b in bounds], [b[1] for b in bounds]
        assert starts[0] == 0 and stops[-1] == c.hp.n_layer and starts[1:] == stops[:-1]
        assert all(a < b for a, b in bounds)
        heads = [e["head_rows"] for e in c.endpoints()]
        if head_split:  # the vocabulary in contiguous shares, in the split's proportions
            assert heads[0][0] == 0 and heads[-1][1] == c.hp.n_vocab
            assert all(a[1] == b[0] for a, b in zip(heads, heads[1:]))
            shares = np.diff([0] + [h[1] for h in heads]) / c.hp.n_vocab
            assert np.allclose(shares, np.array(split) / sum(split), atol=0.01)
            # no stage holds the whole head except the first, whose embedding it is (tied)
            for p in c._places[1:]:
                assert not {"output.weight", "token_embd.weight"} & set(p.stage.weights)
        else:
            assert heads == [None] * len(split)
        first, tokens, last = greedy(c, c.tokenize(PROMPTS[model]), N_GREEDY)
    assert tokens == ref_tokens
    assert np.abs(first - ref_first).max() <= 1e-4
    assert np.abs(last - ref_last).max() <= 1e-4
    # same thread count (1) on both sides: the very same kernels on the very same data
    assert np.array_equal(first, ref_first) and np.array_equal(last, ref_last), \
        f"not bitwise: max abs diff {np.abs(first - ref_first).max()}, {np.abs(last - ref_last).max()}"


def test_tiny_llama_is_not_degenerate(reference, local):
    first, tokens, _ = reference("tiny")
    assert local["tiny"].hp.n_head_kv < local["tiny"].hp.n_head  # GQA
    assert len(set(tokens)) >= 8, tokens
    assert 0.5 < float(first.std()) < 20


def test_gemma3_knows_paris(local):
    c = local["gemma3"]
    c.kv_clear()
    text = c.generate("The capital of France is", max_tokens=16)
    assert re.search(r"paris|france", text, re.IGNORECASE), text
    assert text.strip(), text
    assert sum(ch.isascii() for ch in text) >= 0.95 * len(text), text
    assert len(re.findall(r"[A-Za-z]{2,}", text)) >= 3, text


# ---------------------------------------------------------------- the last layer's output rows
@pytest.mark.parametrize("model", ["gemma3", "tiny"])
def test_the_last_layer_goes_past_attention_for_the_output_rows_only(model, local):
    """As llama.cpp (inp_out_ids): past the last layer's attention output projection only the
    rows that want logits go on, so its FFN multiplies those; every earlier product all the
    step's rows. Those rows' logits are what the full-width graph gives them, up to the
    kernel class of the row count (docs/architecture.md, "Kernels")."""
    from coordinator.model.architectures.common import StepShape
    from ggml_ffi import ffi, graph_nodes, lib

    c = local[model]
    stage, last = c._places[-1].stage, c.hp.n_layer - 1
    g, _ = stage.graph(StepShape(16, 256, 2))
    rows = {ffi.string(n.src[0].name).decode(): n.ne[1] for n in graph_nodes(g.gf) if n.op == lib.GGML_OP_MUL_MAT}
    assert rows[f"blk.{last}.attn_output.weight"] == 16 and rows[f"blk.{last - 1}.ffn_down.weight"] == 16
    assert rows[f"blk.{last}.ffn_down.weight"] == 2 and rows[f"blk.{last}.ffn_up.weight"] == 2
    ids = (c.tokenize(PROMPTS[model]) * 16)[:16]
    c.kv_clear()
    ok(c, Batch(ids, list(range(16)), [[0]] * 16, [False] * 13 + [True, False, True]))
    some = [c.logits(13).copy(), c.logits(15).copy()]
    c.kv_clear()
    ok(c, Batch.single(ids, 0, all_logits=True))
    for got, want in zip(some, [c.logits(13), c.logits(15)]):
        assert int(got.argmax()) == int(want.argmax())
        assert np.abs(got - want).max() <= 1e-2 * np.abs(want).max()


# ---------------------------------------------------------------- batched decode
# Each prompt is 8 tokens or more (gemma3: 9, 10, 16, 11), so decoded alone its K-quant matmuls take
# the tiled kernel as they do in the 46-token batch (a shorter prompt alone would take vec_dot and
# differ in the last bits: docs/architecture.md, "Kernels and what a result depends on").
BATCH_PROMPTS = ["The capital of France is a city that",
                 "Water boils at one hundred degrees Celsius when the",
                 "In 1492, Christopher Columbus sailed across the Atlantic Ocean and",
                 "My favourite food is a warm bowl of soup with"]
N_STEPS = 8


@pytest.fixture(scope="module")
def alone(local):
    """Each batch prompt decoded alone on a fresh KV (in process): tokens, logits per step."""
    cache = {}

    def get(model: str):
        if model in cache:
            return cache[model]
        c = local[model]
        out = []
        for s, prompt in enumerate(BATCH_PROMPTS):
            c.kv_clear()
            ids = c.tokenize(prompt)
            ok(c, Batch.single(ids, 0, s))
            logits = [c.logits(-1).copy()]
            tok, pos, toks = int(logits[-1].argmax()), len(ids), []
            for _ in range(N_STEPS):
                toks.append(tok)
                ok(c, Batch.single([tok], pos, s))
                logits.append(c.logits(-1).copy())
                tok, pos = int(logits[-1].argmax()), pos + 1
            out.append((toks, logits))
        cache[model] = out
        return out

    return get


# gemma3: the 4 prompts make a 46-token batch, the tiny llama's make 164 tokens. From
# 64 query rows on, libggml's CPU flash attention takes another (tiled) kernel whose
# results differ from the per-row kernel's by ~1e-3 relative (f16 intermediates), so
# only below that are the batched logits bitwise those of a sequence decoded alone.
BATCH_TOLERANCE = {"gemma3": 1e-4, "tiny": 0.1}


@pytest.mark.parametrize("where", ["local", "2 workers"])
@pytest.mark.parametrize("model", ["gemma3", "tiny"])
def test_batched_sequences_equal_alone(model, where, local, remote, alone):
    ref = alone(model)
    c = local[model] if where == "local" else remote(model)
    c.kv_clear()
    prompts = [c.tokenize(p) for p in BATCH_PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)
    tokens, pos, seqs, want, last = [], [], [], [], []
    for s, ids in enumerate(prompts):
        tokens += ids
        pos += range(len(ids))
        seqs += [[s]] * len(ids)
        want += [False] * (len(ids) - 1) + [True]
        last.append(len(tokens) - 1)
    ok(c, Batch(tokens, pos, seqs, want))
    step_logits = [[c.logits(i).copy() for i in last]]
    with pytest.raises(IndexError):
        c.logits(0)  # token 0 did not ask for logits
    nxt = [int(l.argmax()) for l in step_logits[0]]
    got = [[] for _ in prompts]
    for step in range(N_STEPS):
        for s in range(len(prompts)):
            got[s].append(nxt[s])
        ok(c, Batch(nxt, [len(p) + step for p in prompts], [[s] for s in range(len(prompts))],
                    [True] * len(prompts)))
        step_logits.append([c.logits(i).copy() for i in range(len(prompts))])
        nxt = [int(l.argmax()) for l in step_logits[-1]]
    worst = 0.0
    for s, (ref_toks, ref_logits) in enumerate(ref):
        assert got[s] == ref_toks, f"sequence {s}: batched {got[s]} != alone {ref_toks}"
        for k in range(N_STEPS + 1):
            worst = max(worst, float(np.abs(step_logits[k][s] - ref_logits[k]).max()))
    assert worst <= BATCH_TOLERANCE[model], worst


# ---------------------------------------------------------------- KV full, invalid batches
@pytest.fixture(params=["local", "2 workers"])
def tiny_small(request, daemons, model_paths):
    eps = ["local"] if request.param == "local" else [d.endpoint for d in daemons[:2]]
    with Coordinator(eps, model=model_paths["tiny"], split=None if len(eps) == 1 else [1, 1],
                     n_ctx=32, n_batch=20) as c:
        yield c


def test_context_full_returns_no_kv_slot(tiny_small):
    c = tiny_small
    ids = c.tokenize("The capital of France is")
    ok(c, Batch.single(ids, 0))
    first = c.logits(-1).copy()
    tok, pos = int(first.argmax()), len(ids)
    codes = []
    for _ in range(c.n_ctx + 4):  # bounded: the cache must fill long before this
        code = c.decode(Batch.single([tok], pos))
        codes.append(code)
        if code is not OK:
            break
        tok, pos = int(c.logits(-1).argmax()), pos + 1
    assert codes[-1] is DecodeResult.NO_KV_SLOT, codes
    assert codes[:-1] == [OK] * (c.n_ctx - len(ids)), codes
    assert c.kv_seq_pos_max(0) == c.n_ctx - 1
    with pytest.raises(RuntimeError):
        c.logits(-1)
    # it stays NO_KV_SLOT, writes nothing, latches nothing
    for batch in (Batch.single([tok], pos), Batch.single([tok, tok], pos), Batch.single([1], 0, seq=1)):
        assert c.decode(batch) is DecodeResult.NO_KV_SLOT
        assert c.kv_seq_pos_max(0) == c.n_ctx - 1 and c.kv_seq_pos_max(1) == -1
    assert c.failed_endpoints() == []
    with pytest.raises(DecodeError) as info:
        c.generate("The capital of France is", max_tokens=c.n_ctx)
    assert info.value.code is DecodeResult.NO_KV_SLOT
    # a batch that does not fit is refused whole, not written in part
    c.kv_clear()
    ok(c, Batch.single(ids, 0))
    assert np.array_equal(c.logits(-1), first)
    ok(c, Batch.single(list(range(3, 3 + c.n_ctx - len(ids) - 2)), len(ids)))
    assert c.decode(Batch.single([5, 6, 7], c.n_ctx - 2)) is DecodeResult.NO_KV_SLOT
    assert c.kv_seq_pos_max(0) == c.n_ctx - 3
    ok(c, Batch.single([5, 6], c.n_ctx - 2))
    assert c.kv_seq_pos_max(0) == c.n_ctx - 1
    c.kv_clear()
    assert c.generate("The capital of France is", max_tokens=8) == local_text(c, "The capital of France is", 8)


def local_text(c: Coordinator, prompt: str, n: int) -> str:
    c.kv_clear()
    ids = c.tokenize(prompt)
    _, toks, _ = greedy(c, ids, n)
    if c.tokenizer.eos_id in toks:
        toks = toks[:toks.index(c.tokenizer.eos_id)]
    c.kv_clear()
    return c.detokenize(toks)


def invalid_batches(n_vocab: int, n_batch: int):
    return {
        "empty": Batch([], []),
        "token == n_vocab": Batch([1, n_vocab], [0, 1]),
        "negative token": Batch([1, -1], [0, 1]),
        "float token": Batch([1.5], [0]),
        "negative pos": Batch([1, 2], [-1, 0]),
        "pos too short": Batch([1, 2], [0]),
        "seq_ids too short": Batch([1, 2], [0, 1], [[0]]),
        "logits too long": Batch([1, 2], [0, 1], [[0], [0]], [True, True, True]),
        "empty seq ids": Batch([1], [0], [[]]),
        "seq id 64": Batch([1], [0], [[64]]),
        "negative seq id": Batch([1], [0], [[-1]]),
        "too large": Batch.single([1] * (n_batch + 1), 0),
        "pos 2**31": Batch([1], [2**31]),
        "pos 2**63": Batch([1], [2**63]),
        "tokens None": Batch(None, [0]),
        "pos a string": Batch([1], "0"),
        "bool seq id": Batch([1], [0], [[True]]),
        "a sequence twice in one token": Batch([1], [0], [[1, 1]]),
        "same position twice": Batch([1, 2], [7, 7], [[1], [1]]),
        "same position twice, shared": Batch([1, 2], [7, 7], [[1, 2], [2]]),
        "position already cached": Batch.single([1], 0),
    }


def test_invalid_batches_are_refused(tiny_small):
    c = tiny_small
    ids = c.tokenize("The capital of France is")
    ok(c, Batch.single(ids, 0))
    first = c.logits(-1).copy()
    for name, batch in invalid_batches(c.hp.n_vocab, c.n_batch).items():
        code = c.decode(batch)
        assert code is DecodeResult.INVALID_BATCH, f"{name}: {code!r}"
        with pytest.raises(RuntimeError):
            c.logits(-1)
        assert c.kv_seq_pos_max(0) == len(ids) - 1, name
        assert c.kv_seq_pos_max(1) == -1, name
    assert c.failed_endpoints() == []
    # still usable, KV untouched: the continuation equals a fresh run's
    _, toks, _ = greedy(c, [int(first.argmax())], 4, pos0=len(ids))
    c.kv_clear()
    first2, toks2, _ = greedy(c, ids, 5)
    assert np.array_equal(first2, first)
    assert toks2[1:] == toks
    # exactly n_batch tokens is fine
    c.kv_clear()
    ok(c, Batch.single([3] * c.n_batch, 0))


# ---------------------------------------------------------------- KV management
def test_kv_calls_refuse_bad_arguments(tiny_small):
    c = tiny_small
    for call in (lambda: c.kv_seq_rm(64), lambda: c.kv_seq_rm(-2), lambda: c.kv_seq_rm("0"),
                 lambda: c.kv_seq_rm(0, 1.5), lambda: c.kv_seq_cp(0, -1), lambda: c.kv_seq_cp(64, 0),
                 lambda: c.kv_seq_pos_max(99), lambda: c.kv_seq_pos_max(True)):
        with pytest.raises(ValueError, match="must be an integer"):
            call()
    c.kv_seq_rm(-1)  # -1: every sequence
    assert c.kv_seq_pos_max(0) == -1


def test_seq_rm_tail_then_redecode(gemma):
    c = gemma
    # 24 tokens: both halves are 8 or more, so all three prompt steps take the same matmul kernels
    ids = c.tokenize("The quick brown fox jumps over the lazy dog because it wanted to see what was on the "
                     "other side of the hill")
    p = len(ids) // 2
    ok(c, Batch.single(ids[:p], 0))
    ok(c, Batch.single(ids[p:], p))
    l1 = c.logits(-1).copy()
    greedy(c, [int(l1.argmax())], 6, pos0=len(ids))  # a continuation that will be removed
    assert c.kv_seq_pos_max(0) == len(ids) + 5
    c.kv_seq_rm(0, p, -1)
    assert c.kv_seq_pos_max(0) == p - 1
    ok(c, Batch.single(ids[p:], p))
    assert np.array_equal(c.logits(-1), l1)
    # and the one-shot prompt gives the same logits (within float reordering)
    c.kv_clear()
    ok(c, Batch.single(ids, 0))
    assert np.abs(c.logits(-1) - l1).max() < 1e-2


def test_seq_cp_continues_from_prefix(gemma, reference):
    c = gemma
    ids = c.tokenize(PROMPTS["gemma3"])
    ref_first, ref_tokens, _ = reference("gemma3")
    ok(c, Batch.single(ids, 0, seq=0))
    first = c.logits(-1).copy()
    assert np.array_equal(first, ref_first)
    c.kv_seq_cp(0, 1)
    assert c.kv_seq_pos_max(1) == len(ids) - 1
    n = 10
    _, toks1, last1 = greedy(c, [int(first.argmax())], n, seq=1, pos0=len(ids))
    _, toks0, last0 = greedy(c, [int(first.argmax())], n, seq=0, pos0=len(ids))
    assert toks1 == toks0 == ref_tokens[1:n + 1]
    assert np.abs(last1 - last0).max() <= 1e-4
    assert np.array_equal(last1, last0)
    # a partial copy: seq 2 gets the first half of the prompt and re-feeds the rest
    p = len(ids) // 2
    c.kv_seq_cp(0, 2, 0, p)
    assert c.kv_seq_pos_max(2) == p - 1
    ok(c, Batch.single(ids[p:], p, seq=2))
    assert np.abs(c.logits(-1) - first).max() < 1e-2
    assert int(c.logits(-1).argmax()) == int(first.argmax())
    # dropping seq 1 does not disturb seq 0
    c.kv_seq_rm(1)
    assert c.kv_seq_pos_max(1) == -1 and c.kv_seq_pos_max(0) == len(ids) + n - 1


# ---------------------------------------------------------------- async face
def test_async_face_matches_sync(gemma):
    c = gemma
    prompt = "The capital of France is"
    text = c.generate(prompt, max_tokens=8)
    c.kv_clear()
    ids = c.tokenize(prompt)
    ok(c, Batch.single(ids, 0))
    sync_logits = c.logits(-1).copy()
    c.kv_clear()

    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        code = await c.adecode(Batch.single(ids, 0))
        logits = c.logits(-1).copy()
        pieces = [piece async for piece in c.astream(prompt, max_tokens=8)]
        stop.set()
        await t
        return code, logits, pieces, ticks

    code, logits, pieces, ticks = asyncio.run(asyncio.wait_for(main(), 60))
    assert code is OK
    assert np.array_equal(logits, sync_logits)
    assert "".join(pieces) == text
    assert len(pieces) >= 2
    assert ticks > 1  # the caller's loop kept running while the coordinator worked


# ---------------------------------------------------------------- generations
GEN_PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello"]


def test_concurrent_generations_take_turns(local):
    """generate/stream/astream share sequence 0: called at the same time from
    several threads or tasks, each still gets exactly its text alone."""
    from concurrent.futures import ThreadPoolExecutor
    c = local["tiny"]
    alone = {p: c.generate(p, max_tokens=12) for p in GEN_PROMPTS}
    with ThreadPoolExecutor(len(GEN_PROMPTS)) as pool:
        texts = list(pool.map(lambda p: c.generate(p, max_tokens=12), GEN_PROMPTS * 2))
    assert texts == [alone[p] for p in GEN_PROMPTS * 2]

    async def collect(prompt):
        return "".join([piece async for piece in c.astream(prompt, max_tokens=12)])

    async def main():
        return await asyncio.gather(*(collect(p) for p in GEN_PROMPTS))

    assert asyncio.run(asyncio.wait_for(main(), 120)) == [alone[p] for p in GEN_PROMPTS]


def test_a_second_generation_from_the_thread_holding_one_is_refused(local):
    """Waiting for a generation its own thread keeps open would wait forever."""
    c = local["tiny"]
    first = c.stream("Once upon a time", max_tokens=8)
    next(first)
    with pytest.raises(RuntimeError, match="already has a generation open"):
        c.generate("Hello", max_tokens=2)
    first.close()  # closing it frees the turn
    assert c.generate("Hello", max_tokens=4) == c.generate("Hello", max_tokens=4)


def test_generate_options(local):
    c = local["tiny"]
    text = c.generate("The capital of France is", max_tokens=16)
    word = next(w for w in text.split() if len(w) >= 2)
    cut = text.index(word)
    # a string is one stop string, not a set of characters
    assert c.generate("The capital of France is", max_tokens=16, stop=word) == text[:cut]
    assert c.generate("The capital of France is", max_tokens=0) == ""
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError):
            c.generate("x", max_tokens=bad)
    # the last new token is sampled, never decoded: prompt + max_tokens - 1 cells
    n = len(c.tokenize("The capital of France is"))
    with Coordinator(["local"], model=c.model_path, n_ctx=n + 3) as small:
        assert small.generate("The capital of France is", max_tokens=4) == c.generate("The capital of France is",
                                                                                       max_tokens=4)
        with pytest.raises(DecodeError) as info:
            small.generate("The capital of France is", max_tokens=5)
        assert info.value.code is DecodeResult.NO_KV_SLOT


def test_a_sync_generation_from_the_task_holding_an_astream_is_refused(local):
    c = local["tiny"]

    async def main():
        pieces = c.astream("Once upon a time", max_tokens=8)
        await pieces.__anext__()
        try:
            with pytest.raises(RuntimeError, match="already has a generation open"):
                c.generate("Hello", max_tokens=2)  # would block this thread, and so the astream, for good
        finally:
            await pieces.aclose()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_close_wakes_a_thread_waiting_for_its_turn(model_paths):
    import threading
    c = Coordinator(["local"], model=model_paths["tiny"], n_ctx=64)
    first = c.stream("Once upon a time", max_tokens=20)
    next(first)  # this thread holds the turn
    out = []

    def waiter():
        try:
            out.append(c.generate("Hello", max_tokens=4))
        except BaseException as exc:  # noqa: BLE001 - what it gets is the point
            out.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.3)
    c.close()
    t.join(10)
    assert not t.is_alive(), "close() left a caller blocked"
    assert isinstance(out[0], RuntimeError) and "closed" in str(out[0]), out


def test_a_stream_collected_on_the_loop_thread_does_not_wedge_the_coordinator(local):
    """An abandoned stream in a reference cycle, collected by the GC while the
    coordinator's loop thread runs: it must not block that thread."""
    import gc
    import threading
    c = local["tiny"]
    gc.disable()  # collect exactly where this test says
    try:
        s = c.stream("Once upon a time", max_tokens=50)
        next(s)
        cycle = [s]
        cycle.append(cycle)
        del s, cycle
        c._loop.call_soon_threadsafe(gc.collect)
        got = []
        t = threading.Thread(target=lambda: got.append(c.generate("Hello", max_tokens=2)), daemon=True)
        t.start()
        t.join(10)
        assert got, "the coordinator's loop is blocked"
    finally:
        gc.enable()


CLOSE_DURING_LOCAL_STEP = """
import asyncio, sys, time
from coordinator import Batch, Coordinator
c = Coordinator(["local"], n_ctx=512)
ids = list(range(10, 10 + 384))
step = asyncio.run_coroutine_threadsafe(c._decoder.decode(Batch.single(ids, 0)), c._loop)
time.sleep(0.2)
print("in flight at close:", not step.done(), flush=True)
c.close()  # what Ctrl-C or SIGTERM in the middle of a step leads to
print("closed", flush=True)
"""


def test_close_during_an_in_process_step_does_not_crash(local):
    """close() while the in-process executor computes (a step whose caller was
    interrupted): its memory is freed after the compute, not under it (this
    was a segfault)."""
    r = subprocess.run([sys.executable, "-c", CLOSE_DURING_LOCAL_STEP], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "in flight at close: True" in r.stdout and "closed" in r.stdout, r.stdout


@pytest.mark.parametrize("split_mode", ["layer", "tensor"])
def test_warmup_leaves_nothing_behind_but_the_workers_first_computes(split_mode, daemons, model_paths):
    """Coordinator(warmup=True): its steps send every stage its one-token graphs (the argmax's and
    the full logits') before the first request, and leave the cache empty and the stats at zero:
    a prompt and its greedy continuation decode to the same bits as without it."""
    endpoints, runs, counts = [d.endpoint for d in daemons[:2]], {}, {}
    for warmup in (False, True):
        with Coordinator(endpoints, model=model_paths["tiny"], n_ctx=N_CTX, split=[1, 1], split_mode=split_mode,
                         warmup=warmup) as c:
            sent = [len(p.executor.sent_graphs) for p in c._endpoints.places]
            assert all(sent) if warmup else not any(sent), sent
            assert c.kv_seq_pos_max(0) == -1
            with pytest.raises(RuntimeError, match="did not return OK"):  # nothing of the warm-up to read
                c.logits()
            head = c.head_placement()
            counts[warmup] = (dict(c.stats), {k: head.get(k) for k in ("choice", "steps_split", "steps_whole",
                                                                      "steps_here", "changes")})
            runs[warmup] = greedy(c, c.tokenize(PROMPTS["tiny"]), 8)
    assert counts[True] == counts[False]  # the warm-up's steps count nowhere
    (logits0, tokens0, last0), (logits1, tokens1, last1) = runs[False], runs[True]
    assert tokens1 == tokens0
    assert np.array_equal(logits1, logits0) and np.array_equal(last1, last0)


# ---------------------------------------------------------------- CLI
def _cli() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "ggml-coordinator")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "coordinator"]


def test_cli_generate_with_local_workers(local):
    """The README's command: generate on local workers. With the layer split it prints the text the
    library decodes in process, and names each worker's layers; by default (--split-mode auto, which
    may take either split for gemma3-270m, by measurement) it prints the same text (the tensor split's
    exact sums are one process's bits) and names the split it ran."""
    prompt = "The capital of France is"
    r = subprocess.run(_cli() + ["generate", "-p", prompt, "-n", "8", "--split-mode", "layer"], capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), r.stdout
    assert re.search(r"\[8 tokens in [\d.]+ s, [\d.]+ tokens/s, [\d.]+ after the first; "
                     r".*layers 0-\d+ \(\d+%\) head \d+%"
                     r".*layers \d+-17 \(\d+%\) head \d+%\]", r.stderr), r.stderr
    c = local["gemma3"]
    c.kv_clear()
    assert r.stdout == c.generate(prompt, max_tokens=8)
    r = subprocess.run(_cli() + ["generate", "-p", prompt, "-n", "8"], capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert re.search(r"\[8 tokens in [\d.]+ s, [\d.]+ tokens/s, [\d.]+ after the first; "
                     r".*(layers 0-\d+ \(\d+%\).*head \d+%\]|shard 1/2 of every layer.*; exact sums\])",
                     r.stderr), r.stderr
    assert r.stdout == c.generate(prompt, max_tokens=8)


def test_cli_unreachable_endpoint_fails_fast():
    started = time.monotonic()
    r = subprocess.run(_cli() + ["generate", "-p", "hi", "-n", "4", "--endpoints", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - started
    assert r.returncode != 0
    assert "127.0.0.1:1" in r.stderr and "unreachable" in r.stderr.lower(), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert elapsed < 10 * SLACK, elapsed


def test_greedy_takes_a_bool_or_a_count_of_best_tokens(gemma):
    for bad in (-1, 65, "8", 2.0, None):
        with pytest.raises(ValueError, match="greedy must be a bool or a count of best tokens 0..64"):
            gemma.decode(Batch.single([2, 3], 0), greedy=bad)
    gemma.kv_clear()
    assert gemma.decode(Batch.single([2, 3], 0), greedy=3) is OK
    assert len(gemma.best_tokens(-1)) == 3 and gemma.best_tokens(-1)[0] == gemma.token(-1)
    with pytest.raises(RuntimeError, match="greedy=True"):
        gemma.logits(-1)
    gemma.kv_clear()
    assert gemma.decode(Batch.single([2, 3], 0)) is OK
    with pytest.raises(RuntimeError, match="returned logits"):
        gemma.best_tokens(-1)


def test_greedy_decode_returns_the_argmax_of_the_logits(gemma, reference):
    """decode(greedy=True): the last worker sends each row's argmax instead of
    its logits; the tokens equal the full-logits argmax, logits() is refused,
    and generate() (which uses it at temperature 0) gives the reference text."""
    ids = gemma.tokenize(PROMPTS["gemma3"])
    _, want, _ = greedy(gemma, ids, 12)
    gemma.kv_clear()
    assert gemma.decode(Batch.single(ids, 0), greedy=True) is OK
    got, pos = [gemma.token(-1)], len(ids)
    with pytest.raises(RuntimeError, match="greedy=True"):
        gemma.logits(-1)
    for _ in range(11):
        assert gemma.decode(Batch.single([got[-1]], pos), greedy=True) is OK
        got.append(gemma.token(-1))
        pos += 1
    assert got == want
    gemma.kv_clear()
    assert gemma.generate(PROMPTS["gemma3"], max_tokens=12) == gemma.detokenize(want)


@pytest.mark.parametrize("head", ["ties", "tied"])
def test_head_shards_combine_as_one_head(head, daemons, tmp_path):
    """The output head split over three workers gives the in-process logits bit
    for bit, and greedy picks what argmax over the whole row picks. "ties": every
    logit is tied with those of 5 other ids, in other shards too, so the lowest
    id must win; "tied": the head is the token embedding, which the first worker
    holds whole and multiplies by a view of its rows."""
    path = write_tiny_llama(tmp_path / f"tiny-{head}.gguf", seed=3, head=head)
    eps = [d.endpoint for d in daemons[:3]]
    with Coordinator(["local"], model=path, n_ctx=N_CTX) as ref, \
            Coordinator(eps, model=path, split=[1, 2, 1], n_ctx=N_CTX) as c:
        assert [e["head_rows"] for e in c.endpoints()] == [[0, 75], [75, 225], [225, 300]]
        ids = list(range(3, 40))
        for x in (ref, c):
            ok(x, Batch.single(ids, 0, all_logits=True))
        for i in range(len(ids)):
            assert np.array_equal(c.logits(i), ref.logits(i))
        want = [int(ref.logits(i).argmax()) for i in range(len(ids))]
        if head == "ties":
            assert max(want) < 50  # the first of each tied group
        c.kv_clear()
        assert c.decode(Batch.single(ids, 0, all_logits=True), greedy=True) is OK
        assert [c.token(i) for i in range(len(ids))] == want
        # greedy=k: each row's k best tokens from the three shards' best, merged: the argmax first, then
        # by logit (with ties across shards, whichever of the tied ids each shard's own k best held)
        c.kv_clear()
        assert c.decode(Batch.single(ids, 0, all_logits=True), greedy=8) is OK
        for i in range(len(ids)):
            best, row = c.best_tokens(i), ref.logits(i)
            assert best[0] == want[i] == c.token(i) and len(set(best.tolist())) == 8
            assert np.array_equal(row[best], np.sort(row)[::-1][:8]), (i, best)
            if head == "tied":  # no ties: exactly the 8 highest
                assert list(best) == list(np.argsort(-row, kind="stable")[:8])

def assert_gone(children: list[int], outlived: str) -> None:
    """The local workers `children` exit within 15 s (zombies count as gone);
    any left are killed, and the test fails."""
    deadline = time.monotonic() + 15 * SLACK
    alive = children
    while alive and time.monotonic() < deadline:
        alive = [c for c in children if os.path.exists(f"/proc/{c}") and
                 open(f"/proc/{c}/stat").read().split()[2] != "Z"]
        time.sleep(0.1)
    for c in alive:
        os.kill(c, signal.SIGKILL)
    assert not alive, f"local workers {alive} outlived {outlived}"


def test_local_workers_die_with_a_killed_coordinator(tmp_path):
    """ggml-coordinator started its own workers; SIGKILL it: they must not linger."""
    import time

    port = free_port()
    proc = subprocess.Popen(_cli() + ["serve", "--port", str(port), "--parallel", "1", "--ctx-per-slot", "64",
                                      "--log-level", "info"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60 * SLACK
        for line in proc.stderr:  # bounded by the deadline check below and the process's own output
            if "serving" in line or time.monotonic() > deadline:
                break
        children = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        assert len(children) == 2, children
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert_gone(children, "the killed coordinator")


@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_cli_generate_stopped_by_a_signal_exits_cleanly(model_paths, sig, code, word):
    """SIGTERM or Ctrl-C in the middle of `generate`: no traceback, the exit
    status a shell expects, and the local workers it started are stopped (the
    SIGTERM case once left one behind: its log writes to the dead pipe raised)."""
    # SIGINT as in a terminal's foreground job: a test run started in the background of a
    # non-interactive shell (`.ci/run &`) ignores SIGINT, which the CLI would inherit and keep;
    # a shim resets it and execs the CLI (its pid stays the one signalled)
    shim = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", shim, *_cli(), "generate", "-p", "Once upon a time",
                             "-n", "100000", "-c", "100100", "-m", str(model_paths["tiny"])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout.read(20), "no text came out"  # bounded: the -n 100000 run outlasts the read
        children = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        assert len(children) == 2, children
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == code, (proc.returncode, err[-2000:])
    assert f"ggml-coordinator: {word}" in err and "Traceback" not in err, err[-2000:]
    assert_gone(children, "the stopped coordinator")


def test_cli_generate_json_logs_every_stderr_line(model_paths):
    """`generate --log-format json`: the text on stdout, and every line on
    stderr JSON, the summary included (event "generated", with its numbers)."""
    r = subprocess.run(_cli() + ["generate", "-p", "Once upon a time", "-n", "4", "--log-format", "json",
                                 "--log-level", "info", "-m", str(model_paths["tiny"])],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and r.stdout, r.stderr
    events = [json.loads(line) for line in r.stderr.splitlines()]
    summary = [e for e in events if e["event"] == "generated"]
    assert len(summary) == 1 and summary[0]["tokens"] == 4 and summary[0]["level"] == "info", events[-3:]
    assert len(summary[0]["endpoints"]) == 2 and summary[0]["tokens_per_second"] > 0
    assert 0 < summary[0]["first_piece_seconds"] <= summary[0]["seconds"], summary[0]
    assert "tokens_per_second_after_first" in summary[0]
    assert [e for e in events if e["event"] == "warmed up"], events  # generate warms up by default


@pytest.mark.parametrize("where", ["local x2", "2 workers", "2 workers head whole"])
def test_batch_without_logit_rows_writes_the_kv_only(where, daemons, model_paths, reference):
    """A prompt fed in chunks of which only the last wants logits (what the HTTP
    server does with prompts longer than n_batch): the chunks without logit rows
    decode OK, return no logits, and the text continues as the reference."""
    eps = ["local", "local"] if where == "local x2" else [d.endpoint for d in daemons[:2]]
    _, ref_tokens, _ = reference("tiny")
    with Coordinator(eps, model=model_paths["tiny"], split=[1, 1], n_ctx=N_CTX,
                     head_split=not where.endswith("whole")) as c:
        ids = c.tokenize(PROMPTS["tiny"])
        half = len(ids) // 2
        for greedy_step in (False, True):
            c.kv_clear()
            no_logits = Batch(ids[:half], list(range(half)), [[0]] * half, [False] * half)
            assert c.decode(no_logits, greedy=greedy_step) is OK, c.last_error
            with pytest.raises(IndexError):
                c.logits(-1) if not greedy_step else c.token(-1)
            ok(c, Batch.single(ids[half:], half))
            assert int(c.logits(-1).argmax()) == ref_tokens[0]


@pytest.mark.parametrize("where", ["local", "2 workers", "2 workers head whole"])
def test_nan_logits_fail_greedy_steps_too(where, daemons, tmp_path):
    """A model whose head makes one logit NaN: COMPUTE_FAILED with or without
    greedy=True (a greedy step must not hand out a token picked around a NaN)."""
    path = write_tiny_llama(tmp_path / "tiny-nan.gguf", seed=0, head="nan")
    eps = ["local"] if where == "local" else [d.endpoint for d in daemons[:2]]
    with Coordinator(eps, model=path, n_ctx=N_CTX, head_split=not where.endswith("whole")) as c:
        for greedy_step in (False, True):
            c.kv_clear()
            assert c.decode(Batch.single([5, 6, 7], 0), greedy=greedy_step) is DecodeResult.COMPUTE_FAILED
            assert "NaN or infinity" in c.last_error and c.failed_endpoints() == []
            with pytest.raises(RuntimeError):
                c.token(-1)
