"""coordinator/serving/llama_server_api.py without a socket or a model: /tokenize, /detokenize and /props bodies."""
from __future__ import annotations

import pytest

from coordinator.serving import chat_templates, llama_server_api
from coordinator.serving.openai_api import ApiError


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
