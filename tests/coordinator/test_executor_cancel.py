"""RemoteExecutor cut short: a step cancelled while it frees the graphs its request evicted
leaves none of them held on the worker, and steps asking for the step channel while it is
being opened share that one opening (one channel for all, whatever becomes of one caller).
Real daemons on 127.0.0.1."""
from __future__ import annotations

import asyncio
import gc
import pathlib
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from conftest import SLACK, free_port  # noqa: E402
from coordinator.api import Batch, Coordinator, DecodeResult  # noqa: E402
from coordinator.cluster.executors import StepRequest  # noqa: E402
from rpc_daemon.client import RpcError  # noqa: E402
from rpc_daemon.wire.protocol import Command, Status  # noqa: E402
from rpc_helpers import metric  # noqa: E402
from tiny_models import write_tiny_model  # noqa: E402

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "llama.gguf", "llama")


def compute_bytes(port: int) -> float:
    return metric(port, "ggml_rpc_compute_bytes")


def test_a_step_cancelled_while_it_frees_evicted_graphs_frees_them_all(model, start_daemon):
    """send_step frees the graphs its request evicted, one GRAPH_FREE after another, before its
    compute. Cancelled right after the first free went out, the others were forgotten as sent
    all the same and never freed: the worker held them, and their compute memory, for the rest
    of the session. Now every one is freed: the worker knows none of them (NOT_FOUND), and its
    compute process soon holds the compute memory of the one graph it still runs, no more, with
    no compute in between (a GRAPH_FREE read while the daemon passes an earlier one on to the
    compute process is passed on by another sync, not left for the client's next compute). A
    second free of a graph already freed is harmless (answered with success, nothing latched)."""
    port = free_port()
    d = start_daemon("-t", "1", "--metrics-port", str(port))
    with Coordinator([d.endpoint], model=model, n_ctx=64) as c:
        p = c._places[0]
        ex = p.executor

        def decode(n: int) -> None:
            c.kv_clear()
            assert c.decode(Batch.single(list(range(10, 10 + n)), 0)) == DecodeResult.OK, c.last_error

        decode(4)
        (kept,) = p.stage.graphs.values()
        alone = compute_bytes(port)  # the compute memory of `kept` alone
        assert alone > 0
        for n in (1, 2, 3):  # 3 more step shapes: 3 more graphs held on the worker
            decode(n)
        evicted = [g for g in p.stage.graphs.values() if g is not kept]
        assert len(evicted) == 3 and all(g.graph_id in ex.sent_graphs for g in evicted + [kept])
        assert compute_bytes(port) > alone
        fields, blob = ex._compute_fields(kept, {})
        request = StepRequest(kept, evicted, fields, blob, 0, None)  # `kept`'s step, which evicted the others

        async def cancel_after_the_first_free():
            step = asyncio.ensure_future(ex.send_step(request))
            await asyncio.sleep(0)  # the step ran up to its first GRAPH_FREE's reply
            waiting = not step.done() and not ex.sent_graphs & {g.graph_id for g in evicted}
            step.cancel()
            await asyncio.wait([step])
            return waiting, step.cancelled()

        async def held(graph_id: int) -> bool:
            """Whether the worker holds the graph: a recompute without its inputs is refused as
            such (INVALID_REQUEST), one of a graph it does not hold NOT_FOUND."""
            try:
                await ex.client.request(Command.GRAPH_RECOMPUTE, {"graph_id": graph_id, "inputs": [], "outputs": [0]},
                                        deadline=5 * SLACK)
            except RpcError as exc:
                return exc.status != Status.NOT_FOUND
            return True

        assert c._io.run(cancel_after_the_first_free()) == (True, True)
        deadline = time.monotonic() + 2 * SLACK
        while any(c._io.run(held(g.graph_id)) for g in evicted) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [c._io.run(held(g.graph_id)) for g in evicted] == [False] * 3  # every evicted graph freed
        while compute_bytes(port) != alone and time.monotonic() < deadline:
            time.sleep(0.02)
        assert compute_bytes(port) == alone  # and its compute memory returned, without another compute

        async def free_again():
            reply, _ = await ex._request(Command.GRAPH_FREE, {"graph_id": evicted[0].graph_id})
            await ex._free_quietly(evicted[1].graph_id)
            return reply.get("status", Status.SUCCESS)

        assert c._io.run(free_again()) == Status.SUCCESS  # a graph it does not hold: no error
        assert ex.client.failed is None and c.failed_endpoints() == []
        decode(4)  # `kept` again: its compute tells the compute process of the frees
        assert compute_bytes(port) == alone


def test_steps_asking_for_the_step_channel_at_once_share_one_opening(model, start_daemon):
    """Two steps of one connection ask for its step channel at once. The second used to get
    None while the first one's was being opened, and went through the daemon while the first
    went over the channel once open: two steps of one connection could reach the compute process
    out of order. Both wait for the one opening and get the same channel (one STEP_CHANNEL)."""
    d = start_daemon("-t", "1")
    with Coordinator([d.endpoint], model=model, n_ctx=64) as c:
        ex = c._places[0].executor
        assert ex.channel is None and ex.channel_next_ask == 0.0  # not asked for yet (no tensor step)

        async def both():
            return await asyncio.wait_for(asyncio.gather(ex._step_channel(), ex._step_channel()), 10 * SLACK)

        first, second = c._io.run(both())
        assert first is not None and second is first and ex.channel is first
        d.wait_log("step channel up")
        assert sum("step channel up" in line for line in d.log_lines) == 1
        assert c._io.run(ex._step_channel()) is first


def test_a_step_cancelled_while_the_channel_opens_leaves_it_opening_for_the_others(model, start_daemon):
    """Of two steps waiting for the step channel to open, the first is cancelled: the opening
    goes on, and the second gets the channel."""
    d = start_daemon("-t", "1")
    with Coordinator([d.endpoint], model=model, n_ctx=64) as c:
        ex = c._places[0].executor

        async def first_cancelled():
            a = asyncio.ensure_future(ex._step_channel())
            b = asyncio.ensure_future(ex._step_channel())
            await asyncio.sleep(0)  # both wait: STEP_CHANNEL is out
            a.cancel()
            got = await asyncio.wait_for(b, 10 * SLACK)
            await asyncio.wait([a])
            return a.cancelled(), got

        cancelled, got = c._io.run(first_cancelled())
        assert cancelled and got is not None and ex.channel is got


def test_a_channel_dropped_while_it_opens_is_none_for_every_waiter(model, start_daemon):
    """The connection's channel dropped (as when it closes or is replaced) while it is being
    opened: each waiting step gets None (their steps go through the daemon), and no channel is
    set afterwards by the opening it ended; nothing is left unretrieved."""
    d = start_daemon("-t", "1")
    with Coordinator([d.endpoint], model=model, n_ctx=64) as c:
        ex = c._places[0].executor
        unretrieved: list = []
        c._io.loop.set_exception_handler(lambda loop, context: unretrieved.append(context.get("message")))

        async def dropped():
            waiters = [asyncio.ensure_future(ex._step_channel()) for _ in range(2)]
            await asyncio.sleep(0)
            ex._drop_channel()
            got = await asyncio.wait_for(asyncio.gather(*waiters), 10 * SLACK)
            await asyncio.sleep(0.3)  # an opening left running would have connected by now
            return got

        assert c._io.run(dropped()) == [None, None]
        assert ex.channel is None
        gc.collect()
        c._io.run(asyncio.sleep(0.05))
        assert unretrieved == [], unretrieved
