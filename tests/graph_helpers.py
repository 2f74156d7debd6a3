"""Hand-written graphs for a real daemon: tensor dicts, packed values, and a Session of an attacker
connection beside a victim connection whose buffer must never change or leak."""
from __future__ import annotations

import struct

from ggml_ffi import lib
from rpc_daemon.wire.protocol import Command, Status
from extents_fuzz import canonical_nb
from rpc_helpers import RawConn

F32, F16, I32, I64 = lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_I32, lib.GGML_TYPE_I64
Q8_0 = lib.GGML_TYPE_Q8_0
INPUT, OUTPUT, COMPUTE = lib.GGML_TENSOR_FLAG_INPUT, lib.GGML_TENSOR_FLAG_OUTPUT, lib.GGML_TENSOR_FLAG_COMPUTE
KiB = 1024
VICTIM_FILL = 0x5A




def T(ttype, ne, nb=None, **kw) -> dict:
    """A wire tensor; canonical strides unless `nb` is given."""
    ne = list(ne) + [1] * (4 - len(ne))
    return dict({"type": ttype, "ne": ne, "nb": list(nb or canonical_nb(ttype, ne))}, **kw)


def f32s(*vals) -> bytes:
    return struct.pack(f"<{len(vals)}f", *vals)


def i32s(*vals) -> bytes:
    return struct.pack(f"<{len(vals)}i", *vals)


def lost(d) -> int:
    return sum("compute process lost" in line for line in d.log_lines)


class Session:
    """An attacker connection with its own buffer and a victim connection whose
    buffer is filled with VICTIM_FILL (allocated first, so it is mapped right
    above the attacker's in the compute process, where an overrun lands)."""

    def __init__(self, d, size: int = 64 * KiB):
        self.d = d
        self.victim = RawConn(d.port)
        self.victim.hello()
        h, _ = self.victim.call(Command.ALLOC_BUFFER, {"size": size})
        self.vbuf, self.vsize = h["buffer"], size
        self.victim.call(Command.BUFFER_CLEAR, {"buffer": self.vbuf, "value": VICTIM_FILL})
        self.conn = RawConn(d.port)
        self.conn.hello()
        h, _ = self.conn.call(Command.ALLOC_BUFFER, {"size": size})
        self.buf, self.size = h["buffer"], size
        self.conn.call(Command.BUFFER_CLEAR, {"buffer": self.buf, "value": 0})
        # map both buffers in the compute process with a harmless compute of each
        for conn, buf in ((self.victim, self.vbuf), (self.conn, self.buf)):
            tensors = [T(F32, [4], buffer=buf), T(F32, [4], op=lib.GGML_OP_SCALE, src=[0], params=f32s(1.0),
                                                     flags=OUTPUT | COMPUTE)]
            h, _ = conn.call(Command.GRAPH_COMPUTE, {"tensors": tensors, "inputs": [], "outputs": [1]})
            assert h["status"] == Status.SUCCESS, h
        self.lost0 = lost(d)

    def victim_bytes(self) -> bytes:
        h, out = self.victim.call(Command.GET_TENSOR, {"buffer": self.vbuf, "offset": 0, "size": self.vsize})
        assert h["status"] == Status.SUCCESS, h
        return out

    def refused(self, tensors, inputs=(), blob=b"", outputs=(), fragment: str = "") -> dict:
        for t in tensors:  # nodes without COMPUTE are skipped by ggml: make every node really run
            if t.get("op", 0):
                t["flags"] = t.get("flags", 0) | COMPUTE
        h, out = self.conn.call(Command.GRAPH_COMPUTE, {"tensors": tensors, "inputs": [list(i) for i in inputs],
                                                        "outputs": list(outputs)}, blob)
        assert bytes([VICTIM_FILL]) * 16 not in out, "the victim's bytes came back in the reply"
        assert h["status"] == Status.INVALID_REQUEST, h
        assert fragment in h.get("error", ""), h
        assert self.victim_bytes() == bytes([VICTIM_FILL]) * self.vsize, "the victim's buffer changed"
        assert lost(self.d) == self.lost0, "the compute process died:\n" + "".join(self.d.log_lines[-10:])
        return h

    def close(self):
        self.conn.close()
        self.victim.close()
