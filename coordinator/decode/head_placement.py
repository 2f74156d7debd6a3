"""Where a step's output head runs: split over every worker (each computes
its share of the vocabulary rows at once), whole on the last stage, or
"here": the last worker's share on it and the rest of the rows in this
process (the coordinator), at once.

Splitting saves compute: the whole head on one worker takes about the sum of
the shards' times, split it takes the slowest shard's. It costs hops: the
last stage's normed rows must reach the other shards, one more one-way hop
with step links (N + 2 instead of N + 1 a token) and two more relayed (the
coordinator sends them out and gathers the shards' rows: 2N + 2 instead of
2N). "here" costs no extra hop with step links: the last stage pushes its
normed rows to its own share and replies with them, so this process computes
the other rows while they would have travelled to the other workers; relayed
the last worker's share costs two more hops, this process's none. It is
possible where this process holds those rows (HeadPlacement.here_held: only
where the last worker holds the whole head too, i.e. a hop may cost more than
the split saves; coordinator/api.py). So `auto` takes, for each step, the
least of

    whole  =  sum(shard times)                      (of the last split steps)
    split  =  max(shard times) + extra hops x one-way delay
    here   =  max(this process's time, the last worker's share's time + (0 linked, 2 relayed) x one-way delay)

measured, not assumed: the one-way delay is half the round trip of PINGs to
each worker (the slowest worker's median of its last samples; measured at
connect and again every REFRESH_S seconds while decoding, and by every probe
of the cluster view), and the shard times are the workers' own compute times
of the head requests (`compute_us` in their replies) and this process's compute
time for its rows, of the last steps so placed with as many output rows, greedy
or not, the least of the last few (a step shape not yet measured is split,
which measures it, and then, where possible, taken "here", which measures
that; a first, cold, compute is slower, so the next step is likely split too
and measures it again). Between workers on one machine, sharing its memory
bandwidth, the whole head takes less than the sum of the shards: the rule
then splits more often than it should, which costs at most the saving it
overestimates. Each step is decided when it is prepared, between steps, and
carries its choice in its shape (StepShape.head_on_last) and its head places:
steps already in flight keep theirs. All give the same logits bit for bit
(each logit is the same dot product on the same data), so the choice never
changes a result. `split`, `whole` and `here` fix the choice (`here` takes
"split" for a step that cannot be placed here: the coordinator holds no rows,
or over step links the last worker lacks `reply_output`).
"""
from __future__ import annotations

import collections
import statistics
import time

import structlog

log = structlog.get_logger("coordinator")

MODES = ("auto", "split", "whole", "here")
# where a step's head runs: every worker's share at once; the last worker's whole head; the last
# worker's share and, in this process, the rows of the others (HeadPlacement.here_held)
CHOICES = ("whole", "split", "here")  # in this order of preference between equal costs
RTT_SAMPLES = 8  # round trips kept per worker; the median of them is its estimate
REFRESH_S = 10.0  # seconds between round-trip measurements while decoding
# More bytes a second than one core of any machine we know reads from memory: the
# head's bytes over it are less than any split of the head can save (held_whole)
FASTEST_READ_BYTES_S = 50e9
HEAD_SAMPLES = 4  # head timings kept per step shape; the least of them is the estimate


def checked_mode(head_split) -> str:
    """The Coordinator's `head_split` as a mode: True is "split", False "whole"."""
    if head_split is True or head_split is False:
        return "split" if head_split else "whole"
    if head_split not in MODES:
        raise ValueError(f"head_split must be True, False or one of {', '.join(MODES)}, not {head_split!r}")
    return head_split


class HeadPlacement:
    """The choice, step by step, and the measurements it is made from."""

    def __init__(self, mode: str):
        self.mode = mode
        self._rtts: dict[str, collections.deque] = {}
        # (choice, step shape) -> the head compute times of its last steps so placed, one tuple a step
        self._head: dict[tuple, collections.deque] = {}
        self.measured_at = 0.0  # monotonic time of the last round-trip measurement asked for
        self.choice: str | None = None  # the last step's: one of CHOICES
        self.steps = dict.fromkeys(CHOICES, 0)
        self.changes = 0
        self.whole_held = False  # the last worker holds the whole head (set at load: held_whole, if it fits)
        self.here_held = False  # this process holds the rows besides the last worker's share (set at load)
        self._last_inputs: tuple = (None, None, 0)  # (one-way s, saved s, extra hops) of the last choice

    def mark(self) -> tuple:
        """The step counts and last choice as they are now (restore(mark) returns to them)."""
        return dict(self.steps), self.changes, self.choice, self._last_inputs

    def restore(self, mark: tuple) -> None:
        """Forget the steps since mark(): steps that are not the user's (the warm-up's)."""
        steps, self.changes, self.choice, self._last_inputs = mark
        self.steps.update(steps)

    # ------------------------------------------------------------ measurements

    def record_rtt(self, endpoint: str, seconds: float) -> None:
        self._rtts.setdefault(endpoint, collections.deque(maxlen=RTT_SAMPLES)).append(float(seconds))

    def forget(self, endpoint: str) -> None:
        """A worker's connection is new (reconnected, or a spare): its old round trips say nothing."""
        self._rtts.pop(endpoint, None)

    def keep_only(self, endpoints: set) -> None:
        """Forget the round trips of workers that no longer hold a stage (a stage moved to a spare)."""
        for endpoint in [e for e in self._rtts if e not in endpoints]:
            self._rtts.pop(endpoint, None)

    def one_way(self) -> float | None:
        """The slowest worker's one-way delay (half its median round trip), or None if none is measured."""
        medians = [statistics.median(d) for d in self._rtts.values() if d]
        return max(medians) / 2 if medians else None

    def record_head(self, shape: tuple, seconds: list, choice: str = "split") -> None:
        """The head shares' compute times (s) of one step of `shape` ((n_outputs,
        argmax)) placed `choice`: "split", every worker's share in stage order;
        "here", this process's share, then the last worker's."""
        if not seconds or any(s is None for s in seconds):
            return
        samples = self._head.setdefault((choice, shape), collections.deque(maxlen=HEAD_SAMPLES))
        samples.append(tuple(float(s) for s in seconds))

    def _least(self, choice: str, shape: tuple, cost) -> float | None:
        """The least `cost(times)` over the last steps of `shape` placed `choice`
        (a compute is only ever slowed: a cold first run, other jobs); None if none."""
        samples = self._head.get((choice, shape))
        return min(cost(t) for t in samples) if samples else None

    def saved(self, shape: tuple) -> float | None:
        """Compute seconds the split saves a step of `shape` (None: not measured yet)."""
        return self._least("split", shape, lambda t: sum(t) - max(t))

    def stale(self, now: float | None = None) -> bool:
        return self.mode == "auto" and (now or time.monotonic()) - self.measured_at >= REFRESH_S

    def held_whole(self, head_bytes: int, n_shards: int) -> bool:
        """Whether the last worker should hold the whole head besides its
        share (decided at load, from the round trips measured before the
        upload): only where a step could ever take it whole, that is where one
        hop may cost more than the least the split saves, the head's bytes
        beyond one shard read at FASTEST_READ_BYTES_S. Gemma 3's 178 MB head
        over 2 workers saves at least 1.8 ms, far more than a loopback or LAN
        hop: the last worker neither holds nor uploads the other half."""
        if self.mode != "auto":
            return False
        hop = self.one_way()
        least_saved = head_bytes * (1 - 1 / max(n_shards, 1)) / FASTEST_READ_BYTES_S
        return hop is None or hop > least_saved

    # ------------------------------------------------------------ the choice
    def choose(self, shape: tuple, extra_hops: int, whole_possible: bool = True, here_possible: bool = False) -> str:
        """Where the head of a step of `shape` ((n_outputs, argmax)) runs, one of
        CHOICES. `extra_hops`: what the split costs on the path the step will
        take (1 linked, 2 relayed); `whole_possible`: the last worker holds the
        whole head; `here_possible`: this process holds the rows besides the
        last worker's share (whose normed rows reach it with the last stage's
        reply, at no extra hop linked; relayed, the last worker's share costs
        two more)."""
        hop, saved = self.one_way(), self.saved(shape)
        if self.mode != "auto":
            choice = "split" if self.mode == "here" and not here_possible else self.mode
        elif hop is None or saved is None:
            choice = "split"  # nothing to compare yet: the split step measures the head
        elif here_possible and self._least("here", shape, max) is None:
            choice = "here"  # measures this process's share
        else:
            here_hops = 0 if extra_hops == 1 else extra_hops
            costs = {"whole": self._least("split", shape, sum) if whole_possible else None,
                     "split": self._least("split", shape, max) + extra_hops * hop,
                     "here": self._least("here", shape, lambda t: max(t[0], t[1] + here_hops * hop))
                     if here_possible else None}
            choice = min((c for c in CHOICES if costs[c] is not None), key=lambda c: costs[c])
        self.steps[choice] += 1
        self._last_inputs = (hop, saved, extra_hops)
        if choice != self.choice:
            if self.choice is not None:
                self.changes += 1
            log.info("output head placement", head=choice, mode=self.mode, n_outputs=shape[0], greedy=shape[1],
                     one_way_ms=None if hop is None else round(hop * 1e3, 3),
                     saved_ms=None if saved is None else round(saved * 1e3, 3), extra_hops=extra_hops)
            self.choice = choice
        return choice

    def view(self) -> dict:
        """What the choice is and what it was made from (the server's /health, /cluster, /metrics)."""
        hop, saved, hops = self._last_inputs
        return {"mode": self.mode, "choice": self.choice, "one_way_seconds": hop, "saved_seconds": saved,
                "extra_hops": hops, "steps_split": self.steps["split"], "steps_whole": self.steps["whole"],
                "steps_here": self.steps["here"], "changes": self.changes, "whole_held": self.whole_held,
                "here_held": self.here_held,
                # copies taken at once: the server's threads read this while the loop thread records
                "rtt_seconds": {e: statistics.median(d) for e, d in
                                ((e, tuple(d)) for e, d in list(self._rtts.items())) if d}}
