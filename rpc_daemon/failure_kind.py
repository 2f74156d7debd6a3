"""What failed, in one word, from the client (PeerFailed) up to the coordinator's
DecodeError, EndpointFailure and health(): one enum for all of them."""
from __future__ import annotations

import enum


class FailureKind(str, enum.Enum):
    """What failed, in one word: EndpointFailure.kind, EndpointUnavailable.kind,
    DecodeError.cause, Coordinator.last_cause, health()'s "kind". A str, so
    `kind == "closed"`, f-strings, logs and JSON see the plain word."""
    # the connection is gone (the endpoint is latched): from rpc_daemon's PeerFailed...
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    CLOSED = "closed"
    PROTOCOL = "protocol"
    ENDPOINT = "endpoint"  # ...or the worker refused what a connection needs first (DEVICE_INFO)
    RECONNECT = "reconnect"  # retired by an explicit reconnect()
    # the worker is fine, a request failed
    COMPUTE = "compute"
    ALLOC = "alloc"  # out of memory
    LOAD = "load"  # a weight upload refused
    # refused or failed here
    INTERNAL = "internal"  # a bug of ours
    CONTEXT_FULL = "context_full"
    INVALID_BATCH = "invalid_batch"

    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__  # as the plain strings were, e.g. in EndpointFailure's repr

    @property
    def lost_connection(self) -> bool:
        return self in _CONNECTION_KINDS

    @classmethod
    def of(cls, word: str) -> "FailureKind | str":
        """The member for `word` (a PeerFailed kind); an unknown word as it is."""
        try:
            return cls(word)
        except ValueError:
            return word


_CONNECTION_KINDS = frozenset({FailureKind.UNREACHABLE, FailureKind.TIMEOUT, FailureKind.CLOSED,
                               FailureKind.PROTOCOL, FailureKind.ENDPOINT, FailureKind.RECONNECT})
