"""coordinator/serving/llama_server_api.py without a socket or a model: /tokenize, /detokenize and /props bodies."""
from __future__ import annotations

import pytest

from coordinator.serving import chat_templates, llama_server_api
from coordinator.serving.openai_api import ApiError
from coordinator.text.sampling import TokenLogprob


def test_tokenize_defaults_and_values():
    assert llama_server_api.parse_tokenize({"content": "Hi"}) == llama_server_api.TokenizeRequest("Hi", False, True)
    assert llama_server_api.parse_tokenize({"content": "", "add_special": True, "parse_special": False}) == \
        llama_server_api.TokenizeRequest("", True, False)


@pytest.mark.parametrize("body, message, param", [
    ({}, "'content' must be a string", "content"),
    ({"content": ["Hi"]}, "'content' must be a string", "content"),
    ({"content": "Hi", "add_special": 1}, "'add_special' must be of type bool", "add_special"),
    ({"content": "Hi", "parse_special": "no"}, "'parse_special' must be of type bool", "parse_special"),
])
def test_bad_tokenize_bodies(body, message, param):
    with pytest.raises(ApiError) as info:
        llama_server_api.parse_tokenize(body)
    assert (info.value.status, info.value.message, info.value.param) == (400, message, param)


def test_detokenize():
    assert llama_server_api.parse_detokenize({"tokens": [0, 5, 99]}, 100) == [0, 5, 99]
    assert llama_server_api.parse_detokenize({"tokens": []}, 100) == []


@pytest.mark.parametrize("tokens, message", [
    (None, "'tokens' must be a list of token ids"), ("1 2", "'tokens' must be a list of token ids"),
    ([1, True], "'tokens' must be a list of token ids"), ([1.0], "'tokens' must be a list of token ids"),
    ([100], "token id 100 in 'tokens' is outside the vocabulary (0..99)"),
    ([3, -2], "token id -2 in 'tokens' is outside the vocabulary (0..99)"),
])
def test_bad_detokenize_bodies(tokens, message):
    with pytest.raises(ApiError) as info:
        llama_server_api.parse_detokenize({"tokens": tokens}, 100)
    assert (info.value.status, info.value.message, info.value.param) == (400, message, "tokens")


def test_props():
    chatml = chat_templates.chosen("chatml")
    assert llama_server_api.props("gemma-3-270m", 4, 2048, chatml, "1.2.3") == {
        "model_alias": "gemma-3-270m", "total_slots": 4, "default_generation_settings": {"n_ctx": 2048},
        "chat_template": chat_templates.BUILTIN["chatml"], "chat_template_name": "chatml",
        "chat_template_source": "builtin", "build_info": "ggml-distributed 1.2.3"}
    split = {"split_mode": "tensor", "workers": [{"endpoint": "a:1", "layers": [0, 18], "shard": {"rank": 0}}]}
    assert llama_server_api.props("m", 1, 64, chatml, "1", split)["split"] == split


def test_slots_entries():
    busy = {1: {"request_id": "abc", "n_prompt_tokens": 9, "n_prompt_tokens_cache": 4, "n_decoded": 2,
                "n_remain": 14}}
    free, taken = llama_server_api.slots(2, 256, busy, {0: 7, 1: 6})
    assert free == {"id": 0, "n_ctx": 256, "is_processing": False, "n_cache_tokens": 7,
                    "next_token": [{"has_next_token": False, "n_remain": 0, "n_decoded": 0}]}
    assert taken == {"id": 1, "n_ctx": 256, "is_processing": True, "n_cache_tokens": 6, "request_id": "abc",
                     "n_prompt_tokens": 9, "n_prompt_tokens_cache": 4,
                     "next_token": [{"has_next_token": True, "n_remain": 14, "n_decoded": 2}]}


# ------------------------------------------------------------ /completion
def native(body, limit=None):
    return llama_server_api.parse_native_completion(body, 100, 64, limit)


def test_native_completion_fields():
    r = native({"prompt": "Hi", "n_predict": 5, "temperature": 0.5, "top_k": 3, "top_p": 0.9, "min_p": 0.1,
                "seed": 7, "stop": ["\n"], "stream": True, "cache_prompt": False, "n_probs": 2})
    g = r.generation
    assert r.prompt == "Hi" and g.max_tokens == 5 and g.stream and g.stop == ["\n"] and not g.cache_prompt
    assert (g.sampler.temperature, g.sampler.top_k, g.sampler.top_p, g.sampler.min_p, g.sampler.seed) == (
        0.5, 3, 0.9, 0.1, 7)
    assert g.logprobs == 2
    r = native({"prompt": [1, 2, 3]})
    assert r.prompt == [1, 2, 3] and r.generation.max_tokens is None and r.generation.logprobs is None  # n_predict -1
    assert native({"prompt": "x", "n_probs": 0}).generation.logprobs is None
    assert native({"prompt": "x"}, limit=4).generation.max_tokens == 4  # serve's -n


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "x", "temprature": 1}, "temprature", "unrecognized request argument supplied: 'temprature'"),
    ({"prompt": "x", "mirostat": 2}, "mirostat", "'mirostat' is not supported by this server"),
    ({"prompt": "x", "messages": []}, "messages", "'messages' is a field of /v1/chat/completions, not of "
                                                  "/completion"),
    ({"prompt": "x", "logprobs": 2}, "logprobs", "'logprobs' is not a field of /completion: ask 'n_probs'"),
    ({"prompt": "x", "echo": True}, "echo", "'echo' is not a field of /completion"),
    ({"prompt": "x", "suffix": "y"}, "suffix", "'suffix' is not a field of /completion: fill-in-the-middle is "
                                               "/infill's"),
    ({"prompt": "x", "n": 2}, "n", "/completion answers one completion per request"),
    ({"prompt": "x", "n_probs": 21}, "n_probs", "'n_probs' must be between 0 and 20"),
    ({"prompt": "x", "n_predict": 0}, "n_predict", "'n_predict' must be -1 (no limit) or between 1 and 64"),
    ({"prompt": 5}, "prompt", "'prompt' must be a string, a list of token ids"),
    ({"prompt": [1] * 60, "n_predict": 10}, "prompt", "prompt of 60 tokens plus max_tokens 10 exceeds"),
])
def test_native_completion_refusals(body, param, message):
    with pytest.raises(ApiError) as info:
        native(body)
    assert info.value.status == 400 and info.value.param == param and info.value.message.startswith(message), \
        info.value.message


def test_native_replies():
    assert [llama_server_api.stop_type(*a) for a in (("length", ""), ("stop", ""), ("stop", "\n"))] == \
        ["limit", "eos", "word"]
    t = llama_server_api.timings(2, 4, 0.5, 10, 2.0)
    assert t == {"cache_n": 2, "prompt_n": 4, "prompt_ms": 500.0, "prompt_per_token_ms": 125.0,
                 "prompt_per_second": 8.0, "predicted_n": 10, "predicted_ms": 2000.0,
                 "predicted_per_token_ms": 200.0, "predicted_per_second": 5.0}
    assert llama_server_api.timings(0, 0, 0.0, 0, 0.0)["predicted_per_second"] == 0.0
    final = llama_server_api.native_final("a\nb", "m", 1, 3, 5, "Hi", "stop", "\n\n", 0, t)
    assert (final["stop"], final["stop_type"], final["stopping_word"], final["has_new_line"], final["id_slot"],
            final["tokens_predicted"], final["tokens_evaluated"], final["prompt"], final["model"]) == \
        (True, "word", "\n\n", True, 1, 3, 5, "Hi", "m")
    assert "completion_probabilities" not in final
    assert llama_server_api.native_partial("x", 0, 1, 5) == {
        "index": 0, "content": "x", "tokens": [], "stop": False, "id_slot": 0, "tokens_predicted": 1,
        "tokens_evaluated": 5}
    entries = [TokenLogprob(7, -0.5, ((7, -0.5), (8, -1.5)))]
    probs = llama_server_api.completion_probabilities(entries, lambda t: b"ab" if t == 7 else b"\xe2")
    assert probs == [{"id": 7, "token": "ab", "bytes": [97, 98], "logprob": -0.5, "top_logprobs": [
        {"id": 7, "token": "ab", "bytes": [97, 98], "logprob": -0.5},
        {"id": 8, "token": "bytes:\\xe2", "bytes": [226], "logprob": -1.5}]}]


# ------------------------------------------------------------ /infill
QWEN_FIM = {"<|fim_prefix|>": 90, "<|fim_suffix|>": 91, "<|fim_middle|>": 92, "<|fim_repo|>": 93,
            "<|file_sep|>": 94}


def test_fim_tokens_from_the_gguf_or_the_vocabulary():
    keys = {"tokenizer.ggml.fim_pre_token_id": 10, "tokenizer.ggml.fim_suf_token_id": 11,
            "tokenizer.ggml.fim_mid_token_id": 12}
    assert llama_server_api.fim_tokens(keys.get, {}.get, 100) == llama_server_api.FimTokens(10, 11, 12)
    older = {"tokenizer.ggml.prefix_token_id": 1, "tokenizer.ggml.suffix_token_id": 2,
             "tokenizer.ggml.middle_token_id": 3}
    assert llama_server_api.fim_tokens(older.get, {}.get, 100) == llama_server_api.FimTokens(1, 2, 3)
    assert llama_server_api.fim_tokens({}.get, QWEN_FIM.get, 100) == llama_server_api.FimTokens(90, 91, 92, 93, 94)
    none = llama_server_api.fim_tokens({}.get, {"<PRE>": 5}.get, 100)
    assert none.missing == ["suffix token is missing", "middle token is missing"]


def fake_tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token a character, ids < 90 for these texts


def test_infill_prompt_assembly():
    plain = llama_server_api.FimTokens(90, 91, 92)
    ids = llama_server_api.infill_prompt(plain, fake_tokenize, "ab", "cd", [], [ord("P")], 64, -1, 256, None)
    assert ids == [90, ord("a"), ord("b"), ord("P"), 91, ord("c"), ord("d"), 92]
    ids = llama_server_api.infill_prompt(plain, fake_tokenize, "ab", "cd", [], [], 64, -1, 256, 2)
    assert ids[:2] == [2, 90] and ids[-1] == 92  # BOS first when the model adds one
    # Qwen's repo-level pattern: the repository, each file, then this file, before the prefix
    qwen = llama_server_api.FimTokens(90, 91, 92, 93, 94)
    ids = llama_server_api.infill_prompt(qwen, fake_tokenize, "a", "b", [("f.py", "x")], [], 64, -1, 256, None)
    expected = ([93] + fake_tokenize("myproject\n") + [94] + fake_tokenize("f.py\n") + fake_tokenize("x")
                + [94] + fake_tokenize("filename\n") + [90, ord("a"), 91, ord("b"), 92])
    assert ids == expected
    # without a file separator the chunks are set apart by llama-server's snippet line
    ids = llama_server_api.infill_prompt(plain, fake_tokenize, "a", "b", [("f.py", "x")], [], 64, -1, 256, None)
    assert ids == fake_tokenize(llama_server_api.CHUNK_SEPARATOR + "x") + [90, ord("a"), 91, ord("b"), 92]
    # a batch of 16: the prefix's last 12 tokens, the suffix's first 16/4 - 2 - len(prompt)
    ids = llama_server_api.infill_prompt(plain, fake_tokenize, "p" * 20, "s" * 20, [], [ord("P")], 16, -1, 256, None)
    assert ids == [90] + [ord("p")] * 12 + [ord("P"), 91] + [ord("s")] * 1 + [92]
    # the extra context takes what the context leaves (n_ctx - n_batch - 2 n_predict), its end
    ids = llama_server_api.infill_prompt(plain, fake_tokenize, "a", "b", [("f", "0123456789")], [], 16, 2, 26,
                                         None)
    assert ids == fake_tokenize("456789") + [90, ord("a"), 91, ord("b"), 92]


@pytest.mark.parametrize("body, param", [
    ({"input_suffix": "b"}, "input_prefix"), ({"input_prefix": "a"}, "input_suffix"),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": {}}, "input_extra"),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "f"}]}, "input_extra"),
    ({"input_prefix": "a", "input_suffix": "b", "prompt": [1, 2]}, "prompt"),
    ({"input_prefix": "a", "input_suffix": "b", "logprobs": 1}, "logprobs"),
])
def test_bad_infill_bodies(body, param):
    with pytest.raises(ApiError) as info:
        llama_server_api.parse_infill(body, 100, 64)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_infill_body():
    r = llama_server_api.parse_infill({"input_prefix": "a", "input_suffix": "b", "n_predict": 4,
                                       "input_extra": [{"text": "x"}, {"filename": "g.py", "text": "y"}]}, 100, 64)
    assert (r.input_prefix, r.input_suffix, r.input_extra) == ("a", "b", [("tmp", "x"), ("g.py", "y")])
    assert r.completion.prompt == "" and r.completion.generation.max_tokens == 4
