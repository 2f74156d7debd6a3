"""Encode throughput on 100 KB of text: SPM (pure Python) and BPE (Rust 'tokenizers').

    python bench/bench_tokenizer.py [--kb 100] [--repeat 3] [--no-python-bpe]

Vocabularies: llama.cpp's fixture GGUFs (bench/vocab_fixtures.py fetches them once)
and, for SPM, the bundled Gemma 3 270M model. The text is the repository's README and
docs (English prose, markdown, code), repeated up to --kb kilobytes; a second run uses
llama.cpp's multilingual fixture texts (emoji, CJK, Cyrillic, Khmer, whitespace runs),
and the worst case of a merge loop, one 8000-letter word, is timed for both BPE paths.

For comparison it also runs a pure-Python byte-level BPE (the ``regex`` package for the
\\p{..} classes, GPT-2-style merge loop with a word cache), built from the same
vocabulary and pre-tokenizer table. It is first checked against llama.cpp's fixture ids
so that the speed numbers are for a correct implementation. It is a baseline for this
benchmark only, not a code path of the coordinator; it needs ``pip install
'.[bench]'`` (the regex package).

Each number is the best of --repeat runs of encode() over the whole text, after one
warm-up run (both BPE paths cache per-word results, so the warm-up matters; the first
cold run is printed too). The machine is shared: compare the lines of one invocation.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import random
import string
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordinator.text.tokenizer import Tokenizer  # noqa: E402
from coordinator.text.tokenizer_bpe import (  # noqa: E402
    _GPT2,
    _PRE_NAMES,
    _PRE_SPECS,
    BYTE_TO_UNICODE,
    BPETokenizer,
)

_spec = importlib.util.spec_from_file_location("vocab_fixtures", ROOT / "bench" / "vocab_fixtures.py")
vf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vf)


class PurePythonBPE:
    """Byte-level BPE in pure Python, for the speed comparison only."""

    def __init__(self, tok: BPETokenizer):
        import regex

        self.tok = tok
        self.vocab = tok._piece_to_id
        self.ranks: dict[tuple[str, str], int] = {}
        for i, m in enumerate(tok.merges):
            pos = m.find(" ", 1)
            if pos > 0:
                self.ranks.setdefault((m[:pos], m[pos + 1:]), i)
        spec_name, self.ignore_merges, _ = _PRE_NAMES[tok.pre]
        self.patterns = []
        for step in _PRE_SPECS[spec_name]:
            kind = step[0]
            if kind == "split":
                pattern = step[1]
            elif kind == "digits":
                pattern = r"\p{N}" if step[1] else r"\p{N}+"
            elif kind == "punct":
                pattern = r"[\p{P}!-/:-@\[-`{-~]+"
            elif kind == "bytelevel":
                pattern = _GPT2
            self.patterns.append(regex.compile(pattern))
        self.cache: dict[str, list[int]] = {}

    def _split(self, pieces: list[str]) -> list[str]:
        for pat in self.patterns:
            out = []
            for piece in pieces:
                pos = 0
                for m in pat.finditer(piece):
                    if m.start() > pos:
                        out.append(piece[pos:m.start()])
                    if m.end() > m.start():
                        out.append(m.group())
                    pos = m.end()
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces

    def _bpe(self, word: str) -> list[int]:
        vocab = self.vocab
        if self.ignore_merges and word in vocab:
            return [vocab[word]]
        parts = list(word)
        ranks = self.ranks
        while len(parts) > 1:
            best, best_rank = None, None
            for i in range(len(parts) - 1):
                r = ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best is None:
                break
            left, right = parts[best], parts[best + 1]
            merged, i = [], 0
            while i < len(parts):  # merge every occurrence of the pair, left to right
                if i < len(parts) - 1 and parts[i] == left and parts[i + 1] == right:
                    merged.append(left + right)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        ids = []
        for p in parts:
            tid = vocab.get(p)
            if tid is not None:
                ids.append(tid)
            else:  # out-of-vocabulary symbol: one token per byte where the byte has one
                ids.extend(vocab[c] for c in p if c in vocab)
        return ids

    def encode(self, text: str) -> list[int]:
        # Special-token partition as the real tokenizer does; BPE on the text fragments.
        b2u = BYTE_TO_UNICODE
        out: list[int] = []
        for frag in self.tok._partition(text, False) if text else ():
            if isinstance(frag, int):
                out.append(frag)
                continue
            for word in self._split([frag]):
                mapped = "".join(b2u[b] for b in word.encode("utf-8"))
                ids = self.cache.get(mapped)
                if ids is None:
                    ids = self.cache[mapped] = self._bpe(mapped)
                out.extend(ids)
        return out


def corpus(kb: int) -> str:
    parts = [(ROOT / "README.md").read_text(encoding="utf-8")]
    parts += [p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md"))]
    text = "\n".join(parts)
    n = kb * 1000
    return (text * (n // len(text) + 1))[:n]


def multilingual(models: pathlib.Path, kb: int) -> str:
    cases = vf.read_cases(models / "ggml-vocab-qwen35.gguf") + vf.read_cases(models / "ggml-vocab-llama-bpe.gguf")
    text = "\n".join(t for t, _ in cases)
    n = kb * 1000
    return (text * (n // len(text) + 1))[:n]


def timed(encode, text: str, repeat: int) -> tuple[int, float, float]:
    t0 = time.perf_counter()
    n = len(encode(text))
    cold = time.perf_counter() - t0
    best = min(_once(encode, text) for _ in range(repeat))
    return n, cold, best


def _once(encode, text: str) -> float:
    t0 = time.perf_counter()
    encode(text)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kb", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-python-bpe", action="store_true")
    args = ap.parse_args()
    models = vf.fetch()

    from coordinator.model.default_model import default_model_path

    tokenizers = [
        ("SPM  gemma3-270m (bundled)", lambda: Tokenizer.from_gguf(default_model_path())),
        ("SPM  llama-spm", lambda: Tokenizer.from_gguf(models / "ggml-vocab-llama-spm.gguf")),
        ("BPE  llama-bpe (Llama 3)", lambda: Tokenizer.from_gguf(models / "ggml-vocab-llama-bpe.gguf")),
        ("BPE  qwen2", lambda: Tokenizer.from_gguf(models / "ggml-vocab-qwen2.gguf")),
        ("BPE  gemma-4", lambda: Tokenizer.from_gguf(models / "ggml-vocab-gemma-4.gguf")),
    ]
    texts = [("docs", corpus(args.kb)), ("multilingual", multilingual(models, args.kb))]
    print(f"{'tokenizer':<34} {'text':<13} {'load s':>7} {'tokens':>7} {'cold s':>7} {'best s':>7} {'tokens/s':>10}")
    for label, make in tokenizers:
        t0 = time.perf_counter()
        tok = make()
        load = time.perf_counter() - t0
        for tname, text in texts:
            n, cold, best = timed(lambda s: tok.encode(s, add_special=False), text, args.repeat)
            print(f"{label:<34} {tname:<13} {load:>7.2f} {n:>7} {cold:>7.3f} {best:>7.3f} {n / best:>10,.0f}")
        if not args.no_python_bpe and isinstance(tok, BPETokenizer) and tok.model == "gpt2":
            py = PurePythonBPE(tok)
            name = tok.pre
            vocab = models / f"ggml-vocab-{'llama-bpe' if name == 'llama-bpe' else name}.gguf"
            cases = vf.read_cases(vocab)
            agree = sum(py.encode(t) == want for t, want in cases)
            for tname, text in texts:
                py.cache.clear()
                same = py.encode(text) == tok.encode(text, add_special=False)
                py.cache.clear()
                n, cold, best = timed(py.encode, text, args.repeat)
                print(f"{'  pure-Python BPE, same vocab':<34} {tname:<13} {'':>7} {n:>7} {cold:>7.3f} "
                      f"{best:>7.3f} {n / best:>10,.0f}   fixtures {agree}/{len(cases)}, "
                      f"same ids as Rust: {same}")
            # Worst case for a merge loop: one long word (no spaces, no cache hit).
            rng = random.Random(0)
            word = "".join(rng.choice(string.ascii_letters) for _ in range(8000))
            rust = _once(lambda s: tok.encode(s, add_special=False), word)
            python = _once(py.encode, word)
            print(f"{'  one 8000-letter word':<34} {'':<13} Rust {rust:.3f} s, pure Python {python:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
