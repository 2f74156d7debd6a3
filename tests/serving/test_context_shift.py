"""Context shift (`serve --context-shift`, llama-server's; issue #28;
coordinator/serving/batching.py): a generation that reaches its slot's
context keeps its first n_keep tokens (plus BOS), drops half of the rest and
decodes the remainder again behind them, then goes on.

* Pure: shift_span is llama-server's arithmetic (server-context.cpp, pre_decode).
* A real `ggml-coordinator serve` over two workers on 127.0.0.1 (pipelined:
  a group of slots per worker), 64 tokens per slot, the tiny model, greedy:
  a request runs past its context to max_tokens (completions, streamed or
  not, chat, llama-server's /completion; two at once on two slots), and the
  tokens after each shift are those a direct Coordinator decode of the kept
  history gives; n_keep is honoured; without the flag the same request is
  refused, and n_predict -1 stops at the context; a prompt that leaves no
  room is refused either way; and with resuming on, a worker killed while
  a generation shifts: the same text.
"""
from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import numpy as np
import pytest
from conftest import SLACK, WorkerSet
from http_helpers import Server, get, post, stream, stream_text

from coordinator import Batch, Coordinator
from coordinator.serving.batching import shift_span

HANG_GUARD = 120.0  # s: a request that takes longer has hung (a guard, not a bound under test)
N_CTX = 64  # tokens per slot
N_PROMPT = 20
LONG = 150  # tokens asked: past the context more than twice
ADD_BOS = True  # the tiny llama's tokenizer.ggml.add_bos_token


# ------------------------------------------------------------ pure
def test_shift_span_is_llama_servers():
    # n_keep 0 (+1 for BOS); 63 tokens held in a 64-token context: 62 left, 31 dropped
    assert shift_span(63, 20, 0, True, 64) == (1, 31)
    assert shift_span(63, 20, 0, False, 64) == (0, 31)
    assert shift_span(63, 20, -1, True, 64) == (21, 21)  # the whole prompt, plus one (llama-server counts BOS again)
    assert shift_span(63, 20, 10, True, 64) == (11, 26)
    assert shift_span(63, 20, 100, True, 64) == (60, 1)  # at most n_ctx - 4 kept; at least one token dropped
    assert shift_span(63, 70, -1, False, 64) == (60, 1)


def simulate(prompt: list[int], generated: list[int], n_keep: int, n_ctx: int = N_CTX):
    """What the server holds as it generates `generated`: for each shift, (index of the first token
    sampled after it, the kept history that token is sampled from)."""
    kv, shifts = list(prompt), []
    for i, tok in enumerate(generated[:-1]):  # the last one ends the request: no shift after it
        if len(kv) + 1 >= n_ctx:
            keep, discard = shift_span(len(kv), len(prompt), n_keep, ADD_BOS, n_ctx)
            kv = kv[:keep] + kv[keep + discard:]
            shifts.append((i + 1, kv + [tok]))
        kv.append(tok)
    return shifts


def test_simulate_shifts_where_the_context_ends():
    shifts = simulate(list(range(20)), list(range(100, 100 + LONG)), 0)
    first, history = shifts[0]
    # the prompt's 20 and 43 generated tokens fill 63 rows: the 44th token is sampled, then the shift
    assert first == N_CTX - N_PROMPT and len(history) == N_CTX - 31
    assert history[:1] == [0] and history[-1] == 100 + first - 1
    assert all(len(h) < N_CTX for _, h in shifts)


# ------------------------------------------------------------ a real server
def prompt_of(seed: int, n: int = N_PROMPT) -> list[int]:
    """Token ids of the tiny model's vocabulary (no BOS/EOS/unknown)."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    """Two workers; a server with --context-shift and one without, on them; a Coordinator of its own."""
    w = WorkerSet(tmp_path_factory.mktemp("cs") / "tensor-cache", 2)
    endpoints = [w.endpoint(0), w.endpoint(1)]
    args = ("-m", str(tiny_model), "--ctx-per-slot", str(N_CTX))
    shifting = Server(endpoints, parallel=2, args=(*args, "--context-shift"))
    plain = Server(endpoints, parallel=2, args=args)
    coord = Coordinator(endpoints, model=str(tiny_model), n_ctx=4 * N_CTX)
    yield shifting, plain, coord
    coord.close()
    shifting.stop()
    plain.stop()
    w.close()


def greedy(coord: Coordinator, history: list[int], n: int) -> list[int]:
    """n tokens a fresh greedy decode of `history` (one step, then one token a step) gives."""
    coord.kv_seq_rm(0)
    assert coord.decode(Batch.single(history, 0)) == 0
    out = []
    for _ in range(n):
        out.append(int(np.argmax(coord.logits(-1))))
        if len(out) == n:
            break
        assert coord.decode(Batch.single(out[-1:], len(history) + len(out) - 1)) == 0
    return out


async def native(url: str, prompt, **fields) -> dict:
    """llama-server's /completion, greedy, with each token's id (n_probs)."""
    body = dict({"prompt": prompt, "temperature": 0, "ignore_eos": True, "n_probs": 1}, **fields)
    status, answer = await post(url + "/completion", body, timeout=HANG_GUARD)
    assert status == 200, answer
    return answer


def ids_of(answer: dict) -> list[int]:
    return [p["id"] for p in answer["completion_probabilities"]]


def check_after_shifts(coord: Coordinator, prompt: list[int], generated: list[int], n_keep: int) -> int:
    """Every run of tokens after a shift is what a fresh decode of the kept history gives; the shifts."""
    shifts = simulate(prompt, generated, n_keep)
    bounds = [i for i, _ in shifts[1:]] + [len(generated)]
    for (first, history), end in zip(shifts, bounds):
        assert greedy(coord, history, end - first) == generated[first:end], (first, end, len(history))
    return len(shifts)


def shift_log(server: Server) -> list[tuple[int, int]]:
    """(n_keep, n_discard) of each "context shift" line the server logged."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", open(server.log.name).read())  # no colours
    lines = [line for line in text.splitlines() if "context shift" in line]
    return [(int(re.search(r"n_keep=(\d+)", line).group(1)), int(re.search(r"n_discard=(\d+)", line).group(1)))
            for line in lines]


@pytest.mark.system
def test_a_generation_goes_past_its_context_and_follows_the_kept_history(cluster):
    shifting, plain, coord = cluster
    p = prompt_of(1)

    async def scenario():
        whole = await native(shifting.url, p, n_predict=LONG)
        events = await stream(shifting.url + "/completion", {"prompt": p, "temperature": 0, "ignore_eos": True,
                                                              "n_predict": LONG, "stream": True}, timeout=HANG_GUARD)
        stopped = await native(plain.url, p, n_predict=-1)  # no flag: up to the context
        refused = [await post(plain.url + "/completion", {"prompt": p, "n_predict": n}, timeout=HANG_GUARD)
                   for n in (N_CTX - N_PROMPT + 1, LONG)]
        return whole, events, stopped, refused

    whole, events, stopped, refused = asyncio.run(scenario())
    generated = ids_of(whole)
    assert len(generated) == whole["tokens_predicted"] == LONG, whole["tokens_predicted"]
    assert whole["stop_type"] == "limit" and whole["truncated"] is True
    assert check_after_shifts(coord, p, generated, 0) >= 3
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == LONG and events[-1]["truncated"]
    # without --context-shift: the same prompt stops at the context, with the same first tokens
    assert stopped["tokens_predicted"] == N_CTX - N_PROMPT and stopped["stop_type"] == "limit"
    assert stopped["truncated"] is False and ids_of(stopped) == generated[:N_CTX - N_PROMPT]
    (status, body), (status_long, body_long) = refused
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert status_long == 400 and body_long["error"]["message"] == f"'n_predict' must be between -1 and {N_CTX}"


@pytest.mark.system
def test_openai_endpoints_count_every_token(cluster):
    """/v1/completions whole and streamed, and chat, past the context: max_tokens tokens, "length"."""
    shifting, plain, _ = cluster
    p = prompt_of(2)
    body = {"prompt": p, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Tell me a long story about the sea."}], "max_tokens": 100,
            "temperature": 0, "ignore_eos": True}

    async def scenario():
        whole = await post(shifting.url + "/v1/completions", body, timeout=HANG_GUARD)
        events = await stream(shifting.url + "/v1/completions",
                              dict(body, stream_options={"include_usage": True}), timeout=HANG_GUARD)
        chatted = await post(shifting.url + "/v1/chat/completions", chat, timeout=HANG_GUARD)
        chat_events = await stream(shifting.url + "/v1/chat/completions",
                                   dict(chat, stream_options={"include_usage": True}), timeout=HANG_GUARD)
        chat_plain = await post(plain.url + "/v1/chat/completions", dict(chat, max_tokens=N_CTX), timeout=HANG_GUARD)
        return whole, events, chatted, chat_events, chat_plain

    (status, whole), events, (chat_status, chatted), chat_events, (plain_status, chat_plain) = asyncio.run(scenario())
    assert status == 200, whole
    assert whole["usage"]["completion_tokens"] == LONG and whole["choices"][0]["finish_reason"] == "length"
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == LONG
    assert stream_text(events[:-2]) == whole["choices"][0]["text"]
    assert [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"][0]["finish_reason"]] == ["length"]
    assert chat_status == 200, chatted
    assert chatted["usage"]["completion_tokens"] == 100 and chatted["choices"][0]["finish_reason"] == "length"
    assert chatted["usage"]["prompt_tokens"] + 100 > N_CTX  # it did pass the context
    assert chat_events[-2]["usage"]["completion_tokens"] == 100
    assert stream_text(chat_events[:-2], chat=True) == chatted["choices"][0]["message"]["content"]
    # without --context-shift the same chat is refused
    assert plain_status == 400 and chat_plain["error"]["code"] == "context_length_exceeded", chat_plain


@pytest.mark.system
def test_n_keep_is_honoured(cluster):
    shifting, _, coord = cluster
    p = prompt_of(3)

    async def scenario():
        return [await native(shifting.url, p, n_predict=LONG - 40, n_keep=k) for k in (10, -1)]

    logged = len(shift_log(shifting))
    ten, whole_prompt = asyncio.run(scenario())
    assert check_after_shifts(coord, p, ids_of(ten), 10) >= 2
    assert check_after_shifts(coord, p, ids_of(whole_prompt), -1) >= 2
    kept = {k for k, _ in shift_log(shifting)[logged:]}
    assert kept == {11, N_PROMPT + 1}, kept  # plus one each: the tiny model adds a BOS


@pytest.mark.system
def test_two_slots_shift_at_once(cluster):
    """Two requests on the two slots (a group each, pipelined), shifting meanwhile: each the text it has
    alone; and so do two choices of one request (n: 2, the second sharing the first's prompt rows)."""
    shifting, _, _ = cluster
    a, b = prompt_of(4), prompt_of(5, N_PROMPT + 7)

    async def scenario():
        alone = [await native(shifting.url, q, n_predict=LONG) for q in (a, b)]
        together = await asyncio.gather(*(native(shifting.url, q, n_predict=LONG) for q in (a, b)))
        choices = await post(shifting.url + "/v1/completions", {"prompt": a, "max_tokens": LONG, "n": 2,
                                                                 "temperature": 0, "ignore_eos": True},
                             timeout=HANG_GUARD)
        return alone, together, choices

    alone, together, (status, choices) = asyncio.run(scenario())
    assert status == 200, choices
    assert [c["text"] for c in choices["choices"]] == [alone[0]["content"]] * 2
    assert choices["usage"]["completion_tokens"] == 2 * LONG
    assert [ids_of(x) for x in together] == [ids_of(x) for x in alone]
    assert all(x["tokens_predicted"] == LONG for x in together)


@pytest.mark.system
def test_a_prompt_must_fit(cluster):
    """A prompt is never cut: one that leaves no room for a token is refused, with or without the flag."""
    shifting, plain, coord = cluster
    fits, too_long = prompt_of(6, N_CTX - 1), prompt_of(7, N_CTX)

    async def scenario():
        return (await native(shifting.url, fits, n_predict=10),
                await post(shifting.url + "/completion", {"prompt": too_long, "n_predict": 10}),
                await post(shifting.url + "/v1/completions", {"prompt": too_long, "max_tokens": 1}),
                await post(plain.url + "/completion", {"prompt": fits, "n_predict": 10}),
                await post(shifting.url + "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "sea " * 200}], "max_tokens": 1}))

    ok, (s1, e1), (s2, e2), (s3, e3), (s4, e4) = asyncio.run(scenario())
    assert ok["tokens_predicted"] == 10 and ok["truncated"] is True  # shifted after its first token
    assert check_after_shifts(coord, fits, ids_of(ok), 0) >= 1
    for status, body in ((s1, e1), (s2, e2), (s3, e3), (s4, e4)):
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "exceeds the context of 64 tokens per slot" in e1["error"]["message"], e1


@pytest.mark.system
def test_a_shifting_generation_survives_a_lost_worker(tiny_model, workers):
    """Resuming on: the worker holding the last stage is killed (and restarted 1 s later) while a
    generation runs past its context (shifting every ~30 tokens): the same text as without the fault."""
    w = workers(2)
    server = Server([w.endpoint(0), w.endpoint(1)], parallel=2,
                    args=("-m", str(tiny_model), "--ctx-per-slot", str(N_CTX), "--context-shift",
                          "--resume-within", "20"))
    try:
        p = prompt_of(8)
        body = {"prompt": p, "max_tokens": 4 * LONG, "temperature": 0, "ignore_eos": True, "cache_prompt": False}

        async def scenario():
            status, want = await post(server.url + "/v1/completions", body, timeout=HANG_GUARD)
            assert status == 200, want
            killed = asyncio.Event()
            events: list = []

            async def kill_after_a_shift():
                # past the first shift: N_CTX - N_PROMPT tokens, each its own event or more
                while sum(1 for e in events if isinstance(e, dict) and e.get("choices")) < N_CTX:
                    await asyncio.sleep(0.005)
                w.kill(1, restart_after=1.0)
                killed.set()

            async def read_as_it_comes():  # into `events` as they come (the killer watches them)
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD)) as s:
                    async with s.post(server.url + "/v1/completions", json=dict(body, stream=True)) as r:
                        assert r.status == 200
                        async for line in r.content:
                            line = line.strip()
                            if line.startswith(b"data: "):
                                payload = line[6:].decode()
                                events.append(payload if payload == "[DONE]" else json.loads(payload))

            killer = asyncio.create_task(kill_after_a_shift())
            await read_as_it_comes()
            await asyncio.wait_for(killed.wait(), 30 * SLACK)
            await killer
            return want, events

        want, events = asyncio.run(scenario())
        w.join()
        assert not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
        assert events[-1] == "[DONE]"
        assert stream_text(events) == want["choices"][0]["text"]
        assert len(shift_log(server)) >= 2 * 4  # both generations shifted several times
        _, metrics = asyncio.run(get(server.url + "/metrics"))
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line and not line.startswith("#")}
        assert values["ggml_resumes_total"] >= 1 and values["ggml_replayed_tokens_total"] > 0, values
    finally:
        server.stop()
