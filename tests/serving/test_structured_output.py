"""Structured output (issue #28): `response_format` json_object / json_schema, llama-server's
`grammar` (GBNF) and `json_schema`, through llguidance (coordinator/text/constrained.py).

* the vocabulary adapter: each token's bytes as our tokenizer decodes it, special tokens
  never matched by grammar text, EOS exactly when the grammar accepts;
* the sampler hook: masked logits (greedy too), the matcher advancing on each token;
* request parsing: an invalid schema or grammar is a 400 naming the field;
* the real bundled model through `ggml-coordinator serve`: a hypothesis property test over
  generated schemas (the output parses and conforms, or is cut by max_tokens as `length`
  and is then a prefix the grammar allows), and end-to-end cases with the `openai` client.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from coordinator.serving import openai_api, structured_output
from coordinator.serving.openai_api import ApiError
from coordinator.text import constrained
from coordinator.text.sampling import Sampler
from coordinator.text.tokenizer import (TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL,
                                        TOKEN_TYPE_USER_DEFINED, Tokenizer)

jsonschema = pytest.importorskip("jsonschema")


# ------------------------------------------------------------ a small SentencePiece vocabulary
def spm_tokenizer() -> Tokenizer:
    pieces = [("<unk>", 2), ("<s>", TOKEN_TYPE_CONTROL), ("</s>", TOKEN_TYPE_CONTROL),
              ("<start_of_turn>", TOKEN_TYPE_USER_DEFINED), ("  ", TOKEN_TYPE_USER_DEFINED)]
    pieces += [(f"<0x{b:02X}>", TOKEN_TYPE_BYTE) for b in range(256)]
    words = ["{", "}", "\"", ":", ",", "▁", "▁\"", "\"a\"", "a", "b", "ab", "1", "2", "12", "true", "false",
             "[", "]", "▁{", "{\"", "\":", "▁1", "name", "x"]
    pieces += [(w, TOKEN_TYPE_NORMAL) for w in words]
    return Tokenizer([p for p, _ in pieces], [0.0] * len(pieces), [t for _, t in pieces], bos_id=1, eos_id=2,
                     unk_id=0, add_bos=True, add_eos=False, add_space_prefix=True)


def test_the_adapter_gives_each_token_the_bytes_our_tokenizer_decodes():
    tok = spm_tokenizer()
    got = constrained.token_bytes(tok)
    for i, piece in enumerate(tok.tokens):
        kind = tok.token_types[i]
        if i in tok.eog_ids or kind == TOKEN_TYPE_CONTROL or kind == 2 or piece == "<start_of_turn>":
            assert got[i] == b"\xff" + piece.encode(), (i, piece)  # special: no grammar text matches it
        else:
            assert got[i] == tok.token_to_piece(i), (i, piece)
    assert got[tok.piece_to_id("▁\"")] == b' "'  # SentencePiece's ▁ is a space
    assert got[tok.piece_to_id("<0x41>")] == b"A"
    assert got[tok.piece_to_id("  ")] == b"  "  # a user-defined token that is text stays text
    lt = constrained.vocabulary(tok)
    assert lt.vocab_size == len(tok.tokens) and set(lt.eos_tokens) == set(tok.eog_ids)


def test_the_adapter_reads_byte_level_bpe_through_byte_to_unicode():
    from coordinator.text.tokenizer_bpe import BYTE_TO_UNICODE

    class Bpe(Tokenizer):  # the byte-level decoding BPETokenizer uses, on a handmade vocabulary
        def _normal_piece(self, text):
            from coordinator.text.tokenizer_bpe import UNICODE_TO_BYTE
            return bytes(UNICODE_TO_BYTE[c] for c in text)

    space, newline = BYTE_TO_UNICODE[ord(" ")], BYTE_TO_UNICODE[ord("\n")]
    pieces = ["<|endoftext|>", "{", "}", f"{space}\"", f"{newline}{space}{space}", "\"", "a", ":"]
    types = [TOKEN_TYPE_CONTROL] + [TOKEN_TYPE_NORMAL] * (len(pieces) - 1)
    tok = Bpe(pieces, [0.0] * len(pieces), types, bos_id=None, eos_id=0, unk_id=None, add_bos=False,
              add_eos=False, add_space_prefix=False)
    got = constrained.token_bytes(tok)
    assert got[3] == b' "' and got[4] == b"\n  " and got[0] == b"\xff<|endoftext|>"


def test_masks_allow_eos_exactly_when_the_grammar_accepts_and_never_special_tokens():
    tok = spm_tokenizer()
    c = constrained.Constraint(tok, constrained.compile_grammar("grammar", 'root ::= "ab" | "ab1"'))
    specials = [i for i, b in enumerate(constrained.token_bytes(tok)) if b[:1] == b"\xff"]
    allowed = c.allowed()
    assert not allowed[specials].any() and allowed[tok.piece_to_id("ab")]
    assert not allowed[tok.piece_to_id("b")] and not allowed[tok.piece_to_id("▁")]
    c.advance(tok.piece_to_id("ab"))
    allowed = c.allowed()
    assert allowed[tok.eos_id] and allowed[tok.piece_to_id("1")] and not allowed[tok.piece_to_id("2")]
    c.advance(tok.piece_to_id("1"))
    allowed = c.allowed()
    assert allowed[tok.eos_id] and allowed.sum() == 1  # done: only the end


def test_json_whitespace_is_bounded_as_llama_cpp_bounds_it():
    import llguidance

    tok = spm_tokenizer()
    vocab = constrained.vocabulary(tok)
    grammar = constrained.compile_grammar("json_object", None)

    def ok(text):
        m = llguidance.LLMatcher(vocab, grammar, log_level=0)
        return m.consume_tokens(vocab.tokenize_bytes(text.encode())) and not m.is_error()
    assert ok('{"a":1}') and ok('{\n  "a": 1\n}') and ok("{" + " " * 20 + "}")
    assert not ok("{" + " " * 21 + "}") and not ok('{"a":1} ')


def test_the_sampler_hook_masks_greedy_and_random_draws():
    tok = spm_tokenizer()
    grammar = constrained.compile_grammar("json_schema", {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False})
    rng = np.random.default_rng(0)
    for temperature in (0.0, 1.0):
        for seed in range(20):
            s = Sampler(temperature, 0, 1.0, seed)
            s.constraint = constrained.Constraint(tok, grammar)
            assert s.greedy_bans() is None  # the mask is applied to the logits
            out = []
            for _ in range(40):
                logits = rng.normal(size=len(tok.tokens)).astype(np.float32)
                logits[tok.piece_to_id("x")] = 100.0  # the model's favourite is never allowed in this JSON
                token = s.sample(logits)
                if token in tok.eog_ids:
                    break
                out.append(token)
            else:
                continue  # cut (as by max_tokens): no claim
            assert json.loads(tok.decode(out)).keys() == {"a"}


def _mask_first_draw(sampler: Sampler, logits: np.ndarray) -> int:
    """The definition a constrained draw must meet: the grammar's mask on the logits, then the chain."""
    token = sampler._draw(sampler.adjusted(sampler.constraint.logits(logits)))
    sampler.accept((token,))
    sampler.constraint.advance(token)
    return token


@pytest.mark.parametrize("settings_", [
    dict(temperature=0.0), dict(temperature=0.0, top_k=0, repeat_penalty=1.3),
    dict(temperature=0.8, top_k=3, top_p=1.0), dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2),
    dict(temperature=1.0, top_k=8, top_p=0.9), dict(temperature=0.0, typical_p=0.5)])
def test_a_draw_checked_against_the_grammar_equals_the_draw_after_the_mask(settings_):
    """Sampler.sample skips the mask where every candidate passes Constraint.fits. Over random
    logits that favour an allowed token half of the time (so checks both pass and fail), the
    tokens and the random state after them are those of masking first, step by step."""
    tok = spm_tokenizer()
    # free runs, and bytes it forces ("12" after each [ab]: only that token, not "1" then "2")
    grammar = constrained.compile_grammar("grammar", 'root ::= "{" [ab12]{1,20} ([ab] "12"){1,6} "}"')
    rng = np.random.default_rng(7)
    steps = masks = 0
    for seed in range(12):
        fast, slow = (Sampler(seed=seed, **settings_) for _ in range(2))
        fast.constraint, slow.constraint = (constrained.Constraint(tok, grammar) for _ in range(2))
        for _ in range(40):
            logits = rng.normal(size=len(tok.tokens)).astype(np.float32)
            if rng.random() < 0.5:  # the model's favourites are ones whose bytes the grammar takes next
                slow.constraint.allowed()  # (the mask's thread is done with the matcher)
                ok = [t for t in range(len(tok.tokens)) if slow.constraint.matcher.validate_tokens([t])]
                ok = ok or list(tok.eog_ids)
                logits[rng.choice(ok, size=min(3, len(ok)), replace=False)] += 8.0
            a, b = fast.sample(logits), _mask_first_draw(slow, logits)
            assert a == b
            assert fast.rng.bit_generator.state == slow.rng.bit_generator.state
            steps += 1
            if a in tok.eog_ids:
                break
        masks += fast.constraint.masks
    if fast._checks_fit:
        assert masks < steps - 20  # the checks did decide draws without a mask
    else:
        assert masks >= steps


def test_output_rows_past_the_vocabulary_are_never_drawn_nor_asked_about():
    """A head with more rows than the tokenizer has tokens (padding): a favourite among them is
    banned as the mask bans it, and the matcher, which stops on an id it does not know, is not
    asked about it."""
    tok = spm_tokenizer()
    grammar = constrained.compile_grammar("grammar", 'root ::= [ab]{1,20}')
    for temperature, top_k in ((0.0, 40), (1.0, 3)):
        s = Sampler(temperature, top_k, 1.0, seed=1)
        s.constraint = constrained.Constraint(tok, grammar)
        for _ in range(6):
            logits = np.zeros(len(tok.tokens) + 8, dtype=np.float32)
            logits[len(tok.tokens) + 2] = 9.0  # padding's row
            logits[tok.piece_to_id("ab")] = 5.0
            assert s.sample(logits) == tok.piece_to_id("ab")
            assert s.constraint.error is None


def test_a_greedy_draw_over_free_text_computes_almost_no_masks():
    """Where the grammar forces nothing and the model keeps to it, a greedy sequence checks its
    tokens instead of computing masks: a handful at the start, none after."""
    tok = spm_tokenizer()
    s = Sampler(0.0)
    s.constraint = constrained.Constraint(tok, constrained.compile_grammar("grammar", 'root ::= [ab12]{1,200}'))
    favourite = [tok.piece_to_id(p) for p in ("ab", "12", "a", "1")]
    for i in range(100):
        logits = np.zeros(len(tok.tokens), dtype=np.float32)
        logits[favourite[i % 4]] = 5.0
        assert s.sample(logits) == favourite[i % 4]
    assert s.constraint.masks <= 2
    logits = np.zeros(len(tok.tokens), dtype=np.float32)
    logits[tok.piece_to_id("x")] = 9.0  # banned: the mask decides, and the next masks are computed ahead again
    logits[tok.piece_to_id("b")] = 1.0
    assert s.sample(logits) == tok.piece_to_id("b")
    for _ in range(3):
        s.sample(logits)
    assert s.constraint.masks >= 4


def test_forked_choices_get_matchers_of_their_own():
    tok = spm_tokenizer()
    gen = openai_api.parse_generation({"grammar": 'root ::= [ab] "x"', "n": 2}, 16, 64)
    samplers = gen.samplers(tok.eog_ids)
    structured_output.constrain(samplers, tok, gen.grammar)
    a, b = samplers
    assert a.constraint is not b.constraint
    a.constraint.advance(tok.piece_to_id("a"))
    assert b.constraint.allowed()[tok.piece_to_id("a")] and not a.constraint.allowed()[tok.piece_to_id("a")]


# ------------------------------------------------------------ request parsing: 400s naming the field
def test_closed_objects_closes_what_lists_properties_and_says_nothing_of_others():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
        "c": {"anyOf": [{"type": "object", "properties": {"z": {}}}, {"type": "null"}]},
        "d": {"type": "object", "properties": {}, "additionalProperties": True},
        "e": {"type": "object", "properties": {}, "patternProperties": {"^k": {}}},
        "f": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]},
        "g": {"type": "object"}},
        "$defs": {"t": {"type": "object", "properties": {"w": {}}}}}
    before = json.dumps(schema, sort_keys=True)
    closed = constrained.closed_objects(schema)
    assert json.dumps(schema, sort_keys=True) == before  # the request's own schema is untouched
    props = closed["properties"]
    assert closed["additionalProperties"] is False and closed["$defs"]["t"]["additionalProperties"] is False
    assert props["a"]["additionalProperties"] is False and props["b"]["items"]["additionalProperties"] is False
    assert props["c"]["anyOf"][0]["additionalProperties"] is False and props["c"]["anyOf"][1] == {"type": "null"}
    assert props["d"]["additionalProperties"] is True and "additionalProperties" not in props["e"]
    assert props["f"] == schema["properties"]["f"] and props["g"] == {"type": "object"}  # allOf; no properties listed
    assert constrained.closed_objects(True) is True


@pytest.mark.parametrize("schema, accepted, refused", [
    # a shared field beside alternatives: neither the object nor its branches may be closed
    ({"type": "object", "properties": {"kind": {"type": "string"}},
      "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"properties": {"y": {"type": "integer"}}, "required": ["y"]}]},
     ['{"kind": "a", "x": 1}', '{"y": 2}'], []),
    # inheritance through $ref in allOf: the base stays open, the object inside it is closed
    ({"$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"},
                                                          "o": {"type": "object", "properties": {"p": {}}}}}},
      "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     ['{"a": 1, "b": 2}', '{"o": {"p": 1}, "b": 2}'], ['{"o": {"p": 1, "q": 2}, "b": 2}']),
    # $ref with properties beside it
    ({"$defs": {"t": {"type": "object", "properties": {"a": {"type": "integer"}}}},
      "$ref": "#/$defs/t", "properties": {"b": {"type": "integer"}}}, ['{"a": 1, "b": 2}'], []),
    # required naming a key the object does not list: left open, so still satisfiable
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
     ['{"a": 1, "b": 2}'], []),
    # pydantic's nested model: a plain $ref to a definition, which is closed
    ({"$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
      "type": "object", "properties": {"home": {"$ref": "#/$defs/Address"}}, "required": ["home"]},
     ['{"home": {"city": "Oslo"}}'], ['{"home": {"city": "Oslo", "zip": 1}}', '{"home": {"city": "Oslo"}, "x": 1}']),
    # a union of object types with nothing beside it: each alternative is closed
    ({"anyOf": [{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"]}]},
     ['{"x": 1}', '{"y": 2}'], ['{"x": 1, "y": 2}']),
])
def test_closing_never_takes_away_what_a_combination_allows(schema, accepted, refused):
    """What a schema combines stays satisfiable and keeps its keys; what it does not is closed.
    Each accepted document conforms to the schema as written (jsonschema checks it)."""
    grammar = constrained.compile_grammar("json_schema", schema)
    for doc in accepted:
        jsonschema.validate(json.loads(doc), schema)
        assert allowed_prefix(doc, grammar), doc
    for doc in refused:
        assert not allowed_prefix(doc, grammar), doc


def test_a_json_schema_without_additional_properties_allows_no_other_key():
    grammar = constrained.compile_grammar("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}}})
    assert allowed_prefix('{"n": 1}', grammar)
    assert not allowed_prefix('{"n": 1, "m"', grammar) and not allowed_prefix('{"m"', grammar)


def refused(**body) -> ApiError:
    with pytest.raises(ApiError) as e:
        openai_api.parse_completion({"prompt": "x", **body}, 1000, 256)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "'response_format': invalid JSON schema: Invalid type: nope"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs 'json_schema'"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type 'yaml' is not one of"),
    ({"response_format": "json"}, "response_format", "must be an object with a 'type'"),
    ({"json_schema": {"properties": {"a": {"$ref": "#/nope"}}}}, "json_schema",
     "'json_schema': invalid JSON schema: "),
    ({"json_schema": [1]}, "json_schema", "a JSON schema is an object"),
    ({"grammar": "root ::= foo"}, "grammar", "'grammar': invalid grammar: "),
    ({"grammar": 'root ::= "a'}, "grammar", "'grammar': invalid grammar: "),
    ({"grammar": 7}, "grammar", "a grammar is a string"),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "json_schema", "each constrain the output: give one"),
    ({"grammar": 'root ::= "a"', "ignore_eos": True}, "ignore_eos", "cannot be used with 'grammar'"),
])
def test_an_invalid_constraint_is_a_400_naming_the_field(body, param, message):
    e = refused(**body)
    assert e.param == param and message in e.message, e.message


def test_what_asks_for_no_constraint():
    for body in ({}, {"response_format": {"type": "text"}}, {"grammar": ""}, {"response_format": None}):
        assert openai_api.parse_completion({"prompt": "x", **body}, 1000, 256).generation.grammar is None
    for body in ({"response_format": {"type": "json_object"}}, {"json_schema": {"type": "integer"}},
                 {"response_format": {"type": "json_object", "schema": {"type": "object"}}},
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": True,
                                                                             "schema": {"type": "object"}}}}):
        assert openai_api.parse_completion({"prompt": "x", **body}, 1000, 256).generation.grammar


# ------------------------------------------------------------ the real model, through `serve`
def leaf() -> st.SearchStrategy:
    return st.one_of(
        st.just({"type": "string", "maxLength": 12}),
        st.builds(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 1000}, st.integers(-50, 50)),
        st.just({"type": "number", "minimum": -100, "maximum": 100}),
        st.just({"type": "boolean"}),
        st.lists(st.sampled_from(["red", "green", "blue", "cat", "dog", "yes", "no"]), min_size=1, max_size=4,
                 unique=True).map(lambda e: {"enum": e}),
    )


def objects(children: st.SearchStrategy) -> st.SearchStrategy:
    names = st.sampled_from(["name", "age", "city", "score", "ok", "kind", "tags", "items", "size", "note"])

    @st.composite
    def build(draw):
        props = draw(st.dictionaries(names, children, min_size=1, max_size=4))
        required = draw(st.lists(st.sampled_from(sorted(props)), unique=True, max_size=len(props)))
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return build()


def field_schemas() -> st.SearchStrategy:
    arrays = leaf().map(lambda item: {"type": "array", "items": item, "maxItems": 3})
    inner = objects(st.one_of(leaf(), arrays))
    return st.one_of(leaf(), arrays, inner)


SCHEMAS = objects(field_schemas())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from http_helpers import served
    yield from served(tmp_path_factory, "--parallel", "2", "--ctx-per-slot", "1024")


def allowed_prefix(text: str, grammar: str) -> bool:
    """Whether the grammar allows `text` as the start of an output (a fresh matcher consumes it)."""
    import llguidance

    from coordinator.model.default_model import default_model_path
    tok = _gemma(default_model_path())
    vocab = constrained.vocabulary(tok)
    m = llguidance.LLMatcher(vocab, grammar)
    return m.consume_tokens(vocab.tokenize_bytes(text.encode())) and not m.is_error()


_TOKENIZERS: dict = {}


def _gemma(path):
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = Tokenizer.from_gguf(path)
    return _TOKENIZERS[path]


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    import aiohttp

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            async with s.post(url + path, json=body) as r:
                return r.status, await r.json()
    return asyncio.run(go())


MAX_TOKENS = 160


@pytest.mark.system
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31), temperature=st.sampled_from([0.0, 0.7, 1.0]))
def test_the_output_parses_and_conforms_to_generated_schemas(server, schema, seed, temperature):
    jsonschema.Draft202012Validator.check_schema(schema)
    body = {"messages": [{"role": "user", "content": "Reply with one JSON object for this schema: "
                                                    + json.dumps(schema)}],
            "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema,
                                                                       "strict": True}}}
    status, reply = post(server.url, "/v1/chat/completions", body)
    assert status == 200, reply
    choice = reply["choices"][0]
    text = choice["message"]["content"]
    event(f"finish_reason {choice['finish_reason']}")  # pytest --hypothesis-show-statistics counts them
    if choice["finish_reason"] == "length":  # cut by max_tokens: what there is follows the grammar
        assert reply["usage"]["completion_tokens"] == MAX_TOKENS
        assert allowed_prefix(text, constrained.compile_grammar("json_schema", schema)), text
        return
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), schema)


# ------------------------------------------------------------ end to end with the official client
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(server):
    from http_helpers import openai_client
    return openai_client(server, timeout=300)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "colour": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "colour"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.mark.system
def test_client_json_schema_strict_streamed_and_with_n(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model="any", messages=ASK, response_format=rf, max_tokens=100,
                                       temperature=0.8, seed=3, n=2)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    chunks = list(client.chat.completions.create(model="any", messages=ASK, response_format=rf, max_tokens=100,
                                                 temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


@pytest.mark.system
def test_client_json_object_and_length(client):
    r = client.chat.completions.create(model="any", messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=400, temperature=0, seed=1)
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # the model went on past 400 tokens: a prefix the grammar allows
        assert choice.finish_reason == "length"
        assert allowed_prefix(choice.message.content, constrained.compile_grammar("json_object", None))
    cut = client.chat.completions.create(model="any", messages=ASK, response_format={"type": "json_object"},
                                         max_tokens=3, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3


@pytest.mark.system
def test_client_gbnf_grammar_and_json_schema_on_completions(client):
    r = client.completions.create(model="any", prompt="Answer yes or no:", max_tokens=10, temperature=1.0, seed=5,
                                  extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
    assert r.choices[0].text in ("yes.", "no.") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="any", prompt="A small number:", max_tokens=10, temperature=0,
                                  extra_body={"json_schema": {"type": "integer", "minimum": 0, "maximum": 99}})
    assert 0 <= json.loads(r.choices[0].text) <= 99 and r.choices[0].finish_reason == "stop"


@pytest.mark.system
def test_client_invalid_schema_and_grammar_are_400s_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert e.value.body["param"] == "response_format" and "Invalid type: nope" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="any", prompt="x", max_tokens=5, extra_body={"grammar": "root ::= foo"})
    assert e.value.body["param"] == "grammar" and "invalid grammar" in e.value.body["message"]
