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


def send(sock: socket.socket, header: dict, blob=b"", fds=()) -> None:
    body = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    first = _PREFIX.pack(len(body), len(blob), len(fds)) + body
    if fds:
        socket.send_fds(sock, [first], list(fds))
    else:
        sock.sendall(first)
    if len(blob):
        sock.sendall(blob)


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


def recv(sock: socket.socket) -> tuple[dict, bytearray, list[int]]:
    fds: list[int] = []
    # the prefix arrives with the descriptors; read it with recvmsg so they are not lost
    data, ancdata, _flags, _addr = sock.recvmsg(_PREFIX.size, socket.CMSG_SPACE(64 * array.array("i").itemsize))
    if not data:
        raise LinkClosed("peer closed the link")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - (len(payload) % arr.itemsize)])
            fds.extend(arr)
    if len(data) < _PREFIX.size:
        data = bytes(data) + bytes(_recv_exactly(sock, _PREFIX.size - len(data)))
    header_len, blob_len, _n_fds = _PREFIX.unpack(data)
    header = pickle.loads(_recv_exactly(sock, header_len))
    blob = _recv_exactly(sock, blob_len) if blob_len else bytearray()
    return header, blob, fds


# ---------------------------------------------------------------- asyncio side
# The daemon's event loop talks to the compute process without a thread hop:
# the link socket is non-blocking and driven by the loop.

async def asend(loop, sock: socket.socket, header: dict, blob=b"", fds=()) -> None:
    body = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    first = _PREFIX.pack(len(body), len(blob), len(fds)) + body
    if fds:
        # the link is idle between calls, so this small first chunk goes out at once
        sent = socket.send_fds(sock, [first[:_PREFIX.size]], list(fds))
        assert sent == _PREFIX.size
        first = first[_PREFIX.size:]
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
    header_len, blob_len, _n_fds = _PREFIX.unpack(await _arecv_exactly(loop, sock, _PREFIX.size))
    header = pickle.loads(await _arecv_exactly(loop, sock, header_len))
    blob = await _arecv_exactly(loop, sock, blob_len) if blob_len else bytearray()
    return header, blob
