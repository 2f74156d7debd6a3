"""The coordinator's event loop thread (coordinator/cluster/loop.py) as a blocking caller
sees it: an interrupt (Ctrl-C) at any moment reaches the caller and cancels its call on the
loop, which stays usable; close() from another thread ends a call in flight with a clear
error; a call from the loop itself, or from inside another asyncio loop, neither hangs nor
fails.
(A caller borrowing the loop to save the two thread wake-ups of a hand-off was tried and
taken back: docs/operations.md, "Which split"; these tests are what it had to keep true.)"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from conftest import SLACK
from coordinator.cluster.loop import LoopThread


async def ident() -> int:
    await asyncio.sleep(0)
    return threading.get_ident()


@pytest.fixture
def lt():
    lt = LoopThread()
    yield lt
    if not lt.closed:
        lt.close(lambda: asyncio.sleep(0))


def test_an_interrupted_call_is_cancelled_on_the_loop_which_stays_usable(lt):
    """Ctrl-C while the main thread waits for its call: KeyboardInterrupt reaches the caller, the
    call's coroutine is cancelled on the loop (its cleanup runs at once), and the next call works."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    cleaned = threading.Event()

    async def waits_for_ever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cleaned.set()
            raise

    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        lt.run(waits_for_ever())
    timer.join()
    assert cleaned.wait(1.0 * SLACK)
    assert time.monotonic() - t0 < 1.0 * SLACK
    assert lt.run(ident()) == lt.thread.ident


def test_close_from_another_thread_ends_a_call_in_flight_with_a_clear_error(lt):
    started = threading.Event()

    async def waits_for_ever():
        started.set()
        await asyncio.sleep(3600)

    outcome = {}

    def caller():
        try:
            lt.run(waits_for_ever())
        except BaseException as exc:  # noqa: BLE001 - the test reads what it was
            outcome["exc"] = exc

    a = threading.Thread(target=caller)
    a.start()
    assert started.wait(5)
    shut = threading.Event()

    async def shutdown():
        shut.set()

    lt.close(shutdown)
    a.join(5 * SLACK)
    assert isinstance(outcome.get("exc"), RuntimeError) and "closed" in str(outcome["exc"])
    assert shut.is_set()
    lt.thread.join(5 * SLACK)
    assert not lt.thread.is_alive()


def test_run_from_the_loop_itself_is_refused_rather_than_waiting_for_ever(lt):
    async def nested():
        inner = ident()
        try:
            return lt.run(inner)
        finally:
            inner.close()

    with pytest.raises(RuntimeError, match="from the loop"):  # (not a wait for itself, for ever)
        lt.submit(nested()).result(timeout=5 * SLACK)


def test_a_caller_inside_a_running_loop_of_its_own_hands_its_call_over(lt):
    """A notebook's cell runs inside the kernel's asyncio loop: its blocking call goes to the
    loop thread and comes back (that thread could not run the coordinator's loop itself)."""
    async def cell():
        return lt.run(ident())

    assert asyncio.run(cell()) == lt.thread.ident


def test_ctrl_c_anywhere_in_a_loop_of_calls_never_leaves_the_loop_half_run():
    """Python runs a signal's handler between any two bytecodes of the main thread. Ctrl-C at a
    different moment of a tight loop of calls, each time: KeyboardInterrupt reaches the caller,
    and the loop still serves a call from another thread and closes cleanly. (Were the main
    thread to run the loop itself, the interrupt could land inside uvloop's bookkeeping: 6 of
    12 such interrupts then left uvloop 'running' for good.)"""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    for trial in range(12):
        lt = LoopThread()
        timer = threading.Timer(0.05 + trial * 0.0071, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            until = time.monotonic() + 2.0 * SLACK
            while time.monotonic() < until:
                lt.run(asyncio.sleep(0))
        timer.join()
        later = {}
        other = threading.Thread(target=lambda: later.setdefault("v", lt.run(asyncio.sleep(0, "ok"))), daemon=True)
        other.start()
        other.join(2 * SLACK)
        assert later.get("v") == "ok", f"trial {trial}: a later call did not complete"
        lt.close(lambda: asyncio.sleep(0))  # does not raise
        assert not lt.loop.is_running() and lt.loop.is_closed()

