"""llama-server's own endpoints against a real `ggml-coordinator serve --local-workers 2`
(the bundled Gemma 3 270M): /completion (whole and streamed, its fields and reply shape),
/apply-template, /slots while a request runs, /infill's refusal for a model without
FIM tokens, and /v1/embeddings' refusal."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from http_helpers import served
from test_http_openai import request

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

PROMPT = "The capital of France is"
TIMING_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from served(tmp_path_factory, "--parallel", "2", "--ctx-per-slot", "256")


def post(server, path: str, body, headers: dict | None = None):
    return request("POST", server.url + path, body, headers=headers)


async def native_events(url: str, body: dict, headers: dict | None = None) -> tuple[list, list[bytes]]:
    """A /completion stream's events (parsed) and its raw `data:` lines."""
    events, lines = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(url, json=dict(body, stream=True), headers=headers) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream"), await r.text()
            async for line in r.content:
                line = line.strip()
                if line.startswith(b"data: "):
                    lines.append(line)
                    events.append(json.loads(line[6:]))
    return events, lines


def test_completion_matches_v1_completions(server):
    status, _, ours = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert status == 200, ours
    status, _, body = post(server, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0})
    assert status == 200, body
    assert body["content"] == ours["choices"][0]["text"]
    assert (body["stop"], body["stop_type"], body["stopping_word"], body["tokens_predicted"],
            body["tokens_evaluated"], body["prompt"], body["model"], body["truncated"]) == (
        True, "limit", "", 8, ours["usage"]["prompt_tokens"], PROMPT, server.model, False)
    assert set(body["timings"]) == TIMING_KEYS and body["timings"]["predicted_n"] == 8
    assert body["id_slot"] in (0, 1) and body["tokens"] == [] and "completion_probabilities" not in body
    # the same prompt again: its prefix is taken from the slot's KV rows
    status, _, again = post(server, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0})
    assert again["content"] == body["content"] and again["tokens_cached"] > 0, again
    assert again["timings"]["cache_n"] == again["tokens_cached"]
    assert again["timings"]["prompt_n"] == again["tokens_evaluated"] - again["tokens_cached"]
    # the alias, a prompt of token ids, and a stop string
    status, _, tokens = post(server, "/tokenize", {"content": PROMPT})
    status, _, by_ids = post(server, "/completions", {"prompt": tokens["tokens"], "n_predict": 8,
                                                      "temperature": 0})
    assert status == 200 and by_ids["tokens_evaluated"] == len(tokens["tokens"]), by_ids
    word = body["content"].strip().split()[0]
    status, _, stopped = post(server, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0,
                                                      "stop": [word]})
    assert status == 200 and (stopped["stop_type"], stopped["stopping_word"]) == ("word", word), stopped
    assert stopped["content"] == body["content"][:body["content"].index(word)]


def test_completion_streamed_and_probabilities(server):
    status, _, whole = post(server, "/completion", {"prompt": PROMPT, "n_predict": 6, "temperature": 0,
                                                    "n_probs": 2})
    assert status == 200, whole
    probs = whole["completion_probabilities"]
    assert len(probs) == whole["tokens_predicted"] == 6
    for p in probs:  # greedy: the token drawn is the most likely one
        assert len(p["top_logprobs"]) == 2 and p["top_logprobs"][0]["id"] == p["id"] and p["logprob"] <= 0
    assert "".join(p["token"] for p in probs) == whole["content"]
    events, lines = asyncio.run(native_events(server.url + "/completion",
                                              {"prompt": PROMPT, "n_predict": 6, "temperature": 0}))
    assert all(line != b"data: [DONE]" for line in lines)  # llama-server's /completion sends no [DONE]
    *pieces, last = events
    assert pieces and all(not e["stop"] and set(e) == {"index", "content", "tokens", "stop", "id_slot",
                                                       "tokens_predicted", "tokens_evaluated"} for e in pieces)
    assert "".join(e["content"] for e in pieces) == whole["content"]
    assert last["stop"] and last["content"] == "" and last["stop_type"] == "limit" and last["tokens_predicted"] == 6
    assert set(last["timings"]) == TIMING_KEYS
    events, _ = asyncio.run(native_events(server.url + "/completion", {"prompt": PROMPT, "n_predict": 3,
                                                                       "temperature": 0, "n_probs": 1}))
    assert sum(len(e.get("completion_probabilities", [])) for e in events) == 3


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "temprature": 0}, "temprature"), ({"prompt": PROMPT, "mirostat": 2}, "mirostat"),
    ({"prompt": PROMPT, "logprobs": 3}, "logprobs"), ({"prompt": PROMPT, "n": 2}, "n"),
    ({"prompt": [10**9]}, "prompt"), ({}, "prompt"),
])
def test_completion_refusals_name_the_field(server, body, param):
    status, _, answer = post(server, "/completion", body)
    assert status == 400 and answer["error"]["param"] == param and param in answer["error"]["message"], answer


def test_apply_template(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    status, _, body = post(server, "/apply-template", {"messages": messages})
    assert status == 200, body
    prompt = body["prompt"]
    assert "Be brief." in prompt and "Name a colour." in prompt and prompt.rstrip().endswith("model"), prompt
    # what the chat endpoint decodes: the same tokens
    status, _, tokens = post(server, "/tokenize", {"content": prompt, "add_special": False})
    status, _, chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == len(tokens["tokens"]), (chat, tokens)
    status, _, bad = post(server, "/apply-template", {"messages": []})
    assert status == 400 and bad["error"]["param"] == "messages"


def test_slots_show_the_request_and_the_cache(server):
    async def scenario():
        url = server.url + "/completion"
        body = {"prompt": "Once upon a time", "n_predict": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with s.post(url, json=body, headers={"X-Request-Id": "slot-watch-1"}) as r:
                assert r.status == 200
                await r.content.readline()  # the first piece: it is decoding
                async with s.get(server.url + "/slots") as g:
                    during = await g.json()
                busy = [e for e in during if e["is_processing"]]
                assert len(busy) == 1 and busy[0]["request_id"] == "slot-watch-1", during
                assert busy[0]["n_prompt_tokens"] > 0 and busy[0]["next_token"][0]["n_decoded"] >= 1, during
                async for _ in r.content:  # to the end
                    pass
            async with s.get(server.url + "/slots") as g:
                after = await g.json()
        return busy[0]["id"], after
    seq, after = asyncio.run(scenario())
    assert [e["id"] for e in after] == [0, 1] and not any(e["is_processing"] for e in after), after
    assert all(e["n_ctx"] == 256 and "request_id" not in e for e in after)
    assert after[seq]["n_cache_tokens"] > 200  # its prompt and the 200 tokens, kept for the next request


def test_infill_refused_without_fim_tokens_and_no_embeddings(server):
    status, _, body = post(server, "/infill", {"input_prefix": "def f(", "input_suffix": "):\n    pass\n"})
    assert status == 400 and "no fill-in-the-middle tokens" in body["error"]["message"], body
    assert "prefix token is missing" in body["error"]["message"]
    status, _, body = post(server, "/v1/embeddings", {"input": "hello"})
    assert status == 501 and body["error"]["type"] == "not_supported_error", body  # as llama-server
    assert "Start it with `--embeddings`" in body["error"]["message"], body
