"""Chat templates: which one renders /v1/chat/completions, and where it came from.

In order: `--chat-template` (a built-in name below, or a path to a Jinja
template file), else the GGUF's own `tokenizer.chat_template`, else the
architecture's generic fallback (model/architectures/<arch>.py FALLBACK_CHAT_TEMPLATE),
which is what a base model without a template gets: the server then warns at
start that chat will mostly continue the user's text.

Templates are HF-style Jinja (messages, add_generation_prompt, bos_token,
eos_token, tools, raise_exception, strftime_now, HF's `tojson`), rendered in a sandbox: a template
may come from a model file. The built-ins are written here from the
published formats of each family.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import jinja2

# name -> Jinja source
BUILTIN = {
    "chatml": (  # Qwen, Yi, OpenHermes, ...
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "gemma": (  # no system role: system text opens the first user turn
        "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% set ns.system = ns.system + (m['content'] | trim) + '\n\n' %}"
        "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
        "{% if m['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
        "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "phi3": (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"),
    "mistral": (  # [INST] turns; a system message goes before the next user text
        "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] + '\n\n' %}"
        "{% elif m['role'] == 'user' %}[INST] {{ ns.system }}{{ m['content'] }} [/INST]{% set ns.system = '' %}"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
}
MAX_FILE_BYTES = 1 << 20


class ChatTemplateError(ValueError):
    """--chat-template names no built-in and no usable template file."""


@dataclass(frozen=True)
class ChatTemplate:
    name: str  # a built-in's name, the file's path, "model", or "<arch>-fallback"
    source: str  # "builtin", "file", "gguf" (the model's tokenizer.chat_template) or "fallback"
    text: str
    template: jinja2.Template


def sandbox() -> jinja2.Environment:
    """What HF-style chat templates expect: a sandbox (the template comes
    from the model file), raise_exception and strftime_now."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # HF's: plain json.dumps (jinja's own escapes <, >, & and ' for HTML, which a prompt must not get)
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), autoescape=False, keep_trailing_newline=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: time.strftime(fmt))
    env.filters["tojson"] = tojson
    return env


def _compiled(name: str, source: str, text: str) -> ChatTemplate:
    try:
        return ChatTemplate(name, source, text, sandbox().from_string(text))
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template {name}: not a valid Jinja template: line {exc.lineno}: "
                                f"{exc.message}") from None


def chosen(choice: str) -> ChatTemplate:
    """The template `--chat-template choice` names: a built-in, or a Jinja file."""
    if choice in BUILTIN:
        return _compiled(choice, "builtin", BUILTIN[choice])
    if not os.path.isfile(choice):
        raise ChatTemplateError(f"--chat-template {choice!r} is neither a built-in template "
                                f"({', '.join(sorted(BUILTIN))}) nor a template file")
    try:
        with open(choice, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ChatTemplateError(f"--chat-template {choice!r}: cannot read it: {exc.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ChatTemplateError(f"--chat-template {choice!r}: larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"--chat-template {choice!r}: not UTF-8 text ({exc.reason} at byte "
                                f"{exc.start})") from None
    return _compiled(choice, "file", text)


def select(choice: str | None, gguf_template: str | None, arch: str, fallback: str) -> ChatTemplate:
    """The template chat uses: `choice` (--chat-template) if given, else the
    model's own, else `arch`'s generic fallback."""
    if choice:
        return chosen(choice)
    if gguf_template:
        return _compiled("model", "gguf", gguf_template)
    return _compiled(f"{arch}-fallback", "fallback", fallback)
