"""The wire protocol, sans I/O: statuses, commands, limits, reply headers,
field checks and request schemas; framing.py cuts the frames.

Everything here is a pure function over decoded headers (dicts); docs/protocol.md
is the spec.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

# 2: HELLO carries `ggml` (version and op-table fingerprint); a graph's op and
# type numbers mean something only between processes running the same op table
PROTOCOL_VERSION = 2
FEATURES = ("graph_reuse", "tensor_cache", "inline_inputs", "step_links", "step_reply_output", "tensor_links",
            "dot_type_inputs", "step_channel", "concat", "tensor_rtt", "pad",
            "tensor_gather")


class Status(IntEnum):
    # ggml's own status codes (enum ggml_status)
    SUCCESS = 0
    ABORTED = 1
    FAILED = -1
    ALLOC_FAILED = -2
    # protocol errors
    INVALID_REQUEST = -100
    UNKNOWN_COMMAND = -101
    NOT_AUTHORIZED = -102
    LIMIT_EXCEEDED = -103
    VERSION_MISMATCH = -104
    NOT_FOUND = -105  # e.g. SET_TENSOR_HASH for content the cache does not hold
    INPUT_MISSING = -106  # a step's input from another worker did not come (timed out, or cancelled)
    LINK_FAILED = -107  # a tensor-parallel exchange failed: the peer's link closed, was cancelled or timed out


class Command(IntEnum):
    HELLO = 0
    DEVICE_INFO = 1
    ALLOC_BUFFER = 2
    FREE_BUFFER = 3
    BUFFER_CLEAR = 4
    SET_TENSOR = 5
    GET_TENSOR = 6
    COPY_TENSOR = 7
    SET_TENSOR_HASH = 8
    GRAPH_COMPUTE = 9
    GRAPH_RECOMPUTE = 10
    GRAPH_FREE = 11
    PING = 12
    AUTH = 13  # second half of an authenticated HELLO (rpc_daemon/wire/auth.py)
    STEP_PEERS = 14  # which workers this session's steps may forward to, and its token (daemon/peers.py)
    STEP_INPUT = 15  # a step's input for a session, from a peer worker or from the client itself
    TENSOR_LINK = 16  # link this session's compute process with its tensor-parallel peers' (daemon/tensor_links.py)
    TENSOR_CANCEL = 17  # end this session's waits on its tensor link now (a peer failed)
    STEP_CHANNEL = 18  # a connection straight to this session's compute process for its steps (daemon/step_channel.py)


class ProtocolError(Exception):
    """A request the daemon refuses. `fatal` means the framing can no longer be
    trusted, so the connection is closed after the reply. `fields` go into the
    refusal's reply header too."""

    def __init__(self, status: Status, message: str, fatal: bool = False, fields: dict | None = None):
        super().__init__(message)
        self.status = Status(status)
        self.message = message
        self.fatal = fatal
        self.fields = fields or {}


@dataclass(frozen=True)
class Limits:
    max_header: int = 16 << 20  # msgpack part: graphs of many thousands of tensors
    max_blob: int = 1 << 30  # raw part: one SET_TENSOR chunk, inline inputs
    max_graph_tensors: int = 65536
    max_buffers: int = 4096
    max_graphs: int = 64  # cached graphs per client
    max_client_bytes: int = 0  # bytes of buffers one client may hold; 0 = the daemon's --mem cap
    # before authentication (HELLO, or AUTH with a secret) a frame is at most this
    # header and no blob: HELLO and AUTH are ~100 bytes, and nothing is earned yet
    max_preauth_header: int = 4096
    # bytes of frames (header + blob held in daemon memory) received and queued but not
    # yet handled, per connection; past it the daemon stops reading until they drain
    max_inflight: int = 64 << 20
    # tensors of all the graphs one client has cached: each costs about 1.5 KiB of daemon and
    # compute-process memory that --mem does not see (a 64-tensor decode graph is 100 KiB)
    max_cached_tensors: int = 131072

    @property
    def max_header_containers(self) -> int:
        """Arrays and maps in one header. A header of nested empty arrays decodes to ~64
        bytes of Python objects per byte and holds the event loop while it does; the
        largest graph (max_graph_tensors maps with their ne/nb/src lists, plus inputs)
        needs about 5 per tensor."""
        return 8 * self.max_graph_tensors + 1024


def reply_header(request_id, status: Status, message: str = "", **fields) -> dict:
    header = {"id": request_id, "status": int(status)}
    if message:
        header["error"] = message
    header.update(fields)
    return header


# ---------------------------------------------------------------- field checks

def field_int(h: dict, key: str, lo: int = 0, hi: int = (1 << 63) - 1, default=None) -> int:
    v = h.get(key, default)
    if v is None:
        raise ProtocolError(Status.INVALID_REQUEST, f"field {key!r} is required")
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(Status.INVALID_REQUEST, f"field {key!r} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(Status.INVALID_REQUEST, f"field {key!r}={v} outside {lo}..{hi}")
    return v


def field_bool(h: dict, key: str, default: bool = False) -> bool:
    """An optional bool field: absent (or nil) is `default`; an int is not a bool."""
    v = h.get(key)
    if v is None:
        return default
    if type(v) is not bool:
        raise ProtocolError(Status.INVALID_REQUEST, f"field {key!r} must be a bool, got {type(v).__name__}")
    return v


def command(h: dict) -> int:
    """The request's `cmd`: an int (a bool or a float equal to a command is not one)."""
    cmd = h.get("cmd")
    if type(cmd) is not int:
        raise ProtocolError(Status.INVALID_REQUEST, f"field 'cmd' must be an integer, got {cmd!r:.40}")
    return cmd


def field_bytes(h: dict, key: str, max_len: int, default=None) -> bytes:
    v = h.get(key, default)
    if not isinstance(v, (bytes, bytearray)):
        raise ProtocolError(Status.INVALID_REQUEST, f"field {key!r} must be bytes")
    if len(v) > max_len:
        raise ProtocolError(Status.INVALID_REQUEST, f"field {key!r} longer than {max_len} bytes")
    return bytes(v)


def field_list(h: dict, key: str, max_len: int, default=None) -> list:
    v = h.get(key, default)
    if not isinstance(v, list):
        raise ProtocolError(Status.INVALID_REQUEST, f"field {key!r} must be a list")
    if len(v) > max_len:
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"field {key!r} has {len(v)} entries, limit {max_len}")
    return v


# ---------------------------------------------------------------- requests

@dataclass(frozen=True)
class ByteRange:
    """`size` bytes at `offset` in the client's buffer `buffer`."""
    buffer: int
    offset: int
    size: int


def parse_range(h: dict, prefix: str = "") -> ByteRange:
    return ByteRange(field_int(h, prefix + "buffer", 1), field_int(h, prefix + "offset"),
                     field_int(h, "size"))


def parse_set_tensor(h: dict, blob_len: int) -> tuple[ByteRange, bool]:
    """Every field of a SET_TENSOR but buffer ownership and bounds (the
    connection's): (range, cache). Checked before a byte of its blob lands."""
    r = parse_range(h)
    cache = field_bool(h, "cache")
    if r.size != blob_len:
        raise ProtocolError(Status.INVALID_REQUEST, f"size {r.size} != blob length {blob_len}")
    return r, cache


@dataclass(frozen=True)
class InputSpec:
    """Inline data for graph tensor `tensor`: `size` bytes at `blob_offset` of the blob."""
    tensor: int
    blob_offset: int
    size: int


def parse_inputs(h: dict, blob_len: int, n_tensors: int | None) -> list[InputSpec]:
    specs = []
    for i, item in enumerate(field_list(h, "inputs", 1 << 16, default=[])):
        if not (isinstance(item, list) and len(item) == 3 and all(type(v) is int for v in item)):
            raise ProtocolError(Status.INVALID_REQUEST, f"inputs[{i}] must be [tensor, blob_offset, size]")
        t, off, size = item
        if t < 0 or (n_tensors is not None and t >= n_tensors):
            raise ProtocolError(Status.INVALID_REQUEST, f"inputs[{i}] names tensor {t}, not in the graph")
        if off < 0 or size < 0 or off + size > blob_len:
            raise ProtocolError(Status.INVALID_REQUEST, f"inputs[{i}] data [{off}, {off + size}) outside the blob of {blob_len} bytes")
        specs.append(InputSpec(t, off, size))
    return specs


def parse_outputs(h: dict, n_tensors: int | None) -> list[int]:
    out = []
    for i, t in enumerate(field_list(h, "outputs", 1 << 16, default=[])):
        if type(t) is not int or t < 0 or (n_tensors is not None and t >= n_tensors):
            raise ProtocolError(Status.INVALID_REQUEST, f"outputs[{i}]={t!r} is not a tensor of the graph")
        out.append(t)
    if len(set(out)) != len(out):  # a tensor named twice would be copied into the reply twice
        raise ProtocolError(Status.INVALID_REQUEST, "outputs names a tensor more than once")
    return out


def check_hello(h: dict, ggml: dict | None = None) -> dict:
    """`ggml` is this side's {"version", "op_table"} (ggml_ffi.ggml_identity);
    a HELLO that carries `ggml` must have the same op table."""
    version = h.get("version")
    if type(version) is not int or version != PROTOCOL_VERSION:  # true and 1.0 are not 1
        raise ProtocolError(Status.VERSION_MISMATCH,
                            f"protocol version {version!r} not supported; this daemon speaks {PROTOCOL_VERSION}",
                            fatal=True)
    if ggml is not None and "ggml" in h:
        check_same_ggml(h["ggml"], ggml, "the client", "this daemon")
    return h


def check_same_ggml(theirs, ours: dict, who: str, us: str) -> None:
    """Refuse a peer whose ggml op table differs from ours: its op and type
    numbers would name other ops, and it would compute something else."""
    if not (isinstance(theirs, dict) and isinstance(theirs.get("op_table"), str)
            and isinstance(theirs.get("version"), str)):
        raise ProtocolError(Status.VERSION_MISMATCH, f"`ggml` must be {{version: str, op_table: str}}", fatal=True)
    if theirs["op_table"] != ours["op_table"]:
        raise ProtocolError(Status.VERSION_MISMATCH,
                            f"ggml mismatch: {who} runs ggml {theirs['version'][:32]} (op table "
                            f"{theirs['op_table'][:32]}), {us} runs ggml {ours['version']} (op table "
                            f"{ours['op_table']}); every machine of a cluster must run the same ggml", fatal=True)
