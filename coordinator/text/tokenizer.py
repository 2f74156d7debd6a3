"""SentencePiece (SPM) tokenizer for GGUF vocabularies, following llama.cpp.

This is a pure-Python port of llama.cpp's ``llm_tokenizer_spm`` (src/llama-vocab.cpp),
used when a GGUF file has ``tokenizer.ggml.model == "llama"`` (Llama 1/2, Mistral v1,
Gemma 1/2/3, ...). The goal is token-for-token agreement with llama.cpp:

* special-token partition (``tokenizer_st_partition``): user-defined tokens are always
  split out of the raw text; control/unknown tokens only with ``parse_special=True``;
* each remaining text fragment gets an optional leading space (``add_space_prefix``),
  spaces become U+2581 ("▁"), and the fragment is segmented by greedily merging the
  adjacent pair whose merged piece has the highest vocab score (ties: leftmost first);
* symbols that are not in the vocab fall back to ``<0xXX>`` byte tokens.

Decoding mirrors llama.cpp's ``token_to_piece``: normal tokens have "▁" turned back into
spaces, byte tokens give their raw byte, user-defined tokens are copied verbatim, and
control/unknown tokens give nothing unless ``special=True``.

About 400 lines in one module on purpose: it is one port of one llama.cpp file,
kept in that file's order so the two can be compared side by side.

``Tokenizer.from_gguf(path)`` / ``from_gguf_fields(get)`` are the entry points for any
GGUF: they dispatch on ``tokenizer.ggml.model`` and return this SPM class for "llama"
or :class:`coordinator.text.tokenizer_bpe.BPETokenizer` (a subclass that reuses the special-
token partition, BOS/EOS, EOG detection, decoding and :class:`Detokenizer`, and replaces
the per-fragment segmentation) for "gpt2" and "gemma4"; other models are refused.
"""

from __future__ import annotations

import codecs
import heapq
import os
from typing import Any, Callable, Iterable, Sequence

# GGUF token types (llama.cpp ``llama_token_type``).
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

SPACE_ESCAPE = "\u2581"  # "▁": how SentencePiece spells a space inside pieces

# Texts llama.cpp treats as end-of-turn / end-of-generation when the GGUF does not say
# (llama_vocab::impl::load, "auto-detect special tokens by text").
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek
)

_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "<|end_of_text|>",  # Llama 3
    "<eos>", "<turn|>", "<|tool_response>",  # Gemma 4
    "<|return|>", "<|call|>",  # gpt-oss
)


def eot_by_text(tokens: list[str]) -> int | None:
    """The end-of-turn token when the GGUF names none: llama.cpp infers it from
    well-known texts (Gemma: "<end_of_turn>"), in _EOT_TEXTS' order."""
    index = {t: i for i, t in enumerate(tokens) if t.startswith("<")}
    return next((index[t] for t in _EOT_TEXTS if t in index), None)


def as_list(value: Any) -> list:
    # GGUF readers hand back lists or numpy arrays; .tolist() is much faster than list()
    # on large arrays and yields plain Python scalars.
    return value.tolist() if hasattr(value, "tolist") else list(value)


class Tokenizer:
    """llama.cpp-compatible SPM tokenizer built from plain vocabulary data."""

    def __init__(
        self,
        tokens: Sequence[str],
        scores: Sequence[float],
        token_types: Sequence[int],
        bos_id: int | None,
        eos_id: int | None,
        unk_id: int | None,
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        eot_id: int | None = None,
        pad_id: int | None = None,
    ) -> None:
        n = len(tokens)
        if len(scores) != n or len(token_types) != n:
            raise ValueError(
                f"tokens, scores and token_types must have equal length, got "
                f"{n}, {len(scores)}, {len(token_types)}"
            )
        for name, tid in (("bos_id", bos_id), ("eos_id", eos_id), ("unk_id", unk_id),
                          ("eot_id", eot_id), ("pad_id", pad_id)):
            if tid is not None and not 0 <= tid < n:
                raise ValueError(f"{name}={tid} is outside the vocabulary (size {n})")

        self.tokens: list[str] = list(tokens)
        self.scores: list[float] = as_list(scores)
        self.token_types: list[int] = as_list(token_types)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.unk_id = unk_id
        self.eot_id = eot_id
        self.pad_id = pad_id
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        self.add_space_prefix = bool(add_space_prefix)

        # piece -> id. A later duplicate wins, as in llama.cpp's token_to_id map.
        self._piece_to_id: dict[str, int] = {t: i for i, t in enumerate(self.tokens)}
        if "" in self._piece_to_id:
            # llama.cpp renames empty pieces so they can never match text.
            del self._piece_to_id[""]
            for i, t in enumerate(self.tokens):
                if t == "":
                    self.tokens[i] = f"[EMPTY_{i}]"
                    self._piece_to_id[self.tokens[i]] = i

        # byte value -> token id for byte fallback (llama_vocab::byte_to_token).
        self._byte_to_id: list[int | None] = []
        for b in range(256):
            tid = self._piece_to_id.get(f"<0x{b:02X}>")
            if tid is None and b < 0x80:
                tid = self._piece_to_id.get(chr(b))  # llama.cpp's "just the byte" fallback
            self._byte_to_id.append(tid if tid is not None else unk_id)

        # llama.cpp makes every end-of-generation text a control token, whatever the
        # GGUF says (Gemma 4 ships "<|tool_response>" as user-defined).
        for text in _EOG_TEXTS:
            tid = self._piece_to_id.get(text)
            if tid is not None and self.token_types[tid] != TOKEN_TYPE_CONTROL:
                self.token_types[tid] = TOKEN_TYPE_CONTROL

        # Tokens split out of raw text before segmentation, longest first so that
        # e.g. "\n\n" wins over "\n" (llama.cpp cache_special_tokens; stable sort here).
        types = self.token_types
        special = [i for i, t in enumerate(types)
                   if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN)]
        special.sort(key=lambda i: -len(self.tokens[i]))
        # Each entry carries the piece's first two characters for a cheap pre-filter.
        self._special: list[tuple[str, int, str]] = [
            (self.tokens[i][:2], i, self.tokens[i]) for i in special]
        self._user_defined: list[tuple[str, int, str]] = [
            e for e in self._special if types[e[1]] == TOKEN_TYPE_USER_DEFINED]

        eog = {t for t in (eos_id, eot_id) if t is not None}
        eog.update(self._piece_to_id[t] for t in _EOG_TEXTS if t in self._piece_to_id)
        self.eog_ids: frozenset[int] = frozenset(eog)

        self._piece_cache: dict[tuple[int, bool], bytes] = {}

    # ------------------------------------------------------------------ construction
    # tokenizer.ggml.model -> the subclass that reads it; filled by `register` as the subclasses are
    # imported (coordinator/text/__init__.py imports them all), so this base class names none of them
    _readers: dict[str, type] = {}

    @staticmethod
    def register(reader: type, *models: str) -> None:
        for model in models:
            Tokenizer._readers[model] = reader

    @classmethod
    def from_gguf(cls, path: "str | os.PathLike") -> "Tokenizer":
        """The tokenizer of a GGUF file (only its metadata is read)."""
        from coordinator.model.gguf_file import GGUFFile

        with GGUFFile(path) as gguf:
            return cls.from_gguf_fields(gguf.get)

    @classmethod
    def from_gguf_fields(cls, get: Callable[[str], Any]) -> "Tokenizer":
        """Build from GGUF metadata; ``get(key)`` returns the value or None if absent.

        Dispatches on ``tokenizer.ggml.model``: "llama" is SentencePiece (this class);
        a model a subclass registered for (``register``: "gpt2" and "gemma4" are
        :class:`coordinator.text.tokenizer_bpe.BPETokenizer`'s) goes to it; anything
        else is refused.
        """
        model = get("tokenizer.ggml.model")
        reader = Tokenizer._readers.get(model)
        if reader is not None and cls is Tokenizer:
            return reader.from_gguf_fields(get)
        if model != "llama":
            raise ValueError(
                f"unsupported tokenizer model tokenizer.ggml.model={model!r}; supported: "
                f"'llama' (SentencePiece), 'gpt2' (byte-level BPE), 'gemma4' (BPE)"
            )
        tokens = get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        tokens = [t.decode("utf-8") if isinstance(t, (bytes, bytearray)) else t
                  for t in as_list(tokens)]
        n = len(tokens)
        scores = get("tokenizer.ggml.scores")
        types = get("tokenizer.ggml.token_type")

        def opt(key: str, default: Any) -> Any:
            value = get(key)
            return default if value is None else value

        # Defaults are llama.cpp's for an SPM vocab when the key is missing.
        eot_id = get("tokenizer.ggml.eot_token_id")
        if eot_id is None:
            eot_id = eot_by_text(tokens)
        return cls(
            tokens=tokens,
            scores=[0.0] * n if scores is None else scores,
            token_types=[TOKEN_TYPE_NORMAL] * n if types is None else types,
            bos_id=int(opt("tokenizer.ggml.bos_token_id", 1)),
            eos_id=int(opt("tokenizer.ggml.eos_token_id", 2)),
            unk_id=int(opt("tokenizer.ggml.unknown_token_id", 0)),
            add_bos=bool(opt("tokenizer.ggml.add_bos_token", True)),
            add_eos=bool(opt("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(opt("tokenizer.ggml.add_space_prefix", True)),
            eot_id=None if eot_id is None else int(eot_id),
            pad_id=None if get("tokenizer.ggml.padding_token_id") is None
            else int(get("tokenizer.ggml.padding_token_id")),
        )

    # ------------------------------------------------------------------ vocabulary

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def piece_to_id(self, piece: str) -> int | None:
        """Exact vocab lookup of a raw piece (e.g. "▁world", "<start_of_turn>")."""
        return self._piece_to_id.get(piece)

    def is_eog(self, token_id: int) -> bool:
        """True for tokens that end generation (EOS, EOT and llama.cpp's EOG texts)."""
        return token_id in self.eog_ids

    # ------------------------------------------------------------------ encoding

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Tokenize ``text`` exactly like llama.cpp's ``llama_tokenize`` for SPM vocabs.

        add_special: prepend BOS / append EOS as the vocab's add_bos/add_eos flags say.
        parse_special: also match control tokens written literally (e.g. "<start_of_turn>").
        """
        out: list[int] = []
        if add_special and self.add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos is set but the vocabulary has no BOS token")
            out.append(self.bos_id)

        is_prev_special = True  # so the first text fragment gets the space prefix
        for fragment in self._partition(text, parse_special) if text else ():
            if isinstance(fragment, int):
                out.append(fragment)
                is_prev_special = True
                continue
            if self.add_space_prefix and is_prev_special:
                fragment = " " + fragment
            self._encode_text(fragment, out)
            is_prev_special = False

        if add_special and self.add_eos:
            if self.eos_id is None:
                raise ValueError("add_eos is set but the vocabulary has no EOS token")
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split raw text into text fragments (str) and special token ids (int).

        Mirrors llama.cpp's tokenizer_st_partition: tokens are tried one at a time,
        longest first, each splitting every remaining text fragment at all of its
        non-overlapping leftmost occurrences (which is what str.split does).
        """
        fragments: list[str | int] = [text]
        # Most special tokens do not occur at all. Rather than scanning the text once per
        # token (~6k control tokens for Gemma), first check that the token's first two
        # characters occur; 1-char tokens are looked up among the single characters.
        prefixes = {text[i:i + 2] for i in range(len(text) - 1)}
        prefixes.update(text)
        for prefix, tid, piece in self._special if parse_special else self._user_defined:
            if prefix not in prefixes or piece not in text:
                continue
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or piece not in fragment:
                    split.append(fragment)
                    continue
                for j, part in enumerate(fragment.split(piece)):
                    if j:
                        split.append(tid)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def _encode_text(self, text: str, out: list[int]) -> None:
        """Tokenize one plain-text fragment (no special tokens in it); BPE overrides this."""
        self._encode_fragment(text.replace(" ", SPACE_ESCAPE), out)

    def _encode_fragment(self, text: str, out: list[int]) -> None:
        """SPM segmentation of one escaped fragment (llm_tokenizer_spm_session::tokenize).

        Symbols start as single code points in a doubly linked list. A max-heap holds
        candidate merges of adjacent symbols whose concatenation is a vocab piece, keyed
        by that piece's score (ties: smaller left index first). Entries go stale when a
        neighbour merges; the length check below detects that, as in llama.cpp.
        """
        n = len(text)
        if n == 0:
            return
        vocab = self._piece_to_id
        scores = self.scores
        start = list(range(n))       # symbol i covers text[start[i] : start[i] + size[i]]
        size = [1] * n               # 0 once merged into its left neighbour
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1

        # heapq is a min-heap, so store the negated score.
        heap: list[tuple[float, int, int, int]] = []
        for i in range(1, n):
            tid = vocab.get(text[i - 1:i + 1])
            if tid is not None:
                heap.append((-scores[tid], i - 1, i, 2))
        heapq.heapify(heap)

        push, pop = heapq.heappush, heapq.heappop
        while heap:
            _, left, right, merged = pop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != merged:
                continue  # stale: one side has merged with something else since
            size[left] = merged
            size[right] = 0
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left

            # New candidate pairs around the merged symbol.
            before = prev[left]
            if before >= 0:
                piece = text[start[before]:start[left] + merged]
                tid = vocab.get(piece)
                if tid is not None:
                    push(heap, (-scores[tid], before, left, len(piece)))
            if after >= 0:
                piece = text[start[left]:start[after] + size[after]]
                tid = vocab.get(piece)
                if tid is not None:
                    push(heap, (-scores[tid], left, after, len(piece)))

        byte_to_id = self._byte_to_id
        i = 0
        while i != -1:
            piece = text[start[i]:start[i] + size[i]]
            tid = vocab.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                # Only single code points can be missing (merges always form vocab
                # pieces), so emit its UTF-8 bytes as <0xXX> tokens.
                for b in piece.encode("utf-8", "surrogatepass"):
                    tid = byte_to_id[b]
                    if tid is None:
                        raise ValueError(f"no byte-fallback token for byte 0x{b:02X} "
                                         f"and no unknown token")
                    out.append(tid)
            i = nxt[i]

    # ------------------------------------------------------------------ decoding

    def token_to_piece(self, token_id: int, special: bool = False) -> bytes:
        """The bytes one token contributes to the output (llama.cpp token_to_piece).

        special=True renders control/unknown tokens as their text instead of b"".
        """
        key = (token_id, special)
        cached = self._piece_cache.get(key)
        if cached is not None:
            return cached
        if not 0 <= token_id < len(self.tokens):
            raise IndexError(f"token id {token_id} outside vocabulary (size {len(self.tokens)})")
        text = self.tokens[token_id]
        ttype = self.token_types[token_id]
        if ttype in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            piece = text.encode("utf-8") if special else b""
        elif ttype == TOKEN_TYPE_USER_DEFINED:
            piece = text.encode("utf-8")  # verbatim: user-defined pieces are stored unescaped
        elif ttype == TOKEN_TYPE_NORMAL:
            piece = self._normal_piece(text)
        elif ttype == TOKEN_TYPE_BYTE:
            piece = bytes([int(text[3:5], 16)])  # "<0xXX>"
        else:
            piece = b""  # unused / undefined: suppressed like control tokens
        self._piece_cache[key] = piece
        return piece

    def _normal_piece(self, text: str) -> bytes:
        """Bytes of a normal (non-special, non-byte) piece; BPE overrides this."""
        return text.replace(SPACE_ESCAPE, " ").encode("utf-8")

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        """Detokenize to text; invalid UTF-8 becomes U+FFFD.

        With add_space_prefix, the dummy space that encode() put in front of the text is
        removed again (as SentencePiece does; llama.cpp's llama_detokenize keeps it after
        a BOS), so decode(encode(s)) == s for text without literal special tokens.
        """
        pieces = []
        at_start = self.add_space_prefix
        for t in ids:
            piece = self.token_to_piece(t, special)
            if at_start and piece:
                at_start = False
                piece = self._strip_dummy_prefix(t, piece)
            pieces.append(piece)
        return b"".join(pieces).decode("utf-8", "replace")

    def _strip_dummy_prefix(self, token_id: int, piece: bytes) -> bytes:
        # encode() only ever prefixes the space to a text fragment, so it can sit only
        # in a normal "▁..." piece; a user-defined "  " token is real text.
        if self.token_types[token_id] == TOKEN_TYPE_NORMAL and piece[:1] == b" ":
            return piece[1:]
        return piece

    def detokenizer(self, special: bool = False) -> "Detokenizer":
        return Detokenizer(self, special)


class Detokenizer:
    """Incremental decoding for streaming: feed token ids, get complete text back.

    Bytes of a multi-byte UTF-8 character that arrive as separate byte tokens are held
    until the character is complete, so callers never see half a character.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._at_start = tokenizer.add_space_prefix  # strip the dummy prefix space once

    def feed(self, token_id: int) -> str:
        piece = self._tokenizer.token_to_piece(token_id, self._special)
        if self._at_start and piece:
            self._at_start = False
            piece = self._tokenizer._strip_dummy_prefix(token_id, piece)
        return self._decoder.decode(piece)

    def flush(self) -> str:
        """Return what is still held (an incomplete sequence becomes U+FFFD) and reset."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
