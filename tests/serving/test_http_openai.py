"""The serving issue's OpenAI and operations details, against one real
`ggml-coordinator serve` (its own two local workers, the bundled Gemma 3 270M)
started with --port 0 and the flags in the `server` fixture."""
from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
from importlib.metadata import version

import aiohttp
import pytest

from conftest import SLACK
from http_helpers import Serve, served  # noqa: F401 (Serve: other modules' import of it)

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"
PROMPT = "The capital of France is"


def coordinator(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True, text=True,
                          timeout=60, **kw)


async def call(method: str, url: str, body=None, headers: dict | None = None, timeout: float = 60):
    """(status, headers, parsed JSON body or text)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        data = None if body is None else (body if isinstance(body, (str, bytes)) else json.dumps(body))
        async with s.request(method, url, data=data, headers=headers) as r:
            text = await r.text()
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError:
                parsed = text
            return r.status, r.headers, parsed


def request(method: str, url: str, body=None, headers: dict | None = AUTH, **kw):
    return asyncio.run(call(method, url, body, headers, **kw))


async def sse(url: str, body: dict, headers: dict = AUTH, first_event: asyncio.Event | None = None) -> list:
    events = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(url, json=dict(body, stream=True), headers=headers) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                line = line.strip()
                if line.startswith(b"data: "):
                    payload = line[6:].decode()
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
                    if first_event is not None:
                        first_event.set()
    return events


def metric_values(text: str) -> dict:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def local_tokenizer():
    from coordinator.model.default_model import default_model_path
    from coordinator.text.tokenizer import Tokenizer
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from served(tmp_path_factory, "--alias", "my-gemma", "--cors-origin", ORIGIN, "--parallel", "1",
                      "--max-queue", "1", "--ctx-per-slot", "256", env={"GGML_COORDINATOR_API_KEY": KEY})


def test_version_and_a_taken_port_fails_before_the_model_is_read():
    expected = f"ggml-coordinator {version('ggml-distributed')}"
    for args in (("--version",), ("serve", "--version")):
        r = coordinator(*args)
        assert r.returncode == 0 and r.stdout.strip() == expected, r
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # no worker to reach and no model file: only the port can be what it reports
        started = time.monotonic()
        r = coordinator("serve", "--port", str(port), "--endpoints", "127.0.0.1:1", "-m", "/nonexistent.gguf")
    assert r.returncode != 0 and time.monotonic() - started < 20 * SLACK
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr


def test_model_id_is_derived_without_spaces_or_the_alias():
    from coordinator.serving.lifecycle import model_id

    def fake(name, path="/models/Some Model.Q4.gguf"):
        return type("C", (), {"gguf": {"general.name": name} if name else {}, "model_path": path})()

    assert model_id(fake("Gemma 3 270m"), None) == "gemma-3-270m"
    assert model_id(fake(None), None) == "some-model.q4"
    assert model_id(fake("Gemma 3 270m"), "mine") == "mine"


def test_ready_line_model_id_and_any_model_name(server):
    assert server.url.startswith("http://127.0.0.1:") and server.model == "my-gemma"
    assert server.text().count("serving http://") == 1
    status, _, body = request("GET", server.url + "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["my-gemma"], body
    status, _, body = request("GET", server.url + "/v1/models/my-gemma")
    assert status == 200 and body["id"] == "my-gemma" and body["object"] == "model", body
    status, _, body = request("GET", server.url + "/v1/models/gpt-4o")
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    # one model served: whatever name a client asks for gets it, and the answer says which
    status, _, body = request("POST", server.url + "/v1/completions",
                              {"model": "gpt-4o", "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["model"] == "my-gemma", body


def test_api_key_guards_everything_but_health_and_metrics(server):
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
            status, h, body = request(method, server.url + path, {"prompt": "x"}, headers=headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", (headers, path, body)
            assert h["WWW-Authenticate"] == "Bearer"
    for path in ("/health", "/metrics"):
        status, _, _ = request("GET", server.url + path, headers=None)
        assert status == 200, path
    assert request("GET", server.url + "/v1/models", headers={"Authorization": f"bearer {KEY}"})[0] == 200


def test_cors_origin_flag_and_preflight(server):
    status, h, _ = request("GET", server.url + "/v1/models")
    assert status == 200 and h["Access-Control-Allow-Origin"] == ORIGIN
    # a browser's preflight carries no credentials: answered 204 before the key is checked
    status, h, _ = request("OPTIONS", server.url + "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert status == 204, h
    assert h["Access-Control-Allow-Origin"] == ORIGIN and "POST" in h["Access-Control-Allow-Methods"]
    assert "authorization" in h["Access-Control-Allow-Headers"].lower()
    status, h, _ = request("GET", server.url + "/v1/models", headers=None)  # errors carry it too
    assert status == 401 and h["Access-Control-Allow-Origin"] == ORIGIN


def test_stream_usage_content_parts_and_prompt_forms(server):
    url = server.url
    plain = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    status, _, reference = request("POST", url + "/v1/completions", plain)
    assert status == 200, reference
    text = reference["choices"][0]["text"]

    events = asyncio.run(sse(url + "/v1/completions", dict(plain, stream_options={"include_usage": True})))
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["choices"] == [] and last["usage"] == reference["usage"], events[-3:]
    assert all(e["usage"] is None for e in events[:-2]) and events[-3]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == text
    events = asyncio.run(sse(url + "/v1/completions", plain))  # without it: no usage chunk, as before
    assert all("usage" not in e for e in events[:-1]) and events[-2]["choices"]

    # the same prompt as token ids, as a list of one string, as a list of one token list
    ids = local_tokenizer().encode(PROMPT, add_special=True)
    for prompt in (ids, [PROMPT], [ids]):
        status, _, body = request("POST", url + "/v1/completions", dict(plain, prompt=prompt))
        assert status == 200 and body["choices"][0]["text"] == text, (prompt, body)
        assert body["usage"]["prompt_tokens"] == len(ids)
    status, _, body = request("POST", url + "/v1/completions", dict(plain, prompt=["a", "b"]))
    assert status == 400 and "2 prompts" in body["error"]["message"] and body["error"]["param"] == "prompt"
    status, _, body = request("POST", url + "/v1/completions", dict(plain, prompt=[1, 10 ** 9]))
    assert status == 400 and "outside the vocabulary" in body["error"]["message"], body

    # chat content as a list of parts: the text parts, joined
    question = "What is the capital of France?"
    chat = {"max_tokens": 6, "temperature": 0}
    _, _, as_text = request("POST", url + "/v1/chat/completions",
                            dict(chat, messages=[{"role": "user", "content": question}]))
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    status, _, as_parts = request("POST", url + "/v1/chat/completions",
                                  dict(chat, messages=[{"role": "user", "content": parts}]))
    assert status == 200 and as_parts["choices"] == as_text["choices"], as_parts
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    status, _, body = request("POST", url + "/v1/chat/completions",
                              dict(chat, messages=[{"role": "user", "content": [parts[0], image]}]))
    assert status == 400 and "'image_url'" in body["error"]["message"], body

    # too long: OpenAI's code, and the numbers
    for path, body in (("/v1/completions", {"prompt": "word " * 400, "max_tokens": 8}),
                       ("/v1/completions", {"prompt": ids * 60, "max_tokens": 8}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]})):
        status, _, reply = request("POST", url + path, body)
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        assert "256 tokens per slot" in reply["error"]["message"], reply


def test_tokenize_detokenize_props(server):
    url = server.url
    status, _, body = request("POST", url + "/tokenize", {"content": "Hello world"})
    assert status == 200 and body["tokens"] == local_tokenizer().encode("Hello world", add_special=False), body
    with_bos = request("POST", url + "/tokenize", {"content": "Hello world", "add_special": True})[2]["tokens"]
    assert len(with_bos) == len(body["tokens"]) + 1 and with_bos[1:] == body["tokens"]
    status, _, back = request("POST", url + "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"content": "Hello world"}, back
    status, _, back = request("POST", url + "/detokenize", {"tokens": ["x"]})
    assert status == 400 and back["error"]["param"] == "tokens", back
    status, _, props = request("GET", url + "/props")
    assert status == 200 and props["model_alias"] == "my-gemma" and props["total_slots"] == 1, props
    assert props["default_generation_settings"]["n_ctx"] == 256 and "{%" in props["chat_template"], props
    # serve's default split (auto: either, by measurement), and the figures it was chosen by
    split = props["split"]
    assert split["split_mode"] in ("layer", "tensor") and len(split["workers"]) >= 1, props
    choice = split["split_choice"]
    assert choice["asked"] == "auto" and choice["chosen"] == split["split_mode"], choice
    assert choice["exchanges_ms_per_token"] > 0 and choice["layer_ms"] > 0, choice
    # each worker a range of layers, or (tensor) a shard of every layer
    tensor = split["split_mode"] == "tensor"
    assert all((w["shard"] is not None) == tensor and "layers" in w for w in split["workers"]), props
    # the tensor split's sums: exact, the default (gemma3-270m and these workers allow them), with each
    # worker's output rows
    assert choice.get("sums") == ("exact" if tensor else None), choice
    assert all((w["shard"] or {}).get("out_rows") or not tensor for w in split["workers"]), props


def test_queue_limit_answers_429_and_shows_the_queue(server):
    """--parallel 1 --max-queue 1: one request in the slot, one waiting, the
    third refused at once with Retry-After; the waiting one still gets its answer."""
    url = server.url

    async def scenario():
        in_slot = asyncio.Event()
        first = asyncio.create_task(sse(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 60,
                                                                  "temperature": 0}, first_event=in_slot))
        await asyncio.wait_for(in_slot.wait(), 60)
        second = asyncio.create_task(call("POST", url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2},
                                          AUTH))
        await asyncio.sleep(0.3)
        _, _, metrics = await call("GET", url + "/metrics")
        third = await call("POST", url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, AUTH)
        return await first, await second, third, metrics

    first, second, third, metrics = asyncio.run(scenario())
    assert metric_values(metrics)["ggml_requests_waiting"] == 1
    status, headers, body = third
    assert status == 429 and int(headers["Retry-After"]) >= 1, (status, body)
    assert body["error"]["code"] == "rate_limit_exceeded" and "--max-queue 1" in body["error"]["message"], body
    assert first[-1] == "[DONE]" and second[0] == 200, second
    _, _, metrics = request("GET", url + "/metrics")
    assert metric_values(metrics)["ggml_requests_waiting"] == 0


def test_request_ids_access_log_and_latency_histograms(server):
    url = server.url
    status, h, _ = request("POST", url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3},
                           headers=dict(AUTH, **{"X-Request-Id": "trace-42"}))
    assert status == 200 and h["X-Request-Id"] == "trace-42"
    status, h, _ = request("GET", url + "/health")
    generated = h["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{16}", generated)
    # a header that is no sane token is not taken into the logs
    assert request("GET", url + "/health", headers={"X-Request-Id": "a b"})[1]["X-Request-Id"] != "a b"
    deadline = time.monotonic() + 5 * SLACK
    while True:
        lines = [json.loads(line) for line in server.text().splitlines() if line.startswith("{")]
        access = {line.get("request_id"): line for line in lines if line.get("event") == "request"}
        if "trace-42" in access and generated in access or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    line = access["trace-42"]
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/completions", 200), line
    assert line["duration_ms"] > 0
    assert (access[generated]["path"], access[generated]["status"]) == ("/health", 200)
    _, _, text = request("GET", url + "/metrics")
    values = metric_values(text)
    assert values['ggml_http_request_seconds_count{path="/v1/completions"}'] >= 1
    assert values['ggml_http_requests_total{path="/v1/completions",status="200"}'] >= 1
    assert values["ggml_time_to_first_token_seconds_count"] >= 1
    assert values["ggml_time_per_output_token_seconds_count"] >= 1


# ---------------------------------------------------------------- chat templates

def test_a_model_without_a_chat_template_says_so(server):
    """The bundled base model has no tokenizer.chat_template: the server warns
    at start, naming the fallback and the flag, and /props says which template
    chat uses and where it came from."""
    status, _, props = request("GET", server.url + "/props")
    assert status == 200 and props["chat_template_source"] == "fallback", props
    assert props["chat_template_name"] == "gemma3-fallback" and "{%" in props["chat_template"], props
    warnings = [json.loads(line) for line in server.text().splitlines()
                if line.startswith("{") and "no chat template" in line]
    assert len(warnings) == 1 and warnings[0]["level"] == "warning", warnings
    assert "gemma3-fallback" in warnings[0]["event"] and "--chat-template" in warnings[0]["event"], warnings


def test_llama_server_flag_names_np_and_no_metrics(tmp_path):
    """llama-server's spellings: -np is --parallel, and --no-metrics takes
    /metrics away (it is on by default here; `--metrics` keeps it)."""
    from tiny_models import write_tiny_llama
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    s = Serve(str(tmp_path), "-m", str(model), "-np", "3", "--ctx-per-slot", "64", "--no-metrics")
    try:
        status, _, props = request("GET", s.url + "/props", headers=None)
        assert status == 200 and props["total_slots"] == 3, props
        status, _, _ = request("GET", s.url + "/metrics", headers=None)
        assert status == 404
        status, _, health = request("GET", s.url + "/health", headers=None)
        assert status == 200, health
    finally:
        s.stop()


def chat_prompt_tokens(url: str) -> int:
    status, _, body = request("POST", url + "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        "max_tokens": 1, "temperature": 0}, headers=None)
    assert status == 200, body
    return body["usage"]["prompt_tokens"]


def tokens_of(url: str, text: str) -> int:
    """How many tokens chat's rendering `text` is (chat tokenizes it as /tokenize does by default)."""
    status, _, body = request("POST", url + "/tokenize", {"content": text}, headers=None)
    assert status == 200, body
    return len(body["tokens"])


@pytest.mark.parametrize("kind", ["builtin", "file"])
def test_chat_template_flag_takes_a_builtin_or_a_file(tmp_path, kind):
    """--chat-template chatml (a built-in) or a Jinja file: chat renders with it
    (the prompt is the template's text, token for token), /props names it, and
    no fallback warning is logged."""
    from tiny_models import write_tiny_llama
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    if kind == "builtin":
        choice, source = "chatml", "builtin"
        expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
                    "<|im_start|>assistant\n")
    else:
        choice, source = str(tmp_path / "mine.jinja"), "file"
        with open(choice, "w") as f:
            f.write("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"
                    "{% if add_generation_prompt %}<<assistant>>{% endif %}")
        expected = "<<system>>Be brief.<<user>>Hello<<assistant>>"
    s = Serve(str(tmp_path), "-m", str(model), "--parallel", "1", "--ctx-per-slot", "128", "--chat-template", choice)
    try:
        status, _, props = request("GET", s.url + "/props", headers=None)
        assert (props["chat_template_name"], props["chat_template_source"]) == (choice, source), props
        assert chat_prompt_tokens(s.url) == tokens_of(s.url, expected)
        assert "no chat template" not in s.text()
    finally:
        s.stop()


def test_bad_chat_template_fails_before_the_model_is_read(tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"\xff\xfe{{ x }}")
    for choice, fragment in (("chatml2", "neither a built-in template (chatml, gemma, llama3, mistral, phi3)"),
                             (str(tmp_path / "missing.jinja"), "nor a template file"),
                             (str(broken), "not a valid Jinja template: line 1"),
                             (str(binary), "not UTF-8")):
        # no worker to reach and no model file: only the template can be what it reports
        r = coordinator("serve", "--port", "0", "--endpoints", "127.0.0.1:1", "-m", "/nonexistent.gguf",
                        "--chat-template", choice)
        assert r.returncode == 2 and fragment in r.stderr, (choice, r.stderr)


def test_greedy_text_is_the_same_from_the_workers_best_tokens_as_from_the_logits(server):
    """Temperature 0 without logprobs: the steps ask the workers for each row's best tokens instead
    of 1 MiB of logits (with ignore_eos or a banning logit_bias, enough to skip what it bans); with
    n_probs they return the logits (/metrics counts which). Both give the same text, and banning
    the tokens that text begins with gives the best the ban leaves, on both paths."""
    url = server.url

    def steps_by_outputs() -> dict:
        status, _, text = request("GET", url + "/metrics")
        assert status == 200
        pattern = r'^ggml_decode_outputs_total\{outputs="(\w+)"\} (\S+)$'
        return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}

    def completion(**fields) -> dict:
        body = dict({"prompt": PROMPT, "n_predict": 12, "temperature": 0, "ignore_eos": True}, **fields)
        status, _, answer = request("POST", url + "/completion", body)
        assert status == 200, answer
        return answer

    before = steps_by_outputs()
    scored = completion(n_probs=1)  # the logits' path, with each token's id
    ids = [p["id"] for p in scored["completion_probabilities"]]
    after_scored = steps_by_outputs()
    assert completion()["content"] == scored["content"]
    after_plain = steps_by_outputs()
    grew = lambda a, b, kind: a.get(kind, 0) - b.get(kind, 0)
    assert grew(after_scored, before, "logits") >= 12 and grew(after_scored, before, "best_tokens") == 0
    assert grew(after_plain, after_scored, "best_tokens") >= 11 and grew(after_plain, after_scored, "logits") == 0
    ban = {"logit_bias": [[ids[0], False], [ids[1], False]]}
    banned_scored = completion(n_probs=1, **ban)
    banned_ids = [p["id"] for p in banned_scored["completion_probabilities"]]
    assert completion(**ban)["content"] == banned_scored["content"] != scored["content"]
    assert not {ids[0], ids[1]} & set(banned_ids)
