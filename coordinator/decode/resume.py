"""Resuming through the loss of a worker (Coordinator(resume_within=...)):
the one place that decides how a decode survives an endpoint failure, for the
library's generate/stream/astream and the HTTP server's batching alike.
docs/failure-semantics.md, "Resuming", states the behaviour and the guarantee.

* The KV table is kept when an endpoint latches (today's policy clears it):
  the workers that stayed up still hold their rows, and the journal
  (kv_journal.py) holds every step a live row depends on.
* The endpoint's automatic reconnect brings the stage back, on its own
  endpoint or, once it has been down `spare_after` seconds, on a spare
  (`candidates`, `claim`, `moved`). Every reconnect of one stage holds that
  stage's reconnect lock, so two resumes never race for it; a spare is
  claimed before it is tried, so two stages never take the same one. A
  stage on a spare moves back to its own endpoint once that is back
  (endpoints.py, `_bring_home`; `moved_home`), its rows rebuilt there alike.
* When no endpoint is latched any more, `reconnected` replays the journal
  through the stages that lost their KV cache (under the decode lock, before
  any new step), in the step shapes first decoded: the rows get the same bits.
* `decode` is decode() plus waiting: a step that failed with ENDPOINT_FAILED
  waits (woken by the reconnect that clears the last latch) until every
  endpoint is serving again and is retried; it decodes the same batch on the
  same KV table, so it gives the same logits. The wait is bounded by the
  outage's deadline (outages.py: the endpoint's first failure plus
  `resume_within`), not by when this decode came to it: every decode waiting
  on one outage gives up at the same moment, and one that meets an outage
  past its deadline fails at once. Giving up returns the outage's first
  failure, as decode() would have.
"""
from __future__ import annotations

import asyncio
import time

import structlog

from coordinator.decode.kv_journal import StepJournal
from coordinator.decode.outages import Outage, Outages
from coordinator.decode.step_io import StepFailed
from coordinator.decode.values import NO_OUTPUT, DecodeOutcome, DecodeResult

log = structlog.get_logger("coordinator.decode.resume")

# reconnect attempts while a stage resumes: a restarted worker is found within 20 ms of listening (a
# refused connect costs next to nothing; a host that does not answer holds each attempt for connect_timeout)
RESUME_BACKOFF = (0.01, 0.02)
LATE_BACKOFF_CAP = 2.0  # once a stage has been down resume_within, nobody paused waits on it: back off to this
HOME_EVERY = 2.0  # while a spare holds a stage, how often its own endpoint is tried again (moving it back)


class Resumer:
    home_every = HOME_EVERY
    def __init__(self, resume_within: float | None, spares=(), stats: dict | None = None,
                 spare_after: float | None = None):
        if resume_within is not None and not resume_within > 0:
            raise ValueError(f"resume_within must be a positive number of seconds or None, not {resume_within!r}")
        self.decoder = self.endpoints = None  # attach(): they are built with this as one of their hooks
        self.resume_within = None if resume_within is None else float(resume_within)
        self.spares: list[str] = list(spares)
        if self.spares and self.resume_within is None:
            raise ValueError("spares need resume_within: a spare takes over a stage while a generation waits")
        if spare_after is not None and not spare_after >= 0:
            raise ValueError(f"spare_after must be a number of seconds (at least 0) or None, not {spare_after!r}")
        # a spare takes over a stage that has been down this long (its own worker may be restarting)
        self.spare_after = (min(1.0, self.resume_within / 4) if spare_after is None and self.resume_within
                            else spare_after)
        self.journal = StepJournal() if self.enabled else None
        self.lost: set[int] = set()  # stages whose worker lost our KV rows, to rebuild
        # each latched stage's outage (its first failure, its deadline): what decode(), health() and the HTTP
        # server's admission all read
        self.outages = Outages(self.resume_within) if self.enabled else None
        self._serving = asyncio.Event()  # set when a reconnect leaves no endpoint latched: paused decodes go on
        self.stats = stats if stats is not None else {}  # the coordinator's, shared with its metrics
        self.stats.update({"resumes": 0, "resume_seconds": 0.0, "kv_rebuilds": 0, "replayed_steps": 0,
                           "replayed_tokens": 0, "replay_seconds": 0.0, "spare_takeovers": 0,
                           "moves_home": 0})

    def attach(self, decoder, endpoints) -> None:
        """The Decoder whose steps this resumes and the EndpointSet whose latches it waits out."""
        self.decoder, self.endpoints = decoder, endpoints

    @property
    def enabled(self) -> bool:
        return self.resume_within is not None

    # ------------------------------------------------------------ hooks of the EndpointSet
    def kv_lost(self, index: int, failure=None) -> None:
        """Stage `index`'s worker freed our buffers (its endpoint latched:
        `failure`, the first of that latch, begins its outage; a failed
        reconnect attempt then replaces the latch's cause, which is not the
        one to report, and does not move the outage's deadline)."""
        self.lost.add(index)
        if failure is not None:
            self.outages.begin(index, failure.endpoint, failure.cause, failure.kind, time.monotonic())

    def candidates(self, p) -> list[str]:
        """The endpoints to try, in order, in one reconnect attempt for `p`."""
        down = time.time() - p.failure.since if p.failure is not None else 0.0
        if self.spares and self.spare_after is not None and down >= self.spare_after:
            return [*self.spares, p.endpoint]  # a stopped worker would hold a connect for connect_timeout
        return [p.endpoint]

    def next_delay(self, p, delay: float, cap: float) -> float:
        """The wait before `p`'s next reconnect attempt after one of `delay`
        (doubling up to `cap`); past resume_within of down time, up to LATE_BACKOFF_CAP."""
        if p.failure is not None and time.time() - p.failure.since >= self.resume_within:
            cap = max(cap, LATE_BACKOFF_CAP)
        return min(delay * 2, cap)

    def claim(self, endpoint: str) -> bool:
        if endpoint in self.spares:
            self.spares.remove(endpoint)
            return True
        return False

    def release(self, endpoint: str) -> None:
        """A spare that failed to take over: tried again last."""
        self.spares.append(endpoint)

    def moved(self, p, spare: str) -> None:
        """`p`'s stage now runs on `spare`; its old endpoint may serve as a spare once back."""
        old, p.endpoint = p.endpoint, spare
        self.spares.append(old)
        self.stats["spare_takeovers"] += 1
        log.warning("spare took over a stage", stage=p.stage.index, spare=spare, lost=old,
                    layers=[p.layers.start, p.layers.stop])

    def moved_home(self, p, spare: str) -> None:
        """`p`'s stage is back on its own endpoint; the spare that held it is free again."""
        self.spares.append(spare)
        self.stats["moves_home"] += 1
        log.warning("stage moved back from the spare to its own worker", stage=p.stage.index, endpoint=p.endpoint,
                    spare=spare, layers=[p.layers.start, p.layers.stop])

    async def reconnected(self, places: list, latch) -> None:
        """Under the decode lock, after a reconnect cleared a latch: once no
        endpoint is latched, rebuild the KV rows the reconnected stages lost.
        `latch(exc)` latches an endpoint whose connection fails meanwhile."""
        if not self.enabled:
            return
        for index, p in enumerate(places):  # before any await: a latch cleared is an outage ended
            if p.failure is None:
                self.outages.end(index)
        if any(p.failure is not None for p in places):
            return
        try:
            if self.lost:
                await self._rebuild(latch)
        finally:
            if not any(p.failure is not None for p in places):
                self._serving.set()

    async def _rebuild(self, latch) -> None:
        through = max(self.lost)
        steps = self.journal.prune(self.decoder.kv.pos >= 0)
        started = time.perf_counter()
        try:
            await self.decoder.pipeline.replay(steps, through)
        except StepFailed as failed:
            if failed.lost:  # a worker failed during the replay: it latches and is resumed in turn
                for exc in failed.lost:
                    latch(exc)
                log.warning("KV rebuild interrupted by another endpoint failure", cause=failed.reported)
                return
            # a compute failure or a bug: the cache cannot be rebuilt exactly; today's policy
            log.error("KV rebuild failed; the sequences must be re-fed", error=str(failed.reported))
            self.lost.clear()
            self.journal.clear()
            self.decoder.forget_kv()
            return
        seconds = time.perf_counter() - started
        n_tokens = self.journal.replay_tokens()
        self.lost.clear()
        self.stats["kv_rebuilds"] += 1
        self.stats["replayed_steps"] += len(steps)
        self.stats["replayed_tokens"] += n_tokens
        self.stats["replay_seconds"] += seconds
        log.info("KV cache rebuilt by replay", stages=through + 1, steps=len(steps), tokens=n_tokens,
                 seconds=round(seconds, 3))

    # ------------------------------------------------------------ decoding through a failure
    async def decode(self, batch, greedy: bool = False, group: bool = True) -> DecodeOutcome:
        """Decoder.decode, waiting through endpoint failures until every stage
        is back, at most until the outage's deadline (its first failure plus
        resume_within, however late this decode came to it); on the
        coordinator's loop. Giving up returns the outage's first failure."""
        decoder = self.decoder
        outcome = await decoder.decode(batch, greedy, group)
        if outcome.code != DecodeResult.ENDPOINT_FAILED or not self.enabled:
            return outcome
        paused = time.monotonic()
        waited_on = None  # the outage this decode paused for (logged once)
        while outcome.code == DecodeResult.ENDPOINT_FAILED:
            while self.endpoints.failed():
                now = time.monotonic()
                outage = self.outages.first()
                if outage is None:  # every latch begins an outage (kv_lost): not expected; then this decode's own
                    outage = Outage(-1, outcome.endpoint, outcome.error, outcome.cause, paused,
                                    paused + self.resume_within)
                if outage.given_up(now):
                    return self._gave_up(outage, now)
                if waited_on is not outage:
                    log.warning("decode paused: waiting for the stage to resume", endpoint=outage.endpoint,
                                cause=outage.cause, within=self.resume_within, left=round(outage.left(now), 3))
                    waited_on = outage
                # no await between the look and the clear: a reconnect that ends meanwhile sets it again
                self._serving.clear()
                try:
                    await asyncio.wait_for(self._serving.wait(), outage.left(now))
                except TimeoutError:
                    pass
            outcome = await decoder.decode(batch, greedy, group)
        seconds = time.monotonic() - paused
        if outcome.code == DecodeResult.OK:
            self.stats["resumes"] += 1
            self.stats["resume_seconds"] += seconds
            log.info("decode resumed", endpoint=waited_on and waited_on.endpoint, paused_seconds=round(seconds, 3))
        return outcome

    def _gave_up(self, outage: Outage, now: float) -> DecodeOutcome:
        """A decode waiting on `outage`, past its deadline: the outage's first failure (not a fast-fail's
        "[latched ...]" form, nor a reconnect attempt's that replaced the latch's cause)."""
        failure = DecodeOutcome(DecodeResult.ENDPOINT_FAILED, NO_OUTPUT, outage.cause, outage.kind, outage.endpoint)
        self.decoder.last = failure
        if not outage.reported:  # once an outage, however many decodes wait on it
            outage.reported = True
            log.error("resume gave up: the stage did not come back in time", endpoint=outage.endpoint,
                      cause=outage.cause, down=round(now - outage.since, 3), within=self.resume_within)
        return failure

    # ------------------------------------------------------------ health
    def health(self, health: dict, places: list) -> dict:
        """The EndpointSet's health with what resuming adds: status
        "resuming" while decodes pause for a latched endpoint (no outage past
        its deadline), "degraded" while a spare holds a stage; each endpoint's
        `spare_for` (the endpoint whose stage it holds)."""
        if not self.enabled:
            return health
        failures = [p.failure for p in places if p.failure is not None]
        for entry, p in zip(health["endpoints"], places):
            if p.endpoint != p.home:
                entry["spare_for"] = p.home
        if failures and self.outages.given_up(time.monotonic()) is None:  # the rule decode() waits by
            health["status"] = "resuming"
        elif not failures and any(p.endpoint != p.home for p in places):
            health["status"] = "degraded"
        health["spares"] = list(self.spares)
        return health

