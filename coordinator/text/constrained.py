"""Structured output: token masks from llguidance (https://github.com/guidance-ai/llguidance).

llguidance is the constrained-decoding library llama.cpp itself links; here it is
driven through its Python wheel (no network at run time, no torch). Nothing in this
file matches a grammar: it only tells llguidance our vocabulary and carries a
matcher per sequence.

* `vocabulary(tokenizer)`: the library's view of our vocabulary, built once per
  tokenizer and cached. Token i's bytes are what our tokenizer decodes it to
  (`token_to_piece`: byte-level BPE pieces through BYTE_TO_UNICODE, SentencePiece's
  ▁ as a space, <0xXX> as its byte). Control, unknown and unused tokens, and
  user-defined ones spelled "<...>", are marked special (llguidance's 0xFF prefix),
  so no grammar text ever matches them; the end-of-generation tokens are the
  library's EOS, allowed exactly when the grammar accepts.
* `compile_grammar(kind, value)`: a request's `response_format` / `grammar` /
  `json_schema` as an llguidance grammar; ValueError with the library's message.
  A schema's objects with `properties` are closed to other keys unless it says
  otherwise (`closed_objects`), as llama.cpp reads them.
* `Constraint`: one sequence's matcher. `logits(z)` sets every disallowed token to
  -inf; `advance(token)` consumes a sampled token and starts computing the next mask
  in a thread (llguidance drops the GIL), so the mask for step t+1 is computed while
  the workers decode step t+1's input. `fits(tokens)` says, without a mask, whether
  the grammar allows each of a few tokens next (below): a sampler that can decide
  from that alone skips the mask, and the next one is computed ahead only while
  such checks keep failing.

Why a check can stand for the mask: llguidance's mask, where the grammar forces no
bytes, is exactly the set of tokens whose bytes the parser accepts next (plus EOS
when it accepts), which is what `validate_tokens([t])` answers in about a
microsecond where the mask takes 0.02-1 ms over a 262k vocabulary. Where bytes are
forced, the mask allows only their canonical tokenization and the check would
allow more, so there (`compute_ff_bytes()` not empty), for the end-of-generation
tokens, and in an error state, the mask decides; except where the forced bytes
make a token of their own (`compute_ff_tokens()`): then the mask allows that token
alone, and `forced()` names it.
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from coordinator.text.tokenizer import (TOKEN_TYPE_BYTE, TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED, Tokenizer)

_SPECIAL = b"\xff"  # llguidance: a token whose bytes start so is special, never matched by grammar text

_vocab_cache: "weakref.WeakKeyDictionary[Tokenizer, Any]" = weakref.WeakKeyDictionary()
_vocab_lock = threading.Lock()
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mask")
# JSON: at most 20 whitespace characters between tokens, as llama.cpp's json-schema-to-grammar allows (llguidance's
# default is any run, which a small model can fill forever); a schema's "x-guidance" options override this
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}


def _llg():
    import llguidance  # imported on first use: the server starts without it when no request asks

    return llguidance


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each token's bytes as llguidance should see them (see the module's doc)."""
    out = []
    for i, text in enumerate(tokenizer.tokens):
        ttype = tokenizer.token_types[i]
        if i in tokenizer.eog_ids:
            out.append(_SPECIAL + text.encode("utf-8"))
        elif ttype in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_BYTE):
            out.append(tokenizer.token_to_piece(i))
        elif ttype == TOKEN_TYPE_USER_DEFINED and not (text.startswith("<") and text.endswith(">")):
            out.append(tokenizer.token_to_piece(i))  # real text (e.g. runs of spaces)
        else:  # control, unknown, unused, undefined, and "<...>" user-defined tokens
            out.append(_SPECIAL + text.encode("utf-8"))
    return out


class _Wrapper:
    """What llguidance.TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokens = token_bytes(tokenizer)
        eog = sorted(tokenizer.eog_ids)
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else (eog[0] if eog else None)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t[:1] == _SPECIAL]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if isinstance(text, bytes):
            raise TypeError("text, not bytes")  # TokenizerWrapper probes with bytes: say we take str
        out: list[int] = []  # plain text: no BOS, no dummy space prefix, no special tokens parsed
        self._tokenizer._encode_text(text, out)
        return out


def vocabulary(tokenizer: Tokenizer):
    """The llguidance.LLTokenizer for `tokenizer` (built once: ~4 s for 262k tokens, ~0.3 s for 32k)."""
    with _vocab_lock:
        found = _vocab_cache.get(tokenizer)
        if found is None:
            llg = _llg()
            eog = sorted(tokenizer.eog_ids)
            found = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapper(tokenizer)), n_vocab=len(tokenizer.tokens),
                                    eos_token=eog or None)
            _vocab_cache[tokenizer] = found
        return found


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")
# beside `properties`, keywords that combine the object with other schemas, or already say what other keys
# may be: closing it there would take the combined keys away (llguidance applies sibling keywords together)
_OPEN_BESIDE = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
                "$ref", "not", "if", "then", "else", "dependentSchemas", "dependencies")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object that lists `properties` and says nothing of other keys
    closed (`additionalProperties: false`), as llama.cpp's json-schema-to-grammar reads such
    an object. JSON Schema would allow any other key there, and a small model held to the
    schema fills them with junk (`{"city": "Paris", "type": "object", "properties": ...}`).
    Whatever is combined stays open where closing could take keys away: an object beside
    `allOf`/`anyOf`/`oneOf`/`$ref`/`if`/..., the branches of `allOf` and those of an
    `anyOf`/`oneOf` beside `properties`, a definition another schema extends (referenced
    from `allOf`, or by a `$ref` with keywords beside it), and an object whose `required`
    names a key it does not list (the objects inside all of these are closed). So the
    output always conforms to the schema as written, and nothing satisfiable becomes
    unsatisfiable. A new object; `schema` is untouched."""
    return _closed(schema, _extended_refs(schema), True)


def _closed(schema: Any, extended: set, close_here: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    beside_properties = "properties" in schema
    out = {}
    for key, value in schema.items():
        if key in ("$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: _closed(sub, extended, f"#/{key}/{name}" not in extended) for name, sub in value.items()}
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _closed(sub, extended, True) for name, sub in value.items()}
        elif key in ("allOf", "anyOf", "oneOf") and isinstance(value, list):
            branches_closed = key != "allOf" and not beside_properties
            out[key] = [_closed(sub, extended, branches_closed) for sub in value]
        elif key == "prefixItems" and isinstance(value, list):
            out[key] = [_closed(sub, extended, True) for sub in value]
        elif key in _SUBSCHEMAS:
            out[key] = [_closed(sub, extended, True) for sub in value] if isinstance(value, list) \
                else _closed(value, extended, True)
        else:
            out[key] = value
    props, required = out.get("properties"), out.get("required", [])
    if close_here and isinstance(props, dict) and not any(k in out for k in _OPEN_BESIDE) \
            and isinstance(required, list) and all(isinstance(r, str) and r in props for r in required):
        out["additionalProperties"] = False
    return out


def _extended_refs(schema: Any) -> set:
    """The `$ref`s another schema extends: those of `allOf` branches, of `anyOf`/`oneOf` branches
    beside `properties`, and those with keywords beside them."""
    found: set = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and any(k not in ("$ref", "description", "title", "$comment") for k in node):
            found.add(ref)
        for key in ("allOf", "anyOf", "oneOf"):
            branches = node.get(key)  # (one $ref alone under allOf, nothing beside it, only names that schema)
            if isinstance(branches, list) and ("properties" in node or key == "allOf" and len(branches) > 1):
                found.update(b["$ref"] for b in branches if isinstance(b, dict) and isinstance(b.get("$ref"), str))
        stack.extend(node.values())
    return found


def compile_grammar(kind: str, value: Any) -> str:
    """An llguidance grammar for one request field; ValueError with the library's message.

    kind: "json_object" (any JSON object), "json_schema" (a schema: dict or JSON text),
    "grammar" (llama.cpp GBNF, or llguidance's Lark), "lark" (llguidance's Lark only)."""
    llg = _llg()
    try:
        if kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_OPTIONS)
        elif kind == "json_schema":
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"a JSON schema is an object, not {type(value).__name__}")
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(closed_objects(value)), defaults=JSON_OPTIONS)
        elif kind == "grammar":
            if not isinstance(value, str):
                raise ValueError(f"a grammar is a string, not {type(value).__name__}")
            grammar = llg.grammar_from("gbnf", value)
        elif kind == "lark":  # llguidance's own syntax (`%json {schema}` rules): the tool-call grammars
            grammar = llg.grammar_from("lark", value)
        else:
            raise ValueError(f"unknown grammar kind {kind!r}")
    except ValueError:
        raise
    except Exception as exc:  # the library's own exception types
        raise ValueError(str(exc)) from exc
    message = llg.LLMatcher.validate_grammar(grammar, None)
    if message and not message.startswith("WARNING"):
        raise ValueError(message)
    return grammar


class Constraint:
    """One sequence's grammar state and its next mask (computed ahead, see the module's doc)."""

    # computing the next mask ahead starts again once this share of recent checks failed
    AHEAD_AFTER_MISSES = 0.5

    def __init__(self, tokenizer: Tokenizer, grammar: str):
        llg = _llg()
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.vocab = vocabulary(tokenizer)
        self.n_vocab = len(tokenizer.tokens)
        self.eog = np.array(sorted(tokenizer.eog_ids), dtype=np.int64)
        self.matcher = llg.LLMatcher(self.vocab, grammar, log_level=0)  # its errors are read with get_error
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())
        self._next: Future | None = None  # the next mask, in the thread or done; None: not started
        self.mask_seconds = 0.0  # time spent computing masks (in the thread)
        self.wait_seconds = 0.0  # time `logits` waited for one
        self.masks = 0  # masks asked for (ahead or at once)
        self.misses = 0.0  # the recent share of `fits` checks that found a token the mask must judge
        self._checked = False  # `fits` was called since the last token
        self._start()  # the first tokens are usually forced ("{"): the mask decides them

    def _compute(self) -> tuple[np.ndarray, bool, np.ndarray]:
        """The next mask: a bool per token, and the ids the loop has to write once the logits are there
        (made here, in the thread): the allowed ones when they are fewer (the rest is -inf), else the
        banned ones (set to -inf in a copy of the logits). Either costs the loop the smaller of the two."""
        t0 = time.perf_counter()
        words = (self.n_vocab + 31) // 32
        mask = np.zeros(words, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)  # drops the GIL
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)
        if not allowed.any():  # the matcher failed (its error says why): end the sequence rather than draw anything
            allowed[self.eog] = True
        n_allowed = int(np.count_nonzero(allowed))
        few = n_allowed <= self.n_vocab // 2
        ids = np.flatnonzero(allowed) if few else np.flatnonzero(~allowed)
        self.mask_seconds += time.perf_counter() - t0
        return allowed, few, ids

    def _start(self) -> None:
        self.masks += 1
        self._next = _pool.submit(self._compute)

    def _mask(self) -> tuple[np.ndarray, bool, np.ndarray]:
        if self._next is None:  # not computed ahead: now, on the caller's thread
            self.masks += 1
            self._next = Future()
            self._next.set_result(self._compute())
        t0 = time.perf_counter()
        mask = self._next.result()
        self.wait_seconds += time.perf_counter() - t0
        return mask

    def allowed(self) -> np.ndarray:
        """The tokens allowed next (a bool per token id)."""
        return self._mask()[0]

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def fits(self, tokens) -> bool:
        """True when the grammar allows every one of `tokens` (a few ids) next, as the mask
        would; False when one is banned or only the mask can tell (see the module's doc).
        Reads the mask if one was started; else asks the matcher, which costs microseconds."""
        tokens = [int(t) for t in tokens]
        if any(t >= self.n_vocab for t in tokens):  # output rows past the vocabulary (padding): banned
            ok = False  # (and llguidance stops a matcher asked about an id it does not know)
        elif self._next is not None:
            allowed = self._mask()[0]
            ok = bool(allowed[tokens].all())
        else:
            m = self.matcher
            ok = not m.is_error() and not any(t in self.tokenizer.eog_ids for t in tokens) \
                and not m.compute_ff_bytes() and all(m.validate_tokens([t]) == 1 for t in tokens)
        self._count_check(ok)
        return ok

    def _count_check(self, passed: bool) -> None:
        """One more check in `misses`, the recent share that fell to the mask (a moving average)."""
        self.misses = 0.75 * self.misses + (0.0 if passed else 0.25)
        self._checked = True

    def forced(self) -> int | None:
        """The token the grammar forces next, the only one its mask would allow (llguidance's
        first fast-forward token: a key's name, punctuation), else None."""
        if self._next is not None:
            _, few, ids = self._mask()
            token = int(ids[0]) if few and ids.size == 1 else None
        elif self.matcher.is_error():
            return None
        else:
            ff = self.matcher.compute_ff_tokens()  # (cached in the matcher for a mask that follows)
            token = int(ff[0]) if ff else None
        if token is not None:
            self._count_check(True)
        return token

    @property
    def worth_checking(self) -> bool:
        """Whether checks have been passing lately (a sampler whose check costs more than a
        lookup skips it otherwise; the share of misses decays while it does)."""
        return self.misses < self.AHEAD_AFTER_MISSES

    def logits(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with every token the grammar does not allow next at -inf (a copy)."""
        _, few, ids = self._mask()
        z = np.asarray(logits, dtype=np.float32)
        if few or z.size != self.n_vocab:  # (output rows wider than the vocabulary: the rest is banned)
            ids = ids if few else np.flatnonzero(self._mask()[0])
            ids = ids[ids < z.size]
            out = np.full(z.size, -np.inf, dtype=np.float32)
            out[ids] = z[ids]
            return out
        out = np.array(z, dtype=np.float32)
        out[ids] = -np.inf
        return out

    def advance(self, token: int, checks: bool = False) -> None:
        """`token` was sampled: the matcher consumes it. The next mask starts at once in the
        thread, unless the caller `checks` with `fits` first and those checks mostly pass."""
        if int(token) in self.tokenizer.eog_ids:
            return
        if self._next is not None:
            self._next.result()  # never two threads in the matcher at once
        self.matcher.consume_token(int(token))
        if checks and not self._checked:
            self.misses *= 0.9  # no check this step: try again before long
        self._checked = False
        if checks and self.worth_checking:
            self._next = None
        else:
            self._start()
