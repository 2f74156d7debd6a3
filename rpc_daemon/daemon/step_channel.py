"""Step channels: a session's steps straight to its compute process
(docs/protocol.md, "Step channels"; the bytes: wire/step_channel.py).

A tensor-parallel step's time on a busy machine goes largely to the hops
through the daemon: its wake-up for the request, its pass-on to the compute
process and its wake-up for the reply. A channel skips all three. The daemon
grants one only to a session that is alone here (its fair lock has nobody to
arbitrate) and takes it back before any other session's compute (the compute
process closes it after the step it is in, if any): from then on the session's
steps come through the daemon and its lock again.
"""
from __future__ import annotations

import asyncio
import os
import socket

import structlog

from rpc_daemon.compute.pool import ComputeFailed
from rpc_daemon.daemon.listeners import open_listener, recv_up_to
from rpc_daemon.wire.sockets import tune_socket
from rpc_daemon.wire.step_channel import ACK, HELLO, TICKET_BYTES, ChannelRefused, check_hello

log = structlog.get_logger("rpc")

ACCEPT_TIMEOUT = 10.0  # seconds the client has to connect and say HELLO after STEP_CHANNEL
HELLO_TIMEOUT = 1.0  # seconds one connection to the listener has to say HELLO (then the next is taken)


class StepChannel:
    """One session's channel while its client connects. The daemon keeps no copy of the
    socket once handed over: the compute process's end is the only one, so its death closes
    the channel at once, as the client must see."""

    def __init__(self):
        self.accepting: asyncio.Task | None = None

    def close(self) -> None:
        if self.accepting is not None:
            self.accepting.cancel()
            self.accepting = None


def alone(s) -> bool:
    """No other session has a compute process here (nobody for the fair lock to weigh against)."""
    return all(cid == s.client_id for cid in s.daemon.compute.by_client)


async def handle_step_channel(s, h, blob, direct):
    if "step_channel" not in s.features():
        return {"granted": False, "reason": "this worker offers no step channel (it serves TLS, which the channel "
                                            "would not have, or runs with test faults, which it would pass by)"}
    if not alone(s):
        return {"granted": False, "reason": "another client computes on this worker: steps go through the daemon"}
    if s.step_channel is not None and s.step_channel.accepting is not None:
        return {"granted": False, "reason": "a step channel is being opened for this connection"}
    channel = s.step_channel = StepChannel()
    try:
        listener = open_listener(s.config.host, 1)
    except OSError as exc:  # the channel is an offer: without it the steps go through the daemon
        return {"granted": False, "reason": f"cannot open a step-channel listener: {exc}"}
    ticket = os.urandom(TICKET_BYTES)
    channel.accepting = asyncio.get_running_loop().create_task(_accept(s, channel, listener, ticket))
    return {"granted": True, "port": listener.getsockname()[1], "ticket": ticket,
            "compute_timeout": s.daemon.compute.timeout}


async def _read_hello(loop, sock: socket.socket) -> bytes:
    async with asyncio.timeout(HELLO_TIMEOUT):
        return await recv_up_to(loop, sock, HELLO.size)


async def _accept(s, channel: StepChannel, listener: socket.socket, ticket: bytes) -> None:
    """Take the client's connection (its HELLO first), hand it to the compute process, ACK it."""
    loop = asyncio.get_running_loop()
    sock = None
    try:
        async with asyncio.timeout(ACCEPT_TIMEOUT):
            while True:
                sock, _ = await loop.sock_accept(listener)
                sock.setblocking(False)
                try:
                    check_hello(await _read_hello(loop, sock), ticket)
                    break
                except (ChannelRefused, TimeoutError, asyncio.TimeoutError) as exc:  # not the session's client
                    log.warning("step-channel connection refused", error=str(exc))
                    sock.close()
                    sock = None
        listener.close()
        tune_socket(sock)  # as the connection's: a whole logits reply fits the kernel's buffers
        # not cancelled once started (a cancelled call kills the process; the client's connection
        # ending kills it anyway, with its channel), and the socket stays open until it has gone
        handover = loop.create_task(s.daemon.compute.for_client(s.client_id).call(
            {"kind": "step_channel", "key_prefix": s.graph_key(0)[:-1], "limits": s.limits,
             "compute_timeout": s.daemon.compute.timeout, "unsafe": s.config.unsafe_no_validation},
            fds=(sock.fileno(),)))
        try:
            await asyncio.shield(handover)
        except asyncio.CancelledError:
            handover.add_done_callback(lambda t, copy=sock: (copy.close(), t.cancelled() or t.exception()))
            sock = None
            raise
        if not alone(s):  # another client came meanwhile: the fair lock decides again
            await s.daemon.compute.for_client(s.client_id).take_channel_back()
            return
        await loop.sock_sendall(sock, ACK)
        log.info("step channel up", client=s.client_id)
    except (TimeoutError, asyncio.TimeoutError, OSError, ComputeFailed) as exc:
        log.warning("step channel not set up", error=str(exc) or type(exc).__name__)
    except asyncio.CancelledError:
        pass  # the connection ended meanwhile
    finally:
        listener.close()
        if sock is not None:
            sock.close()
        if channel.accepting is asyncio.current_task():
            channel.accepting = None
