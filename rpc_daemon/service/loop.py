"""The one place the event loop kind is chosen, for the daemon and the
coordinator alike: uvloop when installed (it is a dependency), whose socket
path is several times cheaper per request than the selector loop."""
from __future__ import annotations

import asyncio


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop of the chosen kind (for a loop run on a thread of its own)."""
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()


def run(main):
    """Run coroutine `main` to completion on a new loop of the chosen kind."""
    try:
        import uvloop
        return uvloop.run(main)
    except ImportError:  # pragma: no cover
        return asyncio.run(main)


if hasattr(asyncio, "timeout"):  # Python >= 3.11
    async def within(awaitable, seconds: float):
        """`await awaitable`, raising asyncio.TimeoutError after `seconds` as
        asyncio.wait_for does, without wait_for's cost on the hot path: on Python
        3.11 wait_for runs a coroutine as a task of its own and wakes the caller
        through two more loop turns, on every compute and every step input."""
        async with asyncio.timeout(seconds):
            return await awaitable
else:  # pragma: no cover
    within = asyncio.wait_for
