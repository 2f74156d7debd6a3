"""Where a tensor-parallel token's time goes, over 2 local workers.

    python bench/tensor_step.py [--model PATH | --model-1b] [--tg N] [--greedy]

Starts two local workers of 1 thread, loads the model (default: the bundled
gemma3-270m; --model-1b: the 1B-class bench model, `python
bench/bench_models.py build`) with split_mode="tensor", decodes a 32-token
prompt, 8 warm-up steps, then --tg one-token steps (default 64; full logits,
or the argmax with --greedy) and prints, per token:

* wall: the caller's time of one decode();
* per member: its compute (the worker's `compute_us`), of it its exchanges
  (`exchange_us`: sending its partial sums, waiting for the peer's, adding
  them; 2 x n_layer a token), and its round trip besides its compute (the
  daemon's passes, the compute process's wake-up, the network);
* CPU per token: this process (the coordinator), the two worker daemons,
  and their compute processes (/proc/PID/stat; 10 ms ticks, so read it over
  many tokens).

Medians over the steps; the CPU columns are totals over them divided by the
steps. docs/operations.md ("Which split") has a run on the 2-core
development VM. Bounded: --tg steps (at most 200, in one KV block), one run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from coordinator import Batch, Coordinator
from coordinator.serving.local_workers import LocalWorkers
from decode_steps import add_model_flags, chosen_model
from proc_stat import children, process_cpu

PROMPT, WARMUP, MAX_TG = 32, 8, 200


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(ap)
    ap.add_argument("--tg", type=int, default=64, help=f"one-token steps measured (at most {MAX_TG})")
    ap.add_argument("--greedy", action="store_true", help="the workers return the argmax instead of the logits")
    ap.add_argument("--exact-sums", action=argparse.BooleanOptionalAction, default=None,
                    help="gather whole inputs (4 exchanges a layer), or with --no-exact-sums all-reduce partial sums "
                         "(2 a layer); default: exact where the model allows")
    args = ap.parse_args(argv)
    if not 1 <= args.tg <= MAX_TG:
        ap.error(f"--tg must be in 1..{MAX_TG}")
    model = chosen_model(ap, args)
    with LocalWorkers(2) as workers:
        daemons = [w.proc.pid for w in workers.workers]
        with Coordinator(workers.endpoints, model=model, n_ctx=PROMPT + WARMUP + MAX_TG,
                         split_mode="tensor", exact_sums=args.exact_sums) as c:
            places, sums = c._endpoints.places, c.health()["split_choice"].get("sums")
            c.decode(Batch.single(list(range(10, 10 + PROMPT)), 0), greedy=args.greedy)
            token, wall, members = c.token(-1), [], [[] for _ in places]
            for i in range(WARMUP + args.tg):
                if i == WARMUP:
                    kids = [k for d in daemons for k in children(d)]
                    cpu0 = (time.process_time(), sum(map(process_cpu, daemons)), sum(map(process_cpu, kids)))
                before = [(p.executor.compute_us, p.executor.exchange_us) for p in places]
                started = time.perf_counter()
                if c.decode(Batch.single([token], PROMPT + i), greedy=args.greedy) != 0:
                    print(f"decode failed: {c.last_error}", file=sys.stderr)
                    return 1
                seconds = time.perf_counter() - started
                token = c.token(-1)
                if i < WARMUP:
                    continue
                wall.append(seconds)
                for m, (p, (compute0, exchange0)) in enumerate(zip(places, before)):
                    ex = p.executor
                    members[m].append(((ex.compute_us - compute0) / 1e3, (ex.exchange_us - exchange0) / 1e3,
                                       ex.rtt * 1e3))
            cpu = (time.process_time() - cpu0[0], sum(map(process_cpu, daemons)) - cpu0[1],
                   sum(map(process_cpu, kids)) - cpu0[2])
    n = args.tg
    print(f"{os.path.basename(model or 'gemma3-270m (bundled)')}, 2 workers x 1 thread, split_mode tensor"
          f" with {sums} sums, {n} one-token steps ({'argmax' if args.greedy else 'full logits'}), medians; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"wall per token {statistics.median(wall) * 1e3:.2f} ms")
    for m, rows in enumerate(members):
        compute, exchanges, rtt = (statistics.median(r[k] for r in rows) for k in range(3))
        print(f"member {m}: compute {compute:.2f} ms, of it exchanges {exchanges:.2f} ms; "
              f"round trip besides compute {rtt:.2f} ms")
    print(f"CPU per token: coordinator {cpu[0] / n * 1e3:.2f} ms, daemons {cpu[1] / n * 1e3:.2f} ms, "
          f"compute processes {cpu[2] / n * 1e3:.2f} ms (of {2 * statistics.median(wall) * 1e3:.2f} ms "
          f"of 2 cores' time a token{', ' + str(os.cpu_count()) + ' cores here' if os.cpu_count() != 2 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
