"""The coordinator's private event loop thread, and the bridge to it.

All network I/O and every executor call runs on one daemon thread,
"coordinator-loop". Callers reach it from any thread (`run`, blocking) or from
their own asyncio loop (`call`, awaiting); `iterate`/`aiterate` drive an async
generator living on the loop from either side. Once `closed` is set nothing
new is accepted.
"""
from __future__ import annotations

import asyncio
import signal
import threading
from concurrent.futures import CancelledError, Future
from typing import AsyncIterator, Iterator

# the loop kind (uvloop) is chosen in one place for the daemon and the coordinator;
# run_async runs the HTTP server on a loop of the same kind
from rpc_daemon.service.loop import new_event_loop, run as run_async  # noqa: F401


class LoopThread:
    def __init__(self, name: str = "coordinator-loop"):
        self.closed = False
        self.loop = new_event_loop()
        self._background: set = set()  # tasks nobody awaits: latching a lost connection, closing a stream
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        # All network I/O runs on this thread. With SIGPIPE blocked here a write to
        # a socket the worker reset fails with EPIPE instead of killing the process,
        # even if the host program restored SIGPIPE's default action.
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
        except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
            pass
        self.loop.run_forever()

    def on_loop(self) -> bool:
        return threading.current_thread() is self.thread

    def submit(self, coro) -> Future:
        """`coro` onto the loop thread; refused once closed."""
        if self.closed:
            coro.close()
            raise RuntimeError("the coordinator is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro):
        """Run `coro` on the loop and wait for it (from another thread)."""
        if self.on_loop():  # a callback on the loop calling run(): it would wait for itself for ever
            coro.close()
            raise RuntimeError("LoopThread.run called from the loop")
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

        try:
            if self.loop.is_running():
                asyncio.run_coroutine_threadsafe(stop_all(), self.loop).result(timeout=10)
        except Exception:
            pass
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
