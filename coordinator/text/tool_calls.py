"""Tool calls in a model's output text, without I/O: `parse(text, names)` finds the
calls a model wrote in one of the common formats and returns them with the text
that is not a call (`content`); `CallSplitter` does the same for a stream, passing
on as content the text that cannot be the start of a call and holding back the rest.

The formats (each model family's own; a model's chat template says which it is
taught, `format_of`):

* Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call, wherever they stand: the text around them is content. The
  built-in format (`HERMES`).
* Llama 3.x: `{"name": ..., "parameters": {...}}` (or `"arguments"`), optionally
  after `<|python_tag|>`, several separated by `;` or newlines.
* Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]`, or
  the newer `[TOOL_CALLS]name[ARGS]{...}` (`[CALL_ID]id` before `[ARGS]` too).
* A generic JSON fallback: the whole answer (in a ```json fence or not) is a call
  object, a list of them, `{"tool_calls": [...]}` or `{"function": {...}}`.

A call names a function (`names`: the request's, when given: a call of any other
is not one, and the text stays content) and has an object of arguments, given
as JSON text in the reply (`ToolCall.arguments`), as OpenAI's API does.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Collection

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"  # call formats (what a grammar forces, format_of)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MARKERS = (HERMES_OPEN, MISTRAL_CALLS, PYTHON_TAG)  # a call starts here, wherever it is in the text
_decoder = json.JSONDecoder()
_FENCE = re.compile(r"^```(?:json|JSON)?\s*\n?(.*?)\n?\s*```$", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # an object's JSON text
    id: str | None = None  # when the model wrote one (Mistral)


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text that is no call (Hermes: around the blocks; else before the calls), or None
    calls: list[ToolCall] = field(default_factory=list)


def format_of(template_text: str) -> str:
    """The call format a chat template teaches its model (HERMES when it says none)."""
    if MISTRAL_CALLS in template_text:
        return MISTRAL
    if HERMES_OPEN in template_text:
        return HERMES
    if PYTHON_TAG in template_text or "ipython" in template_text:
        return LLAMA3
    return HERMES


def parse(text: str, names: Collection[str] | None = None) -> Parsed:
    """The calls `text` holds, in whichever format it writes them, and the text that is not a call.
    No call (or a call of a function not in `names`): all of `text` is content."""
    for found in (_hermes(text), _mistral(text), _python_tag(text), _bare_json(text)):
        if found is None:
            continue
        content, calls = found
        if calls and (names is None or all(c.name in names for c in calls)):
            return Parsed(content if content and content.strip() else None, calls)
    return Parsed(text if text else None, [])


# ------------------------------------------------------------ one call object
def _call(obj) -> ToolCall | None:
    """A call from one JSON object: {"name", "arguments" | "parameters"} (arguments an
    object, or its JSON text), {"function": {...}} or {"type": "function", ...}; else None."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        return _call(dict(obj["function"], id=obj.get("id")))
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    allowed = {"name", "arguments", "parameters", "type", "id"}
    if set(obj) - allowed:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    call_id = obj.get("id")
    return ToolCall(name, json.dumps(args, ensure_ascii=False), call_id if isinstance(call_id, str) else None)


def _calls(value) -> list[ToolCall] | None:
    """Calls from a decoded JSON value: a call, a list of calls, {"tool_calls": [...]}, {"tool_call": {...}}."""
    if isinstance(value, dict) and set(value) == {"tool_calls"}:
        value = value["tool_calls"]
    elif isinstance(value, dict) and set(value) == {"tool_call"}:
        value = value["tool_call"]
    items = value if isinstance(value, list) else [value]
    calls = [_call(v) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls


def _json_at(text: str, i: int):
    """The JSON value starting at text[i] (after whitespace) and the index past it, or (None, i)."""
    while i < len(text) and text[i].isspace():
        i += 1
    try:
        return _decoder.raw_decode(text, i)
    except ValueError:
        return None, i


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


# ------------------------------------------------------------ the formats
def _hermes(text: str):
    """Hermes/Qwen blocks, <tool_call>{...}</tool_call>, wherever they are: the text around
    them is the content (a model may write a sentence after its call, as llama.cpp's parser
    also allows). A last block or marker cut short (max_tokens) is dropped when whole calls
    came before it; a block that holds no call makes the answer no call at all."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return None
    calls: list[ToolCall] = []
    content = [text[:start]]
    i = start
    while True:
        j = _skip(text, i + len(HERMES_OPEN))
        close = text.find(HERMES_CLOSE, j)
        fenced = _FENCE.match(text[j:close].strip()) if close >= 0 else None
        if fenced:  # a ```json fence inside the block
            value, end = _json_at(fenced.group(1), 0)[0], close
        else:
            value, end = _json_at(text, j)
        found = _calls(value) if value is not None else None
        if found is None:
            if calls and HERMES_CLOSE not in text[j:]:  # a last block cut short (max_tokens): the calls before stand
                break
            return None
        calls += found
        i = _skip(text, end)
        if text.startswith(HERMES_CLOSE, i):
            i += len(HERMES_CLOSE)
        elif i < len(text):
            return None  # something else where the block should close
        following = text.find(HERMES_OPEN, i)
        between = text[i:] if following < 0 else text[i:following]
        if following < 0:  # a next block's marker cut short at the end (max_tokens) is no content
            cut = _marker_prefix(between)
            if cut and HERMES_OPEN.startswith(between[-cut:]):
                between = between[:-cut]
        if between.strip():
            content.append(between)
        if following < 0:
            break
        i = following
    return "".join(content), calls


def _mistral(text: str):
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return None
    i = start + len(MISTRAL_CALLS)
    value, end = _json_at(text, i)
    if value is not None:  # [TOOL_CALLS][{...}, ...]
        calls = _calls(value)
        if calls is None or _skip(text, end) < len(text):
            return None
        return text[:start], calls
    calls = []  # [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}, repeated
    while True:
        args_at = text.find(MISTRAL_ARGS, i)
        if args_at < 0:
            return None
        head = text[i:args_at].strip()
        call_id = None
        if MISTRAL_CALL_ID in head:
            head, call_id = (s.strip() for s in head.split(MISTRAL_CALL_ID, 1))
        value, end = _json_at(text, args_at + len(MISTRAL_ARGS))
        call = _call({"name": head, "arguments": value, "id": call_id}) if isinstance(value, dict) else None
        if call is None:
            return None
        calls.append(call)
        i = _skip(text, end)
        if text.startswith(MISTRAL_CALLS, i):
            i += len(MISTRAL_CALLS)
        elif i == len(text):
            return text[:start], calls
        else:
            return None


def _json_sequence(text: str, i: int) -> list[ToolCall] | None:
    """One or more call values from text[i:] to its end, separated by `;`, `,` or whitespace."""
    calls: list[ToolCall] = []
    while True:
        i = _skip(text, i)
        if i == len(text):
            return calls or None
        value, end = _json_at(text, i)
        found = _calls(value) if value is not None else None
        if found is None:
            return None
        calls += found
        i = _skip(text, end)
        if i < len(text) and text[i] in ";,":
            i += 1


def _python_tag(text: str):
    start = text.find(PYTHON_TAG)
    if start < 0:
        return None
    calls = _json_sequence(text, start + len(PYTHON_TAG))
    return (text[:start], calls) if calls else None


def _bare_json(text: str):
    """Llama 3.x's JSON and the generic fallback: the whole answer is calls (in a ```json fence or not)."""
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    if fenced:
        stripped = fenced.group(1).strip()
    if not stripped.startswith(("{", "[")):
        return None
    calls = _json_sequence(stripped, 0)
    return ("", calls) if calls else None


# ------------------------------------------------------------ streams
class CallSplitter:
    """A stream's text, split as it comes into content to send now and a call to
    parse at the end. `feed(piece)` returns the text that can no longer be part of a
    call; from a marker on (or from the first character, when the answer opens with
    JSON or a code fence) the text is held; `finish()` returns what is held, for
    `parse` (not a call after all: it is content)."""

    def __init__(self):
        self.held = ""  # text not sent yet: a possible marker's start, or the call
        self.holding = False  # a call may have started: hold everything
        self.sent = False  # some text other than whitespace went out as content

    def feed(self, piece: str) -> str:
        if self.holding:
            self.held += piece
            return ""
        text = self.held + piece
        at = min((i for i in (text.find(m) for m in MARKERS) if i >= 0), default=-1)
        if at >= 0:
            self.held, self.holding = text[at:], True
            return self._send(text[:at])
        stripped = text.lstrip()
        if not self.sent:  # the answer's start: JSON or a code fence may be a call
            if not stripped or (len(stripped) < 3 and "```".startswith(stripped)):
                self.held = text  # only whitespace, or maybe a fence: wait and see
                return ""
            if stripped.startswith(("{", "[", "```")):
                self.held, self.holding = text, True
                return ""
        keep = _marker_prefix(text)
        self.held = text[len(text) - keep:] if keep else ""
        return self._send(text[:len(text) - keep])

    def _send(self, text: str) -> str:
        if text.strip():
            self.sent = True
        return text

    def finish(self) -> str:
        held, self.held = self.held, ""
        return held


def _marker_prefix(text: str) -> int:
    """The length of the longest end of `text` that is the start of a marker."""
    best = 0
    for m in MARKERS:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


# ------------------------------------------------------------ forcing a call
def call_text(name: str, arguments: str, fmt: str = HERMES) -> str:
    """One call written in `fmt` (the built-in rendering of an assistant's call in a prompt)."""
    key = "parameters" if fmt == LLAMA3 else "arguments"
    body = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}": {arguments}}}'
    if fmt == HERMES:
        return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"
    if fmt == MISTRAL:
        return f"{MISTRAL_CALLS}[{body}]"
    return body


def call_grammar(functions: list[tuple[str, dict]], fmt: str = HERMES, several: bool = False,
                 json_options: dict | None = None) -> str:
    """An llguidance Lark grammar of an answer that is a call, in `fmt`, of one of `functions`
    ((name, JSON schema of its arguments) pairs), whose arguments conform to that function's
    schema; `several`: one call or more. `json_options`: llguidance's JSON options
    ("x-guidance") for schemas that set none. Mistral's calls are a bare JSON list (its
    [TOOL_CALLS] is a control token, not text a grammar writes)."""
    key = "parameters" if fmt == LLAMA3 else "arguments"
    lines = ["start: " + ('"[" calls "]"' if fmt == MISTRAL else "calls"),
             "calls: call" + ((' (", " call)*' if fmt == MISTRAL else ' ("\\n" call)*') if several else ""),
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, (name, schema) in enumerate(functions):
        head = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}": '
        tail = "}"
        if fmt == HERMES:
            head, tail = f"{HERMES_OPEN}\n" + head, tail + f"\n{HERMES_CLOSE}"
        if json_options and isinstance(schema, dict) and "x-guidance" not in schema:
            schema = dict(schema, **{"x-guidance": json_options})
        lines.append(f"call_{i}: {_lark_string(head)} args_{i} {_lark_string(tail)}")
        lines.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
