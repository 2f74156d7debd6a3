"""What one tensor-parallel exchange costs, worker to worker.

    python bench/bench_exchange.py [--exchanges 44] [--reps 200] [--tls]

Two local workers (ggml-rpc-server on 127.0.0.1, 1 thread each) are linked
(TENSOR_LINK) and both compute, at once, a graph of --exchanges tiny ops whose
every result is all-reduced over the link (a partial sum going from one
compute process to the other, as a tensor-parallel layer's twice); then the
same graph without the exchanges. (with - without) / exchanges is the cost of
one exchange: the segment boundary, the bytes both ways, the wait, the sum.
Sizes: 2, 8, 16 and 512 KiB (a token's hidden state of n_embd 512, 2048 and 4096
in f32; a 64-token prompt's of n_embd 2048). The median of --reps steps each, side by side in one run. Issue #27's
budget: <= 150 us per exchange of 2-16 KB on loopback. With --tls, then the same over
two TLS workers (--tls-cert, --peer-tls-ca: throwaway certificates from tests/tls_certs.py),
whose links are TLS sessions in the compute processes.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ggml_ffi import Context, lib  # noqa: E402
from coordinator.serving.local_workers import LocalWorkers  # noqa: E402
from rpc_daemon.client import RpcClient, parse_endpoint  # noqa: E402
from rpc_daemon.wire.graph_codec import encode_graph  # noqa: E402
from rpc_daemon.wire.protocol import Command  # noqa: E402


def chain(n_floats: int, n_ops: int):
    """x -> scale -> scale -> ... (n_ops), every scale's result a node: (wire tensors, input, nodes, output)."""
    ctx = Context(n_ops + 8)
    try:
        x = ctx.new_tensor(lib.GGML_TYPE_F32, [n_floats], "x")
        lib.ggml_set_input(x)
        cur, nodes = x, []
        for _ in range(n_ops):
            cur = lib.ggml_scale(ctx.ptr, cur, 0.5)
            nodes.append(cur)
        lib.ggml_set_output(cur)
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, cur)
        tensors, index = encode_graph(gf, lambda t: None)
        return tensors, index[x], [index[n] for n in nodes], index[cur]
    finally:
        ctx.close()


async def bench(endpoints: list[str], n_exchanges: int, reps: int, ssl_context=None) -> list[tuple[int, float, float]]:
    a, b = [await RpcClient.connect(e, ssl_context=ssl_context) for e in endpoints]
    try:
        la = await a.request(Command.TENSOR_LINK, {"op": "listen", "link": 1})
        await b.request(Command.TENSOR_LINK, {"op": "listen", "link": 1})
        peer = {"rank": 0, "host": parse_endpoint(endpoints[0])[0], "port": la[0]["port"], "ticket": la[0]["ticket"]}
        await asyncio.gather(a.request(Command.TENSOR_LINK, {"op": "join", "link": 1, "rank": 0, "n": 2}),
                             b.request(Command.TENSOR_LINK, {"op": "join", "link": 1, "rank": 1, "n": 2,
                                                             "peers": [peer]}))
        rows, step = [], 0
        for n_floats in (512, 2048, 4096, 131072):
            tensors, x, nodes, out = chain(n_floats, n_exchanges)
            blob = bytes(4 * n_floats)
            times = {}
            for graph_id, exchanged in ((10 + n_floats, True), (20 + n_floats, False)):
                samples = []
                for rep in range(reps + 5):  # the first sends the graph, the first 5 are not measured
                    step += 1
                    fields = {"graph_id": graph_id, "inputs": [[x, 0, len(blob)]], "outputs": [out]}
                    if exchanged:
                        fields["tensor"] = {"link": 1, "step": step, "exchange": nodes, "timeout": 30.0}
                    cmd = Command.GRAPH_RECOMPUTE if rep else Command.GRAPH_COMPUTE
                    if cmd == Command.GRAPH_COMPUTE:
                        fields["tensors"] = tensors
                    started = time.perf_counter()
                    await asyncio.gather(a.request(cmd, fields, blob), b.request(cmd, fields, blob))
                    if rep >= 5:
                        samples.append(time.perf_counter() - started)
                times[exchanged] = statistics.median(samples)
            rows.append((4 * n_floats, times[True], times[False]))
        return rows
    finally:
        await a.aclose()
        await b.aclose()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--exchanges", type=int, default=44, help="exchanges per step (a 22-layer model's)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--tls", action="store_true", help="then the same between TLS workers")
    args = p.parse_args(argv)
    with LocalWorkers(2, threads=1) as workers:
        rows = asyncio.run(bench(workers.endpoints, args.exchanges, args.reps))
    report("plain TCP", rows, args)
    if args.tls:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
        from tls_certs import make_tls_files
        from rpc_daemon.wire.tls import client_context
        with tempfile.TemporaryDirectory() as d:
            files = make_tls_files(pathlib.Path(d))
            tls_args = ("--tls-cert", files.cert, "--tls-key", files.key, "--peer-tls-ca", files.ca)
            with LocalWorkers(2, threads=1, extra_args=tls_args) as workers:
                rows = asyncio.run(bench(workers.endpoints, args.exchanges, args.reps, client_context(files.ca)))
        report("TLS", rows, args)
    return 0


def report(mode: str, rows: list, args) -> None:
    print(f"{'bytes':>8} {'step with':>12} {'without':>12} {'per exchange':>14}   ({mode}: {args.exchanges} exchanges "
          f"a step, median of {args.reps}; load {os.getloadavg()[0]:.2f})")
    for size, with_x, without in rows:
        per = (with_x - without) / args.exchanges
        print(f"{size:>8} {with_x * 1e3:>10.3f}ms {without * 1e3:>10.3f}ms {per * 1e6:>12.1f}us  "
              + (f"({'within' if per <= 150e-6 else 'OVER'} the 150 us budget)" if size <= 16384 else ""))


if __name__ == "__main__":
    sys.exit(main())
