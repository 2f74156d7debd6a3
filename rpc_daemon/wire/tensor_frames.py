"""Tensor links, sans I/O: the bytes two workers of a tensor-parallel group
exchange directly (docs/protocol.md, "Tensor links").

A link is a TCP connection between two compute processes, opened by their
daemons (TENSOR_LINK) and then handed over. It starts with one HELLO from the
member of the higher rank, which names the link and proves the listener's
one-time ticket, and one ACK byte back. Between TLS workers those two are
all that crosses the network in the clear: the HELLO carries a digest of the
ticket, never the ticket, and the compute processes then run TLS over the connection
(compute/link_tls.py), inside which the higher rank sends a TLS_HELLO with
the ticket itself, answered by ACK. On a plaintext link the HELLO carries
the ticket itself (as before TLS links: such members link with older
daemons; the digest would protect nothing there, every byte after it being
in the clear too). After that each exchange
of a step is one EXCHANGE frame each way: a 16-byte header (the step's number,
the exchange's index in the step, the payload's length) and the member's
partial sum as f32 bytes (a gather: its piece, whose length the step's
request gives for every member). A receiver knows all three before the frame arrives
and accepts nothing else: a frame of another step, index or size means the
two sides disagree about the step, and the link is dropped.
"""
from __future__ import annotations

import hashlib
import hmac
import struct

MAGIC = b"GGMLTPL1"
TICKET_BYTES = 32
HELLO = struct.Struct("<8sQI32s")  # magic, link id, sender's rank, the listener's ticket (TLS: its digest)
ACK = b"\x01"
HELLO_DOMAIN = b"ggml tensor link hello tls\x00"  # what a TLS link's HELLO digests before the ticket
TLS_MAGIC = b"GGMLTPS1"
TLS_HELLO = struct.Struct("<8sQI32s")  # inside TLS: magic, link id, sender's rank, the listener's ticket itself
EXCHANGE = struct.Struct("<QII")  # step number, exchange index, payload bytes


class LinkBroken(Exception):
    """The link cannot be trusted any more: closed, refused, or out of step."""


def hello_proof(ticket: bytes, link_id: int, rank: int, tls: bool) -> bytes:
    """What a HELLO for link `link_id` from `rank` carries for `ticket`: on a TLS link
    HMAC-SHA256(key = ticket, HELLO_DOMAIN || link id u64 || rank u32), which lets nobody into TLS
    (that takes the ticket) and, seen on the wire, passes the vetting of that link for that rank
    only; on a plaintext link the ticket itself. So a TLS member and a plaintext one refuse each
    other at the HELLO instead of failing later in the middle."""
    if not tls:
        return ticket
    return hmac.new(ticket, HELLO_DOMAIN + struct.pack("<QI", link_id, rank), hashlib.sha256).digest()


def pack_hello(link_id: int, rank: int, ticket: bytes, tls: bool = False) -> bytes:
    return HELLO.pack(MAGIC, link_id, rank, hello_proof(ticket, link_id, rank, tls))


def check_hello(data: bytes, link_id: int, ticket: bytes, expected_ranks, tls: bool = False) -> int:
    """The sender's rank of a HELLO for link `link_id` proving `ticket` (on a TLS link: with its
    digest, never the ticket itself); LinkBroken if it is not one."""
    if len(data) != HELLO.size:
        raise LinkBroken(f"a tensor-link hello is {HELLO.size} bytes, got {len(data)}")
    magic, link, rank, given = HELLO.unpack(data)
    if magic != MAGIC:
        raise LinkBroken("not a tensor-link hello")
    if not hmac.compare_digest(given, hello_proof(ticket, link, rank, tls)):
        raise LinkBroken(f"wrong tensor-link ticket{' digest' if tls else ''} (another ticket, or a member "
                         f"{'without' if tls else 'with'} TLS)")
    if link != link_id:
        raise LinkBroken(f"hello for tensor link {link}, expected {link_id}")
    if rank not in expected_ranks:
        raise LinkBroken(f"hello from rank {rank}, expected one of {sorted(expected_ranks)}")
    return rank


def pack_tls_hello(link_id: int, rank: int, ticket: bytes) -> bytes:
    return TLS_HELLO.pack(TLS_MAGIC, link_id, rank, ticket)


def check_tls_hello(data: bytes, link_id: int, rank: int, ticket: bytes) -> None:
    """A TLS_HELLO (read inside TLS) from rank `rank` for link `link_id` with `ticket` itself, or LinkBroken."""
    if len(data) != TLS_HELLO.size:
        raise LinkBroken(f"a tensor-link TLS hello is {TLS_HELLO.size} bytes, got {len(data)}")
    magic, link, sender, given = TLS_HELLO.unpack(data)
    if magic != TLS_MAGIC:
        raise LinkBroken("not a tensor-link TLS hello")
    if not hmac.compare_digest(given, ticket):
        raise LinkBroken("wrong tensor-link ticket inside TLS")
    if link != link_id or sender != rank:
        raise LinkBroken(f"TLS hello for tensor link {link} from rank {sender}, expected link {link_id} from "
                         f"rank {rank}")


def exchange_header(step: int, index: int, nbytes: int) -> bytes:
    return EXCHANGE.pack(step, index, nbytes)


def check_exchange_header(data: bytes, step: int, index: int, nbytes: int) -> None:
    got = EXCHANGE.unpack(data)
    if got != (step, index, nbytes):
        raise LinkBroken(f"peer sent exchange (step {got[0]}, index {got[1]}, {got[2]} bytes), expected "
                         f"(step {step}, index {index}, {nbytes} bytes)")
