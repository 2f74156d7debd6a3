"""Tensor links, sans I/O: the bytes two workers of a tensor-parallel group
exchange directly (docs/protocol.md, "Tensor links").

A link is a plain TCP connection between two compute processes, opened by
their daemons (TENSOR_LINK) and then handed over. It starts with one HELLO
from the member of the higher rank, which names the link and carries the
listener's one-time ticket, and one ACK byte back. After that each all-reduce
of a step is one EXCHANGE frame each way: a 16-byte header (the step's number,
the exchange's index in the step, the payload's length) and the member's
partial sum as f32 bytes. A receiver knows all three before the frame arrives
and accepts nothing else: a frame of another step, index or size means the
two sides disagree about the step, and the link is dropped.
"""
from __future__ import annotations

import hmac
import struct

MAGIC = b"GGMLTPL1"
TICKET_BYTES = 32
HELLO = struct.Struct("<8sQI32s")  # magic, link id, sender's rank, the listener's ticket
ACK = b"\x01"
EXCHANGE = struct.Struct("<QII")  # step number, exchange index, payload bytes


class LinkBroken(Exception):
    """The link cannot be trusted any more: closed, refused, or out of step."""


def pack_hello(link_id: int, rank: int, ticket: bytes) -> bytes:
    return HELLO.pack(MAGIC, link_id, rank, ticket)


def check_hello(data: bytes, link_id: int, ticket: bytes, expected_ranks) -> int:
    """The sender's rank of a HELLO for link `link_id` with `ticket`; LinkBroken if it is not one."""
    if len(data) != HELLO.size:
        raise LinkBroken(f"a tensor-link hello is {HELLO.size} bytes, got {len(data)}")
    magic, link, rank, given = HELLO.unpack(data)
    if magic != MAGIC:
        raise LinkBroken("not a tensor-link hello")
    if not hmac.compare_digest(given, ticket):
        raise LinkBroken("wrong tensor-link ticket")
    if link != link_id:
        raise LinkBroken(f"hello for tensor link {link}, expected {link_id}")
    if rank not in expected_ranks:
        raise LinkBroken(f"hello from rank {rank}, expected one of {sorted(expected_ranks)}")
    return rank


def exchange_header(step: int, index: int, nbytes: int) -> bytes:
    return EXCHANGE.pack(step, index, nbytes)


def check_exchange_header(data: bytes, step: int, index: int, nbytes: int) -> None:
    got = EXCHANGE.unpack(data)
    if got != (step, index, nbytes):
        raise LinkBroken(f"peer sent exchange (step {got[0]}, index {got[1]}, {got[2]} bytes), expected "
                         f"(step {step}, index {index}, {nbytes} bytes)")
