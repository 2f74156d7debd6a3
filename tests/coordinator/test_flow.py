"""coordinator/decode/flow.py: items through a chain of stages as a pipeline.
The order every stage sees, the overlap, the bound on items held between
stages, the failure semantics (stop starting, drain, every failure in item
then stage order), cancellation, and flows ordered after each other. Pure
asyncio: no sockets, no daemons."""
from __future__ import annotations

import asyncio

import pytest

from coordinator.decode.flow import FlowFailed, flow


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))  # a hang guard only: every wait below is on events


async def settle(n: int = 20) -> None:
    """Let every ready task run as far as it can."""
    for _ in range(n):
        await asyncio.sleep(0)


class Log:
    """What the stages did: ("start" | "end", stage, item) in the order it happened."""

    def __init__(self):
        self.events: list[tuple[str, int, int]] = []

    def items(self, what: str, k: int) -> list[int]:
        return [i for w, kk, i in self.events if w == what and kk == k]

    def index(self, what: str, k: int, i: int) -> int:
        return self.events.index((what, k, i))


def test_outputs_in_item_order_each_stage_given_the_one_before_s_output():
    async def go():
        seen = []

        async def first(i, given):
            seen.append((0, i, given))
            return i * 10

        async def second(i, given):
            seen.append((1, i, given))
            return given + 1

        assert await flow(3, [first, second]) == [1, 11, 21]
        assert sorted(seen) == [(0, 0, None), (0, 1, None), (0, 2, None), (1, 0, 0), (1, 1, 10), (1, 2, 20)]
        assert await flow(2, [first]) == [0, 10]
        assert await flow(0, [first, second]) == []
    run(go())


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_every_stage_takes_the_items_in_order_one_at_a_time_after_the_stage_before(ahead):
    async def go():
        log = Log()

        def stage(k):
            async def work(i, given):
                log.events.append(("start", k, i))
                for _ in range((i * 7 + k * 3) % 5):  # uneven work: the stages interleave
                    await asyncio.sleep(0)
                log.events.append(("end", k, i))
                return i
            return work

        n = 8
        assert await flow(n, [stage(k) for k in range(3)], ahead=ahead) == list(range(n))
        for k in range(3):
            assert log.items("start", k) == list(range(n))
            for i in range(n):
                assert log.index("start", k, i) < log.index("end", k, i)  # one at a time ...
                if i:
                    assert log.index("end", k, i - 1) < log.index("start", k, i)  # ... in order
                if k:
                    assert log.index("end", k - 1, i) < log.index("start", k, i)  # after the stage before
    run(go())


def test_stages_overlap():
    """Stage 1 works on item 0 while stage 0 works on item 1: each waits until
    the other has started (without the overlap: neither would)."""
    async def go():
        s0_on_1, s1_on_0 = asyncio.Event(), asyncio.Event()

        async def first(i, given):
            if i == 1:
                s0_on_1.set()
                await asyncio.wait_for(s1_on_0.wait(), 10)
            return i

        async def second(i, given):
            if i == 0:
                s1_on_0.set()
                await asyncio.wait_for(s0_on_1.wait(), 10)
            return i

        assert await flow(3, [first, second]) == [0, 1, 2]
    run(go())


@pytest.mark.parametrize("ahead, ran", [(1, [0, 1, 2]), (2, [0, 1, 2, 3]), (0, [0, 1, 2, 3, 4, 5])])
def test_ahead_bounds_the_items_a_stage_finishes_for_a_stage_that_is_behind(ahead, ran):
    """Stage 1 is held on item 0: stage 0 finishes the item stage 1 works on,
    `ahead` items held for it, and one more it cannot hand over yet; no more
    (0: no bound)."""
    async def go():
        release = asyncio.Event()
        log = Log()

        async def first(i, given):
            log.events.append(("start", 0, i))
            return i

        async def second(i, given):
            await release.wait()
            return i

        task = asyncio.ensure_future(flow(6, [first, second], ahead=ahead))
        await settle()
        assert log.items("start", 0) == ran
        release.set()
        assert await task == list(range(6))
    run(go())


# ---------------------------------------------------------------- failures

def test_after_a_failure_no_stage_starts_another_item_and_those_in_flight_end():
    async def go():
        log = Log()
        boom = ValueError("item 2 on stage 0")
        busy, may_end = asyncio.Event(), asyncio.Event()

        async def first(i, given):
            log.events.append(("start", 0, i))
            if i == 2:
                await busy.wait()
                may_end.set()  # stage 1's item 1 is in flight: it ends after this failure
                raise boom
            log.events.append(("end", 0, i))
            return i

        async def second(i, given):
            log.events.append(("start", 1, i))
            if i == 1:
                busy.set()
                await may_end.wait()
                await settle()
            log.events.append(("end", 1, i))
            return i

        with pytest.raises(FlowFailed) as info:
            await flow(6, [first, second])
        assert info.value.failures == [(2, 0, boom)] and info.value.errors == [boom]
        assert str(info.value) == "item 2 on stage 0"
        assert log.items("start", 0) == [0, 1, 2]  # nothing after the failure
        assert log.items("start", 1) == [0, 1] and log.items("end", 1) == [0, 1]  # item 1 ran to its end
        assert log.index("start", 0, 2) < log.index("end", 1, 1)
    run(go())


def test_every_failure_is_reported_in_item_order_then_stage_order():
    """Stage 0 fails item 1 first, then stage 1 (in flight meanwhile) fails
    item 0: both are reported, item 0's first, and the message is item 0's."""
    async def go():
        busy, first_failed = asyncio.Event(), asyncio.Event()
        e01, e10 = RuntimeError("stage 0, item 1"), OSError("stage 1, item 0")

        async def first(i, given):
            if i == 1:
                await busy.wait()
                first_failed.set()
                raise e01
            return i

        async def second(i, given):
            busy.set()
            await first_failed.wait()
            raise e10

        with pytest.raises(FlowFailed) as info:
            await flow(4, [first, second])
        assert info.value.failures == [(0, 1, e10), (1, 0, e01)]
        assert info.value.errors == [e10, e01]
        assert str(info.value) == "stage 1, item 0"
    run(go())


def test_a_failure_with_items_held_between_stages_ends_the_flow():
    """Items finished and held for a later stage, or skipped, are passed on so
    every stage counts them: the flow ends (no stage waits forever)."""
    async def go():
        log = Log()
        release = asyncio.Event()

        def stage(k):
            async def work(i, given):
                log.events.append(("start", k, i))
                if k == 1 and i == 0:
                    await release.wait()
                if k == 2 and i == 0:
                    raise KeyError("last stage, item 0")
                return i
            return work

        task = asyncio.ensure_future(flow(5, [stage(0), stage(1), stage(2)], ahead=1))
        await settle()
        release.set()
        with pytest.raises(FlowFailed) as info:
            await task
        assert [(i, k) for i, k, _ in info.value.failures] == [(0, 2)]
        assert log.items("start", 2) == [0]  # the items after the failure: skipped
    run(go())


def test_cancelling_the_flow_cancels_every_stage():
    async def go():
        cancelled, blocked = [], asyncio.Event()

        def stage(k):
            async def work(i, given):
                try:
                    await blocked.wait()
                except asyncio.CancelledError:
                    cancelled.append((k, i))
                    raise
            return work

        async def first(i, given):
            return i

        task = asyncio.ensure_future(flow(3, [first, stage(1), stage(2)]))
        await settle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cancelled == [(1, 0)]  # the stage at work; the others wait for items, cancelled too
        assert task.cancelled()
    run(go())


# ---------------------------------------------------------------- flows after each other

def test_a_flow_starts_a_stage_once_after_is_done_and_sets_done_when_finished_with_it():
    async def go():
        loop = asyncio.get_running_loop()
        log = Log()
        after = [loop.create_future(), loop.create_future()]
        done = [loop.create_future(), loop.create_future()]

        def stage(k):
            async def work(i, given):
                log.events.append(("start", k, i))
                return i
            return work

        task = asyncio.ensure_future(flow(2, [stage(0), stage(1)], after=after, done=done))
        await settle()
        assert log.events == [] and not any(f.done() for f in done)
        after[0].set_result(None)
        await settle()
        assert log.items("start", 0) == [0, 1] and log.items("start", 1) == []
        assert done[0].done() and not done[1].done()
        after[1].set_result(None)
        assert await task == [0, 1]
        assert done[1].done()
    run(go())


def test_two_flows_share_the_stages_in_order():
    """The second flow's items come after the first's on every stage, while
    its first stage may start as soon as the first flow is done with it."""
    async def go():
        loop = asyncio.get_running_loop()
        seen: list[list[str]] = [[], []]
        release = asyncio.Event()

        def stage(name, k):
            async def work(i, given):
                seen[k].append(f"{name}{i}")
                if name == "a" and k == 1 and i == 0:
                    await release.wait()  # the first flow's last stage falls behind
                return i
            return work

        done_a = [loop.create_future(), loop.create_future()]
        done_b = [loop.create_future(), loop.create_future()]
        a = asyncio.ensure_future(flow(2, [stage("a", 0), stage("a", 1)], done=done_a))
        b = asyncio.ensure_future(flow(2, [stage("b", 0), stage("b", 1)], after=done_a, done=done_b))
        await settle()
        assert seen == [["a0", "a1", "b0", "b1"], ["a0"]]  # b's first stage went on; its second waits
        release.set()
        assert await a == [0, 1] and await b == [0, 1]
        assert seen[1] == ["a0", "a1", "b0", "b1"]
        assert all(f.done() for f in done_a + done_b)
    run(go())


def test_done_is_set_after_a_failure_and_after_a_cancellation():
    async def go():
        loop = asyncio.get_running_loop()

        async def fail(i, given):
            raise ValueError("no")

        async def ok(i, given):
            return i

        done = [loop.create_future(), None]  # None: no order kept for that stage
        with pytest.raises(FlowFailed):
            await flow(3, [fail, ok], done=done)
        assert done[0].done()

        after = [loop.create_future(), loop.create_future()]
        done = [loop.create_future(), loop.create_future()]
        task = asyncio.ensure_future(flow(3, [ok, ok], after=after, done=done))
        await settle()
        task.cancel()  # before any stage ran: the flows after this one must not wait for it
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(f.done() and not f.cancelled() for f in done)
        assert not any(f.done() for f in after)  # the predecessor's futures are not cancelled with it
    run(go())


def test_after_with_none_keeps_no_order():
    async def go():
        loop = asyncio.get_running_loop()
        never = loop.create_future()

        async def ok(i, given):
            return i

        assert await flow(2, [ok, ok], after=[None, None]) == [0, 1]
        task = asyncio.ensure_future(flow(2, [ok, ok], after=[None, never]))
        await settle()
        assert not task.done()  # stage 1 waits for `never`
        never.set_result(None)
        assert await task == [0, 1]
    run(go())
