"""Structured output's cost (issue #28).

    python bench/bench_structured.py masks [--libs llguidance,xgrammar,outlines_core]
        per library: the time to build its view of a 262k (Gemma 3, the bundled model)
        and a 32k (llama.cpp's Llama 2 SPM fixture) vocabulary, to compile a JSON schema,
        and per mask while walking one JSON document token by token
    python bench/bench_structured.py serve [--url URL] [--tokens N] [--rounds R]
        constrained vs unconstrained tokens/s through `ggml-coordinator serve` (started
        here with --local-workers 2 unless --url is given): the per-token decode rate of a
        streamed completion (first token to last), greedy, unconstrained (ignore_eos), under
        a JSON schema and under a GBNF grammar, each letting the model run to max_tokens,
        interleaved; prints each constraint's ratio

The libraries other than llguidance are optional (pip install xgrammar outlines-core):
a missing one is reported as such.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SPM_32K = os.path.expanduser("~/.cache/ggml-distributed/llama.cpp-vocab-0.3.36/models/ggml-vocab-llama-spm.gguf")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"},
    "ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "home": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
             "required": ["city"]}},
    "required": ["name", "age", "tags", "home"]}
DOC = ('{"name": "Ada Lovelace, countess", "age": 36, "score": 98.5, "ok": true, "colour": "green", '
       '"tags": ["mathematics", "poetry of science", "engines"], "home": {"city": "London", "zip": 12345}}')


def vocabularies():
    from coordinator.model.default_model import default_model_path
    from coordinator.text.tokenizer import Tokenizer

    out = [("gemma3 262k", Tokenizer.from_gguf(default_model_path()))]
    if os.path.exists(SPM_32K):
        out.append(("llama-spm 32k", Tokenizer.from_gguf(SPM_32K)))
    return out


def bench_llguidance(tok):
    from coordinator.text import constrained

    t0 = time.perf_counter()
    vocab = constrained.vocabulary(tok)
    t1 = time.perf_counter()
    grammar = constrained.compile_grammar("json_schema", SCHEMA)
    c = constrained.Constraint(tok, grammar)
    c.allowed()
    t2 = time.perf_counter()
    ids = vocab.tokenize_bytes(DOC.encode())
    times = []
    for t in ids:
        assert c.allowed()[t]
        s = time.perf_counter()
        c._compute()  # the mask as the server computes it (library call + unpacking to a bool per token)
        times.append(time.perf_counter() - s)
        c.advance(t)
    assert c.allowed()[sorted(tok.eog_ids)].all()
    return t1 - t0, t2 - t1, times


def bench_xgrammar(tok):
    import numpy as np
    import torch
    import xgrammar as xgr
    from coordinator.text.constrained import token_bytes

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(token_bytes(tok), vocab_type=xgr.VocabType.RAW, vocab_size=len(tok.tokens),
                             stop_token_ids=sorted(tok.eog_ids))
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    from coordinator.text import constrained
    ids = constrained.vocabulary(tok).tokenize_bytes(DOC.encode())
    mask = xgr.allocate_token_bitmask(1, len(tok.tokens))
    times = []
    for t in ids:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
        times.append(time.perf_counter() - s)
        assert matcher.accept_token(t), t
    del torch
    return t1 - t0, t2 - t1, times


def bench_outlines_core(tok):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from coordinator.text.constrained import token_bytes

    t0 = time.perf_counter()
    table: dict[bytes, list[int]] = {}
    eos = tok.eos_id
    for i, b in enumerate(token_bytes(tok)):
        if b and b[:1] != b"\xff" and i != eos:
            table.setdefault(b, []).append(i)
    vocab = Vocabulary(eos, table)
    t1 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab)  # the whole automaton, ahead of time
    guide = Guide(index)
    t2 = time.perf_counter()
    from coordinator.text import constrained
    ids = constrained.vocabulary(tok).tokenize_bytes(DOC.encode())
    times = []
    for t in ids:
        s = time.perf_counter()
        guide.get_tokens()
        times.append(time.perf_counter() - s)
        guide.advance(t)
    return t1 - t0, t2 - t1, times


def loop_cost(tok, step: float) -> list[float]:
    """What the decode loop pays per token under a constraint, as the server runs it: advance (which
    starts the next mask in a thread), the decode (here a sleep of `step` s: the workers are other
    processes), then Constraint.logits (waits for the mask if not done, applies it) and the draw."""
    import numpy as np
    from coordinator.text import constrained
    from coordinator.text.sampling import Sampler

    vocab = constrained.vocabulary(tok)
    z = np.random.default_rng(0).normal(size=len(tok.tokens)).astype(np.float32)
    out = []
    for kind, value, text in (("json_schema", SCHEMA, DOC),
                              ("grammar", GRAMMAR, '["cat", "dog", "big horse"' + ', "fish", "a bird"' * 10)):
        plain, masked = Sampler(0.0, 0, 1.0, 0), Sampler(0.0, 0, 1.0, 0)
        masked.constraint = constrained.Constraint(tok, constrained.compile_grammar(kind, value))
        for t in vocab.tokenize_bytes(text.encode()):
            time.sleep(step)
            s = time.perf_counter()
            plain._draw(plain.adjusted(z))
            base = time.perf_counter() - s
            s = time.perf_counter()
            masked._draw(masked.adjusted(masked.constraint.logits(z)))
            out.append(time.perf_counter() - s - base)
            masked.constraint.advance(t)
    return out


def cmd_masks(args) -> int:
    benches = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines_core": bench_outlines_core}
    print(f"{'library':14} {'vocabulary':14} {'vocab s':>8} {'compile s':>9} {'mask ms p50':>11} {'p99':>7} {'max':>7}")
    for name, tok in vocabularies():
        for lib in args.libs.split(","):
            try:
                v, c, times = benches[lib](tok)
            except ImportError as exc:
                print(f"{lib:14} {name:14} not installed ({exc})")
                continue
            except Exception as exc:  # report, go on with the others
                print(f"{lib:14} {name:14} failed: {type(exc).__name__}: {exc}")
                continue
            times.sort()
            p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
            print(f"{lib:14} {name:14} {v:8.2f} {c:9.3f} {1e3 * statistics.median(times):11.3f} "
                  f"{1e3 * p99:7.3f} {1e3 * times[-1]:7.3f}")
    step = args.step_ms / 1e3
    print(f"\nllguidance: the decode loop's extra time per token over an unconstrained draw, the mask computed "
          f"during a {args.step_ms:g} ms decode step (p50, p99, mean ms; mean / step)")
    for name, tok in vocabularies():
        extra = sorted(loop_cost(tok, step))
        mean = statistics.mean(extra)
        print(f"  {name:14} {1e3 * statistics.median(extra):7.3f} {1e3 * extra[int(len(extra) * 0.99)]:7.3f} "
              f"{1e3 * mean:7.3f}   {mean / step:.4f}")
    return 0


# ------------------------------------------------------------ through the server
GRAMMAR = r'''root ::= "[" item ("," " "? item)* "]"
item ::= "\"" [a-z ]{1,12} "\""'''  # a JSON list of short lowercase strings: never has to end


async def _decode_seconds(session, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return float(re.search(r"^ggml_decode_seconds_sum (\S+)$", text, re.M).group(1))


async def _rate(session, url: str, body: dict) -> tuple[float, int, float]:
    """tokens/s (first token to last), tokens, and the server's time per token outside decode steps
    (the request's time less its decode steps' (/metrics' ggml_decode_seconds), per token): what
    sampling, masks and HTTP cost, much less disturbed by other load on the machine than tokens/s."""
    stamps = []
    d0 = await _decode_seconds(session, url)
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=dict(body, stream=True)) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    total = time.perf_counter() - t0
    decode = await _decode_seconds(session, url) - d0
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), len(stamps), (total - decode) / len(stamps)


# A JSON schema that cannot end before max_tokens (at least 1000 items): response_format's common case,
# whose masks llguidance's JSON slices make cheap; GRAMMAR: a GBNF character class, which they do not cover
LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1000}
CONSTRAINTS = {"json_schema": {"json_schema": LONG_SCHEMA}, "grammar": {"grammar": GRAMMAR}}


async def _serve_bench(url: str, tokens: int, rounds: int) -> None:
    import aiohttp

    base = {"prompt": "A list of animals:", "max_tokens": tokens, "temperature": 0}
    rates: dict[str, list[float]] = {"unconstrained": [], **{k: [] for k in CONSTRAINTS}}
    host: dict[str, list[float]] = {k: [] for k in rates}
    bodies = {"unconstrained": dict(base, ignore_eos=True), **{k: dict(base, **v) for k, v in CONSTRAINTS.items()}}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await _rate(s, url, dict(base, max_tokens=4, grammar=GRAMMAR))  # warm: the vocabulary's table
        for _ in range(rounds):
            line = []
            for kind, body in bodies.items():
                r, n, h = await _rate(s, url, body)
                rates[kind].append(r)
                host[kind].append(h)
                line.append(f"{kind} {r:6.2f} tok/s ({n} tokens, {1e3 * h:5.2f} ms/token outside decode)")
            print("   ".join(line), flush=True)
    p, hp = statistics.median(rates["unconstrained"]), statistics.median(host["unconstrained"])
    step = 1 / p - hp  # an unconstrained token's decode time
    print(f"median: unconstrained {p:.2f} tok/s, {1e3 * hp:.2f} ms/token outside decode")
    for kind in CONSTRAINTS:
        c, hc = statistics.median(rates[kind]), statistics.median(host[kind])
        print(f"median: {kind} {c:.2f} tok/s, ratio {c / p:.3f}; {1e3 * hc:.2f} ms/token outside decode, so at "
              f"the unconstrained decode time ({1e3 * step:.1f} ms/token) the ratio is {(step + hp) / (step + hc):.3f}")


def cmd_serve(args) -> int:
    proc = None
    url = args.url
    if url is None:
        log = open("/tmp/bench_structured_serve.log", "w+")
        proc = subprocess.Popen([sys.executable, "-m", "coordinator", "serve", "--port", "0", "--local-workers", "2",
                                 "--parallel", "1", "--ctx-per-slot", str(args.tokens + 64)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.3)
            m = re.search(r"serving (https?://\S+) ", open(log.name).read())
            url = m.group(1) if m else None
        if url is None:
            print(open(log.name).read())
            return 1
    try:
        asyncio.run(_serve_bench(url, args.tokens, args.rounds))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("masks")
    m.add_argument("--libs", default="llguidance,xgrammar,outlines_core")
    m.add_argument("--step-ms", type=float, default=50.0, help="the decode step the mask overlaps (gemma3 here: "
                                                                "~50 ms a token)")
    s = sub.add_parser("serve")
    s.add_argument("--url")
    s.add_argument("--tokens", type=int, default=128)
    s.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    return cmd_masks(args) if args.cmd == "masks" else cmd_serve(args)


if __name__ == "__main__":
    sys.exit(main())
