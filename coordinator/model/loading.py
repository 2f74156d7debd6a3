"""Putting a model on the workers: connect, plan the split (layers, head rows)
from what each worker reports free, build the stages, upload; and the same
for one endpoint when it is reconnected or a spare takes its stage
(docs/architecture.md, "Splitting the layers").
"""
from __future__ import annotations

import asyncio
import os
import time

import structlog

from coordinator.cluster.endpoints import EndpointSet, Place
from coordinator.cluster.failures import EndpointUnavailable, StageFailed
from coordinator.decode.step_io import StepFailed
from coordinator.cluster.executors import buffer_bytes, make_executor, peer_failed
from coordinator.decode.head_placement import HeadPlacement
from coordinator.decode.pipeline import Pipeline
from coordinator.model.architectures.common import head_source
from coordinator.model.layer_timing import layer_seconds
from coordinator.model.split_plan import (DoesNotFit, compute_reserve, endpoint_free, fit_split, human, in_pages,
                                          plan_rows, plan_split, split_weights)
from coordinator.model.stage import KV_TYPES, Stage
from coordinator.model.tensor_split import TensorSplitError, plan_shards
from rpc_daemon.service.memory import available_memory

log = structlog.get_logger("coordinator")

# auto charges each exchange what the members' own link takes for one (TensorGroup.time_exchanges:
# compute process to compute process, as decode's), or where longer the path's one-way delay as the
# members' PINGs to each other's daemons see it, less PING_PASSAGE: what a PING's passage through two
# daemons' event loops costs beyond the path itself (loopback, a 2-core VM: PING round trips of
# 40-82 us, where the link's exchanges take 12-34 us). The PINGs stand for a delay in front of the
# daemons' ports that the links' own ports do not pass (a proxy, a tunnel); on a plain network the
# link's own time is the larger.
PING_PASSAGE = 100e-6
# the least auto charges an exchange without timing the link: where even this much leaves the split no gain
# (a tiny model), no link is made (bench/bench_exchange.py's mechanics: 12-17 us on 2-core VMs)
FASTEST_EXCHANGE = 5e-6
# auto: PINGs one member sends another back to back (TENSOR_LINK rtt), the fastest taken: the path's
# own delay between awake processes (the first may wake a sleeping daemon)
RTT_PINGS = 5
FALLBACK_BANDWIDTH = 5e9  # bytes/s a worker thread reads, if a layer cannot be timed (a 1.1B Q4_K_M token: ~5e9)
# auto takes the tensor split where a token's exchanges cost less than this share of the layer compute
# it saves. Measured against the real thing (gemma3-270m, 2 workers on a 2-core VM): 18 layers of
# 0.63-0.75 ms (layer_timing.py) saving half of each, about 6.5 ms, less 1.0-1.4 ms of exchanges said
# 5.2-5.5 ms a token, where tensor decoded 6.0 ms a token faster than layer in the same run (the work every member
# repeats costs less than the layer split's hop between its workers): the figures need no margin.
TENSOR_PAYS = 1.0


def exchanges_per_token(n_layer: int, exact: bool) -> int:
    """A token's exchanges in the tensor split: two a layer (four with exact sums), and the embedding's."""
    return (4 if exact else 2) * n_layer + 1


def tensor_trade(n_layer: int, layer_s: float, exchange_s: float, group_weights,
                 exact: bool = False) -> tuple[float, float]:
    """What the tensor split costs and saves a token, in seconds: (its exchanges, the layer compute
    saved against the layer split). Either way a token passes all n_layer layers one after another;
    split over a group, a layer takes the largest member's share of its time, and costs two
    exchanges of `exchange_s` each (four with `exact` sums; and the embedding's rows one). With a
    pipeline of groups each group runs its own layers as one group would, so neither figure
    depends on the number of groups (`group_weights`: one group's members' shares)."""
    cost = exchanges_per_token(n_layer, exact) * exchange_s
    saved = n_layer * layer_s * (1 - max(group_weights) / sum(group_weights))
    return cost, saved


class ModelLoader:
    def __init__(self, gguf, arch, hp, n_ctx: int, n_batch: int, threads: int, executor_options: dict,
                 head: HeadPlacement, kv_types: tuple = ("f16", "f16"), exact_sums: bool | None = None):
        """`executor_options`: every remote executor's keywords (timeouts, secret, TLS, digests);
        `kv_types`: the KV cache's K and V types (stage.KV_TYPES' names); `exact_sums`: a tensor
        split gathers whole inputs instead of all-reducing partial sums (model/tensor_split.py):
        True insists, False never, None where the model and the workers allow it (settle_sums)."""
        self.sums_asked = exact_sums
        self.exact_sums = bool(exact_sums)  # as settled for the tensor split (settle_sums)
        self.sums_reason: str | None = None  # why exact sums were not taken where they were not insisted on
        self.gguf, self.arch, self.hp = gguf, arch, hp
        self.kv_types = tuple(KV_TYPES[t] for t in kv_types)
        self.n_ctx, self.n_batch, self.threads = n_ctx, n_batch, threads
        self.executor_options, self.head = executor_options, head
        # how the split mode was settled (tensor_choice): what was asked and, for auto, the figures
        # it compared; Coordinator.health() reports it
        self.split_choice: dict = {"asked": "layer"}
        self._probed: list | None = None  # the groups auto's probe linked (_time_exchanges)

    def new_executor(self, endpoint: str):
        return make_executor(endpoint, self.threads, **self.executor_options)

    def stage(self, index: int, layers: range, head_rows: range, whole_head: bool) -> Stage:
        return Stage.create(index, self.arch, self.hp, self.gguf, layers, self.hp.n_layer, self.n_ctx, head_rows,
                            whole_head, self.kv_types)

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
                   on_upload, split_mode: str = "layer", exchange_timeout: float = 600.0,
                   tensor_group: int | None = None) -> None:
        """Connect every endpoint, plan the split, build the stages and upload
        their weights. `head_shards`: the stages hold shares of the output head.
        `split_mode`: "layer", "tensor" or "auto" (tensor_choice); `tensor_group`: the
        members of each tensor-parallel group (None: one group of all)."""
        places, head = endpoints.places, self.head
        self.split_choice = {"asked": split_mode, "chosen": "layer"}
        infos = await endpoints.open_all(self.new_executor)
        weights = split_weights(split, infos, len(places))
        if split_mode != "layer" and await self.tensor_choice(places, weights, split_mode, pipeline,
                                                              tensor_group or len(places), infos):
            await self._load_tensor(endpoints, pipeline, infos, weights, progress, on_upload, exchange_timeout,
                                    tensor_group or len(places))
            return
        reserve = compute_reserve(self.hp, self.n_batch, self.n_ctx)

        def plan(whole_head: bool):
            def need(index: int, layers: range, head_rows) -> int:
                return in_pages(buffer_bytes(self.stage(index, layers, head_rows, whole_head)), infos[index]) + reserve

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

    # ------------------------------------------------------------ tensor parallelism
    async def tensor_choice(self, places: list, weights: list, mode: str, pipeline: Pipeline,
                            group_size: int, infos: list) -> bool:
        """Whether the places form tensor-parallel groups of `group_size`: "tensor" insists (a
        ValueError says why it cannot), "auto" takes it where the 1 + 2 x n_layer exchanges of a
        token (4 x n_layer with exact sums, settled first), each as long as the members' link takes
        for one (timed on it: _time_exchanges) or the path's one-way delay as their PINGs see it,
        whichever is longer, cost less than TENSOR_PAYS of the layer compute the split saves, as
        timed here (layer_timing.py). Where the path's delay alone costs more, no link is made."""
        self._probed = None
        self.settle_sums(places, weights, group_size)
        why = self._tensor_refusal(places, weights, group_size)
        if why is not None:
            if mode == "tensor":
                raise ValueError(f"split_mode='tensor': {why}")
            log.info("layer split: tensor parallelism is not possible here", reason=why)
            self.split_choice = {"asked": mode, "chosen": "layer", "reason": why}
            return False
        if mode == "tensor":
            self.split_choice = {"asked": mode, "chosen": "tensor", **self._sums()}
            return True
        rtt, measured_by = await self._exchange_rtt(places, group_size)
        threads = min(max(1, int(info.get("threads") or 1)) for info in infos)
        per_worker = sum(len(self.gguf.tensor_data(n)) for n in self.gguf.tensors) // len(places)
        try:
            layer = await layer_seconds(self.arch, self.hp, self.gguf, min(threads, os.cpu_count() or 1), per_worker)
        except Exception as exc:  # an estimate must not stop the start: the bytes at memory speed instead
            layer = self.gguf.layer_bytes / self.hp.n_layer / FALLBACK_BANDWIDTH
            log.warning("could not time a layer here; estimating it from its bytes", error=str(exc))
        # the coordinator's own PINGs say nothing of the path between the members: not charged
        path = max(0.0, rtt / 2 - PING_PASSAGE) if measured_by == "workers" else 0.0
        exchange, why = max(path, FASTEST_EXCHANGE), None
        figures = {"slowest_rtt_ms": round(rtt * 1e3, 3), "rtt_measured_by": measured_by,
                   "path_one_way_us": round(path * 1e6, 1), "layer_ms": round(layer * 1e3, 3),
                   "timed_threads": threads}
        _, saved = tensor_trade(self.hp.n_layer, layer, exchange, weights[:group_size], self.exact_sums)
        n_exchanges = exchanges_per_token(self.hp.n_layer, self.exact_sums)
        if exchange * n_exchanges < saved * TENSOR_PAYS:  # the path alone leaves room: the link's exchanges decide
            timed, why = await self._time_exchanges(places, group_size, pipeline, saved * TENSOR_PAYS / n_exchanges)
            if timed is not None:
                figures["link_exchange_us"] = round(timed * 1e6, 1)
                exchange = max(exchange, timed)
        cost = exchange * n_exchanges
        chosen = why is None and cost < saved * TENSOR_PAYS
        if not chosen and self._probed:  # the probe's links are not used: ended on every member (moot where none)
            await asyncio.gather(*(p.executor.tensor_cancel(g.link_id) for g in self._probed for p in g.places))
            self._probed = None
        figures.update({"exchange_us": round(exchange * 1e6, 1), "exchanges_ms_per_token": round(cost * 1e3, 2),
                        "compute_saved_ms_per_token": round(saved * 1e3, 2)})
        self.split_choice = {"asked": mode, "chosen": "tensor" if chosen else "layer", **figures,
                             **({"reason": why} if why else {}), **(self._sums() if chosen else {})}
        log.info("split mode chosen by measurement", split_mode=self.split_choice["chosen"], **figures,
                 **({"reason": why} if why else {}))
        return chosen

    async def _time_exchanges(self, places: list, group_size: int, pipeline: Pipeline, enough: float) -> tuple:
        """(an exchange's seconds on the slowest group's link, None) as its members time it
        (TensorGroup.time_exchanges, all groups at once, each done once it finds `enough` seconds or
        less: the tensor split pays), the groups kept for the load to link again;
        or (None, why) where a group cannot link or exchange (the tensor split could not run: the
        layer split is taken; a member that cannot reach its peer's listener, say). A member whose
        connection is lost meanwhile fails the start."""
        from coordinator.decode.tensor_group import TensorGroup

        groups = [TensorGroup(pipeline, 0.0, places[i: i + group_size]) for i in range(0, len(places), group_size)]
        self._probed = groups  # their links ended if the layer split is taken (tensor_choice)
        timed = await asyncio.gather(*(g.time_exchanges(self.hp.n_embd, enough) for g in groups), return_exceptions=True)
        failed = next((exc for exc in timed if isinstance(exc, BaseException)), None)
        if failed is None:
            return max(timed), None
        if not isinstance(failed, StepFailed):
            raise failed
        if not isinstance(failed.reported, StageFailed):  # a bug of ours, not the link's
            raise failed.reported
        for p in places:  # a lost connection fails the start, as it would in the upload (a join that
            # could not link fails as kind `endpoint`, a connection's kind too: the connections decide)
            if p.executor.client.failed is not None:
                lost = peer_failed(p.endpoint, p.executor.client.failed)
                raise EndpointUnavailable(lost.endpoint, lost.cause, lost.message) from None
        log.warning("the tensor-parallel members could not exchange on their link: layer split", error=str(failed))
        return None, f"the members could not exchange over a tensor link: {failed}"

    def _sums(self) -> dict:
        if self.exact_sums:
            return {"sums": "exact"}
        return {"sums": "split", **({"sums_reason": self.sums_reason} if self.sums_reason else {})}

    def settle_sums(self, places: list, weights: list, group_size: int) -> None:
        """Exact sums where asked, or (not asked either way) where every member can gather them and
        the model's shards can be cut by rows; else split sums, and `sums_reason` says why."""
        self.sums_reason = None
        if self.sums_asked is not None:
            self.exact_sums = self.sums_asked
            return
        why = self._exact_refusal(places, weights, group_size)
        self.exact_sums, self.sums_reason = why is None, why

    def _tensor_refusal(self, places: list, weights: list, group_size: int) -> str | None:
        if len(places) < 2:
            return "it needs at least 2 endpoints"
        for p in places:
            if p.endpoint == "local":
                return "`local` cannot be a member of a tensor-parallel group (its exchanges need a worker)"
            if not getattr(p.executor, "tensor_links", False):
                return (f"worker {p.endpoint} does not offer tensor links (an older ggml-rpc-server, or one that "
                        f"serves TLS without --peer-tls-ca: it could not verify its peers' certificates)")
        if len(places) // group_size > self.hp.n_layer:
            return f"{len(places) // group_size} groups but the model has only {self.hp.n_layer} layers"
        if self.exact_sums:
            return self._exact_refusal(places, weights, group_size)
        return self._shard_refusal(len(places), weights, group_size, False)

    def _exact_refusal(self, places: list, weights: list, group_size: int) -> str | None:
        """Why exact sums cannot run here (a member without PAD, shards that rows cannot cut), or None."""
        for p in places:
            if not getattr(p.executor, "pad", False):
                return f"worker {p.endpoint} cannot gather exact sums (an older ggml-rpc-server: it does not take PAD)"
        return self._shard_refusal(len(places), weights, group_size, True)

    def _shard_refusal(self, n_places: int, weights: list, group_size: int, exact: bool) -> str | None:
        """Why the model's layers cannot be sharded over groups of `group_size` (plan_shards), or None."""
        types = {n: t.type for n, t in self.gguf.tensors.items()}
        try:
            for i in range(0, n_places, group_size):
                plan_shards(self.hp, types, weights[i: i + group_size], exact)
        except TensorSplitError as exc:
            return str(exc)
        return None

    async def _exchange_rtt(self, places: list, group_size: int) -> tuple[float, str]:
        """The slowest round trip between two members of a group, where the exchanges run: every
        member PINGs every other of its group over its own link to it (TENSOR_LINK rtt), at the
        address the coordinator names it by, the fastest of RTT_PINGS each way ("workers"); both
        ways, as an exchange goes both ways. Where a worker does not offer that, or cannot reach
        its peer, this process's PINGs to the workers stand in (_slowest_rtt; "coordinator"):
        right where the coordinator sits beside the workers, not where it is far from two that
        are near each other."""
        pairs = [(places[g + i], places[g + j]) for g in range(0, len(places), group_size)
                 for i in range(group_size) for j in range(group_size) if i != j]
        measured = await asyncio.gather(*(p.executor.peer_round_trips(q.endpoint, RTT_PINGS) for p, q in pairs))
        if all(rtts for rtts in measured):
            return max(min(rtts) for rtts in measured), "workers"
        return await self._slowest_rtt(places), "coordinator"

    async def _slowest_rtt(self, places: list) -> float:
        """The slowest worker's round trip, each worker's the fastest of 3 bursts of 3 PINGs, 5 ms
        apart: the path's own delay between awake processes, as the exchanges see it (their
        compute processes wait awake), not a busy moment's nor a sleeping daemon's wake-up (on
        loopback a PING 5 ms after the last took 0.13-0.63 ms, one right after it 0.11)."""
        async def fastest(p):
            rtts = []
            for burst in range(3):
                if burst:
                    await asyncio.sleep(0.005)
                for _ in range(3):
                    rtts.append(await p.executor.ping())
            rtts = [r for r in rtts if r is not None]
            return min(rtts) if rtts else float("inf")
        return max(await asyncio.gather(*(fastest(p) for p in places)))

    async def _load_tensor(self, endpoints: EndpointSet, pipeline: Pipeline, infos: list, weights: list,
                           progress: bool, on_upload, exchange_timeout: float, group_size: int) -> None:
        """The places as tensor-parallel groups of `group_size` (in endpoint order), the groups
        holding consecutive layer ranges in proportion to their members' weights: each member its
        shard of its group's layers, the last group's its share of the head's rows; memory checked
        before any upload (exact sums not insisted on give way to split sums where only those
        fit); the members of each group linked."""
        from coordinator.decode.tensor_group import TensorGroup
        places, n = endpoints.places, group_size
        members = [list(range(i, i + n)) for i in range(0, len(places), n)]
        short, plan = self._plan_tensor(places, infos, weights, members)
        if (short and self.exact_sums and self.sums_asked is None
                and self._shard_refusal(len(places), weights, n, False) is None):
            why = ("exact sums' gathered inputs do not fit the workers' free memory (" + "; ".join(short)
                   + "): split sums")
            self.exact_sums, self.sums_reason = False, why
            self.split_choice.update(self._sums())
            short, plan = self._plan_tensor(places, infos, weights, members)
        if short:
            raise DoesNotFit("the model does not fit the workers' free memory in tensor-parallel shards: "
                             + "; ".join(short))
        self.head.mode = "split"  # every member of the last group ends in its rows of the head
        pipeline.groups = [TensorGroup(pipeline, exchange_timeout, [places[i] for i in m]) for m in members]
        for group, probed in zip(pipeline.groups, self._probed or ()):
            group.link_id = probed.link_id  # linked again after the upload, numbered on from auto's probe
        self._probed = None
        await endpoints.load_all(self.gguf, progress, on_upload)
        linked = await asyncio.gather(*(group.ensure_linked() for group in pipeline.groups), return_exceptions=True)
        failed = next((exc for exc in linked if isinstance(exc, BaseException)), None)
        if failed is not None:
            if not isinstance(failed, StepFailed):
                raise failed
            failure = failed.reported
            if isinstance(failure, StageFailed):
                raise EndpointUnavailable(failure.endpoint, failure.cause, failure.message) from None
            raise failure from None
        log.info("tensor-parallel split: every member holds a shard of its group's layers", groups=len(members),
                 **self._sums(), members=plan)

    def _plan_tensor(self, places: list, infos: list, weights: list, members: list) -> tuple[list, list]:
        """Each place's layers and tensor-parallel stage (groups of `members`, with the sums settled):
        (what does not fit each worker's free memory, the plan as logged)."""
        hp = self.hp
        types = {name: t.type for name, t in self.gguf.tensors.items()}
        group_layers = plan_split(hp.n_layer, [sum(weights[i] for i in m) for m in members])
        short, plan = [], []
        for g, (indices, layers) in enumerate(zip(members, group_layers)):
            w = [weights[i] for i in indices]
            shards = plan_shards(hp, types, w, self.exact_sums)
            # the vocabulary's rows in proportion: of the head (last group), of the embedding (first group);
            # one group holds the same rows of both, so a tied head is a view of its embedding rows
            rows_each = plan_rows(hp.n_vocab, w)
            heads = rows_each if layers.stop == hp.n_layer else [None] * len(indices)
            embds = rows_each if layers.start == 0 else [None] * len(indices)
            for i, shard, rows, embd_rows in zip(indices, shards, heads, embds):
                p = places[i]
                p.layers = layers
                p.stage = Stage.tensor_member(i, self.arch, hp, self.gguf, shard, self.n_ctx, rows, self.kv_types,
                                              layers, g, embd_rows, shards)
                # its shard's heads and FFN rows; with exact sums it holds the whole gathered inputs too
                reserve = compute_reserve(hp if self.exact_sums else p.stage.hp, self.n_batch, self.n_ctx)
                need, free = in_pages(buffer_bytes(p.stage), infos[i]) + reserve, endpoint_free(infos[i])
                if free is not None and need > free:
                    short.append(f"{p.endpoint}: its shard needs {human(need)}, {human(free)} free")
                plan.append({"endpoint": p.endpoint, "group": g, "layers": [layers.start, layers.stop],
                             "heads": [shard.heads.start, shard.heads.stop],
                             "kv_heads": [shard.kv_heads.start, shard.kv_heads.stop],
                             "kv_replicated": shard.replicated_kv, "ffn": [shard.ffn.start, shard.ffn.stop],
                             "head_rows": None if rows is None else [rows.start, rows.stop],
                             "embd_rows": None if embd_rows is None else [embd_rows.start, embd_rows.stop],
                             **({} if shard.out is None else {"out_rows": [shard.out.start, shard.out.stop]})})
        return short, plan

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
