"""Property: every graph the validator (rpc_daemon/validation/graph.py) accepts computes
inside the client buffers it names and writes only what it declares.

Random graphs for every op of graph.OP_RULES, built by the op rules with
random shapes, types, offsets and views (VIEW/PERMUTE/TRANSPOSE/RESHAPE), a
third of them then mutated (a stride, view offset, offset, shape or op
parameter; or the audit's attack: a stride ggml_nbytes undercounts and the
view moved to the end of its storage). Accepted ones are computed by
libggml in a child process on client buffers fenced by PROT_NONE guard pages
and filled with a canary (tests/extents_fuzz.py): a fault, an abort, a
failed compute, or a changed byte outside the declared written ranges fails
the test with the case. bench/fuzz_extents.py runs the same for longer.
"""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import extents_fuzz as F
from conftest import SLACK
from ggml_ffi import lib
from rpc_daemon.validation import graph as G

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

N_CASES = 3200  # about three quarters are accepted: >= 2,000 computed
MIN_ACCEPTED = 2000


@pytest.fixture(scope="module")
def harness():
    h = F.Harness(threads=1, timeout=20.0 * SLACK)  # a case's compute: a hang past this fails it
    yield h
    h.close()


def test_accepted_graphs_stay_inside_their_buffers(harness):
    stats = F.Stats()
    started = time.monotonic()

    @settings(max_examples=N_CASES, deadline=None, derandomize=True, database=None, print_blob=True,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 2**64 - 1))
    def case(seed):
        F.one_case(seed, harness, stats)  # failures are collected, and reported together below

    case()
    took = time.monotonic() - started
    rate = stats.accepted / stats.cases
    table = ", ".join(f"{op} {a}/{n}" for op, (n, a) in sorted(stats.by_op.items()))
    print(f"\n{stats.cases} cases, {stats.accepted} accepted ({rate:.0%}) and computed, {len(stats.faults)} "
          f"failures, {took:.1f} s\n{table}")
    if stats.faults:
        kinds: dict = {}
        for _, res, described in stats.faults:
            key = (described.split(",")[0], res.kind, res.detail.split("\n")[0][:60])
            kinds[key] = kinds.get(key, 0) + 1
        summary = "\n".join(f"  {n} x {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
        first = "\n\n".join(f"seed {seed}: {res.kind}: {res.detail.strip()}\n{described}"
                             for seed, res, described in stats.faults[:3])
        pytest.fail(f"{len(stats.faults)} of {stats.accepted} accepted graphs faulted or wrote outside their "
                    f"declared ranges:\n{summary}\n\nthe first ones:\n{first}")
    assert stats.accepted >= MIN_ACCEPTED, f"only {stats.accepted} accepted of {stats.cases}: {table}"
    every = {G.op_name(op) for op in G.OP_RULES if op != lib.GGML_OP_NONE}
    thin = {op for op in every if stats.by_op.get(op, [0, 0])[1] < 20}
    assert not thin, f"ops with fewer than 20 computed cases: {thin} ({table})"


def test_the_fence_catches_overruns_and_stray_writes(harness, monkeypatch):
    """The harness itself: the audit's write (SET_ROWS through a zero-stride result
    view pushed to the buffer's end), run past validation, faults on the guard;
    a write the graph does not declare is reported from the canary."""
    tensors = [
        F.canonical_tensor(F.F32, [64, 1, 1, 1], buffer=1, offset=0),
        F.canonical_tensor(F.F32, [64, 1, 1, 1], flags=F.INPUT),
        F.canonical_tensor(F.I64, [1, 1, 1, 1], flags=F.INPUT),
        F.canonical_tensor(F.F32, [64, 1, 1, 1], op=F.OP.SET_ROWS, src=[1, 2, 0], view_src=0, view_offs=252,
                           flags=F.COMPUTE),
    ]
    h = {"tensors": tensors, "inputs": [[1, 0, 256], [2, 256, 8]], "outputs": []}
    blob = bytes(256) + bytes(8)
    spec = G.parse_unchecked(h, {1: 256}.get)
    spec.tensors[3].nb = (0, 256, 256, 256)  # what the schema now refuses
    res = harness.run(spec, h, blob, {1: 256})
    assert not res.ok and res.kind == "fault" and "SIGSEGV" in res.detail, res
    # in bounds, but the harness is told nothing is written: the canary says otherwise
    h["tensors"][3]["view_offs"] = 0
    spec = G.parse_graph(h, F.Limits(), {1: 256}.get)
    monkeypatch.setattr(F, "written_ranges", lambda spec: {})
    res = harness.run(spec, h, blob, {1: 256})
    assert not res.ok and res.kind == "canary" and "256 bytes changed" in res.detail, res
