"""Long-running graph-extent fuzzer (the test suite runs a few thousand cases of
the same: tests/daemon/test_graph_extents.py).

    python bench/fuzz_extents.py [--cases 100000] [--seed N] [--threads 1]
                                 [--mutate-rate 0.35] [--report-every 10000]

Generates --cases random graphs for every op the validator accepts
(tests/extents_fuzz.py), validates each with rpc_daemon/validation/graph.py and
row_ids as the daemon does, and computes the accepted ones with libggml in a
child process on client buffers fenced by PROT_NONE guard pages and filled
with a canary. Reports cases, acceptance rate per op, throughput and every
failure (fault, abort, failed compute, write outside the declared ranges) with
the seed and the case. Exit status 0 only if there was none.

To see it find the bugs of an older validator, run it with PYTHONPATH set to
a checkout of that version (this file and tests/extents_fuzz.py copied in).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import extents_fuzz as F  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="CPU backend threads in the compute child")
    ap.add_argument("--mutate-rate", type=float, default=0.35)
    ap.add_argument("--report-every", type=int, default=10_000)
    ap.add_argument("--max-failures", type=int, default=20, help="stop after this many failures")
    args = ap.parse_args(argv)

    harness = F.Harness(threads=args.threads)
    stats = F.Stats()
    started = time.monotonic()

    def on_fault(seed, res, case):
        print(f"FAILURE seed {seed}: {res.kind}: {res.detail.strip()}\n{case.describe()}\n", flush=True)

    import random
    rnd = random.Random(args.seed)
    try:
        for n in range(1, args.cases + 1):
            F.one_case(rnd.getrandbits(64), harness, stats, args.mutate_rate, on_fault)
            if n % args.report_every == 0:
                took = time.monotonic() - started
                print(f"{n} cases, {stats.accepted} accepted ({stats.accepted / n:.0%}), {len(stats.faults)} "
                      f"failures, {n / took:.0f} cases/s", flush=True)
            if len(stats.faults) >= args.max_failures:
                print(f"stopping after {len(stats.faults)} failures", flush=True)
                break
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    finally:
        harness.close()
    took = time.monotonic() - started
    print(f"\n{stats.cases} cases in {took:.1f} s ({stats.cases / max(took, 1e-9):.0f}/s): {stats.accepted} accepted "
          f"({stats.accepted / max(stats.cases, 1):.1%}) and computed, {len(stats.faults)} failures")
    for op, (n, a) in sorted(stats.by_op.items()):
        print(f"  {op:16s} {n:7d} generated {a:7d} accepted ({a / n:.0%})")
    kinds: dict = {}
    for _, res, _ in stats.faults:
        kinds[res.kind] = kinds.get(res.kind, 0) + 1
    if kinds:
        print("failures by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    return 1 if stats.faults else 0


if __name__ == "__main__":
    sys.exit(main())
