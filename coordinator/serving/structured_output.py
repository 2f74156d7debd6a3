"""Structured output's request fields: `response_format` (OpenAI: `{"type": "text"}`,
`{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name", "schema",
"strict", "description"}}`; llama-server's `{"type": "json_object", "schema": {...}}`
too), llama-server's top-level `grammar` (GBNF) and `json_schema`. At most one of them
asks for a constraint; `grammar_of(body)` compiles it with llguidance
(coordinator/text/constrained.py) and returns the grammar text, or None when nothing
is asked. An invalid value is a `Refused` naming the field, with the library's error.

`constrain(samplers, tokenizer, grammar)` gives each choice's sampler its own matcher;
it can take a second the first time (the vocabulary's table for the library), so the
server runs it off the event loop."""
from __future__ import annotations

from typing import Any

from coordinator.text import constrained


class Refused(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _compile(kind: str, value: Any, param: str) -> str:
    try:
        return constrained.compile_grammar(kind, value)
    except (ValueError, TypeError) as exc:
        what = "grammar" if kind == "grammar" else "JSON schema"
        raise Refused(f"'{param}': invalid {what}: {exc}", param) from None


def _response_format(value: Any) -> str | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise Refused("'response_format' must be an object with a 'type': \"text\", \"json_object\" or "
                      "\"json_schema\"", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")  # llama-server's extension
        if schema is not None:
            return _compile("json_schema", schema, "response_format")
        return _compile("json_object", None, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise Refused("'response_format': type json_schema needs 'json_schema': {\"name\": ..., "
                          "\"schema\": {...}}", "response_format")
        if "name" in spec and not isinstance(spec["name"], str):
            raise Refused("'response_format': 'json_schema.name' must be a string", "response_format")
        if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
            raise Refused("'response_format': 'json_schema.strict' must be a boolean", "response_format")
        # strict or not, the output always conforms: the schema is a grammar here
        return _compile("json_schema", spec.get("schema", {}), "response_format")
    raise Refused(f"'response_format': type {kind!r} is not one of \"text\", \"json_object\", \"json_schema\"",
                  "response_format")


def grammar_of(body: dict, ignore_eos: bool = False) -> str | None:
    """The llguidance grammar a request's body asks for, or None."""
    asked: list[tuple[str, str]] = []
    rf = body.get("response_format")
    if rf is not None:
        grammar = _response_format(rf)
        if grammar is not None:
            asked.append(("response_format", grammar))
    gbnf = body.get("grammar")
    if gbnf is not None and gbnf != "":
        asked.append(("grammar", _compile("grammar", gbnf, "grammar")))
    schema = body.get("json_schema")
    if schema is not None:
        asked.append(("json_schema", _compile("json_schema", schema, "json_schema")))
    if len(asked) > 1:
        raise Refused(f"{', '.join(repr(p) for p, _ in asked)} each constrain the output: give one", asked[1][0])
    if not asked:
        return None
    if ignore_eos:
        raise Refused(f"'ignore_eos' cannot be used with '{asked[0][0]}': the output ends where the grammar "
                      f"does", "ignore_eos")
    return asked[0][1]


def constrain(samplers, tokenizer, grammar: str | None) -> None:
    """Each sampler (one per choice) gets a matcher of its own for `grammar`."""
    if grammar is None:
        return
    for sampler in samplers:
        sampler.constraint = constrained.Constraint(tokenizer, grammar)
