"""llama-server's own endpoints that llama.cpp clients call next to the OpenAI
API (/tokenize, /detokenize, /props, /slots): their bodies, without I/O, errors
OpenAI-shaped as openai_api.py's."""
from __future__ import annotations

from dataclasses import dataclass

from coordinator.serving.chat_templates import ChatTemplate
from coordinator.serving.openai_api import ApiError, token_ids, typed_param


@dataclass(frozen=True)
class TokenizeRequest:
    content: str
    add_special: bool  # BOS and the like (default false)
    parse_special: bool  # special tokens' text as those tokens (default true)


def parse_tokenize(body: dict) -> TokenizeRequest:
    """{content, add_special, parse_special}."""
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError(400, "'content' must be a string", param="content")
    return TokenizeRequest(content, typed_param(body, "add_special", bool, False),
                           typed_param(body, "parse_special", bool, True))


def parse_detokenize(body: dict, n_vocab: int) -> list[int]:
    """{tokens}: ids in the vocabulary."""
    return token_ids(body.get("tokens"), "tokens", n_vocab)


def props(model: str, n_slots: int, n_ctx_slot: int, chat: ChatTemplate, version: str) -> dict:
    """What llama-server's /props tells (the fields that apply here)."""
    return {"model_alias": model, "total_slots": n_slots, "default_generation_settings": {"n_ctx": n_ctx_slot},
            "chat_template": chat.text, "chat_template_name": chat.name, "chat_template_source": chat.source,
            "build_info": f"ggml-distributed {version}"}


def slots(n_slots: int, n_ctx_slot: int, busy: dict[int, dict]) -> list[dict]:
    """llama-server's /slots (the fields that apply here): one entry per slot, `busy`
    mapping the id of a slot decoding a request to its n_prompt_tokens, n_decoded, n_remain."""
    out = []
    for i in range(n_slots):
        state = busy.get(i)
        out.append({"id": i, "n_ctx": n_ctx_slot, "is_processing": state is not None,
                    "n_prompt_tokens": state["n_prompt_tokens"] if state else 0,
                    "next_token": {"n_decoded": state["n_decoded"] if state else 0,
                                   "n_remain": state["n_remain"] if state else 0}})
    return out
