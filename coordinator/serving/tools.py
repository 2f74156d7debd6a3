"""Tool calling's request side (issue #28), without I/O: `tools`, `tool_choice` and
`parallel_tool_calls` as a `Tools` (`parse`, or a `Refused` naming the field), a
history's assistant `tool_calls` and `tool` messages checked (`check_history`),
the messages and variables a chat template renders (`template_input`), and the
grammar that forces a call (`grammar`).

Rendering: a chat template that uses a `tools` variable (the model's own, e.g.
Qwen's, Llama 3.1's, Mistral's) gets `tools` as HF templates expect them
(`[{"type": "function", "function": {...}}]`) and the history as the request
gives it, with each call's `arguments` as an object. Any other template gets
the built-in rendering: a system message describing the tools and the Hermes
format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), earlier calls
written in that format in the assistant's text, and tool results as a user turn
of `<tool_response>` blocks. `tool_choice: none` renders no tools.

`required` and a named function are constrained decoding: an llguidance grammar
of a call, in the format the template teaches (coordinator/text/tool_calls.py),
whose arguments follow the function's schema. The model's answer is parsed back
(tool_calls.parse) in every case but `none`.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import jinja2.meta

from coordinator.serving.chat_templates import ChatTemplate, sandbox
from coordinator.text import constrained, tool_calls

NONE, AUTO, REQUIRED, FUNCTION = "none", "auto", "required", "function"  # Tools.choice
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (a dot too: some clients namespace)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class Refused(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A request's tools: each function as {"name", "description"?, "parameters"?, "strict"?}."""
    functions: tuple = ()
    choice: str = NONE  # NONE, AUTO, REQUIRED or FUNCTION (then `name`)
    name: str | None = None
    parallel: bool = False  # parallel_tool_calls: more than one call in an answer (llama-server's default: no)

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    @property
    def active(self) -> bool:
        """Tools are rendered and the answer is parsed for calls."""
        return bool(self.functions) and self.choice != NONE

    @property
    def forced(self) -> bool:
        return self.active and self.choice in (REQUIRED, FUNCTION)

    def openai_tools(self) -> list[dict]:
        """The tools as OpenAI's request (and HF templates) spell them."""
        return [{"type": "function", "function": dict(f)} for f in self.functions]


# ------------------------------------------------------------ the request fields
def parse(body: dict) -> Tools:
    functions = _functions(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = False
    if not isinstance(parallel, bool):
        raise Refused("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    choice, name = _choice(body.get("tool_choice"), functions)
    return Tools(tuple(functions), choice, name, parallel)


def _functions(value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise Refused("'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    out, seen = [], set()
    for i, tool in enumerate(value):
        where = f"'tools[{i}]'"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise Refused(f"{where}: only tools of type \"function\" are supported, not {kind!r}", "tools")
        f = tool.get("function")
        if not isinstance(f, dict):
            raise Refused(f"{where}: a function tool needs 'function': {{\"name\": ..., \"parameters\": {{...}}}}",
                          "tools")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise Refused(f"{where}: 'function.name' must be 1 to 64 letters, digits, '_', '-' or '.', not "
                          f"{name!r}", "tools")
        if name in seen:
            raise Refused(f"{where}: a second function named {name!r}", "tools")
        seen.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise Refused(f"{where}: 'function.description' must be a string", "tools")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise Refused(f"{where}: 'function.parameters' must be a JSON schema (an object)", "tools")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise Refused(f"{where}: 'function.strict' must be a boolean", "tools")
        unknown = sorted(set(f) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise Refused(f"{where}: unknown field(s) of 'function': {', '.join(unknown)}", "tools")
        out.append({k: f[k] for k in ("name", "description", "parameters", "strict") if f.get(k) is not None})
    return out


def _choice(value, functions: list[dict]) -> tuple[str, str | None]:
    if value is None:
        return (AUTO if functions else NONE), None
    if value in (NONE, AUTO, REQUIRED):
        if value == REQUIRED and not functions:
            raise Refused("'tool_choice' is \"required\" but 'tools' lists no function", "tool_choice")
        return value, None
    if (isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict)
            and isinstance(value["function"].get("name"), str)):
        name = value["function"]["name"]
        if name not in [f["name"] for f in functions]:
            listed = ", ".join(repr(f["name"]) for f in functions) or "none"
            raise Refused(f"'tool_choice' names function {name!r}, which is not in 'tools' (they list {listed})",
                          "tool_choice")
        return FUNCTION, name
    raise Refused("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                  "\"function\": {\"name\": ...}}", "tool_choice")


# ------------------------------------------------------------ the history
def is_call_message(m: dict) -> bool:
    """An assistant message whose content may be null: it holds tool calls."""
    return m.get("role") == "assistant" and bool(m.get("tool_calls")) and m.get("content") is None


def check_history(messages: list[dict]) -> None:
    """Assistant `tool_calls` ({id, type: function, function: {name, arguments}}) and `tool`
    messages (a `tool_call_id`) as OpenAI spells them."""
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant":
                raise Refused(f"{where}: only assistant messages have 'tool_calls'", "messages")
            if not isinstance(calls, list):
                raise Refused(f"{where}.tool_calls must be a list", "messages")
            for j, call in enumerate(calls):
                f = call.get("function") if isinstance(call, dict) else None
                if not (isinstance(f, dict) and isinstance(f.get("name"), str)
                        and isinstance(f.get("arguments"), (str, dict))
                        and call.get("type", "function") == "function"
                        and isinstance(call.get("id", ""), str)):
                    raise Refused(f"{where}.tool_calls[{j}] must be {{\"id\": ..., \"type\": \"function\", "
                                  f"\"function\": {{\"name\": ..., \"arguments\": \"<JSON text>\"}}}}", "messages")
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise Refused(f"{where}: a tool message needs the 'tool_call_id' of the call it answers", "messages")


def _arguments_object(arguments):
    """A call's arguments as an object (what HF templates write with `tojson`), when they are JSON."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def _arguments_text(arguments) -> str:
    if isinstance(arguments, str):
        value = _arguments_object(arguments)
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else arguments
    return json.dumps(arguments, ensure_ascii=False)


# ------------------------------------------------------------ rendering
@functools.lru_cache(maxsize=16)
def _variables(text: str) -> frozenset:
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(sandbox().parse(text)))
    except jinja2.TemplateError:
        return frozenset()


def takes_tools(chat: ChatTemplate) -> bool:
    """The template renders a `tools` variable (the model's own tool format)."""
    return "tools" in _variables(chat.text)


def call_format(chat: ChatTemplate) -> str:
    """The format calls are forced in: the template's own, or the built-in (Hermes)."""
    return tool_calls.format_of(chat.text) if takes_tools(chat) else tool_calls.HERMES


def template_input(chat: ChatTemplate, messages: list[dict], tools: Tools) -> tuple[list[dict], dict]:
    """The messages and extra variables `chat` renders for this request's tools and history."""
    if takes_tools(chat):
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = dict(m, content=m.get("content") or "", tool_calls=[
                    dict(c, type="function", function=dict(c["function"],
                                                           arguments=_arguments_object(c["function"]["arguments"])))
                    for c in m["tool_calls"]])
            out.append(m)
        return out, ({"tools": tools.openai_tools()} if tools.active else {})
    out: list[dict] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [tool_calls.call_text(c["function"]["name"], _arguments_text(c["function"]["arguments"]))
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([m["content"]] if m.get("content") else [])
                                                                   + calls)})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # results of one answer's calls: one user turn
                out[-1] = dict(out[-1], content=out[-1]["content"] + "\n" + block)
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append(m)
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    if tools.active:
        text = system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{text}")
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, {}


def system_prompt(tools: Tools) -> str:
    """The built-in description of the tools and of how to call them (Hermes's format)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.openai_tools())
    lines = ["You can call functions (tools) to help answer. They are listed here, each with a JSON schema of its "
             "arguments:", "<tools>", listed, "</tools>",
             "To call a function, answer with a JSON object of its name and arguments in <tool_call></tool_call> "
             "tags, like this:",
             tool_calls.call_text("<function name>", "{<arguments as JSON>}"),
             "The result comes back in <tool_response></tool_response> tags."]
    if tools.choice == FUNCTION:
        lines.append(f"Call the function {tools.name} now.")
    elif tools.choice == REQUIRED:
        lines.append("Call at least one of these functions now.")
    else:
        lines.append("Call a function only when it helps; otherwise answer in plain text.")
    if not tools.parallel:
        lines.append("Call at most one function in an answer.")
    return "\n".join(lines)


# ------------------------------------------------------------ forcing a call
def grammar(tools: Tools, fmt: str) -> str | None:
    """The llguidance grammar of a call `tool_choice` forces (None for none and auto)."""
    if not tools.forced:
        return None
    chosen = [f for f in tools.functions if tools.choice == REQUIRED or f["name"] == tools.name]
    several = tools.choice == REQUIRED and tools.parallel
    text = tool_calls.call_grammar([(f["name"], constrained.closed_objects(f.get("parameters") or NO_PARAMETERS))
                                    for f in chosen], fmt, several,
                                   constrained.JSON_OPTIONS)
    try:
        return constrained.compile_grammar("lark", text)
    except (ValueError, TypeError) as exc:
        raise Refused(f"'tools': a function's 'parameters' is not a JSON schema the call can be held to: {exc}",
                      "tools") from None
