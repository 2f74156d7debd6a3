"""libggml aborting or segfaulting costs the client one FAILED reply, nothing
more: buffers live in the daemon's shared memory, the compute process is
restarted, the connection, the daemon and other clients carry on."""
from __future__ import annotations

import asyncio
import copy
import os
import re
import signal
import time

import numpy as np
import pytest

from conftest import SLACK
from ggml_ffi import Context, lib
from rpc_daemon.client import RpcClient
from rpc_daemon.wire.graph_codec import encode_graph
from rpc_daemon.wire.protocol import Command, Status
from rpc_helpers import N, RawConn, assigned_pids, chain_graph, expect_error, normal_session

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

A_OFF, B_OFF, BUF_SIZE = 0, 256, 4096


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def mul_mat_graph(buf: int):
    """z = mul_mat(a, b), a f32 [8, 4] at A_OFF and b f32 [8, 2] at B_OFF of `buf`.
    Returns (wire tensors, index of a, of b, of z)."""
    ctx = Context(16)
    try:
        a = ctx.new_tensor(lib.GGML_TYPE_F32, [8, 4], "a")
        b = ctx.new_tensor(lib.GGML_TYPE_F32, [8, 2], "b")
        z = lib.ggml_mul_mat(ctx.ptr, a, b)
        lib.ggml_set_output(z)
        gf = ctx.new_graph()
        lib.ggml_build_forward_expand(gf, z)
        place = {a: (buf, A_OFF), b: (buf, B_OFF)}
        tensors, idx = encode_graph(gf, lambda t: place.get(t))
        return tensors, idx[a], idx[b], idx[z]
    finally:
        ctx.close()


def asserting_graph(tensors, ia, ib, iz):
    """The result claims ne [5, 2] while src0 has 4 rows: the CPU kernel's
    GGML_ASSERT(ne0 == ne01) fires and aborts."""
    bad = copy.deepcopy(tensors)
    bad[iz].update(ne=[5, 2, 1, 1], nb=[4, 20, 40, 40])
    return bad


def segfaulting_graph(tensors, ia, ib, iz):
    """src0 claims to live 1 TiB past the start of its 4 KiB buffer: the kernel
    reads unmapped memory."""
    bad = copy.deepcopy(tensors)
    bad[ia]["offset"] = 1 << 40
    return bad


CRASHES = [
    pytest.param(asserting_graph, "SIGABRT", "GGML_ASSERT(ne0 == ne01) failed",
                 (Status.INVALID_REQUEST, "MUL_MAT", "result must be f32 [4, 2, 1, 1]"), id="abort"),
    pytest.param(segfaulting_graph, "SIGSEGV", None,
                 (Status.INVALID_REQUEST, "runs past the end of buffer"), id="segfault"),
]


def known_data():
    rng = np.random.default_rng(7)
    a = rng.standard_normal((4, 8)).astype(np.float32)  # numpy order: ne [8, 4]
    b = rng.standard_normal((2, 8)).astype(np.float32)
    tail = rng.integers(0, 256, BUF_SIZE - 512, dtype=np.uint8).tobytes()
    data = bytearray(BUF_SIZE)
    data[A_OFF:A_OFF + a.nbytes] = a.tobytes()
    data[B_OFF:B_OFF + b.nbytes] = b.tobytes()
    data[512:] = tail
    return bytes(data), b @ a.T  # result ne [4, 2] = numpy (2, 4)


async def check_mul_mat(c: RpcClient, tensors, iz, expect, graph_id: int = 0, recompute: bool = False):
    cmd = Command.GRAPH_RECOMPUTE if recompute else Command.GRAPH_COMPUTE
    fields = {"graph_id": graph_id, "outputs": [iz]}
    if not recompute:
        fields["tensors"] = tensors
    h, out = await c.request(cmd, fields)
    assert h["status"] == Status.SUCCESS and h["outputs"] == [[iz, 0, 32]]
    np.testing.assert_allclose(np.frombuffer(out, np.float32).reshape(2, 4), expect, rtol=1e-5, atol=1e-5)


def eventually(cond, timeout: float = 3.0) -> bool:
    """Poll `cond` (e.g. over log lines, read by a thread) until true or `timeout` (times SLACK)."""
    deadline = time.monotonic() + timeout * SLACK
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def compute_pids(d) -> list[int]:
    return [int(m.group(1)) for line in d.log_lines
            if "compute process started" in line and (m := re.search(r"pid=(\d+)", line))]


def lost_lines(d) -> list[str]:
    return [line for line in d.log_lines if "compute process lost" in line]


@pytest.mark.parametrize("make_bad, signame, log_fragment, _rejected", CRASHES)
def test_compute_crash_is_contained(start_daemon, make_bad, signame, log_fragment, _rejected):
    d = start_daemon("-t", "1", "--unsafe-no-validation")

    async def scenario():
        c = await RpcClient.connect(d.endpoint, liveness_timeout=10.0)
        other = await RpcClient.connect(d.endpoint, liveness_timeout=10.0)
        try:
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": BUF_SIZE})
            buf = h["buffer"]
            data, expect = known_data()
            await c.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": BUF_SIZE}, data)
            h, _ = await other.request(Command.ALLOC_BUFFER, {"size": 64})
            other_buf = h["buffer"]
            await other.request(Command.SET_TENSOR, {"buffer": other_buf, "offset": 0, "size": 64}, b"\x42" * 64)
            tensors, ia, ib, iz = mul_mat_graph(buf)
            await check_mul_mat(c, tensors, iz, expect, graph_id=1)  # cached in the compute process
            bad = make_bad(tensors, ia, ib, iz)
            for attempt in range(2):  # the restarted compute process dies just the same
                await expect_error(c.request(Command.GRAPH_COMPUTE, {"graph_id": 2, "tensors": bad, "outputs": [iz]}),
                                   Status.FAILED, f"compute process died of {signame}")
                assert d.alive()
                # the client's data survived in the daemon's shared memory
                h, out = await c.request(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": BUF_SIZE})
                assert out == data
                # a valid graph computes on the same connection: a new one, and the cached
                # one, which the new compute process has never seen
                await check_mul_mat(c, tensors, iz, expect)
                await check_mul_mat(c, tensors, iz, expect, graph_id=1, recompute=True)
            # the bad graph stays cached under its id; recomputing it crashes again, harmlessly
            await expect_error(c.request(Command.GRAPH_RECOMPUTE, {"graph_id": 2, "outputs": [iz]}),
                               Status.FAILED, f"compute process died of {signame}")
            await c.request(Command.GRAPH_FREE, {"graph_id": 2})
            await check_mul_mat(c, tensors, iz, expect, graph_id=1, recompute=True)
            # the other client: its buffer is intact and it is served
            _, out = await other.request(Command.GET_TENSOR, {"buffer": other_buf, "offset": 0, "size": 64})
            assert out == b"\x42" * 64
            await normal_session(d.endpoint)
        finally:
            await c.aclose()
            await other.aclose()

    run(scenario())
    assert d.alive()
    # 3 deaths, each of them a process of the crashing client (the first to compute), restarted
    # for it alone: every process has its own pid, and none served two clients
    assert eventually(lambda: len(lost_lines(d)) == 3), lost_lines(d)
    first = re.search(r"client=(\d+)", next(line for line in d.log_lines if "compute process assigned" in line))
    assert all(f"client={first.group(1)}" in line for line in lost_lines(d)), lost_lines(d)
    assert len(set(compute_pids(d))) == len(compute_pids(d))
    assert len(assigned_pids(d)) == len(set(assigned_pids(d)))
    if log_fragment:
        assert eventually(lambda: any(log_fragment in line for line in d.log_lines)), "".join(d.log_lines[-20:])


@pytest.mark.parametrize("make_bad, _signame, _log, rejected", CRASHES)
def test_validation_rejects_crashing_graphs(start_daemon, make_bad, _signame, _log, rejected):
    d = start_daemon("-t", "1")

    async def scenario():
        c = await RpcClient.connect(d.endpoint)
        try:
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": BUF_SIZE})
            buf = h["buffer"]
            data, expect = known_data()
            await c.request(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": BUF_SIZE}, data)
            tensors, ia, ib, iz = mul_mat_graph(buf)
            bad = make_bad(tensors, ia, ib, iz)
            status, *fragments = rejected
            await expect_error(c.request(Command.GRAPH_COMPUTE, {"tensors": bad, "outputs": [iz]}),
                               status, *fragments)
            await check_mul_mat(c, tensors, iz, expect)
            _, out = await c.request(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": BUF_SIZE})
            assert out == data
        finally:
            await c.aclose()

    run(scenario())
    # refused before compute: the client's compute process never died (the daemon started
    # one spare, the client took it, and the next spare started)
    # (the next spare starts after the reply has gone out: its log line may come a moment later)
    assert eventually(lambda: len(compute_pids(d)) >= 2), compute_pids(d)
    assert len(compute_pids(d)) == 2 and len(assigned_pids(d)) == 1
    assert not any("compute process lost" in line for line in d.log_lines)


# ---------------------------------------------------------------- long computes

def load_chain(conn: RawConn, steps: int):
    """Allocate and fill the chain's buffer: a = identity, so the result is x0."""
    h, _ = conn.call(Command.ALLOC_BUFFER, {"size": 2 * N * N * 4})
    assert h["status"] == Status.SUCCESS
    buf = h["buffer"]
    x0 = np.random.default_rng(3).standard_normal((N, N)).astype(np.float32)
    data = np.eye(N, dtype=np.float32).tobytes() + x0.tobytes()
    h, _ = conn.call(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": len(data)}, data)
    assert h["status"] == Status.SUCCESS
    tensors, iz = chain_graph(buf, steps)
    return tensors, iz, x0


def test_ping_answered_during_long_compute(start_daemon):
    d = start_daemon("-t", "1")
    with RawConn(d.port, timeout=30) as conn:
        conn.hello()
        tensors, iz, x0 = load_chain(conn, steps=24)
        t0 = time.monotonic()
        compute_id = conn.request(Command.GRAPH_COMPUTE, {"tensors": tensors, "outputs": [iz]})
        ping_id = conn.request(Command.PING)
        h1, _ = conn.recv_frame()
        t_ping = time.monotonic() - t0
        h2, out = conn.recv_frame()
        t_done = time.monotonic() - t0
    assert h1["id"] == ping_id and h1["status"] == Status.SUCCESS, (h1, h2)
    assert h2["id"] == compute_id and h2["status"] == Status.SUCCESS, h2
    assert np.array_equal(np.frombuffer(out, np.float32).reshape(N, N), x0)
    # the compute really was long, and the PING did not wait for it
    assert t_done > 0.5 and t_done - t_ping > 0.4, (t_ping, t_done)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_exits_promptly(start_daemon):
    d = start_daemon("-t", "1")
    conn = RawConn(d.port)
    conn.hello()
    h, _ = conn.call(Command.ALLOC_BUFFER, {"size": 4096})
    buf = h["buffer"]
    data, expect = known_data()
    conn.call(Command.SET_TENSOR, {"buffer": buf, "offset": 0, "size": BUF_SIZE}, data)
    tensors, ia, ib, iz = mul_mat_graph(buf)
    h, _ = conn.call(Command.GRAPH_COMPUTE, {"graph_id": 1, "tensors": tensors, "outputs": [iz]})
    assert h["status"] == Status.SUCCESS  # the compute process is up
    half = RawConn(d.port)
    half.send_raw(b"\x10\x00")  # and someone is in the middle of a frame
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.proc.wait(timeout=10 * SLACK) == 0
    assert time.monotonic() - t0 < 3 * SLACK
    assert conn.wait_closed(timeout=2) == []
    half.close()
    conn.close()
    assert compute_pids(d)
    assert eventually(lambda: all(_gone(p) for p in compute_pids(d))), "compute process outlived the daemon"


def test_sigterm_during_long_compute(start_daemon):
    """The compute in flight is abandoned, not waited for: its client is being
    disconnected anyway."""
    d = start_daemon("-t", "1")
    conn = RawConn(d.port, timeout=30)
    conn.hello()
    tensors, iz, _ = load_chain(conn, steps=100)  # seconds of work with one thread
    conn.request(Command.GRAPH_COMPUTE, {"tensors": tensors, "outputs": [iz]})
    h, _ = conn.call(Command.PING)  # the compute has started
    assert h["status"] == Status.SUCCESS
    time.sleep(0.3)
    t0 = time.monotonic()
    d.signal(signal.SIGTERM)
    assert d.proc.wait(timeout=30 * SLACK) == 0
    assert time.monotonic() - t0 < 2 * SLACK
    conn.close()
    assert compute_pids(d)
    assert eventually(lambda: all(_gone(p) for p in compute_pids(d))), "compute process outlived the daemon"


def test_daemon_whose_log_reader_is_gone_serves_and_stops(tmp_path):
    """Its stderr's reader gone (the coordinator that started it died, journald
    restarted): every log write fails with EPIPE. The daemon must still answer
    HELLO (it once did not: the log call in connection_made raised) and stop on
    SIGTERM (its shutdown once hung)."""
    import subprocess
    import sys

    from conftest import _LISTEN
    proc = subprocess.Popen([sys.executable, "-m", "rpc_daemon", "-H", "127.0.0.1", "-p", "0", "-t", "1",
                             "--log-level", "info"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        port = None
        for _ in range(200):  # bounded; readline returns "" if the daemon exits
            line = proc.stderr.readline()
            m = _LISTEN.search(line)
            if m or not line:
                port = int(m.group(1)) if m else None
                break
        assert port, "the daemon did not start"
        proc.stderr.close()

        async def three_clients():
            for _ in range(3):
                c = await RpcClient.connect(f"127.0.0.1:{port}")
                h, _ = await c.request(Command.DEVICE_INFO)
                assert "free_memory" in h
                await c.aclose()

        run(three_clients(), timeout=30)
        proc.terminate()
        assert proc.wait(timeout=10 * SLACK) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_a_compute_process_maps_the_written_pages_of_a_buffer_and_no_others():
    """When a compute process first maps a buffer it maps the pages the daemon
    wrote (weights), at once: not one fault each at the first compute. The
    pages never written (a KV cache's unused cells) stay unallocated."""
    from rpc_daemon.compute.worker import map_shared, populate_resident

    def mapped_kib(start: int) -> int:
        """Rss of this process's mapping at `start` alone (/proc/self/smaps): the process-wide
        RssShmem moved with other shared mappings of the test process (a page less in one CI run)."""
        lines = open("/proc/self/smaps").read().splitlines()
        for i, line in enumerate(lines):
            head = line.split(" ", 1)[0]
            if "-" in head and int(head.split("-")[0], 16) == start:
                for field in lines[i + 1:]:
                    if field.startswith("Rss:"):
                        return int(field.split()[1])
        raise AssertionError(f"no mapping at {start:#x} in /proc/self/smaps")

    import ctypes
    import mmap

    probe = mmap.mmap(-1, mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(probe))),
                    ctypes.c_size_t(mmap.PAGESIZE), 22) != 0:  # MADV_POPULATE_READ: Linux 5.14+
        pytest.skip(f"this kernel has no MADV_POPULATE_READ ({os.strerror(ctypes.get_errno())})")
    size = 64 << 20
    fd, addr = os.memfd_create("buffer"), None
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, b"w" * (8 << 20), 0)
        os.pwrite(fd, b"w" * (4 << 20), 32 << 20)
        addr = map_shared(fd, size)
        assert mapped_kib(addr) == 0
        page_kib = mmap.PAGESIZE >> 10
        # a buffer need not start or end on a page; here it starts one page in, so the
        # first written page is outside the range asked for. The kernel's fault-around
        # (up to 64 KiB about a fault) maps it too in most runs, not in all.
        populate_resident(addr + mmap.PAGESIZE, size - 2 * mmap.PAGESIZE)
        mapped = mapped_kib(addr)
        assert (12 << 10) - page_kib <= mapped <= (12 << 10) + 64, mapped  # the written pages asked for: mapped
        assert os.fstat(fd).st_blocks * 512 == 12 << 20  # the rest: still no memory
    finally:
        if addr is not None:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
        os.close(fd)
