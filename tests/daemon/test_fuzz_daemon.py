"""Property-based fuzzing of a live daemon (strategies in fuzz_protocol.py):
thousands of protocol messages with valid framing and random contents over
one reused connection; then the daemon must be alive, compute correct
results, and be back at its memory baseline once the fuzzing client left.

bench/fuzz_daemon.py runs the same for longer (--cases 50000).
"""
from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conftest import SLACK, DaemonProcess
from fuzz_protocol import (SEEDS, FuzzClient, daemon_failures, command_messages, graph_messages, lying_prefixes, raw_messages,
                           tiny_buffer_bursts)
from rpc_daemon.client import RpcClient
from rpc_daemon.wire.protocol import Command
from rpc_helpers import assert_served, rss

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

MEM_MIB = 32
# cases per family; the first three add up to more than 2,000
N_RAW, N_COMMANDS, N_GRAPHS = 700, 700, 900
N_LIES, N_BURSTS = 160, 25


def fuzz(n: int) -> settings:
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=True,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck))


async def device_info(endpoint: str) -> dict:
    c = await RpcClient.connect(endpoint)
    try:
        h, _ = await c.request(Command.DEVICE_INFO)
        return h
    finally:
        await c.aclose()


def free_memory_settled(endpoint: str, want: int, timeout: float = 10.0) -> int:
    """free_memory once it reads `want` (a departed client's graphs are dropped by the compute process
    just after it leaves), or what it reads at the deadline (`timeout` times SLACK)."""
    deadline = time.monotonic() + timeout * SLACK
    while True:
        free = asyncio.run(device_info(endpoint))["free_memory"]
        if free == want or time.monotonic() > deadline:
            return free
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fuzzed():
    """The daemon under fuzz, its baseline, and the one fuzzing client."""
    # memfd arenas on 4 KiB pages: on 2 MiB ones the 32 MiB cap (which keeps free memory deterministic) would hold
    # only 16 buffers, and a burst of hundreds would meet ALLOC_FAILED (test_shared_memory.py covers 2 MiB pages)
    d = DaemonProcess("-t", "1", "-m", str(MEM_MIB), "--max-requests-per-second", "0", "--no-huge-pages")
    try:
        assert_served(d)  # compute process up, first allocations made: a fair baseline
        baseline = {"free_memory": free_memory_settled(d.endpoint, MEM_MIB << 20), "rss": rss(d.proc.pid),
                    "started": time.monotonic()}
        client = FuzzClient(d.port, pid=d.proc.pid)
        yield d, client, baseline
    finally:
        d.stop()
        d.kill()


def _check_alive(d):
    assert d.alive(), "daemon died:\n" + "".join(d.log_lines[-40:])


def test_seed_graphs_compute(fuzzed):
    """The unmutated seeds are valid graphs: the graph fuzzer starts from inside the validator."""
    d, client, _ = fuzzed
    assert len(SEEDS) >= 5, [s.name for s in SEEDS]
    from fuzz_protocol import Message
    import numpy as np
    for seed in SEEDS:
        specs, parts, off = [], [], 0
        for t, nbytes, kind in seed.inputs:
            dtype = {"i32": np.int32, "i64": np.int64, "f16": np.float16, "f32": np.float32}[kind]
            data = (np.arange(nbytes // np.dtype(dtype).itemsize) % 3).astype(dtype).tobytes()
            specs.append([t, off, len(data)])
            parts.append(data)
            off += len(data)
        msg = Message({"cmd": int(Command.GRAPH_COMPUTE), "tensors": seed.tensors, "inputs": specs,
                       "outputs": seed.outputs}, b"".join(parts), f"seed {seed.name}")
        reply = client.send(msg)
        assert reply is not None and reply["status"] == 0, (seed.name, reply)


@fuzz(N_RAW)
@given(msg=raw_messages())
def test_fuzz_raw_messages(fuzzed, msg):
    d, client, _ = fuzzed
    client.send(msg)
    _check_alive(d)


@fuzz(N_COMMANDS)
@given(data=st.data())
def test_fuzz_commands(fuzzed, data):
    d, client, _ = fuzzed
    if client.conn is None:
        client.connect()
    client.send(data.draw(command_messages()))
    _check_alive(d)


@fuzz(N_GRAPHS)
@given(data=st.data())
def test_fuzz_graphs(fuzzed, data):
    d, client, _ = fuzzed
    if client.conn is None:
        client.connect()
    client.send(data.draw(graph_messages()))
    _check_alive(d)


@fuzz(N_LIES)
@given(msg=lying_prefixes())
def test_fuzz_lying_prefixes(fuzzed, msg):
    """Connections that declare up to 4 GiB of header and 16 EiB of blob and send
    a few bytes, 16 held open at once: the daemon's RSS must not follow the lies."""
    d, client, _ = fuzzed
    client.send(msg)
    _check_alive(d)


@fuzz(N_BURSTS)
@given(msg=tiny_buffer_bursts())
def test_fuzz_tiny_buffer_bursts(fuzzed, msg):
    d, client, _ = fuzzed
    client.send(msg)
    _check_alive(d)


def test_daemon_after_fuzzing(fuzzed):
    """Alive, correct, and back at its baseline once the fuzzing client left."""
    d, client, baseline = fuzzed
    cases, reconnects = client.cases, client.reconnects
    client.close()
    client.close_victim()
    assert cases >= 2000, (cases, client.unencodable)
    print(f"\nlying connections: at most {client.max_lie_growth / (1 << 20):.1f} MiB of daemon RSS for "
          f"{client.LIES_HELD} held open")
    _check_alive(d)
    for seed in range(3):
        assert_served(d, seed=seed)
    free = free_memory_settled(d.endpoint, MEM_MIB << 20)
    assert free == baseline["free_memory"] == MEM_MIB << 20, (free, baseline)
    grown = rss(d.proc.pid) - baseline["rss"]
    assert grown < 64 << 20, f"daemon RSS grew by {grown >> 20} MiB over {cases} cases"
    failures = daemon_failures(d.log_lines)
    assert not failures, "".join("".join(d.log_lines[i: i + 30]) for i in failures)[:3000]
    print(f"\n{cases} fuzz cases, {reconnects} connections, {time.monotonic() - baseline['started']:.1f} s, "
          f"RSS {grown / (1 << 20):+.1f} MiB; replies: "
          + ", ".join(f"{k[0]}:{k[1]}={v}" for k, v in sorted(client.statuses.items())))


def test_fuzz_finding_cpy_into_a_bigger_dst(fuzzed):
    """Found by this fuzzer: CPY whose dst (src[1]) is the whole cache while the
    result claims the shape of a smaller view passed validation, and libggml's
    GGML_ASSERT(nelements(dst) == nelements(src0)) killed the compute process.
    The result of a CPY must now be dst itself (same type and shape)."""
    from ggml_ffi import lib
    from fuzz_protocol import Message
    d, client, _ = fuzzed
    if client.conn is None:
        client.connect()
    seed = next(s for s in SEEDS if s.name == "glu_cpy")
    tensors = [dict(t) for t in seed.tensors]
    cpy = next(i for i, t in enumerate(tensors) if t["op"] == lib.GGML_OP_CPY)
    cache = next(i for i, t in enumerate(tensors) if t["name"] == "cache")
    tensors[cpy]["src"] = [cache, cache]
    (t, nbytes, _), = seed.inputs
    msg = Message({"cmd": int(Command.GRAPH_COMPUTE), "tensors": tensors, "inputs": [[t, 0, nbytes]],
                   "outputs": seed.outputs}, bytes(nbytes), "GRAPH_COMPUTE cpy finding")
    reply = client.send(msg)
    assert reply["status"] == -100 and f"tensors[{cpy}]" in reply["error"] and "view of dst" in reply["error"], reply


def test_fuzz_finding_zero_stride_view_reads_another_client(fuzzed):
    """The audit's finding A in the fuzzer's own terms: a view with nb[0] = 0 was
    counted as one element per row, GET_ROWS read ne[0] of them, and the reply
    carried the victim client's canary. Now refused, and the victim untouched."""
    from ggml_ffi import lib
    from fuzz_protocol import Message
    d, client, _ = fuzzed
    if client.conn is None:
        client.connect()
    tensors = [
        {"type": 0, "ne": [16384, 1, 1, 1], "nb": [4, 65536, 65536, 65536], "buffer": client.base, "offset": 0},
        {"type": 0, "ne": [1024, 1, 1, 1], "nb": [0, 4096, 4096, 4096], "op": lib.GGML_OP_VIEW, "src": [0],
         "view_src": 0, "view_offs": 65532},
        {"type": lib.GGML_TYPE_I32, "ne": [1, 1, 1, 1], "nb": [4, 4, 4, 4], "flags": lib.GGML_TENSOR_FLAG_INPUT},
        {"type": 0, "ne": [1024, 1, 1, 1], "nb": [4, 4096, 4096, 4096], "op": lib.GGML_OP_GET_ROWS, "src": [1, 2],
         "flags": lib.GGML_TENSOR_FLAG_OUTPUT | lib.GGML_TENSOR_FLAG_COMPUTE},
    ]
    reply = client.send(Message({"cmd": int(Command.GRAPH_COMPUTE), "tensors": tensors, "inputs": [[2, 0, 4]],
                                 "outputs": [3]}, bytes(4), "GRAPH_COMPUTE zero-stride finding"))
    assert reply is not None and reply["status"] == -100 and "tensors[1]" in reply["error"], reply
    client.victim_compute()
