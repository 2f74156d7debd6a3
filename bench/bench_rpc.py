"""Side-by-side costs of going through a worker daemon over loopback.

    python bench/bench_rpc.py [--reps N] [--iters N] [--threads N]

Starts its own daemon on 127.0.0.1 (a free port), measures, stops it, and
prints one table:

  (a) SET_TENSOR throughput (64 MiB in 8 MiB chunks, one request at a time)
      against a numpy copy of the same chunks into a preallocated array;
  (b) round trip of a one-node graph (ggml_add of two 1024-float inputs),
      reused with GRAPH_RECOMPUTE, against computing it in process on the
      persistent-threadpool CpuBackend (inputs set, compute, output read);
  (c) a ~500-node chain of adds and muls: GRAPH_RECOMPUTE (reused graph)
      against GRAPH_COMPUTE (graph resent, validated and rebuilt every time;
      the client encodes it once, so client-side encoding is not counted).

Both sides use the same thread count (default 1). Every repetition count is
bounded; the whole run takes a few seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # DaemonProcess lives in the tests' conftest

from conftest import DaemonProcess  # noqa: E402
from ggml_ffi import Context, CpuBackend, Gallocr, ffi, lib  # noqa: E402
from rpc_daemon.client import RpcClient  # noqa: E402
from rpc_daemon.wire.graph_codec import encode_graph  # noqa: E402
from rpc_daemon.wire.protocol import Command  # noqa: E402

MiB = 1 << 20
F32 = lib.GGML_TYPE_F32


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


# ---------------------------------------------------------------- (a) SET_TENSOR vs memcpy

async def bench_set_tensor(client: RpcClient, total: int, chunk: int, reps: int) -> tuple[float, float]:
    src = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    h, _ = await client.request(Command.ALLOC_BUFFER, {"size": total})
    buf = h["buffer"]
    view = memoryview(src)
    try:
        rpc_times = []
        for _ in range(reps + 1):  # first pass warms up (page faults in the daemon's buffer)
            t0 = time.perf_counter()
            for off in range(0, total, chunk):
                await client.request(Command.SET_TENSOR, {"buffer": buf, "offset": off, "size": chunk},
                                     view[off:off + chunk])
            rpc_times.append(time.perf_counter() - t0)
        h, got = await client.request(Command.GET_TENSOR, {"buffer": buf, "offset": total - chunk, "size": chunk})
        assert got == view[total - chunk:].tobytes(), "SET_TENSOR data did not arrive intact"
    finally:
        await client.request(Command.FREE_BUFFER, {"buffer": buf})

    dst = np.empty_like(src)
    copy_times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for off in range(0, total, chunk):
            np.copyto(dst[off:off + chunk], src[off:off + chunk])
        copy_times.append(time.perf_counter() - t0)
    rpc_mbs = total / MiB / statistics.median(rpc_times[1:])
    copy_mbs = total / MiB / statistics.median(copy_times[1:])
    return rpc_mbs, copy_mbs


# ---------------------------------------------------------------- graphs

class Graph:
    """A graph of `n_ops` f32 ops on 1024-element inputs x and y: a single add,
    or a chain alternating add and mul."""

    def __init__(self, n_ops: int, n: int = 1024):
        self.ctx = Context(n_ops + 16)
        self.x = self.ctx.new_tensor(F32, [n], "x")
        self.y = self.ctx.new_tensor(F32, [n], "y")
        lib.ggml_set_input(self.x)
        lib.ggml_set_input(self.y)
        z = self.x
        for i in range(n_ops):
            z = (lib.ggml_add if i % 2 == 0 else lib.ggml_mul)(self.ctx.ptr, z, self.y)
        lib.ggml_set_output(z)
        self.out = z
        self.gf = self.ctx.new_graph(n_ops + 16)
        lib.ggml_build_forward_expand(self.gf, z)
        self.n_nodes = lib.ggml_graph_n_nodes(self.gf)
        rng = np.random.default_rng(1)
        self.xd = rng.uniform(-1, 1, n).astype(np.float32).tobytes()
        self.yd = rng.uniform(0.999, 1.001, n).astype(np.float32).tobytes()  # the chain stays finite
        self.wire, index_of = encode_graph(self.gf, lambda t: None)
        self.blob = self.xd + self.yd
        self.inputs = [[index_of[self.x], 0, len(self.xd)], [index_of[self.y], len(self.xd), len(self.yd)]]
        self.outputs = [index_of[self.out]]


class Local:
    def __init__(self, g: Graph, threads: int):
        self.g = g
        self.backend = CpuBackend(threads)
        self.galloc = Gallocr(self.backend)
        assert self.galloc.alloc_graph(g.gf)
        self.n_out = lib.ggml_nbytes(g.out)

    def run(self) -> bytes:
        g = self.g
        lib.ggml_backend_tensor_set(g.x, g.xd, 0, len(g.xd))
        lib.ggml_backend_tensor_set(g.y, g.yd, 0, len(g.yd))
        assert self.backend.compute(g.gf) == 0
        return ffi.buffer(g.out.data, self.n_out)[:]

    def close(self) -> None:
        self.galloc.close()
        self.backend.close()


async def time_requests(client: RpcClient, cmd: int, fields: dict, blob: bytes, iters: int) -> tuple[list[float], bytes]:
    samples, out = [], b""
    for _ in range(iters):
        t0 = time.perf_counter()
        _, out = await client.request(cmd, fields, blob)
        samples.append(time.perf_counter() - t0)
    return samples, out


def time_local(local: Local, iters: int) -> tuple[list[float], bytes]:
    samples, out = [], b""
    for _ in range(iters):
        t0 = time.perf_counter()
        out = local.run()
        samples.append(time.perf_counter() - t0)
    return samples, out


# ---------------------------------------------------------------- (b) and (c)

async def bench_one_node(client: RpcClient, threads: int, iters: int) -> tuple[float, float]:
    g = Graph(1)
    gid = 1
    await client.request(Command.GRAPH_COMPUTE, {"graph_id": gid, "tensors": g.wire, "inputs": g.inputs,
                                                 "outputs": g.outputs}, g.blob)
    recompute = {"graph_id": gid, "inputs": g.inputs, "outputs": g.outputs}
    await time_requests(client, Command.GRAPH_RECOMPUTE, recompute, g.blob, min(iters, 50))  # warm up
    rpc, rpc_out = await time_requests(client, Command.GRAPH_RECOMPUTE, recompute, g.blob, iters)
    await client.request(Command.GRAPH_FREE, {"graph_id": gid})
    local = Local(g, threads)
    try:
        time_local(local, min(iters, 50))
        loc, loc_out = time_local(local, iters)
    finally:
        local.close()
    assert rpc_out == loc_out, "daemon and in-process results differ"
    return median_us(rpc), median_us(loc)


async def bench_reuse(client: RpcClient, n_ops: int, iters: int) -> tuple[float, float, int, int]:
    g = Graph(n_ops)
    gid = 2
    compute = {"graph_id": 0, "tensors": g.wire, "inputs": g.inputs, "outputs": g.outputs}
    await time_requests(client, Command.GRAPH_COMPUTE, compute, g.blob, 3)  # warm up
    resend, out1 = await time_requests(client, Command.GRAPH_COMPUTE, compute, g.blob, iters)
    await client.request(Command.GRAPH_COMPUTE, dict(compute, graph_id=gid), g.blob)
    recompute = {"graph_id": gid, "inputs": g.inputs, "outputs": g.outputs}
    await time_requests(client, Command.GRAPH_RECOMPUTE, recompute, g.blob, 3)
    reuse, out2 = await time_requests(client, Command.GRAPH_RECOMPUTE, recompute, g.blob, iters)
    await client.request(Command.GRAPH_FREE, {"graph_id": gid})
    assert out1 == out2, "reused and resent graphs disagree"
    import msgpack
    wire_bytes = len(msgpack.packb(compute, use_bin_type=True))
    return median_us(reuse) / 1e3, median_us(resend) / 1e3, g.n_nodes, wire_bytes


# ---------------------------------------------------------------- main

async def run(args) -> list[tuple[str, str, str, str]]:
    daemon = DaemonProcess("-t", str(args.threads))
    try:
        client = await RpcClient.connect(daemon.endpoint, liveness_timeout=30.0)
        try:
            total, chunk = args.total_mib * MiB, args.chunk_mib * MiB
            rpc_mbs, copy_mbs = await bench_set_tensor(client, total, chunk, args.reps)
            rt_us, loc_us = await bench_one_node(client, args.threads, args.iters)
            ping, _ = await time_requests(client, Command.PING, {}, b"", min(args.iters, 500))
            reuse_ms, resend_ms, n_nodes, wire = await bench_reuse(client, args.nodes, args.graph_iters)
        finally:
            await client.aclose()
    finally:
        daemon.stop()
        daemon.kill()
    return [
        (f"(a) {args.total_mib} MiB in {args.chunk_mib} MiB chunks, median of {args.reps}", "", "", ""),
        ("    SET_TENSOR over loopback vs numpy copy", f"{rpc_mbs:,.0f} MiB/s", f"{copy_mbs:,.0f} MiB/s",
         f"{rpc_mbs / copy_mbs:.3f}x"),
        (f"(b) 1-node add of 1024 f32, median of {args.iters}", "", "", ""),
        ("    GRAPH_RECOMPUTE round trip vs in process", f"{rt_us:,.1f} us", f"{loc_us:,.1f} us",
         f"{rt_us / loc_us:,.1f}x slower"),
        ("    (for scale: PING round trip, no compute)", f"{median_us(ping):,.1f} us", "", ""),
        (f"(c) {n_nodes}-node add/mul chain, median of {args.graph_iters} ({wire / 1024:,.0f} KiB graph)", "", "", ""),
        ("    GRAPH_RECOMPUTE vs GRAPH_COMPUTE (resent)", f"{reuse_ms:,.2f} ms", f"{resend_ms:,.2f} ms",
         f"{resend_ms / reuse_ms:,.1f}x faster"),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="compute threads, daemon and in process (default 1)")
    p.add_argument("--total-mib", type=int, default=64)
    p.add_argument("--chunk-mib", type=int, default=8)
    p.add_argument("--reps", type=int, default=5, help="SET_TENSOR passes over the whole size (default 5)")
    p.add_argument("--iters", type=int, default=2000, help="one-node graph repetitions (default 2000)")
    p.add_argument("--nodes", type=int, default=500, help="ops in the chain graph (default 500)")
    p.add_argument("--graph-iters", type=int, default=50, help="chain graph repetitions (default 50)")
    args = p.parse_args(argv)
    if args.total_mib % args.chunk_mib:
        p.error("--total-mib must be a multiple of --chunk-mib")
    try:
        import uvloop
        rows = uvloop.run(run(args))
        loop_name = "uvloop"
    except ImportError:
        rows = asyncio.run(run(args))
        loop_name = "asyncio"
    head = ("measurement: A vs B", "A", "B", "ratio")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    print(f"threads={args.threads}  client loop={loop_name}  daemon on 127.0.0.1")
    print(line(head))
    print("-" * (sum(widths) + 6))
    for r in rows:
        print(line(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
