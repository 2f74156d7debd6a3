"""Fairness between clients sharing workers: each client's throughput alone, then both at once.

    python bench/bench_fairness.py [--seconds S] [--daemons 1|2] [--threads N]
                                   [--heavy NxSTEPS] [--light NxSTEPS] [--endpoints H:P,H:P]

Two clients, as two coordinators would be: a "heavy" one whose step is a chain of
STEPS NxN f32 MUL_MATs (default 1024x6: a few hundred ms on one thread) and a
"light" one whose step is a small chain (default 128x2: well under a millisecond
of compute). Each sends one step at a time (a coordinator's decode loop: the next
request once the reply is in). With --daemons 2 a step is a compute on the first
worker and then one on the second (a two-stage pipeline), so each worker sees
each client come back only after the other stage. The bench starts its own
daemons on 127.0.0.1 (or uses --endpoints), measures each client alone for
--seconds, then both at once for --seconds, and prints one table:

  client  step  alone (steps/s)  shared (steps/s)  shared/alone

Target (issue #29): each keeps at least ~half of its solo throughput while the
other computes flat out. With a FIFO compute lock the light client got one step
per heavy step (a few percent of its solo rate); with the fair lock
(rpc_daemon/compute/pool.py, FairLock) the two share the worker's time.
Every loop is bounded by --seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # DaemonProcess lives in the tests' conftest

from conftest import DaemonProcess  # noqa: E402
from ggml_ffi import Context, lib  # noqa: E402
from rpc_daemon.client import RpcClient  # noqa: E402
from rpc_daemon.wire.graph_codec import encode_graph  # noqa: E402
from rpc_daemon.wire.protocol import Command  # noqa: E402


def chain(buf: int, n: int, steps: int) -> list:
    """x_{k+1} = mul_mat(a, x_k), `steps` times: a and x_0 f32 [n, n] in `buf`."""
    ctx = Context(steps + 8)
    try:
        a = ctx.new_tensor(lib.GGML_TYPE_F32, [n, n], "a")
        x0 = ctx.new_tensor(lib.GGML_TYPE_F32, [n, n], "x0")
        x = x0
        for _ in range(steps):
            x = lib.ggml_mul_mat(ctx.ptr, a, x)
        lib.ggml_set_output(x)
        gf = ctx.new_graph(steps + 8)
        lib.ggml_build_forward_expand(gf, x)
        place = {a: (buf, 0), x0: (buf, n * n * 4)}
        tensors, _ = encode_graph(gf, lambda t: place.get(t))
        return tensors
    finally:
        ctx.close()


class Client:
    """One client: a connection to every worker, its chain graph cached on each."""

    def __init__(self, name: str, n: int, steps: int):
        self.name, self.n, self.steps = name, n, steps
        self.conns: list[RpcClient] = []

    async def open(self, endpoints: list[str]) -> None:
        data = np.random.default_rng(0).standard_normal(2 * self.n * self.n).astype(np.float32) / self.n
        for ep in endpoints:
            c = await RpcClient.connect(ep, liveness_timeout=120.0)
            self.conns.append(c)
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": data.nbytes})
            await c.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": data.nbytes},
                            data.tobytes())
            await c.request(Command.GRAPH_COMPUTE, {"graph_id": 1, "tensors": chain(h["buffer"], self.n, self.steps),
                                                    "outputs": []})

    async def step(self) -> None:
        for c in self.conns:  # one stage after the other
            await c.request(Command.GRAPH_RECOMPUTE, {"graph_id": 1, "outputs": []})

    async def loop(self, seconds: float) -> float:
        """Steps per second, stepping flat out for `seconds`."""
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await self.step()
            done += 1
        return done / (time.perf_counter() - t0)

    async def close(self) -> None:
        for c in self.conns:
            await c.aclose()


def parse_shape(text: str) -> tuple[int, int]:
    n, _, steps = text.partition("x")
    return int(n), int(steps)


async def measure(endpoints: list[str], heavy: tuple[int, int], light: tuple[int, int], seconds: float):
    h, l_ = Client("heavy", *heavy), Client("light", *light)
    await h.open(endpoints)
    await l_.open(endpoints)
    try:
        await h.loop(min(1.0, seconds))  # warm-up: compute processes started, pages touched
        await l_.loop(min(1.0, seconds))
        h_solo = await h.loop(seconds)
        l_solo = await l_.loop(seconds)
        h_shared, l_shared = await asyncio.gather(h.loop(seconds), l_.loop(seconds))
        return [(h, h_solo, h_shared), (l_, l_solo, l_shared)]
    finally:
        await h.close()
        await l_.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=8.0, help="length of each phase (default 8)")
    p.add_argument("--daemons", type=int, choices=(1, 2), default=1, help="workers a step goes through (default 1)")
    p.add_argument("--threads", type=int, default=1, help="compute threads of each daemon (default 1)")
    p.add_argument("--heavy", default="1024x6", help="heavy client's step: N x chained MUL_MATs (default 1024x6)")
    p.add_argument("--light", default="128x2", help="light client's step (default 128x2)")
    p.add_argument("--endpoints", help="use these daemons (comma-separated host:port) instead of starting them")
    args = p.parse_args(argv)
    daemons = []
    if args.endpoints:
        endpoints = args.endpoints.split(",")
    else:
        daemons = [DaemonProcess("-t", str(args.threads)) for _ in range(args.daemons)]
        endpoints = [d.endpoint for d in daemons]
    try:
        rows = asyncio.run(measure(endpoints, parse_shape(args.heavy), parse_shape(args.light), args.seconds))
    finally:
        for d in daemons:
            d.stop()
    print(f"{len(endpoints)} worker(s), {args.threads} thread(s) each, {args.seconds:g} s per phase")
    print(f"{'client':<7} {'step':<16} {'alone steps/s':>14} {'shared steps/s':>15} {'shared/alone':>13}")
    for c, solo, shared in rows:
        step = f"{c.n}x{c.steps} x{len(endpoints)}"
        print(f"{c.name:<7} {step:<16} {solo:>14.2f} {shared:>15.2f} {shared / solo:>13.2f}")
    worst = min(shared / solo for _, solo, shared in rows)
    print(f"worst ratio {worst:.2f} (target >= ~0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
