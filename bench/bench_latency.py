"""Model load and decode speed behind a slow network, side by side in one run.

    python bench/bench_latency.py [--model PATH] [--tg N] [--links 0,0.02:0.005,0.1:0.03]
                                  [--rate BYTES_PER_S] [--workers 2]

Starts --workers local workers (one thread each) and, per link setting
"delay[:jitter]" (seconds, one way), a bench/delay_proxy.py process in front
of each worker (its own process, so forwarding does not share the bench's
GIL). For each setting it measures:

* load: Coordinator construction (open the GGUF, connect, plan, upload every
  worker's weights; no tensor cache);
* tg: --tg single-token decode steps after a 32-token prompt, full logits read
  back (llama-bench's measure), median step time; and the same with greedy
  (the last worker returns the argmax);
* added per token: (step(d) - step(0)) / d, the extra time of one step in units
  of the one-way delay d (each request to a worker and its reply cost 2 d).

The first setting is the baseline (default 0: the proxies only); ratios are
against it. This machine is shared: only the ratios of one run compare.
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import re
import statistics
import subprocess
import sys
import time

from coordinator import Coordinator
from coordinator.serving.local_workers import LocalWorkers
from decode_steps import timed_steps

PROXY = pathlib.Path(__file__).resolve().parent / "delay_proxy.py"
_LISTENING = re.compile(r"listening on (\S+)")


@contextlib.contextmanager
def proxies(upstreams: list[str], delay: float, jitter: float, rate: float | None):
    procs, endpoints = [], []
    try:
        for up in upstreams:
            cmd = [sys.executable, str(PROXY), up, "--delay", str(delay), "--jitter", str(jitter)]
            if rate:
                cmd += ["--rate", str(rate)]
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            procs.append(p)
            line = p.stdout.readline()  # bounded: the proxy prints it at start or exits (EOF)
            m = _LISTENING.search(line)
            if not m:
                raise RuntimeError(f"delay proxy did not start: {line!r}")
            endpoints.append(m.group(1))
        yield endpoints
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def parse_links(text: str) -> list[tuple[float, float]]:
    links = []
    for item in text.split(","):
        delay, _, jitter = item.partition(":")
        links.append((float(delay), float(jitter or 0)))
    return links


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tg", type=int, default=16, help="decode steps per setting (bounded)")
    ap.add_argument("--links", default="0,0.02:0.005,0.1:0.03", help="delay[:jitter] settings, seconds, one way")
    ap.add_argument("--rate", type=float, default=None, help="bandwidth cap per direction per worker, bytes/s")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    rows = []
    with LocalWorkers(args.workers, threads=1) as workers:
        for delay, jitter in parse_links(args.links):
            with proxies(workers.endpoints, delay, jitter, args.rate) as endpoints:
                t = time.perf_counter()
                c = Coordinator(endpoints, model=args.model, n_ctx=256, threads=1)
                load = time.perf_counter() - t
                try:
                    logits = statistics.median(timed_steps(c, args.tg, greedy=False, warmup=2))
                    greedy = statistics.median(timed_steps(c, args.tg, greedy=True, warmup=2))
                finally:
                    c.close()
            rows.append((delay, jitter, load, logits, greedy))
            print(f"  measured {delay * 1e3:g} +- {jitter * 1e3:g} ms", file=sys.stderr, flush=True)
    base = rows[0]
    cap = f", cap {args.rate / 1e6:g} MB/s" if args.rate else ""
    print(f"{args.workers} workers behind bench/delay_proxy.py{cap}; tg: median of {args.tg} steps")
    print(f"{'one-way delay':>16} {'load s':>8} {'load x':>7} {'tg t/s':>8} {'tg x':>6} {'added/d':>8} "
          f"{'greedy t/s':>11} {'added/d':>8}")
    for delay, jitter, load, logits, greedy in rows:
        added = [f"{(s - b) / delay:8.2f}" if delay else f"{'-':>8}" for s, b in ((logits, base[3]), (greedy, base[4]))]
        print(f"{f'{delay * 1e3:g} +- {jitter * 1e3:g} ms':>16} {load:8.2f} {load / base[2]:7.2f} {1 / logits:8.1f} "
              f"{base[3] / logits:6.3f} {added[0]} {1 / greedy:11.1f} {added[1]}")
    print("load x: load time / the first row's; tg x: tokens/s / the first row's; "
          "added/d: extra step time in one-way delays")
    return 0


if __name__ == "__main__":
    sys.exit(main())
