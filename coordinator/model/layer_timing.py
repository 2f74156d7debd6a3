"""How long one layer of a decode token takes on this machine: what auto's
choice of split (model/loading.py, tensor_choice) weighs the exchanges of a
tensor-parallel split against.

A middle layer is loaded here and timed on a one-token step over a 256-row
KV cache, at the workers' thread count, with every input of its graph filled
and in range: libggml runs in this process, where a row id out of range
would abort it; then the same with the layer after it. The layer's time is
the difference: a step's own costs (the hop to the compute thread and back,
its inputs, the graph's start) are paid once a stage, not once a layer, and
cancel out. Measured on a 2-core VM: gemma3-270m's one-layer step 0.97-1.07
ms, two layers 1.69-1.80 ms, so 0.70-0.73 ms a layer, as a layer takes inside
a worker's real decode (0.73 ms); a tiny test llama's step 0.12 ms, its layer
0.01. The layers timed end before the last (which ends in the output head),
where the model has 3 layers or more. Between repetitions the timing streams
through as many other bytes as a worker reads for the rest of its token (its
share of the weights, capped), so the layer meets the cache as it does in a
real decode: a small model's whole token stays cached, a larger one's
weights come from memory. Counting bytes alone gets small models wrong
(gemma3-270m's layers: 68 MB, 14 ms a token at 5 GB/s, measured 34 ms cold
at 1 thread: their many small ops cost more than their bytes).
"""
from __future__ import annotations

import time

import numpy as np

from coordinator.cluster.executors import LocalExecutor
from coordinator.model.architectures.common import StepShape
from coordinator.model.stage import Stage
from rpc_daemon.service.memory import available_memory

N_KV = 256  # the KV rows the timed token attends over (one padded block)
# timed repetitions after one warm-up; their median counts: the fastest was a lucky moment as often as the
# slowest a descheduled one (gemma3-270m on a 2-core VM, 4 timings in a minute: fastest 0.45-0.99 ms)
REPS = 5
EVICT_CAP = 256 << 20  # bytes streamed between repetitions at most (more than any last-level cache)


async def layer_seconds(arch, hp, gguf, threads: int, other_bytes: int) -> float:
    """Seconds one layer of a one-token decode step takes here at `threads`,
    with `other_bytes` (what a worker reads for the rest of its token) streamed
    through the caches between repetitions: a step of two layers less a step of
    the first of them (never below 0), or a one-layer model's step."""
    il = hp.n_layer // 2
    if hp.n_layer >= 3:  # both steps end before the last layer, which ends in the output head
        il = min(il, hp.n_layer - 3)
    elif il == hp.n_layer - 1 and il > 0:
        il -= 1
    evict = np.ones(max(0, min(other_bytes, EVICT_CAP, available_memory() // 8)), np.uint8)
    one = await _step_seconds(arch, hp, gguf, range(il, il + 1), threads, evict)
    if il + 2 > hp.n_layer:
        return one
    return max(0.0, await _step_seconds(arch, hp, gguf, range(il, il + 2), threads, evict) - one)


async def _step_seconds(arch, hp, gguf, layers: range, threads: int, evict: np.ndarray) -> float:
    """The median time of a one-token step of a stage of `layers`, `evict` written through between repetitions."""
    stage = Stage.create(0, arch, hp, gguf, layers, hp.n_layer, N_KV)
    executor = LocalExecutor(threads)
    try:
        await executor.open()
        await executor.load(stage, gguf)
        mask = np.full((1, N_KV), -np.inf, np.float16)
        mask[0, N_KV - 1] = 0  # the token sees its own row: the softmax is well defined
        # every input the layer's graph reads, in range (a row id out of range would abort in libggml):
        # the first layer embeds a token, the last picks its output row
        inputs = {"positions": np.array([N_KV - 1], np.int32), "kv_rows": np.array([N_KV - 1], np.int64),
                  "mask": mask}
        if stage.first:
            inputs["tokens"] = np.zeros(1, np.int32)
        else:
            inputs["hidden"] = np.random.default_rng(0).standard_normal(hp.n_embd).astype(np.float32)
        if stage.last:
            inputs["out_rows"] = np.zeros(1, np.int32)
        if hp.n_swa:
            inputs["mask_swa"] = mask
        shape = StepShape(1, N_KV, 1)
        graph, _ = stage.graph(shape, dot_type_inputs=executor.dot_type_inputs, concat=executor.concat)
        unfed = sorted(set(graph.inputs) - set(inputs))
        if unfed:  # an architecture with inputs of its own: not run with garbage in them
            raise ValueError(f"the layer's graph has inputs this timing does not fill: {unfed}")
        times = []
        for rep in range(REPS + 1):
            if evict.size:
                evict[::64] += 1  # one write a cache line: every line of it through the caches
            started = time.perf_counter()
            await executor.run(stage, shape, inputs)
            if rep:  # the first builds and places the graph
                times.append(time.perf_counter() - started)
        return float(np.median(times))
    finally:
        await executor.close()
