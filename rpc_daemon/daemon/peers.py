"""Step links: a step's activations go from worker to worker instead of back
through the client (docs/protocol.md, "Step links").

A client (a coordinator) names, per connection, a random 16-byte token and the
workers this connection's steps may forward to (STEP_PEERS). A compute request
may then take one input from the session's mailbox (`step_input`: it waits for
the tag, bounded by its timeout) and push its outputs to other sessions'
mailboxes (`forward`: worker, token, tag). A push arrives as STEP_INPUT on an
ordinary authenticated connection (PeerLinks opens those, with this daemon's
shared secret and TLS) and lands in the mailbox of the session that registered
the token, and nowhere else; the bytes then become an inline input of that
session's own graph and pass the same validation as any inline input.
"""
from __future__ import annotations

import asyncio
import collections
import weakref
from dataclasses import dataclass, field

import structlog

from rpc_daemon.client import PeerFailed, RpcClient, RpcError
from rpc_daemon.service.loop import within
from rpc_daemon.validation import requests as V
from rpc_daemon.wire.protocol import Command, ProtocolError, Status

log = structlog.get_logger("rpc")

MAX_MAILBOX_ENTRIES = 32  # step inputs (and cancellations) a session holds before a request takes them
ENDED_TAGS = 256  # tags whose request has ended, remembered per session: later inputs and cancellations are moot
MAX_DEFERRED = 4  # forwarding requests of one connection whose pushes are still unanswered
PUSH_DEADLINE = 60.0  # one push, even to a peer that keeps answering pings


class _Cancelled:
    """A tag its client cancelled before (or while) a request waited for it."""


CANCELLED = _Cancelled()


class Mailbox:
    """The step inputs delivered to one session, by tag, until a request takes them.

    A cancellation (the client's: the tag's step failed) ends the request
    waiting for the tag, or leaves a mark that ends the request still to come
    (it may be queued behind the connection's running request). The mark stays
    until that request takes it: an input that arrives after the cancellation
    is refused and does not remove it (else the queued request would wait its
    whole timeout for an input that already came and went). A tag whose
    request has ended is remembered (the last ENDED_TAGS), so a cancellation
    of it leaves no mark that nothing would take, and a late input for it is
    refused instead of held."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: collections.OrderedDict[int, bytes | _Cancelled] = collections.OrderedDict()
        self.waiters: dict[int, asyncio.Future] = {}
        self.held = 0
        self.closed = False
        self.ended: collections.OrderedDict[int, None] = collections.OrderedDict()  # tags whose request ended

    def _ended(self, tag: int) -> None:
        self.ended[tag] = None
        self.ended.move_to_end(tag)
        if len(self.ended) > ENDED_TAGS:
            self.ended.popitem(last=False)

    def put(self, tag: int, data: bytes) -> None:
        waiter = self.waiters.pop(tag, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(data)
            return
        if tag in self.ended:
            raise ProtocolError(Status.INVALID_REQUEST, f"step input {tag} was already delivered (or cancelled): "
                                                        f"its request has ended")
        if tag in self.entries:  # a mark stays: it ends the request still to come for this tag
            raise ProtocolError(Status.INVALID_REQUEST, f"step input {tag} was already delivered (or cancelled)")
        if len(self.entries) >= MAX_MAILBOX_ENTRIES:
            self._drop_cancelled()
        if len(self.entries) >= MAX_MAILBOX_ENTRIES or self.held + len(data) > self.max_bytes:
            raise ProtocolError(Status.LIMIT_EXCEEDED, f"the session holds {len(self.entries)} step inputs "
                                                       f"({self.held} bytes) that no request took; limit "
                                                       f"{MAX_MAILBOX_ENTRIES} and {self.max_bytes} bytes")
        self.entries[tag] = data
        self.held += len(data)

    def _drop_cancelled(self) -> None:
        """Forget the oldest cancellations until there is room for one entry:
        a mark whose request never comes (refused before it waited, or a tag
        that fell out of `ended`) would hold its room for ever; room for
        inputs is worth more (a late input of a forgotten tag is then kept
        until the step's request or the connection ends)."""
        for tag in [t for t, entry in self.entries.items() if entry is CANCELLED]:
            if len(self.entries) < MAX_MAILBOX_ENTRIES:
                return
            del self.entries[tag]

    def cancel(self, tag: int) -> None:
        waiter = self.waiters.pop(tag, None)
        if waiter is not None and not waiter.done():
            waiter.set_exception(ProtocolError(Status.INPUT_MISSING, f"step input {tag} was cancelled by the client "
                                                                     f"(an earlier stage of the step failed)"))
            return
        if tag in self.ended:
            return  # its request has ended (it took its input, or was told): nothing to end, no mark to leave
        old = self.entries.pop(tag, None)
        if isinstance(old, bytes):
            self.held -= len(old)
        if len(self.entries) >= MAX_MAILBOX_ENTRIES:
            self._drop_cancelled()
        while len(self.entries) >= MAX_MAILBOX_ENTRIES:  # the oldest goes: a cancellation is worth less than room
            _, dropped = self.entries.popitem(last=False)
            if isinstance(dropped, bytes):
                self.held -= len(dropped)
        self.entries[tag] = CANCELLED

    async def take(self, tag: int, timeout: float) -> bytes:
        """The input under `tag`, waiting for it at most `timeout` seconds.
        Raises ProtocolError INPUT_MISSING when it does not come or was cancelled."""
        if tag in self.waiters:
            raise ProtocolError(Status.INVALID_REQUEST, f"a request already waits for step input {tag}")
        if tag in self.ended:
            raise ProtocolError(Status.INVALID_REQUEST, f"step input {tag} served a request already: a tag is "
                                                        f"for one request")
        data = self.entries.pop(tag, None)
        self._ended(tag)  # whatever happens now, this tag's request ends with this call
        if isinstance(data, bytes):
            self.held -= len(data)
            return data
        if data is CANCELLED:
            raise ProtocolError(Status.INPUT_MISSING, f"step input {tag} was cancelled by the client "
                                                      f"(an earlier stage of the step failed)")
        if self.closed:
            raise ProtocolError(Status.INPUT_MISSING, "the connection is closing")
        waiter = self.waiters[tag] = asyncio.get_running_loop().create_future()
        try:
            return await within(waiter, timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(Status.INPUT_MISSING, f"step input {tag} did not arrive within {timeout:g} s") from None
        finally:
            if self.waiters.get(tag) is waiter:
                del self.waiters[tag]

    def close(self) -> None:
        """The connection is gone: its waiting request stops waiting now."""
        self.closed = True
        for waiter in self.waiters.values():
            if not waiter.done():
                waiter.set_exception(ProtocolError(Status.INPUT_MISSING, "the connection is closing"))
        self.waiters.clear()
        self.entries.clear()
        self.held = 0


class StepSession:
    """A session's step links: its token, the peers it may forward to, its mailbox."""

    def __init__(self, token: bytes, peers: frozenset, max_bytes: int):
        self.token, self.peers, self.mailbox = token, peers, Mailbox(max_bytes)


class PeerLinks:
    """This daemon's connections to peer workers (one per worker address,
    shared by its sessions), opened on first use with the daemon's secret and
    TLS, reopened after a failure; and the registry of session tokens."""

    def __init__(self, secret: bytes | None, ssl_context, timeout: float, usable: bool, stats=None):
        self.secret, self.ssl_context, self.timeout = secret, ssl_context, timeout
        self.stats = stats if stats is not None else collections.Counter()  # step_pushes, step_push_failures
        self.usable = usable  # False: a TLS daemon without --peer-tls-ca cannot verify peers
        self.tokens: dict[bytes, weakref.ref] = {}  # token -> the StepSession that registered it
        self._links: dict[str, RpcClient] = {}
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)

    def register(self, steps: StepSession) -> None:
        owner = self.tokens.get(steps.token)
        if owner is not None and owner() is not None and owner() is not steps:
            raise ProtocolError(Status.INVALID_REQUEST, "step token already in use by another session")
        self.tokens[steps.token] = weakref.ref(steps)

    def unregister(self, steps: StepSession) -> None:
        owner = self.tokens.get(steps.token)
        if owner is not None and owner() in (steps, None):
            del self.tokens[steps.token]

    def session_of(self, token: bytes) -> StepSession | None:
        ref = self.tokens.get(token)
        return ref() if ref is not None else None

    async def round_trips(self, to: str, count: int) -> list[float]:
        """`count` PINGs to worker `to`, one after another, over this daemon's link to it (opened
        as for a push: secret, TLS): each one's round trip in seconds. PeerFailed, RpcError."""
        client = await self._link(to)
        return [await client.ping() for _ in range(count)]

    async def _link(self, to: str) -> RpcClient:
        async with self._locks[to]:
            client = self._links.get(to)
            if client is None or client.failed is not None:
                client = self._links[to] = await RpcClient.connect(
                    to, self.timeout, self.timeout, secret=self.secret, ssl_context=self.ssl_context)
                log.info("peer link opened", peer=to)
            return client

    async def push(self, to: str, token: bytes, tag: int, data: bytes) -> str | None:
        """Deliver `data` to the session registered under `token` (here, or on
        worker `to`). None, or why it failed."""
        self.stats["step_pushes"] += 1
        why = await self._push(to, token, tag, data)
        if why is not None:
            self.stats["step_push_failures"] += 1
        return why

    async def _push(self, to: str, token: bytes, tag: int, data: bytes) -> str | None:
        local = self.session_of(token)
        if local is not None:  # the token is this daemon's: no network hop to ourselves
            try:
                local.mailbox.put(tag, data)
            except ProtocolError as exc:
                return exc.message
            return None
        try:
            client = await self._link(to)
            await client.request(Command.STEP_INPUT, {"token": token, "tag": tag}, data, PUSH_DEADLINE)
        except (PeerFailed, RpcError) as exc:
            return f"peer worker {to}: {exc}"
        return None

    def close(self) -> None:
        for client in self._links.values():
            client.close()
        self._links.clear()


@dataclass
class Deferred:
    """A compute whose reply waits for its pushes: the connection answers it
    from a task of its own and goes on with its next request meanwhile."""
    fields: dict
    out: bytes
    forward: list  # V.Forward
    reply_output: bool = False  # the reply carries `out` even when every push succeeded
    pushes: list = field(default_factory=list)  # the pushes' tasks, in forward order, once started

    def start(self, links: PeerLinks) -> None:
        """Start the pushes. The connection then yields one loop turn, so their
        first steps (a local mailbox put, or the STEP_INPUT frame written to the
        peer) run before its next request's handler: the next stage's compute
        waits on this write, the next request (a head shard waiting for its
        input) does not."""
        loop = asyncio.get_running_loop()
        self.pushes = [loop.create_task(links.push(f.to, f.token, f.tag, self.out)) for f in self.forward]

    async def finish(self) -> tuple[dict, bytes]:
        errors = await asyncio.gather(*self.pushes)
        failed = [[i, err] for i, err in enumerate(errors) if err is not None]
        if not failed:
            return dict(self.fields, forwarded=True), self.out if self.reply_output else b""
        log.warning("step forward failed; the client relays", errors=[err for _, err in failed])
        return dict(self.fields, forwarded=False, forward_failed=failed), self.out


def steps_of(s) -> StepSession:
    if s.steps is None:
        raise ProtocolError(Status.INVALID_REQUEST, "step links need STEP_PEERS first")
    return s.steps


async def handle_step_peers(s, h, blob, direct):
    token, peers = V.check_step_peers(h)
    links: PeerLinks = s.daemon.peer_links
    old = s.steps
    if old is not None and old.token == token:
        old.peers = peers
        return {"step_links": links.usable}
    steps = StepSession(token, peers, s.limits.max_inflight)
    links.register(steps)  # refused (nothing changed) if another session holds the token
    if old is not None:
        links.unregister(old)
        steps.mailbox = old.mailbox  # inputs already delivered stay the session's
    s.steps = steps
    return {"step_links": links.usable}


def handle_step_input(s, h, blob, direct):
    """Answered as soon as it is read: a request of the session may be waiting for it."""
    try:
        token, tag, cancel = V.check_step_input(h)
    except ProtocolError as exc:
        return {"status": exc.status, "error": exc.message}
    steps = s.daemon.peer_links.session_of(token)
    if steps is None:
        return {"status": Status.NOT_AUTHORIZED, "error": "no session on this worker accepts step inputs under "
                                                          "this token"}
    try:
        if cancel:
            steps.mailbox.cancel(tag)
        else:
            steps.mailbox.put(tag, bytes(blob))
    except ProtocolError as exc:
        return {"status": exc.status, "error": exc.message}
    return {}


async def take_step_input(s, h: dict, blob, link: V.StepLink):
    """The request's header and blob with its step input bound as one more
    inline input (waited for in the session's mailbox); unchanged without one."""
    if link.input is None:
        return h, blob
    data = await steps_of(s).mailbox.take(link.input.tag, link.input.timeout)
    inputs = h.get("inputs", [])  # absent: none, as the parser reads it
    if not isinstance(inputs, list):
        return h, blob  # refused by the validation, as without a step input
    return dict(h, inputs=inputs + [[link.input.tensor, len(blob), len(data)]]), b"".join((blob, data))


def deferred(s, result, link: V.StepLink):
    """A successful compute with `forward`: its reply waits for the pushes."""
    if not link.forward or not isinstance(result, tuple):
        return result
    fields, out = result
    return Deferred(fields, bytes(out), link.forward, link.reply_output)


def check_link(s, h: dict) -> V.StepLink:
    link = V.check_step_link(h)
    if link.input is not None or link.forward:
        steps = steps_of(s)
        if link.forward and not s.daemon.peer_links.usable:
            raise ProtocolError(Status.INVALID_REQUEST, "this worker serves TLS without --peer-tls-ca: it cannot "
                                                        "verify peers, so it does not forward")
        for f in link.forward:
            if f.to not in steps.peers:
                raise ProtocolError(Status.NOT_AUTHORIZED, f"forward to {f.to!r}: not a peer STEP_PEERS named "
                                                           f"for this session")
    return link
