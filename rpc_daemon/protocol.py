"""The wire protocol, sans I/O: framing, command table, request schemas.

A frame is a 12-byte prefix `<u32 header_len><u64 blob_len>` (little endian),
a msgpack map of `header_len` bytes, then `blob_len` raw bytes. Tensor data
travels in the blob so the daemon can read it straight into its destination.
Everything here is a pure function over bytes and dicts, or the sans-I/O
FrameReader that client and daemon share; docs/protocol.md is the spec.
Nothing is allocated for a frame before its prefix passed `Limits` (before
authentication: the pre-auth bound), and then only as its bytes arrive.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import msgpack

PROTOCOL_VERSION = 1
FEATURES = ("graph_reuse", "tensor_cache", "inline_inputs")
PREFIX = struct.Struct("<IQ")


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
    AUTH = 13  # second half of an authenticated HELLO (rpc_daemon/auth.py)


class ProtocolError(Exception):
    """A request the daemon refuses. `fatal` means the framing can no longer be
    trusted, so the connection is closed after the reply."""

    def __init__(self, status: Status, message: str, fatal: bool = False):
        super().__init__(message)
        self.status = Status(status)
        self.message = message
        self.fatal = fatal


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


# ---------------------------------------------------------------- framing

def encode_prefix(header_len: int, blob_len: int) -> bytes:
    return PREFIX.pack(header_len, blob_len)


def encode_frame(header: dict, blob_len: int = 0) -> bytes:
    """Prefix plus header; the caller sends `blob_len` bytes of blob after it."""
    body = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(len(body), blob_len) + body


def parse_prefix(prefix: bytes, limits: Limits, authenticated: bool = True) -> tuple[int, int]:
    """(header_len, blob_len) of a frame prefix within `limits`; before
    authentication, within the pre-auth bound (a small header, no blob)."""
    if len(prefix) != PREFIX.size:
        raise ProtocolError(Status.INVALID_REQUEST, "truncated frame prefix", fatal=True)
    header_len, blob_len = PREFIX.unpack(prefix)
    if not authenticated:
        if header_len == 0 or header_len > limits.max_preauth_header:
            raise ProtocolError(Status.LIMIT_EXCEEDED, f"frame header_len {header_len} outside "
                                f"1..{limits.max_preauth_header} before authentication", fatal=True)
        if blob_len:
            raise ProtocolError(Status.LIMIT_EXCEEDED, f"frame blob_len {blob_len}: no blob before "
                                "authentication", fatal=True)
        return header_len, blob_len
    if header_len == 0 or header_len > limits.max_header:
        raise ProtocolError(Status.LIMIT_EXCEEDED,
                            f"frame header_len {header_len} outside 1..{limits.max_header}", fatal=True)
    if blob_len > limits.max_blob:
        raise ProtocolError(Status.LIMIT_EXCEEDED,
                            f"frame blob_len {blob_len} exceeds max_blob {limits.max_blob}", fatal=True)
    return header_len, blob_len


COUNTED_HEADER = 1 << 16  # headers from this size have their containers counted while decoding


class _TooManyContainers(Exception):
    pass


def _container_budget(limit: int):
    """A hook for msgpack's list_hook/object_hook that stops the decode after `limit`
    arrays and maps: the decoder's own bounds are per container, not per header."""
    left = [limit]

    def hook(obj):
        left[0] -= 1
        if left[0] < 0:
            raise _TooManyContainers
        return obj
    return hook


def decode_header(data: bytes, limits: Limits) -> dict:
    hooks = {}
    if len(data) >= COUNTED_HEADER:  # a smaller header cannot hold enough to matter; decodes at full speed
        hook = _container_budget(limits.max_header_containers)
        hooks = {"list_hook": hook, "object_hook": hook}
    try:
        header = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_str_len=limits.max_header, max_bin_len=limits.max_header,
            max_array_len=limits.max_graph_tensors * 4, max_map_len=1 << 16, **hooks)
    except _TooManyContainers:
        raise ProtocolError(Status.LIMIT_EXCEEDED, f"header has more than {limits.max_header_containers} arrays "
                                                   f"and maps") from None
    except Exception as exc:
        raise ProtocolError(Status.INVALID_REQUEST, f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(Status.INVALID_REQUEST, "header must be a msgpack map")
    return header


DISCARD = "discard"  # FrameSink.header's answer for a blob to skip (a refused request's)


class FrameSink:
    """What the daemon plugs into a FrameReader (the client uses none: frames
    are returned by `received`). Called synchronously, frame after frame, so
    what a frame changes (authentication, the queue) applies to the next one,
    even within the same receive."""

    def header(self, header: dict | None, error: ProtocolError | None, blob_len: int):
        """A header is read (`error` set if it is not a valid msgpack map).
        Return where the blob goes: None (into memory, grown as it arrives),
        a memoryview of exactly blob_len bytes (straight into its destination)
        or DISCARD (read and dropped)."""
        return DISCARD if error is not None else None

    def frame(self, header: dict | None, error: ProtocolError | None, blob, direct: bool, header_len: int) -> None:
        """A frame is complete; `blob` is a memoryview (of the destination if `direct`)."""

    def hold(self) -> bool:
        """After each frame: True to stop parsing; the bytes left are kept
        until `FrameReader.resume()` (backpressure, or the connection closing)."""
        return False


class FrameReader:
    """Incremental frame decoder, sans-I/O, shared by the client and the
    daemon. The I/O layer receives into `buffer()` and reports the count to
    `received(n)`. Prefixes, headers and small blobs, however many frames
    arrive together, are cut out of one receive buffer in one pass; a large
    blob is received straight into its own memory, or (daemon) into the
    destination the sink names, with no further copy.

    Memory is committed as bytes arrive, never as a prefix claims: a prefix or
    header split over receives is kept as far as it has arrived; a blob read
    into memory starts at min(blob_len, BLOB_CHUNK) and at most doubles as it
    fills, unless `eager_blobs` (the client, which trusts its worker's replies
    up to `max_blob`: one allocation of blob_len, no copies). While not
    `authenticated`, a prefix must pass the pre-auth bound (`parse_prefix`).

    Without a sink, `received` returns the completed frames as (header, blob)
    pairs (blob: bytes, or a bytearray for a large one) and raises
    ProtocolError on a bad prefix or header. With a sink, frames go to it and
    only a bad prefix raises (the stream cannot be resynchronized after it)."""

    BLOB_CHUNK = 1 << 16  # a blob read into memory starts with this much room (or less)
    LARGE = 1 << 16  # without a sink, blobs from this size are delivered in their own bytearray

    def __init__(self, limits: Limits, size: int = 1 << 17, *, sink: FrameSink | None = None,
                 authenticated: bool = True, eager_blobs: bool = True):
        self.limits = limits
        self.sink = sink
        self.authenticated = authenticated
        self.eager_blobs = eager_blobs
        self._rx = memoryview(bytearray(size))
        self._rx_used = False
        self._kept = b""  # bytes received while the sink held parsing
        self._frames: list | None = None
        self._closed = False
        self._reset()

    def _reset(self) -> None:
        self._stage = "prefix"  # then "header", then "blob" or "discard"
        self._part = bytearray()  # a prefix or header split over receives, as far as it has arrived
        self._header_len = self._blob_len = 0
        self._blob: bytearray | None = None  # blob received into memory
        self._dest: memoryview | None = None  # the sink's destination for the blob
        self._pos = 0  # blob bytes received (or discarded)
        self._header: dict | None = None
        self._error: ProtocolError | None = None

    def resize(self, size: int) -> None:
        """A receive buffer of `size` bytes from the next receive on (a receive
        in progress keeps its view of the old one)."""
        self._rx = memoryview(bytearray(size))

    def buffer(self) -> memoryview:
        self._rx_used = self._stage != "blob"
        if self._rx_used:  # prefix, header, discard: through the receive buffer
            return self._rx
        if self._dest is not None:
            return self._dest[self._pos:]
        if self._blob is None:
            self._blob = bytearray(self._blob_len) if self.eager_blobs else bytearray()
        if self._pos == len(self._blob):
            self._grow(self._pos + 1)
        return memoryview(self._blob)[self._pos:]

    def received(self, n: int) -> list[tuple[dict, bytes]]:
        if self._closed:
            return []
        frames = self._frames = []
        try:
            if self._rx_used:
                self._rx_used = False
                self._consume(self._rx[:n])
            else:
                self._pos += n
                if self._pos >= self._blob_len:
                    self._done()
        finally:
            self._frames = None
        return frames

    def resume(self) -> None:
        """Parse the bytes kept when the sink held (frames go to the sink)."""
        data, self._kept = self._kept, b""
        if data:
            self._consume(memoryview(data))

    def close(self) -> None:
        """Forget the frame in progress and any kept bytes (drops views into a
        destination) and the sink (no reference cycle with it); what is
        received afterwards is dropped."""
        self._reset()
        self._kept = b""
        self.sink = None
        self._closed = True

    @property
    def held(self) -> bool:
        """Bytes are kept, waiting for resume()."""
        return bool(self._kept)

    @property
    def partial(self) -> bool:
        """A frame has started but not completed."""
        return self._stage != "prefix" or bool(self._part)

    def _grow(self, need: int) -> None:
        cap = min(self._blob_len, max(need, 2 * len(self._blob), self.BLOB_CHUNK))
        grown = bytearray(cap)  # a new one: the transport may still hold a view of the old one
        grown[: self._pos] = memoryview(self._blob)[: self._pos]
        self._blob = grown

    def _consume(self, data: memoryview) -> None:
        pos, n = 0, len(data)
        limits, sink, frames = self.limits, self.sink, self._frames
        while pos < n:
            stage = self._stage
            if stage == "prefix" and not self._part and n - pos >= PREFIX.size:
                header_len, blob_len = parse_prefix(data[pos: pos + PREFIX.size], limits, self.authenticated)
                start = pos + PREFIX.size + header_len
                end = start + blob_len
                if end <= n:  # the whole frame is here (the common case): one pass, no state
                    error = None
                    try:
                        header = decode_header(data[pos + PREFIX.size: start], limits)
                    except ProtocolError as exc:
                        if sink is None:
                            raise
                        header, error = None, exc
                    pos = end
                    if sink is None:
                        frames.append((header, b"" if not blob_len else bytes(data[start:end])
                                       if blob_len < self.LARGE else bytearray(data[start:end])))
                        continue
                    where = sink.header(header, error, blob_len)
                    if not blob_len or where is DISCARD:
                        sink.frame(header, error, memoryview(b""), False, header_len)
                    elif where is not None:
                        where[:] = data[start:end]
                        sink.frame(header, error, where, True, header_len)
                    else:
                        sink.frame(header, error, memoryview(bytearray(data[start:end])), False, header_len)
                    if pos < n and sink.hold():
                        self._kept += bytes(data[pos:])
                        return
                    continue
                self._header_len, self._blob_len, self._stage = header_len, blob_len, "header"
                pos += PREFIX.size
                continue
            if stage == "prefix" or stage == "header":
                want = PREFIX.size if stage == "prefix" else self._header_len
                if not self._part and n - pos >= want:
                    part = data[pos: pos + want]
                    pos += want
                else:  # split over receives: keep what has arrived, no more
                    k = min(n - pos, want - len(self._part))
                    self._part += data[pos: pos + k]
                    pos += k
                    if len(self._part) < want:
                        return
                    part, self._part = self._part, bytearray()
                if stage == "prefix":
                    self._header_len, self._blob_len = parse_prefix(bytes(part), limits, self.authenticated)
                    self._stage = "header"
                    continue
                self._header_read(part)
            else:
                k = min(n - pos, self._blob_len - self._pos)
                if stage == "blob":
                    if self._dest is not None:
                        self._dest[self._pos: self._pos + k] = data[pos: pos + k]
                    elif self._blob is None and k == self._blob_len:  # all here: one copy, out of the receive
                        small = sink is None and k < self.LARGE
                        self._blob = (bytes if small else bytearray)(data[pos: pos + k])
                    else:
                        if self._blob is None:
                            self._blob = bytearray(self._blob_len) if self.eager_blobs else bytearray()
                        if self._pos + k > len(self._blob):
                            self._grow(self._pos + k)
                        self._blob[self._pos: self._pos + k] = data[pos: pos + k]
                self._pos += k
                pos += k
                if self._pos < self._blob_len:
                    return
                self._done()
            if sink is not None and self._stage == "prefix" and pos < n and sink.hold():
                self._kept += bytes(data[pos:])
                return

    def _header_read(self, raw) -> None:
        try:
            self._header = decode_header(raw, self.limits)
        except ProtocolError as exc:
            if self.sink is None:
                raise
            self._error = exc
        where = self.sink.header(self._header, self._error, self._blob_len) if self.sink is not None else None
        if self._blob_len == 0:
            self._done()
        elif where is DISCARD:
            self._stage, self._pos = "discard", 0
        elif where is not None:
            if len(where) != self._blob_len:
                raise ValueError("the sink's destination must be exactly blob_len bytes")
            self._stage, self._dest, self._pos = "blob", where, 0
        else:  # into memory: allocated when its bytes come (all at once if they are all here)
            self._stage, self._pos = "blob", 0

    def _done(self) -> None:
        header, error, dest, blob, stage = self._header, self._error, self._dest, self._blob, self._stage
        header_len = self._header_len
        self._reset()
        if self.sink is None:
            if stage != "blob":
                blob = b""
            elif len(blob) < self.LARGE and type(blob) is not bytes:
                blob = bytes(blob)
            self._frames.append((header, blob))
            return
        if stage != "blob":
            self.sink.frame(header, error, memoryview(b""), False, header_len)
        elif dest is not None:
            self.sink.frame(header, error, dest, True, header_len)
        else:
            self.sink.frame(header, error, memoryview(blob), False, header_len)


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


def check_hello(h: dict) -> dict:
    version = h.get("version")
    if type(version) is not int or version != PROTOCOL_VERSION:  # true and 1.0 are not 1
        raise ProtocolError(Status.VERSION_MISMATCH,
                            f"protocol version {version!r} not supported; this daemon speaks {PROTOCOL_VERSION}",
                            fatal=True)
    return h
