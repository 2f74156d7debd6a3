"""The coordinator's event loop and its thread (coordinator/cluster/loop.py): a caller's
blocking `run` borrows the loop and runs its call on its own thread, keeping the loop a
moment for its next call; whatever else is submitted runs on the loop thread once nobody
borrows it; a second caller hands its call over; an interrupt cancels the call; close()
ends every state."""
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


def test_a_caller_runs_its_calls_on_its_own_thread_then_the_loop_thread_takes_the_loop_back(lt):
    me = threading.get_ident()
    assert [lt.run(ident()) for _ in range(5)] == [me] * 5  # no hand-off to the loop thread and back
    time.sleep(lt.KEEP_S * 4)  # the caller left it idle past its keep
    t0 = time.monotonic()
    assert lt.submit(ident()).result(timeout=5) == lt.thread.ident  # another's work: on the loop thread
    assert time.monotonic() - t0 < 0.5 * SLACK
    assert lt.run(ident()) == me  # and the caller takes it again (stopping the loop thread's run)


def test_work_submitted_while_a_caller_keeps_the_loop_runs_when_the_keep_ends(lt):
    """Between two calls nobody runs the loop: what another thread submits waits at most the
    caller's keep (plus a scheduler tick), then runs on the loop thread."""
    lt.run(ident())
    t0 = time.monotonic()
    done = lt.submit(ident())
    assert done.result(timeout=5) == lt.thread.ident
    assert time.monotonic() - t0 < (lt.KEEP_S + 0.1) * SLACK


def test_a_second_caller_hands_its_call_over_while_the_first_runs_the_loop(lt):
    """Thread A runs a long call on the loop (borrowed); B's call runs on that same loop, in A's
    thread, and both return what their coroutines return."""
    release = None
    started = threading.Event()

    async def long_call():
        nonlocal release
        release = asyncio.Event()
        started.set()
        await release.wait()
        return "a"

    got = {}
    a = threading.Thread(target=lambda: got.setdefault("a", (lt.run(long_call()), threading.get_ident())))
    a.start()
    assert started.wait(5)
    b_result = lt.run(ident())
    assert b_result == a.ident  # B's coroutine ran where the loop runs: A's thread
    lt.loop.call_soon_threadsafe(release.set)
    a.join(5)
    assert got["a"] == ("a", a.ident)


def test_an_interrupted_call_is_cancelled_on_the_loop_which_stays_usable(lt):
    """Ctrl-C while the main thread runs the loop for its call: KeyboardInterrupt reaches the
    caller, the call's coroutine is cancelled (its cleanup runs, on the loop thread, at once),
    and the next call works."""
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
    assert lt.run(ident()) == threading.get_ident()


def test_close_while_a_caller_keeps_the_loop_runs_the_shutdown_and_ends_the_thread(lt):
    lt.run(ident())
    shut = []

    async def shutdown():
        shut.append(threading.get_ident())

    lt.close(shutdown)
    assert shut == [threading.get_ident()]  # on the closing thread, which took the loop
    lt.thread.join(1.0 * SLACK)
    assert not lt.thread.is_alive() and lt.loop.is_closed()
    with pytest.raises(RuntimeError, match="closed"):
        lt.run(ident())


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

    with pytest.raises(RuntimeError, match="from the loop"):
        lt.run(nested())


def test_a_caller_inside_a_running_loop_of_its_own_hands_its_call_over(lt):
    """A notebook's cell runs inside the kernel's asyncio loop: that thread cannot run a second
    loop, so its blocking call goes to the loop thread, as before."""
    async def cell():
        return lt.run(ident())

    assert asyncio.run(cell()) == lt.thread.ident


def test_ctrl_c_anywhere_in_a_loop_of_calls_never_leaves_the_loop_half_run():
    """Python runs a signal's handler between any two bytecodes of the main thread, which, in a
    borrowed call, can be inside uvloop's own bookkeeping or a connection's callback. Ctrl-C at
    a different moment of a tight loop of calls, each time: KeyboardInterrupt reaches the caller,
    and the loop still serves a call from another thread and closes cleanly (before the handlers
    were held, 6 of 12 such interrupts left uvloop 'running' for good)."""
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


def test_two_callers_stopping_a_busy_loop_thread_leave_no_stop_behind(lt):
    """The loop thread is busy in 20 ms callbacks when caller A, then B 30 ms later, ask for the
    loop: each stop request is queued, uvloop's stop takes effect a turn later, and a second one
    left queued would end the next borrower's call before it is done."""
    busy_until = time.monotonic() + 0.2

    def busy():
        time.sleep(0.02)
        if time.monotonic() < busy_until:
            lt.loop.call_soon(busy)

    lt.loop.call_soon_threadsafe(busy)
    time.sleep(0.01)

    async def work():
        await asyncio.sleep(0.001)
        return "ok"

    out = {}

    def caller(name, delay):
        time.sleep(delay)
        try:
            out[name] = lt.run(work())
        except BaseException as exc:  # noqa: BLE001 - the test reads what it was
            out[name] = repr(exc)

    callers = [threading.Thread(target=caller, args=("A", 0)), threading.Thread(target=caller, args=("B", 0.03))]
    for t in callers:
        t.start()
    for t in callers:
        t.join(5 * SLACK)
    out["C"] = lt.run(work())
    assert out == {"A": "ok", "B": "ok", "C": "ok"}


def test_a_borrowed_call_writing_to_a_reset_socket_does_not_kill_a_program_that_restored_sigpipe():
    """SIGPIPE is blocked on a borrowing thread for its call, as on the loop thread; one raised
    meanwhile is taken off before the mask is restored, else it would be delivered then."""
    import subprocess
    import sys

    child = r'''
import asyncio, signal, socket
from coordinator.cluster.loop import LoopThread
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
lt = LoopThread()
a, b = socket.socketpair()
async def open_():
    tr, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, a)
    return tr
tr = lt.run(open_())
b.close()
async def write():
    for _ in range(3):
        if not tr.is_closing():
            tr.write(b"x" * 1000)
        await asyncio.sleep(0.01)
    return "returned"
print(lt.run(write()), flush=True)
lt.close(lambda: asyncio.sleep(0))
print("alive", flush=True)
'''
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60 * SLACK)
    assert done.returncode == 0 and done.stdout.split() == ["returned", "alive"], (done.returncode, done.stderr)
