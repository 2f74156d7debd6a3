"""A step that returns every row's logits of a large vocabulary leaves the coordinator's event loop
thread (coordinator/cluster/loop.py) free for every other connection's I/O: the replies are received
into memory that is not zeroed first (rpc_daemon/wire/framing.py, blob_memory), and the logits are
checked for NaN and infinity and the head shards' put side by side on a thread of their own
(coordinator/decode/step_io.py, OFF_LOOP) — not on the loop, which did all of it in one go: 268 MB of
float32 for 256 rows of a 262144-token vocabulary (gemma3-270m's) blocked it 0.1-0.8 s, long enough
for a busy coordinator to stop reading its workers' pongs. And a NaN logit fails the step the same way
whether its check ran inline (a generation's row) or on that thread (many rows).

Real daemons on 127.0.0.1, real libggml. The model is the tiny llama (tests/tiny_models.py) with
gemma3-270m's vocabulary size: its layers take microseconds, so the test is about the logits alone.
What is measured: a coroutine on the loop ticks every millisecond while the step runs, and the most
CPU time the loop thread spent between two ticks (time.thread_time: the work it did without serving
anything else; the wall-clock gap, which on a busy machine also holds the time the thread waited for
a core, is printed beside it)."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from conftest import SLACK
from coordinator.api import Batch, Coordinator, DecodeResult
from coordinator.decode.step_io import OFF_LOOP
from rpc_daemon.wire import framing as F
from rpc_daemon.wire.protocol import Limits
from rpc_helpers import feed_reader
from tiny_models import filler_spm_vocab, model_llama, write_gguf

N_VOCAB = 262144  # gemma3-270m's
ROWS = 256  # a perplexity chunk's: 268 MB of logits
# The most loop-thread CPU one stretch may take while such a step runs (times SLACK). Measured on the
# 2-core VM, loaded: 9-29 ms (receiving the replies, freeing them), with two busy loops beside it too;
# the loop doing the work itself (before): 426-922 ms here, 89-770 ms for gemma3-270m's.
BOUND = 0.02
NAN_VOCAB = 16384  # the NaN test's model: 1 row of logits is checked inline, ROWS rows on a thread
NAN_ROWS = (1000, 12000)  # its vocabulary ids whose head row is NaN: one in each worker's half of the head


def big_vocab_llama(path, n_vocab: int, nan_rows: tuple = ()) -> str:
    """The tiny llama with an `n_vocab`-token vocabulary; the head rows `nan_rows` NaN."""
    arch, metadata, _, tensors = model_llama()
    rng = np.random.default_rng(5)
    for t in tensors:
        if t.name in ("token_embd.weight", "output.weight"):
            t.shape = (n_vocab, t.shape[1])
        if t.name == "output.weight":
            t.kind = "f16"  # (q8_0 quantizes 16M floats in numpy: seconds)
            rows = (rng.standard_normal(t.shape) * 0.3).astype(np.float32)
            rows[list(nan_rows)] = np.nan
            t.values = rows
    return write_gguf(path, arch, metadata, filler_spm_vocab(n_vocab), tensors)


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    return big_vocab_llama(tmp_path_factory.mktemp("big-vocab") / "big-vocab.gguf", N_VOCAB)


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    return big_vocab_llama(tmp_path_factory.mktemp("nan-head") / "nan-head.gguf", NAN_VOCAB, NAN_ROWS)


def coordinator(ws, model: str, split_mode: str) -> Coordinator:
    """Over 2 workers, every step's head in shares (the tensor split's members' head rows; the layer
    split's head_split), one step per batch (no micro-batches) or (layer micro-batched) in micro-batches."""
    options = {"tensor": {"split_mode": "tensor"}, "layer": {"head_split": True, "micro_batch": 0},
               # the default micro-batches of 64 rows: their logits joined (microbatch._joined)
               "layer micro-batched": {"head_split": True}}[split_mode]
    return Coordinator([ws.endpoint(0), ws.endpoint(1)], model=model, split=[1, 1], n_ctx=ROWS, n_batch=ROWS,
                       threads=1, **options)


async def ticks(stop: threading.Event) -> tuple[float, float]:
    """Until `stop`: (the most loop-thread CPU seconds, the longest wall-clock seconds) between two
    ticks of this coroutine, which asks to tick every millisecond."""
    cpu_most = wall_most = 0.0
    wall, cpu = time.perf_counter(), time.thread_time()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now_wall, now_cpu = time.perf_counter(), time.thread_time()
        cpu_most, wall_most = max(cpu_most, now_cpu - cpu), max(wall_most, now_wall - wall)
        wall, cpu = now_wall, now_cpu
    return cpu_most, wall_most


@pytest.mark.system
@pytest.mark.parametrize("split_mode", ["tensor", "layer", "layer micro-batched"])
def test_every_rows_logits_leave_the_loop_free(split_mode, big_vocab, workers):
    """ROWS rows' logits (268 MB, on 2 workers: 134 MB from each) decoded while a coroutine ticks on
    the loop: the loop thread never works more than BOUND (times SLACK) between two ticks, and the
    logits are those of the same step decoded before (the shards side by side, in order)."""
    ws = workers(2)
    with coordinator(ws, big_vocab, split_mode) as c:
        assert c.hp.n_vocab == N_VOCAB and ROWS * N_VOCAB >= OFF_LOOP
        batch = Batch.single([3 + i % 290 for i in range(ROWS)], 0, all_logits=True)
        assert c.decode(batch) == DecodeResult.OK, c.last_error  # its graphs built (on the loop), not measured
        first = np.stack([c.logits(i) for i in (0, ROWS // 2, -1)])
        c.kv_clear()
        stop = threading.Event()
        watching = c._io.submit(ticks(stop))
        time.sleep(0.05)
        try:
            code = c.decode(batch)
        finally:
            stop.set()
        cpu_most, wall_most = watching.result(timeout=10 * SLACK)
        assert code == DecodeResult.OK, c.last_error
        # the same logits as the step before, put side by side right
        assert np.array_equal(np.stack([c.logits(i) for i in (0, ROWS // 2, -1)]), first)
        assert np.isfinite(c.logits(-1)).all() and c.logits(-1).shape == (N_VOCAB,)
    print(f"\n{split_mode}: {ROWS} rows x {N_VOCAB}: the loop thread's longest stretch {cpu_most * 1e3:.1f} ms of "
          f"CPU, its longest gap {wall_most * 1e3:.1f} ms")
    assert cpu_most <= BOUND * SLACK, (cpu_most, wall_most)


@pytest.mark.system
@pytest.mark.parametrize("split_mode", ["tensor", "layer"])
def test_a_nan_logit_fails_the_step_alike_inline_and_off_the_loop(split_mode, nan_model, workers):
    """One row (its check inline) and ROWS rows (4M floats: checked on a thread): COMPUTE_FAILED, the
    same words, naming the first worker (in the head's order) whose logits hold a NaN; nothing
    latched."""
    assert ROWS * NAN_VOCAB >= OFF_LOOP > NAN_VOCAB
    ws = workers(2)
    with coordinator(ws, nan_model, split_mode) as c:
        errors = []
        for n in (1, ROWS, 1):
            c.kv_clear()
            batch = Batch.single([3 + i for i in range(n)], 0, all_logits=True)
            assert c.decode(batch) == DecodeResult.COMPUTE_FAILED
            assert c.last_cause == "compute" and c.failed_endpoints() == [], (c.last_cause, c.failed_endpoints())
            errors.append((c.last_error, c._decoder.last.endpoint))
            with pytest.raises(RuntimeError):
                c.logits(-1)
        first = ws.endpoint(0)  # NAN_ROWS[0] is in its half of the head
        assert errors == [(f"compute failed on worker {first}: logits contain NaN or infinity", first)] * 3, errors


@pytest.mark.parametrize("first", [12, 1000, 1 << 17])
def test_a_large_reply_lands_whole_in_memory_it_did_not_zero(first):
    """A client's reply blob from UNZEROED_FROM bytes (blob_memory: not zeroed first) comes out a
    bytearray holding exactly the bytes sent, however the receives cut it: `first` bytes in the
    first receive (the prefix alone, part of the header, or the header and the blob's start,
    which the reader copies out of its receive buffer), then uneven ones straight into the blob.
    Memory another blob dirtied just before is what it may be given."""
    n = 3 * F.UNZEROED_FROM + 5
    dirty = F.blob_memory(n)
    dirty[:] = b"\xaa" * n
    del dirty
    blob = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8).tobytes()
    data = F.encode_frame({"id": 7, "status": 0}, n) + blob
    reader = F.FrameReader(Limits(), blob_bound=lambda header: n)
    got = feed_reader(reader, data, 100_003, first)  # 100_003: no divisor of the blob's pages
    assert len(got) == 1 and got[0][0] == {"id": 7, "status": 0}
    assert type(got[0][1]) is bytearray and got[0][1] == blob
    assert not reader.partial
