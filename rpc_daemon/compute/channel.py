"""The compute process's end of a step channel (docs/protocol.md, "Step
channels"; the daemon's part: daemon/step_channel.py).

The client's GRAPH_RECOMPUTEs come here straight, in the main protocol's
frames. Each one passes the checks the daemon would make
(validation/requests.py: the cached graph, every input's size and row ids,
the outputs, the buffers it names still the client's, the tensor step) against
what the daemon gave this process: the graphs it built and the buffers it
mapped. Only a graph the daemon has had computed here once (so its memory is
sized and counted against --mem) is recomputed; any other is NOT_FOUND, and
the client sends it through the daemon. A request that breaks the framing
closes the channel (the client then goes through the daemon, which refuses it
as such).
"""
from __future__ import annotations

import os
import select
import socket
import time

import structlog

from rpc_daemon.validation import requests as V
from rpc_daemon.wire import framing as F
from rpc_daemon.wire import protocol as P
from rpc_daemon.wire.protocol import Command, ProtocolError, Status
from rpc_daemon.wire.step_channel import COMMANDS, channel_limits

log = structlog.get_logger("compute")

SEND_TIMEOUT = 30.0  # seconds a reply may take to leave (a client that stopped reading loses its channel)
DRAIN_READS = 64  # reads of unread requests before a close (4 MiB)


class _Range:
    __slots__ = ("offset", "size")

    def __init__(self, offset: int, size: int):
        self.offset, self.size = offset, size


class ChannelEnded(Exception):
    """The channel is closed (by the client, a framing error, or a send that cannot finish)."""


# fields of the connection's computes that a channel's do not take (step links: docs/protocol.md)
NOT_ON_A_CHANNEL = ("step_input", "forward", "reply_output", "tensors")


class StepChannelServer:
    """One request at a time: what has arrived is read (the whole frames in one receive buffer,
    or one request's blob) and then answered one by one, and nothing more is read while one
    waits (the client's further requests wait in TCP's buffers, which push back); the serve
    loop looks at the daemon's socket between any two requests."""

    def __init__(self, sock: socket.socket, key_prefix: str, limits: P.Limits, compute_timeout: float,
                 counts: list, unsafe: bool = False):
        self.sock = sock
        self.unsafe = unsafe  # the daemon's --unsafe-no-validation (tests): its checks, no more
        self.compute_timeout = compute_timeout  # the daemon's bound on one compute: an exchange waits no longer
        self.sock.setblocking(False)  # receives never wait; a send waits in poll(), bounded
        self.key_prefix = key_prefix
        self.limits = limits
        self.reader = F.FrameReader(channel_limits(limits), eager_blobs=False)
        self.waiting: list[tuple[dict, bytes]] = []  # whole requests read, not answered yet
        self.counts = counts  # [computes, compute_us, errors, bytes in, bytes out], over all its channels
        self._parent_stat = os.open(f"/proc/{os.getppid()}/stat", os.O_RDONLY)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        """EOF to the client after every reply sent. Unread requests are read and dropped first:
        closing over unread bytes would reset the connection, which can discard a reply still on
        its way (the client sends a request it had no reply to again, on its connection)."""
        try:
            for _ in range(DRAIN_READS):  # bounded: a client streaming on meets the reset it asked for
                if not self.sock.recv(1 << 16):
                    break
        except OSError:
            pass
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.sock.close()
        self.reader.close()
        os.close(self._parent_stat)

    def next_request(self) -> tuple[dict, bytes] | None:
        """The next whole request, reading what has arrived only if none is waiting (never
        blocks); None if none is whole yet; ChannelEnded at EOF."""
        if not self.waiting:
            self.waiting = self._receive()
        return self.waiting.pop(0) if self.waiting else None

    def _receive(self) -> list[tuple[dict, bytes]]:
        """Read until at least one frame is whole or nothing more has arrived."""
        frames: list = []
        while True:
            buf = self.reader.buffer()
            try:
                n = self.sock.recv_into(buf, len(buf))
            except (BlockingIOError, InterruptedError):
                return frames
            except OSError as exc:
                raise ChannelEnded(f"step channel: {exc}") from None
            if n == 0:
                raise ChannelEnded("the client closed the step channel")
            self.counts[3] += n
            try:
                frames = self.reader.received(n)
                if frames:
                    return frames
            except ProtocolError as exc:
                self._send(P.reply_header(None, exc.status, exc.message), b"")
                raise ChannelEnded(f"step channel: {exc.message}") from None

    def daemon_stopped(self) -> bool:
        """The daemon (this process's parent) is stopped (SIGSTOP, a debugger): a step then goes
        through it, to be held to its connection's liveness bound as any request."""
        try:
            stat = os.pread(self._parent_stat, 512, 0)
        except OSError:
            return True  # gone: its children end with it
        end = stat.rfind(b")")
        return stat[end + 2: end + 3] in (b"T", b"t")

    def answer(self, header: dict, blob, state) -> None:
        """One request: checked, computed by `state` (worker.ComputeState), answered. As the
        daemon's own handlers: a bug of ours is a FAILED reply, not the process's end."""
        req_id = header.get("id")
        if self.daemon_stopped():
            raise ChannelEnded("the daemon is stopped: steps go through it")
        try:
            self._answer(req_id, header, blob, state)
        except ChannelEnded:
            raise
        except Exception as exc:
            log.exception("step-channel request failed")
            self._send(P.reply_header(req_id if type(req_id) is int else None, Status.FAILED,
                                      f"internal error: {type(exc).__name__}: {exc}"), b"")

    def _answer(self, req_id, header: dict, blob, state) -> None:
        try:
            if type(req_id) is not int:
                raise ProtocolError(Status.INVALID_REQUEST, "a request needs an integer 'id'")
            cmd = header.get("cmd")
            if type(cmd) is not int:  # as on the connection: 12.0 or true is no PING
                raise ProtocolError(Status.INVALID_REQUEST, f"'cmd' must be an integer (cmd {cmd!r:.40})")
            if cmd not in COMMANDS:
                raise ProtocolError(Status.UNKNOWN_COMMAND, f"a step channel carries GRAPH_RECOMPUTE and PING only "
                                                            f"(cmd {cmd})")
            if cmd == Command.PING:
                return self._send(P.reply_header(req_id, Status.SUCCESS, time=time.time()), b"")
            extra = [f for f in NOT_ON_A_CHANNEL if f in header]
            if extra:
                raise ProtocolError(Status.INVALID_REQUEST, f"field {extra[0]!r} is not taken over a step channel: "
                                                            "send the request on the connection")
            graph_id = P.field_int(header, "graph_id", 1)
            key = f"{self.key_prefix}{graph_id}"
            spec = state.specs.get(key)
            if spec is None or key not in state.allocated:
                return self._send(P.reply_header(req_id, Status.NOT_FOUND, f"graph {graph_id} is not cached here; "
                                                 "send it with GRAPH_COMPUTE"), b"")
            run = V.check_graph_recompute(graph_id, spec, header, blob, self.limits, self._buffer_of(state),
                                          self.unsafe)
            tensor = V.check_tensor_step(header, spec)
        except ProtocolError as exc:
            return self._send(P.reply_header(req_id, exc.status, exc.message, **exc.fields), b"")
        request = {"kind": "compute", "graph_key": key, "inputs": run.inputs, "outputs": run.outputs}
        if tensor is not None:
            request["tensor"] = tensor.compute_header(self.compute_timeout)
        reply, out = state.compute(request, run.blob, to_arena=False)
        status = reply.pop("status")
        self.counts[0] += 1
        self.counts[1] += reply.get("compute_us", 0)
        if status != 0:
            self.counts[2] += 1
            reply.pop("graph_dropped", None)
            return self._send(P.reply_header(req_id, status, reply.pop("error", "compute failed"), **reply), b"")
        fields = {"outputs": reply["outputs"], "compute_us": reply.get("compute_us", 0)}
        if "exchange_us" in reply:
            fields["exchange_us"] = reply["exchange_us"]
        self._send(P.reply_header(req_id, Status.SUCCESS, **fields), out)

    @staticmethod
    def _buffer_of(state):
        def buffer_of(key):
            entry = state.buffer_ranges.get(key)
            return None if entry is None else _Range(*entry)
        return buffer_of

    def _send(self, header: dict, out) -> None:
        frame = F.encode_frame(header, len(out))
        self.counts[4] += len(frame) + len(out)
        parts = [memoryview(frame)] + ([memoryview(out).cast("B")] if len(out) else [])
        deadline = time.monotonic() + SEND_TIMEOUT
        writable = None
        try:
            while parts:
                try:
                    k = self.sock.sendmsg(parts)  # usually all of it, in one call
                except (BlockingIOError, InterruptedError):
                    k = 0
                while k and parts:
                    if k >= len(parts[0]):
                        k -= len(parts.pop(0))
                    else:
                        parts[0], k = parts[0][k:], 0
                if parts:  # the client reads slowly: wait until it takes more, within the bound
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ChannelEnded(f"step channel: the client took no reply within {SEND_TIMEOUT:g} s")
                    if writable is None:  # the daemon's requests wait: a computed reply is never cut short
                        writable = select.poll()
                        writable.register(self.sock, select.POLLOUT)
                    writable.poll(left * 1000)
        except OSError as exc:
            raise ChannelEnded(f"step channel: cannot send a reply: {exc}") from None
