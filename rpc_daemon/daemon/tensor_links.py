"""Tensor links: a session's compute process linked straight to those of its
tensor-parallel peers (docs/protocol.md, "Tensor links").

TENSOR_LINK "listen" opens a listener on the daemon's address and replies its
port and a one-time ticket; TENSOR_LINK "join" connects to every lower rank's
listener (presenting that listener's ticket, which the coordinator passed on
over its authenticated connections) and accepts every higher rank, then hands
the connected sockets to the session's compute process, which exchanges the
partial sums itself (compute/exchange.py). The daemon keeps its copies only to
end the link: TENSOR_CANCEL, a new link, or the session's end shut them down,
which ends a compute process's wait on them at once.

On a daemon serving TLS (with --peer-tls-ca: else it offers no tensor links
and refuses TENSOR_LINK) the HELLO carries the ticket's digest instead of
the ticket, and the compute process runs TLS over the sockets before the
join is answered
(compute/link_tls.py): the join's reply is then the TLS phase's.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time

import structlog

from rpc_daemon.client import PeerFailed, RpcError
from rpc_daemon.compute.pool import ComputeFailed
from rpc_daemon.daemon.listeners import open_listener, recv_up_to
from rpc_daemon.validation import requests as V
from rpc_daemon.wire.protocol import ProtocolError, Status
from rpc_daemon.wire.tensor_frames import ACK, HELLO, TICKET_BYTES, LinkBroken, check_hello, pack_hello

log = structlog.get_logger("rpc")

HELLO_TIMEOUT = 1.0  # seconds an accepted connection has to say HELLO (others are vetted meanwhile)
MAX_VETTING = 64  # connections vetted at once; one more is closed unanswered
CONNECT_SHARE = 0.75  # of the join's timeout, a connection to a lower rank has to be answered


class PeerUnreached(LinkBroken):
    """This member could not link with lower rank `rank` (the join's reply names it: `unlinked`)."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


class TensorLinks:
    """One session's tensor link: its listener while joining, then its sockets."""

    def __init__(self):
        self.link_id = 0
        self.listener: socket.socket | None = None
        self.ticket = b""
        self.socks: list[socket.socket] = []
        self.joining: asyncio.Task | None = None  # a join in progress (TENSOR_CANCEL ends it)
        self.ended = False  # end() was called since the last listen (a TLS phase cut short was cancelled)

    def end(self) -> None:
        """Shut the link down: a compute process waiting on it, or a join, stops waiting now."""
        self.ended = True
        if self.joining is not None:
            self.joining.cancel()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.end()
        for s in self.socks:
            s.close()
        self.socks = []
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def links_of(s) -> TensorLinks:
    if s.tensor_links is None:
        s.tensor_links = TensorLinks()
    return s.tensor_links


async def handle_tensor_link(s, h, blob, direct):
    req = V.check_tensor_link(h)
    tls = bool(s.config.tls_cert)
    if not s.daemon.peer_links.usable:  # TLS without --peer-tls-ca
        raise ProtocolError(Status.INVALID_REQUEST, "this worker serves TLS without --peer-tls-ca: it cannot verify "
                                                    "tensor-link peers (it offers no tensor links)")
    if req.op == "rtt":
        return await _round_trips(s, req)
    links = links_of(s)
    if req.op == "listen":
        links.close()
        try:
            listener = open_listener(s.config.host, V.MAX_GROUP)
        except OSError as exc:
            return {"status": Status.FAILED, "error": f"cannot open a tensor-link listener: {exc}"}
        links.link_id, links.listener, links.ticket = req.link, listener, os.urandom(TICKET_BYTES)
        links.ended = False
        return {"port": listener.getsockname()[1], "ticket": links.ticket}
    if links.listener is None or links.link_id != req.link:
        raise ProtocolError(Status.INVALID_REQUEST, f"TENSOR_LINK join of link {req.link} needs its listen first")
    if links.ended:  # a TENSOR_CANCEL of this link came first (answered as it is read, this join queued behind)
        links.close()  # else the join would wait its whole timeout for peers the coordinator cancelled too
        return {"status": Status.LINK_FAILED, "error": f"tensor link {req.link}: cancelled (TENSOR_CANCEL: a member "
                                                       f"failed)", "cancelled": True}
    deadline = time.monotonic() + req.timeout  # the whole join's, the TLS phase's included
    socks: dict[int, socket.socket] = {}  # rank -> linked socket, filled as the join goes
    join = links.joining = asyncio.get_running_loop().create_task(_join(links, req, socks, tls))
    try:
        await asyncio.wait({join}, timeout=req.timeout)
    finally:
        links.joining = None
        if not join.done():  # timed out, or this handler cancelled: every wait on the listener ends first
            missing = [r for r in range(req.n) if r != req.rank and r not in socks]
            join.cancel()
            await asyncio.wait({join})
            join = None
    why, fields = None, {}
    if join is None:
        why = (f"not linked with rank(s) {missing} within {req.timeout:g} s (can the workers reach each "
               "other's ports?)")
        fields = {"unlinked": missing}
    elif join.cancelled():
        why, fields = "cancelled (TENSOR_CANCEL: a member failed)", {"cancelled": True}
    elif join.exception() is not None:
        why = str(join.exception()) or type(join.exception()).__name__
        if isinstance(join.exception(), PeerUnreached):  # the coordinator weighs it against that rank's own join
            fields = {"unlinked": [join.exception().rank]}
    if why is not None:
        links.close()
        return {"status": Status.LINK_FAILED, "error": f"tensor link {req.link}: {why}", **fields}
    links.listener.close()
    links.listener = None
    links.socks = [sock for _, sock in sorted(socks.items())]
    ranks = sorted(socks)
    message = {"kind": "tensor_link", "link": req.link, "rank": req.rank, "peers": ranks}
    if tls:
        compute = s.daemon.compute
        message["tls"] = {
            "cert": s.config.tls_cert, "key": s.config.tls_key, "ca": s.config.peer_tls_ca, "ticket": links.ticket,
            "peers": {p.rank: (p.host, p.ticket) for p in req.peers},
            # done before the compute process's call can time out and kill it (--compute-timeout)
            "deadline": min(deadline, time.monotonic() + 0.9 * compute.timeout)}
    try:
        reply, _ = await s.daemon.compute.for_client(s.client_id).call(
            message, fds=tuple(sock.fileno() for sock in links.socks))
    except ComputeFailed as exc:
        links.close()
        return {"status": Status.FAILED, "error": str(exc)}
    if reply.get("status", 0) != 0:  # the TLS phase failed: nothing kept
        fields = {}
        if "peer_rank" in reply:  # the failure is the peer's; a TENSOR_CANCEL meanwhile made it end so
            fields = {"cancelled": True} if links.ended else {"peer_rank": reply["peer_rank"]}
        links.close()
        log.warning("tensor link failed in TLS", link=req.link, rank=req.rank, error=reply.get("error"))
        return {"status": Status.LINK_FAILED, "error": f"tensor link {req.link}: {reply.get('error')}", **fields}
    log.info("tensor link up", link=req.link, rank=req.rank, peers=ranks, tls=tls)
    return {}


async def _round_trips(s, req) -> dict:
    """TENSOR_LINK rtt: this worker's round trips to worker `peer` (PINGs over its authenticated
    link to that worker's daemon port, with TLS where it serves TLS): what a coordinator's auto
    weighs the tensor split's exchanges by, measured where they would run, not from itself."""
    try:
        rtts = await s.daemon.peer_links.round_trips(req.peer, req.count)
    except (PeerFailed, RpcError) as exc:
        return {"status": Status.LINK_FAILED, "error": f"cannot reach worker {req.peer} from here: {exc}"}
    return {"rtts": rtts}


async def _join(links: TensorLinks, req, socks: dict, tls: bool) -> dict[int, socket.socket]:
    """Connect to every lower rank, accept every higher one, into `socks`: rank -> connected socket.
    `tls`: the HELLOs carry the tickets' digests (the compute process runs TLS next)."""
    loop = asyncio.get_running_loop()
    connect_timeout = req.timeout * CONNECT_SHARE

    async def read(sock, n):
        data = await recv_up_to(loop, sock, n)
        if len(data) < n:
            raise LinkBroken("the peer closed the tensor link while linking")
        return data

    async def connect(peer):
        where = f"rank {peer.rank} at {peer.host}:{peer.port}"
        try:
            infos = await loop.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise PeerUnreached(f"cannot resolve {where}: {exc.strerror or exc}", peer.rank) from None
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            # sooner than the join's own deadline: a connection that goes unanswered (a firewall
            # dropping it) fails here first, naming this member and the peer, before the peer's
            # join times out waiting for it
            async with asyncio.timeout(connect_timeout):
                await loop.sock_connect(sock, addr)
                await loop.sock_sendall(sock, pack_hello(req.link, req.rank, peer.ticket, tls))
                ack = await recv_up_to(loop, sock, 1)
            if ack != ACK:  # a HELLO it does not take is closed unanswered
                raise LinkBroken(f"{where} refused the tensor link (closed it without an answer)")
        except BaseException as exc:
            sock.close()
            if isinstance(exc, TimeoutError):  # before OSError: a TimeoutError is one
                raise PeerUnreached(f"cannot connect to {where}: no answer within {connect_timeout:g} s",
                                    peer.rank) from None
            if isinstance(exc, OSError):
                raise PeerUnreached(f"cannot connect to {where}: {exc.strerror or exc}", peer.rank) from None
            if isinstance(exc, LinkBroken):
                raise PeerUnreached(str(exc), peer.rank) from None
            raise
        socks[peer.rank] = sock

    async def vet(sock, pending: set, linked: asyncio.Event, n_higher: int) -> None:
        """One accepted connection: its HELLO within HELLO_TIMEOUT, for a rank still
        pending, then ACK; anything else is closed unanswered."""
        rank = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                rank = check_hello(await read(sock, HELLO.size), req.link, links.ticket, pending, tls)
                pending.discard(rank)  # before any wait: a second HELLO for this rank is refused
                await loop.sock_sendall(sock, ACK)
        except BaseException as exc:
            if rank is not None:
                pending.add(rank)
            sock.close()
            if isinstance(exc, (LinkBroken, OSError, TimeoutError)):  # a stranger, a stale member, a silent one
                log.warning("tensor-link connection refused", error=str(exc) or "no hello in time")
                return
            raise
        socks[rank] = sock
        if sum(r > req.rank for r in socks) == n_higher:
            linked.set()

    async def accept_higher():
        # each connection is vetted in a task of its own: one that connects and says
        # nothing holds up nobody but itself (HELLO_TIMEOUT), not the real members
        n_higher = req.n - req.rank - 1
        if not n_higher:
            return
        pending, linked, vetting = set(range(req.rank + 1, req.n)), asyncio.Event(), set()

        async def accept_all():
            while True:
                sock, _ = await loop.sock_accept(links.listener)
                sock.setblocking(False)
                if len(vetting) >= MAX_VETTING:  # a flood of connections: the excess is closed unanswered
                    sock.close()
                    continue
                task = loop.create_task(vet(sock, pending, linked, n_higher))
                task.add_done_callback(lambda t, sock=sock: t.cancelled() and sock.close())  # even unstarted
                vetting.add(task)
                task.add_done_callback(vetting.discard)

        acceptor, done = loop.create_task(accept_all()), loop.create_task(linked.wait())
        try:
            await asyncio.wait({acceptor, done}, return_when=asyncio.FIRST_COMPLETED)
            if not done.done():  # the listener failed
                acceptor.result()
        finally:
            for task in (acceptor, done, *vetting):
                task.cancel()
            for outcome in await asyncio.gather(acceptor, done, *vetting, return_exceptions=True):
                if isinstance(outcome, Exception) and not isinstance(outcome, asyncio.CancelledError):
                    log.error("tensor-link vetting failed", error=f"{type(outcome).__name__}: {outcome}")

    # the first failure ends the others: none is left waiting on the listener or a socket once this returns
    tasks = [loop.create_task(connect(p)) for p in req.peers] + [loop.create_task(accept_higher())]
    try:
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        failed = next((t.exception() for t in tasks if not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed
        if any(t.cancelled() for t in tasks):
            raise asyncio.CancelledError()
    except BaseException:
        for sock in socks.values():
            sock.close()
        raise
    return socks


def handle_tensor_cancel(s, h, blob, direct):
    """Answered as soon as it is read: the session's compute may be waiting on the link. A bad
    `link` is refused in the reply (the connection stays: its compute is answered as usual)."""
    try:
        link = V.check_tensor_cancel(h)
    except ProtocolError as exc:
        return {"status": exc.status, "error": exc.message}
    links = s.tensor_links
    if links is not None and (link is None or link == links.link_id):
        links.end()
    return {}
