"""TLS on a tensor link, in the compute process (docs/protocol.md, "Tensor links").

Between TLS workers the daemons connect and vet a group's links as without
TLS (daemon/tensor_links.py: a plaintext HELLO with a digest of the ticket),
then hand the sockets here, and this process runs TLS over each: the TLS
session must live where the bytes are sent and received (Python cannot move
one between processes, and there is no kernel TLS to hand over).

With each peer in increasing rank order (every member walks the group's pairs
in the same order, so no two wait on each other): to a lower rank this
process is the TLS client, verifying the peer's certificate against the
worker's --peer-tls-ca and the address the coordinator named it by (as step
links verify), then sends TLS_HELLO with the lower rank's ticket itself and
waits for its ACK; to a higher rank it is the TLS server (--tls-cert,
--tls-key), and takes that TLS_HELLO (its own ticket, compared in constant
time) and answers ACK. A connection taken over after the plaintext HELLO
cannot get through: it would need the ticket, which crosses the network only
inside TLS to the verified listener. Every step has the join's deadline; the
daemon shutting its copies of the sockets down (TENSOR_CANCEL, the session's
end) ends a wait at once, as it ends an exchange's.

A session is an SSLObject over memory BIOs, not an SSLSocket: this process
moves the bytes between the socket and OpenSSL itself, so one receive takes
every record that has come and one send carries a whole encrypted frame (an
SSLSocket reads each record's header and body in a system call of its own;
its exchanges took 1.3-6x as long: compute/exchange.py, _TlsPeer).
"""
from __future__ import annotations

import re
import socket
import ssl
import time

from rpc_daemon.wire.tensor_frames import ACK, TLS_HELLO, LinkBroken, check_tls_hello, pack_tls_hello
from rpc_daemon.wire.tls import TlsConfigError, client_context, server_context

# (cert, key, ca) -> (server context, client context): built once per process, at its first TLS link
_contexts: dict[tuple[str, str, str], tuple[ssl.SSLContext, ssl.SSLContext]] = {}


class LinkSetupFailed(Exception):
    """TLS over a tensor link failed. `peer_rank`: the peer whose failure it is (its certificate
    did not verify, it sent a wrong ticket, it closed the link), None when it is this member's own
    (its certificate refused by the peer, a deadline passed)."""

    def __init__(self, message: str, peer_rank: int | None):
        super().__init__(message)
        self.peer_rank = peer_rank


def contexts(cert: str, key: str, ca: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    key_of = (cert, key, ca)
    if key_of not in _contexts:
        server, client = server_context(cert, key), client_context(ca)
        for ctx in (server, client):
            # both ends are this program: TLS 1.3 only (no renegotiation, one round trip)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        server.num_tickets = 0  # no resumption: nothing arrives on the link after the handshake but ours
        _contexts[key_of] = (server, client)
    return _contexts[key_of]


class TlsSession:
    """One link's TLS session: OpenSSL's state, fed from the socket through `incoming` and
    drained to it from `outgoing` by whoever holds the socket (here, then exchange.py)."""

    __slots__ = ("obj", "incoming", "outgoing")

    def __init__(self, ctx: ssl.SSLContext, host: str | None):
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.incoming, self.outgoing, server_side=host is None, server_hostname=host)


def secure(socks: dict[int, socket.socket], link_id: int, rank: int, tls: dict) -> dict[int, TlsSession]:
    """A TLS session over each of `socks` (rank -> the daemon's vetted connection), its peer
    proven. `tls`: cert, key, ca (the worker's files), ticket (this member's listener's), peers
    (rank -> (host, ticket) of each lower rank, from the join), deadline (time.monotonic()).
    Every socket is closed when one fails (LinkSetupFailed)."""
    deadline = tls["deadline"]
    sessions: dict[int, TlsSession] = {}
    try:
        try:
            server_ctx, client_ctx = contexts(tls["cert"], tls["key"], tls["ca"])
        except TlsConfigError as exc:  # read at the first link, not at the daemon's start: moved since?
            raise LinkSetupFailed(str(exc), None) from None
        for s in socks.values():  # a handshake's flights are small writes: no Nagle wait for a delayed ACK
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for peer in sorted(socks):
            sock = socks[peer]
            if peer < rank:
                host, ticket = tls["peers"][peer]
                sessions[peer] = _session(client_ctx, sock, peer, host, deadline, lambda session: _show_ticket(
                    session, sock, peer, link_id, rank, ticket, deadline))
            else:
                sessions[peer] = _session(server_ctx, sock, peer, None, deadline, lambda session: _check_ticket(
                    session, sock, peer, link_id, tls["ticket"], deadline))
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    return sessions


def _left(deadline: float, peer: int) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise LinkSetupFailed(f"no time left for the TLS handshake with rank {peer} (the join's timeout)", None)
    return left


def _session(ctx, sock, peer: int, host: str | None, deadline: float, prove) -> TlsSession:
    """A TLS session over `sock` with rank `peer`: its client, verifying it as `host`, or (host
    None) its server; the handshake done, then `prove(session)` (the ticket shown or checked).
    Any failure is a LinkSetupFailed saying whose it is, after the alert OpenSSL wrote went out."""
    session = None
    try:
        session = TlsSession(ctx, host)
        _drive(session, sock, session.obj.do_handshake, deadline, peer)
        prove(session)
    except Exception as exc:
        _flush_alert(session, sock)
        raise _classified(exc, peer, host) from None
    return session


def _show_ticket(session: TlsSession, sock, peer: int, link_id: int, rank: int, ticket: bytes,
                 deadline: float) -> None:
    """As the client: TLS_HELLO with the lower rank's ticket, then its ACK."""
    session.obj.write(pack_tls_hello(link_id, rank, ticket))
    _flush(session, sock, deadline, peer)
    ack = _read_exactly(session, sock, len(ACK), deadline, peer)
    if ack != ACK:
        raise LinkBroken(f"it answered the TLS hello with {ack!r}, not ACK")


def _check_ticket(session: TlsSession, sock, peer: int, link_id: int, ticket: bytes, deadline: float) -> None:
    """As the server: the higher rank's TLS_HELLO with this listener's ticket, then ACK."""
    check_tls_hello(_read_exactly(session, sock, TLS_HELLO.size, deadline, peer), link_id, peer, ticket)
    session.obj.write(ACK)
    _flush(session, sock, deadline, peer)


def _drive(tls: TlsSession, sock, step, deadline: float, peer: int):
    """`step()` (a call of the session's SSLObject) done: what it writes sent, and the socket's
    bytes given to it while it wants more. Bounded: each wait ends at the deadline, or at EOF."""
    while True:
        try:
            result = step()
        except ssl.SSLWantReadError:
            _flush(tls, sock, deadline, peer)
            sock.settimeout(_left(deadline, peer))
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionResetError("closed") from None
            tls.incoming.write(data)
            continue
        _flush(tls, sock, deadline, peer)
        return result


def _flush(tls: TlsSession, sock, deadline: float, peer: int) -> None:
    data = tls.outgoing.read()
    if data:
        sock.settimeout(_left(deadline, peer))
        sock.sendall(data)


def _flush_alert(tls: TlsSession | None, sock) -> None:
    """Best effort, never waiting: the alert OpenSSL wrote when it failed (a certificate that did
    not verify) goes to the peer, which then knows its certificate was refused."""
    data = tls.outgoing.read() if tls is not None else b""
    if data:
        try:
            sock.setblocking(False)
            sock.send(data)
        except OSError:
            pass


def _read_exactly(tls: TlsSession, sock, n: int, deadline: float, peer: int) -> bytes:
    data = b""
    while len(data) < n:  # each read returns at least one byte, or ends the loop (EOF, the deadline)
        more = _drive(tls, sock, lambda: tls.obj.read(n - len(data)), deadline, peer)
        if not more:  # the peer ended its TLS session (close_notify)
            raise ConnectionResetError("closed")
        data += more
    return data


_PEER_ALERTS = ("SSLV3_ALERT_", "TLSV1_ALERT_", "TLSV13_ALERT_")  # an alert the peer sent: its refusal
_SSL_MESSAGE = re.compile(r"^\[SSL: [A-Z0-9_]+\] (.*?)(?: \(_ssl\.c:\d+\))?$")


def _reason(exc: ssl.SSLError) -> str:
    """OpenSSL's words without the library's decoration ("tlsv1 alert unknown ca")."""
    text = str(exc)
    m = _SSL_MESSAGE.match(text)
    return m.group(1) if m else text


def _classified(exc: Exception, peer: int, host: str | None) -> Exception:
    """What a step of the TLS phase with `peer` raised, as LinkSetupFailed saying whose failure it
    is. `host`: the peer's address when this member is its client (None: its server)."""
    if isinstance(exc, LinkSetupFailed):
        return exc
    if isinstance(exc, ssl.SSLCertVerificationError):  # we are its client: its certificate is the one
        return LinkSetupFailed(f"cannot verify the certificate of rank {peer} at {host}: certificate verify "
                               f"failed: {exc.verify_message} (is it signed by the CA in this worker's "
                               f"--peer-tls-ca, for that address?)", peer)
    if isinstance(exc, LinkBroken):  # a wrong ticket or answer inside TLS
        return LinkSetupFailed(f"rank {peer}: {exc}", peer)
    if isinstance(exc, TimeoutError):  # before OSError: socket.timeout is one
        return LinkSetupFailed(f"rank {peer} did not complete the TLS handshake within the join's timeout", None)
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionError)):
        return LinkSetupFailed(f"rank {peer} closed the tensor link during the TLS handshake (it failed, or the "
                               f"link was cancelled)", peer)
    if isinstance(exc, ssl.SSLError) and (exc.reason or "").startswith(_PEER_ALERTS):
        if host is None:  # we are its server: what it refused is our certificate ("unknown ca", "bad certificate")
            return LinkSetupFailed(f"rank {peer} refused this worker's TLS handshake: {_reason(exc)} (is this "
                                   f"worker's certificate signed by the CA in its peers' --peer-tls-ca, for the "
                                   f"address the coordinator reaches it at?)", None)
        return LinkSetupFailed(f"rank {peer} at {host} refused the TLS handshake: {_reason(exc)}", None)
    if isinstance(exc, ssl.SSLError):  # not TLS, or not ours: what came from the peer is wrong
        return LinkSetupFailed(f"TLS handshake with rank {peer} failed: {_reason(exc)}", peer)
    if isinstance(exc, OSError):
        return LinkSetupFailed(f"TLS with rank {peer}: {exc.strerror or exc}", peer)
    if isinstance(exc, (ValueError, TypeError)):  # (UnicodeError is one) a host TLS cannot name
        return LinkSetupFailed(f"TLS with rank {peer} at {host!r}: {exc}", None)
    return exc  # a bug of ours: raised as itself
