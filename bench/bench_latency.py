"""Model load and decode speed behind a slow network, side by side in one run.

    python bench/bench_latency.py [--model PATH] [--tg N] [--links direct,0,0.02:0.005,0.1:0.03]
                                  [--rate BYTES_PER_S] [--workers 2]

Starts --workers local workers (one thread each) and, per link setting
"delay[:jitter]" (seconds, one way), a bench/delay_proxy.py process in front
of each worker (its own process, so forwarding does not share the bench's
GIL); "direct" is the workers without a proxy. For each setting it measures:

* load: Coordinator construction (open the GGUF, connect, plan, upload every
  worker's weights; no tensor cache);
* tg: --tg single-token decode steps after a 32-token prompt, full logits read
  back (llama-bench's measure), median step time; and the same with greedy
  (the last worker returns the argmax);
* added per token: (step(d) - step(0)) / d, the extra time of one step in units
  of the one-way delay d (each request to a worker and its reply cost 2 d).

Each --configs entry (step links on or off, the output head split or whole;
"default": the library's defaults, step links and the head placed per step)
is measured at every setting at once: one coordinator per setting, the
coordinators taking turns step by step, so the machine's load from elsewhere
hits every setting alike (--side-by-side configs: every config at once for
each setting instead, to compare configs' tokens/s). A step link (worker to
worker) goes through the destination worker's proxy too, so it pays the delay
like any other hop. The first setting is each config's baseline (default 0:
the proxies only); ratios are against it. This machine is shared: only the ratios of one run compare.
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
from decode_steps import side_by_side_steps

PROXY = pathlib.Path(__file__).resolve().parent / "delay_proxy.py"
_LISTENING = re.compile(r"listening on (\S+)")


@contextlib.contextmanager
def proxies(upstreams: list[str], delay: float | None, jitter: float, rate: float | None):
    procs, endpoints = [], []
    if delay is None:  # "direct": the workers themselves
        yield list(upstreams)
        return
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


def parse_links(text: str) -> list[tuple[float | None, float]]:
    """"delay[:jitter]" settings; "direct": no proxy at all (delay None)."""
    links = []
    for item in text.split(","):
        if item == "direct":
            links.append((None, 0.0))
            continue
        delay, _, jitter = item.partition(":")
        links.append((float(delay), float(jitter or 0)))
    return links


CONFIGS = {  # name: (step_links, head_split)
    "default": (True, "auto"),  # step links, the head placed per step by measured latency (head_placement.py)
    "relayed": (False, True),
    "linked": (True, True),
    "relayed-whole-head": (False, False),
    "linked-whole-head": (True, False),
    "linked-here": (True, "here"),  # the last worker's share, and the rest of the head in this process
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tg", type=int, default=16, help="decode steps per setting (bounded)")
    ap.add_argument("--links", default="0,0.02:0.005,0.1:0.03", help="delay[:jitter] settings, seconds, one way")
    ap.add_argument("--rate", type=float, default=None, help="bandwidth cap per direction per worker, bytes/s")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--configs", default="relayed,linked",
                    help=f"comma-separated, each measured at every delay: {', '.join(CONFIGS)} (step links on or "
                         f"off, output head split or whole)")
    ap.add_argument("--side-by-side", choices=("delays", "configs"), default="delays",
                    help="what is measured at once, taking turns step by step: a config at every delay (for "
                         "added/d), or every config at one delay (for tokens/s between configs)")
    args = ap.parse_args()
    configs = args.configs.split(",")
    for name in configs:
        if name not in CONFIGS:
            ap.error(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")
    links = parse_links(args.links)
    cells = {}  # (config, link index) -> (load, median step, median greedy step)
    # the coordinators measured side by side: one per delay setting for each config (added/d compares them),
    # or, with --side-by-side configs, every config at once for each delay (tokens/s compares them)
    if args.side_by_side == "delays":
        groups = [[(name, i) for i in range(len(links))] for name in configs]
    else:
        groups = [[(name, i) for name in configs] for i in range(len(links))]
    with LocalWorkers(args.workers, threads=1) as workers, contextlib.ExitStack() as stack:
        sets = [stack.enter_context(proxies(workers.endpoints, delay, jitter, args.rate)) for delay, jitter in links]
        for group in groups:
            coordinators, loads = [], []
            try:
                for name, i in group:
                    step_links, head_split = CONFIGS[name]
                    t = time.perf_counter()
                    coordinators.append(Coordinator(sets[i], model=args.model, n_ctx=256, threads=1,
                                                    step_links=step_links, head_split=head_split))
                    loads.append(time.perf_counter() - t)
                logits = side_by_side_steps(coordinators, args.tg, greedy=False, warmup=2)
                greedy = side_by_side_steps(coordinators, args.tg, greedy=True, warmup=2)
                linked = [c.stats["linked_steps"] for c in coordinators]
                heads = [c.head_placement() for c in coordinators]
            finally:
                for c in coordinators:
                    c.close()
            for cell, load, lg, gr in zip(group, loads, logits, greedy):
                cells[cell] = (load, statistics.median(lg), statistics.median(gr))
            print(f"  measured {group} ({linked} linked steps; head " + ", ".join(
                f"{h['mode']}: {h['steps_split']} split/{h['steps_whole']} whole/{h['steps_here']} here"
                for h in heads) + ")",
                file=sys.stderr, flush=True)
    rows = {name: [(delay, jitter, *cells[name, i]) for i, (delay, jitter) in enumerate(links)] for name in configs}
    cap = f", cap {args.rate / 1e6:g} MB/s" if args.rate else ""
    print(f"{args.workers} workers behind bench/delay_proxy.py{cap}; tg: median of {args.tg} steps")
    print(f"{'config':>19} {'one-way delay':>16} {'load s':>8} {'load x':>7} {'tg t/s':>8} {'tg x':>6} "
          f"{'added/d':>8} {'greedy t/s':>11} {'added/d':>8}")
    for name in configs:
        base = rows[name][0]
        for delay, jitter, load, logits, greedy in rows[name]:
            added = [f"{(s - b) / delay:8.2f}" if delay and base[0] is not None else f"{'-':>8}"
                     for s, b in ((logits, base[3]), (greedy, base[4]))]
            where = "direct" if delay is None else f"{delay * 1e3:g} +- {jitter * 1e3:g} ms"
            print(f"{name:>19} {where:>16} {load:8.2f} {load / base[2]:7.2f} "
                  f"{1 / logits:8.1f} {base[3] / logits:6.3f} {added[0]} {1 / greedy:11.1f} {added[1]}")
    print("load x: load time / the config's first row's; tg x: tokens/s / the config's first row's; "
          "added/d: extra step time in one-way delays (against the config's first row)")
    if len(configs) > 1:
        print(f"tokens/s against {configs[0]} at the same delay (" +
              ("measured side by side" if args.side_by_side == "configs" else "measured at different times") + "):")
        for i, (delay, _) in enumerate(links):
            print(f"  {'direct' if delay is None else f'{delay * 1e3:g} ms'}: " + ", ".join(
                f"{name} {rows[configs[0]][i][3] / rows[name][i][3]:.3f} (greedy "
                f"{rows[configs[0]][i][4] / rows[name][i][4]:.3f})" for name in configs[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
