"""The daemon's persistent tensor cache (--cache DIR): content-addressed by
SHA-256, survives restarts, verified against its hash whenever it is loaded."""
from __future__ import annotations

import asyncio
import hashlib
import pathlib
import urllib.request

import numpy as np
import pytest

from conftest import DaemonProcess, free_port
from rpc_daemon.client import RpcClient, RpcError
from rpc_daemon.wire.protocol import Command, Status

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


def _bytes_in(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("ggml_rpc_bytes_in_total"))


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
                sent.append(_bytes_in(mport))
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
