"""llama.cpp's own llama-bench, and its rpc-server, as the reference
`ggml-coordinator bench` measures our speed against: llama.cpp built from the
same pinned source as our ggml, in the cache (`$GGML_DISTRIBUTED_CACHE/
llama.cpp-<sdist version>/build/bin`). `python bench/llama_cpp_reference.py
build` builds it (the product never does); without it the reference rows are
skipped, saying why."""
from __future__ import annotations

import contextlib
import json
import pathlib
import signal
import socket
import subprocess
import time

from ggml_ffi import ggml_build

# llama.cpp's rpc-server target and binary are named ggml-rpc-server in this tree (tools/rpc)
RPC_SERVER = "ggml-rpc-server"
STAMP = "reference-build.json"  # build/: what bench/llama_cpp_reference.py built it from, for which CPU


def root() -> pathlib.Path:
    return ggml_build.cache_root() / f"llama.cpp-{ggml_build.PIN_SDIST_VERSION}"


def bin_dir() -> pathlib.Path:
    return root() / "build" / "bin"


def missing(*tools: str) -> str | None:
    """Why these reference tools cannot run here, or None."""
    absent = [t for t in tools or ("llama-bench",) if not (bin_dir() / t).is_file()]
    if absent:
        return f"llama.cpp reference not built ({', '.join(absent)} missing in {bin_dir()}): " \
               f"python bench/llama_cpp_reference.py build"
    try:  # -march=native: a build for another CPU may die of SIGILL (a cache shared by machines)
        built_for = json.loads((root() / "build" / STAMP).read_text()).get("cpu_tag")
    except (OSError, ValueError, AttributeError):
        built_for = None  # built by hand, or before the stamp existed: taken as it is
    if built_for is not None and built_for != ggml_build.cpu_tag():
        return f"llama.cpp reference in {bin_dir()} was built for another CPU (cpu tag {built_for}, this one " \
               f"{ggml_build.cpu_tag()}): python bench/llama_cpp_reference.py build"
    return None


def describe_exit(returncode: int) -> str:
    """A tool's exit status in words; a signal by name, and what SIGILL means here."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if -returncode == signal.SIGILL:
        return ("killed by SIGILL: an instruction this CPU lists but does not execute (a build for another CPU, "
                "or AMX that a VM lists without granting it: llama.cpp's repacked weights use it with --repack 1)")
    return f"killed by {name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def rpc_servers(n: int, threads: int):
    procs, endpoints = [], []
    try:
        for _ in range(n):
            port = _free_port()
            procs.append(subprocess.Popen([str(bin_dir() / RPC_SERVER), "-H", "127.0.0.1", "-p", str(port),
                                           "-t", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            endpoints.append(f"127.0.0.1:{port}")
        for ep, proc in zip(endpoints, procs):  # bounded wait for each to listen
            host, port = ep.split(":")
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None:
                        raise RuntimeError(f"llama.cpp rpc-server on {ep} exited at start "
                                           f"({describe_exit(proc.returncode)})") from None
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"llama.cpp rpc-server on {ep} did not start") from None
                    time.sleep(0.1)
        try:
            yield endpoints
        except RuntimeError as exc:  # llama-bench failed: say if a server died under it, and how
            died = [f"{ep} {describe_exit(p.returncode)}" for ep, p in zip(endpoints, procs) if p.poll() is not None]
            if died:
                raise RuntimeError(f"{exc} (llama.cpp rpc-server {'; '.join(died)})") from exc
            raise
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def llama_bench(model: str, threads: int, pps: tuple, tg: int, reps: int, rpc: list[str] | None = None) -> dict:
    """{'pp64': t/s, ..., 'tg': t/s} from llama-bench's JSON (the mean over reps), a pp entry for
    each prompt size of `pps`."""
    cmd = [str(bin_dir() / "llama-bench"), "-m", model, "-t", str(threads), "-p", ",".join(map(str, pps)),
           "-n", str(tg),
           "-r", str(reps), "--repack", "0", "-o", "json"]
    if rpc:
        cmd += ["-ngl", "99", "--rpc", ",".join(rpc)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench {'over rpc ' if rpc else ''}failed ({describe_exit(run.returncode)}): "
                           f"{run.stderr[-2000:]}")
    out = {}
    for row in json.loads(run.stdout):
        out[f"pp{row['n_prompt']}" if row["n_prompt"] else "tg"] = row["avg_ts"]
    return out


def reference_rows(model: str, threads: int, pps: tuple, tg: int, reps: int,
                   n_rpc: int) -> tuple[dict[str, dict], list[str]]:
    """({row: {"pp64", ..., "tg"}}, notes): in process, and over n_rpc rpc-servers when built."""
    rows, notes = {"llama.cpp": llama_bench(model, threads, pps, tg, reps)}, []
    if n_rpc > 1:
        why = missing(RPC_SERVER)
        if why:
            notes.append(f"llama.cpp rpc row skipped: {why}")
        else:
            with rpc_servers(n_rpc, threads) as eps:
                rows[f"llama.cpp rpc x{n_rpc}"] = llama_bench(model, threads, pps, tg, reps, eps)
    return rows, notes
