"""coordinator/decode/gate.py: which decode steps may be in flight at once.
Admission order, each step's turn to finish, the steps a step must wait for
(those sharing a sequence), and `async with gate` between steps. Pure asyncio:
no sockets, no daemons."""
from __future__ import annotations

import asyncio

import pytest

from coordinator.decode.gate import DecodeGate, Ticket


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))  # a hang guard only: every wait below is on events


async def settle(n: int = 10) -> None:
    """Let every ready task run as far as it can."""
    for _ in range(n):
        await asyncio.sleep(0)


async def admitted(gate: DecodeGate, *seqs: int) -> list[Ticket]:
    async with gate.lock:  # admission happens under the lock
        return [gate.admit(s) for s in seqs]


def test_steps_are_in_flight_in_admission_order():
    async def go():
        gate = DecodeGate()
        t1, t2, t3 = await admitted(gate, 0b01, 0b10, 0b01)
        assert gate.in_flight == [t1, t2, t3]
        assert (t1.seqs, t2.seqs, t3.seqs) == (0b01, 0b10, 0b01)
        assert t1.before is None and t2.before is t1 and t3.before is t2
        assert not any(t.finished.done() for t in (t1, t2, t3))
    run(go())


def test_each_step_finishes_in_its_turn():
    """Steps that compute in any order finish in admission order: a step's
    turn comes once every step admitted before it has finished."""
    async def go():
        gate = DecodeGate()
        tickets = await admitted(gate, 1, 2, 4)
        order = []

        async def step(name, t):
            await gate.turn(t)
            order.append(name)
            gate.finish(t)

        tasks = [asyncio.ensure_future(step(name, t)) for name, t in reversed(list(zip("abc", tickets)))]
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "c"] and gate.in_flight == []
    run(go())


def test_a_turn_waits_for_the_step_before_to_finish_not_just_its_turn():
    async def go():
        gate = DecodeGate()
        t1, t2, t3 = await admitted(gate, 1, 1, 1)
        third = asyncio.ensure_future(gate.turn(t3))
        second = asyncio.ensure_future(gate.turn(t2))
        await settle()
        assert not second.done() and not third.done()
        gate.finish(t1)
        await settle()
        assert second.done() and not third.done()  # t2's turn came, but t2 has not finished
        assert gate.in_flight == [t2, t3]
        gate.finish(t2)
        await settle()
        assert third.done() and gate.in_flight == [t3]
    run(go())


def test_a_step_admitted_when_nothing_is_in_flight_waits_for_nothing():
    async def go():
        gate = DecodeGate()
        (t1,) = await admitted(gate, 1)
        gate.finish(t1)
        (t2,) = await admitted(gate, 1)
        assert t2.before is None
        await gate.turn(t2)  # at once
        assert gate.in_flight == [t2]
    run(go())


def test_finish_is_idempotent():
    async def go():
        gate = DecodeGate()
        t1, t2 = await admitted(gate, 1, 2)
        gate.finish(t1)
        gate.finish(t1)
        assert t1.finished.done() and gate.in_flight == [t2]
    run(go())


# ---------------------------------------------------------------- sharing a sequence

def test_sharing_names_the_steps_in_flight_with_a_common_sequence():
    async def go():
        gate = DecodeGate()
        t1, t2, t3 = await admitted(gate, 0b001, 0b010, 0b110)
        assert gate.sharing(0b100) == [t3]
        assert gate.sharing(0b010) == [t2, t3]
        assert gate.sharing(0b111) == [t1, t2, t3]
        assert gate.sharing(0b1000) == []
        gate.finish(t1)
        gate.finish(t2)
        assert gate.sharing(0b011) == [t3]  # finished steps are no longer in flight
    run(go())


def test_wait_for_waits_until_every_step_named_has_finished():
    async def go():
        gate = DecodeGate()
        t1, t2, t3 = await admitted(gate, 1, 2, 4)
        waiting = asyncio.ensure_future(gate.wait_for([t1, t3]))
        await settle()
        gate.finish(t1)
        await settle()
        assert not waiting.done()
        gate.finish(t2)
        gate.finish(t3)
        await settle()
        assert waiting.done() and waiting.exception() is None
        await gate.wait_for([])  # nothing to wait for
    run(go())


def test_a_cancelled_waiter_does_not_cancel_the_step_it_waits_for():
    async def go():
        gate = DecodeGate()
        t1, t2 = await admitted(gate, 1, 1)
        waiters = [asyncio.ensure_future(gate.wait_for([t1])), asyncio.ensure_future(gate.turn(t2)),
                   asyncio.ensure_future(gate.idle())]
        await settle()
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert not t1.finished.cancelled() and not t1.finished.done()
        gate.finish(t1)
        await gate.turn(t2)
    run(go())


# ---------------------------------------------------------------- between steps

def test_async_with_waits_until_every_step_has_finished_and_holds_off_admission():
    async def go():
        gate = DecodeGate()
        t1, t2 = await admitted(gate, 1, 2)
        inside, leave = asyncio.Event(), asyncio.Event()

        async def between_steps():
            async with gate as g:
                assert g is gate and gate.in_flight == []
                inside.set()
                await leave.wait()

        task = asyncio.ensure_future(between_steps())
        await settle()
        assert gate.lock.locked() and not inside.is_set()
        gate.finish(t1)
        await settle()
        assert not inside.is_set()  # t2 still in flight
        gate.finish(t2)
        await asyncio.wait_for(inside.wait(), 10)
        admitting = asyncio.ensure_future(admitted(gate, 1))
        await settle()
        assert not admitting.done()  # no step is admitted meanwhile
        leave.set()
        await task
        (t3,) = await admitting
        assert gate.in_flight == [t3] and not gate.lock.locked()
    run(go())


def test_async_with_gives_the_lock_back_when_cancelled_while_waiting():
    async def go():
        gate = DecodeGate()
        (t1,) = await admitted(gate, 1)

        async def between_steps():
            async with gate:
                pytest.fail("entered with a step in flight")

        task = asyncio.ensure_future(between_steps())
        await settle()
        assert gate.lock.locked()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not gate.lock.locked()
        assert not t1.finished.done() and gate.in_flight == [t1]
    run(go())


def test_idle_with_nothing_in_flight_returns_at_once():
    async def go():
        gate = DecodeGate()
        await gate.idle()
        async with gate:
            assert gate.lock.locked()
        assert not gate.lock.locked()
    run(go())


# ---------------------------------------------------------------- a step that cannot wait

def test_finish_in_turn_keeps_the_admission_order():
    """A cancelled step finishes once the step before it has: the step after
    it still waits for both."""
    async def go():
        gate = DecodeGate()
        t1, t2, t3 = await admitted(gate, 1, 2, 4)
        gate.finish_in_turn(t2)
        assert not t2.finished.done() and gate.in_flight == [t1, t2, t3]
        third = asyncio.ensure_future(gate.turn(t3))
        await settle()
        assert not third.done()
        gate.finish(t1)
        await settle()
        assert t2.finished.done() and third.done() and gate.in_flight == [t3]
    run(go())


def test_finish_in_turn_finishes_at_once_when_nothing_is_before():
    async def go():
        gate = DecodeGate()
        t1, t2 = await admitted(gate, 1, 2)
        gate.finish_in_turn(t1)  # first: nothing before it
        assert t1.finished.done()
        gate.finish_in_turn(t2)  # the step before has finished
        assert t2.finished.done() and gate.in_flight == []
    run(go())
