"""How long one layer of a decode token takes on this machine: what auto's
choice of split (model/loading.py, tensor_choice) weighs the exchanges of a
tensor-parallel split against.

A middle layer is loaded here and timed on a one-token step over a 256-row
KV cache, at the workers' thread count, with every input of its graph filled
and in range: libggml runs in this process, where a row id out of range
would abort it; then the same with the layer after it, the two steps in
turn. The layer's time is the fastest two-layer step less the fastest
one-layer step: a step's own costs (the hop to the compute thread and back,
its inputs, the graph's start) are paid once a stage, not once a layer, and
cancel out. Measured on a 2-core VM: gemma3-270m's one-layer step 0.97-1.07
ms, two layers 1.69-1.80 ms, so 0.70-0.73 ms a layer, as a layer takes inside
a worker's real decode (0.73 ms); a tiny test llama's step 0.12 ms, its layer
0.01. Neither stage ends in the output head, whichever layers it holds.
Between repetitions the timing streams
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
# timed repetitions of each step after one warm-up: the fastest counts (with another busy process beside
# it on a 2-core VM, 7 let a tiny layer's every two-layer step be held up, 11 did not in 5 runs)
REPS = 11
EVICT_CAP = 256 << 20  # bytes streamed between repetitions at most (more than any last-level cache)


async def layer_seconds(arch, hp, gguf, threads: int, other_bytes: int) -> float:
    """Seconds one layer of a one-token decode step takes here at `threads`,
    with `other_bytes` (what a worker reads for the rest of its token) streamed
    through the caches before every step: the fastest of REPS steps of two
    middle layers less the fastest of REPS steps of the first of them, taken in
    turn (never below 0); a one-layer model's step. A busy moment only ever
    adds time to a step, so each fastest is that step undisturbed (the wide
    test model's layer with two other busy processes on a 2-core VM: 1.1-1.6
    ms in 10 timings, 1.1-1.6 idle; the median of the pairs' differences read
    1.2-7.3 ms busy)."""
    il = max(0, min(hp.n_layer // 2, hp.n_layer - 2))
    spans = [range(il, il + 1)] + ([range(il, il + 2)] if hp.n_layer >= 2 else [])
    evict = np.ones(max(0, min(other_bytes, EVICT_CAP, available_memory() // 8)), np.uint8)
    times = await _step_times(arch, hp, gguf, spans, threads, evict)
    if len(times) == 1:
        return min(times[0])
    return max(0.0, min(times[1]) - min(times[0]))


async def _step_times(arch, hp, gguf, spans: list, threads: int, evict: np.ndarray) -> list[list[float]]:
    """Each span's one-token step timed REPS times, the spans in turn, `evict` written through before
    each step. Every stage ends in its hidden state, not the output head, whichever layers it holds
    (a stage of the model's last layer would compute the head too)."""
    stages = [Stage.create(0, arch, hp, gguf, layers, hp.n_layer + 1, N_KV) for layers in spans]
    executors = [LocalExecutor(threads) for _ in stages]
    try:
        runs = []
        for stage, executor in zip(stages, executors):
            await executor.open()
            await executor.load(stage, gguf)
            runs.append(_step_of(stage, executor, hp))
        times = [[] for _ in stages]
        for rep in range(REPS + 1):
            for run, timed in zip(runs, times):
                if evict.size:
                    evict[::64] += 1  # one write a cache line: every line of it through the caches
                started = time.perf_counter()
                await run()
                if rep:  # the first builds and places the graph
                    timed.append(time.perf_counter() - started)
        return times
    finally:
        for executor in executors:
            await executor.close()


def _step_of(stage, executor, hp):
    """A coroutine function running `stage`'s one-token step with every input its graph reads filled
    and in range (a row id out of range would abort in libggml): the first layer embeds a token."""
    mask = np.full((1, N_KV), -np.inf, np.float16)
    mask[0, N_KV - 1] = 0  # the token sees its own row: the softmax is well defined
    inputs = {"positions": np.array([N_KV - 1], np.int32), "kv_rows": np.array([N_KV - 1], np.int64),
              "mask": mask}
    if stage.first:
        inputs["tokens"] = np.zeros(1, np.int32)
    else:
        inputs["hidden"] = np.random.default_rng(0).standard_normal(hp.n_embd).astype(np.float32)
    if hp.n_swa:
        inputs["mask_swa"] = mask
    shape = StepShape(1, N_KV, 1)
    graph, _ = stage.graph(shape, dot_type_inputs=executor.dot_type_inputs, concat=executor.concat)
    unfed = sorted(set(graph.inputs) - set(inputs))
    if unfed:  # an architecture with inputs of its own: not run with garbage in them
        raise ValueError(f"the layer's graph has inputs this timing does not fill: {unfed}")
    return lambda: executor.run(stage, shape, inputs)
