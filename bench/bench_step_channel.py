"""Step channels against the daemon path, interleaved in one run on one cluster
(docs/protocol.md, "Step channels"): one-token greedy steps over 2 local
tensor-split workers, rounds alternating between the members' steps going
straight to their compute processes and going through their daemons.

    python bench/bench_step_channel.py [--model-1b | --model PATH] [--rounds 12] [--per 40] [--full-logits]

Prints each mode's ms a token per round, the medians and their ratio.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from decode_steps import add_model_flags, chosen_model  # noqa: E402

from coordinator import Batch, Coordinator  # noqa: E402
from coordinator.serving.local_workers import LocalWorkers  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--rounds", type=int, default=12, help="rounds per mode (at most 100)")
    p.add_argument("--per", type=int, default=40, help="one-token steps a round (at most 200)")
    p.add_argument("--full-logits", action="store_true", help="full logits each step (default: greedy argmax)")
    args = p.parse_args(argv)
    if not (1 <= args.rounds <= 100 and 1 <= args.per <= 200):
        p.error("--rounds must be 1..100 and --per 1..200")
    model = chosen_model(p, args)
    greedy = not args.full_logits
    times = {True: [], False: []}
    with LocalWorkers(2) as workers:
        opts = {"model": model} if model else {}
        n_ctx = 64 + 2 * args.rounds * (args.per + 1)
        with Coordinator(workers.endpoints, split_mode="tensor", n_ctx=n_ctx, **opts) as c:
            executors = [place.executor for place in c._places]
            c.decode(Batch.single(list(range(10, 42)), 0), greedy=greedy)
            tok, pos = c.token(-1), 32
            for r in range(args.rounds):
                for direct in ((True, False) if r % 2 == 0 else (False, True)):
                    for e in executors:
                        e.use_step_channel = direct
                    c.decode(Batch.single([tok], pos), greedy=greedy)  # the first step of a mode: not timed
                    tok, pos = c.token(-1), pos + 1
                    started = time.perf_counter()
                    for _ in range(args.per):
                        c.decode(Batch.single([tok], pos), greedy=greedy)
                        tok, pos = c.token(-1), pos + 1
                    times[direct].append((time.perf_counter() - started) / args.per * 1e3)
            over = [e.channel_steps for e in executors]
    for direct in (True, False):
        print(f"{'step channels' if direct else 'daemons':<14} median {statistics.median(times[direct]):6.2f} "
              f"ms a token; rounds: {' '.join(f'{t:.1f}' for t in times[direct])}")
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(f"tokens/s with step channels / through the daemons: {ratio:.3f} (steps over the channels: {over})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
