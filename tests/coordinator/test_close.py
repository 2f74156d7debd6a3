"""Coordinator.close gives back what the constructor took: its event loop's descriptors
(epoll, self-pipe, eventfd) too, so a program that opens coordinators one after another
does not run out of file descriptors (a test process hit select()'s 1024 limit)."""
from __future__ import annotations

import gc
import os

from coordinator.api import Coordinator


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_leaves_no_descriptor_behind():
    Coordinator(["local"], n_ctx=64).close()  # first use: imports, libggml, the model's own files
    gc.collect()  # an earlier test's garbage closes its descriptors now, not in the middle (CI: 16 after, 17 before)
    before = open_fds()
    for _ in range(3):
        with Coordinator(["local"], n_ctx=64):
            pass
    gc.collect()
    assert open_fds() == before


def test_a_closed_local_executor_leaves_no_tensor_pointing_into_its_freed_buffers(tmp_path):
    """A model file's weight tensors are shared by every stage made from it: when the in-process
    executor frees its buffers, the tensors it placed there are detached, so the next stage that
    holds one (auto's layer timing run again, a stage loaded here once more) loads it afresh
    instead of computing on freed memory (that segfaulted for the tiny qwen3, 2 runs in 3)."""
    import asyncio

    import numpy as np

    from coordinator.cluster.executors import LocalExecutor
    from coordinator.model.architectures import architecture
    from coordinator.model.architectures.common import StepShape
    from coordinator.model.gguf_file import GGUFFile
    from coordinator.model.stage import Stage
    from ggml_ffi import NULL
    from tiny_models import write_tiny_model

    gguf = GGUFFile(write_tiny_model(tmp_path / "qwen3.gguf", "qwen3"))
    arch = architecture(gguf.architecture)
    hp = arch.hparams(gguf)
    inputs = {"tokens": np.zeros(1, np.int32), "positions": np.zeros(1, np.int32),
              "kv_rows": np.zeros(1, np.int64), "mask": np.zeros((1, 256), np.float16)}

    async def load_compute_close():
        stage = Stage.create(0, arch, hp, gguf, range(0, 1), hp.n_layer, 256)
        executor = LocalExecutor(1)
        await executor.open()
        try:
            await executor.load(stage, gguf)
            assert all(t.data != NULL for _, t in stage.weights.items())
            out = await executor.run(stage, StepShape(1, 256, 0), inputs)
        finally:
            await executor.close()
        tensors = [t for _, t in stage.weights.items()] + stage.kv.tensors()
        assert all(t.data == NULL and t.buffer == NULL for t in tensors)
        return out

    first = asyncio.run(load_compute_close())
    assert np.array_equal(np.asarray(asyncio.run(load_compute_close())), np.asarray(first))  # loaded again: the same output


SHARED_WEIGHTS_START = """
import sys
from coordinator import Batch, Coordinator
for _ in range(5):
    with Coordinator(["local", "local"], model=sys.argv[1], split=[1, 1], n_ctx=64) as c:
        assert c.decode(Batch.single([5, 6, 7], 0)) == 0, c.last_error
        print("TOKEN", c.token(-1))
"""


def test_in_process_stages_that_share_a_weight_load_at_once_without_placing_it_twice(tmp_path):
    """Two in-process stages of a llama 3.x model both hold rope_freqs, and load on their own threads
    at once: one places the shared tensor, the other uses it. Both placing it aborted the process
    (ggml's GGML_ASSERT(tensor->buffer == NULL)) in 5 starts of 6; here 5 starts run in a child
    process, so an abort is a failure, not the end of the run, and each gives the same token."""
    import subprocess
    import sys

    from conftest import SLACK
    from tiny_models import write_tiny_model

    model = write_tiny_model(tmp_path / "llama3.gguf", "llama3")
    run = subprocess.run([sys.executable, "-c", SHARED_WEIGHTS_START, str(model)], capture_output=True, text=True,
                         timeout=120 * SLACK)
    assert run.returncode == 0, run.stderr[-2000:]
    tokens = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("TOKEN ")]
    assert len(tokens) == 5 and len(set(tokens)) == 1, run.stdout
