"""Socket options both ends of a worker connection want."""
from __future__ import annotations

import socket

SOCKET_BUFFER = 4 << 20  # a whole logits reply (1 MiB for a 262k vocabulary) fits in the kernel


def tune_socket(sock) -> None:
    """Large kernel buffers, so a big reply moves in one go, and no Nagle delay
    on the small frames of a decode step."""
    if sock is None:
        return
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
