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
"""
from __future__ import annotations

import struct

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
