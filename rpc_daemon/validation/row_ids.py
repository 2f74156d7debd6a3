"""Row ids of GET_ROWS and SET_ROWS checked against the rows they index, and
expert ids of MUL_MAT_ID against the matrices (ne[2]) they pick.

The CPU kernels turn a row id into a pointer (row * nb[1]); an id out of range
reads or writes outside the tensor. libggml asserts on it (the compute process
aborts and is restarted, see compute.py), but the daemon refuses such a request
before any compute when it can: when the id tensor is an inline input (sent
with the request) or a view of one, its values are known up front, so every id
must satisfy 0 <= id < rows, else the request is answered INVALID_REQUEST
naming the tensors.

Ids that the graph computes, or that live in a client buffer a node of the same
graph may write, cannot be checked up front; for GET_ROWS/SET_ROWS the crash
isolation of the compute process (and ggml's own GGML_ASSERT on the id) is the
guard. MUL_MAT_ID has no such assert, so graph.py accepts its ids only inline
(checked here) or from a TOP_K the same graph computes (in range by
construction).

Pure: plan once per validated graph (`plan`, then `group` the checks that read
the same ids), check per compute (`check`).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ggml_ffi import lib
from rpc_daemon.wire.protocol import ProtocolError, Status

if TYPE_CHECKING:
    import numpy as np

# id element types, as numpy dtype strings: numpy itself is imported only on the slow paths
# (strided or many ids, a refusal), so the daemon's parent process starts without it
_DTYPES = {lib.GGML_TYPE_I32: "<i4", lib.GGML_TYPE_I64: "<i8"}
_ITEMSIZE = {"<i4": 4, "<i8": 8}


@dataclass(frozen=True)
class RowCheck:
    node: int  # the GET_ROWS / SET_ROWS tensor
    op: str
    ids: int  # the id tensor the op reads
    root: int  # the inline input leaf holding the ids' data (ids itself or its view_src)
    offs: int  # byte offset of the ids' data in root's data
    dtype: str  # "<i4" or "<i8"
    ne: tuple
    nb: tuple
    rows: int  # valid ids are 0..rows-1
    rows_of: int  # the tensor whose rows (or, for MUL_MAT_ID, matrices) are indexed
    what: str = "rows"


def plan(tensors, inputs) -> list[RowCheck]:
    """The checks a graph (list of graph.TensorSpec, validated) needs: one per
    GET_ROWS/SET_ROWS/MUL_MAT_ID whose ids come inline."""
    inline = set(inputs)
    checks = []
    for t in tensors:
        what = "rows"
        if t.op == lib.GGML_OP_GET_ROWS and len(t.src) >= 2:
            data, ids = tensors[t.src[0]], tensors[t.src[1]]
            op, rows = "GET_ROWS", data.ne[1]
        elif t.op == lib.GGML_OP_SET_ROWS and len(t.src) >= 3:
            # ggml_set_rows(a=dst, b=src, c=ids) stores src[] = {b, c, a}
            ids, data = tensors[t.src[1]], tensors[t.src[2]]
            op, rows = "SET_ROWS", data.ne[1]
        elif t.op == lib.GGML_OP_MUL_MAT_ID and len(t.src) >= 3:
            # ggml_mul_mat_id(as, b, ids): an id picks one of the ne[2] matrices of `as`
            data, ids = tensors[t.src[0]], tensors[t.src[2]]
            op, rows, what = "MUL_MAT_ID", data.ne[2], "experts (ne[2])"
        else:
            continue
        dtype = _DTYPES.get(ids.type)
        if dtype is None:
            continue
        if ids.index in inline:
            root, offs = ids.index, 0
        elif ids.is_view and ids.view_src in inline:
            root, offs = ids.view_src, ids.view_offs
        else:
            continue  # computed by the graph or held in a buffer: see the module doc
        checks.append(RowCheck(t.index, op, ids.index, root, offs, dtype, tuple(ids.ne), tuple(ids.nb),
                               rows, data.index, what))
    return checks


def _contiguous(c: RowCheck) -> bool:
    stride = _ITEMSIZE[c.dtype]
    for n, s in zip(c.ne, c.nb):
        if n != 1 and s != stride:
            return False
        stride *= n
    return True


def ids_array(c: RowCheck, data) -> np.ndarray | None:
    """The ids as numpy (a strided view over the root's inline bytes), or None
    if they cannot be read cheaply and safely: strides reaching outside `data`
    (the validator refuses that already; a second line) or overlapping strides
    that would make one id be read many times over. Dimensions of stride 0
    repeat the same ids and are dropped."""
    import numpy as np

    itemsize = _ITEMSIZE[c.dtype]
    count = math.prod(c.ne)
    if _contiguous(c) and c.offs + count * itemsize <= len(data):
        # the usual case (token ids, KV rows): no strides to honour
        return np.frombuffer(data, c.dtype, count=count, offset=c.offs).reshape(c.ne[::-1])
    ne = tuple(1 if s == 0 else n for n, s in zip(c.ne, c.nb))
    extent = itemsize + sum((n - 1) * s for n, s in zip(ne, c.nb))
    if c.offs + extent > len(data):
        return None
    if math.prod(ne) > 4 * max(1, extent // itemsize):
        return None
    first = np.frombuffer(data, c.dtype, count=1, offset=c.offs)
    return np.lib.stride_tricks.as_strided(first, shape=ne[::-1], strides=c.nb[::-1], writeable=False)


@dataclass(frozen=True)
class RowGroup:
    """Checks that read the same ids (every layer's SET_ROWS reads the KV row
    ids): the ids are read and min/maxed once per request, against the fewest
    rows any check of the group allows."""
    first: RowCheck
    rows: int
    checks: tuple


def group(checks: list[RowCheck]) -> list[RowGroup]:
    by_key: dict = {}
    for c in checks:
        by_key.setdefault((c.root, c.offs, c.dtype, c.ne, c.nb), []).append(c)
    return [RowGroup(cs[0], min(c.rows for c in cs), tuple(cs)) for cs in by_key.values()]


_NATIVE = {"<i4": "i", "<i8": "q"} if sys.byteorder == "little" else {}


def _native_ids(c: RowCheck, data) -> memoryview | None:
    """The ids as a flat memoryview of ints (ggml order), where they are
    contiguous, inside `data` and of this machine's byte order; else None."""
    fmt = _NATIVE.get(c.dtype)
    end = c.offs + math.prod(c.ne) * _ITEMSIZE[c.dtype]
    if fmt is None or not _contiguous(c) or end > len(data):
        return None
    return data[c.offs: end].cast(fmt)


def _min_max(c: RowCheck, data) -> tuple[int, int] | None:
    """(min, max) of the ids, None if there are none. The common case (a few
    contiguous ids: tokens, KV rows, output rows) avoids numpy: this runs on
    every step, right after a compute has flushed the caches, where each
    numpy call costs tens of microseconds."""
    ids = _native_ids(c, data)
    if ids is not None and len(ids) <= 4096:
        return (min(ids), max(ids)) if len(ids) else None
    arr = ids_array(c, data)
    if arr is None:
        raise ProtocolError(Status.INVALID_REQUEST,
                            f"tensors[{c.ids}]: the row ids of {c.op} tensors[{c.node}] cannot be "
                            f"checked (strides outside the inline data, or overlapping)")
    return (int(arr.min()), int(arr.max())) if arr.size else None


def check(checks: list, tensors, inline_data) -> None:
    """`checks` are RowChecks or RowGroups (from `group`, done once per graph).
    `inline_data(tensor index)` gives the bytes sent inline for that input
    (a memoryview), or None if none were sent. Raises ProtocolError
    (INVALID_REQUEST) for the first id out of range."""
    groups = checks if checks and isinstance(checks[0], RowGroup) else group(checks)
    for g in groups:
        data = inline_data(g.first.root)
        if data is None:
            continue  # no data sent: the inputs check has refused (or --unsafe-no-validation)
        bounds = _min_max(g.first, data)
        if bounds is None or (bounds[0] >= 0 and bounds[1] < g.rows):
            continue
        for c in g.checks:  # the slow path, once, to name the first check the ids break
            if bounds[0] < 0 or bounds[1] >= c.rows:
                _refuse(c, bounds, data, tensors)


def _where(c: RowCheck, data, bad: int) -> list | str:
    """The ggml coordinates (i0, i1, ...) of the first id equal to `bad`. Contiguous
    ids are searched without numpy (a refused request should not be what makes a
    worker import it, ~50-100 ms of its event loop)."""
    ids = _native_ids(c, data)
    if ids is not None:
        flat = ids.tolist().index(bad)
        where = []
        for n in c.ne:
            where.append(flat % n)
            flat //= n
        return where
    import numpy as np

    ids = ids_array(c, data)
    return np.argwhere(ids == bad)[0][::-1].tolist() if ids is not None else "?"  # ggml order: i0, i1, ...


def _refuse(c: RowCheck, bounds: tuple[int, int], data, tensors) -> None:
    bad = bounds[0] if bounds[0] < 0 else bounds[1]
    where = _where(c, data, bad)
    ids_t, node_t = tensors[c.ids], tensors[c.node]
    raise ProtocolError(Status.INVALID_REQUEST,
                        f"tensors[{c.ids}] ({ids_t.name!r}): row id {bad} at {where} is outside 0..{c.rows - 1}, "
                        f"the {c.what} of tensors[{c.rows_of}] that {c.op} tensors[{c.node}] ({node_t.name!r}) "
                        f"indexes")


def check_inputs(checks: list, tensors, inputs, blob) -> None:
    """check() for a compute request: `inputs` are its [tensor, blob_offset,
    size] triples, `blob` its data."""
    if not checks:
        return
    where = {t: (off, size) for t, off, size in inputs}
    view = memoryview(blob).cast("B") if len(blob) else memoryview(b"")

    def inline_data(t):
        if t not in where:
            return None
        off, size = where[t]
        return view[off: off + size]

    check(checks, tensors, inline_data)
