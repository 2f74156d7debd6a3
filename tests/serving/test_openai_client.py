"""The request surface llama-server users expect, through the official `openai`
Python client against a real `ggml-coordinator serve --local-workers 2` (the
bundled Gemma 3 270M): logprobs, echo, n, logit_bias, penalties, the fields it
refuses; and serve's llama-server flags (HTTPS, --api-key-file, -n, --slots) on
a tiny model."""
from __future__ import annotations

import collections
import math

import pytest

from http_helpers import Serve, openai_client, served
from test_http_openai import metric_values, request

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

PROMPT = "The capital of France is"
REPETITIVE = "the the the the the the the the"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from served(tmp_path_factory, "--parallel", "4", "--ctx-per-slot", "256")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def greedy(client, prompt=PROMPT, **kw):
    kw = {"max_tokens": 6, "temperature": 0, **kw}
    return client.completions.create(model="any", prompt=prompt, **kw)


def test_chat_logprobs_are_consistent_under_greedy(client):
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Name a colour."}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content and len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        best = entry.top_logprobs[0]
        # greedy takes the most likely token: the top alternative is the token itself, with its logprob
        assert (best.token, best.bytes) == (entry.token, entry.bytes) and math.isclose(best.logprob, entry.logprob)
        assert entry.logprob <= 0 and all(a.logprob >= b.logprob for a, b in zip(entry.top_logprobs,
                                                                                  entry.top_logprobs[1:]))
        if not entry.token.startswith("bytes:"):
            assert bytes(entry.bytes).decode() == entry.token
    # logprobs: false (some clients always send it) is no logprobs
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=0, logprobs=False)
    assert r.choices[0].logprobs is None


def test_completion_logprobs_streamed_and_whole(client):
    whole = greedy(client, logprobs=2)
    choice = whole.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == whole.usage.completion_tokens
    for token, logprob, top, offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert choice.text[offset:].startswith(token)
        assert len(top) == 2 and math.isclose(max(top.values()), logprob) and top[token] == logprob
    chunks = list(greedy(client, logprobs=2, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_echo_puts_the_prompt_first_with_its_logprobs(client, server):
    r = greedy(client, echo=True, logprobs=1, max_tokens=4)
    plain = greedy(client, max_tokens=4)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert text == PROMPT + plain.choices[0].text
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(v < 0 for v in lp.token_logprobs[1:])
    for token, offset in zip(lp.tokens[n_prompt:], lp.text_offset[n_prompt:]):
        assert text[offset:].startswith(token)
    assert lp.text_offset[n_prompt] == len(PROMPT)
    # streamed: the prompt in a first chunk
    chunks = list(greedy(client, echo=True, max_tokens=4, stream=True))
    assert chunks[0].choices[0].text == PROMPT and "".join(c.choices[0].text for c in chunks) == text


def test_n_choices_share_the_prompt_and_draw_with_seed_plus_i(client, server):
    def prompt_tokens_total() -> float:
        _, _, text = request("GET", server.url + "/metrics", headers=None)
        return metric_values(text)["ggml_prompt_tokens_total"]

    before = prompt_tokens_total()
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0.9, seed=3, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 24  # the three choices' tokens
    # the prompt was decoded once for the three choices (they shared its KV rows), but for the tokens
    # whose rows a slot held from an earlier request of the same prompt (the prompt cache)
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert 0 <= cached < r.usage.prompt_tokens
    assert prompt_tokens_total() - before == r.usage.prompt_tokens - cached
    # choice i draws with seed + i: what the same request with n=1 and that seed draws
    for i in (0, 1):
        alone = client.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0.9, seed=3 + i)
        assert r.choices[i].text == alone.choices[0].text, i
    assert len({c.text for c in r.choices}) > 1
    # both chats decode their prompt whole (cache_prompt false): a prompt mostly cached has its last token
    # decoded in a step of its own, whose kernels may round differently (docs/operations.md, prompt cache)
    # and flip a near tie, as "Hi" has at its second token on gemma3-270m
    chat = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, n=2, extra_body={"cache_prompt": False})
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same text
    events = list(client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, n=2, stream=True,
                                                 extra_body={"cache_prompt": False}))
    by_index = collections.defaultdict(str)
    for ev in events:
        for c in ev.choices:
            by_index[c.index] += c.delta.content or ""
    assert dict(by_index) == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}


def test_logit_bias_minus_100_on_the_greedy_token_changes_it(client, server):
    first = greedy(client, max_tokens=1, logprobs=0).choices[0].logprobs.tokens[0]
    _, _, tokens = request("POST", server.url + "/tokenize", {"content": first}, headers=None)
    (token_id,) = tokens["tokens"]
    _, _, back = request("POST", server.url + "/detokenize", {"tokens": [token_id]}, headers=None)
    assert back["content"] == first
    biased = greedy(client, max_tokens=1, logprobs=0, logit_bias={str(token_id): -100})
    assert biased.choices[0].logprobs.tokens[0] != first
    # llama-server's list form, and false to ban
    banned = greedy(client, max_tokens=1, extra_body={"logit_bias": [[token_id, False]]})
    assert banned.choices[0].text == biased.choices[0].text


def test_penalties_change_a_repetitive_continuation(client):
    def most_repeated(**kw) -> int:
        r = greedy(client, REPETITIVE, max_tokens=12, logprobs=0, **kw)
        return collections.Counter(r.choices[0].logprobs.tokens).most_common(1)[0][1]

    assert most_repeated() >= 8  # " the" again and again
    assert most_repeated(extra_body={"repeat_penalty": 1.3}) <= 4
    assert most_repeated(frequency_penalty=1.5, presence_penalty=1.0) <= 4


def test_refused_fields_name_themselves(client):
    for kw in ({"extra_body": {"mirostat": 2}}, {"best_of": 3}, {"suffix": "x"}, {"extra_body": {"temprature": 1}}):
        with pytest.raises(openai.BadRequestError) as info:
            greedy(client, **kw)
        name = next(iter(kw.get("extra_body", kw)))
        assert info.value.body["param"] == name and name in info.value.body["message"], info.value.body


def test_slots_endpoint(server):
    status, _, slots = request("GET", server.url + "/slots", headers=None)
    assert status == 200 and [s["id"] for s in slots] == [0, 1, 2, 3] and slots[0]["n_ctx"] == 256, slots


def test_llama_server_flags_https_key_file_n_predict_no_slots(tmp_path):
    """--ssl-cert-file/--ssl-key-file serve HTTPS, --api-key-file's keys are let in, -n caps and
    defaults max_tokens, --no-slots takes /slots away, --jinja and -ctk f16 are taken."""
    import ssl
    import urllib.error
    import urllib.request

    from tiny_models import write_tiny_llama
    from tls_certs import make_tls_files
    tls = make_tls_files(tmp_path / "tls")
    keys = tmp_path / "keys"
    keys.write_text("# keys\nkey-from-file\n")
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    s = Serve(str(tmp_path), "-m", str(model), "--parallel", "1", "--ctx-per-slot", "64", "--ssl-cert-file", tls.cert,
              "--ssl-key-file", tls.key, "--api-key-file", str(keys), "-n", "3", "--no-slots", "--jinja",
              "-ctk", "f16")
    try:
        assert s.url.startswith("https://127.0.0.1:"), s.url
        trusting = ssl.create_default_context(cafile=tls.ca)
        http = openai.DefaultHttpxClient(verify=trusting, timeout=60)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="key-from-file", http_client=http, max_retries=0)
        r = c.completions.create(model="any", prompt=[1, 2, 3], temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3  # -n 3: the default
        r = c.completions.create(model="any", prompt=[1, 2, 3], temperature=0, max_tokens=10,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"  # and the most
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", http_client=http, max_retries=0).models.list()

        def get(url: str, context=None, key: str = "key-from-file") -> int:
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
            try:
                with urllib.request.urlopen(req, timeout=30, context=context) as answer:
                    return answer.status
            except urllib.error.HTTPError as exc:
                return exc.code
        assert get(s.url + "/health", trusting) == 200
        assert get(s.url + "/slots", trusting) == 404  # --no-slots
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # not trusting its CA
            get(s.url + "/health", ssl.create_default_context())
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # plain HTTP gets no answer
            get(s.url.replace("https://", "http://") + "/health")
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.text()[-2000:]
