"""/v1/embeddings' bodies, without I/O or the model: the request parsed
(OpenAI's fields, llama-server's `content` alias), the rows of the model's
final normed hidden state pooled into one vector per input (mean, last, cls)
and L2-normalized, and OpenAI's reply (floats, or base64 of little-endian
float32, which the official client asks by default).

The rows come from Coordinator.aembed (the final hidden state after
output_norm, no output head), decoded on the scheduler's slots
(batching.Scheduler.embed); http_server.py ties them together."""
from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from coordinator.serving.openai_api import ApiError, token_ids, typed_param

POOLING = ("mean", "last", "cls")  # --pooling; llama-server's names
ENCODINGS = ("float", "base64")
FIELDS = {"input", "content", "model", "encoding_format", "dimensions", "user"}
MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: list  # each a string (to tokenize) or token ids (checked against the vocabulary)
    encoding_format: str  # "float" or "base64"
    param: str = "input"  # the field the inputs came in: "input", or llama-server's "content"


def parse_embeddings(body: dict, n_vocab: int) -> EmbeddingRequest:
    """`input` (or llama-server's `content`): a string, a list of strings, a list of token ids, or a
    list of those lists; none empty. `encoding_format` float (default) or base64; `dimensions`
    refused (the model's width is the vector's); `user` taken; any other field a 400 naming it."""
    for name in body:
        if name not in FIELDS:
            raise ApiError(400, f"unrecognized request argument supplied: {name!r}", param=name)
    if body.get("input") is not None and body.get("content") is not None:
        raise ApiError(400, "give 'input' or 'content', not both", param="content")
    param = "input" if body.get("input") is not None else "content"
    value = body.get(param)
    if isinstance(value, str) or (isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ApiError(400, f"'{param}' must be a string, a list of strings, a list of token ids, or a list of "
                            f"token id lists (not empty)", param=param)
    if len(value) > MAX_INPUTS:
        raise ApiError(400, f"'{param}' holds {len(value)} inputs; at most {MAX_INPUTS}", param=param)
    inputs = []
    for i, item in enumerate(value):
        if isinstance(item, str) and item:
            inputs.append(item)
        elif isinstance(item, list) and item:
            inputs.append(token_ids(item, param, n_vocab))
        else:
            raise ApiError(400, f"'{param}'[{i}] must be a non-empty string or list of token ids", param=param)
    encoding = typed_param(body, "encoding_format", str, "float")
    if encoding not in ENCODINGS:
        raise ApiError(400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    if body.get("dimensions") is not None:
        raise ApiError(400, "'dimensions' is not supported by this server: a vector has the model's width",
                       param="dimensions")
    typed_param(body, "user", str, None)
    return EmbeddingRequest(inputs, encoding, param)


def pool(rows: np.ndarray, pooling: str) -> np.ndarray:
    """One vector of a sequence's rows ([n_tokens, n_embd], the final normed hidden state, the
    sequence's first token first): their mean, the last row or the first (cls), L2-normalized
    (a zero vector stays zero), as float32."""
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2 or not len(rows):
        raise ValueError("pool needs rows of shape [n_tokens, n_embd], n_tokens >= 1")
    if pooling == "mean":
        v = rows.astype(np.float64).mean(axis=0)
    elif pooling == "last":
        v = rows[-1].astype(np.float64)
    elif pooling == "cls":
        v = rows[0].astype(np.float64)
    else:
        raise ValueError(f"pooling must be one of {', '.join(POOLING)}, not {pooling!r}")
    norm = np.linalg.norm(v)
    return (v / norm if norm > 0 else v).astype(np.float32)


def rows_wanted(n_tokens: int, pooling: str) -> list[bool]:
    """Which of a sequence's rows the pooling reads (a decode returns only those)."""
    if pooling == "mean":
        return [True] * n_tokens
    return [i == (n_tokens - 1 if pooling == "last" else 0) for i in range(n_tokens)]


def encode(vector: np.ndarray, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def reply(vectors: list[np.ndarray], model: str, n_prompt_tokens: int, encoding_format: str = "float") -> dict:
    """OpenAI's embeddings reply: a list of `embedding` objects in the inputs' order, and the usage."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v, encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_prompt_tokens, "total_tokens": n_prompt_tokens}}
