"""The OpenAI API's bodies, without I/O: a request body in, a typed request
out (or an ApiError naming the field, as OpenAI words it), and the objects a
reply is sent as (completion objects, stream chunks, usage, error bodies).

Nothing here reads a socket, the model or the clock (but new_completion_id's
random id): http_server.py moves the bytes, tokenizes and decodes.
"""
from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass

import jinja2

from coordinator.decode.values import DecodeResult
from coordinator.serving.chat_templates import ChatTemplate
from coordinator.text.sampling import Sampler

UNSUPPORTED = {  # OpenAI parameters this server does not implement: refused, not silently ignored
    "n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "logit_bias": None,
    "suffix": None, "tools": None, "tool_choice": None, "functions": None, "presence_penalty": 0,
    "frequency_penalty": 0,
}
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is up to the slot's context
BYTES_PER_TOKEN_BOUND = 64  # no vocabulary packs more bytes into one token: a longer text cannot fit
DECODE_FAILURE_STATUS = {DecodeResult.ENDPOINT_FAILED: 503, DecodeResult.ABORTED: 503,
                         DecodeResult.NO_KV_SLOT: 400, DecodeResult.INVALID_BATCH: 400}  # else 500


class ApiError(Exception):
    """An OpenAI-shaped error answer. `retry_after` (seconds) becomes a
    Retry-After header; every 429 and 503 carries one (1 s unless told)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: float | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after = 1 if retry_after is None and status in (429, 503) else retry_after
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response_headers(self) -> dict:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return headers


# ------------------------------------------------------------ typed requests
@dataclass(frozen=True)
class Generation:
    """What a completion or chat request asks besides its prompt."""
    max_tokens: int | None  # None (chat only): up to the slot's context
    sampler: Sampler
    stop: list[str]
    stream: bool
    include_usage: bool  # a stream's last chunk carries `usage` (stream_options.include_usage)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]  # text to tokenize, or token ids (checked against the vocabulary and the context)
    generation: Generation


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]  # each with a string `role` and a string `content` (text parts joined)
    generation: Generation


# ------------------------------------------------------------ parsing
def request_body(text: str) -> dict:
    """A request's JSON object. `model` may name anything (one model is
    served, any name gets it: llama-server's way), but must be a string."""
    try:
        body = json.loads(text)
    except ValueError:  # json.JSONDecodeError is one
        raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    return body


def typed_param(body: dict, name: str, kind: type, default, lo=None, hi=None):
    """body[name] as `kind` (a bool is no int; an int is a float), within lo..hi; `default` when absent or null."""
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, kind) and not (isinstance(v, bool) and kind is not bool)
    if kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok:
        raise ApiError(400, f"'{name}' must be of type {kind.__name__}", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}", param=name)
    return v


def token_ids(value, name: str, n_vocab: int) -> list[int]:
    """A list of token ids, each in the vocabulary."""
    if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise ApiError(400, f"'{name}' must be a list of token ids", param=name)
    bad = next((t for t in value if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} in '{name}' is outside the vocabulary (0..{n_vocab - 1})", param=name)
    return value


def check_fits(n_prompt: int, max_tokens: int, n_ctx_slot: int, param: str = "prompt") -> None:
    if n_prompt + max_tokens > n_ctx_slot:
        raise ApiError(400, f"prompt of {n_prompt} tokens plus max_tokens {max_tokens} exceeds the context of "
                            f"{n_ctx_slot} tokens per slot", param=param, code="context_length_exceeded")


def check_text_fits(text: str, n_ctx_slot: int, param: str = "prompt") -> None:
    """Refuse a text too long for the context before it is tokenized (which takes seconds for a megabyte)."""
    if len(text.encode("utf-8", "surrogatepass")) > BYTES_PER_TOKEN_BOUND * n_ctx_slot:
        raise ApiError(400, f"prompt of {len(text)} characters cannot fit the context of {n_ctx_slot} tokens "
                            f"per slot", param=param, code="context_length_exceeded")


def parse_generation(body: dict, default_max_tokens: int | None, n_ctx_slot: int) -> Generation:
    for name, neutral in UNSUPPORTED.items():
        if body.get(name, neutral) not in (neutral, None):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise ApiError(400, "'response_format' other than {\"type\": \"text\"} is not supported",
                       param="response_format")
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body = dict(body, max_tokens=body["max_completion_tokens"])
    max_tokens = typed_param(body, "max_tokens", int, default_max_tokens, 1, n_ctx_slot)
    temperature = typed_param(body, "temperature", float, 1.0, 0.0, 2.0)
    top_p = typed_param(body, "top_p", float, 1.0, 1e-6, 1.0)
    top_k = typed_param(body, "top_k", int, 0, 0, 1 << 20)
    seed = typed_param(body, "seed", int, None)
    stream = typed_param(body, "stream", bool, False)
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    if seed is not None and not 0 <= seed < 2**63:
        raise ApiError(400, "'seed' must be between 0 and 2**63 - 1", param="seed")
    try:
        sampler = Sampler(temperature, top_k, top_p, seed)
    except ValueError as exc:  # NaN, and whatever else the sampler refuses
        raise ApiError(400, str(exc)) from None
    return Generation(max_tokens, sampler, stop, stream, _include_usage(body, stream))


def _include_usage(body: dict, stream: bool) -> bool:
    """include_usage: a last chunk with `usage` and no choices (OpenAI's);
    without `stream` the answer has `usage` anyway."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}",
                       param="stream_options")
    return stream and options.get("include_usage", False)


def parse_prompt(prompt, n_vocab: int) -> str | list[int]:
    """A string, a list of token ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return token_ids(prompt, "prompt", n_vocab)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; this server answers one prompt per request: "
                            f"send each in a request of its own", param="prompt")
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list holding one of those",
                   param="prompt")


def parse_completion(body: dict, n_vocab: int, n_ctx_slot: int) -> CompletionRequest:
    """A /v1/completions body (from request_body). A prompt of token ids is
    checked to fit here; a text prompt once tokenized (check_text_fits, check_fits)."""
    prompt = parse_prompt(body.get("prompt"), n_vocab)
    generation = parse_generation(body, COMPLETION_MAX_TOKENS, n_ctx_slot)
    if not isinstance(prompt, str):
        check_fits(len(prompt), generation.max_tokens, n_ctx_slot)
    return CompletionRequest(prompt, generation)


def text_message(i: int, m):
    """A message with `content` as text: a list of parts becomes its text
    parts joined; any other part type is refused by name."""
    if not isinstance(m, dict) or not isinstance(m.get("content"), list):
        return m
    texts = []
    for part in m["content"]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ApiError(400, f"messages[{i}].content: parts of type {kind!r} are not supported; this server "
                                f"takes text parts only", param="messages")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"messages[{i}].content: a text part needs a string 'text'", param="messages")
        texts.append(part["text"])
    return dict(m, content="".join(texts))


def parse_messages(messages) -> list[dict]:
    if isinstance(messages, list):
        messages = [text_message(i, m) for i, m in enumerate(messages)]
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    return messages


def parse_chat(body: dict, n_ctx_slot: int) -> ChatRequest:
    """A /v1/chat/completions body (from request_body). Chat clients leave
    max_tokens out expecting the whole answer: then it is None, up to the slot's context."""
    messages = parse_messages(body.get("messages"))
    return ChatRequest(messages, parse_generation(body, None, n_ctx_slot))


def chat_prompt(chat: ChatTemplate, messages: list[dict], bos_token: str, eos_token: str) -> str:
    """The messages rendered by the chat template, ready for the assistant's answer."""
    try:
        return chat.template.render(messages=messages, add_generation_prompt=True, bos_token=bos_token,
                                    eos_token=eos_token)
    except jinja2.TemplateError as exc:  # e.g. the template's raise_exception("roles must alternate")
        raise ApiError(400, f"the chat template ({chat.name}) refused the messages: {exc}",
                       param="messages") from None


# ------------------------------------------------------------ refusals of a valid request
def model_not_found(wanted: str, served: str) -> ApiError:
    return ApiError(404, f"model {wanted!r} not found; this server serves {served!r}", param="model",
                    code="model_not_found")


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", "server_error", retry_after=5)


def decode_loop_stopped() -> ApiError:
    return ApiError(503, "the decode loop is not running", "server_error", retry_after=10)


def worker_unavailable(endpoint: str, cause, retry_after: float) -> ApiError:
    return ApiError(503, f"worker {endpoint} unavailable: {cause}", "server_error", retry_after=retry_after)


def server_busy(n_slots: int, waiting: int, max_queue: int | None, retry_after: float) -> ApiError:
    return ApiError(429, f"server busy: all {n_slots} slots are in use and {waiting} requests already wait for "
                         f"one (--max-queue {max_queue}); retry later", "server_busy", code="rate_limit_exceeded",
                    retry_after=retry_after)


def decode_failed(message: str, code: DecodeResult | None, retry_after: float) -> ApiError:
    """A failed decode of a request not streamed: 503 (worker unreachable or timed out; Retry-After
    `retry_after`), 400 (context full, invalid batch), 500 (compute failed)."""
    status = DECODE_FAILURE_STATUS.get(code, 500)
    return ApiError(status, message, "server_error", code=code.name if code is not None else None,
                    retry_after=retry_after if status == 503 else None)


# ------------------------------------------------------------ replies
def new_completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def choice(text: str, finish_reason: str | None, chat: bool, stream: bool) -> dict:
    if chat:
        key = "delta" if stream else "message"
        return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish_reason}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


@dataclass(frozen=True)
class CompletionReply:
    """The reply to one completion or chat request: what every object it is
    sent as (whole, or chunk by chunk) carries."""
    id: str
    created: int
    model: str
    chat: bool

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def completion(self, text: str, finish_reason: str | None, n_prompt: int, n_completion: int) -> dict:
        """The whole answer (not streamed)."""
        return dict(self._head("chat.completion" if self.chat else "text_completion"),
                    choices=[choice(text, finish_reason, self.chat, False)], usage=usage(n_prompt, n_completion))

    def chunk(self, text: str, finish_reason: str | None = None, include_usage: bool = False) -> dict:
        """A stream's chunk: a piece of text, or (with a finish_reason) the end. Under
        include_usage every chunk but the usage chunk has `usage` null, as OpenAI's."""
        body = dict(self._head("chat.completion.chunk" if self.chat else "text_completion"),
                    choices=[choice(text, finish_reason, self.chat, True)])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, n_prompt: int, n_completion: int) -> dict:
        """The last chunk under include_usage: no choices, the usage."""
        return dict(self._head("chat.completion.chunk" if self.chat else "text_completion"), choices=[],
                    usage=usage(n_prompt, n_completion))


def stream_error(message: str, code: DecodeResult | None, endpoint: str | None) -> dict:
    """The event that ends a stream whose decode failed."""
    return {"error": {"message": message, "type": "server_error", "code": code.name if code is not None else None,
                      "endpoint": endpoint}}


def model_object(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "ggml-distributed"}


def model_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_object(model, created)]}
