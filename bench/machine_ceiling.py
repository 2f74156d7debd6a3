"""What this machine can give a split at most: tokens/s of independent decoders running at once.

    python bench/machine_ceiling.py [--model PATH | --model-1b] [--tg N] [--rounds R] [--no-tensor]

Token generation reads every weight once a token, so on one machine it is
bound by the memory bus the cores share. This measures that bound as the
decoders see it, side by side in one run, rounds taking turns:

* alone: one in-process decoder with 1 thread (`Coordinator(["local"])`);
* 2 at once: two such decoders, in two processes, generating at the same
  moment; their tokens over the longer of their two runs are what two cores
  and their memory traffic allow with ggml's kernels (each reads every
  weight a token);
* tensor: the tensor split over 2 local workers of 1 thread each, where each
  member reads half the weights a token. It should not beat "2 at once" on
  one machine: the same bytes cross the same bus (unless a half of the model
  fits the cache where the whole does not), and its members also exchange
  partial sums and share the cores with the coordinator and the daemons.

Every decoder: a 32-token prompt from an empty KV cache, 4 warm-up steps,
then --tg greedy one-token steps (the worker's argmax). Medians over the
rounds. docs/operations.md ("Which split") quotes a run. Bounded: --rounds
(at most 10) x 3 setups, --tg at most 200 steps each.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile

from coordinator import Coordinator
from coordinator.serving.local_workers import LocalWorkers
from decode_steps import add_model_flags, chosen_model, timed_steps

PROMPT, WARMUP, MAX_TG, MAX_ROUNDS = 32, 4, 200, 10


def decoder_child(model: str | None, tg: int) -> None:
    """A decoder process: load, say "ready", then one timed run for every "run" line on stdin.
    Its answers go to the stdout it was given; everything else it prints (the logs) to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    with Coordinator(["local"], threads=1, n_ctx=PROMPT + WARMUP + MAX_TG, **({"model": model} if model else {})) as c:
        print("ready", file=answers, flush=True)
        for line in sys.stdin:
            if line.strip() != "run":
                break
            steps = timed_steps(c, tg, True, WARMUP, PROMPT)
            print(json.dumps({"tokens": len(steps), "seconds": sum(steps)}), file=answers, flush=True)


class Decoder:
    """A decoder_child process and the pipe that drives it."""

    def __init__(self, model: str | None, tg: int, timeout: float):
        self.timeout = timeout
        self.log = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, __file__, "--child", "--tg", str(tg)] + (["--model", model] if model else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)  # (this script's folder is the child's sys.path[0]: decode_steps)
        if self._line() != "ready":
            self._fail("did not start")

    def _fail(self, what: str) -> None:
        if self.proc.poll() is None:  # a hung or confused child ends with the run
            self.proc.kill()
            self.proc.wait()
        self.log.seek(0)
        raise SystemExit(f"a decoder process {what}; the end of its log:\n{self.log.read()[-3000:]}")

    def _line(self) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            self._fail(f"said nothing in {self.timeout:.0f} s")
        return self.proc.stdout.readline().strip()

    def start(self) -> None:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()

    def result(self) -> tuple[int, float]:
        """The run's (tokens, seconds of its timed steps)."""
        line = self._line()
        try:
            answer = json.loads(line)
            return int(answer["tokens"]), float(answer["seconds"])
        except (ValueError, KeyError, TypeError):
            self._fail(f"answered {line!r}")

    def close(self) -> None:
        """Ask it to end (stdin closed); killed if it has not within 10 s (a run still going, a hang)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(ap)
    ap.add_argument("--tg", type=int, default=64, help=f"one-token steps a run (at most {MAX_TG})")
    ap.add_argument("--rounds", type=int, default=3, help=f"rounds of the 3 setups (at most {MAX_ROUNDS})")
    ap.add_argument("--no-tensor", action="store_true", help="leave out the tensor split")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not 1 <= args.tg <= MAX_TG:
        ap.error(f"--tg must be in 1..{MAX_TG}")
    if not 1 <= args.rounds <= MAX_ROUNDS:
        ap.error(f"--rounds must be in 1..{MAX_ROUNDS}")
    model = chosen_model(ap, args)
    if args.child:
        decoder_child(model, args.tg)
        return 0
    timeout = 600.0  # a load or a run of at most MAX_TG steps on a slow machine
    rows: dict[str, list[float]] = {"alone": [], "2 at once": [], "tensor": []}
    decoders: list[Decoder] = []
    try:
        for _ in range(2):
            decoders.append(Decoder(model, args.tg, timeout))
        with LocalWorkers(2) as workers:
            tensor = None if args.no_tensor else Coordinator(
                workers.endpoints, split_mode="tensor", n_ctx=PROMPT + WARMUP + MAX_TG,
                **({"model": model} if model else {}))
            try:
                for _ in range(args.rounds):
                    decoders[0].start()
                    tokens, seconds = decoders[0].result()
                    rows["alone"].append(tokens / seconds)
                    for d in decoders:
                        d.start()
                    runs = [d.result() for d in decoders]
                    # both tokens over the longer run: the one that ends later runs its last steps alone
                    rows["2 at once"].append(sum(t for t, _ in runs) / max(s for _, s in runs))
                    if tensor is not None:
                        steps = timed_steps(tensor, args.tg, True, WARMUP, PROMPT)
                        rows["tensor"].append(len(steps) / sum(steps))
            finally:
                if tensor is not None:
                    tensor.close()
    finally:
        for d in decoders:
            d.close()
    name = os.path.basename(model) if model else "gemma3-270m (bundled)"
    print(f"{name}, {args.tg} greedy one-token steps a run, medians of {args.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.2f}")
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    print(f"alone (1 decoder, 1 thread)         {med['alone']:8.1f} tokens/s")
    print(f"2 at once (2 decoders, together)   {med['2 at once']:8.1f} tokens/s  "
          f"({med['2 at once'] / med['alone']:.2f}x alone)")
    if "tensor" in med:
        print(f"tensor split, 2 workers x 1 thread  {med['tensor']:8.1f} tokens/s  "
              f"({med['tensor'] / med['alone']:.2f}x alone, {med['tensor'] / med['2 at once']:.2f}x of 2 at once)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
