"""Framing, sans I/O, shared by the client and the daemon: the 12-byte prefix,
the msgpack header, and FrameReader, which cuts frames out of a receive buffer.

A frame is a 12-byte prefix `<u32 header_len><u64 blob_len>` (little endian),
a msgpack map of `header_len` bytes, then `blob_len` raw bytes. Nothing is
allocated for a frame before its prefix passed `Limits` (before
authentication: the pre-auth bound), and then only as its bytes arrive.
A client also bounds each reply's blob by what its request implies
(`reply_blob_bound`, `check_reply_blob`), on the prefix, before anything is
allocated for it.
"""
from __future__ import annotations

import struct

import msgpack

from rpc_daemon.wire.protocol import Command, Limits, ProtocolError, Status

PREFIX = struct.Struct("<IQ")


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


class ReplyTooLarge(ProtocolError):
    """A reply whose blob is larger than its request implies (`check_reply_blob`):
    a lying or broken worker. `header` is None when it was refused on the prefix
    alone (before the header said which request it answers)."""

    def __init__(self, blob_len: int, bound: int, header: dict | None):
        what = "the requests outstanding imply" if header is None else \
            f"its request (id {header.get('id')!r}) implies"
        super().__init__(Status.LIMIT_EXCEEDED, f"reply blob_len {blob_len} exceeds the {bound} bytes {what}",
                         fatal=True)
        self.blob_len, self.bound, self.header = blob_len, bound, header


def reply_blob_bound(cmd: int, fields: dict | None, max_blob: int) -> int:
    """The most reply data (blob bytes) request `cmd` with `fields` can be
    answered with, as far as its fields say: GET_TENSOR its `size`;
    GRAPH_COMPUTE and GRAPH_RECOMPUTE the sum of their outputs' sizes, which
    the fields do not spell out, so `max_blob` here (a client that knows the
    graph passes the exact sum instead); every other command, and every error
    reply, none."""
    if cmd == Command.GET_TENSOR:
        size = (fields or {}).get("size")
        return min(size, max_blob) if type(size) is int and size > 0 else 0
    if cmd in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE):
        return max_blob
    return 0


def check_reply_blob(blob_len: int, bound: int, header: dict | None = None) -> None:
    """The client's rule for a reply's blob: at most `bound` bytes, what the
    request it answers implies. Checked twice, both times before anything is
    allocated for the blob: on the 12-byte prefix with the largest bound of the
    requests the reply may answer (`header` None), and once the header is
    read with the bound of the request its `id` names. Past it the stream
    cannot be trusted: ReplyTooLarge (LIMIT_EXCEEDED, fatal)."""
    if blob_len > bound:
        raise ReplyTooLarge(blob_len, bound, header)


try:  # CPython's own resize: a bytearray's memory, allocated and not written (bytearray(n) zeroes it)
    import ctypes
    _resize = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_ssize_t)(
        ("PyByteArray_Resize", ctypes.pythonapi))
except Exception:  # pragma: no cover - not CPython, or no ctypes: bytearray(n), zeroed
    _resize = None
UNZEROED_FROM = 1 << 20  # bytes: a blob this large is allocated without bytearray(n)'s zeroing


def blob_memory(n: int) -> bytearray:
    """A bytearray of `n` bytes for a blob about to be received, every byte of it, before anyone
    reads it: from UNZEROED_FROM bytes not zeroed first. Zeroing wrote every byte of a
    268 MB reply (a step's every row's logits) on the client's event loop thread, 0.1-0.5 s
    before its first byte was taken; untouched, its pages are mapped as the bytes land, a
    receive at a time. The same object (a bytearray) either way: whoever takes the blob sees
    no difference. (Huge pages, madvise MADV_HUGEPAGE, were tried: a third of the CPU time to
    map them and a twentieth to free, but the kernel compacting memory for the first ones
    stalled the loop 35-55 ms, against 15-20 ms in 4 KiB pages.)"""
    if n < UNZEROED_FROM or _resize is None:
        return bytearray(n)
    blob = bytearray()
    _resize(blob, n)  # raises MemoryError (as bytearray(n) would) if the memory is not there
    return blob


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
    fills, unless `eager_blobs` (the client: one allocation of blob_len, no
    copies, made only once the blob passed `blob_bound`, and not zeroed first:
    `blob_memory`; every byte of it is received before the frame is complete, and
    a frame left incomplete is dropped). While not
    `authenticated`, a prefix must pass the pre-auth bound (`parse_prefix`).

    `blob_bound` (the client's; None: none) gives the most blob bytes a reply
    may carry: called with None for a prefix (any reply that may come now),
    then with the decoded header (the reply to that header's request);
    `check_reply_blob` applies it before anything is allocated for the blob.

    Without a sink, `received` returns the completed frames as (header, blob)
    pairs (blob: bytes, or a bytearray for a large one) and raises
    ProtocolError on a bad prefix or header. With a sink, frames go to it and
    only a bad prefix raises (the stream cannot be resynchronized after it)."""

    BLOB_CHUNK = 1 << 16  # a blob read into memory starts with this much room (or less)
    LARGE = 1 << 16  # without a sink, blobs from this size are delivered in their own bytearray

    def __init__(self, limits: Limits, size: int = 1 << 17, *, sink: FrameSink | None = None,
                 authenticated: bool = True, eager_blobs: bool = True, blob_bound=None):
        self.limits = limits
        self.sink = sink
        self.blob_bound = blob_bound  # callable(header | None) -> int, or None
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
            self._blob = blob_memory(self._blob_len) if self.eager_blobs else bytearray()
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

    def feed(self, data: bytes) -> None:
        """Parse bytes received outside `buffer()` (the daemon reads a connection's
        first bytes on its own, to recognise a llama.cpp client); like `received`."""
        if not self._closed and data:
            self._consume(memoryview(data))

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
                self._check_blob(None, blob_len)
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
                    if error is None:
                        self._check_blob(header, blob_len)
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
                    self._check_blob(None, self._blob_len)
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
                            self._blob = blob_memory(self._blob_len) if self.eager_blobs else bytearray()
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

    def _check_blob(self, header: dict | None, blob_len: int) -> None:
        """The client's bound on a reply's blob (`blob_bound`), before anything is allocated for it."""
        if self.blob_bound is not None:
            check_reply_blob(blob_len, self.blob_bound(header), header)

    def _header_read(self, raw) -> None:
        try:
            self._header = decode_header(raw, self.limits)
        except ProtocolError as exc:
            if self.sink is None:
                raise
            self._error = exc
        if self._error is None:
            self._check_blob(self._header, self._blob_len)
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
