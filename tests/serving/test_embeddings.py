"""coordinator/serving/embeddings.py without a socket or a model: /v1/embeddings' request,
the pooling and normalization of hidden-state rows, and OpenAI's reply shape."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from coordinator.serving import embeddings
from coordinator.serving.openai_api import ApiError


@pytest.mark.parametrize("body, inputs", [
    ({"input": "hi"}, ["hi"]), ({"input": ["a", "b"]}, ["a", "b"]), ({"input": [1, 2]}, [[1, 2]]),
    ({"input": [[1], [2, 3]]}, [[1], [2, 3]]), ({"content": "x", "model": "m", "user": "u"}, ["x"]),
    ({"input": ["a", [4]]}, ["a", [4]]),
])
def test_inputs(body, inputs):
    r = embeddings.parse_embeddings(body, 10)
    assert r.inputs == inputs and r.encoding_format == "float"
    assert embeddings.parse_embeddings(dict(body, encoding_format="base64"), 10).encoding_format == "base64"


@pytest.mark.parametrize("body, param", [
    ({}, "content"), ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": [[1], []]}, "input"), ({"input": [10]}, "input"), ({"input": [True]}, "input"),
    ({"input": "a", "content": "b"}, "content"), ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "a", "dimensions": 8}, "dimensions"), ({"input": "a", "pooling": "mean"}, "pooling"),
    ({"input": "a", "user": 3}, "user"), ({"input": ["a"] * 2049}, "input"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as info:
        embeddings.parse_embeddings(body, 10)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_pooling_and_normalization():
    rows = np.array([[3.0, 0.0], [0.0, 4.0], [1.0, 1.0]], np.float32)
    mean = rows.mean(axis=0)
    assert np.allclose(embeddings.pool(rows, "mean"), mean / np.linalg.norm(mean))
    assert np.allclose(embeddings.pool(rows, "cls"), [1.0, 0.0])
    assert np.allclose(embeddings.pool(rows, "last"), [2 ** -0.5, 2 ** -0.5])
    for mode in embeddings.POOLING:
        v = embeddings.pool(rows, mode)
        assert v.dtype == np.float32 and np.isclose(np.linalg.norm(v), 1.0)
    assert np.array_equal(embeddings.pool(np.zeros((2, 3)), "mean"), np.zeros(3))
    with pytest.raises(ValueError):
        embeddings.pool(rows, "max")
    assert embeddings.rows_wanted(3, "mean") == [True] * 3
    assert embeddings.rows_wanted(3, "last") == [False, False, True]
    assert embeddings.rows_wanted(3, "cls") == [True, False, False]


def test_reply_shape_and_base64():
    v = [np.array([0.6, 0.8], np.float32), np.array([1.0, 0.0], np.float32)]
    r = embeddings.reply(v, "m", 7)
    assert r == {"object": "list", "model": "m", "usage": {"prompt_tokens": 7, "total_tokens": 7}, "data": [
        {"object": "embedding", "index": 0, "embedding": [float(np.float32(0.6)), float(np.float32(0.8))]},
        {"object": "embedding", "index": 1, "embedding": [1.0, 0.0]}]}
    b = embeddings.reply(v, "m", 7, "base64")["data"][0]["embedding"]
    # what the openai client does with it: numpy float32 from the base64 bytes
    assert np.array_equal(np.frombuffer(base64.b64decode(b), dtype="float32"), v[0])
