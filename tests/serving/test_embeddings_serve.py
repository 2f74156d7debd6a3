"""/v1/embeddings against a real `ggml-coordinator serve --embeddings --local-workers 2` (the bundled
Gemma 3 270M, n_embd 640), through the official `openai` client (base64 by default) and plain JSON:
the vectors, their order and usage, the refusals, and that an embedding leaves no KV rows a later
request would reuse as its prompt cache."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from http_helpers import Serve, openai_client, served
from test_http_openai import call, local_tokenizer

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

N_EMBD = 640  # gemma3-270m
CTX = 256
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
         "def add(a, b):\n    return a + b"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from served(tmp_path_factory, "--embeddings", "--parallel", "2", "--ctx-per-slot", str(CTX))


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def post(server, path: str, body) -> tuple[int, dict]:
    status, _, parsed = asyncio.run(call("POST", server.url + path, body, timeout=120))
    return status, parsed


def vectors(response) -> list[np.ndarray]:
    return [np.asarray(d.embedding, dtype=np.float32) for d in response.data]


def test_openai_client_base64_vectors_usage_and_order(server, client):
    tok = local_tokenizer()
    r = client.embeddings.create(model="any", input=TEXTS)  # the client asks base64 and decodes it
    assert r.object == "list" and r.model == server.model and [d.index for d in r.data] == [0, 1, 2]
    vs = vectors(r)
    for v in vs:
        assert v.shape == (N_EMBD,) and np.isfinite(v).all()
        assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-4
    n_tokens = sum(len(tok.encode(t, add_special=True)) for t in TEXTS)
    assert r.usage.prompt_tokens == n_tokens and r.usage.total_tokens == n_tokens
    # each in the batch is what it is alone, in the inputs' order
    for text, v in zip(TEXTS, vs):
        alone = vectors(client.embeddings.create(model="any", input=text))[0]
        assert np.allclose(alone, v, atol=2e-4), (text, float(np.abs(alone - v).max()))
    # different inputs differ (clearly: not rounding)
    for i in range(len(vs)):
        for j in range(i + 1, len(vs)):
            assert float(np.dot(vs[i], vs[j])) < 0.999, (i, j)


def test_float_format_same_input_twice_and_token_ids(server, client):
    tok = local_tokenizer()
    status, body = post(server, "/v1/embeddings", {"input": [TEXTS[0], TEXTS[1], TEXTS[0]], "model": "m"})
    assert status == 200, body
    data = body["data"]
    assert [d["index"] for d in data] == [0, 1, 2] and all(d["object"] == "embedding" for d in data)
    vs = [np.asarray(d["embedding"], dtype=np.float32) for d in data]
    assert all(v.shape == (N_EMBD,) for v in vs)
    assert np.allclose(vs[0], vs[2], atol=1e-5) and not np.allclose(vs[0], vs[1], atol=1e-2)
    b64 = vectors(openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).embeddings.create(
        model="any", input=TEXTS[0]))[0]
    assert np.allclose(b64, vs[0], atol=2e-4)
    # token ids are taken as they are (no BOS added); the text's own ids give the text's vector
    ids = tok.encode(TEXTS[0], add_special=True)
    status, body = post(server, "/v1/embeddings", {"input": ids})
    assert status == 200 and body["usage"]["prompt_tokens"] == len(ids), body
    assert np.allclose(np.asarray(body["data"][0]["embedding"], np.float32), vs[0], atol=2e-4)
    # llama-server's routes and its `content` field
    for path in ("/embeddings", "/embedding"):
        status, body = post(server, path, {"content": TEXTS[0]})
        assert status == 200 and np.allclose(np.asarray(body["data"][0]["embedding"], np.float32), vs[0],
                                             atol=2e-4), body


def test_refusals(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="any", input="hi", extra_body={"pooling": "cls"})
    assert "'pooling'" in info.value.message and info.value.body["param"] == "pooling", info.value.body
    status, body = post(server, "/v1/embeddings", {"input": "hi", "frobnicate": 1})
    assert status == 400 and "'frobnicate'" in body["error"]["message"] and body["error"]["param"] == "frobnicate"
    status, body = post(server, "/v1/embeddings", {"input": ["short", [7] * (CTX + 1)]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert body["error"]["param"] == "input" and "input 1 of 257 tokens" in body["error"]["message"]
    status, body = post(server, "/v1/embeddings", {"input": "word " * (CTX + 10)})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="any", input="hi", dimensions=8)
    assert info.value.body["param"] == "dimensions"


def test_no_stale_prompt_cache_after_embeddings(server, client):
    messages = [{"role": "user", "content": "Name three colours."}]

    def chat(**kw):
        r = client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0, **kw)
        return r.choices[0].message.content, r.usage

    before, usage = chat(extra_body={"cache_prompt": False})  # the prompt decoded whole
    assert usage.prompt_tokens_details.cached_tokens == 0
    _, usage = chat()  # a slot holds the prompt's rows now: they are reused
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    status, rendered = post(server, "/apply-template", {"messages": messages})
    assert status == 200, rendered
    status, tokens = post(server, "/tokenize", {"content": rendered["prompt"], "add_special": False})
    assert status == 200 and len(tokens["tokens"]) == usage.prompt_tokens, (tokens, usage)
    # the chat's own prompt tokens, on both slots: every slot's rows are the embedding's while it runs
    client.embeddings.create(model="any", input=[tokens["tokens"]] * 2 + ["something else entirely"])
    after, usage = chat()
    assert usage.prompt_tokens_details.cached_tokens == 0  # no slot holds a cache any more: decoded whole
    assert after == before  # as decoded whole before: nothing of the embedding's rows was read
    status, _, slots = asyncio.run(call("GET", server.url + "/slots"))
    assert status == 200 and sorted(s["n_cache_tokens"] for s in slots)[0] == 0, slots


def test_embeddings_alongside_a_completion(server, client):
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    status, reference = post(server, "/v1/completions", body)
    assert status == 200, reference

    async def both():
        return await asyncio.gather(call("POST", server.url + "/v1/completions", body, timeout=120),
                                    call("POST", server.url + "/v1/embeddings", {"input": TEXTS}, timeout=120))
    (s1, _, completion), (s2, _, emb) = asyncio.run(both())
    assert s1 == 200 and completion["choices"][0]["text"] == reference["choices"][0]["text"], completion
    assert s2 == 200 and len(emb["data"]) == 3, emb


def test_last_and_cls_pooling_one_slot_and_inputs_longer_than_a_step(tmp_path):
    """--pooling last and cls on one slot (the inputs one after another), and an input longer than
    n_batch (512), fed in two steps."""
    tok = local_tokenizer()
    long_ids = tok.encode("The history of the city goes back many centuries. " * 70, add_special=True)[:700]
    assert len(long_ids) == 700
    for pooling in ("last", "cls"):
        (tmp_path / pooling).mkdir()
        s = Serve(str(tmp_path / pooling), "--embeddings", "--pooling", pooling, "--parallel", "1",
                  "--ctx-per-slot", "1024")
        try:
            status, body = post(s, "/v1/embeddings", {"input": TEXTS[:2] + [long_ids, long_ids[:600], TEXTS[0]]})
            assert status == 200, body
            vs = [np.asarray(d["embedding"], np.float32) for d in body["data"]]
            assert all(v.shape == (N_EMBD,) and abs(float(np.linalg.norm(v)) - 1) < 1e-4 for v in vs)
            assert np.allclose(vs[0], vs[4], atol=1e-5)  # the same text, on the same slot later
            if pooling == "last":  # each its own last token's state
                assert not np.allclose(vs[0], vs[1], atol=1e-2) and not np.allclose(vs[2], vs[3], atol=1e-2)
            else:  # a causal model's first token (BOS) sees nothing after it: the same for every input
                assert all(np.allclose(vs[0], v, atol=2e-4) for v in vs[1:])
        finally:
            s.stop()
        assert s.proc.returncode == 0, s.text()[-2000:]
