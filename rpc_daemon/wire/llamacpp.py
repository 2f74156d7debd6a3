"""Telling a llama.cpp RPC client that it reached the wrong server (sans I/O).

llama.cpp's rpc-server listens on 50052 as our worker does, so its clients
(`llama-cli --rpc`, `llama-bench --rpc`, ...) get pointed at our workers. Their
first message is HELLO in llama.cpp's own framing (ggml/src/ggml-rpc/ggml-rpc.cpp):

    | cmd u8 = 14 | input_size u64 LE | input: input_size bytes |

where input_size is 24 (conn_caps, current llama.cpp) or 0 (older ones), and
they wait for

    | size u64 LE | major u8 | minor u8 | patch u8 | (pad u8, conn_caps[24] if input_size was 24) |

A reply whose major version is not theirs makes them report "RPC server
version mismatch" and stop, instead of waiting for our hello timeout. No
llama.cpp protocol has major version 0, so 0.0.0 mismatches every one.

Why the first 9 bytes cannot be one of our frames that would be served: read
as our 12-byte prefix they say header_len 6158 (`0e 18 00 00`), which is
past the pre-auth bound (4096) and refused anyway, or header_len 14
(`0e 00 00 00`), and a HELLO needs at least 15 bytes of msgpack
(`{"cmd": 0, "version": 1}`); before HELLO nothing else is served.

`Opening` is what a daemon connection runs its first bytes through, sans I/O:
it says what to do (hand the bytes to the frame reader, log, answer and close),
the connection does it (rpc_daemon/daemon/connection.py).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

HELLO = 14  # RPC_CMD_HELLO: "must be always 14" in every llama.cpp protocol version
CONN_CAPS = 24  # rpc_msg_hello_req.conn_caps
_SIZE = struct.Struct("<Q")
OPENING = 1 + _SIZE.size  # cmd and input_size: what decides
MISMATCH_VERSION = bytes((0, 0, 0))  # major.minor.patch no llama.cpp client accepts
UNDECIDED = "undecided"


def classify(opening: bytes) -> int | None | str:
    """For a connection's first bytes: the input_size of a llama.cpp HELLO (0
    or 24), None if they are not one, UNDECIDED while fewer than OPENING bytes
    could still be one."""
    if not opening:
        return UNDECIDED
    if opening[0] != HELLO:
        return None
    size_bytes = bytes(opening[1:OPENING])
    candidates = [_SIZE.pack(n) for n in (0, CONN_CAPS)]
    if len(opening) < OPENING:
        return UNDECIDED if any(c.startswith(size_bytes) for c in candidates) else None
    (size,) = _SIZE.unpack(size_bytes)
    return size if size in (0, CONN_CAPS) else None


def hello_reply(input_size: int) -> bytes:
    """The HELLO reply, in llama.cpp's framing, for a HELLO of `input_size`."""
    body = MISMATCH_VERSION + (bytes(1 + CONN_CAPS) if input_size == CONN_CAPS else b"")
    return _SIZE.pack(len(body)) + body


# what the daemon logs and says when it closes (tests/interop/test_llamacpp_interop.py looks for LOG_LINE)
LOG_LINE = "a llama.cpp RPC client connected; this worker speaks the ggml-distributed protocol"
HINT = ("llama.cpp's own rpc-server serves llama.cpp clients (it also uses port 50052); "
        "this worker serves ggml-coordinator")
CLOSE_REASON = "llama.cpp RPC client (another protocol): answered its HELLO with version 0.0.0"


@dataclass(frozen=True)
class Ours:
    """The opening is not llama.cpp's: every byte so far goes to the frame reader, from the first."""
    data: bytes


@dataclass(frozen=True)
class Detected:
    """The opening is a llama.cpp HELLO (log it, once); its input may still be arriving."""
    input_size: int


@dataclass(frozen=True)
class Answer:
    """The llama.cpp HELLO is read whole: write `reply` and close (closing then sends FIN, not
    RST, before the client reads the reply)."""
    reply: bytes


class Opening:
    """A connection's first bytes, kept until they tell whether they are a
    llama.cpp client's HELLO. `received(data)` returns what to do, in order:
    nothing yet, `Ours` (then the opening is done with), or `Detected` and, once
    the HELLO's input is in too, `Answer` (again for any bytes after it: the
    connection is closing by then). At most OPENING + CONN_CAPS bytes are looked
    at; the caller bounds the wait (the hello timeout)."""

    def __init__(self):
        self._data = bytearray()
        self._input_size: int | None = None  # set once the opening is a llama.cpp HELLO

    def received(self, data: bytes) -> list:
        self._data += data
        events = []
        if self._input_size is None:
            kind = classify(self._data)
            if kind is UNDECIDED:
                return events
            if kind is None:  # ours (or anything but llama.cpp): framing as usual, from the first byte
                return [Ours(bytes(self._data))]
            self._input_size = kind
            events.append(Detected(kind))
        if len(self._data) >= OPENING + self._input_size:
            events.append(Answer(hello_reply(self._input_size)))
        return events
