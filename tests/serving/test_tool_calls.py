"""Tool calling (issue #28): `tools`, `tool_choice`, `parallel_tool_calls` and a history of
assistant `tool_calls` and `tool` messages.

* the parser (coordinator/text/tool_calls.py) on each format: Hermes/Qwen `<tool_call>`,
  Llama 3.x JSON, Mistral `[TOOL_CALLS]`, the generic JSON fallback; and its stream splitter;
* the grammar that forces a call: what it allows, with a vocabulary of bytes;
* request parsing and rendering (serving/tools.py): 400s naming the field, the built-in
  rendering and a template's own (`tools=` passed to a template that takes them);
* the bundled model through `ggml-coordinator serve`, with the official `openai` client:
  a forced named call whose arguments conform to the schema, `required`, the stream's
  chunks, a two-turn round trip with a tool result, an unknown function, `tools: []`.
"""
from __future__ import annotations

import json

import pytest

from coordinator.serving import chat_templates, openai_api, tools
from coordinator.serving.openai_api import ApiError
from coordinator.text import constrained, tool_calls
from coordinator.text.tool_calls import HERMES, LLAMA3, MISTRAL, CallSplitter, ToolCall, parse

NAMES = ["get_weather", "add"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "The sum of two integers",
                                           "parameters": ADD}}]


def call(name, **args) -> ToolCall:
    return ToolCall(name, json.dumps(args))


# ------------------------------------------------------------ the parser, format by format
@pytest.mark.parametrize("text, content, calls", [
    # Hermes / Qwen
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [call("get_weather", city="Paris")]),
    ('Let me look.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
     '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', "Let me look.\n",
     [call("add", a=1, b=2), call("get_weather")]),
    ('<tool_call>\n```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```\n</tool_call>', None,
     [call("add", a=1, b=2)]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}', None, [call("add", a=1, b=2)]),  # no close
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "add", "argu',
     None, [call("add", a=1, b=2)]),  # a last call cut by max_tokens: the whole ones stand
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_',
     None, [call("add", a=1, b=2)]),  # cut inside the next block's marker
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> Done. <tool_c',
     " Done. ", [call("add", a=1, b=2)]),  # cut inside a marker after some text
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\nThat adds them.',
     "\nThat adds them.", [call("add", a=1, b=2)]),  # a sentence after the call (as llama.cpp's parser allows)
    ('First <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> then '
     '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call> done', "First  then  done",
     [call("add", a=1, b=2), call("get_weather")]),
    # Llama 3.x
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [call("get_weather", city="Paris")]),
    ('<|python_tag|>{"type": "function", "name": "add", "parameters": {"a": 1, "b": 2}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [call("add", a=1, b=2), call("get_weather", city="Oslo")]),
    # Mistral
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "abcdefghi"}]', None,
     [ToolCall("add", '{"a": 1, "b": 2}', "abcdefghi")]),
    ('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_weather[CALL_ID]x1y2z3w4v[ARGS]{"city": "Rome"}', None,
     [call("add", a=1, b=2), ToolCall("get_weather", '{"city": "Rome"}', "x1y2z3w4v")]),
    # the generic fallback
    ('```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```', None, [call("add", a=1, b=2)]),
    ('[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Lima"}}]',
     None, [call("add", a=1, b=2), call("get_weather", city="Lima")]),
    ('{"tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}', None,
     [call("add", a=1, b=2)]),
    ('  {"function": {"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}}\n', None, [call("add", a=3, b=4)]),
])
def test_the_parser_reads_each_format(text, content, calls):
    parsed = parse(text, NAMES)
    assert parsed.calls == calls and parsed.content == content


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '{"city": "Paris"}',  # JSON, not a call
    '{"name": "get_weather", "arguments": {"city": "Paris"}} and then some text',
    '<tool_call>{"name": "send_email", "arguments": {}}</tool_call>',  # not one of the request's functions
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>not json</tool_call>',
    '<tool_call>{"name": "add", "arguments": {}}</tool_call> and <tool_call>not json</tool_call>',
    '[TOOL_CALLS]add',
    '{"name": "add", "arguments": {"a": 1}, "extra": 2}',
])
def test_text_that_is_no_call_stays_content(text):
    parsed = parse(text, NAMES)
    assert parsed.calls == [] and parsed.content == text


def test_without_names_any_function_is_a_call():
    assert parse('<tool_call>{"name": "send_email", "arguments": {}}</tool_call>').calls == [call("send_email")]
    assert parse("").content is None


def test_the_template_says_the_format():
    assert tool_calls.format_of("{% for t in tools %}<tool_call>{% endfor %}") == HERMES
    assert tool_calls.format_of("{{ '[TOOL_CALLS]' }}{{ tools | tojson }}") == MISTRAL
    assert tool_calls.format_of("<|start_header_id|>ipython<|end_header_id|>{{ tools }}") == LLAMA3
    assert tool_calls.format_of("{{ tools }}") == HERMES


def split(pieces: list[str]) -> tuple[str, str]:
    s = CallSplitter()
    sent = "".join(s.feed(p) for p in pieces)
    return sent, s.finish()


@pytest.mark.parametrize("pieces, sent, held", [
    (["Hello", " world", "."], "Hello world.", ""),
    (["Sure.", " <tool", "_call>", '{"name"', ': "add"}', "</tool_call>"], "Sure. ",
     '<tool_call>{"name": "add"}</tool_call>'),
    (["a <to", "day"], "a <today", ""),  # a marker's start that is not one goes out
    (["\n ", '{"na', 'me": 1}'], "", '\n {"name": 1}'),  # JSON first: maybe a call, held
    (["``", "`json\n{}", "\n```"], "", "```json\n{}\n```"),
    (["`x` is", " code"], "`x` is code", ""),
    (["Text {not at the start}"], "Text {not at the start}", ""),
    (["[TOOL_", "CALLS][]"], "", "[TOOL_CALLS][]"),
    (["x<|python_tag|>{}"], "x", "<|python_tag|>{}"),
])
def test_the_stream_splitter_holds_what_may_be_a_call(pieces, sent, held):
    assert split(pieces) == (sent, held)
    assert sent + held == "".join(pieces)


# ------------------------------------------------------------ the grammar of a forced call
@pytest.fixture(scope="module")
def matcher():
    import llguidance
    from test_structured_output import spm_tokenizer
    vocab = constrained.vocabulary(spm_tokenizer())

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(vocab, grammar, log_level=0)
        return m.consume_tokens(vocab.tokenize_bytes(text.encode())) and not m.is_error() and m.is_accepting()
    return accepts


def forced(fmt=HERMES, **body) -> str:
    req = openai_api.parse_chat(dict({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}, **body),
                                1024, 1000, call_format=fmt)
    return req.generation.grammar


def test_a_named_function_forces_one_call_of_it_conforming_to_its_schema(matcher):
    g = forced(tool_choice={"type": "function", "function": {"name": "add"}})
    assert matcher(g, tool_calls.call_text("add", '{"a": 1, "b": 2}'))
    assert not matcher(g, tool_calls.call_text("add", '{"a": 1}'))  # b is required
    assert not matcher(g, tool_calls.call_text("add", '{"a": 1, "b": 2000}'))  # beyond its maximum
    assert not matcher(g, tool_calls.call_text("get_weather", '{"city": "x", "unit": "celsius"}'))
    assert not matcher(g, "Sure: " + tool_calls.call_text("add", '{"a": 1, "b": 2}'))
    two = tool_calls.call_text("add", '{"a": 1, "b": 2}') + "\n" + tool_calls.call_text("add", '{"a": 1, "b": 2}')
    assert not matcher(g, two)


def test_a_forced_calls_object_without_additional_properties_is_closed_to_other_keys(matcher):
    """As users write a schema (no additionalProperties) and as llama.cpp reads it: a 270M model
    filled the open object with junk keys ({"city": "Paris", "type": "object", ...})."""
    open_schema = {"type": "object", "properties": {"city": {"type": "string"},
                                                    "where": {"type": "object", "properties": {"lat": {"type": "number"}}}},
                   "required": ["city"]}
    g = forced(tools=[{"type": "function", "function": {"name": "find", "parameters": open_schema}}],
               tool_choice="required")
    assert matcher(g, tool_calls.call_text("find", '{"city": "Oslo"}'))
    assert matcher(g, tool_calls.call_text("find", '{"city": "Oslo", "where": {"lat": 59.9}}'))
    assert not matcher(g, tool_calls.call_text("find", '{"city": "Oslo", "unit": "c"}'))
    assert not matcher(g, tool_calls.call_text("find", '{"city": "Oslo", "where": {"lat": 1, "lon": 2}}'))
    free = dict(open_schema, additionalProperties={"type": "integer"})  # a schema that allows others is kept
    g = forced(tools=[{"type": "function", "function": {"name": "find", "parameters": free}}], tool_choice="required")
    assert matcher(g, tool_calls.call_text("find", '{"city": "Oslo", "n": 3}'))
    assert not matcher(g, tool_calls.call_text("find", '{"city": "Oslo", "n": "x"}'))


def test_required_forces_a_call_of_any_function_and_several_only_when_parallel(matcher):
    g = forced(tool_choice="required")
    weather = tool_calls.call_text("get_weather", '{"city": "Oslo", "unit": "celsius"}')
    add = tool_calls.call_text("add", '{"a": 1, "b": 2}')
    assert matcher(g, weather) and matcher(g, add) and not matcher(g, weather + "\n" + add)
    assert not matcher(g, tool_calls.call_text("get_weather", '{"city": "Oslo", "unit": "kelvin"}'))
    g = forced(tool_choice="required", parallel_tool_calls=True)
    assert matcher(g, weather + "\n" + add)


def test_the_forced_call_follows_the_templates_format(matcher):
    args = '{"a": 1, "b": 2}'
    llama = forced(LLAMA3, tool_choice="required")
    assert matcher(llama, '{"name": "add", "parameters": ' + args + "}")
    assert not matcher(llama, tool_calls.call_text("add", args))
    mistral = forced(MISTRAL, tool_choice="required", parallel_tool_calls=True)
    assert matcher(mistral, '[{"name": "add", "arguments": ' + args + '}, {"name": "add", "arguments": ' + args + "}]")
    for fmt, grammar in ((HERMES, forced(tool_choice="required")), (LLAMA3, llama)):
        assert parse(tool_calls.call_text("add", args, fmt), NAMES).calls == [ToolCall("add", args)]
    assert parse('[{"name": "add", "arguments": ' + args + "}]", NAMES).calls == [ToolCall("add", args)]


def test_auto_and_none_force_nothing():
    assert forced() is None and forced(tool_choice="auto") is None and forced(tool_choice="none") is None


# ------------------------------------------------------------ request parsing
def chat(**body):
    return openai_api.parse_chat(dict({"messages": [{"role": "user", "content": "x"}]}, **body), 1024, 1000)


@pytest.mark.parametrize("body, param, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'tool_choice' names function 'nope', which is not in 'tools' (they list 'get_weather', 'add')"),
    ({"tool_choice": "required"}, "tool_choice", "'tool_choice' is \"required\" but 'tools' lists no function"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "lists no function"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'tool_choice' must be \"none\", \"auto\""),
    ({"tools": {"a": 1}}, "tools", "'tools' must be a list"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "'tools[0]': only tools of type \"function\""),
    ({"tools": [{"type": "function"}]}, "tools", "'tools[0]': a function tool needs 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "'function.name' must be"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools", "'tools[1]': a second function named 'add'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools",
     "'function.parameters' must be a JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools", "'tools': a function's 'parameters' is not a JSON schema"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "give one"),
    ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos", "forced tool call"),
])
def test_bad_tool_fields_are_400s_naming_the_field(body, param, message):
    with pytest.raises(ApiError) as e:
        chat(**body)
    assert e.value.status == 400 and e.value.param == param and message in e.value.message, e.value.message


def test_tool_fields_asking_nothing():
    for body in ({}, {"tools": []}, {"tools": [], "tool_choice": "none"}, {"tools": [], "tool_choice": "auto"},
                 {"tools": TOOLS, "tool_choice": "none"}, {"tools": None, "tool_choice": None}):
        assert not chat(**body).tools.active, body
    assert chat(tools=TOOLS).tools.choice == "auto" and chat(tools=TOOLS).tools.active
    assert not chat(tools=TOOLS).tools.parallel and chat(tools=TOOLS, parallel_tool_calls=True).tools.parallel


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": None, "tool_calls": []}], "non-empty list of {role, content}"),
    ([{"role": "user", "content": "x", "tool_calls": [HISTORY[1]["tool_calls"][0]]}],
     "messages[0]: only assistant messages have 'tool_calls'"),
    ([HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]}],
     "messages[1].tool_calls[0] must be"),
    ([HISTORY[0], HISTORY[1], {"role": "tool", "content": "x"}], "messages[2]: a tool message needs the "
                                                                  "'tool_call_id'"),
])
def test_bad_history_is_a_400(messages, message):
    with pytest.raises(ApiError) as e:
        chat(messages=messages)
    assert e.value.param == "messages" and message in e.value.message, e.value.message


def gemma_fallback():
    from coordinator.model.architectures import gemma3
    return chat_templates.select(None, None, "gemma3", gemma3.FALLBACK_CHAT_TEMPLATE)


def test_the_built_in_rendering_describes_tools_and_writes_the_history_in_hermes_format():
    req = chat(messages=HISTORY + [{"role": "tool", "tool_call_id": "call_2", "content": "(more)"}], tools=TOOLS,
               tool_choice={"type": "function", "function": {"name": "add"}})
    template = gemma_fallback()
    assert not tools.takes_tools(template) and tools.call_format(template) == HERMES
    text = openai_api.chat_prompt(template, req.messages, "<bos>", "", {}, req.tools)
    assert json.dumps(TOOLS[1]) in text and "<tool_call>" in text and "Call the function add now." in text
    assert ('<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call><end_of_turn>\n<start_of_turn>user\n<tool_response>\n18 C, sunny\n'
            '</tool_response>\n<tool_response>\n(more)\n</tool_response><end_of_turn>\n<start_of_turn>model\n') in text
    none = openai_api.chat_prompt(template, req.messages, "<bos>", "", {}, chat(tools=TOOLS, tool_choice="none").tools)
    assert "<tools>" not in none and "<tool_response>" in none  # no tools, the history still rendered


QWEN_LIKE = (  # the shape of Qwen 2.5's template: tools in the system turn, calls' arguments with tojson
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools>\nReturn <tool_call></tool_call> blocks.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_a_template_that_takes_tools_gets_them_and_the_calls_as_objects(tmp_path):
    path = tmp_path / "qwen.jinja"
    path.write_text(QWEN_LIKE)
    template = chat_templates.chosen(str(path))
    assert tools.takes_tools(template) and tools.call_format(template) == HERMES
    req = chat(messages=HISTORY, tools=TOOLS)
    text = openai_api.chat_prompt(template, req.messages, "", "", {}, req.tools)
    assert '\n{"type": "function", "function": {"name": "add", "description": "The sum of two integers"' in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
            in text)  # the arguments an object (HF's tojson), not a JSON string in a string
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text and "You can call functions" not in text
    assert "<tools>" not in openai_api.chat_prompt(template, req.messages, "", "", {},
                                                   chat(tools=TOOLS, tool_choice="none").tools)


# ------------------------------------------------------------ the real model, through `serve`
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from http_helpers import served
    yield from served(tmp_path_factory, "--parallel", "2", "--ctx-per-slot", "1024")


@pytest.fixture(scope="module")
def client(server):
    from http_helpers import openai_client
    return openai_client(server, timeout=300)


ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def conforming(tool_call, schemas: dict) -> dict:
    assert tool_call.type == "function" and tool_call.id.startswith("call_")
    args = json.loads(tool_call.function.arguments)
    jsonschema.validate(args, schemas[tool_call.function.name])
    return args


@pytest.mark.system
def test_client_a_named_function_is_called_with_conforming_arguments(client):
    for seed, temperature in ((1, 0.0), (2, 1.0)):
        r = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, max_tokens=120, seed=seed,
                                           temperature=temperature,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [tc] = choice.message.tool_calls
        assert tc.function.name == "add"
        conforming(tc, {"add": ADD})


@pytest.mark.system
def test_client_required_returns_a_call_of_a_listed_function(client):
    r = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=120, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    conforming(choice.message.tool_calls[0], {"get_weather": WEATHER, "add": ADD})


@pytest.mark.system
def test_client_streamed_call_chunks(client):
    chunks = list(client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, tool_choice="required",
                                                 max_tokens=120, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and not any(finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    calls = [d.tool_calls for d in deltas if d.tool_calls]
    assert not any(d.content for d in deltas)  # the call is no content
    head, *rest = calls
    assert head[0].index == 0 and head[0].id.startswith("call_") and head[0].type == "function"
    assert head[0].function.name in ("get_weather", "add") and head[0].function.arguments == ""
    assert all(c[0].index == 0 and c[0].id is None for c in rest)
    args = json.loads("".join(c[0].function.arguments for c in rest))
    jsonschema.validate(args, {"get_weather": WEATHER, "add": ADD}[head[0].function.name])


@pytest.mark.system
def test_client_two_turns_with_a_tool_result(client):
    first = client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    [tc] = message.tool_calls
    assert conforming(tc, {"get_weather": WEATHER})["unit"] in ("celsius", "fahrenheit")
    history = ASK + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": "18 degrees celsius and sunny"}]
    # the history as the client sends it: the assistant's content left out, its call's arguments a JSON string
    assert "content" not in history[1] and isinstance(history[1]["tool_calls"][0]["function"]["arguments"], str)
    final = client.chat.completions.create(model="any", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=40, temperature=0)
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str) and choice.message.content
    auto = client.chat.completions.create(model="any", messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")  # the model's choice, parsed
    assert auto.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and its result are in the prompt


@pytest.mark.system
def test_client_unknown_function_and_empty_tools(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=ASK, tools=TOOLS, max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "send_email"}})
    assert e.value.body["param"] == "tool_choice" and "'send_email'" in e.value.body["message"]
    r = client.chat.completions.create(model="any", messages=ASK, tools=[], max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


# ------------------------------------------------------------ a stream's chunks, without a server
def stream_chunks(pieces: list[str], finish: str = "stop", **body) -> list[dict]:
    from coordinator.serving.batching import SlotEvent
    from coordinator.serving.http_server import _Answer

    req = chat(tools=TOOLS, **body)
    reply = openai_api.CompletionReply("chatcmpl-x", 0, "m", True)
    answer = _Answer(reply, req.generation, True, None, 3, lambda t: b"", req.tools if req.tools.active else None)
    events = [SlotEvent("text", p) for p in pieces] + [SlotEvent("done", finish_reason=finish)]
    return [c for ev in events for c in answer.chunks(0, ev)]


def test_stream_text_then_a_call_as_openai_sends_them():
    chunks = stream_chunks(["Let me ", "check. <tool", '_call>{"name": "add", ', '"arguments": {"a": 1, "b": 2}}',
                            "</tool_call>"])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check. "
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "add", "arguments": ""}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"a": 1, "b": 2}'}}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls" and deltas[-1] == {}


def test_stream_text_that_is_no_call_is_content_with_its_finish_reason():
    chunks = stream_chunks(['{"city": ', '"Paris"}'], "length")
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    two = stream_chunks(['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                         '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'])
    assert sum(1 for c in two if c["choices"][0]["delta"].get("tool_calls")) == 2  # one call: parallel is off
    two = stream_chunks(['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                         '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'], parallel_tool_calls=True)
    indexes = [c["choices"][0]["delta"]["tool_calls"][0]["index"] for c in two
               if c["choices"][0]["delta"].get("tool_calls")]
    assert indexes == [0, 0, 1, 1]
