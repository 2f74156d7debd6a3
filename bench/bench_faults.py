"""Fault detection latency, and what the liveness mechanism costs.

    python bench/bench_faults.py [--reps N] [--liveness S] [--model PATH|tiny] [--tg N]

Starts two workers on 127.0.0.1 (A: first half of the layers, B: second half,
the one that returns logits), with a tensor cache so reconnecting is cheap,
and prints:

  (a) detection latency of a kill -9 and of a SIGSTOP of worker B, sent from
      another thread at a random moment while decodes run back to back:
      from the signal to the decode that returns ENDPOINT_FAILED; median and
      max over --reps, next to the configured bound (--liveness, default 2 s:
      the Coordinator's default). After each repetition B is restarted on its
      port and the coordinator reconnect()s.
  (b) tg throughput (a 16-token prompt, then --tg single-token decodes, greedy)
      with the liveness pings on (default settings) and off
      (liveness_timeout=None, which exists for this measurement), interleaved,
      median of --reps; the ratio on/off, and how many pings the "on" runs sent.
      A third row pings every 5 ms (liveness 20 ms) to show the cost of pings
      that actually fire.

Every loop is bounded; with the bundled Gemma 3 270M it takes about a minute.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import signal
import statistics
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # DaemonProcess lives in the tests' conftest

from conftest import DaemonProcess  # noqa: E402
from coordinator.api import Batch, Coordinator, DecodeResult  # noqa: E402

PROMPT_TOKENS = 16


def tg_run(c: Coordinator, n_tg: int) -> float:
    """Tokens/s of n_tg single-token greedy decodes after a short prompt."""
    c.kv_clear()
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    assert c.decode(Batch.single(prompt, 0)) == DecodeResult.OK, c.last_error
    tok, pos = int(c.logits(-1).argmax()), PROMPT_TOKENS
    t = time.perf_counter()
    for _ in range(n_tg):
        code = c.decode(Batch.single([tok], pos))
        assert code == DecodeResult.OK, c.last_error
        tok, pos = int(c.logits(-1).argmax()), pos + 1
    return n_tg / (time.perf_counter() - t)


def detection(c: Coordinator, b: DaemonProcess, sig: int, rng: random.Random, budget: float) -> float:
    """Decode back to back; another thread sends `sig` to B after a random
    0.05-0.3 s. Returns seconds from the signal to the failing decode's return."""
    c.kv_clear()
    sent: list[float] = []

    def shoot():
        time.sleep(rng.uniform(0.05, 0.3))
        sent.append(time.monotonic())
        b.signal(sig)

    threading.Thread(target=shoot, daemon=True).start()
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    pos, tok = 0, prompt
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline:
        if pos + len(tok) >= c.n_ctx:
            c.kv_clear()
            pos, tok = 0, prompt
        code = c.decode(Batch.single(tok, pos))
        if code != DecodeResult.OK:
            done = time.monotonic()
            assert code == DecodeResult.ENDPOINT_FAILED, (code, c.last_error)
            assert sent, "failed before the signal was sent"
            return done - sent[0]
        pos += len(tok)
        tok = [int(c.logits(-1).argmax())]
    raise RuntimeError(f"no failure detected within {budget} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--liveness", type=float, default=2.0, help="detection bound, seconds (default 2, the default)")
    ap.add_argument("--model", default=None, help="GGUF path, or 'tiny' (default: the bundled Gemma 3 270M)")
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    model = args.model
    tmp = tempfile.TemporaryDirectory(prefix="bench-faults-")
    if model == "tiny":
        from tiny_models import write_tiny_llama
        model = write_tiny_llama(pathlib.Path(tmp.name) / "tiny.gguf", seed=0)
    cache = str(pathlib.Path(tmp.name) / "cache")
    wargs = ("-t", str(args.threads), "--cache", cache)
    a = DaemonProcess(*wargs)
    b = DaemonProcess(*wargs)
    port_b = b.port
    coords: dict[str, Coordinator] = {}
    rng = random.Random(0)
    try:
        c = Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=256, threads=args.threads,
                        liveness_timeout=args.liveness)
        coords["detect"] = c
        lat: dict[str, list[float]] = {"kill -9": [], "SIGSTOP": []}
        for _ in range(args.reps):
            for name, sig in (("kill -9", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
                lat[name].append(detection(c, b, sig, rng, budget=args.liveness + 30))
                b.kill()
                b = DaemonProcess(*wargs, port=port_b)
                c.reconnect()
        # (b) liveness cost: on (defaults), off, and pinging every 5 ms
        coords["on"] = Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=256,
                                   threads=args.threads)
        coords["off"] = Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=256,
                                    threads=args.threads, liveness_timeout=None)
        coords["ping 5 ms"] = Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=256,
                                          threads=args.threads, liveness_timeout=0.02)
        names = ["on", "off", "ping 5 ms"]
        for n in names:
            tg_run(coords[n], 4)  # warm up: graphs sent, compute processes started
        pings0 = {n: sum(p.executor.client.pings_sent for p in coords[n]._places) for n in names}
        tps: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.reps):
            for n in names:  # interleaved, so all see the same machine load
                tps[n].append(tg_run(coords[n], args.tg))
        pings = {n: sum(p.executor.client.pings_sent for p in coords[n]._places) - pings0[n] for n in names}
    finally:
        for co in coords.values():
            co.close()
        for d in (a, b):
            d.stop()
            d.kill()
        tmp.cleanup()

    print(f"model: {model or 'bundled Gemma 3 270M'}; two workers, faults on the second; {args.reps} repetitions")
    print(f"\n(a) detection latency, signal -> decode returns ENDPOINT_FAILED (bound {args.liveness:g} s)")
    print(f"    {'fault':<10} {'median':>9} {'max':>9} {'bound':>9}")
    for name, xs in lat.items():
        bound = "-" if name == "kill -9" else f"{args.liveness:.3f}"
        print(f"    {name:<10} {statistics.median(xs):>9.3f} {max(xs):>9.3f} {bound:>9}")
    med = {n: statistics.median(v) for n, v in tps.items()}
    print(f"\n(b) tg{args.tg} throughput, median of {args.reps} (tokens/s)")
    print(f"    {'liveness':<10} {'t/s':>9} {'vs off':>9} {'pings':>9}")
    for n in names:
        print(f"    {n:<10} {med[n]:>9.1f} {med[n] / med['off']:>9.3f} {pings[n]:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
