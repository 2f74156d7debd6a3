"""The fault tests, run again and again under load, to find a rare hang or failure
(issue #29: "the suite's fault tests run 30 times in a row in CI-like
conditions (2 cores, load from a second suite) with no hang").

    python bench/repeat_faults.py [--runs 30] [--tests tests/coordinator/test_faults.py ...]
                                  [--load tests/daemon] [--timeout 300] [--logs DIR]

While the runs go on, a second pytest process runs `--load` over and over (the
CI-like load: the two suites share the machine's cores). Each run of `--tests`
is one pytest process with pytest-timeout at `--timeout` seconds a test (the
thread method: a test past it dumps every thread's stack into the run's log and
the run ends), so a hang shows as a run that timed out, with its stacks. Every
run's output is kept in `--logs` (run-NN.log); the summary prints each run's
outcome and time, and the exit status is 1 if any run did not pass.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|error).*?) in [\d.]+s", re.MULTILINE)


def pytest_command(paths: list[str], timeout: float, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout={timeout}", *extra, *paths]


def outcome(returncode: int, output: str) -> str:
    """'passed', 'hung' (pytest-timeout fired) or 'failed', from a run's exit status and output."""
    if "Timeout" in output and "++++++" in output:  # pytest-timeout's banner around the stack dump
        return "hung"
    return "passed" if returncode == 0 else "failed"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--tests", nargs="+", default=["tests/coordinator/test_faults.py"])
    ap.add_argument("--load", nargs="*", default=["tests/daemon"], help="paths the load suite runs (none: no load)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a test may take before its stacks are dumped")
    ap.add_argument("--logs", default=None, help="directory for each run's output (default: a new temporary one)")
    args = ap.parse_args(argv)
    logs = pathlib.Path(args.logs or tempfile.mkdtemp(prefix="repeat-faults-"))
    logs.mkdir(parents=True, exist_ok=True)
    load = None
    load_runs = 0
    results = []
    try:
        for i in range(1, args.runs + 1):
            if args.load and (load is None or load.poll() is not None):
                load_runs += 1
                load = subprocess.Popen(pytest_command(args.load, args.timeout, ["-x"]), cwd=ROOT,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            started = time.monotonic()
            run = subprocess.run(pytest_command(args.tests, args.timeout, []), cwd=ROOT, capture_output=True,
                                 text=True)
            took = time.monotonic() - started
            text = run.stdout + run.stderr
            (logs / f"run-{i:02d}.log").write_text(text)
            found = SUMMARY.findall(text)
            results.append((outcome(run.returncode, text), took, found[-1] if found else f"exit {run.returncode}"))
            print(f"run {i:2d}: {results[-1][0]:<6} {took:6.1f} s  {results[-1][2]}", flush=True)
    finally:
        if load is not None and load.poll() is None:
            load.terminate()
            try:
                load.wait(30)
            except subprocess.TimeoutExpired:
                load.kill()
    counts = {k: sum(r[0] == k for r in results) for k in ("passed", "failed", "hung")}
    times = sorted(r[1] for r in results)
    print(f"{len(results)} runs of {' '.join(args.tests)} under load from {' '.join(args.load) or 'nothing'} "
          f"({load_runs} load runs started): {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['hung']} hung; run time median {times[len(times) // 2]:.1f} s, max {times[-1]:.1f} s; "
          f"logs in {logs}")
    return 0 if counts["passed"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
