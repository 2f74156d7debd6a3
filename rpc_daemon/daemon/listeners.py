"""The one-shot listeners a session opens for direct connections (tensor links, step
channels), and reading their fixed-size hellos."""
from __future__ import annotations

import socket


def open_listener(host: str, backlog: int) -> socket.socket:
    """A non-blocking listening socket on `host` (the daemon's --host) and a free port; OSError if none."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(backlog)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener


async def recv_up_to(loop, sock: socket.socket, n: int) -> bytes:
    """`n` bytes from `sock`, or fewer if the peer closed first."""
    data = b""
    while len(data) < n:
        more = await loop.sock_recv(sock, n - len(data))
        if not more:
            break
        data += more
    return data
