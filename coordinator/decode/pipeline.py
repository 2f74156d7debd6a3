"""One decode step through the stages: the forward pass (stage after stage,
the hidden state coming back here between them) and, with the output head
split, the head round (every endpoint's share at once); or, when every
worker offers step links, the same step with its activations going worker to
worker (coordinator/decode/step_links.py), chosen per step. Each step that
succeeds is recorded in the KV journal when there is one, and `replay` runs
journal steps again to rebuild a lost KV cache (coordinator/decode/resume.py).

It touches no latch: a failure is raised as StepFailed, naming the failure the
decode reports and every endpoint whose connection failed, for the caller to
latch. docs/architecture.md, "A decode step", has the data flow.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

from coordinator.cluster.failures import StageFailed
from coordinator.decode import step_links, tensor_group
from coordinator.decode.flow import FlowFailed, flow
from coordinator.decode.head_placement import HeadPlacement
from coordinator.decode.kv_cells import KVCells
from coordinator.decode.step_io import (PreparedStep, StepFailed, checked_logits, checked_logits_off_loop,
                                        checked_tokens, no_rows, off_loop_from, ranked, read_output, side_by_side,
                                        stage_inputs, step_failed)
from coordinator.model.architectures.common import HParams, StepShape
from coordinator.model.stage import StageOutput

REPLAY_AHEAD = 4  # replayed steps a stage may run ahead of the next one (hidden states held)


async def _run_on(p, common: dict, tokens, hidden, out_rows, shape: StepShape) -> StageOutput:
    """Stage `p` computed once: its inputs sent, its reply read back."""
    inputs = stage_inputs(p, common, tokens, hidden, out_rows)
    return read_output(p, await p.executor.run(p.stage, shape, inputs), shape)


async def _failures_as_step_failed(coro):
    try:
        return await coro
    except StageFailed as exc:
        raise StepFailed(exc, [exc] if exc.lost_connection else []) from None
    except (StepFailed, asyncio.CancelledError):
        raise
    except Exception as exc:  # a bug of ours: the decode reports it, never raises it
        raise StepFailed(exc, []) from exc


class Pipeline:
    def __init__(self, places: list, hp: HParams, kv: KVCells, head_shards: bool, journal=None,
                 links: bool = True, stats: dict | None = None, head_placement: HeadPlacement | None = None):
        """`head_shards`: the stages hold shares of the output head; `head_placement`
        chooses, step by step, whether a step uses them or the last stage's
        whole head (coordinator/decode/head_placement.py; None: always the shards).
        `journal` (a StepJournal, or None): every step that succeeds is
        recorded there, for rebuilding a lost KV cache by replay. `links`: a
        step whose workers all offer step links sends its activations worker
        to worker (coordinator/decode/step_links.py); else they come back here."""
        self.places, self.hp, self.kv, self.head_shards, self.journal = places, hp, kv, head_shards, journal
        self.here = None  # a Place in this process holding the rows besides the last stage's share, if any
        self.head_placement = (head_placement if head_placement is not None
                               else HeadPlacement("split" if head_shards else "whole"))
        self._pinging: set = set()  # round-trip measurements in flight (held until they end)
        self.links = links
        self.links_paused_until = 0.0  # relayed until then, after a failed push (pause_links)
        self.stats = stats if stats is not None else {}  # counts "linked_steps" (the rest were relayed)
        # TensorGroups (decode/tensor_group.py) when the places are tensor-parallel groups, one after another
        self.groups: list = []
        self._unconfirmed: set = set()  # linked requests whose step ended before their reply (held until it comes)
        self._late: list = []  # (place, its executor then, failure) of those that failed: the next step reports them

    def unconfirmed(self, p, request: asyncio.Task) -> None:
        """A linked request of place `p` whose step ended before its reply, which
        only confirms that its push arrived (step_links.py). If it fails (the
        worker was lost after its push), the next step reports that failure,
        unless `p` has reconnected since (a new executor)."""
        executor = p.executor
        self._unconfirmed.add(request)

        def ended(task: asyncio.Task) -> None:
            self._unconfirmed.discard(task)
            if not task.cancelled() and task.exception() is not None:
                self._late.append((p, executor, task.exception()))
        request.add_done_callback(ended)

    def report_late(self) -> None:
        """Raise StepFailed for the unconfirmed requests that failed since the
        last step, if their worker's connection is still the one they used."""
        late, self._late = [exc for p, executor, exc in self._late if p.executor is executor], []
        if late:
            raise step_failed(late)

    @property
    def n_stages(self) -> int:
        """The stages a step goes through one after another: the places, or the tensor-parallel groups."""
        return len(self.groups) if self.groups else len(self.places)

    def flow_stages(self, steps: list[PreparedStep]) -> list:
        """Prepared steps (micro-batches) as flow.py's stages: each place (or tensor-parallel group) in
        turn, each taking the one before's output; the last stage's output is the step's result."""
        if self.groups:
            def group_stage(group):
                if group is self.groups[-1]:
                    return lambda i, hidden: group.step(steps[i], hidden)
                return lambda i, hidden: group.hidden(steps[i].common, steps[i].tokens, steps[i].out_rows,
                                                      steps[i].shape, hidden)
            return [group_stage(group) for group in self.groups]

        def on(p):
            return lambda i, out: self.run_stage(p, steps[i], None if out is None else out.hidden)
        return [on(p) for p in self.places] + [lambda i, out: self.finish(steps[i], out)]

    def pause_links(self, seconds: float) -> None:
        """Relay every step for `seconds` (a worker could not push to its next hop)."""
        self.links_paused_until = time.monotonic() + seconds

    async def step(self, tokens, rows: np.ndarray, tok_pos: np.ndarray, tok_seq: np.ndarray,
                   out_rows: np.ndarray, greedy: bool, normed: bool = False) -> np.ndarray:
        """The logits of the rows `out_rows` lists (f32[n_outputs, n_vocab]), or
        with `greedy` their argmax tokens (i32[n_outputs]), or with `normed` their
        final hidden states, normalized (f32[n_outputs, n_embd]); the KV rows
        `rows` written on every worker. Raises StepFailed."""
        self.report_late()
        return await _failures_as_step_failed(self._step(tokens, rows, tok_pos, tok_seq, out_rows, greedy, normed))

    async def replay(self, steps: list, through: int) -> None:
        """Journal steps (kv_journal.JournalStep) again, in order, as they were
        first decoded, through the stages 0..`through` only: their KV rows are
        rewritten (the stages after keep theirs); no head round. The stages
        work as a pipeline (flow.py): stage k replays step i while
        stage k-1 replays step i+1, each taking the steps in order, as its KV
        rows need. Raises StepFailed; after the first failure no stage starts
        another step, and the requests in flight end before it is raised."""
        if self.groups:  # every member of a group holds a shard of its layers: the whole group replays
            upto = next(i for i, g in enumerate(self.groups) if self.places[through] in g.places)
            await _failures_as_step_failed(tensor_group.replay(self.groups[: upto + 1], steps))
            return
        places = self.places[: through + 1]

        def replay_on(p):
            async def replay_one(i: int, carried):
                step = steps[i]
                if carried is None:  # the first stage: the inputs common to every stage
                    mask, mask_swa = step.masks()
                    common, hidden = self.common_inputs(step.pos, step.rows, mask, mask_swa), None
                else:
                    common, hidden = carried
                out = await _run_on(p, common, step.tokens, hidden, step.out_rows, step.shape)
                return common, out.hidden
            return replay_one

        try:
            await flow(len(steps), [replay_on(p) for p in places], ahead=REPLAY_AHEAD)
        except FlowFailed as failed:
            raise step_failed(failed.errors) from None

    def common_inputs(self, tok_pos, rows, mask, mask_swa) -> dict:
        common = {"positions": tok_pos.astype(np.int32), "kv_rows": rows.astype(np.int64), "mask": mask}
        if self.hp.n_swa:
            common["mask_swa"] = mask_swa
        return common

    async def _forward(self, step: PreparedStep) -> StageOutput:
        """The stages one after another; the last one's output."""
        hidden = out = None
        for p in self.places:
            out = await self.run_stage(p, step, hidden)
            hidden = out.hidden
        return out

    def prepare(self, tokens, rows, tok_pos, tok_seq, out_rows, greedy: bool, relayed: bool = False,
                normed: bool = False) -> PreparedStep:
        """A step's inputs, fixed now: n_kv and the masks from the KV table as
        it is (the step's own rows assigned, those of later steps not yet);
        and where its head runs (`relayed`: it will not go over step links)."""
        if self.groups:  # tensor-parallel: every member of the last group ends in its head rows
            return self.groups[0].prepare(tokens, rows, tok_pos, tok_seq, out_rows, greedy, normed)
        n = len(tokens)
        wanted = len(out_rows) > 0
        if not wanted:  # a graph cannot have 0 output rows: the last stage computes one, dropped in finish
            out_rows = np.array([n - 1], dtype=np.int32)
        head = self._place_head(len(out_rows), greedy, relayed) if wanted and not normed else "whole"
        if not self.head_shards:
            head = "whole"  # the stages hold no shares (the placement's mode is "whole" then)
        n_kv = self.kv.n_kv()
        mask, mask_swa = self.kv.masks(n_kv, tok_pos, tok_seq)
        shape = StepShape(n, n_kv, len(out_rows), 0 if normed else int(greedy),
                          head_on_last=wanted and self.head_shards and head == "whole" and not normed, normed=normed)
        return PreparedStep(tokens, rows, tok_pos, tok_seq, out_rows, wanted, head != "whole", shape,
                            self.common_inputs(tok_pos, rows, mask, mask_swa), mask, mask_swa, self._head_places(head))

    def _head_places(self, head: str) -> tuple:
        """The places whose shares compute a step's head placed `head`."""
        if head == "split":
            return tuple(p for p in self.places if len(p.stage.head_rows))
        if head == "here":
            return self.here, self.places[-1]
        return ()

    def _place_head(self, n_outputs: int, greedy: bool, relayed: bool) -> str:
        """The placement's choice for a step (only a last stage that holds the whole head can take it whole;
        only a coordinator that holds the other rows, with a last worker that can reply with its normed
        rows while it pushes them to its own share, can take a share itself)."""
        if self.head_placement.stale():
            self.head_placement.measured_at = time.monotonic()
            task = asyncio.get_running_loop().create_task(self.measure_rtts(pings=1))
            self._pinging.add(task)  # not awaited: the step does not wait for it
            task.add_done_callback(self._pinging.discard)
        linked = self.links and not relayed and step_links.usable(self)
        last = self.places[-1]
        here = self.here is not None and (not linked or last.executor.step_reply_output)
        return self.head_placement.choose((n_outputs, greedy), 1 if linked else 2,
                                     whole_possible=last.stage.holds_whole_head, here_possible=here)

    async def measure_rtts(self, pings: int = 3) -> None:
        """PING every connected worker `pings` times (one after another), all
        workers at once; each round trip into the placement's estimate. A
        worker that does not answer is its requests' to report, not this."""
        async def one(p):
            for _ in range(pings if p.executor is not None and p.failure is None else 0):
                rtt = await p.executor.ping()
                if rtt is None:
                    return
                self.head_placement.record_rtt(p.endpoint, rtt)

        await asyncio.gather(*(one(p) for p in self.places))
        self.head_placement.keep_only({p.endpoint for p in self.places})

    async def run_stage(self, p, step: PreparedStep, hidden) -> StageOutput:
        """Stage `p` of `step`, given the hidden state from the stage before (None for the first)."""
        return await _run_on(p, step.common, step.tokens, hidden, step.out_rows, step.shape)

    async def finish(self, step: PreparedStep, out: StageOutput) -> np.ndarray:
        """The step's result from the last stage's output: the head round (head
        split), or the last stage's logits or tokens, checked."""
        greedy = step.shape.argmax
        if not step.wanted:  # the KV rows are written; no head round for rows nobody wants
            return no_rows(step.shape, self.hp.n_vocab)
        if step.shape.normed:
            return await checked_logits_off_loop(out.hidden.reshape(step.shape.n_outputs, self.hp.n_embd),
                                                 self.places[-1].endpoint)
        if step.head_in_shares:
            return await self._head(out.hidden, step.shape, step.head_places)
        last = self.places[-1].endpoint
        if greedy:
            checked_logits(out.probes, last)
            tokens = checked_tokens(out.tokens, self.hp.n_vocab, last)
            if greedy > 1:
                return ranked(tokens, [checked_tokens(out.best_ids, self.hp.n_vocab, last)], [out.best_values], greedy)
            return tokens
        return await checked_logits_off_loop(out.logits, last)

    def record(self, step: PreparedStep) -> None:
        """A step that succeeded, into the journal (if any)."""
        if self.journal is not None:
            self.journal.record(step.tokens, step.rows, step.pos, step.seqs, step.out_rows, step.shape.argmax,
                                step.shape.n_kv, step.mask, step.mask_swa if self.hp.n_swa else None,
                                lambda: self.kv.pos >= 0)

    async def _step(self, tokens, rows, tok_pos, tok_seq, out_rows, greedy, normed=False) -> np.ndarray:
        if self.groups:
            step = self.prepare(tokens, rows, tok_pos, tok_seq, out_rows, greedy, normed=normed)
            result = await tensor_group.chain(self.groups, step)
            self.record(step)
            return result
        step = self.prepare(tokens, rows, tok_pos, tok_seq, out_rows, greedy, normed=normed)
        result = await self._linked(step)
        if result is not None:
            result = result[0]
        else:
            out = await self._forward(step)
            result = await self.finish(step, out)
        self.record(step)
        return result

    async def linked(self, steps: list[PreparedStep]) -> list[np.ndarray] | None:
        """`steps` (a decode's micro-batches, in order) over step links, if
        every worker offers them (None: they must be relayed). Raises StepFailed."""
        return await _failures_as_step_failed(self._linked(*steps))

    async def _linked(self, *steps: PreparedStep) -> list[np.ndarray] | None:
        """The steps over step links when every worker offers them, each one's
        result; None: relay them."""
        if self.groups or not (self.links and step_links.usable(self)):  # (groups: relayed, chain or flow)
            return None
        heads = [list(step.head_places) for step in steps]
        linked = await step_links.run(self, list(zip(steps, heads)))
        if linked is None:
            return None
        self.stats["linked_steps"] = self.stats.get("linked_steps", 0) + len(steps)
        results = []
        for step, head_places, (out, head_results) in zip(steps, heads, linked):
            if head_places:
                self._timed_head(head_places, step.shape)
                results.append(await self.combine_head(head_places, head_results, step.shape))
            else:  # no head round: the last stage's output, or nothing wanted
                results.append(await self.finish(step, out))
        return results

    async def _head(self, normed: np.ndarray, shape: StepShape, places: tuple) -> np.ndarray:
        """The shares of the output head (`places`') at once; then the logits
        side by side, or (greedy) each row's token from the shard whose best
        logit is highest (the first such shard: the lowest id, as argmax)."""
        inputs = {"head_in": normed}
        # every shard's request runs to its end (or failure): none is left in flight past this decode
        results = await asyncio.gather(*(p.executor.run(p.stage, shape, inputs, head=True) for p in places),
                                       return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise step_failed(failures)
        self._timed_head(places, shape)
        return await self.combine_head(places, results, shape)

    def _timed_head(self, places, shape: StepShape) -> None:
        """The shards' compute times of a head round, into the placement's estimate."""
        key = shape.head_key
        here = any(p is self.here for p in places)
        self.head_placement.record_head(key, [p.executor.head_seconds.get(key) for p in places],
                                   "here" if here else "split")

    async def combine_head(self, places: list, results: list, shape: StepShape) -> np.ndarray:
        """The head shards' replies (in `places` order) as one result. Logits from
        step_io.OFF_LOOP floats are checked and put side by side on a thread of their
        own (the event loop serves every other connection meanwhile); the failure
        raised is the same either way: the first shard's (in `places` order) that fails."""
        if shape.argmax:
            best, value, best_ids, best_values = [], [], [], []
            for p, data in zip(places, results):
                out, r = read_output(p, data, shape, head=True), p.stage.head_rows
                checked_logits(out.probes, p.endpoint)
                best.append(checked_tokens(out.tokens, len(r), p.endpoint) + r.start)
                value.append(out.best)
                if out.best_ids is not None:
                    best_ids.append(checked_tokens(out.best_ids, len(r), p.endpoint) + r.start)
                    best_values.append(out.best_values)
            winner = np.argmax(np.stack(value), axis=0)
            tokens = np.stack(best)[winner, np.arange(shape.n_outputs)].astype(np.int32)
            return ranked(tokens, best_ids, best_values, shape.argmax) if shape.argmax > 1 else tokens
        shards = []  # each place's endpoint and rows read here, on the loop: the thread touches no place
        for p, data in zip(places, results):
            try:
                shards.append((p.endpoint, p.stage.head_rows, read_output(p, data, shape, head=True).logits))
            except Exception as exc:  # raised in its turn, after the shards before it are checked
                shards.append((p.endpoint, None, exc))
        n = shape.n_outputs * self.hp.n_vocab
        return await off_loop_from(n, side_by_side, shape.n_outputs, self.hp.n_vocab, shards)
