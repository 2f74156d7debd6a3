"""Items through a chain of stages as a pipeline: stage k works on item i
while stage k-1 works on item i+1. Pure scheduling, nothing of models or
workers: the micro-batches of a decode step (coordinator/decode/microbatch.py) and
the replay of journal steps (Pipeline.replay) both run on it.

Order: each stage takes the items in their order, one at a time, and takes
item i only after the stage before has finished it. So every stage sees the
same sequence of items as when they run one after another, which is what
keeps a stage's KV rows (written by earlier items, read by later ones) the
same bits.

Failure: after the first failure no stage starts another item; the ones in
flight run to their end (each bounded by its own request's timeouts), so no
request is left in flight when `flow` raises FlowFailed with every failure,
in item order, then stage order. Cancelling `flow` cancels every stage.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence

FlowStage = Callable[[int, object], Awaitable[object]]  # (item index, the stage before's output or None) -> output

_SKIPPED = object()  # an item not run because something failed: passed on so later stages count it


class FlowFailed(Exception):
    def __init__(self, failures: list[tuple[int, int, BaseException]]):
        super().__init__(str(failures[0][2]))
        self.failures = failures  # (item, stage, exception), sorted

    @property
    def errors(self) -> list[BaseException]:
        return [exc for _, _, exc in self.failures]


async def flow(n_items: int, stages: Sequence[FlowStage], ahead: int = 0,
               after: Sequence[asyncio.Future | None] = (), done: Sequence[asyncio.Future | None] = ()) -> list:
    """Run items 0..n_items-1 through `stages`; the last stage's outputs, in
    item order. `ahead` (0: no bound) bounds how many finished items a stage
    holds for the next one (their outputs stay in memory meanwhile).

    Several flows share stages in order with `after` and `done` (per stage,
    None where no order is kept): stage k starts this flow's first item once
    `after[k]` is done (the flow before this one has finished with stage k),
    and `done[k]` is set once this flow has finished with stage k (every item
    run, skipped or cancelled)."""
    links = [asyncio.Queue(maxsize=ahead) for _ in stages[1:]]
    results: list = [None] * n_items
    failures: list[tuple[int, int, BaseException]] = []

    async def run(k: int, stage: FlowStage) -> None:
        try:
            await _run(k, stage)
        finally:
            _set(done, k)

    async def _run(k: int, stage: FlowStage) -> None:
        if k < len(after) and after[k] is not None:
            await asyncio.shield(after[k])  # a cancelled flow must not cancel its predecessor's future
        for i in range(n_items):
            given = await links[k - 1].get() if k else None
            out = _SKIPPED
            if given is not _SKIPPED and not failures:
                try:
                    out = await stage(i, given)
                except Exception as exc:  # noted; the stages stop starting items and drain
                    failures.append((i, k, exc))
                    out = _SKIPPED
            if k < len(links):
                await links[k].put(out)  # the next stage always takes it: no put waits forever
            elif out is not _SKIPPED:
                results[i] = out

    try:
        async with asyncio.TaskGroup() as group:
            for k, stage in enumerate(stages):
                group.create_task(run(k, stage))
    finally:  # a stage task cancelled before it ever ran must not hold up the flows after this one
        for k in range(len(done)):
            _set(done, k)
    if failures:
        raise FlowFailed(sorted(failures, key=lambda f: (f[0], f[1])))
    return results


def _set(done: Sequence[asyncio.Future | None], k: int) -> None:
    if k < len(done) and done[k] is not None and not done[k].done():
        done[k].set_result(None)
