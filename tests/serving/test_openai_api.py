"""coordinator/serving/openai_api.py without a socket or a model: request
bodies in, typed requests or OpenAI-shaped errors (naming the field) out, and
the exact objects a reply is sent as."""
from __future__ import annotations

import re

import pytest

from coordinator.decode.values import DecodeResult
from coordinator.serving import chat_templates, openai_api
from coordinator.serving.openai_api import ApiError, CompletionReply

N_VOCAB = 256
N_CTX = 256


def refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


def completion(**body):
    return openai_api.parse_completion(body, N_VOCAB, N_CTX)


def chat(**body):
    return openai_api.parse_chat(body, N_CTX)


def completion_refused(**body) -> ApiError:
    return refused(lambda: completion(**body))


# ------------------------------------------------------------ ApiError
def test_error_body_and_headers():
    e = ApiError(400, "'stop' is wrong", param="stop", code="some_code")
    assert e.body() == {"error": {"message": "'stop' is wrong", "type": "invalid_request_error", "param": "stop",
                                  "code": "some_code"}}
    assert e.response_headers() == {}
    assert str(e) == "'stop' is wrong"


@pytest.mark.parametrize("status, retry_after, header", [
    (503, None, "1"), (429, None, "1"), (503, 2.2, "3"), (503, 0.2, "1"), (500, None, None), (400, 7, "7")])
def test_retry_after_is_whole_seconds_at_least_one_and_on_every_429_and_503(status, retry_after, header):
    headers = ApiError(status, "x", retry_after=retry_after).response_headers()
    assert headers.get("Retry-After") == header


def test_error_keeps_its_own_headers():
    e = ApiError(401, "no key", headers={"WWW-Authenticate": "Bearer"})
    assert e.response_headers() == {"WWW-Authenticate": "Bearer"}


# ------------------------------------------------------------ the body
@pytest.mark.parametrize("text, message, param", [
    ("{not json", "request body is not valid JSON", None),
    ("", "request body is not valid JSON", None),
    ('["a list"]', "request body must be a JSON object", None),
    ('"text"', "request body must be a JSON object", None),
    ('{"model": 5}', "'model' must be a string", "model"),
])
def test_bad_bodies(text, message, param):
    e = refused(openai_api.request_body, text)
    assert (e.status, e.message, e.param, e.kind) == (400, message, param, "invalid_request_error")


def test_any_model_name_is_taken():
    assert openai_api.request_body('{"model": "gpt-4o", "prompt": "x"}') == {"model": "gpt-4o", "prompt": "x"}
    assert openai_api.request_body('{"model": null}') == {"model": None}


# ------------------------------------------------------------ typed parameters
def test_typed_param_types_ranges_and_defaults():
    tp = openai_api.typed_param
    assert tp({}, "top_k", int, 0) == 0
    assert tp({"top_k": None}, "top_k", int, 7) == 7
    assert tp({"temperature": 1}, "temperature", float, 1.0) == 1  # an int is a float
    assert tp({"stream": True}, "stream", bool, False) is True
    e = refused(tp, {"max_tokens": True}, "max_tokens", int, 16)  # a bool is no int
    assert (e.message, e.param) == ("'max_tokens' must be of type int", "max_tokens")
    e = refused(tp, {"temperature": "hot"}, "temperature", float, 1.0)
    assert (e.message, e.param) == ("'temperature' must be of type float", "temperature")
    e = refused(tp, {"stream": 1}, "stream", bool, False)
    assert (e.message, e.param) == ("'stream' must be of type bool", "stream")
    e = refused(tp, {"temperature": 2.5}, "temperature", float, 1.0, 0.0, 2.0)
    assert (e.message, e.param) == ("'temperature' must be between 0.0 and 2.0", "temperature")


@pytest.mark.parametrize("body, message, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "'response_format': invalid JSON schema: Invalid type: nope", "response_format"),
    ({"max_tokens": "ten"}, "'max_tokens' must be of type int", "max_tokens"),
    ({"max_tokens": 0}, f"'max_tokens' must be between 1 and {N_CTX}", "max_tokens"),
    ({"max_tokens": N_CTX + 1}, f"'max_tokens' must be between 1 and {N_CTX}", "max_tokens"),
    ({"max_completion_tokens": 0}, f"'max_tokens' must be between 1 and {N_CTX}", "max_tokens"),
    ({"temperature": -1}, "'temperature' must be between 0.0 and 2.0", "temperature"),
    ({"top_p": 0}, "'top_p' must be between 1e-06 and 1.0", "top_p"),
    ({"top_k": -1}, f"'top_k' must be between 0 and {1 << 20}", "top_k"),
    ({"seed": 1.5}, "'seed' must be of type int", "seed"),
    ({"seed": -1}, "'seed' must be between 0 and 2**63 - 1", "seed"),
    ({"seed": 2**63}, "'seed' must be between 0 and 2**63 - 1", "seed"),
    ({"stream": "yes"}, "'stream' must be of type bool", "stream"),
    ({"stop": [1]}, "'stop' must be a string or a list of up to 4 non-empty strings", "stop"),
    ({"stop": [""]}, "'stop' must be a string or a list of up to 4 non-empty strings", "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "'stop' must be a string or a list of up to 4 non-empty strings", "stop"),
    ({"stop": {"a": 1}}, "'stop' must be a string or a list of up to 4 non-empty strings", "stop"),
    ({"stream_options": True}, "'stream_options' must be an object like {\"include_usage\": true}",
     "stream_options"),
    ({"stream_options": {"include_usage": 1}}, "'stream_options' must be an object like {\"include_usage\": true}",
     "stream_options"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0 (0 is greedy), not nan", None),
    ({"top_p": float("nan")}, "top_p must be in (0, 1], not nan", None),
])
def test_bad_generation_parameters(body, message, param):
    e = completion_refused(prompt="x", **body)
    assert (e.status, e.message, e.param, e.code) == (400, message, param, None)


def test_nan_from_the_wire_is_refused_by_the_sampler():
    body = openai_api.request_body('{"prompt": "x", "temperature": NaN}')
    assert completion_refused(**body).message == "temperature must be a finite number >= 0 (0 is greedy), not nan"


def test_the_first_bad_field_is_the_one_named():
    # the prompt before the sampling; unsupported parameters before the others
    assert completion_refused(prompt=5, n=3).param == "prompt"
    assert completion_refused(prompt="x", best_of=3, max_tokens="ten").param == "best_of"
    assert completion_refused(prompt="x", max_tokens="ten", temperature=-1).param == "max_tokens"


def test_generation_defaults():
    gen = completion(prompt="x").generation
    assert (gen.max_tokens, gen.stop, gen.stream, gen.include_usage) == (16, [], False, False)
    assert (gen.sampler.temperature, gen.sampler.top_p, gen.sampler.top_k) == (1.0, 1.0, 0)
    assert (gen.n, gen.logprobs, gen.echo, gen.ignore_eos) == (1, None, False, False)
    s = gen.sampler
    assert (s.min_p, s.typical_p, s.repeat_penalty, s.repeat_last_n, s.frequency_penalty, s.presence_penalty,
            s.logit_bias, s.min_keep) == (0.0, 1.0, 1.0, 64, 0.0, 0.0, {}, 0)
    assert chat(messages=[{"role": "user", "content": "x"}]).generation.max_tokens is None


def test_generation_values():
    gen = completion(prompt="x", max_tokens=5, temperature=0, top_p=0.5, top_k=3, seed=7, stop="\n",
                     stream=True, stream_options={"include_usage": True}, response_format={"type": "text"},
                     model="anything").generation
    assert (gen.max_tokens, gen.stop, gen.stream, gen.include_usage) == (5, ["\n"], True, True)
    assert (gen.sampler.temperature, gen.sampler.top_p, gen.sampler.top_k) == (0, 0.5, 3)
    assert completion(prompt="x", max_completion_tokens=9).generation.max_tokens == 9  # the newer name
    assert completion(prompt="x", max_tokens=4, max_completion_tokens=9).generation.max_tokens == 4
    assert completion(prompt="x", stop=["a", "b"]).generation.stop == ["a", "b"]
    assert completion(prompt="x", stop=None).generation.stop == []


def test_the_seed_seeds_the_sampler():
    draw = [completion(prompt="x", seed=42).generation.sampler.rng.integers(1 << 30) for _ in range(2)]
    assert draw[0] == draw[1]
    assert completion(prompt="x", seed=43).generation.sampler.rng.integers(1 << 30) != draw[0]


def test_include_usage_needs_stream():
    assert completion(prompt="x", stream_options={"include_usage": True}).generation.include_usage is False
    assert completion(prompt="x", stream=True, stream_options={}).generation.include_usage is False


# ------------------------------------------------------------ prompts
@pytest.mark.parametrize("prompt, parsed", [
    ("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3]), ([[1, 2]], [1, 2]),
    ([N_VOCAB - 1], [N_VOCAB - 1]),
])
def test_prompt_forms(prompt, parsed):
    assert completion(prompt=prompt).prompt == parsed


@pytest.mark.parametrize("prompt, message", [
    (None, "'prompt' must be a string, a list of token ids, or a list holding one of those"),
    (5, "'prompt' must be a string, a list of token ids, or a list holding one of those"),
    ([], "'prompt' must be a string, a list of token ids, or a list holding one of those"),
    ([True, False], "'prompt' must be a string, a list of token ids, or a list holding one of those"),
    ([1, "a"], "'prompt' must be a string, a list of token ids, or a list holding one of those"),
    (["a", "b"], ("'prompt' holds 2 prompts; this server answers one prompt per request: send each in a "
                  "request of its own")),
    ([[1], [2], [3]], ("'prompt' holds 3 prompts; this server answers one prompt per request: send each in a "
                       "request of its own")),
    ([1, N_VOCAB], f"token id {N_VOCAB} in 'prompt' is outside the vocabulary (0..{N_VOCAB - 1})"),
    ([-1], f"token id -1 in 'prompt' is outside the vocabulary (0..{N_VOCAB - 1})"),
    ([["a"]], "'prompt' must be a string, a list of token ids, or a list holding one of those"),
])
def test_bad_prompts(prompt, message):
    e = completion_refused(prompt=prompt)
    assert (e.status, e.message, e.param) == (400, message, "prompt")


def test_token_prompt_must_fit_with_max_tokens():
    completion(prompt=[1] * (N_CTX - 16))
    e = completion_refused(prompt=[1] * (N_CTX - 15))
    assert (e.status, e.param, e.code) == (400, "prompt", "context_length_exceeded")
    assert e.message == f"prompt of {N_CTX - 15} tokens plus max_tokens 16 exceeds the context of {N_CTX} tokens " \
                        f"per slot"
    assert completion_refused(prompt=[1] * 10, max_tokens=N_CTX - 9).code == "context_length_exceeded"


def test_check_fits():
    openai_api.check_fits(200, 56, 256)
    e = refused(openai_api.check_fits, 200, 57, 256, "messages")
    assert (e.message, e.param, e.code) == (
        "prompt of 200 tokens plus max_tokens 57 exceeds the context of 256 tokens per slot", "messages",
        "context_length_exceeded")


def test_a_text_too_long_to_fit_is_refused_before_tokenizing():
    openai_api.check_text_fits("x" * (64 * 4), 4)
    e = refused(openai_api.check_text_fits, "x" * (64 * 4 + 1), 4)
    assert (e.status, e.message, e.param, e.code) == (
        400, "prompt of 257 characters cannot fit the context of 4 tokens per slot", "prompt",
        "context_length_exceeded")
    e = refused(openai_api.check_text_fits, "é" * 129, 4, "messages")  # bytes count, not characters
    assert (e.message, e.param) == ("prompt of 129 characters cannot fit the context of 4 tokens per slot",
                                    "messages")
    openai_api.check_text_fits("é" * 128, 4)


# ------------------------------------------------------------ chat messages
def test_messages_with_text_parts_are_joined():
    req = chat(messages=[{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hello, "},
                                                      {"type": "text", "text": "world"}], "name": "x"}])
    assert req.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hello, world", "name": "x"}]


@pytest.mark.parametrize("messages, message", [
    ("hi", "'messages' must be a non-empty list of {role, content} objects"),
    (None, "'messages' must be a non-empty list of {role, content} objects"),
    ([], "'messages' must be a non-empty list of {role, content} objects"),
    (["hi"], "'messages' must be a non-empty list of {role, content} objects"),
    ([{"content": "x"}], "'messages' must be a non-empty list of {role, content} objects"),
    ([{"role": "user", "content": 5}], "'messages' must be a non-empty list of {role, content} objects"),
    ([{"role": "user"}], "'messages' must be a non-empty list of {role, content} objects"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[1].content: parts of type 'image_url' are not supported; this server takes text parts only"),
    ([{"role": "user", "content": ["bare"]}],
     "messages[0].content: parts of type None are not supported; this server takes text parts only"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content: a text part needs a string 'text'"),
])
def test_bad_messages(messages, message):
    e = refused(lambda: chat(messages=messages))
    assert (e.status, e.message, e.param) == (400, message, "messages")


def test_chat_checks_messages_before_sampling():
    assert refused(lambda: chat(messages="hi", n=2)).param == "messages"
    assert refused(lambda: chat(messages=[{"role": "user", "content": "x"}], tools=[{}])).param == "tools"
    assert refused(lambda: chat(messages="hi", tools=[{}])).param == "messages"


def test_chat_prompt_renders_for_the_assistant():
    template = chat_templates.chosen("chatml")
    text = openai_api.chat_prompt(template, [{"role": "user", "content": "Hi"}], "<s>", "</s>")
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    llama3 = openai_api.chat_prompt(chat_templates.chosen("llama3"), [{"role": "user", "content": "Hi"}], "<s>", "")
    assert llama3.startswith("<s><|start_header_id|>user")


def test_a_template_that_refuses_the_messages_names_them():
    text = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}"
    strict = chat_templates.ChatTemplate("strict.jinja", "file", text, chat_templates.sandbox().from_string(text))
    e = refused(openai_api.chat_prompt, strict, [{"role": "user", "content": "Hi"}], "", "")
    assert (e.status, e.message, e.param) == (
        400, "the chat template (strict.jinja) refused the messages: a system message first", "messages")


# ------------------------------------------------------------ refusals of valid requests
def test_refusals_of_a_valid_request():
    e = openai_api.model_not_found("gpt-4", "gemma-3-270m")
    assert (e.status, e.message, e.param, e.code, e.kind) == (
        404, "model 'gpt-4' not found; this server serves 'gemma-3-270m'", "model", "model_not_found",
        "invalid_request_error")
    e = openai_api.shutting_down()
    assert (e.status, e.message, e.kind, e.response_headers()) == (
        503, "the server is shutting down", "server_error", {"Retry-After": "5"})
    e = openai_api.decode_loop_stopped()
    assert (e.status, e.message, e.kind, e.response_headers()) == (
        503, "the decode loop is not running", "server_error", {"Retry-After": "10"})
    e = openai_api.worker_unavailable("10.0.0.2:50052", "closed", 3.5)
    assert (e.status, e.message, e.kind, e.response_headers()) == (
        503, "worker 10.0.0.2:50052 unavailable: closed", "server_error", {"Retry-After": "4"})
    e = openai_api.server_busy(4, 2, 2, 1)
    assert e.body() == {"error": {"message": "server busy: all 4 slots are in use and 2 requests already wait for "
                                             "one (--max-queue 2); retry later", "type": "server_busy",
                                  "param": None, "code": "rate_limit_exceeded"}}
    assert (e.status, e.response_headers()) == (429, {"Retry-After": "1"})


@pytest.mark.parametrize("code, status, retry", [
    (DecodeResult.ENDPOINT_FAILED, 503, "3"), (DecodeResult.ABORTED, 503, "3"), (DecodeResult.NO_KV_SLOT, 400, None),
    (DecodeResult.INVALID_BATCH, 400, None), (DecodeResult.COMPUTE_FAILED, 500, None), (None, 500, None)])
def test_decode_failures(code, status, retry):
    e = openai_api.decode_failed("it failed", code, 2.5)
    assert (e.status, e.message, e.kind, e.code) == (status, "it failed", "server_error",
                                                     code.name if code is not None else None)
    assert e.response_headers().get("Retry-After") == retry


# ------------------------------------------------------------ replies
def test_completion_objects():
    text = CompletionReply("cmpl-1", 1700000000, "m", chat=False)
    assert text.completion("Paris.", "stop", 6, 2) == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
        "choices": [{"index": 0, "text": "Paris.", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8,
                  "prompt_tokens_details": {"cached_tokens": 0}}}
    chat_reply = CompletionReply("chatcmpl-1", 1700000000, "m", chat=True)
    assert chat_reply.completion("Hi!", "length", 10, 16) == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!"}, "logprobs": None,
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 16, "total_tokens": 26,
                  "prompt_tokens_details": {"cached_tokens": 0}}}


def test_stream_chunks():
    text = CompletionReply("cmpl-1", 5, "m", chat=False)
    assert text.chunk(" Paris") == {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
                                    "choices": [{"index": 0, "text": " Paris", "logprobs": None,
                                                 "finish_reason": None}]}
    assert text.chunk("", "stop", include_usage=True) == {
        "id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}], "usage": None}
    chat_reply = CompletionReply("chatcmpl-1", 5, "m", chat=True)
    assert chat_reply.chunk("Hi") == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5,
                                      "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                       "content": "Hi"},
                                                                 "logprobs": None, "finish_reason": None}]}
    assert chat_reply.usage_chunk(3, 4) == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5,
                                            "model": "m", "choices": [],
                                            "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                                      "total_tokens": 7,
                                                      "prompt_tokens_details": {"cached_tokens": 0}}}
    assert text.usage_chunk(1, 0)["object"] == "text_completion"


def test_stream_error_event():
    assert openai_api.stream_error("worker lost", DecodeResult.ENDPOINT_FAILED, "127.0.0.1:1") == {
        "error": {"message": "worker lost", "type": "server_error", "code": "ENDPOINT_FAILED",
                  "endpoint": "127.0.0.1:1"}}
    assert openai_api.stream_error("x", None, None) == {"error": {"message": "x", "type": "server_error",
                                                                  "code": None, "endpoint": None}}


def test_models_and_ids():
    assert openai_api.model_list("m", 7) == {"object": "list", "data": [
        {"id": "m", "object": "model", "created": 7, "owned_by": "ggml-distributed"}]}
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", openai_api.new_completion_id(True))
    assert re.fullmatch(r"cmpl-[0-9a-f]{24}", openai_api.new_completion_id(False))
    assert openai_api.new_completion_id(False) != openai_api.new_completion_id(False)
