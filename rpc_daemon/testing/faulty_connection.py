"""The connections of a daemon started with --test-fault or --test-older (tests
only): they misbehave as the fault specs say (faults.py), or refuse what a daemon
from before a feature refused, through the seams of daemon/connection.py's
Connection, which carries nothing of this. Imported by the daemon's app only
when its config has fault specs or older features."""
from __future__ import annotations

import functools

import structlog

from ggml_ffi import lib
from rpc_daemon.daemon.connection import Connection
from rpc_daemon.testing.faults import Faults
from rpc_daemon.wire.protocol import Command, Status


def _uses_dot_type_inputs(header: dict) -> str | None:
    """What a daemon from before "dot_type_inputs" said of a graph that uses it: a cast
    (CPY naming itself), a CPY into q8_K or q8_1 (then no KV type), a MUL_MAT whose src1
    is not f32. Anything malformed is left to the validation."""
    tensors = header.get("tensors")
    if not isinstance(tensors, list):
        return None
    for i, t in enumerate(tensors):
        src = t.get("src") if isinstance(t, dict) else None
        if not isinstance(src, list):
            continue
        if t.get("op") == lib.GGML_OP_CPY and (i in src or t.get("type") in (lib.GGML_TYPE_Q8_K, lib.GGML_TYPE_Q8_1)):
            return f"tensors[{i}]: CPY: dst type not supported"
        if t.get("op") == lib.GGML_OP_MUL_MAT and len(src) > 1 and isinstance(src[1], int) and 0 <= src[1] < i \
                and isinstance(tensors[src[1]], dict) and tensors[src[1]].get("type") != lib.GGML_TYPE_F32:
            return f"tensors[{i}]: MUL_MAT: src1 type not supported"
    return None


def _uses_op(op: int, name: str):
    """What a daemon from before the op `name` said of a graph with such a node."""
    def refusal(header: dict) -> str | None:
        tensors = header.get("tensors")
        for i, t in enumerate(tensors if isinstance(tensors, list) else ()):
            if isinstance(t, dict) and t.get("op") == op:
                return f"tensors[{i}]: op {name} is not supported by this daemon"
        return None
    return refusal


# feature -> what a daemon from before it said of a GRAPH_COMPUTE using it (a refusal, or None); a
# daemon from before "step_channel" did not know STEP_CHANNEL (UNKNOWN_COMMAND, below), one from before
# "tensor_rtt" not TENSOR_LINK's op "rtt" (INVALID_REQUEST, below); one from before "tensor_gather" is
# sent no `tensor.gather` (it is not offered)
OLDER = {"dot_type_inputs": _uses_dot_type_inputs, "step_channel": lambda header: None,
         "concat": _uses_op(lib.GGML_OP_CONCAT, "CONCAT"), "tensor_rtt": lambda header: None,
         "pad": _uses_op(lib.GGML_OP_PAD, "PAD"), "tensor_gather": lambda header: None}
log = structlog.get_logger("rpc")


class FaultyConnection(Connection):
    """A daemon connection that misbehaves as the daemon's fault specs say:
    around the handler of a queued request that a spec takes (before it, while
    it runs, instead of or halfway through its reply), and by refusing a
    STEP_INPUT a spec names. Requests no spec takes are served as usual."""

    def __init__(self, daemon, faults: Faults):
        super().__init__(daemon)
        self.faults = faults

    async def _call(self, cmd, row, header, blob, direct):
        if cmd == Command.STEP_CHANNEL and "step_channel" in self.daemon.config.test_older:
            return {"status": int(Status.UNKNOWN_COMMAND), "error": f"unknown command {cmd}"}, self._send
        if cmd == Command.TENSOR_LINK and header.get("op") == "rtt" and "tensor_rtt" in self.daemon.config.test_older:
            return {"status": int(Status.INVALID_REQUEST), "error": "field 'op' must be 'listen' or 'join'"}, self._send
        if cmd == Command.GRAPH_COMPUTE:
            for feature in self.daemon.config.test_older:
                refusal = OLDER[feature](header)
                if refusal:
                    return {"status": int(Status.INVALID_REQUEST), "error": refusal}, self._send
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
    if daemon.config.test_older:
        log.warning("TEST: acting as a daemon from before these features", features=list(daemon.config.test_older))
    return lambda: FaultyConnection(daemon, faults)
