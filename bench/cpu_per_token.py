"""CPU milliseconds per generated token, in process and over 2 local workers.

    python bench/cpu_per_token.py [--tg N] [--reps R] [--only local|remote] [--no-ggml] [--model PATH]
                                  [--profile DIR]

Wall-clock time means little on a shared machine; CPU time much less so. Per
setup (in process, `local`; two local workers with the output head split over
them on every step, as "auto" does on loopback: "auto" itself would move it by
round trips measured under the machine's load), for full logits and greedy
(`decode(greedy=True)`), it decodes --tg single tokens after a 32-token prompt
and 8 warm-up steps (in blocks of at most 200 tokens, each after a fresh
prompt, so every step reuses one graph) and prints, per token:

* coord: this process's CPU (user + system, every thread);
* ggml: of it, the CPU of the ggml_backend_graph_compute calls (the computing
  thread's CPU around each call; with one thread ggml runs on that thread);
* overhd: coord minus ggml, what this process spends besides ggml;
* daemons: the worker daemons' CPU; children: their compute processes' CPU,
  ggml included (/proc/PID/stat);
* wall, and the coordinator's threads' CPU by name (10 ms ticks: read over
  many tokens).

--no-ggml puts bench/no_ggml on PYTHONPATH for this process and the workers:
every graph computes once, then its later computes skip libggml (outputs
replayed), so the columns are the cost of a step besides ggml's kernels,
without the kernels' noise. Caches stay warm there, so it understates what
the same Python costs right after a real compute.

--profile DIR writes cProfile stats (CPU time) of the coordinator's loop thread.
"""
from __future__ import annotations

import argparse
import os
import resource
import runpy
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NO_GGML = "--no-ggml" in sys.argv
if NO_GGML:  # before ggml_ffi is used anywhere, and inherited by the workers and their compute processes
    os.environ["BENCH_NO_GGML"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(HERE, "no_ggml"),
                                                           os.environ.get("PYTHONPATH")) if p)
    runpy.run_path(os.path.join(HERE, "no_ggml", "sitecustomize.py"))

from coordinator import Batch, Coordinator  # noqa: E402
from coordinator.serving.local_workers import LocalWorkers  # noqa: E402
import ggml_ffi.core  # noqa: E402
from proc_stat import children, stat_cpu  # noqa: E402

PROMPT, WARMUP, BLOCK = 32, 8, 200
_ggml_cpu = [0.0]
_compute = ggml_ffi.core.CpuBackend.compute


def _timed_compute(self, gf):
    t = time.thread_time()
    try:
        return _compute(self, gf)
    finally:
        _ggml_cpu[0] += time.thread_time() - t


ggml_ffi.core.CpuBackend.compute = _timed_compute


def _threads_cpu() -> dict:
    """CPU seconds of each of this process's threads, by name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict = {}
    for tid in os.listdir("/proc/self/task"):
        name = names.get(int(tid), "other")
        out[name] = out.get(name, 0.0) + stat_cpu(f"/proc/self/task/{tid}/stat")
    return out


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _on_loop(c: Coordinator, fn) -> None:
    async def call():
        fn()
    c._run(call())


class Meter:
    """CPU of this process (and its threads, and its ggml calls), the daemons and their children."""

    def __init__(self, daemons: list[int]):
        self.daemons = daemons
        self.sums = dict.fromkeys(("coord", "ggml", "daemons", "children", "wall"), 0.0)
        self.threads: dict = {}

    def _read(self) -> tuple:
        kids = [k for d in self.daemons for k in children(d)]
        return (_self_cpu(), _ggml_cpu[0], sum(stat_cpu(f"/proc/{d}/stat") for d in self.daemons),
                {k: stat_cpu(f"/proc/{k}/stat") for k in kids}, time.perf_counter(), _threads_cpu())

    def start(self) -> None:
        self._at = self._read()

    def stop(self) -> None:
        (c0, g0, d0, k0, t0, th0), (c1, g1, d1, k1, t1, th1) = self._at, self._read()
        for key, v in (("coord", c1 - c0), ("ggml", g1 - g0), ("daemons", d1 - d0), ("wall", t1 - t0),
                       ("children", sum(v - k0.get(k, v) for k, v in k1.items()))):
            self.sums[key] += v
        for name, v in th1.items():
            self.threads[name] = self.threads.get(name, 0.0) + v - th0.get(name, 0.0)


def run(c: Coordinator, n: int, greedy: bool, daemons: list[int], profile: str | None) -> dict:
    meter, prof, done = Meter(daemons), None, 0
    if profile:
        import cProfile
        prof = cProfile.Profile(time.thread_time)
    while done < n:
        block = min(BLOCK, n - done)
        c.kv_clear()
        if c.decode(Batch.single(list(range(10, 10 + PROMPT)), 0), greedy=greedy) != 0:
            raise SystemExit(f"prompt decode failed: {c.last_error}")
        tok = c.token(-1)
        for i in range(WARMUP + block):
            if i == WARMUP:
                meter.start()
                if prof is not None:
                    _on_loop(c, prof.enable)
            if c.decode(Batch.single([tok], PROMPT + i), greedy=greedy) != 0:
                raise SystemExit(f"decode failed: {c.last_error}")
            tok = c.token(-1)
        if prof is not None:
            _on_loop(c, prof.disable)
        meter.stop()
        done += block
    if prof is not None:
        prof.dump_stats(profile)
    k = 1000.0 / n
    d = {key: v * k for key, v in meter.sums.items()}
    d["over"] = d["coord"] - d["ggml"]
    d["threads"] = {name: v * k for name, v in meter.threads.items() if v > 0}
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--only", choices=("local", "remote"), default=None)
    ap.add_argument("--no-ggml", action="store_true", help="skip ggml's kernels after each graph's first compute")
    ap.add_argument("--model", default=None)
    ap.add_argument("--profile", default=None, help="directory for cProfile stats of the coordinator's loop thread")
    a = ap.parse_args()
    kw = {"model": a.model} if a.model else {}

    def prof(setup: str, greedy: bool) -> str | None:
        return os.path.join(a.profile, f"{setup}-{'greedy' if greedy else 'full'}.prof") if a.profile else None

    rows = []
    if a.only != "remote":
        with Coordinator(["local"], **kw) as c:
            for greedy in (False, True):
                for _ in range(a.reps):
                    rows.append(("local", greedy, run(c, a.tg, greedy, [], prof("local", greedy))))
    if a.only != "local":
        with LocalWorkers(2) as workers:
            daemons = [w.proc.pid for w in workers.workers]
            with Coordinator(workers.endpoints, head_split=True, **kw) as c:
                for greedy in (False, True):
                    for _ in range(a.reps):
                        rows.append(("2 workers", greedy, run(c, a.tg, greedy, daemons, prof("remote", greedy))))
    print(f"CPU ms per token, {a.tg} tokens{', ggml skipped (--no-ggml)' if a.no_ggml else ''} "
          f"(load {os.getloadavg()[0]:.1f})")
    print(f"{'setup':10} {'logits':7} {'coord':>7} {'ggml':>7} {'overhd':>7} {'daemons':>8} {'children':>8} "
          f"{'wall':>7}  threads")
    for name, greedy, d in rows:
        print(f"{name:10} {'greedy' if greedy else 'full':7} {d['coord']:7.2f} {d['ggml']:7.2f} {d['over']:7.2f} "
              f"{d['daemons']:8.2f} {d['children']:8.2f} {d['wall']:7.2f}  "
              + " ".join(f"{n}={v:.2f}" for n, v in sorted(d["threads"].items())))


if __name__ == "__main__":
    main()
