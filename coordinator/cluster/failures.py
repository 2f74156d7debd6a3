"""How a worker fails, as the coordinator records it: a stage's failed request,
an endpoint that cannot be reached, and the latch record of a failed endpoint."""
from __future__ import annotations

from dataclasses import dataclass

from rpc_daemon.failure_kind import FailureKind  # noqa: F401  (re-exported: one enum from the client up)


class StageFailed(Exception):
    """A stage's request failed (executors raise it). `cause` says how;
    `lost_connection`: the connection is gone, so the endpoint must be latched
    (else the worker is fine and only this request failed)."""

    def __init__(self, cause: FailureKind | str, endpoint: str, message: str):
        super().__init__(message)
        self.cause, self.endpoint, self.message = cause, endpoint, message

    @property
    def lost_connection(self) -> bool:
        return not isinstance(self.cause, FailureKind) or self.cause.lost_connection


class EndpointUnavailable(ConnectionError):
    """Connecting to (or loading weights onto) a worker failed: raised by the
    constructor and by reconnect(). `kind` as in EndpointFailure."""

    def __init__(self, endpoint: str, kind: FailureKind, message: str):
        super().__init__(message)
        self.endpoint, self.kind, self.message = endpoint, kind, message


@dataclass
class EndpointFailure:
    """Why an endpoint is latched failed. `cause` is the message; `kind` a
    FailureKind: 'unreachable', 'timeout', 'closed', 'protocol' (what the
    connection saw), 'reconnect' (retired by an explicit reconnect()) or
    'alloc'/'load' (the weights could not be placed while reconnecting)."""
    endpoint: str
    cause: str
    kind: FailureKind
    since: float  # unix time of the failure
    attempts: int = 0  # automatic reconnection attempts so far
    next_attempt: float | None = None  # unix time of the next automatic attempt, if one is scheduled
