"""One row per command: its handler, and whether it is answered as soon as it
is read (PING, HELLO, AUTH while a challenge is pending) or queued behind the
connection's running request, and whether queued requests of it may run side
by side (SET_TENSOR_HASH). Handlers see a `Session` (this client's id,
buffers, graphs, limits, authentication), not the connection.

A handler takes (session, header, blob, direct) and returns reply fields, or
(fields, blob); `status`, `error` and `quiet` among the fields set the reply's
status, message and whether a refusal is logged. A refusal is raised as
ProtocolError. Queued handlers are coroutines; those answered at once are not.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import structlog

from ggml_ffi import extra_buffers
from ggml_ffi.core import describe, ggml_identity
from rpc_daemon.compute.pool import ComputeFailed
from rpc_daemon.daemon.buffers import ALIGNMENT, SharedBuffer, fill_bytes
from rpc_daemon.daemon import peers, step_channel, tensor_links
from rpc_daemon.service import hoptrace
from rpc_daemon.service.memory import available_memory
from rpc_daemon.validation import requests as V
from rpc_daemon.validation.graph import SUPPORTED_OP_NAMES, GraphSpec
from rpc_daemon.wire import auth as A
from rpc_daemon.wire import protocol as P
from rpc_daemon.wire.protocol import Command, ProtocolError, Status

if TYPE_CHECKING:
    from rpc_daemon.daemon.connection import Daemon

log = structlog.get_logger("rpc")

LARGE_GRAPH = 2048  # graphs with more tensors are validated off the event loop
# SET_TENSOR_HASH requests of one connection run at once (their cache entries read and hashed on
# executor threads); 3 keeps two cores busy with a reading and a hashing one and the next one started
LOOKUPS_AT_ONCE = 3
Range = tuple[int, int, int]  # (buffer, start, end): the bytes of a client buffer a request writes


class Session:
    """One client as its handlers see it: its id, its buffers (in the daemon's
    registry), its cached graphs, the limits, its authentication; and the
    daemon's shared services (compute pool, tensor cache, stats, config)."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.config = daemon.config
        self.limits = daemon.config.limits
        self.client_id = daemon.new_client_id()
        self.graphs: dict[int, GraphSpec] = {}
        self.auth = A.ServerAuth(daemon.config.secret) if daemon.config.secret else None
        self.hello_done = False
        self.steps = None  # its step links (daemon/peers.py StepSession), once STEP_PEERS named them
        self.tensor_links = None  # its tensor link (daemon/tensor_links.py), once TENSOR_LINK opened one
        self.step_channel = None  # its step channel while the client connects (daemon/step_channel.py)
        self.log = log

    def authenticated(self) -> None:
        """HELLO (and AUTH with a secret) succeeded (the connection then lifts its pre-auth frame bound)."""
        self.hello_done = True

    @property
    def auth_pending(self) -> bool:
        return self.auth is not None and self.auth.pending

    def features(self) -> list[str]:
        # a TLS daemon links with peers only if it can verify them (--peer-tls-ca): step links and
        # tensor links (those run TLS in the compute process); a step channel is never encrypted
        return [f for f in P.FEATURES if f not in self.config.test_older
                and (f != "tensor_cache" or self.daemon.cache is not None)
                and (f not in ("step_links", "step_reply_output", "tensor_links", "tensor_rtt")
                     or self.daemon.peer_links.usable)
                and (f != "step_channel" or not self.config.tls_cert)
                # a request over a step channel never passes the daemon's --test-fault points
                and (f != "step_channel" or not self.config.test_faults)]

    def buffer_of(self, key: int) -> SharedBuffer | None:
        """This client's buffer `key`, or None (validation.requests refuses it)."""
        return self.daemon.buffers.get(self.client_id, key)

    def graph_key(self, graph_id: int) -> str:
        return f"{self.client_id}:{graph_id}"

    def forget_graph(self, graph_id: int) -> None:
        proc = self.daemon.compute.get(self.client_id)
        if proc is not None:
            proc.forget_graph(self.graph_key(graph_id))


# ---------------------------------------------------------------- answered at once

def hello_fields(s: Session) -> dict:
    """What a successful HELLO and AUTH reply both carry."""
    return {"version": P.PROTOCOL_VERSION, "features": s.features(), "server": "ggml-rpc-server (python)",
            "max_blob": s.limits.max_blob, "idle_timeout": s.config.idle_timeout, "ggml": ggml_identity()}


def handle_ping(s: Session, h, blob, direct):
    return {"time": time.time()}


def handle_hello(s: Session, h, blob, direct):
    try:
        P.check_hello(h, ggml_identity())
        challenge = s.auth.challenge(h) if s.auth is not None and not s.hello_done else None
    except ProtocolError as exc:
        raise ProtocolError(exc.status, exc.message, fatal=True,
                            fields={"version": P.PROTOCOL_VERSION, "ggml": ggml_identity()}) from None
    if challenge is not None:  # authentication pending: the next frame must be AUTH
        return {"status": Status.NOT_AUTHORIZED, "error": "authentication required: answer the challenge with AUTH",
                "quiet": True, "version": P.PROTOCOL_VERSION, "auth": challenge}
    s.authenticated()
    return hello_fields(s)


def handle_auth(s: Session, h, blob, direct):
    try:
        server_proof = s.auth.verify(h)
    except ProtocolError as exc:
        raise ProtocolError(exc.status, exc.message, fatal=True) from None
    s.authenticated()
    s.log.info("client authenticated")
    return dict(hello_fields(s), proof=server_proof)


# ---------------------------------------------------------------- queued

async def handle_device_info(s: Session, h, blob, direct):
    reg = s.daemon.buffers
    ggml = describe()
    free = max(0, min(reg.max_bytes - reg.allocated - reg.compute_bytes(), available_memory()))
    cap = s.limits.max_client_bytes  # --max-client-mem: what this client may still allocate, at most
    client_free = free if not cap else max(0, min(free, cap - reg.held_by(s.client_id)[1]))
    return {"name": "CPU", "description": cpu_model(), "total_memory": reg.max_bytes, "free_memory": free,
            "client_free_memory": client_free,
            "alignment": ALIGNMENT, "max_buffer_size": reg.max_bytes, "threads": s.config.threads,
            "cpu_features": [f.lower() for f in ggml["cpu_features"]], "cpu_variant": ggml["cpu_variant"],
            "kernels": dict(ggml["kernels"], extra_buffers=extra_buffers.known() or {}),
            "ggml": dict(ggml_identity(), origin=ggml["origin"]), "tensor_cache": s.daemon.cache is not None,
            "shared_memory": dict(s.daemon.shm.describe(), page=reg.page),
            "ops": SUPPORTED_OP_NAMES}  # a coordinator checks the ops its graphs need at connect


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


async def handle_alloc_buffer(s: Session, h, blob, direct):
    size = V.check_alloc(h, *s.daemon.buffers.held_by(s.client_id), s.limits, s.daemon.buffers.round_up)
    await s.daemon.compute.allocations_settled()  # a graph's first compute may be taking memory right now
    buf = s.daemon.buffers.alloc(s.client_id, size)
    if buf is None:
        reg = s.daemon.buffers
        return {"status": Status.ALLOC_FAILED,
                "error": f"cannot allocate {size} bytes ({max(0, reg.max_bytes - reg.allocated - reg.compute_bytes())} "
                         f"of {reg.max_bytes} free; {reg.compute_bytes()} held by compute)"}
    return {"buffer": buf.key, "size": buf.size, "alignment": ALIGNMENT}


async def handle_free_buffer(s: Session, h, blob, direct):
    buf = V.owned(P.field_int(h, "buffer", 1), s.buffer_of)
    proc = s.daemon.compute.get(s.client_id)
    if proc is not None:
        proc.forget_buffer(buf.key)
        if s.daemon.compute.channel_holder is proc:  # no step over the channel touches it once it is freed
            await proc.sync()
    s.daemon.buffers.free(buf)  # its pages are released at once (the child's ggml buffer struct goes below)
    if proc is not None:
        proc.flush_soon()
    return {}


async def handle_buffer_clear(s: Session, h, blob, direct):
    buf, value = V.check_buffer_clear(h, s.buffer_of)
    fill_bytes(buf.view, value)
    return {}


async def handle_set_tensor(s: Session, h, blob, direct):
    buf, r, cache = V.check_set_tensor(h, len(blob), s.buffer_of)  # the checks a direct write passed before landing
    dest = buf.view[r.offset: r.offset + r.size]
    if not direct:
        dest[:] = blob
    if cache and s.daemon.cache is not None:
        await asyncio.get_running_loop().run_in_executor(None, s.daemon.cache.store, dest)
    return {}


async def handle_set_tensor_hash(s: Session, h, blob, direct):
    buf, r, hex_digest = V.check_set_tensor_hash(h, s.buffer_of)
    if s.daemon.cache is None:
        return {"status": Status.NOT_FOUND, "error": "this daemon has no tensor cache"}
    try:
        ok = await asyncio.get_running_loop().run_in_executor(None, s.daemon.cache.load_into, hex_digest, buf.fd,
                                                              buf.offset + r.offset, r.size)
    except ValueError as exc:
        raise ProtocolError(Status.INVALID_REQUEST, str(exc)) from None
    if not ok:
        return {"status": Status.NOT_FOUND, "error": "content not in the tensor cache"}
    return {}


def set_tensor_hash_range(h) -> Range | None:
    """A SET_TENSOR_HASH's (buffer, start, end), for running it beside others;
    None for one whose range is not plain integers (it runs alone, in its turn,
    and its handler refuses it)."""
    fields = h.get("buffer"), h.get("offset"), h.get("size")
    if any(type(f) is not int for f in fields):
        return None
    return fields[0], fields[1], fields[1] + fields[2]


async def handle_get_tensor(s: Session, h, blob, direct):
    buf, r = V.check_get_tensor(h, s.buffer_of, s.limits)
    return {}, bytes(buf.view[r.offset: r.offset + r.size])


async def handle_copy_tensor(s: Session, h, blob, direct):
    src, rs, dst, rd = V.check_copy_tensor(h, s.buffer_of)
    dst.view[rd.offset: rd.offset + rd.size] = src.view[rs.offset: rs.offset + rs.size]
    return {}


async def _run(s: Session, run: V.Run, tensor: V.TensorStep | None = None):
    arena = s.daemon.buffers.arena(s.client_id)
    if hoptrace.ON:
        hoptrace.mark("daemon validated")
    header = {"kind": "compute", "graph_key": s.graph_key(run.graph_id or -1), "inputs": run.inputs,
              "outputs": run.outputs}
    if tensor is not None:
        header["tensor"] = tensor.compute_header(s.daemon.compute.timeout)
    try:
        # the client's own compute process: only its arena is mapped there
        reply, out = await s.daemon.compute.for_client(s.client_id).call(
            header, run.blob, run.buffers, run.spec, out_size=run.out_size,
            client_arena=(arena.size, arena.fd) if arena is not None else None)
    except ComputeFailed as exc:
        s.daemon.stats["compute_restarts"] += 1
        return {"status": Status.FAILED, "error": str(exc)}
    s.daemon.stats["computes"] += 1
    s.daemon.stats["compute_us"] += reply.get("compute_us", 0)
    if reply["status"] != 0:
        s.daemon.stats["compute_errors"] += 1
        failed = {"status": reply["status"], "error": reply.get("error", "compute failed")}
        if reply.get("link_missing"):  # this session's own link is gone, not a peer's: protocol.md, Tensor links
            failed["link_missing"] = True
        return failed
    if tensor is not None:
        return {"outputs": reply["outputs"], "compute_us": reply.get("compute_us", 0),
                "exchange_us": reply.get("exchange_us", 0)}, out
    return {"outputs": reply["outputs"], "compute_us": reply.get("compute_us", 0)}, out


async def handle_graph_compute(s: Session, h, blob, direct):
    if hoptrace.ON:
        hoptrace.mark("daemon handler")
    link = peers.check_link(s, h)  # before anything: a refused request takes no step input
    h, blob = await peers.take_step_input(s, h, blob, link)
    unsafe = s.config.unsafe_no_validation
    tensors = h.get("tensors")
    if not unsafe and isinstance(tensors, list) and len(tensors) > LARGE_GRAPH:
        # pure Python over tens of thousands of tensors: in a thread, so the loop keeps answering
        # every other client (it gets the GIL back every few milliseconds)
        run = await asyncio.get_running_loop().run_in_executor(
            None, V.check_graph_compute, h, blob, s.limits, s.buffer_of, s.graphs)
    else:
        run = V.check_graph_compute(h, blob, s.limits, s.buffer_of, s.graphs, unsafe)
    tensor = V.check_tensor_step(h, run.spec)
    if run.graph_id:  # only now: a refused request must not replace the graph cached under its id
        s.graphs[run.graph_id] = run.spec
    s.forget_graph(run.graph_id or -1)  # a one-off graph: cached in the compute process under a throwaway key
    return peers.deferred(s, await _run(s, run, tensor), link)


async def handle_graph_recompute(s: Session, h, blob, direct):
    if hoptrace.ON:
        hoptrace.mark("daemon handler")
    graph_id, spec = V.cached_graph(h, s.graphs)
    link = peers.check_link(s, h)
    if spec is None:  # before the step input is taken: the client sends GRAPH_COMPUTE for it next
        return {"status": Status.NOT_FOUND, "error": f"graph {graph_id} is not cached; send it with GRAPH_COMPUTE"}
    h, blob = await peers.take_step_input(s, h, blob, link)
    spec = s.graphs.get(graph_id)
    if spec is None:
        raise ProtocolError(Status.INVALID_REQUEST, f"graph {graph_id} was freed while the step input was awaited")
    run = V.check_graph_recompute(graph_id, spec, h, blob, s.limits, s.buffer_of, s.config.unsafe_no_validation)
    return peers.deferred(s, await _run(s, run, V.check_tensor_step(h, spec)), link)


async def handle_graph_free(s: Session, h, blob, direct):
    graph_id, _ = V.cached_graph(h, s.graphs)
    if s.graphs.pop(graph_id, None) is not None:
        s.forget_graph(graph_id)
        proc = s.daemon.compute.get(s.client_id)
        if proc is not None and s.daemon.compute.channel_holder is proc:
            await proc.sync()  # no step over the channel computes it once it is freed
        elif proc is not None:
            proc.flush_soon()  # its compute memory is returned (and counted free) now, not at the next compute
    return {}


@dataclass(frozen=True)
class CommandRow:
    handler: Callable
    # None: queued, run in request order on the connection's task. Else a predicate over the
    # session: when it holds, the command is answered as soon as it is read (a coroutine-free
    # handler), even while the connection's previous request computes; when it does not, the
    # command is not one this session may send (UNKNOWN_COMMAND, in its turn).
    answer_now: Callable[[Session], bool] | None = None
    # None: one request at a time. Else, for a queued command, the range a request writes (None:
    # that request runs alone, in its turn): requests of the command queued back to back then run up
    # to `at_once` at a time, as if one at a time (replies in request order; one whose range overlaps
    # a running one's starts once none runs; any other request after every one of them is answered)
    beside: Callable[[dict], Range | None] | None = None
    at_once: int = 1


def runs_beside(h) -> tuple[CommandRow, Range] | None:
    """A queued request that may run beside others of its command: its row and
    the range it writes; None for any other (it runs alone, in its turn)."""
    cmd = h.get("cmd") if isinstance(h, dict) else None
    row = COMMANDS.get(cmd) if type(cmd) is int else None  # strictly: cmd 8.0 or True is not a command
    rng = row.beside(h) if row is not None and row.beside is not None else None
    return None if rng is None else (row, rng)


def overlap(a: Range, b: Range) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _always(s: Session) -> bool:
    return True


def _challenge_pending(s: Session) -> bool:
    return s.auth_pending


COMMANDS: dict[int, CommandRow] = {
    Command.HELLO: CommandRow(handle_hello, answer_now=_always),
    Command.AUTH: CommandRow(handle_auth, answer_now=_challenge_pending),
    Command.PING: CommandRow(handle_ping, answer_now=_always),
    Command.DEVICE_INFO: CommandRow(handle_device_info),
    Command.ALLOC_BUFFER: CommandRow(handle_alloc_buffer),
    Command.FREE_BUFFER: CommandRow(handle_free_buffer),
    Command.BUFFER_CLEAR: CommandRow(handle_buffer_clear),
    Command.SET_TENSOR: CommandRow(handle_set_tensor),
    Command.GET_TENSOR: CommandRow(handle_get_tensor),
    Command.COPY_TENSOR: CommandRow(handle_copy_tensor),
    Command.SET_TENSOR_HASH: CommandRow(handle_set_tensor_hash, beside=set_tensor_hash_range,
                                        at_once=LOOKUPS_AT_ONCE),
    Command.GRAPH_COMPUTE: CommandRow(handle_graph_compute),
    Command.GRAPH_RECOMPUTE: CommandRow(handle_graph_recompute),
    Command.GRAPH_FREE: CommandRow(handle_graph_free),
    Command.STEP_PEERS: CommandRow(peers.handle_step_peers),
    # a request of the token's session may be waiting for it: answered (delivered) as soon as it is read
    Command.STEP_INPUT: CommandRow(peers.handle_step_input, answer_now=_always),
    Command.TENSOR_LINK: CommandRow(tensor_links.handle_tensor_link),
    # the session's compute may be waiting on the link: answered (the link shut down) as soon as it is read
    Command.TENSOR_CANCEL: CommandRow(tensor_links.handle_tensor_cancel, answer_now=_always),
    Command.STEP_CHANNEL: CommandRow(step_channel.handle_step_channel),
}
