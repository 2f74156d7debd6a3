"""Outages, and the one bound of every wait for one (resuming on: resume.py).

An outage is a stage's endpoint latched failed: it begins with the latch (the
first failure; a failed reconnect attempt replaces the latch's cause but not
the outage) and ends when a reconnect clears the latch (the stage is back, on
its worker or a spare). Its deadline is its beginning plus `resume_within`,
and it belongs to the outage, not to whoever waits on it: every decode paused
for it, however late it came to it (a step admitted after the failure, a
request that waited for a slot), gives up at that one moment; once past it
the outage has given up, so a decode that meets it fails at once and the HTTP
server answers 503, until the stage is back (docs/failure-semantics.md,
"Resuming"). Waits on several outages at once end at the earliest deadline.

Pure: times are given (time.monotonic()), nothing here waits or logs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Outage:
    stage: int  # the place's index: its endpoint may change (a spare takes over) but the stage does not
    endpoint: str  # the endpoint that failed
    cause: str  # its first failure's message, what a request that gives up reports
    kind: object  # its first failure's FailureKind
    since: float  # time.monotonic() of the first failure
    deadline: float  # since + resume_within
    reported: bool = False  # "resume gave up" logged (once an outage)

    def given_up(self, now: float) -> bool:
        return now >= self.deadline

    def left(self, now: float) -> float:
        """Seconds until it gives up (0 once it has)."""
        return max(0.0, self.deadline - now)


class Outages:
    """The open outage of each stage whose endpoint is latched."""

    def __init__(self, within: float):
        if not within > 0:
            raise ValueError(f"an outage's bound must be a positive number of seconds, not {within!r}")
        self.within = float(within)
        self.open: dict[int, Outage] = {}

    def begin(self, stage: int, endpoint: str, cause: str, kind, now: float) -> Outage:
        """Stage `stage`'s endpoint latched (its first failure, at `now`): a new outage."""
        outage = self.open[stage] = Outage(stage, endpoint, cause, kind, now, now + self.within)
        return outage

    def end(self, stage: int) -> Outage | None:
        """The stage is back (a reconnect cleared its latch): its outage ends."""
        return self.open.pop(stage, None)

    def first(self) -> Outage | None:
        """The open outage that gives up first (the oldest), None if none is open."""
        # list() copies in one step: health() reads this from other threads while the loop's begin/end change it
        return min(list(self.open.values()), key=lambda o: (o.deadline, o.stage), default=None)

    def given_up(self, now: float) -> Outage | None:
        """The open outage past its deadline, if one is: every wait on the cluster ends."""
        first = self.first()
        return first if first is not None and first.given_up(now) else None

