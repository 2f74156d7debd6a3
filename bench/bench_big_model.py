"""A model bigger than one worker, split by the workers' free memory.

    python bench/bench_big_model.py [--gib 2.0] [--path FILE] [--tg 16] [--threads 1]

Writes (once, outside the repo: ~/.cache/ggml-distributed/, or $GGML_DISTRIBUTED_CACHE)
a random-weight llama of about --gib GiB (TinyLlama 1.1B's layer shape in f16, as many
layers as the size asks). Then, each setup with fresh local workers:

* one worker whose --mem is 60% of the model: the coordinator must refuse it before
  uploading anything (DoesNotFit, printed);
* 1 worker with room for it all, 2 and 3 workers with --mem 60% of the model each
  (no split given: planned from their free memory).

For each it prints the load time, greedy tokens/s over --tg steps (after a warm-up)
and, per worker, the layers it holds and the memory it uses (its buffer and its
compute processes' intermediates, from its metrics). Bounded: --tg steps per setup.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from conftest import free_port  # noqa: E402
from coordinator import Coordinator, DoesNotFit  # noqa: E402
from coordinator.serving.local_workers import LocalWorker  # noqa: E402
from decode_steps import timed_steps  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
N_EMBD, N_HEAD, N_HEAD_KV, N_FF = 2048, 32, 4, 5632  # TinyLlama 1.1B's layer
N_CTX = 256


def layer_bytes() -> int:
    head_dim = N_EMBD // N_HEAD
    return 2 * (2 * N_EMBD * N_EMBD + 2 * N_EMBD * N_HEAD_KV * head_dim + 3 * N_EMBD * N_FF)


def write_model(path: pathlib.Path, gib: float) -> pathlib.Path:
    """A llama of f16 random weights, written tensor by tensor (the writer keeps them in memory)."""
    from tiny_models import Dims, write_plain_llama

    n_layer = max(2, round(gib * GiB / layer_bytes()))
    d = Dims(n_embd=N_EMBD, n_layer=n_layer, n_head=N_HEAD, n_head_kv=N_HEAD_KV, n_ff=N_FF)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    write_plain_llama(tmp, d, "f16", n_ctx=N_CTX, layer_std=0.02, seed=1)  # 0.02: in range over many layers
    tmp.rename(path)
    return path


def gauge(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def workers(mems_mib: list[int], threads: int) -> list[LocalWorker]:
    ws = []
    for mem in mems_mib:
        port = free_port()
        w = LocalWorker(threads, ["--mem", str(mem), "--metrics-port", str(port)])
        w.metrics_port = port
        ws.append(w)
    return ws


def tokens_per_second(c: Coordinator, n: int) -> float:
    return n / sum(timed_steps(c, n, greedy=True, warmup=4, prompt_len=16))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cache = pathlib.Path(os.environ.get("GGML_DISTRIBUTED_CACHE", pathlib.Path.home() / ".cache/ggml-distributed"))
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--path", type=pathlib.Path, default=None)
    ap.add_argument("--tg", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    path = args.path or cache / f"big-random-llama-{args.gib:g}gib.gguf"
    if not path.exists():
        t0 = time.perf_counter()
        write_model(path, args.gib)
        print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    size = path.stat().st_size
    small = int(0.6 * size / MiB)
    print(f"model {path.name}: {size / GiB:.2f} GiB; small workers: --mem {small} MiB (60%)")

    ws = workers([small], args.threads)
    try:
        t0 = time.perf_counter()
        Coordinator([w.endpoint for w in ws], model=str(path), n_ctx=N_CTX, threads=args.threads)
        print("ERROR: one small worker accepted the model")
        return 1
    except DoesNotFit as exc:
        print(f"1 small worker: refused in {time.perf_counter() - t0:.2f} s, "
              f"{gauge(ws[0].metrics_port, 'ggml_rpc_bytes_in_total') / 1024:.1f} KiB received: {exc}")
    finally:
        for w in ws:
            w.stop()

    print(f"\n| workers | --mem each (MiB) | load s | tg tok/s | per worker: layers, memory used (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for n, mem in ((1, int(1.5 * size / MiB)), (2, small), (3, small)):
        ws = workers([mem] * n, args.threads)
        try:
            t0 = time.perf_counter()
            with Coordinator([w.endpoint for w in ws], model=str(path), n_ctx=N_CTX, threads=args.threads) as c:
                load = time.perf_counter() - t0
                tps = tokens_per_second(c, args.tg)
                used = [(gauge(w.metrics_port, "ggml_rpc_buffer_bytes") + gauge(w.metrics_port, "ggml_rpc_compute_bytes"))
                        / MiB for w in ws]
                layers = [e["layers"] for e in c.endpoints()]
            per = ", ".join(f"{r[0]}-{r[1] - 1}: {u:.0f}" for r, u in zip(layers, used))
            print(f"| {n} | {mem} | {load:.1f} | {tps:.2f} | {per} |", flush=True)
        finally:
            for w in ws:
                w.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
