"""Blocking message link between the daemon and its compute process.

Both ends are ours, so headers are pickled; file descriptors of shared-memory
buffers ride along as SCM_RIGHTS ancillary data on the first chunk.
"""
from __future__ import annotations

import array
import pickle
import socket
import struct

_PREFIX = struct.Struct("<IQI")  # header_len, blob_len, n_fds


class LinkClosed(Exception):
    pass


# A whole small message goes in one send and comes out of one receive: this
# runs on every compute, right after the compute has flushed the caches, where
# each extra system call and Python frame is tens of microseconds. The link is
# strictly request/reply (one message in flight each way), so a receive of up
# to FIRST_READ bytes never takes bytes of a following message.
FIRST_READ = 1 << 16
MAX_FDS = 253  # SCM_MAX_FD: the most descriptors one message can carry


def _frame(header: dict, blob, n_fds: int) -> bytes:
    body = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    return _PREFIX.pack(len(body), len(blob), n_fds) + body


def send(sock: socket.socket, header: dict, blob=b"", fds=()) -> None:
    parts = [_frame(header, blob, len(fds))]
    if len(blob):
        parts.append(blob)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg(parts, anc)
    total = sum(len(p) for p in parts)
    if sent < total:
        rest = memoryview(b"".join(bytes(p) for p in parts))[sent:]
        sock.sendall(rest)


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise LinkClosed("peer closed the link")
        got += k
    return buf


def _split(first: bytes, more) -> tuple[dict, bytearray]:
    """Header and blob from the first chunk read, reading the rest with `more(n)`."""
    if len(first) < _PREFIX.size:
        first = bytes(first) + bytes(more(_PREFIX.size - len(first)))
    header_len, blob_len, _n_fds = _PREFIX.unpack_from(first)
    end = _PREFIX.size + header_len + blob_len
    if len(first) < end:
        first = bytes(first) + bytes(more(end - len(first)))
    header = pickle.loads(memoryview(first)[_PREFIX.size: _PREFIX.size + header_len])
    blob = bytearray(memoryview(first)[_PREFIX.size + header_len: end]) if blob_len else bytearray()
    return header, blob


def recv(sock: socket.socket) -> tuple[dict, bytearray, list[int]]:
    fds: list[int] = []
    # descriptors arrive with the first bytes: read them with recvmsg so they are not lost
    data, ancdata, _flags, _addr = sock.recvmsg(FIRST_READ, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize))
    if not data:
        raise LinkClosed("peer closed the link")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - (len(payload) % arr.itemsize)])
            fds.extend(arr)
    header, blob = _split(data, lambda n: _recv_exactly(sock, n))
    return header, blob, fds


# ---------------------------------------------------------------- asyncio side
# The daemon's event loop talks to the compute process without a thread hop:
# the link socket is non-blocking and driven by the loop.

async def asend(loop, sock: socket.socket, header: dict, blob=b"", fds=()) -> None:
    first = _frame(header, blob, len(fds))
    if fds:
        # the link is idle between calls, so this small first chunk goes out at once
        sent = socket.send_fds(sock, [first[:_PREFIX.size]], list(fds))
        assert sent == _PREFIX.size
        first = first[_PREFIX.size:]
    if len(blob) and len(blob) <= FIRST_READ:
        await loop.sock_sendall(sock, first + bytes(blob))  # one system call for the usual small request
        return
    await loop.sock_sendall(sock, first)
    if len(blob):
        await loop.sock_sendall(sock, blob)


async def _arecv_exactly(loop, sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise LinkClosed("peer closed the link")
        got += k
    return buf


async def arecv(loop, sock: socket.socket) -> tuple[dict, bytearray]:
    first = await loop.sock_recv(sock, FIRST_READ)
    if not first:
        raise LinkClosed("peer closed the link")
    if len(first) >= _PREFIX.size:
        header_len, blob_len, _n_fds = _PREFIX.unpack_from(first)
        if len(first) >= _PREFIX.size + header_len + blob_len:
            return _split(first, None)
    # a large reply: the rest arrives in pieces
    rest = bytearray(first)
    if len(rest) < _PREFIX.size:
        rest += await _arecv_exactly(loop, sock, _PREFIX.size - len(rest))
    header_len, blob_len, _n_fds = _PREFIX.unpack_from(rest)
    end = _PREFIX.size + header_len + blob_len
    rest += await _arecv_exactly(loop, sock, end - len(rest))
    return _split(rest, None)
