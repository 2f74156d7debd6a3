"""The connections of a daemon started with --test-fault (tests only): they
misbehave as the fault specs say (faults.py), through the seams of
daemon/connection.py's Connection, which carries nothing of this. Imported by
the daemon's app only when its config has fault specs."""
from __future__ import annotations

import functools

from rpc_daemon.daemon.connection import Connection
from rpc_daemon.testing.faults import Faults
from rpc_daemon.wire.protocol import Status


class FaultyConnection(Connection):
    """A daemon connection that misbehaves as the daemon's fault specs say:
    around the handler of a queued request that a spec takes (before it, while
    it runs, instead of or halfway through its reply), and by refusing a
    STEP_INPUT a spec names. Requests no spec takes are served as usual."""

    def __init__(self, daemon, faults: Faults):
        super().__init__(daemon)
        self.faults = faults

    async def _call(self, cmd, row, header, blob, direct):
        fault = self.faults.take(cmd)
        if fault is None:
            return await super()._call(cmd, row, header, blob, direct)
        if await fault.before(self):
            return None  # dropped: no reply
        result, _ = await super()._call(cmd, row, header, blob, direct)
        return result, functools.partial(fault.send, self)

    def _answer_now(self, req_id, row, header: dict, blob) -> None:
        if self.faults.refuse_now(header, self):  # a spec naming STEP_INPUT may refuse it
            self._reply(req_id, Status.FAILED, "test fault: injected refusal")
            return
        super()._answer_now(req_id, row, header, blob)


def connections(daemon):
    """The protocol factory of a daemon whose config has fault specs: one fault
    table (counting across connections), FaultyConnections sharing it."""
    faults = Faults(list(daemon.config.test_faults), daemon)
    return lambda: FaultyConnection(daemon, faults)
