"""How long one layer of a decode token takes on this machine: what auto's
choice of split (model/loading.py, tensor_choice) weighs the exchanges of a
tensor-parallel split against.

One middle layer (not the last, which ends in the output head: a 2-layer
model's first) is loaded here and timed on a one-token step over a 256-row
KV cache, at the workers' thread count, with every input of its graph filled
and in range: libggml runs in this process, where a row id out of range
would abort it. Between repetitions the
timing streams through as many other bytes as a worker reads for the rest of
its token (its share of the weights, capped), so the layer meets the cache as
it does in a real decode: a small model's whole token stays cached, a larger
one's weights come from memory. Counting bytes alone gets small models wrong
(gemma3-270m's layers: 68 MB, 14 ms a token at 5 GB/s, measured 34 ms cold
at 1 thread: their many small ops cost more than their bytes).

The time is the whole in-process step, its hop to the compute thread and back
included. That is a calibration, not a model: the hop is paid once a stage,
not once a layer, so n_layer times it overstates what a split saves, and the
exchanges' estimate from PINGs overstates their cost about as much
(loading.py, TENSOR_PAYS). Measured on a 2-core VM, gemma3-270m: the compute
alone 0.3 ms, the step 0.5-1.3 ms, and a layer inside a worker's real decode
0.73 ms (9 layers: 6.6 ms computing, 8.5 ms from request to reply); timed by
its compute alone, auto chose the layer split there, where tensor generated
1.5x faster.
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
    through the caches between repetitions."""
    il = hp.n_layer // 2
    if il == hp.n_layer - 1 and il > 0:  # the last layer ends in the output head: time one that does not
        il -= 1
    stage = Stage.create(0, arch, hp, gguf, range(il, il + 1), hp.n_layer, N_KV)
    executor = LocalExecutor(threads)
    evict = np.ones(max(0, min(other_bytes, EVICT_CAP, available_memory() // 8)), np.uint8)
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
