"""Property-based fuzzing of a live daemon: hypothesis strategies for protocol
messages with valid framing and random contents, and a client that sends them
one at a time over one reused connection (reconnecting when the daemon hangs
up) and checks every reply.

Three families of messages:

* `raw_messages`: any command id (known, unknown, not even an int) with a map
  of fields drawn from the protocol's field names and random values of every
  msgpack type;
* `command_messages`: each known command with plausible fields (this
  connection's buffers, offsets and sizes near their edges, blobs whose length
  may or may not match);
* `graph_messages`: GRAPH_COMPUTE / GRAPH_RECOMPUTE of random graphs: graphs
  built from random wire tensors, and valid seed graphs (built with the real
  ggml op constructors, one per supported op family) with random mutations of
  tensor fields, inputs, outputs and inline data (row ids included), and
  stride mutations (nb[0] = 0, swapped or scaled strides, odd strides of
  dims of size 1) of the kind that once let a view read past its buffer;
* `lying_prefixes`: connections that declare huge headers or blobs (before
  and after HELLO) and send a fraction of them, held open side by side: the
  daemon must not commit memory for bytes that never came;
* `tiny_buffer_bursts`: hundreds of one-byte-to-one-page ALLOC_BUFFERs in a
  row: past its limit a client gets LIMIT_EXCEEDED, and another client can
  still connect, allocate and compute;
* `channel_messages`: what a client sends over its step channel, straight to
  its compute process (`ChannelFuzzer`: each answered or, refused by the
  framing, the channel closed; the compute process lives through all of it).

Any message may carry an int-like non-integer (True, 1.0) where the spec says
int (`Message.must_refuse`): such a request must be refused. A refused request
that could write (SET_TENSOR, COPY_TENSOR, BUFFER_CLEAR, SET_TENSOR_HASH,
graphs) must leave the connection's buffers byte-for-byte unchanged.

What a reply must satisfy (`FuzzClient.send`): it arrives (no hang), it is a
well-formed frame with a known status and our request id, and it is never an
"internal error" (a handler raising: a bug of ours) nor a dead compute process
(a graph that passed validation yet crashed libggml: a hole in the validator).

Used by tests/daemon/test_fuzz_daemon.py (a few thousand cases) and
bench/fuzz_daemon.py (as many as you like).
"""
from __future__ import annotations

import copy
import re
import socket
import struct
import time
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from ggml_ffi import Context, NULL, lib
from rpc_daemon.wire import framing as F
from rpc_daemon.wire import protocol as P
from rpc_daemon.validation.graph import SUPPORTED_OPS
from rpc_daemon.wire.graph_codec import encode_graph
from rpc_daemon.wire.protocol import Command, Status
from rpc_helpers import RawConn, assigned_pids, encode_prefix, rss, small_graph

# a real failure in a daemon's log: a Python traceback's first line, or the connection's "handler failed"
# event (console format: "... [error    ] handler failed ..."); not the same words inside a refusal's
# echoed `error=` (hypothesis draws strings from constants in the source: seed 43 drew 'Traceback')
_FAILURE = re.compile(r"^Traceback \(most recent call last\)|\[\w+\s*\] handler failed")


def daemon_failures(log_lines: list[str]) -> list[int]:
    """Indexes of the lines of a daemon's log that show a failure of its own."""
    return [i for i, line in enumerate(log_lines) if _FAILURE.search(line)]


BASE = 1 << 47  # placeholder buffer id in seed graphs: replaced by the client's current base buffer
BASE_SIZE = 64 << 10
STATUSES = set(int(s) for s in Status)
FIELD_NAMES = ("buffer", "offset", "size", "src_buffer", "src_offset", "value", "hash", "cache", "graph_id",
               "tensors", "inputs", "outputs", "version", "features", "auth_nonce", "proof", "id", "cmd",
               "token", "peers", "tag", "cancel", "step_input", "forward")
EDGE_INTS = (0, 1, -1, 2, 63, 64, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**48,
             2**48 + 1, 2**53, 2**62, 2**63 - 1, -(2**63), 2**64 - 1)


# ---------------------------------------------------------------- values

ints = st.one_of(st.integers(-3, 300), st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**64 - 1))
small_ints = st.one_of(st.integers(-2, 40), st.sampled_from(EDGE_INTS))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=20),
                    st.binary(max_size=70))
# numbers msgpack encodes as bool or float: never an int, whatever Python's == says
INT_LIKE = (True, False, 1.0, 0.0, 2.0, 5.0, 4096.0, float("nan"))
int_like = st.sampled_from(INT_LIKE)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=6),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


@dataclass(frozen=True)
class BufRef:
    """One of the connection's own buffers, picked when the message is sent
    (strategies must not depend on run-time state)."""
    k: int


own_buffer = st.integers(0, 7).map(BufRef)


def maybe_garbage(plausible):
    """Mostly `plausible`, sometimes any value at all."""
    return st.one_of(plausible, plausible, plausible, values)


# ---------------------------------------------------------------- messages

@dataclass
class Message:
    header: dict
    blob: bytes = b""
    note: str = ""
    must_refuse: bool = False  # an int field holds a bool or float: SUCCESS would be a bug
    burst: int = 0  # tiny_buffer_bursts: this many ALLOC_BUFFERs of header["size"] in a row
    lie: tuple | None = None  # lying_prefixes: (bytes to send on a fresh connection, hello first)


INT_FIELDS = {  # the integer fields each command reads (docs/protocol.md)
    Command.HELLO: ("version",),
    Command.ALLOC_BUFFER: ("size",),
    Command.FREE_BUFFER: ("buffer",),
    Command.BUFFER_CLEAR: ("buffer", "value"),
    Command.SET_TENSOR: ("buffer", "offset", "size"),
    Command.GET_TENSOR: ("buffer", "offset", "size"),
    Command.COPY_TENSOR: ("buffer", "offset", "size", "src_buffer", "src_offset"),
    Command.SET_TENSOR_HASH: ("buffer", "offset", "size"),
    Command.GRAPH_FREE: ("graph_id",),
    Command.STEP_INPUT: ("tag",),
}
STEP_TOKENS = (b"\x01" * 16, b"\x02" * 16, b"\x03" * 15)  # step links: the last is one byte short
# statuses that say "nothing was done"
REFUSALS = (Status.INVALID_REQUEST, Status.UNKNOWN_COMMAND, Status.LIMIT_EXCEEDED, Status.NOT_FOUND,
            Status.VERSION_MISMATCH, Status.NOT_AUTHORIZED)
WRITING = (Command.SET_TENSOR, Command.SET_TENSOR_HASH, Command.COPY_TENSOR, Command.BUFFER_CLEAR,
           Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE)


@st.composite
def raw_messages(draw):
    cmd = draw(st.one_of(st.sampled_from([int(c) for c in Command]), st.integers(-5, 40), values))
    keys = draw(st.lists(st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=6)), max_size=6, unique=True))
    header = {k: draw(values) for k in keys if k not in ("id", "cmd")}
    header["cmd"] = cmd
    blob = draw(st.one_of(st.just(b""), st.binary(max_size=300)))
    return Message(header, blob, "raw")


@st.composite
def command_messages(draw):
    buffer = maybe_garbage(st.one_of(own_buffer, own_buffer, small_ints))
    offset = maybe_garbage(st.one_of(st.integers(0, BASE_SIZE + 64), small_ints))
    size = maybe_garbage(st.one_of(st.integers(0, 4096), small_ints))
    cmd = draw(st.sampled_from([c for c in Command if c not in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE)]))
    h: dict = {"cmd": int(cmd)}
    blob = b""
    if cmd == Command.HELLO:
        h["version"] = draw(st.one_of(st.just(P.PROTOCOL_VERSION), small_ints, values))
    elif cmd == Command.AUTH:
        h["proof"] = draw(st.binary(min_size=0, max_size=40))
    elif cmd == Command.ALLOC_BUFFER:
        h["size"] = draw(maybe_garbage(st.one_of(st.integers(1, 1 << 16), small_ints, st.integers(1, 1 << 26))))
    elif cmd in (Command.FREE_BUFFER, Command.BUFFER_CLEAR):
        h["buffer"] = draw(buffer)
        if cmd == Command.BUFFER_CLEAR:
            h["value"] = draw(maybe_garbage(st.integers(-1, 256)))
    elif cmd in (Command.SET_TENSOR, Command.GET_TENSOR, Command.COPY_TENSOR, Command.SET_TENSOR_HASH):
        h.update(buffer=draw(buffer), offset=draw(offset), size=draw(size))
        if cmd == Command.SET_TENSOR:
            n = h["size"] if type(h["size"]) is int and 0 <= h["size"] <= 4096 else 16
            n = draw(st.one_of(st.just(n), st.integers(0, 300)))
            blob = draw(st.binary(min_size=n, max_size=n))
            if draw(st.booleans()):
                h["cache"] = draw(st.one_of(st.booleans(), values))
        elif cmd == Command.COPY_TENSOR:
            h.update(src_buffer=draw(buffer), src_offset=draw(offset))
        elif cmd == Command.SET_TENSOR_HASH:
            h["hash"] = draw(st.one_of(st.text("0123456789abcdef", min_size=64, max_size=64), values))
    elif cmd == Command.GRAPH_FREE:
        h["graph_id"] = draw(maybe_garbage(st.integers(-1, 8)))
    elif cmd in (Command.STEP_PEERS, Command.STEP_INPUT):
        # a few fixed tokens, so inputs sometimes land in a mailbox a STEP_PEERS of this run registered
        h["token"] = draw(maybe_garbage(st.sampled_from(STEP_TOKENS)))
        if cmd == Command.STEP_PEERS:
            h["peers"] = draw(maybe_garbage(st.lists(st.sampled_from(("127.0.0.1:9", "localhost:1", "x", "")),
                                                     max_size=3)))
        else:
            h["tag"] = draw(maybe_garbage(st.integers(-1, 6)))
            if draw(st.booleans()):
                h["cancel"] = draw(st.one_of(st.booleans(), values))
            blob = draw(st.binary(max_size=64))
    if draw(st.integers(0, 9)) == 0:  # an extra field nobody asked for
        h[draw(st.text(max_size=6))] = draw(values)
    must_refuse = False
    if cmd != Command.AUTH and draw(st.integers(0, 5)) == 0:  # an int field as bool or float (the command too)
        key = draw(st.sampled_from(("cmd",) + INT_FIELDS.get(cmd, ())))
        h[key] = draw(int_like)
        must_refuse = True
    return Message(h, blob, cmd.name, must_refuse=must_refuse)


# ---------------------------------------------------------------- graphs

@dataclass
class Seed:
    name: str
    tensors: list[dict]
    inputs: list[tuple[int, int, str]]  # (tensor index, nbytes, kind) kind: "f32", "f16", "i32", "i64"
    outputs: list[int]


def _seed(name: str, build, n: int = 64) -> Seed | None:
    ctx = Context(n)
    try:
        outs, inputs, placed = build(ctx.ptr, ctx)
        gf = ctx.new_graph()
        for o in outs:
            lib.ggml_set_output(o)
            lib.ggml_build_forward_expand(gf, o)
        place = {t: (BASE, off) for t, off in placed}
        tensors, index_of = encode_graph(gf, lambda t: place.get(t))
        ins = [(index_of[t], lib.ggml_nbytes(t), kind) for t, kind in inputs if t in index_of]
        return Seed(name, tensors, ins, [index_of[o] for o in outs])
    except Exception:  # pragma: no cover - an op this libggml lacks: fewer seeds
        return None
    finally:
        ctx.close()


def _inp(ctx, t, ne, name):
    x = ctx.new_tensor(t, ne, name)
    lib.ggml_set_input(x)
    return x


F32, F16, I32, I64 = lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_I32, lib.GGML_TYPE_I64


def make_seeds() -> list[Seed]:
    def arith(c, ctx):
        x = ctx.new_tensor(F32, [4, 3], "x")
        y = _inp(ctx, F32, [4, 3], "y")
        z = lib.ggml_div(c, lib.ggml_sub(c, lib.ggml_mul(c, lib.ggml_add(c, x, y), y), x), y)
        return [z], [(y, "f32")], [(x, 0)]

    def rows(c, ctx):
        a = ctx.new_tensor(F32, [8, 16], "a")
        ids = _inp(ctx, I32, [4], "ids")
        dst = ctx.new_tensor(F32, [8, 16], "dst")
        src = _inp(ctx, F32, [8, 4], "src")
        kv = _inp(ctx, I64, [4], "kv_idxs")
        g = lib.ggml_get_rows(c, a, ids)
        s = lib.ggml_set_rows(c, dst, src, kv)
        return [g, s], [(ids, "i32"), (src, "f32"), (kv, "i64")], [(a, 0), (dst, 1024)]

    def matmul(c, ctx):
        w = ctx.new_tensor(F32, [8, 6], "w")
        x = _inp(ctx, F32, [8, 3], "x")
        y = lib.ggml_rms_norm(c, lib.ggml_mul_mat(c, w, x), 1e-5)
        z = lib.ggml_silu(c, lib.ggml_scale(c, lib.ggml_norm(c, y, 1e-5), 0.5))
        return [lib.ggml_soft_max(c, z)], [(x, "f32")], [(w, 2048)]

    def rope(c, ctx):
        x = _inp(ctx, F32, [8, 2, 3], "q")
        pos = _inp(ctx, I32, [3], "pos")
        r = lib.ggml_rope_ext(c, x, pos, NULL, 8, 0, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
        p = lib.ggml_cont(c, lib.ggml_permute(c, r, 0, 2, 1, 3))
        t = lib.ggml_cont(c, lib.ggml_transpose(c, lib.ggml_reshape_2d(c, p, 8, 6)))
        return [t], [(x, "f32"), (pos, "i32")], []

    def glu_cpy(c, ctx):
        x = _inp(ctx, F32, [8, 3], "x")
        cache = ctx.new_tensor(F16, [4, 6], "cache")
        g = lib.ggml_swiglu(c, x)
        v = lib.ggml_view_2d(c, cache, 4, 3, 8, 0)
        return [lib.ggml_cpy(c, g, v), lib.ggml_gelu(c, g)], [(x, "f32")], [(cache, 3072)]

    def attn(c, ctx):
        q = _inp(ctx, F32, [8, 3, 2], "q")
        k = ctx.new_tensor(F16, [8, 4, 2], "k")
        v = ctx.new_tensor(F16, [8, 4, 2], "v")
        mask = _inp(ctx, F16, [4, 3], "mask")
        out = lib.ggml_flash_attn_ext(c, q, k, v, mask, 0.35, 0.0, 0.0)
        lib.ggml_flash_attn_ext_set_prec(out, lib.GGML_PREC_F32)
        kq = _inp(ctx, F32, [4, 3], "kq")
        sm = lib.ggml_soft_max_ext(c, kq, mask, 0.5, 0.0)
        return [out, sm], [(q, "f32"), (mask, "f16"), (kq, "f32")], [(k, 4096), (v, 4096 + 128)]

    def view_rows(c, ctx):
        # row ops over views into a buffer, as a KV cache is addressed: the shape
        # the stride mutations need to reach a read or write past the buffer
        a = ctx.new_tensor(F32, [16, 64], "a")
        av = lib.ggml_view_2d(c, a, 16, 2, 64, 64 * 32)
        ids = _inp(ctx, I32, [2], "ids")
        kv = ctx.new_tensor(F32, [16, 32], "kv")
        kvv = lib.ggml_view_2d(c, kv, 16, 8, 64, 64 * 8)
        src = _inp(ctx, F32, [16, 2], "src")
        idx = _inp(ctx, I64, [2], "idx")
        return ([lib.ggml_get_rows(c, av, ids), lib.ggml_set_rows(c, kvv, src, idx)],
                [(ids, "i32"), (src, "f32"), (idx, "i64")], [(a, 0), (kv, 8192)])

    seeds = [_seed(n, b) for n, b in (("arith", arith), ("rows", rows), ("matmul", matmul), ("rope", rope),
                                      ("glu_cpy", glu_cpy), ("attn", attn), ("view_rows", view_rows))]
    return [s for s in seeds if s is not None]


SEEDS = make_seeds()
TENSOR_KEYS = ("type", "ne", "nb", "op", "params", "flags", "src", "view_src", "view_offs", "buffer", "offset",
               "name")


def tensor_value(key: str, n: int):
    """Plausible-or-garbage values for one wire tensor field; `n` tensors so far."""
    idx = st.integers(-2, max(n, 1))
    plausible = {
        "type": st.one_of(st.sampled_from([F32, F16, I32, I64, lib.GGML_TYPE_BF16, lib.GGML_TYPE_Q8_0,
                                           lib.GGML_TYPE_Q4_0, lib.GGML_TYPE_Q4_K]), st.integers(-1, 45)),
        "ne": st.lists(st.one_of(st.integers(1, 33), st.sampled_from(EDGE_INTS)), min_size=3, max_size=5),
        "nb": st.lists(st.one_of(st.integers(0, 4096), st.sampled_from(EDGE_INTS)), min_size=3, max_size=5),
        "op": st.one_of(st.sampled_from(sorted(SUPPORTED_OPS)), st.integers(-1, lib.GGML_OP_COUNT + 2)),
        "params": st.one_of(st.binary(max_size=64), st.binary(min_size=65, max_size=80),
                            st.lists(st.integers(-3, 40), min_size=1, max_size=16).map(
                                lambda v: struct.pack(f"<{len(v)}i", *v))),
        "flags": st.one_of(st.sampled_from([0, 1, 2, 4, 8, 16, 3]), st.integers(-1, 1 << 10)),
        "src": st.lists(idx, max_size=11),
        "view_src": idx,
        "view_offs": st.one_of(st.integers(0, 256), st.sampled_from(EDGE_INTS)),
        "buffer": st.one_of(own_buffer, st.sampled_from([0, BASE]), small_ints),
        "offset": st.one_of(st.integers(0, BASE_SIZE + 64), st.sampled_from(EDGE_INTS)),
        "name": st.text(max_size=70),
    }[key]
    return maybe_garbage(plausible)


def wire_tensor(n: int):
    """A random wire tensor (a map with some of the tensor keys)."""
    return st.fixed_dictionaries({}, optional={k: tensor_value(k, n) for k in TENSOR_KEYS})


def input_bytes(draw, kind: str, nbytes: int) -> bytes:
    if kind in ("i32", "i64"):  # row ids and positions: small, sometimes out of range
        dt = np.int32 if kind == "i32" else np.int64
        n = nbytes // np.dtype(dt).itemsize
        vals = draw(st.lists(st.one_of(st.integers(0, 15), st.integers(-3, 40), st.sampled_from([2**31 - 1, -2**31])),
                             min_size=n, max_size=n))
        return np.array(vals, dtype=np.int64).astype(dt).tobytes()
    kind_dt = np.float16 if kind == "f16" else np.float32
    n = nbytes // np.dtype(kind_dt).itemsize
    seed = draw(st.integers(0, 2**32 - 1))
    arr = np.random.default_rng(seed).standard_normal(n).astype(kind_dt)
    if draw(st.integers(0, 9)) == 0:
        with np.errstate(over="ignore"):  # 1e30 is inf in f16: fine, that is the point
            arr[: max(1, n // 3)] = draw(st.sampled_from([np.inf, -np.inf, np.nan, 1e30, 0.0]))
    return arr.tobytes()


@st.composite
def graph_messages(draw):
    graph_id = draw(st.one_of(st.just(0), st.integers(1, 6), small_ints))
    if draw(st.integers(0, 4)) == 0:  # random wire tensors
        tensors = []
        for i in range(draw(st.integers(1, 8))):
            tensors.append(draw(wire_tensor(i)))
        inputs = draw(st.lists(st.lists(st.integers(-1, 600), min_size=3, max_size=3), max_size=4))
        blob = draw(st.binary(max_size=512))
        h = {"cmd": int(Command.GRAPH_COMPUTE), "graph_id": graph_id, "tensors": tensors, "inputs": inputs,
             "outputs": draw(st.lists(st.integers(-1, 9), max_size=3))}
        return Message(h, blob, "random graph")
    seed = draw(st.sampled_from(SEEDS))
    tensors = copy.deepcopy(seed.tensors)
    specs, parts, off = [], [], 0
    for t, nbytes, kind in seed.inputs:
        data = input_bytes(draw, kind, nbytes)
        specs.append([t, off, len(data)])
        parts.append(data)
        off += len(data)
    outputs = list(seed.outputs)
    for _ in range(draw(st.integers(0, 3))):  # mutations
        what = draw(st.integers(0, 12))
        if what >= 10 and what != 11:
            mutate_strides(draw, tensors)
        elif what == 11:
            i = draw(st.integers(0, len(tensors) - 1))
            key = draw(st.sampled_from(("type", "op", "ne", "nb", "src", "view_src", "flags")))
            if key in tensors[i]:
                v = tensors[i][key]
                if isinstance(v, list) and v:
                    v = list(v)
                    v[draw(st.integers(0, len(v) - 1))] = draw(int_like)
                else:
                    v = draw(int_like)
                tensors[i][key] = v
        elif what <= 6:
            i = draw(st.integers(0, len(tensors) - 1))
            key = draw(st.sampled_from(TENSOR_KEYS))
            if draw(st.integers(0, 5)) == 0:
                tensors[i].pop(key, None)
            else:
                tensors[i][key] = draw(tensor_value(key, i))
        elif what == 7 and specs:
            k = draw(st.integers(0, len(specs) - 1))
            specs[k][draw(st.integers(0, 2))] = draw(small_ints)
        elif what == 8:
            outputs = draw(st.lists(st.integers(-1, len(tensors) + 1), max_size=3))
        else:
            cut = draw(st.integers(1, len(tensors)))
            tensors = tensors[:cut] if draw(st.booleans()) else tensors + [copy.deepcopy(tensors[cut - 1])]
    cmd = Command.GRAPH_RECOMPUTE if draw(st.integers(0, 3)) == 0 else Command.GRAPH_COMPUTE
    h = {"cmd": int(cmd), "graph_id": graph_id, "inputs": specs, "outputs": outputs}
    if cmd == Command.GRAPH_COMPUTE:
        h["tensors"] = tensors
    must_refuse = cmd == Command.GRAPH_COMPUTE and any(_has_int_like(t) for t in tensors)
    return Message(h, b"".join(parts), f"{cmd.name} {seed.name}", must_refuse=must_refuse)


GRAPH_INT_KEYS = ("type", "ne", "nb", "op", "flags", "src", "view_src", "view_offs", "buffer", "offset")


def _has_int_like(t) -> bool:
    """A wire tensor with a bool or float where the spec says int (however it got there)."""
    if not isinstance(t, dict):
        return False
    for key in GRAPH_INT_KEYS:
        v = t.get(key)
        for x in (v if isinstance(v, list) else [v]):
            if isinstance(x, (bool, float)):
                return True
    return False


def mutate_strides(draw, tensors: list[dict]) -> None:
    """Strides the kernels may not honour: nb[0] = 0 (a view that once read a
    whole row per element counted), a zero or scaled stride, two strides
    swapped, an odd stride on a dim of size 1 (asserted nb orders), a
    view_offs at the edge of its source."""
    views = [k for k, x in enumerate(tensors) if type(x.get("view_src")) is int and x["view_src"] >= 0]
    if views and draw(st.integers(0, 3)):
        i = draw(st.sampled_from(views))  # mostly a view: only views may have other strides
    else:
        i = draw(st.integers(0, len(tensors) - 1))
    t = tensors[i]
    nb = t.get("nb")
    if not (isinstance(nb, list) and len(nb) == 4 and all(type(x) is int for x in nb)):
        return
    nb = list(nb)
    how = draw(st.integers(-2, 5))
    k = draw(st.integers(0, 3))
    if how <= 0:
        nb[0] = 0
    elif how == 1:
        nb[k] = 0
    elif how == 2:
        j = draw(st.integers(0, 3))
        nb[k], nb[j] = nb[j], nb[k]
    elif how == 3:
        nb[k] = nb[k] * draw(st.sampled_from([2, 3, 16, 1024])) + draw(st.sampled_from([0, 1, 4]))
    elif how == 4:
        ne = t.get("ne")
        ones = [d for d in range(4) if isinstance(ne, list) and len(ne) == 4 and ne[d] == 1]
        if ones:
            nb[draw(st.sampled_from(ones))] = draw(st.sampled_from([0, 4, 8, 1 << 16]))
    else:
        t["view_offs"] = draw(st.sampled_from([BASE_SIZE - 4, BASE_SIZE - 252, BASE_SIZE, 4, 1 << 20]))
    t["nb"] = nb
    ne, root = t.get("ne"), t.get("view_src")
    if (type(root) is int and 0 <= root < len(tensors) and isinstance(ne, list) and len(ne) == 4
            and all(type(x) is int and x > 0 for x in ne) and draw(st.integers(0, 3))):
        # the view moved to where it just fits if one element per row counted (nb[0] = 0): the
        # kernels read ne[0] contiguous elements there, past the end of the buffer
        offset = tensors[root].get("offset", 0)
        counted = 4 + sum((ne[d] - 1) * nb[d] for d in range(4))
        if type(offset) is int:
            t["view_offs"] = max(0, BASE_SIZE - offset - counted)


@st.composite
def lying_prefixes(draw):
    """A fresh connection that declares more than it sends: a header or blob
    length up to the 32/64-bit maximum, the start of a HELLO or SET_TENSOR
    header, and then a few bytes or nothing. Sent with or without HELLO first."""
    after_hello = draw(st.booleans())
    header_len = draw(st.one_of(st.sampled_from([1, 64, 4096, 4097, 1 << 16, (16 << 20), (16 << 20) + 1,
                                                 2**32 - 1]), st.integers(1, 2**32 - 1)))
    blob_len = draw(st.one_of(st.sampled_from([0, 1, 1 << 20, (1 << 30) - 1, 1 << 30, 2**64 - 1]),
                              st.integers(0, 2**64 - 1)))
    if after_hello:
        body = F.encode_frame({"cmd": int(Command.SET_TENSOR), "id": 1, "buffer": 1, "offset": 0, "size": 4},
                              blob_len)[F.PREFIX.size:]
    else:
        body = F.encode_frame({"cmd": int(Command.HELLO), "id": 1, "version": P.PROTOCOL_VERSION},
                              blob_len)[F.PREFIX.size:]
    if draw(st.booleans()):
        header_len = len(body)  # an honest header, a lying blob
    data = F.PREFIX.pack(header_len, blob_len) + body[: draw(st.integers(0, len(body)))]
    data += draw(st.binary(max_size=64))
    return Message({}, b"", "lie", lie=(data, after_hello))


@st.composite
def tiny_buffer_bursts(draw):
    size = draw(st.one_of(st.integers(1, 64), st.sampled_from([1, 4095, 4096, 4097])))
    return Message({"cmd": int(Command.ALLOC_BUFFER), "size": size}, b"", "burst",
                   burst=draw(st.integers(50, 600)))


# ---------------------------------------------------------------- the client


class FuzzFailure(AssertionError):
    """A reply (or its absence) that breaks the contract. Cases depend on the
    connection's state (cached graphs, buffers), so hypothesis may call a
    failure flaky when replaying it alone: FuzzClient.failures keeps the
    original message."""


@dataclass
class FuzzClient:
    """One connection to the daemon at `port`, re-opened whenever the daemon
    closes it; owns a BASE_SIZE buffer whose id replaces BASE in seed graphs."""
    port: int
    timeout: float = 20.0
    expect_compute_deaths: bool = False
    conn: RawConn | None = None
    base: int | None = None
    buffers: list[int] = field(default_factory=list)
    cases: int = 0  # messages sent (and answered, or answered by hanging up)
    unencodable: int = 0  # drawn but not sendable (msgpack cannot encode them)
    reconnects: int = 0
    statuses: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    graphs: dict = field(default_factory=dict)  # graph_id -> tensors of the graph this connection cached
    sizes: dict = field(default_factory=dict)  # buffer id -> size, for the no-effect checks
    pid: int | None = None  # the daemon's, for the memory checks of lying_prefixes
    lies: list = field(default_factory=list)  # lying connections held open
    lies_rss: int = 0  # the daemon's RSS before the open lies were made
    max_lie_growth: int = 0  # the most RSS a batch of lies added
    victim: RawConn | None = None  # another client's buffer, which nothing we send may reach
    victim_buffer: int = 0
    _id: int = 0

    LIES_HELD = 16
    CANARY = b"\xa5VICTIM-CANARY!\x5a"  # repeated over the victim's buffer
    SNAPSHOT_MAX = 256 << 10  # buffers up to this size are compared around refused writes

    def _fail(self, text: str) -> FuzzFailure:
        self.failures.append(text)
        return FuzzFailure(text)

    def _victim_up(self) -> None:
        """A second client whose buffer the compute process maps before ours (so it
        sits next to ours in memory if one process maps both): its canary must
        never show in our outputs, and its bytes must never change."""
        if self.victim is not None:
            return
        self.victim = RawConn(self.port, timeout=self.timeout)
        self.victim.hello()
        h, _ = self.victim.call(Command.ALLOC_BUFFER, {"size": BASE_SIZE})
        assert h["status"] == Status.SUCCESS, h
        self.victim_buffer = h["buffer"]
        h, _ = self.victim.call(Command.SET_TENSOR, {"buffer": self.victim_buffer, "offset": 0, "size": BASE_SIZE},
                                self._victim_bytes(BASE_SIZE))
        assert h["status"] == Status.SUCCESS, h
        self.victim_compute()

    def _victim_bytes(self, n: int) -> bytes:
        return (self.CANARY * (n // len(self.CANARY) + 1))[:n]

    def victim_compute(self) -> None:
        """The victim's buffer is mapped and its graph computes (checked)."""
        _, _, fields, yb, expect = small_graph(self.victim_buffer, BASE_SIZE - 48, np.zeros(12, np.float32))
        h, out = self.victim.call(Command.GRAPH_COMPUTE, fields, yb)
        assert h["status"] == Status.SUCCESS, h
        h, data = self.victim.call(Command.GET_TENSOR, {"buffer": self.victim_buffer, "offset": 0,
                                                        "size": BASE_SIZE - 48})
        if data != self._victim_bytes(BASE_SIZE - 48):
            raise self._fail("another client's buffer changed while fuzzing")

    def connect(self) -> None:
        self._victim_up()
        if self.conn is not None:
            self.conn.close()
        self.conn = RawConn(self.port, timeout=self.timeout)
        self.conn.hello()
        self.reconnects += 1
        self.buffers = []
        self.graphs = {}
        h, _ = self.conn.call(Command.ALLOC_BUFFER, {"size": BASE_SIZE})
        assert h["status"] == Status.SUCCESS, h
        self.base = h["buffer"]
        self.buffers.append(self.base)
        self.sizes = {self.base: BASE_SIZE}
        data = np.random.default_rng(0).standard_normal(BASE_SIZE // 4).astype(np.float32)
        data[:256] = np.arange(256) % 16  # row ids and small values at the start
        h, _ = self.conn.call(Command.SET_TENSOR, {"buffer": self.base, "offset": 0, "size": BASE_SIZE},
                              data.tobytes())
        assert h["status"] == Status.SUCCESS, h

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self._close_lies()

    def close_victim(self) -> None:
        if self.victim is not None:
            self.victim.close()
            self.victim = None

    def _close_lies(self) -> None:
        for conn in self.lies:
            conn.close()
        self.lies = []

    def _substitute(self, v):
        """BufRef -> one of our buffer ids, BASE -> our base buffer, in a copy."""
        if isinstance(v, BufRef):
            return self.buffers[v.k % len(self.buffers)] if self.buffers else 1
        if isinstance(v, dict):
            return {k: self._substitute(x) for k, x in v.items()}
        if isinstance(v, list):
            return [self._substitute(x) for x in v]
        if type(v) is int and v == BASE:
            return self.base
        return v

    def _snapshot(self) -> dict[int, bytes]:
        """The contents of this connection's small buffers, read with valid requests
        (on a new connection if the daemon hung up after the last reply)."""
        try:
            return self._read_buffers()
        except (EOFError, ConnectionResetError, BrokenPipeError):
            self.connect()
            return self._read_buffers()

    def _read_buffers(self) -> dict[int, bytes]:
        out = {}
        for b in self.buffers:
            size = self.sizes.get(b)
            if size is not None and size <= self.SNAPSHOT_MAX:
                h, data = self.conn.call(Command.GET_TENSOR, {"buffer": b, "offset": 0, "size": size})
                if h.get("status") == Status.SUCCESS:
                    out[b] = data
        return out

    def _lie(self, msg: Message) -> None:
        """A lying connection, held open beside up to LIES_HELD others: the bytes it
        declared never come, so they must cost the daemon (almost) nothing."""
        data, after_hello = msg.lie
        if not self.lies and self.pid is not None:
            self.lies_rss = rss(self.pid)
        self.cases += 1
        try:
            conn = RawConn(self.port, timeout=5.0)
            if after_hello:
                conn.hello()
            conn.send_raw(data)
        except (OSError, EOFError, AssertionError):
            return  # refused or closed: nothing held
        self.lies.append(conn)
        if len(self.lies) >= self.LIES_HELD:
            if self.pid is not None:
                time.sleep(0.2)  # let the daemon take in all it was sent
                grown = rss(self.pid) - self.lies_rss
                self.max_lie_growth = max(self.max_lie_growth, grown)
                if grown > 32 << 20:
                    self._close_lies()
                    raise self._fail(f"{self.LIES_HELD} lying connections raised the daemon's RSS by "
                                     f"{grown >> 20} MiB; the last sent {data[:80]!r}")
            self._close_lies()

    def _burst(self, msg: Message) -> None:
        """Many tiny buffers in a row, then another client must still be served."""
        self.cases += 1
        size = msg.header["size"]
        frames = []
        for _ in range(msg.burst):
            self._id += 1
            frames.append(F.encode_frame({"cmd": int(Command.ALLOC_BUFFER), "id": self._id, "size": size}))
        self.conn.send_raw(b"".join(frames))
        for _ in range(msg.burst):
            reply, _ = self.conn.recv_frame()
            status = reply.get("status")
            if status not in (Status.SUCCESS, Status.LIMIT_EXCEEDED):
                raise self._fail(f"ALLOC_BUFFER of {size} bytes in a burst of {msg.burst}: {reply!r:.300}")
            key = (msg.note, Status(status).name)
            self.statuses[key] = self.statuses.get(key, 0) + 1
        with RawConn(self.port, timeout=self.timeout) as other:
            other.hello()
            h, _ = other.call(Command.ALLOC_BUFFER, {"size": 4096})
            if h.get("status") != Status.SUCCESS:
                raise self._fail(f"after a burst of {msg.burst} ALLOC_BUFFERs another client cannot allocate: {h!r}")
            b = h["buffer"]
            h, _ = other.call(Command.SET_TENSOR, {"buffer": b, "offset": 0, "size": 4}, b"\1\2\3\4")
            h2, data = other.call(Command.GET_TENSOR, {"buffer": b, "offset": 0, "size": 4})
            if h.get("status") != Status.SUCCESS or data != b"\1\2\3\4":
                raise self._fail(f"after a burst another client is not served: {h!r} {h2!r}")
        self.close()  # frees the burst's buffers

    def send(self, msg: Message) -> dict | None:
        """Send one message, check its reply; None if the daemon hung up (then
        the next send reconnects)."""
        if msg.lie is not None:
            return self._lie(msg)
        if self.conn is None:
            self.connect()
        if msg.burst:
            return self._burst(msg)
        cmd = msg.header.get("cmd")
        before = self._snapshot() if type(cmd) is int and cmd in WRITING else None
        self._id += 1
        header = self._substitute(dict(msg.header, id=self._id))
        try:
            frame = F.encode_frame(header, len(msg.blob)) + bytes(msg.blob)
        except (OverflowError, ValueError, TypeError):
            self.unencodable += 1
            return None  # msgpack cannot say it (e.g. an int beyond 64 bits): not a wire message
        self.cases += 1
        try:
            self.conn.send_raw(frame)
            reply, out = self.conn.recv_frame()
        except (EOFError, ConnectionResetError, BrokenPipeError):
            self.close()
            return None
        except socket.timeout:
            raise self._fail(f"no reply within {self.timeout} s to {msg.note}: {header!r:.2000}") from None
        status = reply.get("status")
        if status not in STATUSES:
            raise self._fail(f"reply with unknown status {status!r} to {header!r:.1000}: {reply!r:.500}")
        if reply.get("id") not in (self._id, None):
            raise self._fail(f"reply id {reply.get('id')!r} to request {self._id}: {reply!r:.500}")
        err = str(reply.get("error", ""))
        if "internal error" in err:
            raise self._fail(f"handler bug: {err} for {msg.note}: {header!r:.3000}")
        if "compute process died" in err and not self.expect_compute_deaths:
            cached = self.graphs.get(header.get("graph_id"), []) if header.get("cmd") == Command.GRAPH_RECOMPUTE \
                else []
            raise self._fail(f"a validated graph crashed libggml ({err}) for {msg.note}: {header!r:.6000} "
                             f"blob {bytes(msg.blob)!r}"
                             + "".join(f"\n  earlier GRAPH_COMPUTE of this graph_id (reply {st}): {h!r:.6000} "
                                       f"blob {b!r}" for h, b, st in cached[-3:]))
        if header.get("cmd") == Command.GRAPH_COMPUTE and type(header.get("graph_id")) is int:
            self.graphs.setdefault(header["graph_id"], []).append((header, bytes(msg.blob), Status(status).name))
            del self.graphs[header["graph_id"]][:-3]
        if self.CANARY[1:13] in out:
            raise self._fail(f"another client's data in the reply to {msg.note}: {header!r:.6000} "
                             f"blob {bytes(msg.blob)!r}")
        if header.get("cmd") in (Command.GRAPH_COMPUTE, Command.GRAPH_RECOMPUTE) and self.cases % 50 == 0:
            self.victim_compute()
        if msg.must_refuse and status == Status.SUCCESS:
            raise self._fail(f"a bool or float where the spec says int was accepted: {header!r:.3000}")
        if before is not None and status in REFUSALS:
            after = self._snapshot()
            for b, data in before.items():
                if after.get(b, data) != data:
                    raise self._fail(f"a refused request ({Status(status).name}: {err}) changed buffer {b}: "
                                     f"{header!r:.3000}")
        self.statuses[(msg.note.split()[0], Status(status).name)] = \
            self.statuses.get((msg.note.split()[0], Status(status).name), 0) + 1
        if status == Status.SUCCESS and header.get("cmd") == Command.ALLOC_BUFFER and "buffer" in reply:
            self.buffers.append(reply["buffer"])
            self.sizes[reply["buffer"]] = reply.get("size")
        if status == Status.SUCCESS and header.get("cmd") == Command.FREE_BUFFER:
            b = header.get("buffer")
            if b in self.buffers:
                self.buffers.remove(b)
            if b == self.base:  # seeds need a base buffer: make a new one on a fresh connection
                self.close()
        if len(self.buffers) > 48:  # keep the connection's footprint small: start afresh now and then
            self.close()
        return reply


# ---------------------------------------------------------------- step channels

# the session's one graph: x (input, 4 floats) -> y = 2x (output)
def channel_graph() -> list[dict]:
    from graph_helpers import COMPUTE, F32, INPUT, OUTPUT, T, f32s
    return [T(F32, [4], flags=INPUT), T(F32, [4], op=lib.GGML_OP_SCALE, src=[0], params=f32s(2.0),
                                        flags=OUTPUT | COMPUTE)]


CHANNEL_STEP = {"graph_id": 1, "inputs": [[0, 0, 16]], "outputs": [1]}
CHANNEL_X = struct.pack("<4f", 1, 2, 3, 4)


@dataclass(frozen=True)
class ChannelCase:
    header: dict | None  # a request (its fields random), or None: `raw` is a whole frame as bytes
    blob: bytes = b""
    raw: bytes = b""


@st.composite
def channel_messages(draw):
    """What a client may send over its step channel (docs/protocol.md, "Step channels"):
    mostly the session's valid GRAPH_RECOMPUTE with 1-3 of its fields replaced, removed or
    added (so the compute process's checks are passed as often as refused, each in turn),
    and whole frames whose prefix lies or whose header is not a msgpack map (the framing
    refuses them and closes the channel)."""
    kind = draw(st.sampled_from(["raw", "valid"] + ["mutated"] * 8))
    if kind == "raw":
        body = draw(st.binary(max_size=40))
        blob = draw(st.binary(max_size=40))
        header_len, blob_len = draw(st.sampled_from([
            (len(body), len(blob)), (0, len(blob)), ((1 << 20) + 1, 0), (len(body), (64 << 20) + 1),
            (2**32 - 1, 2**64 - 1)]))
        return ChannelCase(None, raw=encode_prefix(header_len, blob_len) + body + blob)
    small = st.one_of(st.integers(-3, 8), st.sampled_from(EDGE_INTS), st.floats(allow_nan=True),
                      st.text(max_size=4), st.none(), st.booleans(), int_like)
    entry = st.one_of(st.lists(small, min_size=3, max_size=3), st.lists(small, max_size=4),
                      st.tuples(st.just(0), small, small).map(list), st.tuples(small, st.just(0), st.just(16)).map(list))
    choices = {
        "cmd": st.one_of(st.sampled_from([int(c) for c in Command]), small),
        "id": st.one_of(st.integers(1, 1 << 30), small),
        "graph_id": st.one_of(st.integers(0, 3), small),
        "inputs": st.one_of(st.sampled_from([[], [[0, 0, 16], [0, 0, 16]], [[1, 0, 16]], [[0, 16, 16]], [[0, 0, 8]]]),
                            st.lists(entry, min_size=1, max_size=3), small, values),
        "outputs": st.one_of(st.sampled_from([[], [0], [1, 1], [2], [-1], [1, 0]]),
                             st.lists(st.one_of(st.integers(-1, 3), small), min_size=1, max_size=3), small),
        "tensor": st.one_of(small, values, st.fixed_dictionaries({}, optional={
            "link": small, "step": small, "exchange": st.lists(small, max_size=3), "timeout": small,
            "gather": st.one_of(values, st.lists(st.one_of(st.none(), st.lists(small, max_size=4), small),
                                                 max_size=3))})),
        "step_input": values, "forward": values, "budget": small, "graph": values, "tensors": values,
    }
    header = dict(CHANNEL_STEP, cmd=int(Command.GRAPH_RECOMPUTE), id=draw(st.integers(1, 1 << 30)))
    blob = CHANNEL_X
    for _ in range(0 if kind == "valid" else draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(choices) + ["blob"]))
        if name == "blob":
            blob = draw(st.binary(max_size=40))
        elif draw(st.integers(0, 4)) == 0:
            header.pop(name, None)
        else:
            header[name] = draw(choices[name])
    return ChannelCase(header, blob)


@dataclass
class ChannelFuzzer:
    """A session on the daemon `d` (a conftest DaemonProcess) with one cached graph and its
    step channel, re-opened whenever the channel closes. Every case must get a well-formed
    reply (a known status; our id where we sent an integer one), or, for a frame the framing
    refuses, the channel's close; the session's compute process must live through all of it,
    and the daemon too. `check()` then computes right over the channel and the connection."""
    d: object
    timeout: float = 20.0
    conn: RawConn | None = None
    channel: RawConn | None = None
    pid: int = 0
    cases: int = 0
    reopened: int = 0
    statuses: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)

    def start(self) -> None:
        self.conn = RawConn(self.d.port, timeout=self.timeout)
        self.conn.hello()
        h, out = self.conn.call(Command.GRAPH_COMPUTE, dict(CHANNEL_STEP, tensors=channel_graph()), CHANNEL_X)
        assert h["status"] == Status.SUCCESS and out == struct.pack("<4f", 2, 4, 6, 8), h
        self.pid = self._assigned_pid()
        self.open()

    def _assigned_pid(self) -> int:
        found = assigned_pids(self.d)
        assert found, "no compute process assigned in the daemon's log"
        return found[-1]

    def open(self) -> None:
        from rpc_daemon.wire.step_channel import ACK, pack_hello
        if self.channel is not None:
            self.channel.close()
        h, _ = self.conn.call(Command.STEP_CHANNEL)
        if h["status"] != Status.SUCCESS or not h.get("granted"):
            raise self._fail(f"the session's step channel was not granted again: {h!r:.1000}")
        sock = socket.create_connection(("127.0.0.1", h["port"]), timeout=self.timeout)
        sock.sendall(pack_hello(h["ticket"]))
        self.channel = RawConn.over(sock, timeout=self.timeout)
        assert sock.recv(1) == ACK
        self.reopened += 1

    def _fail(self, text: str) -> FuzzFailure:
        self.failures.append(text)
        return FuzzFailure(text)

    def send(self, case: ChannelCase) -> None:
        self.cases += 1
        try:
            if case.header is None:
                self.channel.send_raw(case.raw)
            else:
                try:
                    self.channel.send(case.header, case.blob)
                except (TypeError, ValueError, OverflowError):  # not encodable by msgpack: nothing was sent
                    return
            reply, _ = self.channel.recv_frame()
            status = reply.get("status")
            if type(status) is not int or status not in STATUSES:
                raise self._fail(f"a reply with status {status!r} to {case!r:.2000}")
            sent_id = None if case.header is None else case.header.get("id")
            if type(sent_id) is int and reply.get("id") not in (sent_id, None):
                raise self._fail(f"the reply to id {sent_id} names id {reply.get('id')!r}")
            if "internal error" in str(reply.get("error", "")):
                raise self._fail(f"an internal error answered {case!r:.2000}: {reply!r:.2000}")
            key = Status(status).name
            if case.header is None:  # a refusal of the framing: the channel closes after it
                self.open()
        except EOFError:  # the framing refused it and closed the channel: the session goes on
            key = "closed"
            self._check_alive(case)
            self.open()
        except (socket.timeout, TimeoutError):
            raise self._fail(f"no reply over the step channel within {self.timeout:g} s to {case!r:.2000}") \
                from None
        self.statuses[key] = self.statuses.get(key, 0) + 1
        self._check_alive(case)

    def _check_alive(self, case: ChannelCase) -> None:
        if not self.d.alive():
            raise self._fail("daemon died:\n" + "".join(self.d.log_lines[-40:]))
        if self._assigned_pid() != self.pid or not _alive(self.pid):
            raise self._fail(f"the session's compute process died after {case!r:.2000}:\n"
                             + "".join(self.d.log_lines[-40:]))

    def check(self) -> None:
        """The session computes right, over its channel and over the connection."""
        for conn, cmd in ((self.channel, Command.GRAPH_RECOMPUTE), (self.conn, Command.GRAPH_RECOMPUTE)):
            h, out = conn.call(cmd, CHANNEL_STEP, CHANNEL_X)
            if h["status"] != Status.SUCCESS or out != struct.pack("<4f", 2, 4, 6, 8):
                raise self._fail(f"after fuzzing the channel the session computes {out!r} ({h!r:.500})")
        if any("compute process lost" in line for line in self.d.log_lines):
            raise self._fail("a compute process was lost while fuzzing the channel")

    def close(self) -> None:
        for c in (self.channel, self.conn):
            if c is not None:
                c.close()
        self.channel = self.conn = None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
