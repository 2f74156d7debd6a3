"""A decode step over a tensor-parallel group: every member computes the group's
layers at once, each its shard (model/tensor_split.py), and the partial sums go
member to member over their tensor links (rpc_daemon/daemon/tensor_links.py).
The last group's members end in their rows of the output head, which come back
here and are put side by side as the head shards' are
(pipeline.Pipeline.combine_head); an earlier group's (a pipeline of groups,
Coordinator(tensor_group=)) end in the hidden state, the same on every member,
which the next group takes from the first member's reply (`chain`).

The group is linked before its first step and again after any failure or
reconnect (a member's new connection is a new session: its link is gone), and
after a step cancelled from outside before every member answered: its requests
are cancelled with it and every member's waits on the link ended
(TENSOR_CANCEL), so none is left to reach a member after the next step's.
A failure of one member cancels the others' waits on the link at once
(TENSOR_CANCEL), so a member blocked on a dead or stopped peer answers now;
the step reports the member that failed, never the peer that saw its link
close (docs/failure-semantics.md, "Tensor parallelism").
"""
from __future__ import annotations

import asyncio

import numpy as np

from coordinator.cluster.executors import TensorLinkFailed
from coordinator.cluster.failures import FailureKind, StageFailed
from coordinator.decode.step_io import (PreparedStep, checked_logits_off_loop, no_rows, read_output, stage_inputs,
                                        step_failed)
from coordinator.model.architectures.common import StepShape
from rpc_daemon.client import parse_endpoint

LINK_TIMEOUT = 10.0  # seconds the members' TENSOR_LINK join may take
# auto's probe (time_exchanges): computes of PROBE_EXCHANGES exchanges in a row, PROBE_GAP s apart for
# PROBE_WINDOW s (at least PROBE_REPS), each exchange waiting PROBE_TIMEOUT s at most for a peer; done
# after PROBE_SETTLE s where the fastest is steady (the last two within PROBE_STEADY times it)
PROBE_EXCHANGES, PROBE_REPS, PROBE_GAP, PROBE_WINDOW, PROBE_TIMEOUT = 16, 3, 0.02, 0.5, 5.0
PROBE_STEADY, PROBE_SETTLE = 1.5, 0.25


class TensorGroup:
    def __init__(self, pipeline, exchange_timeout: float, places: list | None = None):
        """`exchange_timeout`: the longest a member waits for a peer's partial (a failed peer's
        wait is cancelled sooner, as soon as this process knows of the failure). `places`: the
        members (default: every place of the pipeline)."""
        self.pipeline = pipeline
        self.exchange_timeout = exchange_timeout
        self.places = list(pipeline.places if places is None else places)
        self.link_id = 0
        self.linked_with: tuple | None = None  # the executors the current link joins
        self.step_no = 0
        self._cancels: set = set()  # TENSOR_CANCELs in flight (not awaited; held until they end)

    @property
    def last(self) -> bool:
        """The group ends in the output head (its members hold the last layer)."""
        return self.places[0].stage.last

    async def ensure_linked(self) -> None:
        """Link the members (again) unless the current link joins exactly their connections."""
        members = tuple(id(p.executor) for p in self.places)
        if members == self.linked_with:
            return
        self.linked_with = None
        self.link_id += 1
        link, places, n = self.link_id, self.places, len(self.places)
        listens = await self._on_all([p.executor.tensor_listen(link) for p in places])
        peers = [{"rank": j, "host": parse_endpoint(places[j].endpoint)[0], "port": listens[j]["port"],
                  "ticket": listens[j]["ticket"]} for j in range(n)]
        await self._on_all([p.executor.tensor_join(link, rank, n, peers[:rank], LINK_TIMEOUT)
                            for rank, p in enumerate(places)], weigh=_consequences_of_failed_ranks)
        self.linked_with = members
        stats = self.pipeline.stats
        stats["tensor_links"] = stats.get("tensor_links", 0) + 1

    async def time_exchanges(self, floats: int, enough: float = 0.0, count: int = PROBE_EXCHANGES) -> float:
        """What one exchange of `floats` f32 costs between the members, in seconds, timed on their
        link (auto's probe: RemoteExecutor.time_exchanges): the fastest of computes of `count`
        exchanges in a row, repeated PROBE_GAP apart for PROBE_WINDOW (at least PROBE_REPS): a
        member's first compute starts its daemon's next spare compute process, which takes the
        cores for 0.1-0.2 s (exchanges of 0.7-4 ms instead of 20 us on a 2-core VM), and a busy
        moment only ever adds time. The first exchange of a compute also waits for the member
        whose request came last; that member's time is the least of the group's and is taken:
        `count` exchanges at the pace of members in step, as a decode's are (its first finds the
        peer's partial there: the figure reads up to 1/count of a one-way delay low). Done sooner, after
        PROBE_SETTLE, once the fastest is `enough` seconds or less (more computes could only find it
        faster) and the last two came within PROBE_STEADY of it: the spare's start is over, and the
        figure is the link's (stopped as soon as the split paid, a tail of that start read 116 us
        for the 1.1B llama's 20)."""
        await self.ensure_linked()
        loop = asyncio.get_running_loop()
        started, times = loop.time(), []

        def settled() -> bool:
            best = min(times)
            return (best <= enough and max(times[-2:]) <= PROBE_STEADY * best
                    and loop.time() - started >= PROBE_SETTLE)

        while len(times) < PROBE_REPS or not (settled() or loop.time() - started >= PROBE_WINDOW):
            if times:
                await asyncio.sleep(PROBE_GAP)
            self.step_no += 1
            spent = await self._on_all([p.executor.time_exchanges(self.link_id, self.step_no, floats, count,
                                                                  PROBE_TIMEOUT) for p in self.places])
            times.append(min(spent) / count)
        return min(times)

    async def _on_all(self, coros, weigh=None) -> list:
        """One request per member, all at once; each one's result in member order. The moment one
        fails the others' waits on the link (a join, or an exchange) are cancelled (TENSOR_CANCEL),
        then every request is awaited (each within its own bounds) and the failures raised as one
        StepFailed: a member that failed itself before one that only saw its link close. `weigh`:
        the results (in rank order) with the failures that are consequences of others' made
        TensorLinkFailed. Cancelled from outside, it leaves no request running on its own (_abandon)."""
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(c) for c in coros]
        try:
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            if pending:
                self._cancel_waits()
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException:  # cancelled from outside (adecode's caller, a closing coordinator)
            self._abandon(tasks)
            raise
        if weigh is not None:
            results = weigh(results)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            self.linked_with = None  # the link is down on some member: linked again before the next step
            failures.sort(key=lambda exc: isinstance(exc, TensorLinkFailed))
            raise step_failed(failures)
        return results

    def _cancel_waits(self) -> None:
        """TENSOR_CANCEL to every member, not awaited (held until it ends): each one's wait on the
        current link (a join, an exchange) ends at once, and the link with it."""
        loop = asyncio.get_running_loop()
        for p in self.places:
            cancel = loop.create_task(p.executor.tensor_cancel(self.link_id))
            self._cancels.add(cancel)
            cancel.add_done_callback(self._cancels.discard)

    def _abandon(self, tasks: list) -> None:
        """The requests of a step (or join) whose caller was cancelled: none is left to run on its own.
        Left running, a member's request held up before it left (its step channel opening) would
        reach its compute process after the next step's, and the members would exchange partials
        of different steps; and a member that had the step would wait for a peer that never gets
        it. So the requests not ended are cancelled (their late replies dropped), every member's
        waits on the link are ended (TENSOR_CANCEL), and the group is linked again before its next
        step. A step every member had answered keeps its link. Every request's failure is
        retrieved here: nobody else awaits them."""
        if all(t.done() and not t.cancelled() and t.exception() is None for t in tasks):
            return
        self.linked_with = None
        running = [t for t in tasks if not t.done()]
        for t in tasks:
            t.add_done_callback(_retrieve)  # an ended one's at once, a running one's when its cancel lands
        for t in running:
            t.cancel()
        if running:
            self._cancel_waits()

    def prepare(self, tokens, rows, tok_pos, tok_seq, out_rows, greedy: bool, normed: bool = False) -> PreparedStep:
        n = len(tokens)
        wanted = len(out_rows) > 0
        if not wanted:  # a graph cannot have 0 output rows: one is computed and dropped
            out_rows = np.array([n - 1], dtype=np.int32)
        kv = self.pipeline.kv
        n_kv = kv.n_kv()
        mask, mask_swa = kv.masks(n_kv, tok_pos, tok_seq)
        shape = StepShape(n, n_kv, len(out_rows), 0 if normed else int(greedy), normed=normed)
        return PreparedStep(tokens, rows, tok_pos, tok_seq, out_rows, wanted, False, shape,
                            self.pipeline.common_inputs(tok_pos, rows, mask, mask_swa), mask, mask_swa)

    async def step(self, step: PreparedStep, hidden=None) -> np.ndarray:
        """The step's result from this group, the last (`hidden`: the group before's output)."""
        results = await self.run(step.common, step.tokens, step.out_rows, step.shape, hidden)
        hp = self.pipeline.hp
        if not step.wanted:
            return no_rows(step.shape, hp.n_vocab)
        if step.shape.normed:  # every member computed the same normed rows: the first's
            normed = read_output(self.places[0], results[0], step.shape).hidden
            return await checked_logits_off_loop(normed.reshape(step.shape.n_outputs, hp.n_embd),
                                                 self.places[0].endpoint)
        return await self.pipeline.combine_head(self.places, results, step.shape)

    async def run(self, common: dict, tokens, out_rows, shape: StepShape, hidden=None) -> list[bytes]:
        """One step on every member at once: each member's reply (its head rows' output, or the
        hidden state). `hidden`: the group before's output (None for the first group)."""
        await self.ensure_linked()
        self.step_no += 1
        # exact sums' pieces are gathered where every member can (else summed padded: the same bits)
        tensor = {"link": self.link_id, "step": self.step_no, "timeout": self.exchange_timeout,
                  "gather": all(p.executor.tensor_gather for p in self.places)}
        requests = []  # every request built before any is sent: they leave back to back
        try:
            for p in self.places:
                requests.append(p.executor.step_request(p.stage, shape, stage_inputs(p, common, tokens, hidden,
                                                                                     out_rows), tensor=tensor))
        except Exception as exc:  # nothing sent: no member waits on the link for this step
            for p, request in zip(self.places, requests):
                p.executor.drop_request(request)
            raise step_failed([exc]) from None
        return await self._on_all([p.executor.send_step(r) for p, r in zip(self.places, requests)])

    async def hidden(self, common: dict, tokens, out_rows, shape: StepShape, hidden=None) -> np.ndarray:
        """A group before the last: its output hidden state (every member's is the same: the first's)."""
        results = await self.run(common, tokens, out_rows, shape, hidden)
        return read_output(self.places[0], results[0], shape).hidden


def _retrieve(task: asyncio.Task) -> None:
    """An abandoned request's end: its failure, if any, taken (nobody awaits it)."""
    if not task.cancelled():
        task.exception()


def _consequences_of_failed_ranks(results: list) -> list:
    """The joins' results (rank order), a member's failure made a consequence of others' (TensorLinkFailed:
    reported only if nothing else is, not latched) when it concerns only members that failed too (their
    listeners closed as their joins ended: its connection refused or cut) and does not stand alone: one
    of them failed by itself, or another member failed without blaming a peer (its connection lost).
    In a group of 3 or more, rank 1's connection lost in its join can fail rank 2's connection to rank 1,
    or to rank 0 whose join the coordinator cancelled meanwhile; rank 2 is not latched. A member that
    could not connect to a peer that only saw the join cancelled (a firewall between two members), or
    two failures that name each other, stand."""
    failed = {rank for rank, r in enumerate(results) if isinstance(r, BaseException)}
    own = {rank for rank in failed if isinstance(results[rank], StageFailed)
           and not isinstance(results[rank], TensorLinkFailed)}
    blamed = {rank: getattr(results[rank], "unlinked", None) or [] for rank in own}
    root_elsewhere = {rank for rank in own if not blamed[rank]}  # a lost connection, a failure of its own
    weighed = list(results)
    for rank in own:
        unlinked = blamed[rank]
        if not unlinked or not all(r != rank and r in failed and rank not in blamed.get(r, ()) for r in unlinked):
            continue
        if any(r in own for r in unlinked) or root_elsewhere - {rank}:
            failure = results[rank]
            weighed[rank] = TensorLinkFailed(FailureKind.COMPUTE, failure.endpoint,
                                             f"{failure.message} (after rank(s) {unlinked} failed their own join)")
    return weighed


async def chain(groups: list, step: PreparedStep) -> np.ndarray:
    """A step through a pipeline of tensor-parallel groups, one after another."""
    hidden = None
    for group in groups[:-1]:
        hidden = await group.hidden(step.common, step.tokens, step.out_rows, step.shape, hidden)
    return await groups[-1].step(step, hidden)


async def replay(groups: list, steps: list) -> None:
    """Journal steps again through `groups` (the first ones of the pipeline), in order, each
    step through them one after another (their KV rows rewritten)."""
    for step in steps:
        mask, mask_swa = step.masks()
        common = groups[0].pipeline.common_inputs(step.pos, step.rows, mask, mask_swa)
        hidden = None
        for group in groups:
            if group.last:
                await group.run(common, step.tokens, step.out_rows, step.shape, hidden)
            else:
                hidden = await group.hidden(common, step.tokens, step.out_rows, step.shape, hidden)
