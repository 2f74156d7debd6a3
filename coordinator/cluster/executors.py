"""Where a stage runs: in this process (`local`), or on a worker daemon through
one dispatcher (an RpcClient) per connection. Both run the very same graphs
and offer the same contract, `Executor`; what only a worker can do (step
links, pings) the local one declines with neutral values.

Executors raise StageFailed; the coordinator turns it into a decode code.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import structlog

from coordinator.decode.values import FailureKind

from coordinator.cluster.failures import StageFailed
from ggml_ffi import NULL, CpuBackend, Gallocr, ffi, lib
from rpc_daemon.client import PeerFailed, RpcClient, RpcError, connect_step_channel, parse_endpoint
from rpc_daemon.request_window import RequestWindow
from rpc_daemon.service.memory import map_anonymous, munmap_anonymous
from rpc_daemon.wire.graph_codec import encode_graph
from rpc_daemon.wire import step_channel
from rpc_daemon.wire.protocol import Command, Status
from rpc_daemon.wire.tls import client_context

log = structlog.get_logger("coordinator")
CHANNEL_MARGIN = 5.0  # seconds beyond the worker's compute timeout a step-channel request may take
CHANNEL_ASK_AGAIN = 30.0  # seconds after a step channel was refused or taken back before it is asked for again

ALIGN = 64
UPLOAD_CHUNK = 4 << 20  # several chunks fit the upload window (rpc_daemon/request_window.py)
# the ops the model graphs (coordinator/models, stage.py) are built from; DEVICE_INFO lists a daemon's
GRAPH_OPS = ("ADD", "CONT", "CPY", "DIV", "FLASH_ATTN_EXT", "GET_ROWS", "GLU", "MUL", "MUL_MAT", "MUL_MAT_ID",
             "PERMUTE", "RESHAPE", "RMS_NORM", "ROPE", "SCALE", "SET_ROWS", "SOFT_MAX", "SUB", "SUM_ROWS", "TOP_K",
             "UNARY", "VIEW")
PROBE_SCALE = struct.pack("<f", 1.0)  # time_exchanges' nodes: SCALE by 1
CACHE_MIN_BYTES = 128 << 10  # below this sending the bytes costs less than hashing them and a look-up
# The in-process executors of a coordinator load at once, each on its own thread, and a weight two
# stages share (rope_freqs, a tied token_embd) must be placed by one of them: which tensors are still
# unplaced and placing them is one step. Two threads placing one tensor failed ggml's
# GGML_ASSERT(tensor->buffer == NULL) and aborted the process (Coordinator(["local", "local"]) of a
# llama 3.x model: 5 starts of 6).
_PLACING = threading.Lock()


def peer_failed(endpoint: str, exc: PeerFailed) -> StageFailed:
    return StageFailed(FailureKind.of(exc.kind), endpoint, exc.message)


def rpc_failed(endpoint: str, exc: RpcError, kind: FailureKind = FailureKind.COMPUTE) -> StageFailed:
    """A worker's error reply to a request that was to `kind` (COMPUTE, LOAD,
    ALLOC, or ENDPOINT: one a connection needs first)."""
    if exc.status == Status.ALLOC_FAILED:
        return StageFailed(FailureKind.ALLOC, endpoint, f"worker {endpoint} is out of memory: {exc.message}")
    if kind == FailureKind.COMPUTE:
        return StageFailed(kind, endpoint, f"compute failed on worker {endpoint}: {exc}")
    if kind == FailureKind.LOAD:
        return StageFailed(kind, endpoint, f"loading weights onto worker {endpoint} failed: {exc}")
    return StageFailed(kind, endpoint, f"worker {endpoint} refused the request: {exc}")


class InputMissing(StageFailed):
    """A linked step's request ended without its step input (INPUT_MISSING):
    cancelled after another stage failed, or never delivered. A consequence,
    reported only when the step has no other failure."""


class TensorLinkFailed(StageFailed):
    """A tensor-parallel member's exchange failed: its link to a peer closed, was cancelled or
    timed out. Reported only when no member failed itself (decode/tensor_group.py)."""


class NotLinked(Exception):
    """A linked step's graph was not cached on the worker (NOT_FOUND): the step
    runs again on the relayed path (rewriting the same KV rows)."""


@dataclass
class StepRequest:
    """A compute request built by RemoteExecutor.step_request, not yet sent."""
    graph: object  # the stage's BuiltGraph
    evicted: list  # graphs evicted from the stage's cache to make room: freed on the worker first
    fields: dict
    blob: bytes
    expect: int  # the reply's size
    head_key: tuple | None  # a head shard's StepShape.head_key (its compute time is kept)


def _count_when_done(task, nbytes: int, progress) -> None:
    """Advance the progress bar by `nbytes` when the request succeeds."""
    if progress:
        task.add_done_callback(lambda t: None if t.cancelled() or t.exception() else progress(nbytes))


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(tensors) -> tuple[dict, int]:
    offsets, total = {}, 0
    for t in tensors:
        offsets[t] = total
        total += align(lib.ggml_nbytes(t))
    return offsets, total


def stage_tensors(stage) -> tuple[list, list]:
    return list(stage.weights.items()), stage.kv.tensors()


def buffer_bytes(stage) -> int:
    """The size of the one buffer a stage's weights and KV cache take on a worker."""
    weights, kv = stage_tensors(stage)
    return layout([t for _, t in weights] + kv)[1]


class ChunkDigests:
    """The SHA-256 of weight chunks, remembered per model file for the
    coordinator's lifetime: a reconnect, or a spare taking a stage over, looks
    the stage's chunks up in the worker's tensor cache without hashing its
    weights again (0.1-0.4 s for Gemma 3 270M's second stage). A chunk is known
    by which bytes of the file its weight is (Stage.bytes_of: the weight's
    name and, for a part of it, which part), its offset and size, within the
    file's identity (path, device, inode, size, mtime): a file changed or
    replaced under the coordinator is hashed afresh. The part matters: two
    members' shards of a weight share its name, offset and size, and a digest
    taken for one and asked for the other would load the wrong rows from a
    worker's cache that holds both (workers of one machine share it)."""

    def __init__(self):
        self._by_file: dict[tuple, dict[tuple, str]] = {}
        self.hashed = 0  # chunks hashed so far

    def of_file(self, gguf) -> dict[tuple, str]:
        """The digests known for `gguf` as it is on disk now."""
        path = getattr(gguf, "path", None)
        if path is None:
            return {}
        st = os.stat(path)
        identity = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        return self._by_file.setdefault(identity, {})

    def digest(self, known: dict, weight, start: int, chunk) -> str:
        """The SHA-256 (hex) of `chunk`, bytes `start`.. of `weight` (Stage.bytes_of) of the file `known` is of."""
        key = (weight, start, len(chunk))
        found = known.get(key)
        if found is None:
            found = known[key] = hashlib.sha256(chunk).hexdigest()
            self.hashed += 1
        return found


class Executor(Protocol):
    """What the coordinator asks of a place that runs a stage."""
    endpoint: str
    client: RpcClient | None  # the connection (None in this process): EndpointSet watches it for failures
    rtt: float | None  # the last step's round trip minus the worker's compute time (None: not measured)
    compute_us: int | None  # the worker's compute time summed over this connection (None in this process)
    head_seconds: dict  # (n_outputs, argmax) -> compute time of the last head share of that shape here
    request_timeout: float | None
    step_token: bytes  # this connection's token for step links

    async def open(self) -> dict: ...  # DEVICE_INFO (or this process's equivalent)
    async def load(self, stage, gguf, progress=None) -> None: ...
    async def run(self, stage, shape, inputs: dict, head: bool = False) -> bytes: ...
    async def ping(self) -> float | None: ...  # a round trip in seconds; None: no answer (or nothing to ask)
    async def probe(self, timeout: float) -> dict: ...
    async def close(self) -> None: ...

    @property
    def step_links(self) -> bool: ...  # takes step inputs from, and pushes outputs to, other workers

    @property
    def step_reply_output(self) -> bool: ...  # a forwarding compute may reply with its outputs too

    @property
    def dot_type_inputs(self) -> bool: ...  # takes matmul inputs converted to the weights' dot type

    @property
    def concat(self) -> bool: ...  # takes CONCAT (GraphBuilder.product)

    # step links (only where step_links is True)
    async def name_peers(self, peers: frozenset) -> None: ...
    def send_linked(self, stage, shape, inputs: dict, head: bool, step_input: tuple | None, forward: list[dict],
                    reply_output: bool = False) -> asyncio.Task: ...
    async def deliver(self, token: bytes, tag: int, data: bytes) -> None: ...
    async def cancel_input(self, tag: int) -> None: ...


def _resolve(fut: asyncio.Future, result, exc: BaseException | None) -> None:
    if not fut.done():  # cancelled meanwhile: nobody waits for it
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)


def _outputs(outputs) -> np.ndarray:
    """A graph's outputs, one after another, copied once into bytes of their own
    (uint8; writable: the arrays read from them need no second copy to be the caller's)."""
    sizes = [lib.ggml_nbytes(out) for out in outputs]
    data = np.empty(sum(sizes), np.uint8)
    dst, off = ffi.from_buffer(data), 0
    for out, n in zip(outputs, sizes):
        ffi.memmove(dst + off, out.data, n)
        off += n
    return data


class LocalExecutor:
    """The in-process path: the correctness reference and the local baseline."""

    endpoint = "local"
    client = None
    rtt = None
    compute_us = None
    request_timeout = None
    step_token = b""
    step_links = step_reply_output = False  # nothing to link: the stage runs in this process
    dot_type_inputs = True  # this process's ggml takes matmul inputs in the weights' dot type
    concat = True

    async def ping(self) -> float | None:
        return None  # nothing to measure: no network between here and here

    def __init__(self, threads: int = 1):
        self.threads = threads
        self.backend: CpuBackend | None = None
        # one allocator per graph: a shared one re-plans on every switch, and
        # reused plans across graphs of equal topology but other sizes corrupt memory
        self.gallocs: dict[int, Gallocr] = {}
        self.allocated: set[int] = set()  # graphs placed once keep their addresses: no allocator pass per step
        self.buffers = []
        self.memory = []  # (address, size) mapped for the buffers, unmapped after them
        # the tensors placed in those buffers: detached when they are freed, so none points into
        # freed memory (a model file's weight tensors are shared: the next stage that holds one,
        # e.g. auto's layer timing run again on the same file, loads it afresh instead of reading
        # a freed buffer; that run segfaulted for the tiny qwen3, 2 times in 3)
        self.placed = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="local-compute")
        self.head_seconds: dict[tuple, float] = {}  # (n_outputs, argmax) -> time of the last head shard here

    async def probe(self, timeout: float) -> dict:
        """Nothing to ask over a network: the stage runs in this process."""
        return {}

    async def open(self) -> dict:
        self.backend = CpuBackend(self.threads)
        return {"name": "local", "free_memory": 0, "threads": self.threads}

    async def load(self, stage, gguf, progress=None) -> None:
        # on the compute thread, copies without the GIL: the event loop goes on (uploads to workers beside it)
        loop = asyncio.get_running_loop()
        done = (lambda n: loop.call_soon_threadsafe(progress, n)) if progress else None
        await loop.run_in_executor(self._pool, self._load, stage, gguf, done)

    def _load(self, stage, gguf, progress) -> None:
        weights, kv = stage_tensors(stage)
        with _PLACING:
            todo = [(n, t) for n, t in weights if t.data == NULL]
            offsets, total = layout([t for _, t in todo] + kv)
            # fresh zeroed memory asked to be on 2 MiB pages: the weights read ~8 % faster than on the
            # 4 KiB pages a CPU buffer's malloc gives where THP is "madvise" (docs/operations.md, "Huge pages")
            base = map_anonymous(total)
            self.memory.append((base, total))
            buf = self.backend.buffer_from_ptr(base, total)
            if buf == NULL:
                raise MemoryError(f"cannot make a CPU buffer of {total} bytes")
            self.buffers.append(buf)
            for t, off in offsets.items():
                lib.ggml_backend_tensor_alloc(buf, t, ffi.cast("void *", base + off))
                self.placed.append(t)
        for name, t in todo:
            data = stage.weight_data(gguf, name)
            np.copyto(np.frombuffer(ffi.buffer(t.data, len(data)), np.uint8), np.frombuffer(data, np.uint8))
            if progress:
                progress(len(data))

    def _run(self, stage, shape, inputs: dict, head: bool) -> bytes:
        g, evicted = stage.graph(shape, head, self.dot_type_inputs, self.concat)
        for old in evicted:
            galloc = self.gallocs.pop(id(old), None)
            self.allocated.discard(id(old))
            if galloc:
                galloc.close()
        galloc = self.gallocs.get(id(g))
        if galloc is None:
            galloc = self.gallocs[id(g)] = Gallocr(self.backend)
        if id(g) not in self.allocated:
            if not galloc.alloc_graph(g.gf):
                raise StageFailed(FailureKind.ALLOC, self.endpoint, "cannot allocate the compute buffer")
            self.allocated.add(id(g))
        for name, arr in inputs.items():
            x = g.inputs[name]
            if x.data == NULL:  # not used by this stage's layers (e.g. mask of a stage without global layers)
                continue
            ffi.memmove(x.data, ffi.from_buffer(arr), arr.nbytes)
        started = time.perf_counter()
        status = self.backend.compute(g.gf)
        if head:  # the compute alone, as a worker's compute_us: not the wait for this thread
            self.head_seconds[shape.head_key] = time.perf_counter() - started
        if status != lib.GGML_STATUS_SUCCESS:
            raise StageFailed(FailureKind.COMPUTE, self.endpoint, f"local compute returned ggml status {status}")
        return _outputs(g.outputs)

    async def run(self, stage, shape, inputs: dict, head: bool = False) -> bytes:
        # run_in_executor's two chained futures cost more Python per step than the step's own
        # bookkeeping: the compute thread resolves one loop future, with one call_soon_threadsafe
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def job():
            try:
                result, exc = self._run(stage, shape, inputs, head), None
            except BaseException as e:  # noqa: B036 (handed to the awaiting coroutine, as run_in_executor does)
                result, exc = None, e
            try:
                loop.call_soon_threadsafe(_resolve, done, result, exc)
            except RuntimeError:  # the loop closed meanwhile: nobody waits for it
                pass

        started = self._pool.submit(job)
        try:
            return await done
        except asyncio.CancelledError:
            started.cancel()  # not started yet: it never runs (as with run_in_executor)
            raise

    async def close(self) -> None:
        # on the compute thread: a step whose caller gave up (cancelled, Ctrl-C) may
        # still be computing there, and freeing its memory under it would segfault
        await asyncio.get_running_loop().run_in_executor(self._pool, self._free)
        self._pool.shutdown(wait=False)

    def _free(self) -> None:
        for galloc in self.gallocs.values():
            galloc.close()
        self.gallocs.clear()
        self.allocated.clear()
        for buf in self.buffers:
            lib.ggml_backend_buffer_free(buf)
        self.buffers.clear()
        for base, size in self.memory:  # under the buffers, which do not own it
            munmap_anonymous(base, size)
        self.memory.clear()
        for t in self.placed:
            t.data, t.buffer = NULL, NULL
        self.placed.clear()
        if self.backend:
            self.backend.close()


class RemoteExecutor:
    """One connection to one worker: weights and KV cache of its stage live in
    one remote buffer; step graphs are sent once and recomputed by id."""

    def __init__(self, endpoint: str, connect_timeout: float = 5.0, liveness_timeout: float | None = 2.0,
                 use_cache: bool = True, request_timeout: float | None = 900.0, secret: bytes | None = None,
                 tls_ca: str | None = None, digests: ChunkDigests | None = None, step_channels: bool = True):
        """`digests`: the chunk digests shared by the coordinator's executors (tensor cache look-ups);
        `step_channels`: tensor-parallel steps over a step channel where the worker grants one."""
        self.endpoint = endpoint
        self.digests = digests if digests is not None else ChunkDigests()
        self.secret = secret  # shared secret for HELLO's challenge-response (rpc_daemon/wire/auth.py)
        self.ssl_context = client_context(tls_ca) if tls_ca else None  # TLS, verifying the worker against tls_ca
        self.connect_timeout = connect_timeout
        self.liveness_timeout = liveness_timeout  # None: no liveness pings (measurements only)
        self.request_timeout = request_timeout  # overall bound on one request, even from a live worker
        self.use_cache = use_cache
        self.client: RpcClient | None = None
        self.info: dict = {}
        self.addresses: dict = {}  # tensor -> (remote buffer, offset) of the loaded stage
        self.sent_graphs: set[int] = set()
        self.buffer: int | None = None
        self.step_token = b""  # this connection's token for step links (STEP_PEERS), new per connection
        # tensor-parallel steps straight to the worker's compute process (docs/protocol.md, "Step
        # channels"): asked for at a connection's first recompute of a tensor step, and again
        # `channel_ask_again` seconds after one was refused or taken back
        self.channel: RpcClient | None = None
        self._channel_opening: asyncio.Task | None = None  # the step channel's opening under way (_step_channel)
        self.use_step_channel = step_channels  # (bench/bench_step_channel.py turns it off and on)
        self.channel_next_ask = 0.0  # monotonic time from which a channel may be asked for
        self.channel_ask_again = CHANNEL_ASK_AGAIN
        self.channel_deadline: float | None = None  # a channel request's bound: the worker's compute timeout
        self.step_peers: frozenset | None = None  # the peers last named to the worker on this connection
        self.channel_steps = 0  # steps answered over the step channel
        self.compute_us = 0  # worker-side compute time, summed
        self.exchange_us = 0  # of it, in tensor-parallel exchanges (sending, waiting for peers, summing)
        self.rtt: float | None = None  # last step's round trip minus the worker's compute time
        # (n_outputs, argmax) -> the worker's compute time of its last head shard of that shape
        self.head_seconds: dict[tuple, float] = {}
        # the last load: chunks sent, hash look-ups and hits, and the most requests in flight at once
        self.load_stats = {"sent": 0, "lookups": 0, "cache_hits": 0, "max_sends_in_flight": 0,
                           "max_lookups_in_flight": 0}

    async def _request(self, cmd, fields=None, blob=b"", kind_on_error: FailureKind = FailureKind.COMPUTE,
                       reply_blob: int | None = None, refused=None):
        """`refused(exc)`: the StageFailed of an error reply, if not rpc_failed's of `kind_on_error`."""
        try:
            return await self.client.request(cmd, fields, blob, self.request_timeout, reply_blob)
        except PeerFailed as exc:
            raise peer_failed(self.endpoint, exc) from None
        except RpcError as exc:
            raise (refused(exc) if refused else rpc_failed(self.endpoint, exc, kind_on_error)) from None

    async def open(self) -> dict:
        try:
            self.client = await RpcClient.connect(self.endpoint, self.connect_timeout, self.liveness_timeout,
                                                  secret=self.secret, ssl_context=self.ssl_context)
        except PeerFailed as exc:
            raise peer_failed(self.endpoint, exc) from None
        self.info, _ = await self._request(Command.DEVICE_INFO, kind_on_error=FailureKind.ENDPOINT)
        missing = sorted(set(GRAPH_OPS) - set(self.info.get("ops") or ()))
        if missing:  # an older daemon: say so now, not as a failed compute at the first greedy step
            raise StageFailed(FailureKind.PROTOCOL, self.endpoint, f"worker {self.endpoint} runs an older "
                              f"ggml-rpc-server without op(s) {', '.join(missing)}, which this coordinator's graphs "
                              f"use; upgrade it")
        self.sent_graphs.clear()
        self.step_token, self.step_peers = os.urandom(16), None
        self._drop_channel()
        self.channel_next_ask = 0.0
        return self.info

    def _offers(self, feature: str) -> bool:
        client = self.client
        return (client is not None and client.failed is None
                and feature in client.server_hello.get("features", ()))

    @property
    def step_links(self) -> bool:
        """The worker takes step inputs from, and forwards outputs to, other workers."""
        return self._offers("step_links")

    @property
    def step_reply_output(self) -> bool:
        """A forwarding compute on this worker may reply with its outputs too (reply_output)."""
        return self._offers("step_reply_output")

    @property
    def dot_type_inputs(self) -> bool:
        """The worker's MUL_MAT takes src1 in the weights' dot type, made by a cast (an older one: f32 only)."""
        return self._offers("dot_type_inputs")

    @property
    def concat(self) -> bool:
        """The worker takes CONCAT (an older one refuses the graph)."""
        return self._offers("concat")

    @property
    def pad(self) -> bool:
        """The worker takes PAD (exact sums' gathers; an older one refuses the graph)."""
        return self._offers("pad")

    @property
    def tensor_gather(self) -> bool:
        """The worker gathers exact sums' pieces (`tensor.gather`) instead of summing them padded."""
        return self._offers("tensor_gather")

    async def name_peers(self, peers: frozenset) -> None:
        """STEP_PEERS: the workers this connection's steps may forward to (sent when they change)."""
        if peers != self.step_peers:
            await self._request(Command.STEP_PEERS, {"token": self.step_token, "peers": sorted(peers)},
                                kind_on_error=FailureKind.ENDPOINT)
            self.step_peers = peers

    def _forget_sent(self, evicted) -> list[int]:
        """The ids of the evicted graphs this worker holds, no longer counted as sent: to free there."""
        ids = [old.graph_id for old in evicted if old.graph_id in self.sent_graphs]
        self.sent_graphs.difference_update(ids)
        return ids

    def send_linked(self, stage, shape, inputs: dict, head: bool, step_input: tuple | None,
                    forward: list[dict], reply_output: bool = False) -> asyncio.Task:
        """Start one linked compute: `step_input` (input name, tag, timeout)
        is taken from the worker's mailbox, the outputs go to each `forward`
        destination. Requests of one connection leave in the order of these
        calls (the task and those of evicted graphs' GRAPH_FREE start in order).
        The task gives (reply, blob): the blob is empty when every push
        succeeded, unless `reply_output` (then it always holds the outputs)."""
        g, evicted = stage.graph(shape, head, self.dot_type_inputs, self.concat)
        self._free_evicted(evicted)
        fields, blob = self._compute_fields(g, inputs)
        tensors, index_of = g.wire
        if step_input is not None:
            name, tag, timeout = step_input
            fields["step_input"] = {"tensor": index_of[g.inputs[name]], "tag": tag, "timeout": timeout}
        if forward:
            fields["forward"] = forward
        if reply_output:
            fields["reply_output"] = True
        cmd = Command.GRAPH_RECOMPUTE if g.graph_id in self.sent_graphs else Command.GRAPH_COMPUTE
        if cmd == Command.GRAPH_COMPUTE:
            fields["tensors"] = tensors
        return asyncio.get_running_loop().create_task(self._linked(cmd, fields, blob, g.graph_id,
                                                                   shape.head_key if head else None,
                                                                   stage.output_size(shape, head)))

    def _free_evicted(self, evicted) -> None:
        """GRAPH_FREE, without waiting, of the evicted graphs this worker holds (their requests
        leave now, before any this connection sends later)."""
        for graph_id in self._forget_sent(evicted):
            asyncio.get_running_loop().create_task(self._free_quietly(graph_id))

    async def _free_in_order(self, graph_ids: list[int]) -> None:
        """GRAPH_FREE of `graph_ids` (forgotten as sent already), each awaited in turn: all of
        them freed before the step's compute leaves. Left early (the step cancelled, or a free
        failed), the frees not answered yet are sent without waiting (_free_quietly), else those
        graphs' compute memory would stay held on the worker until the session ends. The free
        that was out then is sent again: its frame is whole in the transport once the request
        has started (RpcClient.request), but asking twice costs nothing (the daemon answers a
        GRAPH_FREE of a graph it does not hold with success) and a free that did not leave is
        not lost."""
        for i, graph_id in enumerate(graph_ids):
            try:
                await self._request(Command.GRAPH_FREE, {"graph_id": graph_id})
            except BaseException:
                loop = asyncio.get_running_loop()
                for left in graph_ids[i:]:
                    loop.create_task(self._free_quietly(left))
                raise

    async def _free_quietly(self, graph_id: int) -> None:
        if self.client is None or self.client.failed is not None:
            return  # the session is over (or ending): the worker frees all its graphs with it
        try:
            await self._request(Command.GRAPH_FREE, {"graph_id": graph_id})
        except StageFailed:
            pass  # a lost connection is the step's own requests' to report

    async def _linked(self, cmd, fields: dict, blob, graph_id: int, head_key: tuple | None,
                      reply_blob: int) -> tuple[dict, bytes]:
        started = time.monotonic()
        try:
            reply, out = await self.client.request(cmd, fields, blob, self.request_timeout, reply_blob)
        except PeerFailed as exc:
            raise peer_failed(self.endpoint, exc) from None
        except RpcError as exc:
            if exc.status == Status.NOT_FOUND and cmd == Command.GRAPH_RECOMPUTE:
                self.sent_graphs.discard(graph_id)
                raise NotLinked(exc.message) from None
            if exc.status == Status.INPUT_MISSING:
                raise InputMissing(FailureKind.COMPUTE, self.endpoint,
                                   f"compute failed on worker {self.endpoint}: {exc}") from None
            raise rpc_failed(self.endpoint, exc) from None
        self._account(reply, time.monotonic() - started, head_key)
        self.sent_graphs.add(graph_id)
        return reply, out

    async def deliver(self, token: bytes, tag: int, data: bytes) -> None:
        """STEP_INPUT over this connection: the relay when a worker could not push."""
        try:
            await self.client.request(Command.STEP_INPUT, {"token": token, "tag": tag}, data, self.request_timeout)
        except PeerFailed as exc:
            raise peer_failed(self.endpoint, exc) from None
        except RpcError as exc:
            if exc.status == Status.INVALID_REQUEST:
                return  # the input is there already (the push arrived after all), or the step was cancelled
            raise StageFailed(FailureKind.COMPUTE, self.endpoint, f"worker {self.endpoint} refused the step input "
                                                                  f"the coordinator relayed to it: {exc}") from None

    async def cancel_input(self, tag: int) -> None:
        """End this connection's wait for step input `tag` (the step failed elsewhere); errors are moot."""
        client = self.client
        if client is None or client.failed is not None:
            return
        try:
            await client.request(Command.STEP_INPUT, {"token": self.step_token, "tag": tag, "cancel": True},
                                 deadline=self.liveness_timeout or 2.0)
        except (PeerFailed, RpcError):
            pass

    async def load(self, stage, gguf, progress=None) -> None:
        weights, kv = stage_tensors(stage)
        offsets, total = layout([t for _, t in weights] + kv)
        reply, _ = await self._request(Command.ALLOC_BUFFER, {"size": max(total, 1)}, kind_on_error=FailureKind.ALLOC)
        self.buffer = reply["buffer"]
        self.addresses = {t: (self.buffer, off) for t, off in offsets.items()}
        self.load_stats = dict.fromkeys(self.load_stats, 0)
        chunks = []  # (range, bytes, (which bytes of the file: Stage.bytes_of, offset in them)) in buffer order
        for name, t in weights:
            data = stage.weight_data(gguf, name)
            for start in range(0, len(data), UPLOAD_CHUNK):
                chunk = data[start: start + UPLOAD_CHUNK]
                chunks.append(({"buffer": self.buffer, "offset": offsets[t] + start, "size": len(chunk)}, chunk,
                               (stage.bytes_of(name), start)))
        try:
            if self.use_cache and self.info.get("tensor_cache"):
                chunks = await self._fill_from_cache(chunks, self.digests.of_file(gguf), progress)
            window = RequestWindow(self.client, deadline=self.request_timeout)
            for where, chunk, _ in chunks:
                _count_when_done(await window.submit(Command.SET_TENSOR, where, chunk), len(chunk), progress)
            await window.drain()
            self.load_stats.update(sent=len(chunks), max_sends_in_flight=window.peak_requests)
        except PeerFailed as exc:
            raise peer_failed(self.endpoint, exc) from None
        except RpcError as exc:
            raise rpc_failed(self.endpoint, exc, FailureKind.LOAD) from None

    async def _fill_from_cache(self, chunks: list, known: dict, progress) -> list:
        """Ask the worker's tensor cache for every large chunk at once (pipelined
        SET_TENSOR_HASH, one window; digests from `known`, a ChunkDigests
        file's, where hashed before); return the chunks still to send, the
        misses marked `cache: true` so the worker keeps them."""
        window = RequestWindow(self.client, deadline=self.request_timeout)
        asked, rest = [], []
        for where, chunk, (weight, start) in chunks:
            if len(chunk) < CACHE_MIN_BYTES:
                rest.append((where, chunk, None))
                continue
            digest = self.digests.digest(known, weight, start, chunk)
            asked.append((where, chunk, await window.submit(Command.SET_TENSOR_HASH, dict(where, hash=digest),
                                                             accept=(Status.NOT_FOUND,))))
        await window.drain()
        self.load_stats.update(lookups=len(asked), max_lookups_in_flight=window.peak_requests)
        for where, chunk, task in asked:
            if task.result()[0].get("status") == Status.NOT_FOUND:
                rest.append((dict(where, cache=True), chunk, None))
                continue
            self.load_stats["cache_hits"] += 1
            if progress:
                progress(len(chunk))
        return rest

    def _compute_fields(self, g, inputs: dict) -> tuple[dict, bytes]:
        """A compute request's fields (graph id, inline inputs, outputs) and blob."""
        if g.wire is None:
            g.wire = encode_graph(g.gf, self.addresses.get)
            index_of = g.wire[1]
            g.wire_ids = ({name: index_of.get(t) for name, t in g.inputs.items()}, [index_of[out] for out in g.outputs],
                          [index_of[t] for t in g.exchanges])
        input_ids, output_ids, _ = g.wire_ids
        specs, parts, off = [], [], 0
        for name, arr in inputs.items():
            index = input_ids[name]
            if index is None:  # not used by this stage's layers
                continue
            specs.append([index, off, arr.nbytes])
            parts.append(arr.data if arr.flags.c_contiguous else arr.tobytes())
            off += arr.nbytes
        return {"graph_id": g.graph_id, "inputs": specs, "outputs": output_ids}, b"".join(parts)

    def step_request(self, stage, shape, inputs: dict, head: bool = False, tensor: dict | None = None) -> StepRequest:
        """A step's compute request, built and not sent (send_step sends it): the members of a
        tensor-parallel group get theirs built first, then sent back to back, so none starts
        later than another by the time its request took to build. `tensor`: a tensor-parallel
        member's step ({"link", "step", "timeout", "gather"}): the graph's exchanges go over the
        member's tensor link, its exact sums' pieces gathered where `gather` (every member takes
        it) and else summed padded."""
        g, evicted = stage.graph(shape, head, self.dot_type_inputs, self.concat)
        fields, blob = self._compute_fields(g, inputs)
        if tensor is not None:
            gather = tensor.get("gather") and any(g.pieces)
            fields["tensor"] = {"link": tensor["link"], "step": tensor["step"], "timeout": tensor["timeout"],
                                "exchange": g.wire_ids[2], **({"gather": g.pieces} if gather else {})}
        # the reply's layout: no worker makes us allocate more
        return StepRequest(g, evicted, fields, blob, stage.output_size(shape, head), shape.head_key if head else None)

    async def run(self, stage, shape, inputs: dict, head: bool = False, tensor: dict | None = None) -> bytes:
        return await self.send_step(self.step_request(stage, shape, inputs, head, tensor))

    def drop_request(self, request: StepRequest) -> None:
        """A built request that will not be sent: the graphs it evicted from the stage's cache
        are freed on the worker all the same (else their compute memory stays held there)."""
        self._free_evicted(request.evicted)

    async def send_step(self, request: StepRequest) -> bytes:
        """Send a step_request's request (the graph itself the first time) and wait for the reply."""
        g, fields, blob, expect, head_key = request.graph, request.fields, request.blob, request.expect, \
            request.head_key
        await self._free_in_order(self._forget_sent(request.evicted))
        tensor = fields.get("tensor")
        tensors, _ = g.wire
        if g.graph_id in self.sent_graphs:
            if tensor is not None:
                out = await self._run_on_channel(fields, blob, expect, head_key)
                if out is not None:
                    return out
            try:
                started = time.monotonic()
                reply, out = await self.client.request(Command.GRAPH_RECOMPUTE, fields, blob, self.request_timeout,
                                                       expect)
                self._account(reply, time.monotonic() - started, head_key)
                return out
            except RpcError as exc:
                if exc.status != Status.NOT_FOUND:
                    raise self._compute_failed(exc) from None
            except PeerFailed as exc:
                raise peer_failed(self.endpoint, exc) from None
        started = time.monotonic()
        try:
            reply, out = await self.client.request(Command.GRAPH_COMPUTE, dict(fields, tensors=tensors), blob,
                                                   self.request_timeout, expect)
        except PeerFailed as exc:
            raise peer_failed(self.endpoint, exc) from None
        except RpcError as exc:
            raise self._compute_failed(exc) from None
        self._account(reply, time.monotonic() - started, head_key)
        self.sent_graphs.add(g.graph_id)
        return out

    async def _run_on_channel(self, fields: dict, blob, expect: int, head_key) -> bytes | None:
        """A recompute over the step channel; None if it has none, or the graph is not cached
        there, or the channel ended without the reply (taken back by the worker for another
        client, or its compute process is gone): the step then goes through the daemon, which
        computes it or says what became of the compute process."""
        if not self.use_step_channel or len(blob) > step_channel.MAX_BLOB:
            return None
        channel = await self._step_channel()
        if channel is None:
            return None
        started = time.monotonic()
        watch, pinging = self._watch_worker_from(started)
        try:
            reply, out = await channel.request(Command.GRAPH_RECOMPUTE, fields, blob, self.channel_deadline, expect)
        except RpcError as exc:
            if exc.status == Status.NOT_FOUND:
                return None
            raise self._compute_failed(exc) from None
        except PeerFailed as exc:
            self._drop_channel()
            if self.client.failed is not None:  # the worker itself is gone (or stopped): reported as that
                raise peer_failed(self.endpoint, self.client.failed) from None
            # computing still, perhaps, or computed: not sent again (a tensor step twice would exchange
            # out of step with its peers)
            if exc.kind == FailureKind.TIMEOUT or exc.mid_reply:
                self.channel_next_ask = float("inf")  # a process that failed so: not again on this connection
            if exc.kind == FailureKind.TIMEOUT:
                raise rpc_failed(self.endpoint, RpcError(Status.FAILED, f"no reply over the step channel within "
                                                         f"{self.channel_deadline:g} s")) from None
            if exc.mid_reply:
                raise rpc_failed(self.endpoint, RpcError(Status.FAILED, "the step channel closed in the middle of "
                                                         "a reply")) from None
            # closed without a reply, or refused at the framing (before any compute): not computed, or
            # by a process that is gone (the daemon says so); asked for again in a while
            self.channel_next_ask = time.monotonic() + self.channel_ask_again
            log.info("step channel ended; steps go through the worker's daemon", endpoint=self.endpoint,
                     reason=exc.message)
            return None
        finally:
            if watch is not None:
                watch.cancel()
            for task in pinging:
                task.cancel()
        self._account(reply, time.monotonic() - started, head_key)
        self.channel_steps += 1
        return out

    def _watch_worker_from(self, started: float) -> tuple[asyncio.TimerHandle | None, list]:
        """While a channel request is out, the worker is held to the liveness bound of a request
        on its connection: past the ping interval without the reply, the connection pings the
        daemon, counting silence from `started`; a daemon silent for the bound fails the
        connection, which ends the channel wait (when_lost). A step's usual milliseconds send
        no ping. The timer, and the list the ping task goes into."""
        client, pinging = self.client, []
        if client.liveness_timeout is None:
            return None, pinging

        async def keep_pinging():
            while True:
                try:
                    await client.request(Command.PING, silent_since=started)
                except (PeerFailed, RpcError):
                    return
                await asyncio.sleep(client.ping_interval)
        loop = asyncio.get_running_loop()
        return loop.call_later(client.ping_interval, lambda: pinging.append(loop.create_task(keep_pinging()))), \
            pinging

    async def _step_channel(self) -> RpcClient | None:
        """The step channel, opened at the first call on this connection if the worker offers one.
        Callers that come while it is being opened wait for that opening (one STEP_CHANNEL), and
        all get its result: the channel, or None (their steps go through the daemon). Were a
        second caller sent through the daemon meanwhile, its step could reach the compute process
        after a later one's that went over the channel. The opening is shielded: a caller
        cancelled does not end it for the others."""
        if self.channel is not None:
            return self.channel
        opening = self._channel_opening
        if opening is None:
            if time.monotonic() < self.channel_next_ask or not self._offers("step_channel"):
                return None
            self.channel_next_ask = time.monotonic() + self.channel_ask_again  # unless it opens
            opening = self._channel_opening = asyncio.get_running_loop().create_task(self._open_channel())
            opening.add_done_callback(self._channel_opened)
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            # the opening itself cancelled (_drop_channel: the connection closed or replaced), not
            # this caller: no channel
            if opening.cancelled() and not asyncio.current_task().cancelling():
                return None
            raise

    def _channel_opened(self, opening: asyncio.Task) -> None:
        if self._channel_opening is opening:
            self._channel_opening = None
        if not opening.cancelled():
            opening.exception()  # retrieved: each waiter (if any is left) has it raised

    async def _open_channel(self) -> RpcClient | None:
        """STEP_CHANNEL and the connection to the port it names (one opening: _step_channel)."""
        client = self.client
        try:
            reply, _ = await client.request(Command.STEP_CHANNEL, deadline=self.request_timeout)
        except PeerFailed as exc:
            raise peer_failed(self.endpoint, exc) from None
        except RpcError as exc:  # an offer: refused, the steps go through the daemon
            log.warning("no step channel", endpoint=self.endpoint, error=str(exc))
            return None
        if not reply.get("granted"):
            log.info("no step channel", endpoint=self.endpoint, reason=reply.get("reason"))
            return None
        try:
            channel = await connect_step_channel(self.endpoint, parse_endpoint(self.endpoint)[0], reply["port"],
                                                 reply["ticket"], self.connect_timeout, client.limits)
        except (PeerFailed, KeyError, TypeError) as exc:
            log.warning("step channel not opened; steps go through the worker's daemon", endpoint=self.endpoint,
                        error=str(exc))
            return None
        if self._channel_opening is not asyncio.current_task() or self.client is not client:
            channel.close()  # dropped meanwhile (the connection closed or replaced)
            return None
        compute_timeout = reply.get("compute_timeout")
        self.channel_deadline = self.request_timeout if not isinstance(compute_timeout, (int, float)) else \
            min(self.request_timeout or float("inf"), compute_timeout + CHANNEL_MARGIN)
        self.channel = channel
        self._channel_opening = None  # done: the callers coming from now on take the channel
        # a worker lost or stopped ends a channel wait at once (this connection's channel only)
        client.when_lost(lambda: self._drop_channel(channel))
        log.info("step channel open", endpoint=self.endpoint)
        return channel

    def _drop_channel(self, only: RpcClient | None = None) -> None:
        """Close the step channel (`only`: if it is still that one). Without `only` (the
        connection closed or replaced), an opening under way is cancelled too: its waiters
        get no channel."""
        if only is None and self._channel_opening is not None:
            opening, self._channel_opening = self._channel_opening, None
            opening.cancel()
        if only is not None and self.channel is not only:
            return
        channel, self.channel = self.channel, None
        if channel is not None and channel.transport is not None:
            channel.close()

    def _compute_failed(self, exc: RpcError) -> StageFailed:
        # this worker's own link missing (its compute process was replaced) is its own failure; a link
        # that closed or timed out on it is a peer's, reported only when no member failed itself
        if exc.status == Status.LINK_FAILED and not exc.header.get("link_missing"):
            return TensorLinkFailed(FailureKind.COMPUTE, self.endpoint,
                                    f"tensor-parallel exchange failed on worker {self.endpoint}: {exc}")
        return rpc_failed(self.endpoint, exc)

    @property
    def tensor_links(self) -> bool:
        """The worker links its compute process with tensor-parallel peers' (over TLS only if it can
        verify them: a TLS worker without --peer-tls-ca does not offer it)."""
        return self._offers("tensor_links")

    async def peer_round_trips(self, peer: str, count: int) -> list[float] | None:
        """TENSOR_LINK rtt: `count` round trips (s) from this worker to worker `peer`, PINGs over
        its own link to it; None where the worker does not offer it (`tensor_rtt`) or cannot reach
        `peer` (auto then falls back on this process's PINGs)."""
        if not self._offers("tensor_rtt"):
            return None
        try:
            reply, _ = await self._request(Command.TENSOR_LINK, {"op": "rtt", "peer": peer, "count": count},
                                           kind_on_error=FailureKind.ENDPOINT)
        except StageFailed as exc:
            if exc.lost_connection:
                raise
            log.warning("a worker could not time its round trip to a peer", endpoint=self.endpoint, peer=peer,
                        error=exc.message)
            return None
        rtts = reply.get("rtts")
        if not isinstance(rtts, list) or not all(isinstance(r, (int, float)) and r >= 0 for r in rtts):
            return None
        return [float(r) for r in rtts]

    async def tensor_listen(self, link: int) -> dict:
        """TENSOR_LINK listen: this member's listener ({"port", "ticket"}) for link `link`."""
        reply, _ = await self._request(Command.TENSOR_LINK, {"op": "listen", "link": link},
                                       kind_on_error=FailureKind.ENDPOINT)
        return reply

    async def tensor_join(self, link: int, rank: int, n: int, peers: list[dict], timeout: float) -> None:
        """TENSOR_LINK join: linked with every lower rank in `peers` and every higher rank's connection.
        A join cancelled because another member's failed, or that failed for its peer's fault (the
        reply's `peer_rank`: the peer's certificate did not verify, it closed the link in the TLS
        handshake), is that member's failure, not this one's (reported only when nothing else failed,
        not latched)."""
        await self._request(Command.TENSOR_LINK, {"op": "join", "link": link, "rank": rank, "n": n, "peers": peers,
                                                  "timeout": timeout}, refused=self._join_failed)

    def _join_failed(self, exc: RpcError) -> StageFailed:
        if exc.status != Status.LINK_FAILED:
            return rpc_failed(self.endpoint, exc, FailureKind.ENDPOINT)
        if exc.header.get("cancelled"):
            return TensorLinkFailed(FailureKind.COMPUTE, self.endpoint,
                                    f"worker {self.endpoint}'s tensor link was cancelled: {exc}")
        if "peer_rank" in exc.header:
            return TensorLinkFailed(FailureKind.COMPUTE, self.endpoint,
                                    f"worker {self.endpoint} could not link with its tensor-parallel peer of rank "
                                    f"{exc.header['peer_rank']}: {exc}")
        failure = StageFailed(FailureKind.ENDPOINT, self.endpoint,
                              f"worker {self.endpoint} could not link with its tensor-parallel peers: {exc}")
        unlinked = exc.header.get("unlinked")  # the ranks it could not link with (TensorGroup weighs them)
        failure.unlinked = [r for r in unlinked if type(r) is int] if isinstance(unlinked, list) else []
        return failure

    async def time_exchanges(self, link: int, step: int, floats: int, count: int, timeout: float) -> float:
        """auto's probe of tensor link `link`: one compute of nothing but `count` all-reduces in a row
        of `floats` f32 (a decode step's partial sum), every member of the group running it as step
        `step`: the seconds this member spent in them (the reply's `exchange_us`: sending, waiting
        for the peers, summing; the compute between them is one SCALE of those floats)."""
        f32, row = lib.GGML_TYPE_F32, 4 * floats
        nb = [4, row, row, row]
        tensors = [{"type": f32, "ne": [floats, 1, 1, 1], "nb": nb, "flags": lib.GGML_TENSOR_FLAG_INPUT}]
        for i in range(count):  # each node the one before, scaled by 1: zeros stay zeros whatever the group
            tensors.append({"type": f32, "ne": [floats, 1, 1, 1], "nb": nb, "op": lib.GGML_OP_SCALE, "src": [i],
                            "params": PROBE_SCALE, "flags": lib.GGML_TENSOR_FLAG_COMPUTE
                            | (lib.GGML_TENSOR_FLAG_OUTPUT if i == count - 1 else 0)})
        fields = {"tensors": tensors, "inputs": [[0, 0, row]], "outputs": [count],
                  "tensor": {"link": link, "step": step, "exchange": list(range(1, count + 1)), "timeout": timeout}}
        reply, _ = await self._request(Command.GRAPH_COMPUTE, fields, bytes(row), reply_blob=row,
                                       refused=self._compute_failed)
        spent = reply.get("exchange_us")
        if isinstance(spent, bool) or not isinstance(spent, int) or spent < 0:
            raise rpc_failed(self.endpoint, RpcError(Status.FAILED, f"no exchange time in the reply: {spent!r}"))
        return spent / 1e6

    async def tensor_cancel(self, link: int) -> None:
        """End this member's waits on link `link` now (a peer failed); errors are moot."""
        client = self.client
        if client is None or client.failed is not None:
            return
        try:
            await client.request(Command.TENSOR_CANCEL, {"link": link}, deadline=self.liveness_timeout or 2.0)
        except (PeerFailed, RpcError):
            pass

    def _account(self, reply: dict, elapsed: float, head_key: tuple | None = None) -> None:
        """Worker compute time, and the step's round trip without it (network and
        hops); a head shard's (of StepShape.head_key `head_key`) kept for the head's placement."""
        compute = reply.get("compute_us", 0)
        self.compute_us += compute
        self.exchange_us += reply.get("exchange_us", 0)
        self.rtt = max(0.0, elapsed - compute / 1e6)
        if head_key is not None:
            self.head_seconds[head_key] = compute / 1e6

    async def ping(self) -> float | None:
        """One PING's round trip (s), bounded by the connection's liveness bound;
        None if there is no live connection or no answer in time (the
        connection's own requests report what is wrong with it)."""
        client = self.client
        if client is None or client.failed is not None:
            return None
        started = time.monotonic()
        try:
            await client.request(Command.PING, deadline=None)
        except (PeerFailed, RpcError):
            return None
        return time.monotonic() - started

    async def probe(self, timeout: float) -> dict:
        """For the cluster view: a PING's round trip and the worker's memory
        (DEVICE_INFO) over this connection, each bounded by `timeout` seconds.
        A request abandoned at its timeout stays harmless (its reply is
        dropped); a worker that stops answering altogether is the liveness
        watchdog's to declare dead, as for any request. Errors are values."""
        client = self.client
        if client is None or client.failed is not None:
            return {"error": f"no connection to worker {self.endpoint}"}
        out: dict = {}
        try:
            started = time.monotonic()
            await asyncio.wait_for(client.request(Command.PING), timeout)
            out["ping_rtt"] = time.monotonic() - started
            info, _ = await asyncio.wait_for(client.request(Command.DEVICE_INFO), timeout)
            out.update(total_memory=info.get("total_memory"), free_memory=info.get("free_memory"))
        except asyncio.TimeoutError:
            out["error"] = f"worker {self.endpoint} did not answer the probe within {timeout:g} s"
        except (PeerFailed, RpcError) as exc:
            out["error"] = str(exc) or type(exc).__name__
        return out

    async def close(self) -> None:
        self._drop_channel()
        if self.client is not None:
            if self.client.failed is None and self.buffer is not None:
                try:
                    await asyncio.wait_for(self.client.request(Command.FREE_BUFFER, {"buffer": self.buffer}), 2.0)
                except Exception:
                    pass
            await self.client.aclose()
            self.client = None


def make_executor(endpoint: str, threads: int, **opts):
    if endpoint == "local":
        return LocalExecutor(threads)
    return RemoteExecutor(endpoint, **opts)

