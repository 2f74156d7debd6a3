"""Every request field OpenAI's chat/completions APIs or llama-server's
/completion document is honoured, accepted (a hint with no effect here, said
why) or refused with a 400 naming it: never silently ignored. The table is
openai_api.FIELDS; docs/operations.md's request-field table is it, line for line.
Also the parsing of the fields added for llama-server users (sampling, n,
logprobs, echo) and the shapes of logprobs in replies, without a socket or a model."""
from __future__ import annotations

import math
import pathlib
import re

import pytest

from coordinator.serving import chat_templates, openai_api
from coordinator.serving.openai_api import BOTH, CHAT, COMPLETIONS, FIELDS, HONOURED, REFUSED, ApiError
from coordinator.text.sampling import TokenLogprob

N_VOCAB = 256
N_CTX = 256
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md"

# The documented lists (OpenAI's API reference, Create chat completion / Create completion; llama.cpp's
# tools/server/README.md, POST /completion options). The installed `openai` client's request types are
# walked too (below), so a field a newer client can send is caught here.
OPENAI_CHAT = """
    messages model audio frequency_penalty function_call functions logit_bias logprobs max_completion_tokens
    max_tokens metadata modalities n parallel_tool_calls prediction presence_penalty prompt_cache_key
    prompt_cache_retention reasoning_effort response_format safety_identifier seed service_tier stop store stream
    stream_options temperature tool_choice tools top_logprobs top_p user verbosity web_search_options""".split()
OPENAI_COMPLETIONS = """
    model prompt best_of echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream
    stream_options suffix temperature top_p user""".split()
LLAMA_SERVER_COMPLETION = """
    prompt temperature dynatemp_range dynatemp_exponent top_k top_p min_p n_predict n_indent n_keep n_cmpl
    n_cache_reuse stream stop typical_p repeat_penalty repeat_last_n presence_penalty frequency_penalty
    dry_multiplier dry_base dry_allowed_length dry_penalty_last_n dry_sequence_breakers xtc_probability
    xtc_threshold mirostat mirostat_tau mirostat_eta grammar json_schema seed ignore_eos logit_bias n_probs
    min_keep t_max_predict_ms id_slot cache_prompt return_tokens samplers timings_per_token return_progress
    sse_ping_interval post_sampling_probs response_fields lora top_n_sigma""".split()
LLAMA_SERVER_CHAT = "chat_template_kwargs reasoning_effort reasoning_format reasoning_control parse_tool_calls".split()

# a value for every field: for honoured and accepted ones a valid value that asks for something
# (with what it must change), for refused ones a value that asks for what is refused
MESSAGES = [{"role": "user", "content": "x"}]
EXAMPLES = {
    "model": ("gpt-4o", None),
    "prompt": ("hello", lambda r: r.prompt == "hello"),
    "messages": (MESSAGES, lambda r: r.messages == MESSAGES),
    "stream": (True, lambda r: r.generation.stream),
    "stream_options": ({"include_usage": True}, None),
    "max_tokens": (7, lambda r: r.generation.max_tokens == 7),
    "max_completion_tokens": (8, lambda r: r.generation.max_tokens == 8),
    "n_predict": (9, lambda r: r.generation.max_tokens == 9),
    "stop": (["\n"], lambda r: r.generation.stop == ["\n"]),
    "ignore_eos": (True, lambda r: r.generation.ignore_eos),
    "temperature": (0.5, lambda r: r.generation.sampler.temperature == 0.5),
    "top_k": (5, lambda r: r.generation.sampler.top_k == 5),
    "top_p": (0.5, lambda r: r.generation.sampler.top_p == 0.5),
    "min_p": (0.1, lambda r: r.generation.sampler.min_p == 0.1),
    "typical_p": (0.7, lambda r: r.generation.sampler.typical_p == 0.7),
    "min_keep": (2, lambda r: r.generation.sampler.min_keep == 2),
    "repeat_penalty": (1.3, lambda r: r.generation.sampler.repeat_penalty == 1.3),
    "repeat_last_n": (32, lambda r: r.generation.sampler.repeat_last_n == 32),
    "frequency_penalty": (0.5, lambda r: r.generation.sampler.frequency_penalty == 0.5),
    "presence_penalty": (0.25, lambda r: r.generation.sampler.presence_penalty == 0.25),
    "logit_bias": ({"5": -100}, lambda r: r.generation.sampler.logit_bias == {5: -100.0}),
    "seed": (42, lambda r: r.generation.sampler.seed == 42),
    "n": (3, lambda r: r.generation.n == 3),
    "n_cmpl": (2, lambda r: r.generation.n == 2),
    "logprobs": ({CHAT: True, COMPLETIONS: 3}, lambda r: r.generation.logprobs is not None),
    "top_logprobs": (4, lambda r: r.generation.logprobs == 4),
    "echo": (True, lambda r: r.generation.echo),
    "chat_template_kwargs": ({"enable_thinking": False}, lambda r: r.template_kwargs == {"enable_thinking": False}),
    "best_of": 3, "suffix": "end",
    "response_format": ({"type": "json_object"}, lambda r: r.generation.grammar is not None),
    "tools": ([{"type": "function", "function": {"name": "f"}}], lambda r: r.tools.names == ["f"] and r.tools.active),
    "tool_choice": ("none", lambda r: r.tools.choice == "none"), "functions": [{"name": "f"}],
    "function_call": "auto", "parallel_tool_calls": (True, lambda r: r.tools.parallel),
    "parse_tool_calls": True,
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {}, "reasoning_effort": "low",
    "reasoning_format": "deepseek", "reasoning_control": True, "verbosity": "low", "moderation": {},
    "user": "u-1", "safety_identifier": "s-1", "metadata": {"k": "v"}, "store": True, "service_tier": "flex",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {},
    "cache_prompt": (False, lambda r: r.generation.cache_prompt is False), "n_cache_reuse": 256, "n_keep": (-1, lambda r: r.generation.n_keep == -1), "id_slot": 2, "n_indent": 4,
    "t_max_predict_ms": 500, "dynatemp_range": 0.5, "dynatemp_exponent": 1.0, "mirostat": 2, "mirostat_tau": 5.0,
    "mirostat_eta": 0.1, "dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
    "dry_sequence_breakers": ["\n"], "xtc_probability": 0.5, "xtc_threshold": 0.1, "top_n_sigma": 1.0,
    "samplers": ["top_k", "temperature"], "n_probs": 5,
    "grammar": ("root ::= \"a\"", lambda r: r.generation.grammar is not None),
    "json_schema": ({"type": "integer"}, lambda r: r.generation.grammar is not None),
    "post_sampling_probs": True, "return_tokens": True, "timings_per_token": True, "return_progress": True,
    "sse_ping_interval": 5, "response_fields": ["content"], "lora": [{"id": 0, "scale": 0.5}],
}


def parse(endpoint: str, **fields):
    if endpoint == CHAT:
        return openai_api.parse_chat(dict({"messages": MESSAGES}, **fields), N_CTX, N_VOCAB)
    return openai_api.parse_completion(dict({"prompt": "x"}, **fields), N_VOCAB, N_CTX)


def refused(endpoint: str, **fields) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(endpoint, **fields)
    assert info.value.status == 400
    return info.value


def endpoints_of(f) -> list[str]:
    return [CHAT, COMPLETIONS] if f.endpoints == BOTH else [f.endpoints]


# ------------------------------------------------------------ the documented lists
def openai_client_fields() -> tuple[set[str], set[str]]:
    """The request fields of the installed openai client's create() types (chat, completions)."""
    chat = pytest.importorskip("openai.types.chat.completion_create_params")
    completions = pytest.importorskip("openai.types.completion_create_params")

    def keys(t) -> set[str]:
        return {k for cls in t.__mro__ for k in getattr(cls, "__annotations__", {})}
    return (keys(chat.CompletionCreateParamsStreaming) | keys(chat.CompletionCreateParamsNonStreaming),
            keys(completions.CompletionCreateParamsStreaming) | keys(completions.CompletionCreateParamsNonStreaming))


def test_every_documented_field_is_in_the_table_for_its_endpoint():
    client_chat, client_completions = openai_client_fields()
    for endpoint, names in ((CHAT, set(OPENAI_CHAT) | set(LLAMA_SERVER_CHAT) | client_chat),
                            (COMPLETIONS, set(OPENAI_COMPLETIONS) | set(LLAMA_SERVER_COMPLETION) | client_completions)):
        missing = sorted(n for n in names if n not in FIELDS or endpoint not in endpoints_of(FIELDS[n]))
        assert not missing, f"documented {endpoint} fields the table does not know: {missing}"
    # llama-server takes its /completion options on both OpenAI endpoints: so do we, but for the prompt
    for name in LLAMA_SERVER_COMPLETION:
        assert name == "prompt" or FIELDS[name].endpoints == BOTH, name


def test_every_field_has_an_example_and_a_reason():
    assert set(EXAMPLES) == set(FIELDS)
    for f in FIELDS.values():
        assert f.status in (HONOURED, "accepted", REFUSED) and f.note, f
        assert f.status == REFUSED or not f.neutral, f
        assert f.status != "accepted" or f.kind is not None, f


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_each_field_is_honoured_accepted_or_refused_by_name(name):
    f = FIELDS[name]
    for endpoint in endpoints_of(f):
        if f.status == REFUSED:
            e = refused(endpoint, **{name: EXAMPLES[name]})
            assert e.param == name and e.message == f"'{name}' is not supported by this server: {f.note}", e.message
            for value in (None, *f.neutral):  # asking for nothing is fine
                parse(endpoint, **{name: value})
        elif f.status == "accepted":
            parse(endpoint, **{name: EXAMPLES[name]})
            e = refused(endpoint, **{name: object.__new__(type("NotJson", (), {}))})
            assert e.param == name and e.message.startswith(f"'{name}' must be of type"), e.message
        else:
            value, effect = EXAMPLES[name]
            if isinstance(value, dict) and set(value) <= {CHAT, COMPLETIONS} and value:
                value = value[endpoint]
            fields = {"logprobs": True, name: value} if name == "top_logprobs" else {name: value}
            req = parse(endpoint, **fields)
            assert effect is None or effect(req), (name, endpoint, req)
    for other in {CHAT, COMPLETIONS} - set(endpoints_of(f)):  # sent to the other endpoint: named, not ignored
        value = EXAMPLES[name][0] if isinstance(EXAMPLES[name], tuple) else EXAMPLES[name]
        e = refused(other, **{name: value})
        assert e.param == name and "is a field of" in e.message, e.message


def test_an_unknown_field_is_refused_by_name():
    for endpoint in (CHAT, COMPLETIONS):
        e = refused(endpoint, temprature=0.5)
        assert e.param == "temprature" and "unrecognized request argument supplied: 'temprature'" in e.message
    # the first offending field in the body's order is the one named
    assert refused(COMPLETIONS, best_of=3, mirostat=2).param == "best_of"


# ------------------------------------------------------------ docs/operations.md's table
def docs_table() -> list[str]:
    lines = DOCS.read_text().splitlines()
    start = lines.index(openai_api.field_table()[0])
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return lines[start:end]


def test_the_docs_table_is_the_parsers_table():
    """docs/operations.md's request-field table must say exactly what the parser does: regenerate it with
    python -c 'from coordinator.serving.openai_api import field_table; print(*field_table(), sep="\\n")'"""
    docs = docs_table()
    rows = {re.match(r"\| `([^`]+)` \|", line).group(1): line for line in docs[2:]}
    assert set(rows) == set(FIELDS), (sorted(set(rows) ^ set(FIELDS)))
    assert docs == openai_api.field_table()


# ------------------------------------------------------------ the new fields' parsing
@pytest.mark.parametrize("endpoint, fields, message, param", [
    (COMPLETIONS, {"logprobs": 21}, "'logprobs' must be between 0 and 20", "logprobs"),
    (COMPLETIONS, {"logprobs": True}, "'logprobs' must be an integer (alternatives per token, 0..20) on "
                                      "/v1/completions", "logprobs"),
    (CHAT, {"logprobs": 2}, "'logprobs' must be of type bool", "logprobs"),
    (CHAT, {"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true", "top_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be between 0 and 20", "top_logprobs"),
    (COMPLETIONS, {"n": 0}, "'n' must be between 1 and 64", "n"),
    (COMPLETIONS, {"n": 2, "n_cmpl": 3}, "'n' (2) and 'n_cmpl' (3) disagree: give one", "n_cmpl"),
    (COMPLETIONS, {"n_predict": 0}, f"'n_predict' must be -1 (no limit) or between 1 and {N_CTX}", "n_predict"),
    (COMPLETIONS, {"n_predict": -2}, f"'n_predict' must be between -1 and {N_CTX}", "n_predict"),
    (COMPLETIONS, {"n_predict": 5, "max_tokens": 6}, "'n_predict' (5) and 'max_tokens' (6) disagree: give one",
     "n_predict"),
    (COMPLETIONS, {"echo": 1}, "'echo' must be of type bool", "echo"),
    (COMPLETIONS, {"ignore_eos": "yes"}, "'ignore_eos' must be of type bool", "ignore_eos"),
    (COMPLETIONS, {"min_p": 2}, "'min_p' must be between 0.0 and 1.0", "min_p"),
    (COMPLETIONS, {"typical_p": -0.1}, "'typical_p' must be between 0.0 and 1.0", "typical_p"),
    (COMPLETIONS, {"repeat_penalty": 0}, "'repeat_penalty' must be at least 1e-06", "repeat_penalty"),
    (COMPLETIONS, {"repeat_last_n": -2}, f"'repeat_last_n' must be between -1 and {1 << 20}", "repeat_last_n"),
    (COMPLETIONS, {"frequency_penalty": 2.5}, "'frequency_penalty' must be between -2.0 and 2.0",
     "frequency_penalty"),
    (COMPLETIONS, {"presence_penalty": "x"}, "'presence_penalty' must be of type float", "presence_penalty"),
    (COMPLETIONS, {"logit_bias": [1, 2]}, "'logit_bias' must be an object {\"token id\": bias} or a list "
                                          "[[token id, bias], ...]", "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"Hello": 1}}, "'logit_bias': 'Hello' is not a token id (token texts are not "
                                                "taken: give ids, e.g. from /tokenize)", "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"256": 1}}, "token id 256 in 'logit_bias' is outside the vocabulary (0..255)",
     "logit_bias"),
    (COMPLETIONS, {"logit_bias": [[3, "x"]]}, "'logit_bias': the bias of token 3 must be a number, or false to ban "
                                              "it", "logit_bias"),
    (COMPLETIONS, {"logit_bias": [[3, True]]}, "'logit_bias': the bias of token 3 must be a number, or false to "
                                               "ban it", "logit_bias"),
    (CHAT, {"chat_template_kwargs": []}, "'chat_template_kwargs' must be an object", "chat_template_kwargs"),
    (CHAT, {"chat_template_kwargs": {"messages": []}}, "'chat_template_kwargs' may not set messages: the server "
                                                       "does", "chat_template_kwargs"),
])
def test_bad_values_of_the_new_fields(endpoint, fields, message, param):
    e = refused(endpoint, **fields)
    assert (e.message, e.param) == (message, param)


def test_logprobs_false_and_null_are_no_logprobs():
    for endpoint in (CHAT, COMPLETIONS):
        for value in (False, None):
            assert parse(endpoint, logprobs=value).generation.logprobs is None
    assert parse(CHAT, logprobs=True).generation.logprobs == 0
    assert parse(CHAT, logprobs=True, top_logprobs=5).generation.logprobs == 5
    assert parse(COMPLETIONS, logprobs=0).generation.logprobs == 0


def test_logit_bias_forms():
    bias = lambda **f: parse(COMPLETIONS, **f).generation.sampler.logit_bias  # noqa: E731
    assert bias(logit_bias={"3": 1.5, "7": -100}) == {3: 1.5, 7: -100.0}
    assert bias(logit_bias=[[3, 1.5], [7, False]]) == {3: 1.5, 7: -math.inf}
    assert bias(logit_bias={"3": False}) == {3: -math.inf}
    assert bias(logit_bias=[[3, 1.0], [3, 0.5]]) == {3: 1.5}  # llama-server adds repeated ones
    assert bias(logit_bias={}) == {} and bias(logit_bias=[]) == {}


def test_max_tokens_names():
    assert parse(COMPLETIONS, n_predict=-1).generation.max_tokens is None  # the rest of the context
    assert parse(COMPLETIONS, n_predict=5, max_tokens=5).generation.max_tokens == 5
    assert parse(CHAT, n_predict=-1).generation.max_tokens is None
    assert parse(COMPLETIONS).generation.max_tokens == 16
    assert parse(CHAT).generation.max_tokens is None


def test_choices_get_distinct_seeds_and_ignore_eos_bans_the_end():
    gen = parse(COMPLETIONS, n=3, seed=10, ignore_eos=True, top_k=4).generation
    samplers = gen.samplers(eog_ids=[1, 2])
    assert [s.seed for s in samplers] == [10, 11, 12]
    assert all(s.top_k == 4 and s.logit_bias == {1: -math.inf, 2: -math.inf} for s in samplers)
    assert parse(COMPLETIONS, n=2).generation.samplers([1])[0].logit_bias == {}
    assert [s.seed for s in parse(COMPLETIONS, n=2).generation.samplers()] == [None, None]


def test_chat_template_kwargs_reach_the_template():
    text = "{% if enable_thinking is defined and not enable_thinking %}NO{% endif %}{{ messages[0]['content'] }}"
    template = chat_templates.ChatTemplate("t.jinja", "file", text, chat_templates.sandbox().from_string(text))
    req = parse(CHAT, chat_template_kwargs={"enable_thinking": False})
    assert openai_api.chat_prompt(template, req.messages, "", "", req.template_kwargs) == "NOx"
    assert openai_api.chat_prompt(template, req.messages, "", "") == "x"


# ------------------------------------------------------------ logprobs in replies
PIECES = {1: b"Hello", 2: b" world", 3: b"\xe2\x80", 4: "é".encode()}


def test_token_text_shows_part_of_a_character_as_bytes():
    assert openai_api.token_text(b" world") == " world"
    assert openai_api.token_text(b"\xe2\x80") == "bytes:\\xe2\\x80"


def test_chat_logprobs_shape():
    entries = [TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.5))), TokenLogprob(3, -2.0, ())]
    assert openai_api.chat_logprobs(entries, PIECES.get) == {"content": [
        {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"),
         "top_logprobs": [{"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")},
                          {"token": " world", "logprob": -1.5, "bytes": list(b" world")}]},
        {"token": "bytes:\\xe2\\x80", "logprob": -2.0, "bytes": [0xE2, 0x80], "top_logprobs": []}],
        "refusal": None}


def test_completion_logprobs_shape_with_an_echoed_prompt():
    prompt = [TokenLogprob(1, None, (), 0), TokenLogprob(2, -3.0, ((4, -0.1),), 5)]
    entries = [TokenLogprob(4, -0.25, ((4, -0.25), (1, -2.0)), 0)]
    assert openai_api.completion_logprobs(entries, PIECES.get, base=11, prompt=prompt) == {
        "tokens": ["Hello", " world", "é"], "token_logprobs": [None, -3.0, -0.25],
        "top_logprobs": [None, {"é": -0.1}, {"é": -0.25, "Hello": -2.0}], "text_offset": [0, 5, 11]}
    assert openai_api.completion_logprobs([], PIECES.get) == {"tokens": [], "token_logprobs": [],
                                                              "top_logprobs": [], "text_offset": []}


def test_replies_with_several_choices_and_logprobs():
    reply = openai_api.CompletionReply("cmpl-1", 5, "m", chat=False)
    lp = {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [{}], "text_offset": [0]}
    body = reply.completions([openai_api.choice("a", "length", False, False, 0, lp),
                              openai_api.choice("b", "stop", False, False, 1)], 3, 2)
    assert body["choices"] == [{"index": 0, "text": "a", "logprobs": lp, "finish_reason": "length"},
                               {"index": 1, "text": "b", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    chunk = openai_api.CompletionReply("chatcmpl-1", 5, "m", chat=True).chunk("Hi", None, False, 1,
                                                                             {"content": [], "refusal": None})
    assert chunk["choices"] == [{"index": 1, "delta": {"role": "assistant", "content": "Hi"},
                                 "logprobs": {"content": [], "refusal": None}, "finish_reason": None}]
