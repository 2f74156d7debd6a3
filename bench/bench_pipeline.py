"""Pipeline parallelism over 2 local workers, side by side in one run.

    python bench/bench_pipeline.py [--reps 3] [--pp 512] [--tg 16] [--streams 8] [--models gemma3,llama]
                                   [--micro-batches 32,48] [--only-pp]

For each model, with two fresh local workers (1 thread each) and the same
workers for every setup:

* pp: a prompt of --pp tokens decoded in one batch, over the 2 workers with
  pipelining (micro-batches, the default: over step links, every piece's
  requests at once), pipelined but relayed (--no-step-links: each piece's
  hidden state through the coordinator) and without (--micro-batch 0),
  against the in-process path with both workers' threads (`local -t 2`);
* serve: `ggml-coordinator serve` (--parallel --streams) with --streams
  concurrent streaming clients (greedy, --serve-tokens each), aggregate
  tokens/s, pipelining on (the slots in one group per worker, the groups'
  steps in flight at once) and off (--micro-batch 0: one step at a time);
* batch: --streams sequences decoded together in one batch per step through
  the library (full logits read, argmax on the coordinator), aggregate
  tokens/s over --tg steps: what cutting one step into groups alone gives;
* tg: one sequence, one token per step (the same with and without
  pipelining: a one-token batch is never cut).

Models: `gemma3` (the bundled Gemma 3 270M: a 262k-row output head) and
`llama` (a random-weight llama with a 300-token vocabulary, 8 layers of n_embd
768 in f16, written once to ~/.cache/ggml-distributed/), whose head is
negligible. Each repetition runs every setup once, interleaved, so the
machine's load (2 shared cores) hits them alike; the ratios are per repetition
and reported as min–max over --reps.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_serve import round_of  # noqa: E402
from conftest import DaemonProcess  # noqa: E402
from test_http_server import Server  # noqa: E402
from coordinator import Batch, Coordinator, DecodeResult, default_model_path  # noqa: E402

CACHE = pathlib.Path(os.environ.get("GGML_DISTRIBUTED_CACHE", pathlib.Path.home() / ".cache" / "ggml-distributed"))
N_CTX = 1024


def small_vocab_llama() -> str:
    """A llama whose compute is all in its layers (8 x n_embd 768, f16; vocabulary 300)."""
    path = CACHE / "bench-llama-768x8-f16-v300.gguf"
    if path.exists():
        return str(path)
    from tiny_models import Dims, write_plain_llama

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    write_plain_llama(tmp, Dims(n_embd=768, n_layer=8, n_head=12, n_head_kv=4, n_ff=2048), "f16", n_ctx=N_CTX,
                      layer_std=0.02, seed=1)  # 0.02: activations stay in range over the layers
    tmp.rename(path)
    return str(path)


def ok(code) -> None:
    if code is not DecodeResult.OK:
        raise RuntimeError(f"decode failed: {code!r}")


def pp_rate(c: Coordinator, prompt: list[int]) -> float:
    c.kv_clear()
    t = time.perf_counter()
    ok(c.decode(Batch.single(prompt, 0)))
    return len(prompt) / (time.perf_counter() - t)


def streams_rate(c: Coordinator, n_streams: int, n_steps: int, n_vocab: int) -> float:
    """Aggregate tokens/s of n_streams sequences stepping together (full logits, argmax here)."""
    c.kv_clear()
    rng = np.random.default_rng(n_streams)
    prompts = [[int(x) for x in rng.integers(3, min(n_vocab, 1000), 8 + s)] for s in range(n_streams)]
    tokens, pos, seqs, want = [], [], [], []
    for s, p in enumerate(prompts):
        tokens += p
        pos += list(range(len(p)))
        seqs += [[s]] * len(p)
        want += [False] * (len(p) - 1) + [True]
    ok(c.decode(Batch(tokens, pos, seqs, want)))
    last = [int(np.argmax(c.logits(i))) for i in np.flatnonzero(want)]
    at = [len(p) for p in prompts]
    t = time.perf_counter()
    for step in range(-2, n_steps):  # 2 steps not timed: a graph shape evicted from the workers' cache is sent again
        if step == 0:
            t = time.perf_counter()
        ok(c.decode(Batch(last, at, [[s] for s in range(n_streams)], [True] * n_streams)))
        last = [int(np.argmax(c.logits(s))) for s in range(n_streams)]
        at = [a + 1 for a in at]
    return n_streams * n_steps / (time.perf_counter() - t)


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if len(xs) > 1 else f"{xs[0]:.2f}"


def piece_costs(name: str, path: str, args) -> list[str]:
    """In process, one thread: a --pp prompt decoded in pieces of each size
    (what a micro-batch costs on a stage), and whole with 1 and 2 threads;
    each size's time over the whole prompt's, cost(s). Two equal stages of one
    thread each, fed pieces of s tokens, take half the work in pieces plus one
    piece (the pipeline's fill and drain), so the pp ratio against `local -t 2`
    is at most 2 / (speedup(-t 2) x cost(s) x (1 + s / pp)): printed as the
    ceiling (docs/operations.md, "Benchmarks")."""
    sizes = sorted({*args.piece_sizes, args.pp})
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, 300, args.pp)]
    coords = {t: Coordinator(["local"], model=path, n_ctx=N_CTX, threads=t) for t in (1, 2)}
    times: dict[str, list[float]] = {}
    try:
        for rep in range(args.reps + 1):  # the first round warms up (graphs built)
            runs = [(1, s) for s in sizes] + [(2, args.pp)]
            for threads, size in runs:
                c = coords[threads]
                c.kv_clear()
                t = time.perf_counter()
                for a in range(0, args.pp, size):
                    n = min(size, args.pp - a)
                    ok(c.decode(Batch(prompt[a:a + n], list(range(a, a + n)), [[0]] * n,
                                      [False] * (n - 1) + [a + n == args.pp])))
                if rep:
                    times.setdefault(f"-t {threads}, pieces of {size}", []).append(time.perf_counter() - t)
    finally:
        for c in coords.values():
            c.close()
    whole = times[f"-t 1, pieces of {args.pp}"]
    speedup = statistics.median(w / x for w, x in zip(whole, times[f"-t 2, pieces of {args.pp}"]))
    out = [f"## {name}: pp{args.pp} in process, in pieces; time / one thread whole (min-max over {args.reps}); "
           f"pipelined ceiling 2 / (speedup x cost x (1 + s / pp)), speedup of -t 2 {speedup:.2f}"]
    for label, xs in times.items():
        cost = [x / w for x, w in zip(xs, whole)]
        size = int(label.rsplit(" ", 1)[1])
        ceiling = "" if label.startswith("-t 2") else \
            f"  ceiling {2 / (speedup * statistics.median(cost) * (1 + size / args.pp)):.2f}"
        out.append(f"  {label:<24} {statistics.median(xs):7.3f} s  {spread(cost)}{ceiling}")
    return out


def bench_model(name: str, path: str, args) -> list[str]:
    on, off, local = "2 workers, pipelined", "2 workers, unpipelined", "local -t 2"
    workers = [DaemonProcess("-t", "1"), DaemonProcess("-t", "1")]
    eps = [w.endpoint for w in workers]
    setups = {"local -t 2": (["local"], {"threads": 2}), "2 workers, pipelined": (eps, {}),
              "2 workers, unpipelined": (eps, {"micro_batch": 0})}
    for mb in args.micro_batches:  # other piece sizes, pp only
        setups[f"2 workers, mb {mb}"] = (eps, {"micro_batch": mb})
    relayed = "2 workers, relayed"  # pipelined, each piece's hidden state through the coordinator, pp only
    setups[relayed] = (eps, {"step_links": False})
    only_pp = args.only_pp
    coords, servers = {}, {}
    try:
        for label, (e, opts) in setups.items():
            coords[label] = Coordinator(e, model=path, n_ctx=N_CTX, **opts)
        for label, extra in (() if only_pp else ((on, ()), (off, ("--micro-batch", "0")))):
            servers[label] = Server(eps, parallel=args.streams, args=("-m", path, "-t", "1", *extra))
            asyncio.run(round_of(servers[label].url, args.streams, 4))  # warm up
        n_vocab = coords["local -t 2"].hp.n_vocab
        prompt = [int(x) for x in np.random.default_rng(0).integers(3, min(n_vocab, 1000), args.pp)]
        for c in coords.values():  # warm up: graphs built and sent, compute processes started
            pp_rate(c, prompt)
            if not only_pp:
                streams_rate(c, args.streams, 2, n_vocab)
                streams_rate(c, 1, 2, n_vocab)
        rows: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.reps):
            for label, c in coords.items():
                rows.setdefault(("pp", label), []).append(pp_rate(c, prompt))
                if label in (on, off) and not only_pp:
                    rows.setdefault(("batch", label), []).append(streams_rate(c, args.streams, args.tg, n_vocab))
                    rows.setdefault(("tg", label), []).append(streams_rate(c, 1, args.tg, n_vocab))
            for label, server in servers.items():
                tps, _ = asyncio.run(round_of(server.url, args.streams, args.serve_tokens))
                rows.setdefault(("serve", label), []).append(tps)
    finally:
        for c in coords.values():
            c.close()
        for server in servers.values():
            server.stop()
        for w in workers:
            w.stop()

    def ratios(what: str, a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(rows[(what, a)], rows[(what, b)])]

    out = [f"## {name} ({pathlib.Path(path).name}), median tokens/s over {args.reps} repetitions"]
    for (what, label), xs in sorted(rows.items()):
        out.append(f"  {what:<8} {label:<24} {statistics.median(xs):>9.1f}")
    out += [f"  ratio pp{args.pp}: pipelined / local -t 2      {spread(ratios('pp', on, local))}",
            f"  ratio pp{args.pp}: unpipelined / local -t 2    {spread(ratios('pp', off, local))}"]
    out += [f"  ratio pp{args.pp}: micro-batch {mb} / local -t 2  {spread(ratios('pp', f'2 workers, mb {mb}', local))}"
            for mb in args.micro_batches]
    out += [f"  ratio pp{args.pp}: pipelined relayed / local -t 2  {spread(ratios('pp', relayed, local))}",
            f"  ratio pp{args.pp}: pipelined (step links) / relayed  {spread(ratios('pp', on, relayed))}"]
    if only_pp:
        return out
    out += [
            f"  ratio serve, {args.streams} streams: pipelined / unpipelined {spread(ratios('serve', on, off))}",
            f"  ratio one batch of {args.streams} sequences: pipelined / unpipelined "
            f"{spread(ratios('batch', on, off))}",
            f"  ratio tg (1 stream): pipelined / unpipelined {spread(ratios('tg', on, off))}"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=16, help="steps per streams/tg measurement")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--serve-tokens", type=int, default=32, help="tokens per client in the serve measurement")
    ap.add_argument("--models", default="gemma3,llama")
    ap.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                    help="comma-separated other micro-batch sizes to measure pp with too")
    ap.add_argument("--only-pp", action="store_true", help="pp only (no serve, batch or tg)")
    ap.add_argument("--piece-sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                    help="instead: in process, what a prompt costs in pieces of these sizes (e.g. 32,64,128,256)")
    args = ap.parse_args()
    paths = {"gemma3": default_model_path, "llama": small_vocab_llama}
    for name in args.models.split(","):
        run = piece_costs if args.piece_sizes else bench_model
        print("\n".join(run(name, paths[name](), args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
