"""Step channels, sans I/O: a client's tensor-parallel steps straight to its
compute process (docs/protocol.md, "Step channels").

STEP_CHANNEL on the client's authenticated connection opens a listener on the
daemon's address and replies its port and a one-time ticket. The client
connects there and sends one HELLO (magic and the ticket); the daemon hands the
socket to the session's compute process and answers one ACK byte. From then on
the channel carries GRAPH_RECOMPUTE requests and their replies in the main
protocol's frames (framing.py), nothing else: the compute process validates
each as the daemon would (validation/requests.py) against the graphs and
buffers the daemon gave it.

A channel is closed (the client sees EOF) when the daemon takes it back (a
second client computes there: the daemon's fair lock decides again), when the
compute process ends, or with the session. A request the client did not get a
reply to before EOF was not computed, or computed by a process that is gone:
the client sends it again over its connection to the daemon, which reports
what happened to that process.
"""
from __future__ import annotations

import hmac
import struct

from dataclasses import replace

from rpc_daemon.wire.protocol import Command, Limits

MAGIC = b"GGMLSCH1"
TICKET_BYTES = 32
HELLO = struct.Struct("<8s32s")  # magic, the listener's ticket
ACK = b"\x01"
COMMANDS = (Command.GRAPH_RECOMPUTE, Command.PING)  # all a channel carries
# A frame on a channel is held whole in the client's compute process before it is checked: at most
# this much (a step's inputs are kilobytes; a long prompt's masks megabytes). A larger request goes
# on the connection, whose daemon streams it under its own bounds.
MAX_HEADER = 1 << 20
MAX_BLOB = 64 << 20


def channel_limits(limits: Limits) -> Limits:
    """The session's limits, with a channel frame's bounds."""
    return replace(limits, max_header=min(limits.max_header, MAX_HEADER), max_blob=min(limits.max_blob, MAX_BLOB))


class ChannelRefused(Exception):
    """Not a step-channel HELLO for this listener."""


def pack_hello(ticket: bytes) -> bytes:
    return HELLO.pack(MAGIC, ticket)


def check_hello(data: bytes, ticket: bytes) -> None:
    if len(data) != HELLO.size:
        raise ChannelRefused(f"a step-channel hello is {HELLO.size} bytes, got {len(data)}")
    magic, given = HELLO.unpack(data)
    if magic != MAGIC:
        raise ChannelRefused("not a step-channel hello")
    if not hmac.compare_digest(given, ticket):
        raise ChannelRefused("wrong step-channel ticket")
