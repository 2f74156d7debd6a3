"""llama.cpp's tokenizer fixtures: fetch them, check our tokenizer against them, record new ones.

    python bench/vocab_fixtures.py fetch               # download + unpack once into the cache
    python bench/vocab_fixtures.py check [NAME ...]    # per-vocabulary pass table and timing
    python bench/vocab_fixtures.py record MODEL.gguf TEXTS.inp [-o OUT]
                                                       # write our ids as a .out file

The fixtures are llama.cpp's ``models/ggml-vocab-*.gguf`` (vocabulary-only GGUF files)
with ``.inp`` (test texts separated by ``\\n__ggml_vocab_test__\\n``) and ``.out`` (the
expected ids, space separated, one case per line; llama.cpp encodes with
add_special=False, parse_special=False). They come from the llama.cpp tree vendored in
the llama-cpp-python sdist on PyPI, fetched with pip (the ordinary client) and unpacked
once into ``$GGML_DISTRIBUTED_CACHE`` (default ``~/.cache/ggml-distributed``); only the
``models/ggml-vocab-*`` files are kept (~75 MB).

``record`` is for a vocabulary llama.cpp has no fixture for (e.g. a real model's GGUF):
it writes the ids our tokenizer gives for each case of an .inp file, in the .out
format, so that a later change of the tokenizer shows up as a diff. Compare such a file
with ``llama-tokenize`` output before trusting it as truth.

tests/coordinator/test_tokenizer_fixtures.py imports this file for fetching and parsing.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SEPARATOR = "\n__ggml_vocab_test__\n"
# Tokenizer models of llama.cpp that we do not claim (WordPiece, Unigram/T5, RWKV, ...).
UNCLAIMED_MODELS = {"bert": "WPM (WordPiece)", "t5": "UGM (Unigram)", "rwkv": "RWKV",
                    "plamo2": "PLaMo-2"}


def cache_dir() -> pathlib.Path:
    root = os.environ.get("GGML_DISTRIBUTED_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "ggml-distributed")
    return pathlib.Path(root)


def models_dir() -> pathlib.Path:
    return cache_dir() / f"llama.cpp-vocab-{SDIST_VERSION}" / "models"


def sdist_path() -> pathlib.Path:
    """The llama-cpp-python sdist in the cache, downloaded with pip on first use (also what
    bench/record_reference_logits.py builds llama.cpp from). RuntimeError if that fails."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    if (cache_dir() / name).exists():
        return cache_dir() / name
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"{SDIST}=={SDIST_VERSION}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        got = pathlib.Path(tmp) / name
        if done.returncode != 0 or not got.exists():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            raise RuntimeError(f"could not download the {SDIST} {SDIST_VERSION} sdist: {tail}")
        os.replace(got, cache_dir() / name)
    return cache_dir() / name


def fetch(quiet: bool = True) -> pathlib.Path:
    """The directory of ggml-vocab-* files, downloading and unpacking them on first use.

    Raises RuntimeError (with pip's last lines) when the download fails.
    """
    target = models_dir()
    if (target / ".complete").exists():
        return target
    sdist = sdist_path()
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        tmp = pathlib.Path(tmp)
        unpacked = tmp / "models"
        unpacked.mkdir()
        with tarfile.open(sdist) as tar:
            for member in tar:
                parts = member.name.split("/")
                if (member.isfile() and parts[-2:-1] == ["models"]
                        and "/vendor/llama.cpp/models/" in member.name
                        and parts[-1].startswith("ggml-vocab-")):
                    src = tar.extractfile(member)
                    with open(unpacked / parts[-1], "wb") as dst:
                        shutil.copyfileobj(src, dst)
        if not any(unpacked.glob("*.gguf")):
            raise RuntimeError(f"no models/ggml-vocab-*.gguf inside {sdist.name}")
        (unpacked / ".complete").write_text(f"{SDIST} {SDIST_VERSION}\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        os.replace(unpacked, target)
    if not quiet:
        print(f"fixtures in {target}")
    return target


def vocab_names(models: pathlib.Path) -> list[str]:
    return sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in models.glob("ggml-vocab-*.gguf"))


def read_cases(gguf: pathlib.Path) -> list[tuple[str, list[int]]] | None:
    """(text, expected ids) pairs of a vocabulary, or None if it has no .inp/.out."""
    inp, out = gguf.with_name(gguf.name + ".inp"), gguf.with_name(gguf.name + ".out")
    if not (inp.exists() and out.exists()):
        return None
    texts = inp.read_bytes().decode("utf-8").split(SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()  # the file ends with a separator
    lines = out.read_bytes().decode("utf-8").split("\n")
    if len(lines) < len(texts):
        raise ValueError(f"{out.name}: {len(lines)} lines for {len(texts)} cases")
    return [(t, [int(v) for v in line.split()]) for t, line in zip(texts, lines)]


def tokenizer_model(gguf: pathlib.Path) -> str | None:
    from coordinator.model.gguf_file import GGUFFile

    with GGUFFile(gguf) as f:
        return f.get("tokenizer.ggml.model")


def check(names: list[str] | None = None) -> int:
    from coordinator.text.tokenizer import Tokenizer

    models = fetch(quiet=False)
    failed = 0
    print(f"{'vocabulary':<18} {'model':<7} {'pre':<15} {'encode':>8} {'decode':>8} {'load s':>7} {'enc ms':>7}")
    for name in names or vocab_names(models):
        path = models / f"ggml-vocab-{name}.gguf"
        model = tokenizer_model(path)
        if model in UNCLAIMED_MODELS:
            print(f"{name:<18} {model:<7} skipped: {UNCLAIMED_MODELS[model]} is not supported")
            continue
        t0 = time.perf_counter()
        tok = Tokenizer.from_gguf(path)
        t1 = time.perf_counter()
        cases = read_cases(path)
        if cases is None:
            print(f"{name:<18} {model:<7} {str(getattr(tok, 'pre', '-')):<15} loads; no .inp/.out")
            continue
        enc = dec = 0
        t2 = time.perf_counter()
        for text, expected in cases:
            ids = tok.encode(text, add_special=False, parse_special=False)
            enc += ids == expected
            dec += tok.decode(ids) == text
            if ids != expected:
                failed += 1
                print(f"  MISMATCH {text!r:.60}\n    want {expected}\n    got  {ids}")
        t3 = time.perf_counter()
        print(f"{name:<18} {model:<7} {str(getattr(tok, 'pre', '-')):<15} {enc:>3}/{len(cases):<4} "
              f"{dec:>3}/{len(cases):<4} {t1 - t0:>7.2f} {1000 * (t3 - t2):>7.1f}")
    return 1 if failed else 0


def record(gguf: str, inp: str, out: str | None) -> int:
    from coordinator.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf)
    texts = pathlib.Path(inp).read_bytes().decode("utf-8").split(SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()
    lines = [" ".join(map(str, tok.encode(t, add_special=False))) for t in texts]
    target = pathlib.Path(out) if out else pathlib.Path(gguf + ".out")
    target.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    print(f"wrote {len(lines)} cases to {target}")
    return 0


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch")
    c = sub.add_parser("check")
    c.add_argument("names", nargs="*")
    r = sub.add_parser("record")
    r.add_argument("gguf")
    r.add_argument("inp")
    r.add_argument("-o", "--out")
    args = ap.parse_args(argv)
    if args.cmd == "fetch":
        fetch(quiet=False)
        return 0
    if args.cmd == "check":
        return check(args.names)
    return record(args.gguf, args.inp, args.out)


if __name__ == "__main__":
    sys.exit(main())
