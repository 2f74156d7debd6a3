"""Byte-level BPE tokenizer for GGUF vocabularies (``tokenizer.ggml.model == "gpt2"``).

Llama 3, Qwen 2/2.5/3, DeepSeek, GPT-2, Falcon, StarCoder, Command-R, MPT, ... ship a
BPE vocabulary: ``tokenizer.ggml.tokens`` (pieces in GPT-2's byte-to-unicode alphabet),
``tokenizer.ggml.merges`` (ranked "left right" pairs) and ``tokenizer.ggml.pre``, the
name of the pre-tokenizer that cuts text into words before merging. Token-for-token
agreement with llama.cpp is the goal; llama.cpp's own vocabulary fixtures are the test
(tests/coordinator/test_tokenizer_fixtures.py).

What this module adds to the shared machinery of :class:`coordinator.text.tokenizer.Tokenizer`
(special-token partition, BOS/EOS, EOG detection, decoding, streaming):

* a table from each supported ``pre`` name to its pre-tokenizer: the split regexes (and
  digit / punctuation splitters) of the model family's tokenizer.json, followed by the
  GPT-2 byte-to-unicode mapping;
* the BPE merge step itself, done by the Rust ``tokenizers`` package (PyPI), whose
  ``BPE`` model and ``Split``/``ByteLevel``/``Digits``/``Punctuation`` pre-tokenizers are
  assembled in memory from the GGUF's tokens and merges (no tokenizer.json, no hub);
* byte-level decoding of pieces back to bytes (partial UTF-8 is held back by the
  streaming :class:`~coordinator.text.tokenizer.Detokenizer`).

Why the Rust library rather than a pure-Python merge loop (measured with
bench/bench_tokenizer.py, which carries such a loop as its baseline: the ``regex``
package for \\p{..} classes, GPT-2-style merging, a per-word cache; it agrees with
llama.cpp on the Llama 3 and Qwen 2 fixtures):

* on ordinary text the two are equally fast: 100 KB of this repository's docs encode
  in ~0.05 s either way (~600k tokens/s with the Llama 3 vocabulary), because the
  word cache makes most Python merges lookups and Oniguruma's pre-tokenization
  dominates the Rust side;
* the worst case is not: a merge loop that rescans a word per merge is quadratic in
  the word's length, and a prompt is untrusted input. One 8000-letter word takes
  ~1.8 s in Python and 4 ms in Rust (which merges with a priority queue);
* the Rust ``tokenizers`` produced llama.cpp's reference ids in the first place, so
  its Split/Digits/Punctuation/ByteLevel pre-tokenizers take the tokenizer.json
  recipes as they are; re-creating them by hand is where a pure-Python path slips
  (the baseline's Punctuation class misses one Falcon case).

Special tokens are never handed to the Rust side: user-defined tokens are always split
out first, control tokens only with ``parse_special=True`` (as llama.cpp does), and only
the plain-text fragments in between go through pre-tokenization and BPE.

Also handled: ``tokenizer.ggml.model == "gemma4"``, llama.cpp's "SPM-style BPE" (Gemma 4):
spaces become U+2581, text is cut only at newlines, merges run on raw UTF-8 and
characters outside the vocabulary fall back to ``<0xXX>`` byte tokens.

Deliberate difference from llama.cpp: ``decode`` returns exactly the bytes of the pieces
and does not apply llama.cpp's ``clean_spaces`` post-processing (" ," -> ","), so that
decode(encode(text)) == text and streaming gives the same text as a one-shot decode.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from coordinator.text.tokenizer import (
    SPACE_ESCAPE,
    TOKEN_TYPE_NORMAL,
    Tokenizer,
    as_list,
    eot_by_text,
)

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- pre-tokenizers
#
# Regexes as written in the model families' tokenizer.json files (Hugging Face
# "Split" pre-tokenizers, behavior "Isolated"). Each regex cuts every piece produced so
# far into its matches and the text between them.

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Non-ASCII characters are written as escapes: the ranges below start or end at
# characters that Unicode normalization would silently rewrite in an editor.
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"

# A pre-tokenizer is a list of steps:
#   ("split", regex)      Split(regex, "isolated")
#   ("digits", bool)      Digits(individual_digits=bool)
#   ("punct",)            Punctuation("contiguous")
#   ("bytelevel", bool)   ByteLevel(add_prefix_space=False, use_regex=bool); added at the
#                         end with use_regex=False when a spec has none of its own.
_PRE_SPECS: dict[str, list[tuple]] = {
    # GPT-2's own byte-level regex (tokenizer.json: ByteLevel with use_regex=true).
    "gpt-2": [("bytelevel", True)],
    "mpt": [("bytelevel", True)],  # GPT-NeoX tokenizer
    # Digits one by one, then GPT-2's regex.
    "starcoder": [("digits", True), ("bytelevel", True)],
    "refact": [("digits", True), ("bytelevel", True)],
    "command-r": [("digits", True), ("bytelevel", True)],
    "falcon": [("punct",), ("bytelevel", True), ("digits", False), ("split", "[0-9][0-9][0-9]")],
    "llama3": [("split", _LLAMA3)],
    "qwen2": [("split", _QWEN2)],
    "qwen35": [("split", _QWEN35)],
    "deepseek-llm": [("split", "[\r\n]"), ("split", _DEEPSEEK_LETTERS),
                     ("split", _DEEPSEEK_PUNCT), ("split", "\\s+$"),
                     ("split", _CJK), ("digits", True)],
    "deepseek-coder": [("split", "[\r\n]"), ("split", "\\s?\\p{L}+"), ("split", "\\s?\\p{P}+"),
                       ("split", _CJK), ("digits", True)],
    # llama.cpp's fallback for a GGUF without tokenizer.ggml.pre ("default").
    "default": [("split", r"[\p{P}\$\+<=>\^~\|]+"), ("split", _GPT2[:-4]),
                ("split", r"\p{N}+"), ("split", "[0-9][0-9][0-9]")],
}

# tokenizer.ggml.pre names -> (spec name, ignore_merges, add_bos default). The aliases
# are the names llama.cpp maps onto the same pre-tokenizer.
_PRE_NAMES: dict[str, tuple[str, bool, bool]] = {
    "default": ("default", False, False),
    "gpt-2": ("gpt-2", False, False),
    "phi-2": ("gpt-2", False, False),
    "mpt": ("mpt", False, False),
    "olmo": ("gpt-2", False, False),
    "starcoder": ("starcoder", False, False),
    "refact": ("refact", False, False),
    "command-r": ("command-r", False, False),
    "smollm": ("starcoder", False, False),
    "codeshell": ("starcoder", False, False),
    "falcon": ("falcon", False, False),
    "llama3": ("llama3", True, True),
    "llama-v3": ("llama3", True, True),
    "llama-bpe": ("llama3", True, True),
    "falcon3": ("llama3", True, True),
    "dbrx": ("llama3", False, False),
    "smaug-bpe": ("llama3", False, False),
    "qwen2": ("qwen2", False, False),
    "deepseek-r1-qwen": ("qwen2", False, False),
    "stablelm2": ("qwen2", False, False),
    "megrez": ("qwen2", False, False),
    "qwen35": ("qwen35", False, False),
    "deepseek-llm": ("deepseek-llm", False, False),
    "deepseek-coder": ("deepseek-coder", False, False),
}

SUPPORTED_PRE = tuple(sorted(_PRE_NAMES))
SUPPORTED_MODELS = ("llama", "gpt2", "gemma4")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space,
    0x7F-0xA0, 0xAD) are mapped in order onto U+0100, U+0101, ...
    """
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ImportError("BPE vocabularies need the 'tokenizers' package "
                          "(pip install 'tokenizers>=0.20,<1')") from exc
    return tokenizers


class BPETokenizer(Tokenizer):
    """llama.cpp-compatible BPE tokenizer (byte-level GPT-2 style, or Gemma 4's SPM style).

    Shares partitioning, BOS/EOS handling, EOG detection, decoding and streaming with
    the SPM :class:`Tokenizer`; replaces the per-fragment segmentation and the way
    normal pieces turn back into bytes.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int],
        pre: str,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool | None = None,
        add_eos: bool = False,
        eot_id: int | None = None,
        pad_id: int | None = None,
        unk_id: int | None = None,
        model: str = "gpt2",
    ) -> None:
        if model not in ("gpt2", "gemma4"):
            raise ValueError(f"BPETokenizer handles tokenizer models 'gpt2' and 'gemma4', not {model!r}")
        self.model = model
        if model == "gemma4":
            spec_name, ignore_merges, bos_default = "gemma4", False, True
        else:
            if pre not in _PRE_NAMES:
                raise ValueError(
                    f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: "
                    f"{', '.join(SUPPORTED_PRE)}")
            spec_name, ignore_merges, bos_default = _PRE_NAMES[pre]
        self.pre = pre
        if add_bos is None:
            add_bos = bos_default
        if model == "gemma4":
            add_bos = True  # llama.cpp forces BOS on for Gemma 4 vocabularies
        super().__init__(
            tokens=tokens, scores=[0.0] * len(tokens), token_types=token_types,
            bos_id=bos_id, eos_id=eos_id, unk_id=unk_id, add_bos=add_bos, add_eos=add_eos,
            add_space_prefix=False, eot_id=eot_id, pad_id=pad_id,
        )
        self.merges = list(merges)
        self.ignore_merges = ignore_merges
        self._byte_level = model == "gpt2"
        self._hf = self._build(spec_name)

    # ------------------------------------------------------------------ construction

    def _build(self, spec_name: str):
        tk = _import_tokenizers()
        from tokenizers import Regex, models, normalizers, pre_tokenizers

        vocab: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            vocab[t] = i  # a later duplicate wins, as in llama.cpp
        merges: list[tuple[str, str]] = []
        dropped = 0
        for m in self.merges:
            # llama.cpp splits at the first space after position 0 (a piece may be " ").
            pos = m.find(" ", 1)
            if pos < 0:
                dropped += 1
                continue
            left, right = m[:pos], m[pos + 1:]
            if left in vocab and right in vocab and left + right in vocab:
                merges.append((left, right))
            else:
                dropped += 1  # a merge that can only produce out-of-vocabulary text
        if dropped:
            log.warning("BPE vocabulary: ignored %d merges whose pieces are not in the vocabulary", dropped)

        bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=self.ignore_merges,
                         byte_fallback=not self._byte_level)
        hf = tk.Tokenizer(bpe)
        if spec_name == "gemma4":
            hf.normalizer = normalizers.Replace(" ", SPACE_ESCAPE)
            hf.pre_tokenizer = pre_tokenizers.Split(Regex("[^\n]+|[\n]+"), behavior="isolated")
            return hf

        steps = []
        has_bytelevel = False
        for step in _PRE_SPECS[spec_name]:
            kind = step[0]
            if kind == "split":
                steps.append(pre_tokenizers.Split(Regex(step[1]), behavior="isolated"))
            elif kind == "digits":
                steps.append(pre_tokenizers.Digits(individual_digits=step[1]))
            elif kind == "punct":
                steps.append(pre_tokenizers.Punctuation(behavior="contiguous"))
            elif kind == "bytelevel":
                steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=step[1]))
                has_bytelevel = True
            else:  # pragma: no cover - table typo
                raise AssertionError(kind)
        if not has_bytelevel:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
        return hf

    @classmethod
    def from_gguf_fields(cls, get: Callable[[str], Any]) -> "BPETokenizer":
        model = get("tokenizer.ggml.model")
        tokens = get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        tokens = [t.decode("utf-8") if isinstance(t, (bytes, bytearray)) else t
                  for t in as_list(tokens)]
        merges = get("tokenizer.ggml.merges")
        if merges is None:
            raise ValueError(f"tokenizer.ggml.model {model!r} needs tokenizer.ggml.merges, "
                             f"which this GGUF file does not have")
        merges = [m.decode("utf-8") if isinstance(m, (bytes, bytearray)) else m
                  for m in as_list(merges)]
        pre = get("tokenizer.ggml.pre")
        if model == "gpt2" and pre is None:
            log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' "
                        "pre-tokenizer (quality may suffer, consider reconverting the model)")
            pre = "default"
        n = len(tokens)
        types = get("tokenizer.ggml.token_type")

        def tid(key: str, default: int | None) -> int | None:
            value = get(key)
            if value is None:
                return default
            return int(value) if 0 <= int(value) < n else default

        # llama.cpp's defaults for a BPE vocabulary: BOS = EOS = 11, no unknown token.
        default_special = 11 if model == "gpt2" and n > 11 else None
        add_bos = get("tokenizer.ggml.add_bos_token")
        add_eos = get("tokenizer.ggml.add_eos_token")
        eot_id = tid("tokenizer.ggml.eot_token_id", None)
        if eot_id is None:
            eot_id = eot_by_text(tokens)
        return cls(
            tokens=tokens,
            merges=merges,
            token_types=[TOKEN_TYPE_NORMAL] * n if types is None else types,
            pre=pre if pre is not None else model,
            bos_id=tid("tokenizer.ggml.bos_token_id", default_special),
            eos_id=tid("tokenizer.ggml.eos_token_id", default_special),
            add_bos=None if add_bos is None else bool(add_bos),
            add_eos=bool(add_eos) if add_eos is not None else False,
            eot_id=eot_id,
            pad_id=tid("tokenizer.ggml.padding_token_id", None),
            unk_id=tid("tokenizer.ggml.unknown_token_id", None),
            model=model,
        )

    # ------------------------------------------------------------------ encoding

    def _encode_text(self, text: str, out: list[int]) -> None:
        if text:
            out.extend(self._hf.encode(text, add_special_tokens=False).ids)

    # ------------------------------------------------------------------ decoding

    def _normal_piece(self, text: str) -> bytes:
        if not self._byte_level:
            return text.replace(SPACE_ESCAPE, " ").encode("utf-8")
        table = UNICODE_TO_BYTE
        try:
            return bytes(table[c] for c in text)
        except KeyError:
            # A character outside GPT-2's byte alphabet (hand-added piece): keep its UTF-8.
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in text)


Tokenizer.register(BPETokenizer, "gpt2", "gemma4")
