"""The daemon's persistent tensor cache (--cache DIR): content-addressed by
SHA-256, survives restarts, verified against its hash whenever it is loaded."""
from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import socket
import time

import numpy as np
import pytest

from conftest import DaemonProcess, free_port
from rpc_helpers import bytes_in, metric, raw_session
from rpc_daemon.client import RpcClient, RpcError
from rpc_daemon.wire.protocol import Command, Status

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

SIZE = 2 << 20


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def store(endpoint: str, data: bytes) -> None:
    c = await RpcClient.connect(endpoint)
    try:
        h, _ = await c.request(Command.ALLOC_BUFFER, {"size": len(data)})
        await c.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": len(data), "cache": True},
                        data)
    finally:
        await c.aclose()


async def load(endpoint: str, digest: str, size: int) -> bytes | RpcError:
    """SET_TENSOR_HASH into a fresh buffer, then read it back; the error if refused."""
    c = await RpcClient.connect(endpoint)
    try:
        h, _ = await c.request(Command.ALLOC_BUFFER, {"size": size})
        where = {"buffer": h["buffer"], "offset": 0, "size": size}
        try:
            await c.request(Command.SET_TENSOR_HASH, dict(where, hash=digest))
        except RpcError as exc:
            return exc
        _, out = await c.request(Command.GET_TENSOR, where)
        return out
    finally:
        await c.aclose()


@pytest.fixture
def data() -> bytes:
    return np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def test_cache_survives_a_restart_and_is_verified(tmp_path, data):
    cache = tmp_path / "cache"
    digest = hashlib.sha256(data).hexdigest()
    d = DaemonProcess("-t", "1", "--cache", str(cache))
    try:
        run(store(d.endpoint, data))
    finally:
        d.stop()
    entry = cache / digest[:2] / digest
    assert entry.read_bytes() == data
    d = DaemonProcess("-t", "1", "--cache", str(cache))  # a new process: only the disk remembers
    try:
        assert run(load(d.endpoint, digest, SIZE)) == data
        missing = run(load(d.endpoint, hashlib.sha256(b"other").hexdigest(), SIZE))
        assert isinstance(missing, RpcError) and missing.status == Status.NOT_FOUND
        wrong_size = run(load(d.endpoint, digest, SIZE - 1))
        assert isinstance(wrong_size, RpcError) and wrong_size.status == Status.NOT_FOUND
        bad_hash = run(load(d.endpoint, "xyz", SIZE))
        assert isinstance(bad_hash, RpcError) and bad_hash.status == Status.INVALID_REQUEST
        # flip one byte on disk: the entry fails verification, is refused and removed
        corrupt = bytearray(data)
        corrupt[12345] ^= 0xFF
        entry.write_bytes(bytes(corrupt))
        refused = run(load(d.endpoint, digest, SIZE))
        assert isinstance(refused, RpcError) and refused.status == Status.NOT_FOUND, refused
        assert not entry.exists()
        assert d.alive()
    finally:
        d.stop()


def test_without_cache_hash_loads_are_not_found(daemon, data):
    out = run(load(daemon.endpoint, hashlib.sha256(data).hexdigest(), SIZE))
    assert isinstance(out, RpcError) and out.status == Status.NOT_FOUND and "no tensor cache" in out.message


def test_coordinator_loads_weights_from_a_restarted_workers_cache(tmp_path):
    """A worker restarted with its cache gets the weights from disk: the second
    load sends a small fraction of the bytes over the network, same text."""
    from coordinator import Coordinator

    cache = str(tmp_path / "cache")
    texts, sent, stats = [], [], []
    for _ in range(2):
        mport = free_port()
        d = DaemonProcess("-t", "1", "--cache", cache, "--metrics-port", str(mport))
        try:
            with Coordinator([d.endpoint]) as c:
                sent.append(bytes_in(mport))
                stats.append(c._places[0].executor.load_stats)
                texts.append(c.generate("The capital of France is", max_tokens=8))
        finally:
            d.stop()
    weights = sum(f.stat().st_size for f in pathlib.Path(cache).rglob("*") if f.is_file())
    assert sent[0] > 0.9 * weights, (sent, weights)
    assert sent[1] < 0.05 * sent[0], sent
    # the look-ups went out in one window (batched), not one round trip each
    assert stats[1]["cache_hits"] == stats[1]["lookups"] > 1 and stats[1]["max_lookups_in_flight"] > 1, stats
    assert stats[0]["cache_hits"] == 0 and stats[0]["max_sends_in_flight"] > 1, stats
    assert texts[0] == texts[1]


# --- the bound (--cache-max): least recently used entries go first, never one in use

MIB = 1 << 20


def chunk(seed: int, size: int = SIZE) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def cached(cache: pathlib.Path) -> dict[str, int]:
    """The entries on disk: {hash: size}. An entry the daemon evicts between the
    listing and its stat is gone, not an error (the watcher below races eviction)."""
    sizes = {}
    for f in cache.glob("??/*"):
        if f.name.startswith("."):
            continue
        try:
            sizes[f.name] = f.stat().st_size
        except FileNotFoundError:
            continue
    return sizes


def test_cache_is_bounded_least_recently_used_first(tmp_path):
    """--cache-max 5 MiB holds two 2 MiB entries: a third evicts the one used
    longest ago (a load counts as a use), also after a restart; metrics and the
    log say so."""
    cache = tmp_path / "cache"
    a, b, c, d_ = (chunk(i) for i in range(4))
    mport = free_port()
    d = DaemonProcess("-t", "1", "--cache", str(cache), "--cache-max", "5", "--metrics-port", str(mport))
    try:
        run(store(d.endpoint, a))
        run(store(d.endpoint, b))
        assert run(load(d.endpoint, sha(a), SIZE)) == a  # a is now the more recently used
        run(store(d.endpoint, c))
        assert set(cached(cache)) == {sha(a), sha(c)}, "b, the least recently used, should have gone"
        line = d.wait_log("tensor cache evicted")
        assert "entries=1" in line and sha(b) in line, line
        gone = run(load(d.endpoint, sha(b), SIZE))
        assert isinstance(gone, RpcError) and gone.status == Status.NOT_FOUND
        assert metric(mport, "ggml_rpc_tensor_cache_bytes") == 2 * SIZE == sum(cached(cache).values())
        assert metric(mport, "ggml_rpc_tensor_cache_bytes_max") == 5 * MIB
        assert metric(mport, "ggml_rpc_tensor_cache_entries") == 2
        assert metric(mport, "ggml_rpc_tensor_cache_evictions_total") == 1
        assert run(load(d.endpoint, sha(a), SIZE)) == a  # now c is the least recently used
    finally:
        d.stop()
    d = DaemonProcess("-t", "1", "--cache", str(cache), "--cache-max", "5")  # the use order is on disk
    try:
        run(store(d.endpoint, d_))
        assert set(cached(cache)) == {sha(a), sha(d_)}
        assert run(load(d.endpoint, sha(a), SIZE)) == a and run(load(d.endpoint, sha(d_), SIZE)) == d_
    finally:
        d.stop()
    d = DaemonProcess("-t", "1", "--cache", str(cache), "--cache-max", "3")  # a smaller bound: trimmed at start
    try:
        assert set(cached(cache)) == {sha(d_)}
        d.wait_log("over --cache-max at start")
        big = chunk(9, 4 * MIB)  # larger than the whole cache: served, not cached, nothing evicted for it
        run(store(d.endpoint, big))
        assert set(cached(cache)) == {sha(d_)}
        d.wait_log("larger than the whole cache")
    finally:
        d.stop()


def test_partial_and_truncated_entries_are_cleaned_and_rewritten(tmp_path):
    """A write cut short by a crash (a temp file of a dead process) is removed at start; an entry
    truncated on disk is never served, and the next store of its content
    rewrites it (it used to stay truncated for good: the store saw the name and
    skipped it)."""
    cache = tmp_path / "cache"
    data = chunk(1)
    entry = cache / sha(data)[:2] / sha(data)
    entry.parent.mkdir(parents=True)
    entry.write_bytes(data[: SIZE // 2])
    partial = entry.parent / ".tmp-999999999-x"  # its writer (that pid) is gone: cut short
    partial.write_bytes(data[:1000])
    in_progress = entry.parent / f".tmp-{os.getpid()}-x"  # a live writer's (a daemon sharing the dir): kept
    in_progress.write_bytes(data[:1000])
    old_partial = entry.parent / f"{sha(data)}.tmp12345"  # how daemons before --cache-max named them
    old_partial.write_bytes(data[:1000])
    unrelated = cache / "README"  # not the cache's: left alone
    unrelated.write_text("mine")
    d = DaemonProcess("-t", "1", "--cache", str(cache))
    try:
        assert not partial.exists() and not old_partial.exists() and in_progress.exists()
        assert unrelated.read_text() == "mine"
        refused = run(load(d.endpoint, sha(data), SIZE))
        assert isinstance(refused, RpcError) and refused.status == Status.NOT_FOUND
        run(store(d.endpoint, data))
        assert entry.read_bytes() == data
        assert run(load(d.endpoint, sha(data), SIZE)) == data
        # cut short behind the daemon's back, same name: refused, removed, and stored again later
        entry.write_bytes(data[: SIZE // 4])
        refused = run(load(d.endpoint, sha(data), SIZE))
        assert isinstance(refused, RpcError) and refused.status == Status.NOT_FOUND
        assert not entry.exists()
        run(store(d.endpoint, data))
        assert run(load(d.endpoint, sha(data), SIZE)) == data
        assert d.alive()
    finally:
        d.stop()


def fifo_entry(cache: pathlib.Path, data: bytes) -> pathlib.Path:
    """Swap cached `data`'s entry file for a FIFO: a worker's read of it waits,
    deterministically, until the test writes the content (write_fifo)."""
    entry = cache / sha(data)[:2] / sha(data)
    entry.unlink()
    os.mkfifo(entry)
    return entry


def open_fifo_writer(entry: pathlib.Path) -> int:
    """The FIFO's write end, once the worker has opened it for reading (bounded wait)."""
    for _ in range(200):
        try:
            return os.open(entry, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader yet
            time.sleep(0.05)
    raise AssertionError("the worker never opened the entry")


def write_fifo(fd: int, data: bytes) -> None:
    os.set_blocking(fd, True)
    os.write(fd, data)
    os.close(fd)


def test_an_entry_being_read_is_not_evicted(tmp_path):
    """A SET_TENSOR_HASH in progress holds its entry: stores from another client
    that need room evict the others, never it, and the load completes with the
    right bytes. (The entry's file is swapped for a FIFO, so the worker's read
    waits, deterministically, until the test writes the content into it.)"""
    import threading

    cache = tmp_path / "cache"
    a, b, c = chunk(1), chunk(2), chunk(3)
    d = DaemonProcess("-t", "1", "--cache", str(cache), "--cache-max", "5")
    try:
        run(store(d.endpoint, a))
        entry = fifo_entry(cache, a)
        result = {}
        reader = threading.Thread(target=lambda: result.setdefault("a", run(load(d.endpoint, sha(a), SIZE))))
        reader.start()
        fd = open_fifo_writer(entry)
        run(store(d.endpoint, b))  # fits beside a
        run(store(d.endpoint, c))  # needs room: b goes, not a, which is being read
        assert set(cached(cache)) == {sha(a), sha(c)}
        write_fifo(fd, a)
        reader.join(60)
        assert result.get("a") == a, "the load of the entry in use failed"
    finally:
        d.stop()


def test_concurrent_clients_keep_the_bound(tmp_path):
    """Eight clients store 24 chunks (1 MiB each, some the same content) at once
    into a 6 MiB cache: every SET_TENSOR succeeds, the disk never holds more
    than the bound, the metric agrees with the disk, and every entry left is
    intact."""
    cache = tmp_path / "cache"
    mport = free_port()
    d = DaemonProcess("-t", "1", "--cache", str(cache), "--cache-max", "6", "--metrics-port", str(mport))
    chunks = [chunk(i % 16, MIB) for i in range(24)]  # 16 distinct, 8 stored twice
    peak = 0

    async def client(i: int) -> None:
        for data in chunks[i::8]:
            await store(d.endpoint, data)

    async def watch(stop: asyncio.Event) -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, sum(cached(cache).values()))
            await asyncio.sleep(0.01)

    async def all_clients() -> None:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        await asyncio.gather(*(client(i) for i in range(8)))
        stop.set()
        await watcher

    try:
        run(all_clients(), timeout=120)
        on_disk = cached(cache)
        assert peak <= 6 * MIB and sum(on_disk.values()) <= 6 * MIB, (peak, on_disk)
        assert metric(mport, "ggml_rpc_tensor_cache_bytes") == sum(on_disk.values())
        assert metric(mport, "ggml_rpc_tensor_cache_entries") == len(on_disk) == 6
        assert metric(mport, "ggml_rpc_tensor_cache_evictions_total") >= 10  # 16 distinct into 6 places
        for name in on_disk:
            assert sha((cache / name[:2] / name).read_bytes()) == name
        assert not list(cache.glob("??/.tmp-*"))
        assert d.alive()
    finally:
        d.stop()


def test_cache_max_flag_is_checked():
    import subprocess
    import sys

    for args, fragment in ((["--cache-max", "5"], "give --cache"), (["--cache", "x", "--cache-max", "-1"], ">= 0")):
        p = subprocess.run([sys.executable, "-m", "rpc_daemon", *args], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and fragment in p.stderr, (args, p.returncode, p.stderr)


def test_lookups_run_at_once_and_answer_in_request_order(tmp_path):
    """SET_TENSOR_HASH requests sent back to back run several at once, yet
    answer in request order and leave every range as if run one at a time.
    The first one's entry is a FIFO, so it waits until the test writes it:
    meanwhile the next one (a corrupt entry, another range) is verified,
    refused and removed, while the one after it, which overlaps the first's
    range, waits for it and has not touched its entry. Then every reply comes
    in order, with its status, and the buffer holds the request-order result."""
    cache = tmp_path / "cache"
    first, corrupt, overlapping, other, last = (chunk(10 + i, MIB) for i in range(5))
    d = DaemonProcess("-t", "1", "--cache", str(cache))
    try:
        for data in (first, corrupt, overlapping, other, last):
            run(store(d.endpoint, data))
        for f in cache.glob("??/*"):
            os.utime(f, (0, 0))  # a load's touch shows which entries were read
        bad = bytearray(corrupt)
        bad[77] ^= 0xFF
        (cache / sha(corrupt)[:2] / sha(corrupt)).write_bytes(bytes(bad))
        entry = fifo_entry(cache, first)
        half = MIB // 2
        with raw_session(d) as conn:
            header, _ = conn.call(Command.ALLOC_BUFFER, {"size": 4 * MIB})
            buf = header["buffer"]
            lookups = [(first, 0), (corrupt, 2 * MIB), (overlapping, half), (other, 3 * MIB), (last, 0)]
            ids = [conn.request(Command.SET_TENSOR_HASH, {"buffer": buf, "offset": off, "size": MIB,
                                                          "hash": sha(data)}) for data, off in lookups]
            ids.append(conn.request(Command.GET_TENSOR, {"buffer": buf, "offset": 0, "size": 4 * MIB}))
            fd = open_fifo_writer(entry)
            corrupt_file = cache / sha(corrupt)[:2] / sha(corrupt)
            for _ in range(200):  # verified beside the first one, which still waits
                if not corrupt_file.exists():
                    break
                time.sleep(0.05)
            assert not corrupt_file.exists(), "the lookup after the first did not run beside it"
            assert (cache / sha(overlapping)[:2] / sha(overlapping)).stat().st_mtime == 0, \
                "a lookup overlapping a running one's range ran beside it"
            conn.sock.settimeout(0.3)
            with pytest.raises(socket.timeout):  # no reply overtakes the first one's
                conn.recv_frame()
            conn.sock.settimeout(30)
            write_fifo(fd, first)
            replies = [conn.recv_frame() for _ in ids]
        assert [h["id"] for h, _ in replies] == ids
        assert [h["status"] for h, _ in replies] == [Status.SUCCESS, Status.NOT_FOUND, Status.SUCCESS,
                                                    Status.SUCCESS, Status.SUCCESS, Status.SUCCESS]
        out = replies[-1][1]
        # in request order: first at 0, overlapping at half, last at 0 again (the corrupt range is unspecified)
        assert out[:MIB] == last[:MIB]
        assert out[MIB: MIB + half] == overlapping[half:]
        assert out[3 * MIB:] == other
    finally:
        d.stop()
