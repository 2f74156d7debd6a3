"""A step whose activations go worker to worker (docs/protocol.md, "Step
links"; docs/architecture.md, "A decode step").

Every request of the step leaves at once: stage 0 gets the tokens, stage k > 0
waits on its worker for the hidden state stage k-1 pushes there, and with the
head split every head shard waits for the normed state the last stage pushes
to all of them. Only the last stage's (or the shards') results come back here:
N + 1 one-way hops for N workers (N + 2 with the head split), not 2N + 2. With
the head placed "here" (head_placement.py) the last stage pushes its normed
state to its own share only and replies with it too, and this process
computes the other rows from that reply: N + 1 hops for the split's compute.

Failures keep the relayed path's meaning. Each request stays on its own
worker's connection, with that connection's liveness and deadline, so a dead
worker fails its own requests and is reported as itself. A worker that cannot
push (its next hop is unreachable from it) answers with the bytes and which
pushes failed; they are relayed here over the destination's own connection.
When any request fails, the step's other waits are cancelled at once
(STEP_INPUT `cancel`): they end with INPUT_MISSING, a consequence reported only
when nothing else failed.

A stage that pushed answers once its push is acknowledged. The step does not
wait for those answers once its outputs are in (the outputs prove every push
arrived): that saves a one-way delay per token behind slow links. A worker lost
after its push is then reported by the next decode (Pipeline.unconfirmed).
"""
from __future__ import annotations

import asyncio
import itertools
import time

import structlog

from coordinator.cluster.executors import InputMissing, NotLinked
from coordinator.cluster.failures import StageFailed
from coordinator.decode.step_io import StepFailed, read_output, stage_inputs, step_failed
from coordinator.decode.values import FailureKind

log = structlog.get_logger("coordinator")

RELAY_AFTER_FAILED_PUSH = 30.0  # seconds of relayed steps after a worker could not push to its next hop
_tags = itertools.count(1)  # step input tags: unique per coordinator process, so per session too
_background: set = set()  # cancellations in flight (held so they are not collected before they end)


def usable(pipe) -> bool:
    """Every stage's worker offers step links (a protocol-2 daemon of this
    version, not `local`, and not a TLS worker without --peer-tls-ca), and no
    push failed lately (a firewall between workers would cost every step a
    failed push before the relay)."""
    return (len(pipe.places) > 1 and time.monotonic() >= pipe.links_paused_until
            and all(p.executor is not None and p.executor.step_links for p in pipe.places))


async def _share_here(p, last_place, last_stage: asyncio.Task, shape) -> tuple[dict, bytes]:
    """This process's share of a step's head (`p`, pipe.here), from the normed
    rows the last stage replies with (reply_output); (reply, blob) as a worker's."""
    await asyncio.wait([last_stage])  # not `await`: cancelling this must not cancel the last stage's request
    if last_stage.cancelled() or last_stage.exception() is not None:
        raise InputMissing(FailureKind.COMPUTE, p.endpoint, "no normed rows for this process's share of the "
                                                            "output head: the last stage failed")
    normed = read_output(last_place, last_stage.result()[1], shape).hidden
    return {}, await p.executor.run(p.stage, shape, {"head_in": normed}, head=True)


def _destination(p, tag: int) -> dict:
    return {"to": p.endpoint, "token": p.executor.step_token, "tag": tag}


def _send_all(pipe, steps: list, plans: list, jobs: list, waits: list, acks: set) -> None:
    """Every request of the linked steps, sent at once (each connection's in
    step order), into `jobs` (place, task, destinations) and, for those that
    wait for an input, `waits` (place, tag, task), as they are sent; `acks`:
    the requests whose reply only confirms their push (every stage's but the last)."""
    places = pipe.places
    last = len(places) - 1
    for (step, head_places), (stage_tags, head_tags, targets) in zip(steps, plans):
        for k, p in enumerate(places):
            inputs = stage_inputs(p, step.common, step.tokens, None, step.out_rows)
            inputs.pop("hidden", None)  # it comes from stage k-1's worker
            timeout = p.executor.request_timeout or 900.0
            step_input = ("hidden", stage_tags[k], timeout) if k else None
            dests = [_destination(q, tag) for q, tag in targets[k]]
            # this process's share of the head takes the normed rows from the last stage's reply
            reply_output = k == last and None in head_tags
            jobs.append((p, p.executor.send_linked(p.stage, step.shape, inputs, False, step_input, dests,
                                                   reply_output), targets[k]))
            if k < last:
                acks.add(jobs[-1][1])
            if k:
                waits.append((p, stage_tags[k], jobs[-1][1]))
        last_stage = jobs[-1][1]
        for p, tag in zip(head_places, head_tags):
            if tag is None:
                jobs.append((p, asyncio.get_running_loop().create_task(
                    _share_here(p, places[last], last_stage, step.shape)), []))
                continue
            step_input = ("head_in", tag, p.executor.request_timeout or 900.0)
            jobs.append((p, p.executor.send_linked(p.stage, step.shape, {}, True, step_input, []), []))
            waits.append((p, tag, jobs[-1][1]))


async def run(pipe, steps: list) -> list | None:
    """Linked steps through `pipe.places` (a Pipeline), one after another on
    every worker: `steps` lists (PreparedStep, its head shards (empty: no head
    round)), the micro-batches of one decode in order.
    Every request of every step is sent at once, each connection's in step
    order, so no worker waits for the coordinator between them. Returns per
    step (the last stage's output, or None when it went to the head shards;
    the shards' reply blobs), or None when the steps must run on the relayed
    path instead. Raises StepFailed (the failures in step order)."""
    places = pipe.places
    last = len(places) - 1
    if not places[last].executor.step_reply_output and any(
            q is pipe.here for _, head_places in steps for q in head_places):
        return None  # placed here for the relayed path (links were paused then): its last stage cannot reply
    plans = []  # per step: (stage tags, head tags (None: this process's share), per stage its destinations)
    for _, head_places in steps:
        stage_tags = [None] + [next(_tags) for _ in places[1:]]
        head_tags = [None if q is pipe.here else next(_tags) for q in head_places]
        plans.append((stage_tags, head_tags,
                      [[(places[k + 1], stage_tags[k + 1])] if k < last else
                       [(q, tag) for q, tag in zip(head_places, head_tags) if tag is not None]
                       for k in range(len(places))]))
    # the last stage names every head shard whether a step's head is split or not, so a head
    # placement that changes between steps (head_placement.py) costs no STEP_PEERS round trip
    shards = frozenset(p.endpoint for p in places if pipe.head_shards and len(p.stage.head_rows))
    try:
        # a round trip only when a connection's peers change (its first linked step)
        await asyncio.gather(*(p.executor.name_peers(
            frozenset(q.endpoint for _, _, targets in plans for q, _ in targets[k])
            | (shards if k == last else frozenset())) for k, p in enumerate(places)))
    except StageFailed as exc:
        raise StepFailed(exc, [exc] if exc.lost_connection else []) from None

    jobs = []  # (place, task, destinations); per connection in send order: step by step, its stage then its shard
    waits = []  # (place, tag, task): every request that waits for an input
    relays: list[asyncio.Task] = []
    refused: list[BaseException] = []  # relays refused (a lost destination fails its own requests instead)
    acks: set = set()  # requests whose reply only says their push arrived: the step need not wait for them
    cancelled = False
    finished = False  # the step's outputs are in: a reply that comes later changes nothing here

    def cancel_waits() -> None:
        """Every request of the step still waiting for its input stops waiting (the
        step failed, or was cancelled from outside): on every path that ends the
        step before its requests did."""
        nonlocal cancelled
        if cancelled:
            return
        cancelled = True
        for p, tag, request in waits:
            if request.done() and not request.cancelled() and request.exception() is None:
                continue  # it took its input: nothing to end (an older worker would keep a mark for ever)
            task = asyncio.get_running_loop().create_task(p.executor.cancel_input(tag))
            _background.add(task)  # not awaited: a stopped worker's would take its liveness bound
            task.add_done_callback(_background.discard)

    try:
        _send_all(pipe, steps, plans, jobs, waits, acks)
    except BaseException:  # a bug of ours half way: what was sent must not wait for what never comes
        cancel_waits()
        for _, task, _ in jobs:
            task.cancel()
        raise

    def settled(job) -> None:
        p, task, dests = job
        if task.cancelled() or finished:  # (an unconfirmed request's failure: Pipeline.unconfirmed)
            return
        if task.exception() is not None:
            cancel_waits()
            return
        reply, out = task.result()
        if cancelled:  # the step failed elsewhere: nothing waits for these bytes
            return
        for index, why in reply.get("forward_failed") or ():  # the worker could not push: relay it
            q, tag = dests[index]
            log.warning("a worker could not push to the next; relaying its steps for a while", worker=p.endpoint,
                        to=q.endpoint, error=why, relay_s=RELAY_AFTER_FAILED_PUSH)
            pipe.pause_links(RELAY_AFTER_FAILED_PUSH)
            relay = asyncio.get_running_loop().create_task(q.executor.deliver(q.executor.step_token, tag, bytes(out)))
            relay.add_done_callback(relay_settled)
            relays.append(relay)

    def relay_settled(relay) -> None:
        # a refused relay leaves its destination's request waiting for an input nobody will send
        if relay.cancelled() or relay.exception() is None:
            return
        exc = relay.exception()
        if not (isinstance(exc, StageFailed) and exc.lost_connection):
            refused.append(exc)
        cancel_waits()

    for job in jobs:
        job[1].add_done_callback(lambda _t, job=job: settled(job))
    pending = {task for _, task, _ in jobs}
    pushes_to = {task: {q.endpoint for q, _ in dests} for _, task, dests in jobs}
    lost: set[str] = set()
    try:
        while pending:  # every request ends (or fails) within its own connection's bounds
            if pending <= acks and not cancelled:
                # every output is in, so every push arrived: what is left are the earlier stages' replies,
                # which only confirm that. The step ends without them (they come one one-way delay after
                # the last stage's compute, or never from a worker lost since); a failure among them is the
                # next decode's to report (Pipeline.unconfirmed)
                break
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            lost |= {t.exception().endpoint for t in done if not t.cancelled() and isinstance(t.exception(), StageFailed)
                     and t.exception().lost_connection}
            # a request that pushes to a lost worker is given up (its late reply dropped, its connection kept):
            # its answer waits for the push, which a stopped worker holds for the peer link's own bound
            given_up = {t for t in pending if pushes_to[t] & lost}
            for task in given_up:
                task.cancel()
            if given_up:
                await asyncio.gather(*given_up, return_exceptions=True)
                pending -= given_up
    except asyncio.CancelledError:
        cancel_waits()
        for _, task, _ in jobs:
            task.cancel()
        raise
    await asyncio.gather(*relays, return_exceptions=True)  # a lost destination shows as its own requests' failure
    finished = True
    for p, task, _ in jobs:
        if task in pending:
            pipe.unconfirmed(p, task)

    failures = [task.exception() for _, task, _ in jobs
                if task.done() and not task.cancelled() and task.exception() is not None]
    failures += refused
    if any(isinstance(exc, NotLinked) for exc in failures):
        cancel_waits()
        return None
    if failures:  # a wait that ended for want of its input is reported only if nothing else failed
        raise step_failed([exc for exc in failures if not isinstance(exc, InputMissing)]
                          + [exc for exc in failures if isinstance(exc, InputMissing)])
    results = [task.result() if task.done() else None for _, task, _ in jobs]  # (an unconfirmed stage's: unused)
    outputs = []
    for step, head_places in steps:  # each step's replies: its stages', then its shards'
        mine, results = results[:len(places) + len(head_places)], results[len(places) + len(head_places):]
        outputs.append((None if head_places else read_output(places[last], mine[last][1], step.shape),
                        [blob for _, blob in mine[len(places):]]))
    return outputs
