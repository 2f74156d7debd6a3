"""Putting a model on the workers: connect, plan the split (layers, head rows)
from what each worker reports free, build the stages, upload; and the same
for one endpoint when it is reconnected or a spare takes its stage
(docs/architecture.md, "Splitting the layers").
"""
from __future__ import annotations

import asyncio
import time

import structlog

from coordinator.cluster.endpoints import EndpointSet, Place
from coordinator.cluster.executors import buffer_bytes, make_executor
from coordinator.decode.head_placement import HeadPlacement
from coordinator.decode.pipeline import Pipeline
from coordinator.model.architectures.common import head_source
from coordinator.model.split_plan import PAGE, DoesNotFit, compute_reserve, endpoint_free, fit_split, split_weights
from coordinator.model.stage import Stage
from rpc_daemon.service.memory import available_memory

log = structlog.get_logger("coordinator")


class ModelLoader:
    def __init__(self, gguf, arch, hp, n_ctx: int, n_batch: int, threads: int, executor_options: dict,
                 head: HeadPlacement):
        """`executor_options`: every remote executor's keywords (timeouts, secret, TLS, digests)."""
        self.gguf, self.arch, self.hp = gguf, arch, hp
        self.n_ctx, self.n_batch, self.threads = n_ctx, n_batch, threads
        self.executor_options, self.head = executor_options, head

    def new_executor(self, endpoint: str):
        return make_executor(endpoint, self.threads, **self.executor_options)

    def stage(self, index: int, layers: range, head_rows: range, whole_head: bool) -> Stage:
        return Stage.create(index, self.arch, self.hp, self.gguf, layers, self.hp.n_layer, self.n_ctx, head_rows,
                            whole_head)

    async def connect(self, p: Place, endpoint: str):
        """A new connection to `endpoint` (`p`'s, or a spare's) with `p`'s stage's weights (reconnect)."""
        self.head.forget(endpoint)  # measured again (head_placement.REFRESH_S) over the new connection
        ex = self.new_executor(endpoint)
        try:
            await ex.open()
            await ex.load(p.stage, self.gguf)
        except BaseException:
            await ex.close()
            raise
        return ex

    async def load(self, endpoints: EndpointSet, pipeline: Pipeline, split, head_shards: bool, progress: bool,
                   on_upload) -> None:
        """Connect every endpoint, plan the split, build the stages and upload
        their weights. `head_shards`: the stages hold shares of the output head."""
        places, head = endpoints.places, self.head
        infos = await endpoints.open_all(self.new_executor)
        weights = split_weights(split, infos, len(places))
        reserve = compute_reserve(self.hp, self.n_batch, self.n_ctx)

        def plan(whole_head: bool):
            def need(index: int, layers: range, head_rows) -> int:
                return -(-buffer_bytes(self.stage(index, layers, head_rows, whole_head)) // PAGE) * PAGE + reserve

            # checked against each worker's free memory before anything is uploaded (DoesNotFit); the whole
            # head besides is taken only where the layers stay as they would be without it
            return fit_split([p.endpoint for p in places], [endpoint_free(i) for i in infos], self.hp.n_layer,
                             self.hp.n_vocab, weights, head_shards, split is not None or whole_head, need)

        whole_head = False  # the last stage holds the whole head besides the shards (auto, where it may win)
        if head.mode == "auto":
            await pipeline.measure_rtts()
            head_bytes = len(self.gguf.tensor_data(head_source(self.gguf.tensors)))
            whole_head = head.held_whole(head_bytes, len(places))
            if not whole_head:
                log.info("the last worker holds only its share of the output head: a hop costs less than the "
                         "least the split saves", one_way_ms=round(head.one_way() * 1e3, 3))
        try:
            layer_plan, heads = plan(whole_head)
        except DoesNotFit as exc:
            if not whole_head:
                raise
            log.info("the last worker has no room for the whole output head besides the layers: the head stays "
                     "split", reason=str(exc))
            head.mode, whole_head = "split", False
            layer_plan, heads = plan(whole_head)
        head.whole_held = whole_head
        for index, (p, layers, head_rows) in enumerate(zip(places, layer_plan, heads)):
            p.layers = layers
            p.stage = self.stage(index, layers, head_rows, whole_head)
        uploads = endpoints.load_all(self.gguf, progress, on_upload)
        if whole_head or head.mode == "here":  # a far last worker: a step may take its share plus one here
            # copied here while the workers upload; both end before a failure of either is raised
            for outcome in await asyncio.gather(uploads, self._hold_head_here(places[-1], pipeline),
                                                return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
        else:
            await uploads
        if head.mode == "auto":
            await pipeline.measure_rtts(pings=1)  # one more round trip each, now the uploads are done
            head.measured_at = time.monotonic()

    async def _hold_head_here(self, last: Place, pipeline: Pipeline) -> None:
        """Hold in this process the output head's rows besides the last
        worker's share (head_placement.py, "here"): a step can then have the
        last worker compute its share while this process computes the rest
        from the normed rows the last stage replies with, which costs the
        split's compute without the split's extra hop."""
        rows = last.stage.head_rows
        if not rows or not rows.start or rows.stop != self.hp.n_vocab:
            return  # no share on the last worker, or nothing besides it
        stage = Stage.head_share(self.arch, self.hp, self.gguf, range(0, rows.start))
        need, available = buffer_bytes(stage), available_memory()
        if need > available // 2:  # the rows are an optimization: never worth crowding this machine
            log.warning("the coordinator does not hold the output head's other rows: they need more than half "
                        "of its available memory", need_mib=need >> 20, available_mib=available >> 20)
            return
        here = Place("local", range(0), executor=make_executor("local", self.threads), stage=stage)
        try:
            await here.executor.open()
            await here.executor.load(here.stage, self.gguf)
        except BaseException:
            await here.executor.close()
            raise
        pipeline.here, self.head.here_held = here, True
