"""One client cannot take the daemon's descriptors from the others, and cannot
reach another client's memory even through a graph that validation let by.

* Buffers are page ranges of one sparse memfd arena per client: a client costs
  the daemon a constant number of descriptors whatever its buffer count.
* The daemon checks RLIMIT_NOFILE against --max-clients at start, raises the
  soft limit if it must, and serves fewer clients if even the hard one is short.
* Each client computes in a process of its own, where only its arena is mapped:
  out-of-bounds reads and writes (with --unsafe-no-validation) at many offsets
  never see nor change another client's bytes.
* A client that floods the worker with computes does not starve another
  client's (fair shares of compute time: test_fairness.py).
"""
from __future__ import annotations

import asyncio
import os
import re
import time

import numpy as np
import pytest

from ggml_ffi import Context, lib
from rpc_daemon.client import RpcClient
from rpc_daemon.wire.graph_codec import encode_graph
from rpc_daemon.wire.protocol import Command, Status
from rpc_helpers import N, RawConn, assert_served, chain_graph, check_compute, checked_session, expect_error

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

KiB, MiB = 1 << 10, 1 << 20


def run(coro, timeout: float = 240.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def daemon_fds(d) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def soft_nofile(d) -> int:
    with open(f"/proc/{d.proc.pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    return int(line.split()[3])


# ---------------------------------------------------------------- descriptors

def test_tiny_buffers_cost_no_descriptors(start_daemon):
    """One client holding the default --max-buffers (4096) one-byte buffers, on a daemon
    allowed only 600 descriptors: every allocation succeeds, the next is LIMIT_EXCEEDED
    and the client keeps its connection; the daemon's descriptor count does not grow with
    the buffers; two more clients connect, allocate and compute. (Before: two descriptors
    per buffer, so the client's allocations failed after a few hundred and then everybody's did.)"""
    # 4 KiB pages: on 2 MiB ones 4096 buffers count 8 GiB, past the default cap of a smaller machine
    dd = start_daemon("-t", "1", "--max-clients", "8", "--no-huge-pages", nofile=(600, 600))
    n_max = 4096

    async def scenario():
        a = await RpcClient.connect(dd.endpoint, liveness_timeout=20.0)
        try:
            h, _ = await a.request(Command.ALLOC_BUFFER, {"size": 1})
            first = h["buffer"]
            before = daemon_fds(dd)
            keys = [first]
            while len(keys) < n_max:
                batch = min(256, n_max - len(keys))
                replies = await asyncio.gather(*(a.request(Command.ALLOC_BUFFER, {"size": 1}) for _ in range(batch)))
                keys += [h["buffer"] for h, _ in replies]
            assert len(set(keys)) == n_max
            assert daemon_fds(dd) <= before + 2, (before, daemon_fds(dd))
            await expect_error(a.request(Command.ALLOC_BUFFER, {"size": 1}), Status.LIMIT_EXCEEDED,
                               f"buffer count limit {n_max}")
            # the client keeps its connection and its buffers work
            await a.request(Command.SET_TENSOR, {"buffer": keys[-1], "offset": 0, "size": 1}, b"\x07")
            _, out = await a.request(Command.GET_TENSOR, {"buffer": keys[-1], "offset": 0, "size": 1})
            assert out == b"\x07"
            for key in keys[:16]:
                await a.request(Command.FREE_BUFFER, {"buffer": key})
            h, _ = await a.request(Command.ALLOC_BUFFER, {"size": 4096})
            x = np.arange(12, dtype=np.float32)
            await a.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": 48}, x.tobytes())
            await check_compute(a, h["buffer"], 0, x)
            # others are served beside it: allocate, write, read, compute
            b = await RpcClient.connect(dd.endpoint, liveness_timeout=20.0)
            c = await RpcClient.connect(dd.endpoint, liveness_timeout=20.0)
            try:
                await checked_session(b, 1)
                await checked_session(c, 2)
                for _ in range(64):
                    await b.request(Command.ALLOC_BUFFER, {"size": 1})
                # three clients connected and computing: a constant cost each
                assert daemon_fds(dd) <= before + 2 * 8, (before, daemon_fds(dd))
            finally:
                await b.aclose()
                await c.aclose()
        finally:
            await a.aclose()

    run(scenario())
    assert_served(dd)


def test_open_files_limit_checked_at_start(start_daemon):
    """A hard RLIMIT_NOFILE too low for --max-clients: the daemon says so at start and
    serves the number of clients it can; the next is refused at connect, the others work."""
    dd = start_daemon("-t", "1", "--max-clients", "64", nofile=(256, 256))
    line = dd.wait_log("open-files limit")
    served = int(re.search(r"effective_max_clients=(\d+)", line).group(1))
    assert 1 <= served < 64 and "rlimit_nofile=256" in line, line
    conns = []
    try:
        for _ in range(served):
            conn = RawConn(dd.port)
            conn.hello()
            conns.append(conn)
        extra = RawConn(dd.port)
        h, _ = extra.recv_frame()
        assert h["status"] == Status.LIMIT_EXCEEDED and f"limit {served}" in h["error"], h
        extra.close()
    finally:
        for conn in conns:
            conn.close()
    deadline = time.monotonic() + 5  # the daemon sees the closes a moment later
    while sum("client disconnected" in line for line in dd.log_lines) < served + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_served(dd)


def test_soft_open_files_limit_raised(start_daemon):
    """A soft limit too low for --max-clients, under a hard limit high enough: raised, no warning."""
    dd = start_daemon("-t", "1", "--max-clients", "64", nofile=(128, 4096))
    assert soft_nofile(dd) >= 64 + 64 * 8
    assert not any("open-files limit" in line for line in dd.log_lines)
    assert_served(dd)


# ---------------------------------------------------------------- isolation

MARK = b"VICTIM-SECRET-%08d"  # 22 bytes: found in any output that copied a victim's row
# Large enough that each mapping in the old shared compute process was placed top-down, one
# right below the other: the victim's buffer, the output area (holding the victim's last output)
# and the victim's graph intermediates (a copy of its data) lay right above the attacker's buffer.
VICTIM_BYTES = ATTACKER_BYTES = 8 * MiB
WINDOW = 2 * MiB  # bytes an attacker graph reads or writes at once


def victim_data() -> bytes:
    data = b"".join((MARK % i).ljust(32, b".") for i in range(VICTIM_BYTES // 32))
    assert len(data) == VICTIM_BYTES
    return data


def copy_graph(buf: int, offset: int, nbytes: int, write: bool):
    """Unvalidated: a f32 tensor of `nbytes` at (buf, offset), wherever that is. read: z = dup(t),
    returned; write: t = cpy(src), src an inline input of 0x55 bytes. Returns (fields, blob)."""
    ctx = Context(16)
    try:
        t = ctx.new_tensor(lib.GGML_TYPE_F32, [nbytes // 4], "t")
        if write:
            src = ctx.new_tensor(lib.GGML_TYPE_F32, [nbytes // 4], "src")
            lib.ggml_set_input(src)
            z = lib.ggml_cpy(ctx.ptr, src, t)
        else:
            z = lib.ggml_dup(ctx.ptr, t)
            lib.ggml_set_output(z)
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, z)
        tensors, index_of = encode_graph(gf, lambda x: (buf, offset) if x == t else None)
    finally:
        ctx.close()
    if write:
        return {"tensors": tensors, "inputs": [[index_of[src], 0, nbytes]], "outputs": []}, b"\x55" * nbytes
    return {"tensors": tensors, "outputs": [index_of[z]]}, b""


ATTACK_OFFSETS = [ATTACKER_BYTES + k * WINDOW for k in range(16)] + [64 * MiB, 1 << 30, (1 << 40) - WINDOW]


def test_out_of_bounds_graph_cannot_reach_another_client(start_daemon):
    """With validation off, an attacker's graphs read and write far past its own buffer, at
    offsets where the single shared compute process had the victim's buffer, its graph's
    intermediates and the output area mapped (right above the attacker's), and beyond: its
    computes may die (FAILED), but no victim byte shows in any of its outputs, the victim's
    buffer stays byte for byte the same, and the victim computes correctly throughout, in a
    process that never died. On 20fd020 the first read (8 MiB past) returned the victim's
    data, and writes changed its buffer and crashed its computes."""
    dd = start_daemon("-t", "1", "--unsafe-no-validation")
    data = victim_data()

    async def victim_computes(v, vbuf, scratch):
        x = np.linspace(-3, 3, 12, dtype=np.float32)
        await v.request(Command.SET_TENSOR, {"buffer": scratch, "offset": 0, "size": 48}, x.tobytes())
        await check_compute(v, scratch, 0, x)
        fields, _ = copy_graph(vbuf, 0, VICTIM_BYTES, write=False)  # the victim reads its own secret
        h, out = await v.request(Command.GRAPH_COMPUTE, fields)
        assert out == data

    async def scenario():
        v = await RpcClient.connect(dd.endpoint, liveness_timeout=20.0)
        a = await RpcClient.connect(dd.endpoint, liveness_timeout=20.0)
        try:
            h, _ = await v.request(Command.ALLOC_BUFFER, {"size": VICTIM_BYTES})
            vbuf = h["buffer"]
            await v.request(Command.SET_TENSOR, {"buffer": vbuf, "offset": 0, "size": VICTIM_BYTES}, data)
            h, _ = await v.request(Command.ALLOC_BUFFER, {"size": 4096})
            scratch = h["buffer"]
            h, _ = await a.request(Command.ALLOC_BUFFER, {"size": ATTACKER_BYTES})
            abuf = h["buffer"]
            await a.request(Command.SET_TENSOR, {"buffer": abuf, "offset": 0, "size": ATTACKER_BYTES},
                            b"\x11" * ATTACKER_BYTES)
            died = 0
            for write in (False, True):
                for off in ATTACK_OFFSETS:
                    await victim_computes(v, vbuf, scratch)  # its buffer mapped wherever it would be
                    fields, blob = copy_graph(abuf, off, WINDOW, write)
                    try:
                        h, out = await a.request(Command.GRAPH_COMPUTE, fields, blob)
                    except Exception as exc:  # noqa: BLE001 - the attacker's compute may die
                        assert getattr(exc, "status", None) == Status.FAILED, exc
                        died += 1
                        continue
                    assert b"VICTIM-SECRET" not in out, f"victim data read at offset {off}"
            _, out = await v.request(Command.GET_TENSOR, {"buffer": vbuf, "offset": 0, "size": VICTIM_BYTES})
            assert out == data, "the attacker's writes changed the victim's buffer"
            await victim_computes(v, vbuf, scratch)
            _, out = await a.request(Command.GET_TENSOR, {"buffer": abuf, "offset": 0, "size": ATTACKER_BYTES})
            assert b"VICTIM-SECRET" not in out
            return died
        finally:
            await v.aclose()
            await a.aclose()

    died = run(scenario(), timeout=600)
    assert dd.alive()
    lost = [line for line in dd.log_lines if "compute process lost" in line]
    assert len(lost) == died
    victim = re.search(r"client=(\d+)", next(line for line in dd.log_lines if "compute process assigned" in line))
    assert all(re.search(r"client=(\d+)", line).group(1) != victim.group(1) for line in lost), lost
    assert_served(dd)


# ---------------------------------------------------------------- the arena, without a daemon

def test_arena_reuses_freed_ranges_zeroed_and_releases_pages():
    """First fit, neighbours coalesced, every buffer zeroed when handed out, freed pages released
    (MADV_REMOVE inside, ftruncate at the top), sizes counted as whole pages, one arena per owner."""
    from rpc_daemon.daemon.buffers import PAGE, BufferRegistry

    reg = BufferRegistry(64 * PAGE, arena_bytes=1 << 30)
    held = lambda: os.fstat(reg.arena(1).fd).st_blocks * 512  # noqa: E731
    a, b, c = (reg.alloc(1, n) for n in (1, 2 * PAGE, PAGE + 1))
    assert [x.offset for x in (a, b, c)] == [0, PAGE, 3 * PAGE] and reg.allocated == 5 * PAGE
    assert os.fstat(reg.arena(1).fd).st_size == 5 * PAGE  # the file ends at the highest live buffer
    for x in (a, b, c):
        x.view[:] = b"\xff" * x.size
    reg.free(b)  # a hole: its pages go back
    assert held() == 3 * PAGE and reg.allocated == 3 * PAGE
    d = reg.alloc(1, PAGE)  # first fit: into the hole, zeroed
    assert d.offset == PAGE and bytes(d.view) == b"\0" * PAGE
    reg.free(a)
    reg.free(d)  # coalesced with a's range: 2 pages at 0
    e = reg.alloc(1, 2 * PAGE)
    assert e.offset == 0 and bytes(e.view) == b"\0" * (2 * PAGE)
    reg.free(c)  # the top: the file shrinks to the highest live buffer
    assert os.fstat(reg.arena(1).fd).st_size == 2 * PAGE
    assert reg.alloc(1, 63 * PAGE) is None  # --mem counts whole pages: 2 + 63 > 64
    other = reg.alloc(2, 1)  # another owner: another arena, never the same memory
    assert reg.arena(2) is not reg.arena(1) and reg.get(1, other.key) is None
    reg.release(1)
    reg.release(2)
    assert reg.allocated == 0 and len(reg) == 0 and reg.arena(1) is None


# ---------------------------------------------------------------- compute fairness

FLOOD = 24  # computes client A has queued at the daemon at once (below its 64-request backpressure)


def test_flooding_client_does_not_starve_another(start_daemon):
    """Computes run one at a time daemon-wide, through a lock that each
    connection asks for once per request (its requests run in order on its own
    task) and that goes to the waiting client that has held it least
    (FairLock, tests/daemon/test_fairness.py). So a client with a backlog of
    computes holds one place in the line, and another client's compute waits
    for at most the one running. Measured as order, not time: while A has FLOOD long computes
    pipelined, B runs 5 small ones in turn, and each of B's computes must
    complete with at most 2 of A's completing meanwhile (the one running, and one
    of slack for replies read in the same loop pass); a lock that let A's next
    compute jump ahead of B's (or a connection that drained its queue under the
    lock) makes B wait for A's whole backlog, about FLOOD. A still has most of
    its backlog left when B is done, so B really competed with a flood."""
    d = start_daemon("-t", "1")

    async def main():
        a = await RpcClient.connect(d.endpoint, liveness_timeout=60.0)
        b = await RpcClient.connect(d.endpoint, liveness_timeout=60.0)
        try:
            h, _ = await a.request(Command.ALLOC_BUFFER, {"size": 2 * N * N * 4})
            chain = np.random.default_rng(1).standard_normal(2 * N * N).astype(np.float32).tobytes()
            await a.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": len(chain)}, chain)
            tensors, _ = chain_graph(h["buffer"], steps=1)
            await a.request(Command.GRAPH_COMPUTE, {"graph_id": 1, "tensors": tensors, "outputs": []})
            h, _ = await b.request(Command.ALLOC_BUFFER, {"size": 4096})
            b_buf, b_data = h["buffer"], np.arange(12, dtype=np.float32)
            await b.request(Command.SET_TENSOR, {"buffer": b_buf, "offset": 0, "size": 48}, b_data.tobytes())
            await check_compute(b, b_buf, 0, b_data)  # B's compute process started: only turns are measured

            a_done = 0

            async def a_compute():
                nonlocal a_done
                await a.request(Command.GRAPH_RECOMPUTE, {"graph_id": 1, "outputs": []})
                a_done += 1

            flood = [asyncio.create_task(a_compute()) for _ in range(FLOOD)]
            while a_done == 0:  # A's backlog is queued at the daemon and computing (bounded by run's timeout)
                await asyncio.sleep(0.005)
            a_during_b = []
            for _ in range(5):
                before = a_done
                await check_compute(b, b_buf, 0, b_data)
                a_during_b.append(a_done - before)
            a_left = FLOOD - a_done
            await asyncio.gather(*flood)
            return a_during_b, a_left
        finally:
            await a.aclose()
            await b.aclose()

    a_during_b, a_left = run(main())
    assert max(a_during_b) <= 2, f"B's computes waited behind {a_during_b} of A's"
    assert a_left >= FLOOD // 2, f"A's flood was almost over ({a_left} left) before B was done"
