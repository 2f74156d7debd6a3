"""The tensor link's frames (rpc_daemon/wire/tensor_frames.py): a TLS link's plaintext HELLO
carries a digest of the listener's ticket, never the ticket; a plaintext link's the ticket itself,
as daemons from before TLS links send it; each refuses the other's."""
from __future__ import annotations

import hashlib
import hmac
import os
import struct

import pytest

from rpc_daemon.wire.tensor_frames import (HELLO, TLS_HELLO, LinkBroken, check_hello, check_tls_hello,
                                           pack_hello, pack_tls_hello)


def test_a_tls_hello_carries_a_digest_of_the_ticket_not_the_ticket():
    ticket = os.urandom(32)
    hello = pack_hello(7, 1, ticket, tls=True)
    assert len(hello) == HELLO.size == 52
    assert ticket not in hello and ticket[:16] not in hello and ticket[16:] not in hello
    # as the docs say: HMAC-SHA256 keyed by the ticket over the domain, the link id and the rank
    assert hello[20:] == hmac.new(ticket, b"ggml tensor link hello tls\x00" + struct.pack("<QI", 7, 1),
                                  hashlib.sha256).digest()
    assert check_hello(hello, 7, ticket, {1}, tls=True) == 1
    # seen on the wire, it passes for its own link and rank only: rewritten to claim rank 2, it is refused
    with pytest.raises(LinkBroken, match="wrong tensor-link ticket digest"):
        check_hello(hello[:16] + struct.pack("<I", 2) + hello[20:], 7, ticket, {1, 2}, tls=True)
    with pytest.raises(LinkBroken, match="wrong tensor-link ticket digest"):  # the ticket itself is refused
        check_hello(pack_hello(7, 1, ticket, tls=False), 7, ticket, {1}, tls=True)
    with pytest.raises(LinkBroken, match="wrong tensor-link ticket digest"):
        check_hello(pack_hello(7, 1, os.urandom(32), tls=True), 7, ticket, {1}, tls=True)
    with pytest.raises(LinkBroken, match="expected 7"):
        check_hello(pack_hello(8, 1, ticket, tls=True), 7, ticket, {1}, tls=True)
    with pytest.raises(LinkBroken, match="rank 2"):
        check_hello(pack_hello(7, 2, ticket, tls=True), 7, ticket, {1}, tls=True)
    with pytest.raises(LinkBroken, match="52 bytes"):
        check_hello(hello[:-1], 7, ticket, {1}, tls=True)


def test_a_plaintext_hello_is_as_before_and_refuses_a_tls_one():
    ticket = os.urandom(32)
    hello = pack_hello(7, 1, ticket)
    assert hello == b"GGMLTPL1" + (7).to_bytes(8, "little") + (1).to_bytes(4, "little") + ticket
    assert check_hello(hello, 7, ticket, {1}) == 1
    with pytest.raises(LinkBroken, match="wrong tensor-link ticket"):  # a TLS member's
        check_hello(pack_hello(7, 1, ticket, tls=True), 7, ticket, {1})


def test_the_tls_hello_carries_the_ticket_and_is_checked():
    ticket = os.urandom(32)
    hello = pack_tls_hello(7, 1, ticket)
    assert len(hello) == TLS_HELLO.size == 52 and ticket in hello
    check_tls_hello(hello, 7, 1, ticket)
    with pytest.raises(LinkBroken, match="wrong tensor-link ticket inside TLS"):
        check_tls_hello(pack_tls_hello(7, 1, bytes(32)), 7, 1, ticket)
    with pytest.raises(LinkBroken, match="expected link 7 from rank 1"):
        check_tls_hello(pack_tls_hello(7, 2, ticket), 7, 1, ticket)
    with pytest.raises(LinkBroken, match="not a tensor-link TLS hello"):  # the plaintext HELLO is not it
        check_tls_hello(pack_hello(7, 1, ticket, tls=True), 7, 1, ticket)
