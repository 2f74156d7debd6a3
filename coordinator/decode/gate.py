"""Which decode steps may be in flight at once (pipeline parallelism across
steps: worker A computes one step while worker B computes another).

* A step is admitted under the gate's lock, briefly: its checks, its KV rows
  and masks, its place in every stage's order (microbatch.py). Then it
  computes outside the lock, while later steps are admitted behind it.
* A step waits, before admission, for every step in flight that shares a
  sequence with it: it may attend to their KV rows, which are final only if
  they succeed.
* A step finishes (rolls back or keeps its rows, latches, records itself in
  the KV journal) in admission order: `Ticket.finish` waits for the step
  before. So the KV table and the journal change in the order every stage
  computed the steps.
* `async with gate` is for everything that must happen between steps
  (reconnecting, latching a connection lost while idle, replaying the
  journal, KV edits): it takes the lock, so no step is admitted, and waits
  until every step in flight has finished.
"""
from __future__ import annotations

import asyncio


class Ticket:
    """A step in flight: its sequences (a bitmask) and when it has finished."""

    def __init__(self, seqs: int, before: "Ticket | None"):
        self.seqs = seqs
        self.before = before
        self.finished = asyncio.get_running_loop().create_future()


class DecodeGate:
    def __init__(self):
        self.lock = asyncio.Lock()
        self.in_flight: list[Ticket] = []  # in admission order
        self._last: Ticket | None = None

    async def __aenter__(self):
        await self.lock.acquire()
        try:
            await self.idle()
        except BaseException:
            self.lock.release()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self.lock.release()

    async def idle(self) -> None:
        """Until no step is in flight."""
        while self.in_flight:
            await asyncio.shield(self.in_flight[0].finished)

    def sharing(self, seqs: int) -> list[Ticket]:
        return [t for t in self.in_flight if t.seqs & seqs]

    async def wait_for(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            await asyncio.shield(t.finished)

    def admit(self, seqs: int) -> Ticket:
        """A new step in flight (call under the lock, after its admission)."""
        before = self._last if self._last is not None and not self._last.finished.done() else None
        ticket = Ticket(seqs, before)
        self.in_flight.append(ticket)
        self._last = ticket
        return ticket

    async def turn(self, ticket: Ticket) -> None:
        """Until every step admitted before `ticket` has finished."""
        if ticket.before is not None:
            await asyncio.shield(ticket.before.finished)

    def finish(self, ticket: Ticket) -> None:
        """`ticket` has finished (after its turn: see finish_in_turn)."""
        if ticket in self.in_flight:
            self.in_flight.remove(ticket)
        if not ticket.finished.done():
            ticket.finished.set_result(None)

    def finish_in_turn(self, ticket: Ticket) -> None:
        """`ticket` finishes once the step before it has (a cancelled step,
        which cannot wait): the steps after it keep the admission order."""
        before = ticket.before
        if before is None or before.finished.done():
            self.finish(ticket)
        else:
            before.finished.add_done_callback(lambda _: self.finish(ticket))
