"""Every check a request must pass before it has any effect, as pure functions
over (header, blob, the session's state): which commands a connection may send
yet, buffer ownership and ranges, and a whole compute (graph, inputs, row ids,
outputs, buffers) in one call. The handlers only act on what these return.

`buffer_of(key)` is the session's lookup: the client's buffer `key` (with
`.offset` and `.size` in its arena), or None if it holds no such buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ggml_ffi import lib
from rpc_daemon.validation import row_ids
from rpc_daemon.validation.graph import GraphSpec, canonical_nb, parse_graph, parse_unchecked
from rpc_daemon.wire import protocol as P
from rpc_daemon.wire.protocol import Command, ProtocolError, Status

BufferOf = Callable[[int], object]


# ---------------------------------------------------------------- the handshake

def admission(cmd, hello_done: bool, auth_required: bool, auth_pending: bool) -> tuple[ProtocolError, str] | None:
    """Whether a connection may send `cmd` (as read, any type) now: None, or the
    refusal and the reason the connection is closed for it. Before HELLO
    nothing but a valid HELLO passes; with a secret, nothing but HELLO and then
    the one AUTH its challenge admits. A `cmd` that is not an int passes once
    authenticated (refused in its turn, so replies keep request order)."""
    if type(cmd) is not int:  # 0.0 or False must not pass for HELLO, 13.0 not for AUTH, 12.0 not for PING
        if hello_done:
            return None
        return ProtocolError(Status.INVALID_REQUEST, f"the first command must be HELLO (cmd {cmd!r:.40})"), \
            "first frame without a valid cmd"
    if cmd == Command.AUTH and auth_pending:
        return None
    if not hello_done and auth_required and (cmd != Command.HELLO or auth_pending):
        return ProtocolError(Status.NOT_AUTHORIZED, "not authenticated: this worker requires HELLO with "
                                                    "auth_nonce, then AUTH (a shared secret)"), \
            "request before authentication"
    if not hello_done and cmd != Command.HELLO:
        return ProtocolError(Status.INVALID_REQUEST, "the first command must be HELLO"), "first command was not HELLO"
    return None


# ---------------------------------------------------------------- buffers

def owned(key: int, buffer_of: BufferOf):
    buf = buffer_of(key)
    if buf is None:
        raise ProtocolError(Status.INVALID_REQUEST, f"buffer {key} is not a buffer of this connection")
    return buf


def check_range(r: P.ByteRange, buffer_of: BufferOf):
    """The buffer `r` is in, once `r` is known to lie inside it: (buffer, r)."""
    buf = owned(r.buffer, buffer_of)
    if r.offset + r.size > buf.size:
        raise ProtocolError(Status.INVALID_REQUEST,
                            f"range [{r.offset}, {r.offset + r.size}) runs past the end of buffer {r.buffer} "
                            f"({buf.size} bytes)")
    return buf, r


def check_set_tensor(h: dict, blob_len: int, buffer_of: BufferOf):
    """(buffer, range, cache): checked before a byte of the blob lands (also for a direct write)."""
    r, cache = P.parse_set_tensor(h, blob_len)
    buf, r = check_range(r, buffer_of)
    return buf, r, cache


def check_set_tensor_hash(h: dict, buffer_of: BufferOf):
    """(buffer, range, hex digest)."""
    buf, r = check_range(P.parse_range(h), buffer_of)
    hex_digest = h.get("hash")
    if not isinstance(hex_digest, str) or len(hex_digest) != 64:
        raise ProtocolError(Status.INVALID_REQUEST, "field 'hash' must be a sha256 hex digest")
    return buf, r, hex_digest


def check_get_tensor(h: dict, buffer_of: BufferOf, limits: P.Limits):
    buf, r = check_range(P.parse_range(h), buffer_of)
    if r.size > limits.max_blob:
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"GET_TENSOR of {r.size} bytes exceeds max_blob "
                                                   f"{limits.max_blob}; read it in parts")
    return buf, r


def check_copy_tensor(h: dict, buffer_of: BufferOf):
    """(source buffer, source range, destination buffer, destination range)."""
    src, rs = check_range(P.parse_range(h, "src_"), buffer_of)
    dst, rd = check_range(P.parse_range(h), buffer_of)
    return src, rs, dst, rd


def check_alloc(h: dict, count: int, held: int, limits: P.Limits, round_up: Callable[[int], int]) -> int:
    """The size to allocate, within the client's buffer count and byte cap
    (`count` buffers of `held` bytes now; buffers count as whole pages)."""
    size = P.field_int(h, "size", 1)
    if count >= limits.max_buffers:
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"buffer count limit {limits.max_buffers} reached")
    cap = limits.max_client_bytes
    if cap and held + round_up(size) > cap:
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"cannot allocate {size} bytes ({round_up(size)} as whole "
                                                   f"pages): this client holds {held} of its {cap}-byte limit")
    return size


def check_buffer_clear(h: dict, buffer_of: BufferOf):
    """(buffer, fill value)."""
    return owned(P.field_int(h, "buffer", 1), buffer_of), P.field_int(h, "value", 0, 255, default=0)


# ---------------------------------------------------------------- computes

@dataclass(frozen=True)
class Run:
    """A compute, checked: what the client's compute process is sent."""
    graph_id: int  # 0: a one-off graph
    spec: GraphSpec
    inputs: list  # (tensor, blob offset, size)
    outputs: list  # tensor indices
    buffers: dict  # buffer key -> (offset in the arena, size), every buffer the graph uses
    blob: object

    @property
    def out_size(self) -> int:
        return sum(self.spec.tensors[i].nbytes for i in self.outputs)


def check_run(graph_id: int, spec: GraphSpec, h: dict, blob, limits: P.Limits, buffer_of: BufferOf,
              unsafe: bool = False) -> Run:
    """Everything a compute of `spec` with this request's inputs and outputs
    needs checked, before it has any effect."""
    inputs = P.parse_inputs(h, len(blob), len(spec.tensors))
    given = {i.tensor for i in inputs}
    for i in inputs:
        t = spec.tensors[i.tensor]
        if i.tensor not in spec.inputs:
            raise ProtocolError(Status.INVALID_REQUEST, f"inputs: tensor {i.tensor} is not an input leaf of the graph")
        if i.size != t.nbytes:
            raise ProtocolError(Status.INVALID_REQUEST,
                                f"inputs: tensor {i.tensor} ({t.name!r}) needs {t.nbytes} bytes, got {i.size}")
    missing = [i for i in spec.inputs if i not in given]
    if missing and not unsafe:
        t = spec.tensors[missing[0]]
        raise ProtocolError(Status.INVALID_REQUEST, f"inputs: no data for input tensor {t.index} ({t.name!r})")
    inputs = [(i.tensor, i.blob_offset, i.size) for i in inputs]
    row_ids.check_inputs(spec.row_groups, spec.tensors, inputs, blob)  # GET_ROWS/SET_ROWS ids in range
    outputs = P.parse_outputs(h, len(spec.tensors))
    unreadable = [i for i in outputs if spec.readable is not None and i not in spec.readable]
    if unreadable:
        raise ProtocolError(Status.INVALID_REQUEST, f"outputs: tensor {unreadable[0]} has no memory after "
                                                    "compute (a leaf no node uses)")
    reply_bytes = sum(spec.tensors[i].nbytes for i in outputs)
    if reply_bytes > limits.max_blob:  # the reply is a frame too: max_blob bounds it as it does GET_TENSOR's
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"outputs: {reply_bytes} bytes exceed max_blob "
                                                   f"{limits.max_blob}; read large tensors with GET_TENSOR")
    bufs = {}
    for key in spec.buffers:
        buf = owned(key, buffer_of)
        bufs[key] = (buf.offset, buf.size)
    return Run(graph_id, spec, inputs, outputs, bufs, blob)


def check_graph_compute(h: dict, blob, limits: P.Limits, buffer_of: BufferOf, graphs: dict,
                        unsafe: bool = False) -> Run:
    """A GRAPH_COMPUTE, validated whole: the graph (schema, ops, placement in
    the client's buffers), the cached-graph bound, and the run."""
    graph_id = P.field_int(h, "graph_id", 0, default=0)

    def buffer_size(key):
        buf = buffer_of(key)
        return None if buf is None else buf.size

    spec = parse_unchecked(h, buffer_size) if unsafe else parse_graph(h, limits, buffer_size)
    if graph_id and graph_id not in graphs and len(graphs) >= limits.max_graphs:
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"cached graph limit {limits.max_graphs} reached; free one")
    cached = sum(len(g.tensors) for gid, g in graphs.items() if gid != graph_id) + len(spec.tensors)
    if graph_id and cached > limits.max_cached_tensors:
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"cached graphs would hold {cached} tensors, limit "
                                                   f"{limits.max_cached_tensors}; free one")
    return check_run(graph_id, spec, h, blob, limits, buffer_of, unsafe)


def cached_graph(h: dict, graphs: dict) -> tuple[int, GraphSpec | None]:
    """A GRAPH_RECOMPUTE's or GRAPH_FREE's graph: (id, the cached spec or None)."""
    graph_id = P.field_int(h, "graph_id", 1)
    return graph_id, graphs.get(graph_id)


def check_graph_recompute(graph_id: int, spec: GraphSpec, h: dict, blob, limits: P.Limits, buffer_of: BufferOf,
                          unsafe: bool = False) -> Run:
    """A recompute of cached `spec`: its buffers still held (one may have been
    freed since the graph was sent), and the run."""
    for key in spec.buffers:
        owned(key, buffer_of)
    return check_run(graph_id, spec, h, blob, limits, buffer_of, unsafe)


# ---------------------------------------------------------------- step links (docs/protocol.md, "Step links")

TOKEN_BYTES = 16
MAX_PEERS = 64
MAX_FORWARD = 16
MAX_INPUT_TIMEOUT = 3600.0


@dataclass(frozen=True)
class StepInput:
    tensor: int  # the graph's input leaf the bytes are bound to (checked as any inline input)
    tag: int
    timeout: float


@dataclass(frozen=True)
class Forward:
    to: str  # "host:port", one of the session's peers
    token: bytes
    tag: int


@dataclass(frozen=True)
class StepLink:
    input: StepInput | None
    forward: tuple
    reply_output: bool = False  # the reply carries the outputs even when every push succeeded


def _token(h: dict, key: str = "token") -> bytes:
    token = h.get(key)
    if type(token) is not bytes or len(token) != TOKEN_BYTES:
        raise ProtocolError(Status.INVALID_REQUEST, f"field {key!r} must be {TOKEN_BYTES} bytes")
    return token


def _endpoint(v) -> str:
    from rpc_daemon.client import parse_endpoint
    if not isinstance(v, str) or len(v) > 255:
        raise ProtocolError(Status.INVALID_REQUEST, "a peer must be a 'host:port' string of at most 255 characters")
    try:
        parse_endpoint(v)
    except ValueError as exc:
        raise ProtocolError(Status.INVALID_REQUEST, f"peer {v!r}: {exc}") from None
    return v


def check_step_peers(h: dict) -> tuple[bytes, frozenset]:
    """STEP_PEERS: the session's token and the workers its steps may forward to."""
    token = _token(h)
    peers = P.field_list(h, "peers", MAX_PEERS, default=[])
    return token, frozenset(_endpoint(p) for p in peers)


def check_step_input(h: dict) -> tuple[bytes, int, bool]:
    """STEP_INPUT: token, tag, and whether it cancels the tag."""
    return _token(h), P.field_int(h, "tag"), P.field_bool(h, "cancel")


def check_step_link(h: dict) -> StepLink:
    """A compute request's optional `step_input` and `forward` (their shape;
    the session's peers are checked by daemon/peers.py)."""
    step_input = None
    raw = h.get("step_input")
    if raw is not None:
        if not isinstance(raw, dict):
            raise ProtocolError(Status.INVALID_REQUEST, "field 'step_input' must be a map")
        timeout = raw.get("timeout")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_INPUT_TIMEOUT:
            raise ProtocolError(Status.INVALID_REQUEST, f"step_input 'timeout' must be a number of seconds in "
                                                        f"(0, {MAX_INPUT_TIMEOUT:g}]")
        step_input = StepInput(P.field_int(raw, "tensor"), P.field_int(raw, "tag"), float(timeout))
    forward = []
    for f in P.field_list(h, "forward", MAX_FORWARD, default=[]):
        if not isinstance(f, dict):
            raise ProtocolError(Status.INVALID_REQUEST, "each 'forward' entry must be a map")
        forward.append(Forward(_endpoint(f.get("to")), _token(f), P.field_int(f, "tag")))
    reply_output = h.get("reply_output", False)
    if type(reply_output) is not bool:
        raise ProtocolError(Status.INVALID_REQUEST, "field 'reply_output' must be a bool")
    return StepLink(step_input, tuple(forward), reply_output)


# ---------------------------------------------------------------- tensor links (docs/protocol.md, "Tensor links")

MAX_GROUP = 16  # members of one tensor-parallel group
MAX_LINK_TIMEOUT = 120.0  # seconds a join waits for its peers
MAX_EXCHANGE_TIMEOUT = 3600.0  # seconds an exchange of a compute waits for a peer
MAX_EXCHANGES = 4096  # all-reduces in one compute
MAX_EXCHANGE_BYTES = 256 << 20  # one partial sum


@dataclass(frozen=True)
class TensorPeer:
    rank: int
    host: str
    port: int
    ticket: bytes


@dataclass(frozen=True)
class TensorLinkRequest:
    op: str  # "listen": open a listener, reply its port and ticket; "join": link with `peers`; "rtt": time `peer`
    link: int
    rank: int = 0
    n: int = 0
    peers: tuple = ()  # TensorPeer, one per lower rank (connected to); higher ranks connect here
    timeout: float = 10.0
    peer: str = ""  # rtt: the worker ("host:port") whose round trip from here to time
    count: int = 0  # rtt: how many PINGs


def _seconds(h: dict, key: str, hi: float, default: float) -> float:
    v = h.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= hi:
        raise ProtocolError(Status.INVALID_REQUEST, f"field {key!r} must be a number of seconds in (0, {hi:g}]")
    return float(v)


def _link_host(host) -> str:
    """A join peer's `host`: a name or address a socket can connect to and TLS can verify (no
    control characters, IDNA-encodable: the TLS phase names the peer by it)."""
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        raise ProtocolError(Status.INVALID_REQUEST, "a peer's 'host' must be a string of 1..255 characters")
    try:
        host.encode("idna")
    except UnicodeError:
        raise ProtocolError(Status.INVALID_REQUEST, f"a peer's 'host' {host!r} is not a host name or address") from None
    if any(ord(ch) < 0x21 or ord(ch) == 0x7F for ch in host):
        raise ProtocolError(Status.INVALID_REQUEST, f"a peer's 'host' {host!r} holds a control character or space")
    return host


MAX_RTT_PINGS = 16  # TENSOR_LINK rtt: PINGs to a peer worker in one request


def check_tensor_link(h: dict) -> TensorLinkRequest:
    op = h.get("op")
    if op == "rtt":  # no link: the round trip to a peer worker, as a tensor link's exchanges would see it
        return TensorLinkRequest("rtt", 0, peer=_endpoint(h.get("peer")),
                                 count=P.field_int(h, "count", 1, MAX_RTT_PINGS))
    link = P.field_int(h, "link", 1)
    if op == "listen":
        return TensorLinkRequest("listen", link)
    if op != "join":
        raise ProtocolError(Status.INVALID_REQUEST, "field 'op' must be 'listen', 'join' or 'rtt'")
    n = P.field_int(h, "n", 2, MAX_GROUP)
    rank = P.field_int(h, "rank", 0, n - 1)
    peers = []
    for p in P.field_list(h, "peers", MAX_GROUP, default=[]):
        if not isinstance(p, dict):
            raise ProtocolError(Status.INVALID_REQUEST, "each 'peers' entry must be a map")
        host = _link_host(p.get("host"))
        ticket = p.get("ticket")
        if type(ticket) is not bytes or len(ticket) != 32:
            raise ProtocolError(Status.INVALID_REQUEST, "a peer's 'ticket' must be 32 bytes")
        peers.append(TensorPeer(P.field_int(p, "rank", 0, rank - 1), host, P.field_int(p, "port", 1, 65535), ticket))
    if sorted(p.rank for p in peers) != list(range(rank)):
        raise ProtocolError(Status.INVALID_REQUEST, f"rank {rank} joins every lower rank: 'peers' must name ranks "
                                                    f"0..{rank - 1} once each")
    return TensorLinkRequest("join", link, rank, n, tuple(peers), _seconds(h, "timeout", MAX_LINK_TIMEOUT, 10.0))


def check_tensor_cancel(h: dict) -> int | None:
    """The link a TENSOR_CANCEL names (1 .. 2^63-1), or None: absent, it ends whatever link the session has."""
    return None if h.get("link") is None else P.field_int(h, "link", 1)


@dataclass(frozen=True)
class TensorStep:
    """A compute's exchanges: after computing each `exchange` tensor, it is summed with the
    group's other members' over tensor link `link`, as step number `step`; or, where `gather`
    has the members' lengths for it, gathered from their pieces (docs/protocol.md, "Tensor links")."""
    link: int
    step: int
    exchange: tuple  # tensor indices, in the order the graph computes them
    timeout: float
    gather: tuple = ()  # per exchange: None (summed), or every member's length along dim 0, in rank order

    def compute_header(self, timeout_cap: float) -> dict:
        """The compute process's `tensor` field for this step (its waits capped at `timeout_cap`)."""
        header = {"link": self.link, "step": self.step, "exchange": self.exchange,
                  "timeout": min(self.timeout, timeout_cap)}
        if self.gather:
            header["gather"] = self.gather
        return header


def check_tensor_step(h: dict, spec: GraphSpec) -> TensorStep | None:
    raw = h.get("tensor")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ProtocolError(Status.INVALID_REQUEST, "field 'tensor' must be a map")
    exchange = P.field_list(raw, "exchange", MAX_EXCHANGES)
    gather = None if raw.get("gather") is None else P.field_list(raw, "gather", MAX_EXCHANGES)
    # every step of a graph names the same exchanges (and gathers): checked once per graph, by a key that
    # only plain ints make (1.0 and True equal 1 in a set, and must be refused as they are the first time)
    key = _plain_key(exchange, gather)
    if key is None or key not in spec.checked_exchanges:
        _check_exchange(exchange, spec)
        gathered = _check_gather(gather, exchange, spec)
        if key is not None:
            if len(spec.checked_exchanges) >= 4:  # a graph has one list; a client sending others gains no memory
                spec.checked_exchanges.clear()
            spec.checked_exchanges.add(key)
    else:
        gathered = key[1]
    return TensorStep(P.field_int(raw, "link", 1), P.field_int(raw, "step", 0), tuple(exchange),
                      _seconds(raw, "timeout", MAX_EXCHANGE_TIMEOUT, 600.0), gathered)


def _plain_key(exchange: list, gather: list | None) -> tuple | None:
    """(exchange, gather) as a set key when every entry is a plain int (a gather entry: nil, or a
    list of them); None for anything else, which is then checked in full (and refused)."""
    if any(type(i) is not int for i in exchange):
        return None
    if gather is None:
        return tuple(exchange), ()
    if any(g is not None and (type(g) is not list or any(type(n) is not int for n in g)) for g in gather):
        return None
    return tuple(exchange), tuple(None if g is None else tuple(g) for g in gather)


def _check_exchange(exchange: list, spec: GraphSpec) -> None:
    nodes = set(spec.nodes)
    seen = set()
    for i in exchange:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(spec.tensors):
            raise ProtocolError(Status.INVALID_REQUEST, f"tensor.exchange: {i!r} is not a tensor of the graph")
        t = spec.tensors[i]
        if i not in nodes or t.is_view or i in seen:
            raise ProtocolError(Status.INVALID_REQUEST, f"tensor.exchange: tensor {i} must be a computed node, "
                                                        f"not a view, named once")
        if t.type != 0 or t.nb != canonical_nb(t.type, t.ne):  # GGML_TYPE_F32, contiguous
            raise ProtocolError(Status.INVALID_REQUEST, f"tensor.exchange: tensor {i} must be a contiguous f32 tensor")
        if t.nbytes > MAX_EXCHANGE_BYTES:
            raise ProtocolError(Status.LIMIT_EXCEEDED, f"tensor.exchange: tensor {i} is {t.nbytes} bytes, limit "
                                                       f"{MAX_EXCHANGE_BYTES}")
        if spec.readable is not None and i not in spec.readable:
            raise ProtocolError(Status.INVALID_REQUEST, f"tensor.exchange: tensor {i} has no memory after compute")
        seen.add(i)


def _check_gather(gather: list | None, exchange: list, spec: GraphSpec) -> tuple:
    """`tensor.gather` (absent: every exchange summed): one entry per exchange, nil or the group's
    members' lengths along dim 0 in rank order (2..16 of them, each at least 1), summing to the
    exchanged tensor's ne[0]; that tensor a PAD of a contiguous f32 source padded in dim 0 only,
    the member's own piece (which the compute process checks against its rank)."""
    if gather is None:
        return ()
    if len(gather) != len(exchange):
        raise ProtocolError(Status.INVALID_REQUEST, f"tensor.gather has {len(gather)} entries for "
                                                    f"{len(exchange)} exchanges")
    checked = []
    for i, lengths in zip(exchange, gather):
        if lengths is None:
            checked.append(None)
            continue
        where = f"tensor.gather for tensor {i}"
        if (not isinstance(lengths, list) or not 2 <= len(lengths) <= MAX_GROUP
                or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1 << 31 for n in lengths)):
            raise ProtocolError(Status.INVALID_REQUEST, f"{where}: must be nil or a list of 2..{MAX_GROUP} lengths, "
                                                        f"each an integer of at least 1")
        t = spec.tensors[i]
        src = spec.tensors[t.src[0]] if t.op == lib.GGML_OP_PAD and t.src else None
        if (src is None or src.type != 0 or src.nb != canonical_nb(src.type, src.ne)
                or any(t.param_i32(k) for k in range(2, 9)) or src.ne[1:] != t.ne[1:]):
            raise ProtocolError(Status.INVALID_REQUEST, f"{where}: the tensor must be a PAD of a contiguous f32 "
                                                        f"tensor, padded in dim 0 only")
        if sum(lengths) != t.ne[0]:
            raise ProtocolError(Status.INVALID_REQUEST, f"{where}: the lengths {lengths} sum to {sum(lengths)}, "
                                                        f"the tensor's ne[0] is {t.ne[0]}")
        checked.append(tuple(lengths))
    return tuple(checked)
