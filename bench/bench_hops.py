"""Where a remote decode step's time goes, hop by hop.

    python bench/bench_hops.py [--tg N] [--model PATH] [--greedy]

Runs the bundled model (or --model) on two local workers with
GGML_RPC_HOP_TRACE set (rpc_daemon/service/hoptrace.py), so the coordinator, each
daemon and each compute process stamp fixed points of every compute request
with the shared monotonic clock. After a warm-up it decodes --tg single tokens
and prints, per stage, the median time between consecutive points, then the
step time against the sum of compute, next to an in-process run of the same
steps in the same invocation (this machine is shared: only side by side
numbers compare). Bounded: --tg steps (default 32) per setup.

The hop table is of the layer chain alone (head_split=False, step_links=False:
one request per stage, in order, each relayed through the coordinator); then
the default setup (step links, the output head split over the workers, as
head_split="auto" places it on loopback) is broken down along its critical
path: coordinator to stage 0's compute, stage 0's layers, the push to stage 1,
stage 1's layers, the push of the normed rows to each head shard, the shards'
compute, and the last reply, with the step time; the last line compares the
step times.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

TRACE = tempfile.NamedTemporaryFile(prefix="hops-", suffix=".txt", delete=False).name
os.environ["GGML_RPC_HOP_TRACE"] = TRACE  # before rpc_daemon is imported: hoptrace reads it once

from coordinator import Coordinator  # noqa: E402
from coordinator.serving.local_workers import LocalWorkers  # noqa: E402
from decode_steps import timed_steps  # noqa: E402
from rpc_daemon.service import hoptrace  # noqa: E402

hoptrace.FLUSH_EVERY = 1 << 20  # this process writes its points between its runs only (steps())


def steps(c: Coordinator, n: int, greedy: bool) -> tuple[list[float], tuple[float, float]]:
    """The seconds of `n` measured steps, and their window on the trace's clock (microseconds)."""
    window = []

    def measuring_from_now():
        hoptrace.flush()  # the warm-up's points out now, not in the middle of a measured hop
        window.append(time.monotonic() * 1e6)

    seconds = timed_steps(c, n, greedy, warmup=8, before_measuring=measuring_from_now)
    window.append(time.monotonic() * 1e6)
    hoptrace.flush()
    time.sleep(0.2)  # the workers write their points as they go quiet, after each reply
    return seconds, (window[0], window[1])


def trace_events(path: str, window: tuple[float, float]) -> list[tuple[int, int, str]]:
    """(microseconds, pid, point) of the trace within `window`, in time order."""
    events = []
    for line in open(path).read().splitlines():
        pid, rest = line.split(" ", 1)
        point, t = rest.rsplit(" ", 1)  # "pid point words microseconds"
        if window[0] <= int(t) <= window[1]:
            events.append((int(t), int(pid), point))
    return sorted(events)


def hops(path: str, n_stages: int, window: tuple[float, float]) -> list[list[tuple[str, float]]]:
    """Per stage: (from -> to, median microseconds) between consecutive points."""
    events = [(t, point) for t, _, point in trace_events(path, window)]
    requests, cur = [], None
    for t, point in events:
        if point == "client send":
            cur = [(t, point)]
            requests.append(cur)
        elif cur is not None:
            cur.append((t, point))
    gaps = [collections.defaultdict(list) for _ in range(n_stages)]
    for k, req in enumerate(requests):
        if k % n_stages and k >= 1:  # the coordinator passes one stage's output to the next
            gaps[k % n_stages]["(previous stage's reply -> client send)"].append(req[0][0] - requests[k - 1][-1][0])
        for (t0, a), (t1, b) in zip(req, req[1:]):
            gaps[k % n_stages][f"{a} -> {b}"].append(t1 - t0)
    return [[(name, statistics.median(v)) for name, v in g.items() if len(v) * 2 >= len(requests) // n_stages]
            for g in gaps]


def critical_path(path: str, window: tuple[float, float]) -> list[tuple[str, float]]:
    """(segment, median microseconds) along a linked, head-split step over two
    workers: each step's events start at its burst of requests (stage 0, stage 1,
    two head shards) and end at the last reply; the compute processes' first
    computes of a step are the layers, in stage order, the next two the heads."""
    events = trace_events(path, window)
    steps, cur, replies = [], None, 0
    for e in events:
        if e[2] == "client send" and (cur is None or replies >= 4):
            cur, replies = [], 0
            steps.append(cur)
        if cur is not None:
            cur.append(e)
            replies += e[2] == "client has reply"
    gaps = collections.defaultdict(list)
    for step in steps:
        starts = [(t, pid) for t, pid, point in step if point == "compute start"]
        ends = {}
        for t, pid, point in step:
            if point == "compute end":
                ends.setdefault(pid, []).append(t)
        last_reply = max((t for t, _, point in step if point == "client has reply"), default=None)
        if len(starts) != 4 or last_reply is None or sorted(len(v) for v in ends.values()) != [2, 2]:
            continue  # a step the trace did not catch whole
        (a0, pa), (b0, pb) = starts[0], starts[1]
        if pa == pb:
            continue
        head = {pid: t for t, pid in starts[2:]}
        a1, b1 = ends[pa][0], ends[pb][0]
        for name, us in (("coordinator send -> stage 0 compute", a0 - step[0][0]),
                         ("stage 0 layers (compute)", a1 - a0),
                         ("stage 0 end -> stage 1 compute (push)", b0 - a1),
                         ("stage 1 layers (compute)", b1 - b0),
                         ("stage 1 end -> its head shard's compute", head[pb] - b1),
                         ("stage 1 end -> stage 0's head shard (push)", head[pa] - b1),
                         ("head shard compute, stage 0", ends[pa][1] - head[pa]),
                         ("head shard compute, stage 1", ends[pb][1] - head[pb]),
                         ("last head end -> last reply (logits)", last_reply - max(ends[pa][1], ends[pb][1])),
                         ("step: first send -> last reply", last_reply - step[0][0])):
            gaps[name].append(us)
    return [(name, statistics.median(v)) for name, v in gaps.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--greedy", action="store_true", help="the last worker returns the argmax, not the logits")
    args = ap.parse_args()
    with LocalWorkers(2, threads=1) as workers:
        endpoints = workers.endpoints
        local = Coordinator(["local"], model=args.model, n_ctx=256, threads=1)
        # relayed through the coordinator (no step links): one request per stage, in order, as the table reads them
        remote = Coordinator(endpoints, model=args.model, n_ctx=256, threads=1, head_split=False, step_links=False)
        # split every step (what head_split="auto" places on loopback): the critical path reads four computes a step
        shared = Coordinator(endpoints, model=args.model, n_ctx=256, threads=1, head_split=True)
        try:
            local_steps, _ = steps(local, args.tg, args.greedy)
            remote_steps, window = steps(remote, args.tg, args.greedy)
            table = hops(TRACE, len(endpoints), window)
            shared_steps, window = steps(shared, args.tg, args.greedy)
            path = critical_path(TRACE, window)
        finally:
            shared.close()
            remote.close()
            local.close()
    os.unlink(TRACE)
    what = "greedy (argmax returned)" if args.greedy else "full logits returned"
    print(f"tg step, {what}, median over {args.tg} steps")
    for i, rows in enumerate(table):
        print(f"stage {i} ({endpoints[i]}):")
        for name, us in rows:
            print(f"  {name:<42} {us:8.0f} us")
        hop_us = sum(us for name, us in rows if name != "compute start -> compute end")
        print(f"  {'everything but compute':<42} {hop_us:8.0f} us")
    print("default setup (step links, head split), along the critical path:")
    for name, us in path:
        print(f"  {name:<42} {us:8.0f} us")
    loc, rem = statistics.median(local_steps) * 1e3, statistics.median(remote_steps) * 1e3
    sh = statistics.median(shared_steps) * 1e3
    print(f"in-process step {loc:.2f} ms; remote step {rem:.2f} ms (head whole), ratio {loc / rem:.3f}; "
          f"with the head split: {sh:.2f} ms, ratio {loc / sh:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
