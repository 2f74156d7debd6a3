"""The coordinator's private event loop, its thread, and the bridge to it.

All network I/O and every executor call runs on one event loop, run by a daemon
thread, "coordinator-loop", whenever no caller borrows it. Callers reach it
from their own asyncio loop (`call`, awaiting) or from any thread (`run`,
blocking); `iterate`/`aiterate` drive an async generator living on the loop
from either side. Once `closed` is set nothing new is accepted.

A thread that calls `run` borrows the loop: it runs the loop itself until its
coroutine is done, and keeps it for KEEP_S after, so the next call of a loop of
calls (a decode per token) runs at once on the caller's thread too. Handing
each call to the loop thread and back cost two thread wake-ups, ~0.3 ms a call
on the 2-core development VM (a gemma3-270m token over 2 tensor-split workers
0.34 ms faster, a 1.1B llama's 0.32 ms, interleaved). A caller idle for longer
leaves the loop to the loop thread again. Only one thread runs the loop at a
time (`_own`); a second caller while one borrows it hands its call over as
before, and whatever is submitted while nobody runs it (a borrower between two
calls) waits for the keep to end. On the main thread the signals' Python
handlers are held for the call (`_MainThreadSignals`), and on every borrower
SIGPIPE is blocked as on the loop thread (`_sigpipe_blocked`).
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from concurrent.futures import CancelledError, Future
from typing import AsyncIterator, Iterator

# the loop kind (uvloop) is chosen in one place for the daemon and the coordinator;
# run_async runs the HTTP server on a loop of the same kind
from rpc_daemon.service.loop import new_event_loop, run as run_async  # noqa: F401


class LoopThread:
    KEEP_S = 0.005  # a borrower keeps the loop this long after its call (see the module's doc)
    BUSY_POLL_S = 0.05  # while a borrower's call runs, the loop thread looks this often for its end

    def __init__(self, name: str = "coordinator-loop"):
        self.closed = False
        self.loop = new_event_loop()
        self._background: set = set()  # tasks nobody awaits: latching a lost connection, closing a stream
        self._own = threading.Lock()  # held by the one thread running the loop
        self._runner: int | None = None  # that thread's ident (None: nobody runs it now)
        self._lent_until = 0.0  # a borrower keeps the loop until then (time.monotonic)
        self._wanted = 0  # callers that stopped the loop thread's run and wait to take the loop
        self._stopping = False  # the loop thread's current run was asked to stop
        self._thread_exits = False
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        # The network I/O runs on this thread (or a borrower's, which does the same for its
        # call). With SIGPIPE blocked here a write to a socket the worker reset fails with
        # EPIPE instead of killing the process, even if the host program restored SIGPIPE's
        # default action.
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
        except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
            pass
        me = threading.get_ident()
        while not self._thread_exits:
            with self._own:
                if self._thread_exits:
                    return
                self._runner = me
                try:
                    self.loop.run_forever()  # until a borrower (or close) stops it
                finally:
                    self._runner = None
                    self._stopping = False
            # lent: take it back once the borrower has left it idle past its keep
            while not self._thread_exits:
                wait = self._lent_until - time.monotonic()
                busy = self._own.locked() or self._wanted
                if wait <= 0 and not busy:
                    break
                # (rarely while a call runs: each wake-up here preempts a worker on a busy machine)
                time.sleep(self.BUSY_POLL_S if busy else max(wait, 0.0))

    def on_loop(self) -> bool:
        """This thread runs the loop now (the loop thread, or a borrower inside its call)."""
        return self._runner == threading.get_ident()

    def submit(self, coro) -> Future:
        """`coro` onto the loop thread; refused once closed."""
        if self.closed:
            coro.close()
            raise RuntimeError("the coordinator is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro):
        """Run `coro` on the loop and wait for it (from another thread): on this thread, borrowing
        the loop, unless another caller's thread runs it now."""
        if self.closed:
            coro.close()
            raise RuntimeError("the coordinator is closed")
        held = _MainThreadSignals(self.loop) if threading.current_thread() is threading.main_thread() else None
        try:
            if held is not None:
                held.hold()
            borrowed = self._borrow()
        except BaseException:
            coro.close()
            if held is not None:
                held.release()
            raise
        if borrowed:
            return self._run_borrowed(coro, held)
        if held is not None:
            held.release()  # (a signal that came meanwhile has its handler run here, before the call)
        fut = self.submit(coro)
        try:
            return fut.result()
        except CancelledError:
            if self.closed:
                raise RuntimeError("the coordinator was closed while this call waited") from None
            raise
        except BaseException:  # interrupted here (KeyboardInterrupt, SIGTERM): stop it there too
            fut.cancel()
            raise

    def _borrow(self) -> bool:
        """Take the loop for this thread: free (its borrower's keep or the loop thread's turn
        between two runs), or stopped on the loop thread. False if another caller runs it."""
        me = threading.get_ident()
        if me == self._runner:  # a callback on the loop calling run(): it would wait for itself
            raise RuntimeError("LoopThread.run called from the loop")
        if asyncio._get_running_loop() is not None:
            return False  # a thread running a loop of its own (a notebook's) cannot run this one too
        for _ in range(3):  # (the loop changes hands between the checks: look again)
            if self._own.acquire(blocking=False):
                self._runner = me
                return True
            runner = self._runner
            if runner is not None and runner != self.thread.ident:
                return False  # another caller's: hand this call over as before
            if runner is not None:  # the loop thread's: it stops after this turn and waits
                self._wanted += 1
                try:
                    self.loop.call_soon_threadsafe(self._stop_for_borrower)
                    got = self._own.acquire(timeout=1.0)
                finally:
                    self._wanted -= 1
                if got:
                    self._runner = me
                    return True
        return False

    def _stop_for_borrower(self) -> None:
        # On the loop, a turn after a caller asked. Only the loop thread's run is stopped, once: a
        # stop left queued (by a second caller) would end the next run_until_complete before its
        # call is done.
        if self._runner == self.thread.ident and self._wanted and not self._stopping:
            self._stopping = True  # once a run: uvloop's stop() takes effect a turn later, and a second
            self.loop.stop()  # one would be left queued for whoever runs the loop next

    def _run_borrowed(self, coro, held: "_MainThreadSignals | None"):
        """`coro` run to its end on this thread, which holds the loop (_borrow)."""
        task = None
        keep = True
        with _sigpipe_blocked():  # as on the loop thread
            try:
                task = self.loop.create_task(coro)
                if held is not None:
                    held.call = task
                return self.loop.run_until_complete(task)
            except asyncio.CancelledError:  # (close() from another thread cancelled it)
                if self.closed:
                    raise RuntimeError("the coordinator was closed while this call waited") from None
                raise
            except BaseException:  # interrupted (a signal's handler raised): stop it there too
                if task is not None and not task.done():
                    task.cancel()  # the loop thread takes the loop back now and ends it
                    keep = False
                raise
            finally:
                self._lent_until = time.monotonic() + self.KEEP_S if keep else 0.0
                self._runner = None
                self._own.release()
                if held is not None:
                    held.release()  # raises what a handler raised during the call

    async def call(self, coro):
        """Run `coro` on the loop and await it (from the caller's own loop)."""
        fut = self.submit(coro)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.closed and not (task is not None and task.cancelling()):
                raise RuntimeError("the coordinator was closed while this call waited") from None
            raise

    def spawn(self, coro) -> None:
        """Run `coro` on the loop (from the loop thread) with nobody awaiting it;
        referenced until done."""
        task = self.loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def iterate(self, agen) -> Iterator:
        """The items of async generator `agen` (run on the loop), from another thread."""
        try:
            while True:
                try:
                    item = self.run(agen.__anext__())  # interrupted (Ctrl-C), it cancels the step
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if not self.closed:
                if self.on_loop():  # the GC finalized it on the loop: never block that
                    self.spawn(_aclose_when_idle(agen))
                else:
                    self.run(_aclose_when_idle(agen))

    async def aiterate(self, agen) -> AsyncIterator:
        """The items of async generator `agen` (run on the loop), from the caller's loop."""
        try:
            while True:
                try:
                    item = await self.call(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            if not self.closed:
                await self.call(_aclose_when_idle(agen))

    def close(self, shutdown) -> None:
        """Refuse new work, run coroutine function `shutdown` on the loop (after
        cancelling whatever still runs there), stop the loop and the thread."""
        self.closed = True

        async def stop_all():
            # everything still running or waiting here (a step, a generation waiting
            # for its turn, a reconnect): cancelled, and its caller told so
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in others:
                t.cancel()
            if others:
                await asyncio.wait(others, timeout=5)
            await shutdown()

        async def stop_within(seconds: float):
            # bounded, in this task (asyncio.wait_for's own task would be among those stop_all cancels)
            timer = asyncio.get_running_loop().call_later(seconds, asyncio.current_task().cancel)
            try:
                await stop_all()
            finally:
                timer.cancel()

        try:
            if self._borrow():
                try:
                    with _sigpipe_blocked():
                        self.loop.run_until_complete(stop_within(10))
                except asyncio.CancelledError:
                    pass  # past its bound, as a hand-off's result(timeout=10) gives up below
                finally:
                    self._runner = None
                    self._own.release()
            else:
                asyncio.run_coroutine_threadsafe(stop_all(), self.loop).result(timeout=10)
        except Exception:
            pass
        self._thread_exits = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():  # its epoll, self-pipe and eventfd: 5 descriptors per Coordinator, else
            self.loop.close()


async def _aclose_when_idle(agen) -> None:
    """aclose() a generation, once a step cancelled from the caller's side has
    finished unwinding on this loop (aclose of a running generator raises)."""
    for _ in range(3000):  # bounded: a cancelled step unwinds in a few loop iterations
        if not agen.ag_running:
            break
        await asyncio.sleep(0.01)
    await agen.aclose()


@contextlib.contextmanager
def _sigpipe_blocked():
    """SIGPIPE blocked on this thread, as on the loop thread: a write to a socket the worker reset
    fails with EPIPE. One raised meanwhile is taken off before the mask is put back, else it
    would be delivered then (and kill a program that restored SIGPIPE's default action)."""
    try:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        yield
        return
    try:
        yield
    finally:
        if signal.SIGPIPE not in blocked and signal.SIGPIPE in signal.sigpending():
            signal.sigtimedwait({signal.SIGPIPE}, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _MainThreadSignals:
    """Python runs a signal's handler in the main thread between any two of its bytecodes. While
    the main thread runs the loop for a call, that can be inside uvloop's own bookkeeping or a
    connection's callback, where an exception (KeyboardInterrupt) leaves the loop half-run for
    good. So for the call (hold .. release) these signals' Python handlers are replaced by one
    that has the original run as a callback of the loop, between two of its callbacks: if it
    raises there, the call is cancelled and the exception raised to the caller once the call
    has unwound and the loop is released, as a handler interrupting a handed-off call's wait
    does (a second one stops the loop at once and leaves the unwinding to the loop thread). A
    signal that comes when no callback can run it any more has its handler run at release."""

    SIGNALS = tuple(getattr(signal, name) for name in
                    ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")
                    if hasattr(signal, name))

    def __init__(self, loop):
        self.loop = loop
        self.call: asyncio.Task | None = None
        self.saved: dict = {}  # signal -> the handler it had
        self.came: list = []  # (signum, frame) whose handler has not run yet
        self.raised: BaseException | None = None
        self.open = False  # handlers still run as loop callbacks

    def hold(self) -> None:
        self.open = True
        for sig in self.SIGNALS:
            handler = signal.getsignal(sig)
            if isinstance(getattr(handler, "__self__", None), _MainThreadSignals):
                handler = handler.__self__.saved.get(sig, handler)  # one left behind (release was cut short)
            if callable(handler):
                self.saved[sig] = handler
                signal.signal(sig, self._came)

    def _came(self, signum, frame) -> None:
        if not self.open:  # (released meanwhile)
            self.saved[signum](signum, frame)
            return
        self.came.append((signum, frame))
        self.loop.call_soon_threadsafe(self._run_handlers)

    def _run_handlers(self) -> None:
        while self.came and self.open:
            signum, frame = self.came.pop(0)
            try:
                self.saved[signum](signum, frame)
            except BaseException as exc:  # noqa: BLE001 - raised to the caller at release
                first = self.raised is None
                if first:
                    self.raised = exc
                if self.call is not None and not self.call.done():
                    if first:
                        self.call.cancel()  # it unwinds (its waits end at once) and the run returns
                    else:  # a second Ctrl-C: no waiting for that; the loop thread finishes it
                        self.loop.stop()

    def release(self) -> None:
        """Put the handlers back (the loop is no longer this thread's); run those still due;
        raise what one raised."""
        self.open = False
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        came, self.came = self.came, []
        for signum, frame in came:
            self.saved[signum](signum, frame)
        if self.raised is not None:
            raised, self.raised = self.raised, None
            raise raised
