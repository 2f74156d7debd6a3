"""The OpenAI-compatible server for real: a `ggml-coordinator serve` process,
real worker daemons on 127.0.0.1, real HTTP, a worker killed with SIGKILL."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import SLACK, DaemonProcess, free_port, stop_process  # noqa: F401
from http_helpers import Server, get, head_of, post, stream, stream_text, wait_healthy  # noqa: F401

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cluster():
    workers = [DaemonProcess("-t", "1"), DaemonProcess("-t", "1")]
    # resuming off: the worker-fault tests here check what a request sees without it (tests/coordinator/test_resume.py: with);
    # the layer split, whose output head placement they check (auto may take either for gemma, by measurement)
    server = Server([w.endpoint for w in workers], args=("--resume-within", "0", "--split-mode", "layer"))
    yield server, workers
    server.stop()
    for w in workers:
        w.stop()
        w.kill()


def test_completion_and_chat(cluster):
    server, _ = cluster
    # cache_prompt false: each request decodes its prompt whole, so the pairs below compare the same batch
    # shapes (a mostly cached prompt decodes only its last token: logits may move enough to flip gemma's near
    # ties, docs/operations.md on the prompt cache)
    status, body = asyncio.run(post(server.url + "/v1/completions",
                                    {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "cache_prompt": False}))
    assert status == 200, body
    text = body["choices"][0]["text"]
    # the greedy text depends on the kernels this machine's ggml build runs: a French continuation either way
    assert any(word in text for word in ("France", "French", "Paris")), text
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["choices"][0]["finish_reason"] == "length"
    # streamed: the same greedy text, ending with a finish chunk and [DONE]
    events = asyncio.run(stream(server.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 12,
                                                                 "temperature": 0, "cache_prompt": False}))
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert stream_text(events) == text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    status, body = asyncio.run(post(server.url + "/v1/chat/completions",
                                    {"messages": messages, "max_tokens": 10, "temperature": 0,
                                     "cache_prompt": False}))
    assert status == 200, body
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    chat_text = body["choices"][0]["message"]["content"]
    assert chat_text
    events = asyncio.run(stream(server.url + "/v1/chat/completions",
                                {"messages": messages, "max_tokens": 10, "temperature": 0, "cache_prompt": False}))
    assert stream_text(events, chat=True) == chat_text


def test_models_health_metrics(cluster):
    server, workers = cluster
    status, body = asyncio.run(post(server.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}))
    assert status == 200, body
    status, body = asyncio.run(get(server.url + "/v1/models"))
    assert status == 200 and body["data"][0]["id"]
    status, body = asyncio.run(get(server.url + "/health"))
    assert status == 200 and body["status"] == "ok"
    assert {e["endpoint"] for e in body["endpoints"]} == {w.endpoint for w in workers}
    assert body["split_mode"] == "layer" and body["split_choice"] == {"asked": "layer", "chosen": "layer"}, body
    # where the output head ran (docs/architecture.md, "Where the output head runs"), and from what
    head = body["head"]
    # auto is a measurement: on loopback it splits, unless a slow round trip at load made the last
    # worker hold the whole head (whole_held), and with it this process the other rows (here_held)
    assert head["mode"] == "auto" and head["choice"] in ("split", "whole", "here"), head
    assert head["choice"] == "split" or (head["whole_held"] and (head["choice"] == "whole" or head["here_held"])), head
    assert head[f"steps_{head['choice']}"] >= 1, head
    assert head["steps_split"] >= 1 and set(head["rtt_seconds"]) == {w.endpoint for w in workers}, head
    status, text = asyncio.run(get(server.url + "/metrics"))
    assert status == 200
    for name in ("ggml_tokens_generated_total", "ggml_prompt_tokens_total", "ggml_decode_seconds_bucket",
                 "ggml_endpoint_up", "ggml_endpoint_rtt_seconds", "ggml_slots_busy", "ggml_reconnects_total",
                 "ggml_decode_failures_total", "ggml_tokens_per_second", 'ggml_head_steps_total{placement="split"}',
                 "ggml_head_split", "ggml_head_one_way_seconds"):
        assert name in text, name


@pytest.mark.parametrize("body, fragment", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "JSON object"),
    ({"prompt": 5}, "'prompt'"),
    ({"prompt": "x", "max_tokens": "ten"}, "'max_tokens'"),
    ({"prompt": "x", "temperature": -1}, "'temperature'"),
    ({"prompt": "x", "stop": [1]}, "'stop'"),
    ({"prompt": "word " * 400, "max_tokens": 8}, "exceeds the context"),
    ({"messages": "hi"}, "'messages'"),
    ({"prompt": "x", "best_of": 3}, "'best_of' is not supported"),
    ({"prompt": "x", "mirostat": 2}, "'mirostat' is not supported"),
    ({"prompt": "x", "temprature": 0.5}, "unrecognized request argument supplied: 'temprature'"),
    ({"prompt": "x", "presence_penalty": 5}, "'presence_penalty' must be between -2.0 and 2.0"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "'tools[0]': a function tool needs 'function'"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "'response_format'"),
    ({"prompt": "x", "seed": -1, "temperature": 0.7}, "'seed'"),
    ('{"prompt": "x", "temperature": NaN}', "temperature"),
    ('{"prompt": "x", "temperature": 1, "top_p": NaN}', "top_p"),
    ({"prompt": "x" * (64 * 256 + 1)}, "cannot fit the context"),  # refused before tokenizing
])
def test_bad_requests_get_clear_400s(cluster, body, fragment):
    server, _ = cluster
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    status, reply = asyncio.run(post(server.url + path, body))
    assert status == 400, reply
    assert fragment in reply["error"]["message"], reply


def test_seven_concurrent_clients_get_complete_answers_and_their_texts_alone(cluster):
    """Seven at once: every prompt is decoded in steps of its own, and the seven sampled tokens
    share a step, so each row takes the kernels it takes alone (a step of 8 or more rows would
    take the tiled K-quant kernel: docs/architecture.md, "Kernels and what a result depends on")."""
    server, _ = cluster
    prompts = [f"{PROMPT}", "Once upon a time", "The best way to learn is", "My favourite food is",
               "Water boils at", "The sun is", "A cat and a dog"]
    alone = {}
    for p in prompts[:3]:
        status, body = asyncio.run(post(server.url + "/v1/completions", {"prompt": p, "max_tokens": 16,
                                                                          "temperature": 0}))
        alone[p] = body["choices"][0]["text"]

    async def all_at_once():
        return await asyncio.gather(*(post(server.url + "/v1/completions",
                                           {"prompt": p, "max_tokens": 16, "temperature": 0}) for p in prompts))

    results = asyncio.run(all_at_once())
    for p, (status, body) in zip(prompts, results):
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 16 or body["choices"][0]["finish_reason"] == "stop"
        if p in alone:  # batched with six others, greedy text is what it was alone
            assert body["choices"][0]["text"] == alone[p]


def test_client_disconnect_mid_stream_frees_its_slot(cluster):
    server, _ = cluster
    events = asyncio.run(stream(server.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 200,
                                                                 "temperature": 0}, stop_after=2))
    assert len(events) == 2
    deadline = time.monotonic() + 10 * SLACK
    while time.monotonic() < deadline:
        status, body = asyncio.run(get(server.url + "/health"))
        if body["slots_busy"] == 0:
            break
        time.sleep(0.1)
    assert body["slots_busy"] == 0, body


def test_worker_killed_then_restarted(cluster):
    server, workers = cluster
    victim = workers[1]

    async def scenario():
        # a long stream in flight when the worker dies
        in_flight = asyncio.create_task(stream(server.url + "/v1/completions",
                                               {"prompt": PROMPT, "max_tokens": 200, "temperature": 0}))
        await asyncio.sleep(0.5)
        killed_at = time.monotonic()
        victim.kill()
        events = await in_flight
        status_after = None
        while time.monotonic() - killed_at < 5 * SLACK:
            status_after, health = await get(server.url + "/health")
            if status_after == 503:
                break
            await asyncio.sleep(0.05)
        return events, time.monotonic() - killed_at, status_after, health

    events, detected_after, status, health = asyncio.run(scenario())
    assert status == 503, health
    assert detected_after < 2.0 * SLACK, detected_after
    failed = [e for e in health["endpoints"] if e["failed"]]
    assert [e["endpoint"] for e in failed] == [victim.endpoint] and failed[0]["cause"]
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["error"]["code"] == "ENDPOINT_FAILED", events[-3:]
    assert events[-1] == "[DONE]"
    status, body = asyncio.run(post(server.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}))
    assert status == 503 and victim.endpoint in body["error"]["message"], body
    # a 503 tells when to come back: the next reconnect attempt (at least 1 s)
    for method, path in (("POST", "/v1/completions"), ("GET", "/health")):
        status, headers = asyncio.run(head_of(method, server.url + path, {"prompt": PROMPT, "max_tokens": 4}))
        assert status == 503 and 1 <= int(headers["Retry-After"]) <= 10, (path, headers)

    # the worker comes back on the same port: health and requests recover without a server restart
    workers[1] = DaemonProcess("-t", "1", port=victim.port)
    wait_healthy(server)
    status, body = asyncio.run(post(server.url + "/v1/completions",
                                    {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}))
    assert status == 200, body
    assert any(word in body["choices"][0]["text"] for word in ("France", "French", "Paris")), body
    status, text = asyncio.run(get(server.url + "/metrics"))
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["ggml_reconnects_total"] >= 1
    assert values['ggml_decode_failures_total{code="ENDPOINT_FAILED"}'] >= 1
    assert values[f'ggml_endpoint_up{{endpoint="{victim.endpoint}"}}'] == 1


def test_worker_killed_while_idle_shows_in_health_without_a_request(cluster):
    """No request in flight: /health still turns 503 within moments of a
    worker's death (the connection's failure latches it at once), and comes
    back once the worker is back."""
    server, workers = cluster
    victim = workers[0]
    status, _ = asyncio.run(get(server.url + "/health"))
    assert status == 200
    killed_at = time.monotonic()
    victim.kill()
    health = None
    while time.monotonic() - killed_at < 5 * SLACK:
        status, health = asyncio.run(get(server.url + "/health"))
        if status == 503:
            break
        time.sleep(0.05)
    assert status == 503 and time.monotonic() - killed_at < 2.0 * SLACK, health
    assert [e["endpoint"] for e in health["endpoints"] if e["failed"]] == [victim.endpoint], health
    workers[0] = DaemonProcess("-t", "1", port=victim.port)
    wait_healthy(server)


def test_errors_are_json_everywhere(cluster):
    server, _ = cluster
    # one model served: any requested name gets it (llama-server's way) and the answer names the served id;
    # an unknown id is 404 model_not_found where a model is looked up by id
    status, body = asyncio.run(get(server.url + "/v1/models"))
    served = body["data"][0]["id"]
    assert served == "gemma-3-270m", served  # general.name "Gemma 3 270m": lowercased, no spaces
    status, body = asyncio.run(post(server.url + "/v1/completions", {"prompt": "x", "model": "gpt-4",
                                                                      "max_tokens": 1}))
    assert status == 200 and body["model"] == served, body
    status, body = asyncio.run(get(server.url + "/v1/models/gpt-4"))
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    status, body = asyncio.run(get(server.url + "/v1/nothing"))
    assert status == 404 and "error" in body, body
    status, body = asyncio.run(post(server.url + "/v1/completions", "x" * (5 << 20)))
    assert status == 413 and "error" in body, body


def test_cors_and_request_ids_by_default(cluster):
    """Without flags: every answer (errors too) allows any origin and echoes
    or makes an X-Request-Id; a browser's preflight gets 204 (it was a 405)."""
    server, _ = cluster
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/nothing"), ("POST", "/v1/completions")):
        status, headers = asyncio.run(head_of(method, server.url + path, {"prompt": 5},
                                              {"X-Request-Id": "req-1"}))
        assert headers["Access-Control-Allow-Origin"] == "*", (path, status)
        assert headers["X-Request-Id"] == "req-1", (path, status)
    status, headers = asyncio.run(head_of("OPTIONS", server.url + "/v1/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}))
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "*", headers
    assert "POST" in headers["Access-Control-Allow-Methods"] and "Authorization" in headers[
        "Access-Control-Allow-Headers"], headers


def test_chat_templates_get_what_hf_templates_call_in_a_sandbox():
    """GGUF chat templates (HF style) call raise_exception and strftime_now,
    and come from the model file: rendered sandboxed; a template's own refusal
    is a TemplateError (the server answers 400 with its message)."""
    import jinja2
    from jinja2.sandbox import SecurityError

    from coordinator.serving.chat_templates import sandbox
    env = sandbox()
    alternate = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                 "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                 "{{ m['content'] }}{% endfor %}{{ strftime_now('%Y') }}")
    t = env.from_string(alternate)
    assert t.render(messages=[{"role": "user", "content": "a"}]) == "a" + time.strftime("%Y")
    with pytest.raises(jinja2.TemplateError, match="must alternate"):
        t.render(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(SecurityError):
        env.from_string("{{ ''.__class__.__mro__[1].__subclasses__() }}").render()


def test_sigterm_ends_requests_in_flight_with_an_answer(cluster):
    """SIGTERM while a stream runs and another request waits for a slot: the
    stream ends with an ABORTED error event and [DONE], the waiting request
    gets 503 "shutting down", and the server exits 0 (it used to cut both)."""
    _, workers = cluster
    server = Server([w.endpoint for w in workers], parallel=1)
    try:
        async def scenario():
            streaming = asyncio.create_task(stream(server.url + "/v1/completions",
                                                   {"prompt": PROMPT, "max_tokens": 200, "temperature": 0}))
            await asyncio.sleep(0.5)
            waiting = asyncio.create_task(post(server.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 8}))
            await asyncio.sleep(0.3)
            server.proc.send_signal(signal.SIGTERM)
            return await streaming, await waiting

        events, (status, body) = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert server.proc.wait(timeout=20 * SLACK) == 0
    finally:
        server.stop()
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["error"]["code"] == "ABORTED", events[-3:]
    assert "shutting down" in errors[0]["error"]["message"] and events[-1] == "[DONE]", events[-3:]
    assert status == 503 and "shutting down" in body["error"]["message"], (status, body)


def test_serve_restarts_a_local_worker_that_dies(tmp_path):
    """`serve` without --endpoints owns its workers: one killed is restarted on
    its port and the server recovers by itself (it used to stay 503 forever,
    retrying a port nobody listened on, with the dead worker a zombie). Under
    --log-format json every line it prints, the restart's included, is JSON."""
    from tiny_models import write_tiny_llama
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "serve", "-m", str(model), "--port", str(port),
                             "--parallel", "1", "--ctx-per-slot", "64", "--log-format", "json"], stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        server = type("S", (), {"url": url})()
        wait_healthy(server, 60)
        children = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
        victim = children[0]
        os.killpg(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10 * SLACK
        status, body = 200, {"status": "ok"}
        while body["status"] == "ok" and time.monotonic() < deadline:
            status, body = asyncio.run(get(url + "/health"))
            time.sleep(0.05)
        # resuming (serve's default): a request would pause, not fail, so still 200
        assert status == 200 and body["status"] == "degraded", ("the dead worker did not show", body)
        while body["status"] != "ok" and time.monotonic() < deadline + 60 * SLACK:
            status, body = asyncio.run(get(url + "/health"))
            time.sleep(0.05)
        assert status == 200 and body["status"] == "ok", body
        status, body = asyncio.run(post(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 4}))
        assert status == 200, body
        assert not os.path.exists(f"/proc/{victim}") or open(f"/proc/{victim}/stat").read().split()[2] != "Z"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=30 * SLACK) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    lines = open(log.name).read().splitlines()
    events = [json.loads(line) for line in lines]  # every line, stdout and stderr: JSON
    restarts = [e for e in events if e["event"] == "local worker exited; restarting it"]
    assert len(restarts) == 1 and restarts[0]["exit_status"] == -signal.SIGKILL, restarts
    assert any(e["event"].startswith(f"serving {url} ") and e["url"] == url for e in events), lines[:5]
