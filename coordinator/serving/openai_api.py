"""The OpenAI API's bodies, without I/O: a request body in, a typed request
out (or an ApiError naming the field, as OpenAI words it), and the objects a
reply is sent as (completion objects, stream chunks, usage, logprobs, error
bodies). FIELDS is the one table of every request field OpenAI or
llama-server documents and what is done with it (docs/operations.md shows it).

Nothing here reads a socket, the model or the clock (but new_completion_id's
random id): http_server.py moves the bytes, tokenizes and decodes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

import jinja2

from coordinator.decode.values import DecodeResult
from coordinator.serving import structured_output, tools as tool_requests
from coordinator.serving.chat_templates import ChatTemplate
from coordinator.text import tool_calls
from coordinator.text.sampling import Sampler, TokenLogprob

# ------------------------------------------------------------ the request fields
CHAT, COMPLETIONS, BOTH = "chat", "completions", "both"  # the endpoints a field belongs to
HONOURED, ACCEPTED, REFUSED = "honoured", "accepted", "refused"


@dataclass(frozen=True)
class Field:
    """A request field OpenAI or llama-server documents, and what this server
    does with it: `honoured` (it does what the field asks), `accepted` (a hint
    that changes nothing here, for the reason given; type-checked), or `refused`
    (a 400 naming it and the reason, unless its value is null or one of
    `neutral`, which ask for nothing). docs/operations.md's request-field table
    is `field_table()`, line for line (tests/serving/test_request_fields.py)."""
    name: str
    endpoints: str  # CHAT, COMPLETIONS or BOTH
    status: str  # HONOURED, ACCEPTED or REFUSED
    note: str  # what it does here, or why it is refused
    neutral: tuple = ()  # REFUSED: values that ask for nothing and are taken
    kind: type | tuple | None = None  # ACCEPTED: the JSON type its value must have

    def endpoint_text(self) -> str:
        return {CHAT: "chat", COMPLETIONS: "completions", BOTH: "both"}[self.endpoints]

    def status_text(self) -> str:
        if self.status != REFUSED or not self.neutral:
            return self.status
        return "refused unless " + " or ".join(f"`{json.dumps(v)}`" for v in self.neutral)


def _fields(*fields: Field) -> dict[str, Field]:
    return {f.name: f for f in fields}


FIELDS = _fields(
    # ---- what a request is
    Field("model", BOTH, HONOURED, "any name: the one model served answers, and the reply's `model` names it"),
    Field("prompt", COMPLETIONS, HONOURED, "a string, a list of token ids, or a list holding one of those"),
    Field("messages", CHAT, HONOURED, "rendered by the chat template; `content` a string or text parts; history's "
                                      "assistant `tool_calls` (`content` null) and `tool` messages (`tool_call_id`)"),
    Field("stream", BOTH, HONOURED, "Server-Sent Events, `data: [DONE]` last"),
    Field("stream_options", BOTH, HONOURED, "`include_usage`: a last chunk with `usage` and no choices"),
    # ---- how much
    Field("max_tokens", BOTH, HONOURED, "completions default 16, chat the rest of the slot's context"),
    Field("max_completion_tokens", BOTH, HONOURED, "`max_tokens` under its newer name"),
    Field("n_predict", BOTH, HONOURED, "llama-server's `max_tokens`; -1: the rest of the slot's context"),
    Field("stop", BOTH, HONOURED, "up to 4 strings; the text ends before the first"),
    Field("ignore_eos", BOTH, HONOURED, "the end-of-generation tokens are never drawn (a -inf bias)"),
    # ---- sampling (coordinator/text/sampling.py: llama.cpp's samplers and order)
    Field("temperature", BOTH, HONOURED, "0..2, default 1; 0 takes the most likely token (after bias and penalties)"),
    Field("top_k", BOTH, HONOURED, "default 0: no limit"),
    Field("top_p", BOTH, HONOURED, "default 1"),
    Field("min_p", BOTH, HONOURED, "default 0"),
    Field("typical_p", BOTH, HONOURED, "default 1"),
    Field("min_keep", BOTH, HONOURED, "the least each filter keeps (at least 1)"),
    Field("repeat_penalty", BOTH, HONOURED, "default 1 (off)"),
    Field("repeat_last_n", BOTH, HONOURED, "the tokens the penalties look back at, prompt included; default 64, "
                                           "-1 all, 0 none"),
    Field("frequency_penalty", BOTH, HONOURED, "-2..2, default 0"),
    Field("presence_penalty", BOTH, HONOURED, "-2..2, default 0"),
    Field("logit_bias", BOTH, HONOURED, "`{\"id\": bias}` or llama-server's `[[id, bias], ...]`; `false` bans a "
                                        "token; token ids only"),
    Field("seed", BOTH, HONOURED, "the same seed, the same text; choice i of `n` draws with seed + i"),
    # ---- what comes back
    Field("n", BOTH, HONOURED, "1..64 choices; they share the prompt's KV rows when they start together"),
    Field("n_cmpl", BOTH, HONOURED, "llama-server's `n`"),
    Field("logprobs", BOTH, HONOURED, "chat: `true`; completions: 0..20 alternatives; `false`/null: none. The "
                                      "model's own log-probabilities (before bias, penalties and temperature)"),
    Field("top_logprobs", CHAT, HONOURED, "0..20 alternatives per token; needs `logprobs: true`"),
    Field("echo", COMPLETIONS, HONOURED, "the prompt before the completion, with its logprobs when asked"),
    Field("best_of", COMPLETIONS, REFUSED, "ranking choices by their logprobs is not done: ask `n` and rank them",
          neutral=(1,)),
    Field("suffix", COMPLETIONS, REFUSED, "fill-in-the-middle is /infill's (`input_prefix`, `input_suffix`), "
                                          "for a model with FIM tokens", neutral=("",)),
    Field("response_format", BOTH, HONOURED, "`text`, `json_object`, or `json_schema` (`json_schema.schema`; "
                                             "always strict): the output parses and conforms (llguidance)"),
    # ---- tools, modalities, reasoning
    Field("tools", CHAT, HONOURED, "function tools (`parameters` a JSON schema), rendered by the chat template when "
                                   "it takes `tools`, else described in a system message (Hermes's `<tool_call>`); "
                                   "calls in the answer come back as `tool_calls`, `finish_reason` `tool_calls`"),
    Field("tool_choice", CHAT, HONOURED, "`auto` (the default with tools), `none` (no tools rendered), `required` or "
                                         "`{\"type\": \"function\", \"function\": {\"name\": ...}}`: the call is "
                                         "forced by a grammar, its arguments following the schema (llguidance)"),
    Field("functions", CHAT, REFUSED, "the deprecated form of `tools`: send `tools`", neutral=([],)),
    Field("function_call", CHAT, REFUSED, "the deprecated form of `tool_choice`: send `tool_choice`",
          neutral=("none",)),
    Field("parallel_tool_calls", CHAT, HONOURED, "default false (llama-server's): one call at most in an answer; "
                                                 "true: several (a forced `required` call may be followed by more)"),
    Field("parse_tool_calls", CHAT, ACCEPTED, "calls are parsed whenever there are `tools` and `tool_choice` is "
                                              "not `none`", kind=bool),
    Field("audio", CHAT, REFUSED, "text only"),
    Field("modalities", CHAT, REFUSED, "text only", neutral=(["text"],)),
    Field("prediction", CHAT, REFUSED, "no predicted outputs"),
    Field("web_search_options", CHAT, REFUSED, "no web search"),
    Field("reasoning_effort", CHAT, REFUSED, "no reasoning controls; a template's own switch goes in "
                                             "`chat_template_kwargs`"),
    Field("reasoning_format", CHAT, REFUSED, "reasoning is never parsed out of the text", neutral=("none",)),
    Field("reasoning_control", CHAT, REFUSED, "no reasoning controls", neutral=(False,)),
    Field("verbosity", CHAT, REFUSED, "no reasoning controls"),
    Field("moderation", CHAT, REFUSED, "no moderation"),
    Field("chat_template_kwargs", CHAT, HONOURED, "extra variables for the chat template, e.g. "
                                                 "`{\"enable_thinking\": false}`"),
    # ---- OpenAI's account features
    Field("user", BOTH, ACCEPTED, "an end-user id for OpenAI's abuse monitoring; nothing to monitor here", kind=str),
    Field("safety_identifier", CHAT, ACCEPTED, "as `user`", kind=str),
    Field("metadata", CHAT, ACCEPTED, "tags for stored completions; none are stored", kind=dict),
    Field("store", CHAT, REFUSED, "completions are not stored", neutral=(False,)),
    Field("service_tier", CHAT, REFUSED, "one tier", neutral=("auto", "default")),
    Field("prompt_cache_key", CHAT, ACCEPTED, "a caching hint; the prompt cache (`cache_prompt`) needs none: a free slot sharing "
                                                "the longest prefix is chosen", kind=str),
    Field("prompt_cache_retention", CHAT, ACCEPTED, "as `prompt_cache_key`", kind=str),
    Field("prompt_cache_options", CHAT, ACCEPTED, "as `prompt_cache_key`", kind=dict),
    # ---- llama-server's /completion options
    Field("cache_prompt", BOTH, HONOURED, "default true: the KV rows of the prompt's longest prefix a free slot "
                                          "holds are reused, the rest decoded (`usage.prompt_tokens_details."
                                          "cached_tokens`); false: the whole prompt is decoded"),
    Field("n_cache_reuse", BOTH, ACCEPTED, "no reuse of chunks past the common prefix (KV shifting); "
                                           "`cache_prompt` reuses the prefix", kind=int),
    Field("n_keep", BOTH, HONOURED, "with `--context-shift`, the prompt tokens a context shift keeps (default 0; "
                                    "-1: the whole prompt; plus BOS, as llama-server counts); without it the "
                                    "context is never shifted"),
    Field("id_slot", BOTH, REFUSED, "the scheduler picks the slot", neutral=(-1,)),
    Field("n_indent", BOTH, REFUSED, "no indentation stop", neutral=(0,)),
    Field("t_max_predict_ms", BOTH, REFUSED, "no time limit", neutral=(0,)),
    Field("dynatemp_range", BOTH, REFUSED, "no dynamic temperature", neutral=(0,)),
    Field("dynatemp_exponent", BOTH, ACCEPTED, "no effect while `dynatemp_range` is 0", kind=(int, float)),
    Field("mirostat", BOTH, REFUSED, "no Mirostat", neutral=(0,)),
    Field("mirostat_tau", BOTH, ACCEPTED, "no effect while `mirostat` is 0", kind=(int, float)),
    Field("mirostat_eta", BOTH, ACCEPTED, "no effect while `mirostat` is 0", kind=(int, float)),
    Field("dry_multiplier", BOTH, REFUSED, "no DRY", neutral=(0,)),
    Field("dry_base", BOTH, ACCEPTED, "no effect while `dry_multiplier` is 0", kind=(int, float)),
    Field("dry_allowed_length", BOTH, ACCEPTED, "no effect while `dry_multiplier` is 0", kind=int),
    Field("dry_penalty_last_n", BOTH, ACCEPTED, "no effect while `dry_multiplier` is 0", kind=int),
    Field("dry_sequence_breakers", BOTH, ACCEPTED, "no effect while `dry_multiplier` is 0", kind=list),
    Field("xtc_probability", BOTH, REFUSED, "no XTC", neutral=(0,)),
    Field("xtc_threshold", BOTH, ACCEPTED, "no effect while `xtc_probability` is 0", kind=(int, float)),
    Field("top_n_sigma", BOTH, REFUSED, "no top-n-sigma", neutral=(-1,)),
    Field("samplers", BOTH, REFUSED, "the order is fixed: penalties, top_k, typical_p, top_p, min_p, temperature"),
    Field("grammar", BOTH, HONOURED, "a GBNF grammar the output follows (llguidance); `\"\"`: none"),
    Field("json_schema", BOTH, HONOURED, "a JSON schema the output conforms to (llguidance)"),
    Field("n_probs", BOTH, REFUSED, "/completion and /infill: honoured (`completion_probabilities`); here ask "
                                    "`logprobs` (and `top_logprobs`)", neutral=(0,)),
    Field("post_sampling_probs", BOTH, REFUSED, "logprobs are the model's own", neutral=(False,)),
    Field("return_tokens", BOTH, REFUSED, "/completion's `tokens` field is not in these replies", neutral=(False,)),
    Field("timings_per_token", BOTH, REFUSED, "no timings in replies", neutral=(False,)),
    Field("return_progress", BOTH, REFUSED, "no prompt progress events", neutral=(False,)),
    Field("sse_ping_interval", BOTH, REFUSED, "no SSE pings"),
    Field("response_fields", BOTH, REFUSED, "replies have OpenAI's shape", neutral=([],)),
    Field("lora", BOTH, REFUSED, "no LoRA adapters", neutral=([],)),
)
MAX_CHOICES = 64  # n: at most this many choices (OpenAI allows 128)
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs bound)
MAX_SHIFTED_TOKENS = 1 << 20  # --context-shift: max_tokens may pass the slot's context, up to this
# what chat_template_kwargs may not set: the server does
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token")


def field_table() -> list[str]:
    """docs/operations.md's request-field table, as Markdown lines."""
    lines = ["| field | endpoint | status | here |", "| --- | --- | --- | --- |"]
    for f in FIELDS.values():
        lines.append(f"| `{f.name}` | {f.endpoint_text()} | {f.status_text()} | {f.note} |")
    return lines


def check_fields(body: dict, endpoint: str, path: str | None = None) -> None:
    """Every field of `body` is one this endpoint knows, and not one it refuses
    (null is as absent). The first offending field, in the body's order, is named.
    `path`: the route the body came to (llama-server's /completion takes COMPLETIONS' fields)."""
    path = path or ("/v1/chat/completions" if endpoint == CHAT else "/v1/completions")
    for name, value in body.items():
        f = FIELDS.get(name)
        if f is None:
            raise ApiError(400, f"unrecognized request argument supplied: {name!r} (docs/operations.md lists "
                                f"the fields this server knows)", param=name)
        if value is None:
            continue
        if f.endpoints not in (BOTH, endpoint):
            other = "/v1/completions" if endpoint == CHAT else "/v1/chat/completions"
            raise ApiError(400, f"'{name}' is a field of {other}, not of {path}", param=name)
        if f.status == REFUSED and not any(_same(value, v) for v in f.neutral):
            raise ApiError(400, f"'{name}' is not supported by this server: {f.note}", param=name)
        if f.status == ACCEPTED and f.kind is not None and (
                not isinstance(value, f.kind) or (isinstance(value, bool) and f.kind is not bool)):
            kinds = f.kind if isinstance(f.kind, tuple) else (f.kind,)
            raise ApiError(400, f"'{name}' must be of type {' or '.join(k.__name__ for k in kinds)}", param=name)


def _same(value, neutral) -> bool:
    """JSON equality: 0 is 0.0, but false is not 0."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return isinstance(value, bool) and isinstance(neutral, bool) and value == neutral
    return value == neutral


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
    max_tokens: int | None  # None: up to the slot's context (chat's default, n_predict -1)
    sampler: Sampler  # the settings, validated; each choice draws with a fork of it (samplers())
    stop: list[str]
    stream: bool
    include_usage: bool  # a stream's last chunk carries `usage` (stream_options.include_usage)
    n: int = 1  # choices
    logprobs: int | None = None  # alternatives shown per token (0: the chosen token's alone); None: no logprobs
    echo: bool = False  # completions: the prompt comes first in the text (and its logprobs)
    ignore_eos: bool = False
    cache_prompt: bool = True  # reuse the KV rows of the prompt's prefix a slot holds (llama-server's default)
    grammar: str | None = None  # structured output: the llguidance grammar (serving/structured_output.py)
    n_keep: int = 0  # the prompt tokens a context shift keeps (-1: all of them); only with --context-shift

    def samplers(self, eog_ids=()) -> list[Sampler]:
        """One sampler per choice: choice i draws with seed + i (a random seed each
        without one); with ignore_eos the end-of-generation tokens `eog_ids` are banned."""
        seed = self.sampler.seed
        ban = tuple(eog_ids) if self.ignore_eos else ()
        return [self.sampler.fork(None if seed is None else seed + i, ban) for i in range(self.n)]


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]  # text to tokenize, or token ids (checked against the vocabulary and the context)
    generation: Generation


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]  # each with a string `role` and a string `content` (text parts joined)
    generation: Generation
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs: more variables for the template
    tools: tool_requests.Tools = tool_requests.Tools()  # tools, tool_choice, parallel_tool_calls


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
        span = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise ApiError(400, f"'{name}' must be {span}", param=name)
    return v


def token_ids(value, name: str, n_vocab: int) -> list[int]:
    """A list of token ids, each in the vocabulary."""
    if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise ApiError(400, f"'{name}' must be a list of token ids", param=name)
    bad = next((t for t in value if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} in '{name}' is outside the vocabulary (0..{n_vocab - 1})", param=name)
    return value


def check_fits(n_prompt: int, max_tokens: int, n_ctx_slot: int, param: str = "prompt",
               context_shift: bool = False) -> None:
    """The prompt and max_tokens new tokens fit a slot's context. With `context_shift` (serve's
    --context-shift) max_tokens may pass it, the prompt alone must leave room for a token (as
    llama-server: a prompt is never truncated, a too-long one is refused)."""
    if context_shift:
        if n_prompt >= n_ctx_slot:
            raise ApiError(400, f"prompt of {n_prompt} tokens exceeds the context of {n_ctx_slot} tokens per slot "
                                f"(a context shift moves generated tokens; the prompt must fit with one more "
                                f"token)", param=param, code="context_length_exceeded")
        return
    if n_prompt + max_tokens > n_ctx_slot:
        raise ApiError(400, f"prompt of {n_prompt} tokens plus max_tokens {max_tokens} exceeds the context of "
                            f"{n_ctx_slot} tokens per slot", param=param, code="context_length_exceeded")


def check_text_fits(text: str, n_ctx_slot: int, param: str = "prompt") -> None:
    """Refuse a text too long for the context before it is tokenized (which takes seconds for a megabyte)."""
    if len(text.encode("utf-8", "surrogatepass")) > BYTES_PER_TOKEN_BOUND * n_ctx_slot:
        raise ApiError(400, f"prompt of {len(text)} characters cannot fit the context of {n_ctx_slot} tokens "
                            f"per slot", param=param, code="context_length_exceeded")


def parse_generation(body: dict, default_max_tokens: int | None, n_ctx_slot: int, endpoint: str = COMPLETIONS,
                     n_vocab: int | None = None, limit: int | None = None,
                     context_shift: bool = False) -> Generation:
    """The generation fields of a body whose fields check_fields has passed. `limit`: serve's
    -n/--n-predict, the most tokens a request generates and what it gets when it asks no number.
    `context_shift` (serve's --context-shift): max_tokens may pass the slot's context."""
    max_tokens = _max_tokens(body, default_max_tokens, MAX_SHIFTED_TOKENS if context_shift else n_ctx_slot, limit)
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
    settings = dict(
        min_p=typed_param(body, "min_p", float, 0.0, 0.0, 1.0),
        typical_p=typed_param(body, "typical_p", float, 1.0, 0.0, 1.0),
        repeat_penalty=typed_param(body, "repeat_penalty", float, 1.0, 1e-6),
        repeat_last_n=typed_param(body, "repeat_last_n", int, 64, -1, 1 << 20),
        frequency_penalty=typed_param(body, "frequency_penalty", float, 0.0, -2.0, 2.0),
        presence_penalty=typed_param(body, "presence_penalty", float, 0.0, -2.0, 2.0),
        min_keep=typed_param(body, "min_keep", int, 0, 0, 1 << 20),
        logit_bias=parse_logit_bias(body.get("logit_bias"), n_vocab))
    ignore_eos = typed_param(body, "ignore_eos", bool, False)
    cache_prompt = typed_param(body, "cache_prompt", bool, True)
    n_keep = typed_param(body, "n_keep", int, 0)  # any negative: the whole prompt, as llama-server
    n = typed_param(body, "n", int, None, 1, MAX_CHOICES)
    n_cmpl = typed_param(body, "n_cmpl", int, None, 1, MAX_CHOICES)
    if n is not None and n_cmpl is not None and n != n_cmpl:
        raise ApiError(400, f"'n' ({n}) and 'n_cmpl' ({n_cmpl}) disagree: give one", param="n_cmpl")
    logprobs = _logprobs(body, endpoint)
    echo = typed_param(body, "echo", bool, False)
    try:
        grammar = structured_output.grammar_of(body, ignore_eos)
    except structured_output.Refused as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    try:
        sampler = Sampler(temperature, top_k, top_p, seed, **settings)
    except ValueError as exc:  # NaN, and whatever else the sampler refuses
        raise ApiError(400, str(exc)) from None
    return Generation(max_tokens, sampler, stop, stream, _include_usage(body, stream), n or n_cmpl or 1, logprobs,
                      echo, ignore_eos, cache_prompt, grammar, n_keep=n_keep)


def _max_tokens(body: dict, default: int | None, n_ctx_slot: int, limit: int | None = None) -> int | None:
    """max_tokens, else max_completion_tokens, else llama-server's n_predict (-1: no limit, None);
    at most `limit`, and `limit` when none is given (llama-server's -n)."""
    wanted = _wanted_tokens(body, default, n_ctx_slot)
    if limit is None:
        return wanted
    asked = any(body.get(k) is not None for k in ("max_tokens", "max_completion_tokens", "n_predict"))
    return limit if wanted is None or not asked else min(wanted, limit)


def _wanted_tokens(body: dict, default: int | None, n_ctx_slot: int) -> int | None:
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body = dict(body, max_tokens=body["max_completion_tokens"])
    max_tokens = typed_param(body, "max_tokens", int, None, 1, n_ctx_slot)
    n_predict = typed_param(body, "n_predict", int, None, -1, n_ctx_slot)
    if n_predict == 0:
        raise ApiError(400, f"'n_predict' must be -1 (no limit) or between 1 and {n_ctx_slot}", param="n_predict")
    if n_predict is None:
        return default if max_tokens is None else max_tokens
    if max_tokens is not None and max_tokens != n_predict:
        raise ApiError(400, f"'n_predict' ({n_predict}) and 'max_tokens' ({max_tokens}) disagree: give one",
                       param="n_predict")
    return None if n_predict == -1 else n_predict


def _logprobs(body: dict, endpoint: str) -> int | None:
    """Alternatives shown per token, or None for no logprobs. Chat: logprobs true,
    top_logprobs 0..20; completions: logprobs 0..20. `false` is no logprobs."""
    value = body.get("logprobs")
    if endpoint == CHAT:
        wanted = typed_param(body, "logprobs", bool, False)
        top = typed_param(body, "top_logprobs", int, None, 0, MAX_LOGPROBS)
        if top is not None and not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if wanted else None
    if value is None or value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, "'logprobs' must be an integer (alternatives per token, 0..20) on /v1/completions",
                       param="logprobs")
    return typed_param(body, "logprobs", int, None, 0, MAX_LOGPROBS)


def parse_logit_bias(value, n_vocab: int | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} or llama-server's [[id, bias], ...]; a bias of
    false bans the token (-inf). Token ids only: a token's text is refused."""
    if value is None:
        return {}
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise ApiError(400, "'logit_bias' must be an object {\"token id\": bias} or a list [[token id, bias], ...]",
                       param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in items:
        token = key
        if isinstance(key, str):
            try:
                token = int(key)
            except ValueError:
                token = None
        if isinstance(token, bool) or not isinstance(token, int):
            raise ApiError(400, f"'logit_bias': {key!r} is not a token id (token texts are not taken: give ids, "
                                f"e.g. from /tokenize)", param="logit_bias")
        if not 0 <= token < (n_vocab if n_vocab is not None else 2**31):
            raise ApiError(400, f"token id {token} in 'logit_bias' is outside the vocabulary "
                                f"(0..{(n_vocab or 2**31) - 1})", param="logit_bias")
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise ApiError(400, f"'logit_bias': the bias of token {token} must be a number, or false to ban it",
                           param="logit_bias")
        out[token] = out.get(token, 0.0) + float(bias)
    return out


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


def parse_completion(body: dict, n_vocab: int, n_ctx_slot: int, limit: int | None = None,
                     context_shift: bool = False) -> CompletionRequest:
    """A /v1/completions body (from request_body). A prompt of token ids is
    checked to fit here; a text prompt once tokenized (check_text_fits, check_fits).
    `limit`: serve's -n, `context_shift`: its --context-shift (parse_generation)."""
    prompt = parse_prompt(body.get("prompt"), n_vocab)
    check_fields(body, COMPLETIONS)
    generation = parse_generation(body, COMPLETION_MAX_TOKENS, n_ctx_slot, COMPLETIONS, n_vocab, limit,
                                  context_shift)
    if not isinstance(prompt, str):
        check_fits(len(prompt), generation.max_tokens or 1, n_ctx_slot, context_shift=context_shift)
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
    """Each a {role, content} (an assistant's content may be null when it holds `tool_calls`)."""
    if isinstance(messages, list):
        messages = [text_message(i, m) for i, m in enumerate(messages)]
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and (isinstance(m.get("content"), str) or tool_requests.is_call_message(m)) for m in messages)):
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    try:
        tool_requests.check_history(messages)
    except tool_requests.Refused as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    return messages


def parse_chat(body: dict, n_ctx_slot: int, n_vocab: int | None = None, limit: int | None = None,
               call_format: str = tool_calls.HERMES, context_shift: bool = False) -> ChatRequest:
    """A /v1/chat/completions body (from request_body). Chat clients leave
    max_tokens out expecting the whole answer: then it is None, up to the slot's context.
    `call_format`: the format a forced tool call is written in (tools.call_format of the template)."""
    messages = parse_messages(body.get("messages"))
    check_fields(body, CHAT)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    taken = [k for k in TEMPLATE_VARIABLES if k in kwargs]
    if taken:
        raise ApiError(400, f"'chat_template_kwargs' may not set {', '.join(taken)}: the server does",
                       param="chat_template_kwargs")
    generation = parse_generation(body, None, n_ctx_slot, CHAT, n_vocab, limit, context_shift)
    try:
        tools = tool_requests.parse(body)
        grammar = tool_requests.grammar(tools, call_format)
    except tool_requests.Refused as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    if grammar is not None:
        if generation.grammar is not None:
            raise ApiError(400, "'tool_choice' forces a call, and the output cannot also follow 'response_format', "
                                "'grammar' or 'json_schema': give one", param="tool_choice")
        if generation.ignore_eos:
            raise ApiError(400, "'ignore_eos' cannot be used with a forced tool call ('tool_choice'): the output "
                                "ends where the call does", param="ignore_eos")
        generation = dataclasses.replace(generation, grammar=grammar)
    return ChatRequest(messages, generation, kwargs, tools)


def chat_prompt(chat: ChatTemplate, messages: list[dict], bos_token: str, eos_token: str,
                template_kwargs: dict | None = None, tools: tool_requests.Tools | None = None) -> str:
    """The messages rendered by the chat template, ready for the assistant's answer; with
    the request's tools (serving/tools.py: the template's own way, else the built-in one)."""
    messages, extra = tool_requests.template_input(chat, messages, tools or tool_requests.Tools())
    try:
        return chat.template.render(dict(template_kwargs or {}, **extra, messages=messages,
                                         add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token))
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


def usage(n_prompt: int, n_completion: int, n_cached: int = 0) -> dict:
    """`n_cached`: prompt tokens whose KV rows a slot already held (the prompt cache), counted in n_prompt too."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": n_cached}}


def choice(text: str, finish_reason: str | None, chat: bool, stream: bool, index: int = 0,
           logprobs: dict | None = None) -> dict:
    if chat:
        key = "delta" if stream else "message"
        return {"index": index, key: {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_object(call: tool_calls.ToolCall) -> dict:
    """A call as `message.tool_calls[i]`: arguments as JSON text; the model's id if it wrote one."""
    return {"id": call.id or new_call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_choice(parsed: tool_calls.Parsed, index: int = 0, logprobs: dict | None = None) -> dict:
    """A whole chat choice whose answer is calls: `content` the text before them (or null)."""
    return {"index": index, "message": {"role": "assistant", "content": parsed.content,
                                        "tool_calls": [tool_call_object(c) for c in parsed.calls]},
            "logprobs": logprobs, "finish_reason": "tool_calls"}


def tool_call_deltas(calls: Sequence[tool_calls.ToolCall]) -> list[dict]:
    """A stream's deltas of these calls, as OpenAI sends them: per call, its index, id, type and
    name with empty arguments, then its arguments."""
    deltas = []
    for i, call in enumerate(calls):
        head = tool_call_object(call)
        deltas.append({"role": "assistant", "content": None, "tool_calls": [
            {"index": i, "id": head["id"], "type": "function", "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
    return deltas


def token_text(piece: bytes) -> str:
    """A token's text as OpenAI shows it: its UTF-8, or `bytes:\\xNN...` for part of a character."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def chat_logprobs(entries: Sequence[TokenLogprob], piece: Callable[[int], bytes]) -> dict:
    """choices[].logprobs of a chat reply or chunk: `content`, one entry per token.
    `piece(id)`: a token's bytes."""
    def one(token: int, logprob: float) -> dict:
        p = piece(token)
        return {"token": token_text(p), "logprob": logprob, "bytes": list(p)}
    return {"content": [dict(one(e.token, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top])
                        for e in entries], "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], piece: Callable[[int], bytes], base: int = 0,
                        prompt: Sequence[TokenLogprob] = ()) -> dict:
    """choices[].logprobs of a completion: tokens, token_logprobs, top_logprobs
    (text -> logprob; null where there is no logprob: a prompt's first token) and
    text_offset (characters of the choice's text before the token). `prompt`: the
    echoed prompt's entries, first; `base` is added to the offsets of `entries`
    (the echoed prompt's length)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e, shift in [(e, 0) for e in prompt] + [(e, base) for e in entries]:
        tokens.append(token_text(piece(e.token)))
        lps.append(e.logprob)
        tops.append(None if e.logprob is None else {token_text(piece(t)): lp for t, lp in e.top})
        offsets.append(e.offset + shift)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


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

    def completion(self, text: str, finish_reason: str | None, n_prompt: int, n_completion: int,
                   logprobs: dict | None = None, n_cached: int = 0) -> dict:
        """The whole answer (not streamed), one choice."""
        return self.completions([choice(text, finish_reason, self.chat, False, 0, logprobs)], n_prompt, n_completion,
                                n_cached)

    def completions(self, choices: list[dict], n_prompt: int, n_completion: int, n_cached: int = 0) -> dict:
        """The whole answer with these choices (`choice(..., stream=False, index=i)`);
        n_completion counts the tokens of them all; n_cached, the prompt's tokens taken from the cache."""
        return dict(self._head("chat.completion" if self.chat else "text_completion"), choices=choices,
                    usage=usage(n_prompt, n_completion, n_cached))

    def chunk(self, text: str, finish_reason: str | None = None, include_usage: bool = False, index: int = 0,
              logprobs: dict | None = None) -> dict:
        """A stream's chunk: a piece of text, or (with a finish_reason) the end. Under
        include_usage every chunk but the usage chunk has `usage` null, as OpenAI's."""
        body = dict(self._head("chat.completion.chunk" if self.chat else "text_completion"),
                    choices=[choice(text, finish_reason, self.chat, True, index, logprobs)])
        if include_usage:
            body["usage"] = None
        return body

    def delta_chunk(self, delta: dict, finish_reason: str | None = None, include_usage: bool = False,
                    index: int = 0, logprobs: dict | None = None) -> dict:
        """A chat stream's chunk with this `delta` (tool calls; `{}` with the finish_reason)."""
        body = dict(self._head("chat.completion.chunk"), choices=[
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, n_prompt: int, n_completion: int, n_cached: int = 0) -> dict:
        """The last chunk under include_usage: no choices, the usage."""
        return dict(self._head("chat.completion.chunk" if self.chat else "text_completion"), choices=[],
                    usage=usage(n_prompt, n_completion, n_cached))


def stream_error(message: str, code: DecodeResult | None, endpoint: str | None) -> dict:
    """The event that ends a stream whose decode failed."""
    return {"error": {"message": message, "type": "server_error", "code": code.name if code is not None else None,
                      "endpoint": endpoint}}


def model_object(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "ggml-distributed"}


def model_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_object(model, created)]}
