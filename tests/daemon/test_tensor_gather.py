"""Gathered exchanges (`tensor.gather`, exact sums) between two real daemons: each member
sends only its piece and puts every member's piece in place, nothing summed (a -0.0 stays
-0.0, where summing it padded with zeros gives +0.0); the lengths are checked before any
memory is touched, statically by the daemon and against the member's rank by its compute
process; a peer sending another piece size than the lengths say drops the link."""
from __future__ import annotations

import struct

import pytest

from graph_helpers import COMPUTE, F32, INPUT, OUTPUT, T, f32s, i32s
from ggml_ffi import lib
from rpc_daemon.wire.protocol import Command, Status
from rpc_helpers import RawConn
from test_tensor_links import both, link, pair  # noqa: F401  (pair: the fixture)

pytestmark = pytest.mark.system


def gather_graph(lo: int, piece: int, whole: int, rows: int = 1) -> list:
    """x (input: this member's piece, `rows` rows) -> y = 2x -> w = y padded to `whole` floats
    a row from `lo` (exchanged: gathered) -> z = w + w (output)."""
    return [T(F32, [piece, rows], flags=INPUT),
            T(F32, [piece, rows], op=lib.GGML_OP_SCALE, src=[0], params=f32s(2.0), flags=COMPUTE),
            T(F32, [whole, rows], op=lib.GGML_OP_PAD, src=[1], params=i32s(lo, whole - lo - piece, 0, 0, 0, 0, 0, 0, 0),
              flags=COMPUTE),
            T(F32, [whole, rows], op=lib.GGML_OP_ADD, src=[2, 2], flags=OUTPUT | COMPUTE)]


def gather(conn: RawConn, x, lo: int, lengths, step: int, rows: int = 1, gather_field=None, timeout: float = 30.0,
           again: bool = False, exchange=(2,)):
    """`again`: a GRAPH_RECOMPUTE of the graph a GRAPH_COMPUTE cached as graph 1."""
    piece = len(x) // rows
    fields = {"graph_id": 1, "inputs": [[0, 0, 4 * len(x)]], "outputs": [3],
              "tensor": {"link": 7, "step": step, "exchange": list(exchange), "timeout": timeout,
                         "gather": [list(lengths)] if gather_field is None else gather_field}}
    if not again:
        fields["tensors"] = gather_graph(lo, piece, sum(lengths), rows)
    return conn.call(Command.GRAPH_RECOMPUTE if again else Command.GRAPH_COMPUTE, fields, f32s(*x))


def floats(out: bytes) -> list:
    return list(struct.unpack(f"<{len(out) // 4}f", out))


def bits(values) -> bytes:
    return f32s(*values)


def test_the_feature_is_offered(pair):
    _, _, a, _ = pair
    assert "tensor_gather" in a.hello_reply["features"]


@pytest.mark.parametrize("lengths", [(2, 2), (1, 3)])
def test_each_member_puts_every_members_piece_in_place(pair, lengths):
    da, db, a, b = pair
    link(a, b, db.port)
    xa, xb = [-0.0, 1.5, 2.0][:lengths[0]], [3.0, -4.0, 5.0][:lengths[1]]
    for step in range(3):  # several steps over the same link
        (ha, oa), (hb, ob) = both(lambda: gather(a, xa, 0, lengths, step),
                                  lambda: gather(b, xb, lengths[0], lengths, step))
        assert ha["status"] == 0 and hb["status"] == 0, (ha, hb)
        want = [4 * v for v in xa + xb]
        assert oa == ob == bits(want), (floats(oa), floats(ob), want)  # bit for bit: -0.0 is not summed into +0.0
        assert "exchange_us" in ha


def test_pieces_of_several_rows_go_to_their_columns(pair):
    da, db, a, b = pair
    link(a, b, db.port)
    rows = 3
    xa = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # 2 floats a row
    xb = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0]  # 3 floats a row
    (ha, oa), (hb, ob) = both(lambda: gather(a, xa, 0, (2, 3), 0, rows=rows),
                              lambda: gather(b, xb, 2, (2, 3), 0, rows=rows))
    assert ha["status"] == 0 and hb["status"] == 0, (ha, hb)
    want = [4 * v for r in range(rows) for v in xa[2 * r: 2 * r + 2] + xb[3 * r: 3 * r + 3]]
    assert floats(oa) == floats(ob) == want


@pytest.mark.parametrize("field, words", [
    ([[2, 2], [2, 2]], "2 entries for 1 exchanges"),
    ([[4]], "a list of 2..16 lengths"),
    ([[2, 0, 2]], "a list of 2..16 lengths"),
    ([[2, True]], "a list of 2..16 lengths"),
    ([[1, 1, 1]], "sum to 3, the tensor's ne[0] is 4"),
    ("all", "must be a list"),
    ([[2] * 17], "a list of 2..16 lengths"),
])
def test_bad_lengths_are_refused_before_anything_runs(pair, field, words):
    _, _, a, _ = pair
    h, _ = gather(a, [1.0, 2.0], 0, (2, 2), 0, gather_field=field)
    assert h["status"] == Status.INVALID_REQUEST and words in h["error"], h
    h, _ = a.call(Command.PING)
    assert h["status"] == 0


def test_only_a_pad_in_dim_0_of_a_contiguous_f32_piece_is_gathered(pair):
    _, _, a, _ = pair
    scale = [T(F32, [4], flags=INPUT), T(F32, [4], op=lib.GGML_OP_SCALE, src=[0], params=f32s(2.0), flags=COMPUTE),
             T(F32, [4], op=lib.GGML_OP_ADD, src=[1, 1], flags=OUTPUT | COMPUTE)]
    padded_rows = [T(F32, [4, 1], flags=INPUT),
                   T(F32, [4, 1], op=lib.GGML_OP_SCALE, src=[0], params=f32s(2.0), flags=COMPUTE),
                   T(F32, [4, 2], op=lib.GGML_OP_PAD, src=[1], params=i32s(0, 0, 0, 1, 0, 0, 0, 0, 0), flags=COMPUTE),
                   T(F32, [4, 2], op=lib.GGML_OP_ADD, src=[2, 2], flags=OUTPUT | COMPUTE)]
    for graph, exchange in ((scale, 1), (padded_rows, 2)):
        fields = {"tensors": graph, "inputs": [[0, 0, 16]], "outputs": [len(graph) - 1],
                  "tensor": {"link": 7, "step": 0, "exchange": [exchange], "timeout": 5, "gather": [[2, 2]]}}
        h, _ = a.call(Command.GRAPH_COMPUTE, fields, f32s(1, 2, 3, 4))
        assert h["status"] == Status.INVALID_REQUEST and "a PAD of a contiguous f32 tensor" in h["error"], h


def test_lengths_that_do_not_match_the_members_own_piece_are_refused_by_it(pair):
    """Statically fine (they sum to the whole), but rank 0's graph pads 2 floats from 0 and the
    lengths give rank 0 three: refused by that member before it exchanges anything."""
    da, db, a, b = pair
    link(a, b, db.port)
    h, _ = gather(a, [1.0, 2.0], 0, (3, 1), 0, timeout=5)
    assert h["status"] == Status.INVALID_REQUEST and "rank 0's piece is 3 floats from 0" in h["error"], h
    h, _ = gather(a, [1.0, 2.0], 0, (2, 2, 0), 0, gather_field=[[1, 1, 2]], timeout=5)
    assert h["status"] == Status.INVALID_REQUEST and "3 lengths for a group of 2" in h["error"], h


def test_a_peer_sending_another_piece_size_drops_the_link(pair):
    """Each member's own lengths check out, but they disagree: rank 1 sends 1 float where rank 0
    expects 2 (and rank 0 sends 2 where rank 1 expects 3)."""
    da, db, a, b = pair
    link(a, b, db.port)
    (ha, _), (hb, _) = both(lambda: gather(a, [1.0, 2.0], 0, (2, 2), 0),
                            lambda: gather(b, [3.0], 3, (3, 1), 0))
    assert ha["status"] == hb["status"] == Status.LINK_FAILED, (ha, hb)
    assert "expected (step 0, index 0, 8 bytes)" in ha["error"] and "4 bytes" in ha["error"], ha
    h, _ = gather(a, [1.0, 2.0], 0, (2, 2), 1)  # dropped: linked again before the next step
    assert h["status"] == Status.LINK_FAILED and "not set up" in h["error"], h


def test_the_same_graph_sums_padded_without_gather(pair):
    """Without `tensor.gather` the PAD is computed and summed, as for a client that does not
    gather: the same values, except that -0.0 padded with a peer's +0.0 sums to +0.0."""
    da, db, a, b = pair
    link(a, b, db.port)
    (ha, oa), (hb, ob) = both(lambda: gather(a, [-0.0, 1.5], 0, (2, 2), 0, gather_field=[None]),
                              lambda: gather(b, [3.0, -4.0], 2, (2, 2), 0, gather_field=[None]))
    assert ha["status"] == 0 and hb["status"] == 0, (ha, hb)
    assert oa == ob == bits([0.0, 6.0, 12.0, -16.0])


@pytest.mark.parametrize("exchange, field, words", [
    ((2.0,), None, "2.0 is not a tensor of the graph"),
    ((True,), None, "True is not a tensor of the graph"),
    ((2,), [[2.0, 2]], "a list of 2..16 lengths"),
    ((2,), [[True, 3]], "a list of 2..16 lengths"),
])
def test_a_list_checked_once_is_checked_again_when_its_entries_only_equal_ints(pair, exchange, field, words):
    """A graph's exchanges and gathers are checked once and then known; 2.0 and True equal 2 and 1 as
    set keys, so a later step naming the same ones so must not pass as known."""
    da, db, a, b = pair
    link(a, b, db.port)
    (ha, _), (hb, _) = both(lambda: gather(a, [1.0, 2.0], 0, (2, 2), 0), lambda: gather(b, [3.0, 4.0], 2, (2, 2), 0))
    assert ha["status"] == 0 and hb["status"] == 0, (ha, hb)
    h, _ = gather(a, [1.0, 2.0], 0, (2, 2), 1, again=True, exchange=exchange, gather_field=field, timeout=5)
    assert h["status"] == Status.INVALID_REQUEST and words in h["error"], h
