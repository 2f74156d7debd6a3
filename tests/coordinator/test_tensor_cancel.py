"""A tensor-parallel decode cancelled from outside (adecode under task.cancel())
just as its requests go out leaves nothing half done (docs/failure-semantics.md,
"Tensor parallelism"): the next decode succeeds with the same bits, the link
rebuilt if the cancel cut it, nobody latched, no exception left unretrieved, and
nothing waits longer than its reason. Real daemons on 127.0.0.1."""
from __future__ import annotations

import asyncio
import gc
import pathlib
import socket
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import SLACK  # noqa: E402
from coordinator.api import Batch, Coordinator, DecodeResult  # noqa: E402
from rpc_daemon.wire.protocol import Command, Status  # noqa: E402
from rpc_helpers import raw_session  # noqa: E402
from tiny_models import write_tiny_model  # noqa: E402

pytestmark = pytest.mark.system

PROMPT = "the capital of france is paris and the capital of"


def test_a_tensor_step_cancelled_as_its_requests_go_out_leaves_the_next_one_whole(tmp_path, start_daemon):
    """Member A's steps go through its daemon (it offers no step channel); member B asks for its
    channel at its first recompute, so B's request of that step waits for the channel to open
    while A's is already on its way. The step is cancelled right then, and the next one sent
    at once. Were the cancelled step's requests left running on their own, B's would reach
    B's compute process over the channel after the next step's had gone through B's daemon:
    A and B exchanging partials of different steps, the next decode failing COMPUTE_FAILED
    ("tensor link 1 is not set up in this compute process") and each request's failure logged
    as a task exception never retrieved."""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama")
    a = start_daemon("-t", "1", "--test-older", "step_channel")
    b = start_daemon("-t", "1")
    with Coordinator([a.endpoint, b.endpoint], model=model, n_ctx=64, split_mode="tensor") as c:
        toks = c.tokenize(PROMPT)
        batch = Batch.single(toks, 0, all_logits=True)
        assert c.decode(batch) == DecodeResult.OK, c.last_error  # the graphs sent: the same shape recomputes
        want = np.stack([c.logits(i) for i in range(len(toks))])
        links = c.stats["tensor_links"]
        c.kv_clear()
        b_executor = c._places[1].executor
        assert b_executor.channel is None and b_executor.channel_next_ask == 0.0  # B's channel not asked for yet
        unretrieved: list = []
        c._io.loop.set_exception_handler(lambda loop, context: unretrieved.append(context.get("message")))

        async def cancel_as_sent_then_decode():
            step = asyncio.ensure_future(c.adecode(batch))
            for _ in range(100_000):  # the step's requests leave: A's request, B's STEP_CHANNEL
                if b_executor.channel_next_ask:
                    break
                await asyncio.sleep(0)
            asked = b_executor.channel_next_ask != 0.0 and b_executor.channel is None
            step.cancel()
            await asyncio.wait([step])
            started = time.monotonic()
            code = await asyncio.wait_for(c.adecode(batch), 30 * SLACK)  # a hang guard, not the bound
            return asked, step.cancelled(), code, time.monotonic() - started

        asked, cancelled, code, took = c._io.run(cancel_as_sent_then_decode())
        assert asked and cancelled
        assert code == DecodeResult.OK, c.last_error
        assert took <= 2 * SLACK, took
        assert np.array_equal(np.stack([c.logits(i) for i in range(len(toks))]), want)
        assert c.failed_endpoints() == []
        assert c.stats["tensor_links"] == links + 1  # the cancel ended the link's waits: linked again
        c.kv_clear()
        assert c.decode(batch) == DecodeResult.OK, c.last_error
        assert np.array_equal(np.stack([c.logits(i) for i in range(len(toks))]), want)
        gc.collect()
        c._io.run(asyncio.sleep(0.1))
        gc.collect()
        assert unretrieved == [], unretrieved


def test_a_join_read_after_its_links_cancel_ends_at_once(start_daemon):
    """A TENSOR_CANCEL is answered as soon as it is read, so it can overtake the join it means:
    a decode cancelled while its members' joins are out sends one right behind them, and a
    daemon that read both at once, the join still queued, started the join after the cancel.
    The join is refused at once (cancelled), not left waiting its whole timeout for peers
    whose joins were cancelled too (which held the next decode's listen behind it on that
    connection: the next decode took the join's 10 s). The next link is served as usual."""
    d = start_daemon("-t", "1")
    a = raw_session(d)
    try:
        h, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": 9})
        assert h["status"] == 0, h
        h, _ = a.call(Command.TENSOR_CANCEL, {"link": 9})
        assert h["status"] == 0, h
        started = time.monotonic()
        h, _ = a.call(Command.TENSOR_LINK, {"op": "join", "link": 9, "rank": 0, "n": 2, "timeout": 20})
        assert h["status"] == Status.LINK_FAILED and h.get("cancelled") is True, h
        assert time.monotonic() - started < 2 * SLACK
        h, _ = a.call(Command.TENSOR_LINK, {"op": "listen", "link": 10})  # a new link: its join is not cancelled
        assert h["status"] == 0, h
        join_id = a.request(Command.TENSOR_LINK, {"op": "join", "link": 10, "rank": 0, "n": 2, "timeout": 20})
        a.sock.settimeout(0.3)
        with pytest.raises(socket.timeout):  # it waits for rank 1, which never comes
            a.recv_frame()
        a.sock.settimeout(10 * SLACK)
        cancel_id = a.request(Command.TENSOR_CANCEL, {"link": 10})
        replies = {h["id"]: h for h in (a.recv_frame()[0] for _ in range(2))}  # the cancel's at once, the join's
        assert replies[cancel_id]["status"] == 0, replies
        assert replies[join_id]["status"] == Status.LINK_FAILED and replies[join_id].get("cancelled") is True, replies
    finally:
        a.close()
