"""The ops of a mixture-of-experts layer on a real daemon: TOP_K picks the experts,
MUL_MAT_ID multiplies by them. MUL_MAT_ID's kernel turns every expert id into a
slot of its work memory with no check in a release build (an id past the
experts faults or silently corrupts the heap), so the daemon proves each id in
range before compute: ids sent inline are checked against the expert count on
every request, ids computed by the graph must be a TOP_K over exactly one score
per expert; anything else is refused.

Every refusal runs as tests/daemon/test_graph_validation_refusals.py's do: INVALID_REQUEST with
the reason, the compute process alive, a victim client's buffer unchanged and
never in a reply; and the refused request changes nothing (a cached graph
still computes the right result afterwards).
"""
from __future__ import annotations

import numpy as np
import pytest

from ggml_ffi import lib
from rpc_daemon.wire.protocol import Command, Status
from graph_helpers import COMPUTE, F32, I32, INPUT, OUTPUT, Session, T, i32s

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

MUL_MAT_ID, TOP_K, VIEW = lib.GGML_OP_MUL_MAT_ID, lib.GGML_OP_TOP_K, lib.GGML_OP_VIEW
K, M, N_AS, TOKENS, N_USED = 8, 4, 3, 2, 2
EXPERTS = np.arange(K * M * N_AS, dtype=np.float32).reshape(N_AS, M, K) / 100  # ggml [K, M, N_AS]
X = np.linspace(-1, 1, K * TOKENS, dtype=np.float32).reshape(TOKENS, 1, K)  # ggml [K, 1, TOKENS]


@pytest.fixture
def s(d):
    sess = Session(d)
    ok, _ = sess.conn.call(Command.SET_TENSOR, {"buffer": sess.buf, "offset": 0, "size": EXPERTS.nbytes},
                           EXPERTS.tobytes())
    assert ok["status"] == Status.SUCCESS, ok
    yield sess
    sess.close()


def experts_leaf(buf: int) -> dict:
    return T(F32, [K, M, N_AS], buffer=buf)


def inline_ids_graph(buf: int) -> list[dict]:
    """experts (buffer) x, with the ids [N_USED, TOKENS] inline."""
    return [experts_leaf(buf), T(F32, [K, 1, TOKENS], flags=INPUT), T(I32, [N_USED, TOKENS], flags=INPUT),
            T(F32, [M, N_USED, TOKENS], op=MUL_MAT_ID, src=[0, 1, 2], flags=OUTPUT | COMPUTE)]


def inline_request(ids) -> tuple[list, bytes]:
    xb = X.tobytes()
    return [(1, 0, len(xb)), (2, len(xb), 4 * len(ids))], xb + i32s(*ids)


def expected(ids: np.ndarray) -> np.ndarray:
    """numpy's MUL_MAT_ID: out[t, j] = EXPERTS[ids[t, j]] @ x[t]."""
    return np.stack([[EXPERTS[ids[t, j]] @ X[t, 0] for j in range(ids.shape[1])] for t in range(TOKENS)])


def compute(s: Session, tensors, inputs, blob, out: int, graph_id: int = 0) -> np.ndarray:
    h, data = s.conn.call(Command.GRAPH_COMPUTE, {"tensors": tensors, "inputs": [list(i) for i in inputs],
                                                  "outputs": [out], "graph_id": graph_id}, blob)
    assert h["status"] == Status.SUCCESS, h
    return np.frombuffer(data, np.float32)


def test_inline_ids_compute_the_chosen_experts(s):
    ids = [2, 0, 1, 2]
    inputs, blob = inline_request(ids)
    got = compute(s, inline_ids_graph(s.buf), inputs, blob, 3)
    np.testing.assert_allclose(got.reshape(TOKENS, N_USED, M), expected(np.array(ids).reshape(TOKENS, N_USED)),
                               rtol=1e-5)


@pytest.mark.parametrize("bad", [N_AS, -1, 1 << 20, -(1 << 31)])
def test_inline_ids_out_of_range_are_refused_and_change_nothing(s, bad):
    ok_ids = [1, 0, 2, 2]
    inputs, blob = inline_request(ok_ids)
    before = compute(s, inline_ids_graph(s.buf), inputs, blob, 3, graph_id=5)
    ids = [1, 0, bad, 2]
    inputs, blob = inline_request(ids)
    h = s.refused(inline_ids_graph(s.buf), inputs, blob, outputs=[3], fragment="tensors[2]")
    assert f"row id {bad}" in h["error"] and f"outside 0..{N_AS - 1}" in h["error"] and "MUL_MAT_ID" in h["error"]
    # the same ids on a recompute of the cached graph: refused too, and the graph still computes as before
    h, _ = s.conn.call(Command.GRAPH_RECOMPUTE, {"graph_id": 5, "inputs": [list(i) for i in inputs],
                                                 "outputs": [3]}, blob)
    assert h["status"] == Status.INVALID_REQUEST and f"row id {bad}" in h["error"], h
    inputs, blob = inline_request(ok_ids)
    h, data = s.conn.call(Command.GRAPH_RECOMPUTE, {"graph_id": 5, "inputs": [list(i) for i in inputs],
                                                    "outputs": [3]}, blob)
    assert h["status"] == Status.SUCCESS and np.array_equal(np.frombuffer(data, np.float32), before), h


def test_inline_ids_read_through_strides_are_checked_as_the_kernel_reads_them(s):
    """A view of a longer inline input: only the ids the view's strides reach count (the one
    past them is out of range and harmless), and an out-of-range one they reach is refused."""
    def graph(nb1):
        t = inline_ids_graph(s.buf)
        mmid = t.pop()
        t[2] = T(I32, [8], flags=INPUT)
        t.append(T(I32, [N_USED, TOKENS], [4, nb1, 8 * 4, 8 * 4], op=VIEW, src=[2], view_src=2, view_offs=4))
        return t + [dict(mmid, src=[0, 1, 3])]
    xb = X.tobytes()
    inputs = [(1, 0, len(xb)), (2, len(xb), 32)]
    raw = [99, 1, 2, 99, 0, 1, 99, 99]  # the view at offset 4 with row stride 12 reads [1, 2] and [0, 1]
    got = compute(s, graph(12), inputs, xb + i32s(*raw), 4)
    np.testing.assert_allclose(got.reshape(TOKENS, N_USED, M), expected(np.array([[1, 2], [0, 1]])), rtol=1e-5)
    s.refused(graph(8), inputs, xb + i32s(*raw), outputs=[4], fragment="row id 99")  # now reads [1, 2], [99, 0]


def top_k_graph(buf: int, n_scores: int = N_AS, k: int = N_USED, **top) -> list[dict]:
    """scores [n_scores, TOKENS] inline -> TOP_K -> ids of MUL_MAT_ID."""
    return [experts_leaf(buf), T(F32, [K, 1, TOKENS], flags=INPUT), T(F32, [n_scores, TOKENS], flags=INPUT),
            T(I32, [k, TOKENS], **dict(dict(op=TOP_K, src=[2], flags=COMPUTE), **top)),
            T(F32, [M, k, TOKENS], op=MUL_MAT_ID, src=[0, 1, 3], flags=OUTPUT | COMPUTE)]


def scores_request(scores: np.ndarray) -> tuple[list, bytes]:
    xb = X.tobytes()
    return [(1, 0, len(xb)), (2, len(xb), scores.nbytes)], xb + scores.astype(np.float32).tobytes()


def test_top_k_ids_compute_the_best_experts(s):
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.1, 0.4]], np.float32)
    inputs, blob = scores_request(scores)
    got = compute(s, top_k_graph(s.buf), inputs, blob, 4).reshape(TOKENS, N_USED, M)
    for t in range(TOKENS):  # TOP_K gives the top k in no promised order: compare as sets
        best = set(np.argsort(-scores[t])[:N_USED])
        rows = {int(np.argmin([np.abs(EXPERTS[e] @ X[t, 0] - r).max() for e in range(N_AS)])) for r in got[t]}
        assert rows == best


def test_top_k_over_more_scores_than_experts_is_refused(s):
    """TOP_K over 5 scores names ids up to 4 of 3 experts: it proves nothing."""
    inputs, blob = scores_request(np.zeros((TOKENS, 5), np.float32))
    s.refused(top_k_graph(s.buf, n_scores=5), inputs, blob, outputs=[4], fragment="exactly 3 entries")


@pytest.mark.parametrize("what, fragment", [("not computed", "flagged COMPUTE"),
                                            ("in a client buffer", "client buffer")])
def test_top_k_ids_that_other_bytes_could_replace_are_refused(s, what, fragment):
    """A TOP_K node skipped (no COMPUTE: its memory keeps whatever was there) or placed in a
    client buffer (where another tensor can alias and rewrite it) proves nothing."""
    top = {"flags": 0} if what == "not computed" else {"buffer": s.buf, "offset": 4096}
    inputs, blob = scores_request(np.zeros((TOKENS, N_AS), np.float32))
    tensors = top_k_graph(s.buf, **top)
    h, _ = s.conn.call(Command.GRAPH_COMPUTE, {"tensors": tensors, "inputs": [list(i) for i in inputs],
                                               "outputs": [4]}, blob)  # as sent: refused() would set COMPUTE
    assert h["status"] == Status.INVALID_REQUEST and fragment in h["error"], h
    if what == "in a client buffer":
        s.refused(tensors, inputs, blob, outputs=[4], fragment=fragment)


def test_view_of_top_k_ids_must_read_whole_elements(s):
    """A view 2 bytes into the TOP_K result would read ids made of two halves (0x00010000 and up)."""
    inputs, blob = scores_request(np.zeros((TOKENS, N_AS), np.float32))
    tensors = top_k_graph(s.buf, k=N_AS)
    tensors[4] = T(I32, [1, TOKENS], [4, 12, 24, 24], op=VIEW, src=[3], view_src=3, view_offs=2)
    tensors.append(T(F32, [M, 1, TOKENS], op=MUL_MAT_ID, src=[0, 1, 4], flags=OUTPUT | COMPUTE))
    s.refused(tensors, inputs, blob, outputs=[5], fragment="whole int32")
    tensors[4]["view_offs"] = 4  # the second-best of each row: fine
    compute(s, tensors, inputs, blob, 5)


@pytest.mark.parametrize("source", ["buffer", "argmax", "get_rows"])
def test_ids_neither_inline_nor_from_top_k_are_refused(s, source):
    """Ids in a client buffer (its bytes are the client's to choose) or computed by any op
    but TOP_K cannot be proven in range before compute."""
    xb = X.tobytes()
    tensors = [experts_leaf(s.buf), T(F32, [K, 1, TOKENS], flags=INPUT)]
    inputs, blob = [(1, 0, len(xb))], xb
    if source == "buffer":
        tensors.append(T(I32, [N_USED, TOKENS], buffer=s.buf, offset=4096))
    elif source == "argmax":
        tensors += [T(F32, [N_AS, N_USED * TOKENS], flags=INPUT),
                    T(I32, [N_USED * TOKENS], op=lib.GGML_OP_ARGMAX, src=[2], flags=COMPUTE)]
        tensors.append(T(I32, [N_USED, TOKENS], op=lib.GGML_OP_RESHAPE, src=[3], view_src=3))
        inputs.append((2, len(xb), 4 * N_AS * N_USED * TOKENS))
        blob += bytes(4 * N_AS * N_USED * TOKENS)
    else:
        tensors += [T(I32, [N_USED, 5, TOKENS], buffer=s.buf, offset=4096), T(I32, [1, TOKENS], flags=INPUT),
                    T(I32, [N_USED, 1, TOKENS], op=lib.GGML_OP_GET_ROWS, src=[2, 3], flags=COMPUTE)]
        tensors.append(T(I32, [N_USED, TOKENS], op=lib.GGML_OP_RESHAPE, src=[4], view_src=4))
        inputs.append((3, len(xb), 8))
        blob += i32s(0, 0)
    ids = len(tensors) - 1
    tensors.append(T(F32, [M, N_USED, TOKENS], op=MUL_MAT_ID, src=[0, 1, ids], flags=OUTPUT | COMPUTE))
    s.refused(tensors, inputs, blob, outputs=[ids + 1], fragment="ids must come inline or from a TOP_K")


@pytest.mark.parametrize("change, fragment", [
    (lambda t: t[2].update(ne=[N_USED, TOKENS, 2, 1], nb=[4, 8, 16, 32]), "ids 2-D"),
    (lambda t: t[1].update(ne=[K, 1, TOKENS, 2], nb=[4, 32, 32, 64]), "3-D"),
    (lambda t: t[3].update(ne=[M, N_USED, TOKENS, 2], nb=[4, 16, 32, 64]), "result must be"),
    (lambda t: t[0].update(ne=[K, 1, 2048, 1], nb=[4, 32, 32, 65536]), "at most 1024 experts"),
])
def test_shapes_and_strides_the_kernel_cannot_take_are_refused(s, change, fragment):
    tensors = inline_ids_graph(s.buf)
    change(tensors)
    nx, nids = (4 * int(np.prod(tensors[i]["ne"])) for i in (1, 2))
    inputs, blob = [(1, 0, nx), (2, nx, nids)], bytes(nx + nids)
    s.refused(tensors, inputs, blob, outputs=[3], fragment=fragment)


def test_argsort_is_not_accepted(s):
    """ARGSORT's std::sort is not memory-safe under a comparator NaN scores break; TOP_K's
    heap-based partial sort is, and is what the models use."""
    tensors = [T(F32, [N_AS, TOKENS], flags=INPUT),
               T(I32, [N_AS, TOKENS], op=lib.GGML_OP_ARGSORT, src=[0], flags=OUTPUT | COMPUTE)]
    s.refused(tensors, [(0, 0, 4 * N_AS * TOKENS)], bytes(4 * N_AS * TOKENS), outputs=[1],
              fragment="not supported")


def test_top_k_of_a_strided_view_is_refused(s):
    """TOP_K walks all rows as i * nb[1]: a view whose planes are not packed after its rows
    would be read past."""
    tensors = [T(F32, [4, 4, 4], buffer=s.buf),
               T(F32, [4, 2, 2], [4, 16, 64, 128], op=VIEW, src=[0], view_src=0),
               T(I32, [2, 2, 2], op=TOP_K, src=[1], flags=OUTPUT | COMPUTE)]
    s.refused(tensors, outputs=[2], fragment="packed rows")
