"""The greedy head's argmax (coordinator/model/architectures/common.argmax_first),
computed by libggml in this process and held to numpy's argmax: the first of equal
maxima, whatever the ties, rows and threads; the maximum; and a finiteness probe
that is 0 where a row is finite and not finite where a logit is not."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.model.architectures.common import PROBE_MAX_SPAN, PROBE_MIN_SPAN, argmax_first
from ggml_ffi import Context, CpuBackend, Gallocr, ffi, lib

N_VOCAB = 4096


def greedy(logits: np.ndarray, threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """argmax_first of `logits` ([rows, n] f32) on the CPU backend: (ids, maxima, probes), one per row."""
    rows, n = logits.shape
    with CpuBackend(threads) as backend:
        ctx = Context(16)
        galloc = Gallocr(backend)
        try:
            x = ctx.new_tensor(lib.GGML_TYPE_F32, [n, rows], "logits")
            lib.ggml_set_input(x)
            outs = argmax_first(ctx.ptr, x)
            gf = ctx.new_graph()
            for out in outs:
                lib.ggml_set_output(out)
                lib.ggml_build_forward_expand(gf, out)
            assert galloc.alloc_graph(gf)
            data = np.ascontiguousarray(logits, np.float32)
            lib.ggml_backend_tensor_set(x, ffi.from_buffer(data), 0, data.nbytes)
            assert backend.compute(gf) == lib.GGML_STATUS_SUCCESS
            ids, best, total = (bytes(ffi.buffer(o.data, lib.ggml_nbytes(o))) for o in outs)
            return np.frombuffer(ids, np.int32), np.frombuffer(best, np.float32), np.frombuffer(total, np.float32)
        finally:
            galloc.close()
            ctx.close()


def tie_rows(rng) -> np.ndarray:
    """Rows whose maximum repeats: small integers (every value many times), all equal, the
    maximum first, last, or only at the ends, and -inf besides finite values."""
    rows = [rng.integers(-3, 3, N_VOCAB).astype(np.float32) for _ in range(5)]
    rows.append(np.full(N_VOCAB, 1.5, np.float32))
    first = rng.normal(size=N_VOCAB).astype(np.float32)
    first[0] = first.max() + 1
    first[1000] = first[0]
    rows.append(first)
    ends = np.zeros(N_VOCAB, np.float32)
    ends[[0, N_VOCAB - 1]] = 2.0
    rows.append(ends)
    last = rng.normal(size=N_VOCAB).astype(np.float32)
    last[-1] = last.max() + 1
    rows.append(last)
    minus = rng.normal(size=N_VOCAB).astype(np.float32)
    minus[::3] = -np.inf
    rows.append(minus)
    return np.stack(rows)


@pytest.mark.parametrize("threads", [1, 2])
def test_ties_go_to_the_lowest_id(threads):
    logits = tie_rows(np.random.default_rng(5))
    ids, best, total = greedy(logits, threads)
    assert ids.tolist() == logits.argmax(axis=1).tolist()
    assert np.array_equal(best, logits.max(axis=1))
    assert (total[:-1] == 0).all() and np.isnan(total[-1])  # -inf logits make the probe NaN: refused


@pytest.mark.parametrize("n", [N_VOCAB, 1000, 1031, 1 << 18])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_logit_that_is_not_finite_shows_in_the_probe_wherever_it_is(n, bad):
    """The coordinator refuses a greedy step whose probes are not all finite, as it refuses such
    logits: a NaN or infinity anywhere in a row shows in that row's probe, even where the pick
    stays finite (at the first and last logit, and where the probe's spans meet), whatever the
    vocabulary's divisors (4096 and 2^18: spans of PROBE_MAX_SPAN; 1000: one span; 1031, a prime
    past it: the plain row sum). With spans, one in the first row's first span reaches every
    row's probe (the zeros the products take are made from it): that step is refused all the same."""
    rng = np.random.default_rng(6)
    spans = [k for k in range(PROBE_MIN_SPAN, min(n, PROBE_MAX_SPAN) + 1) if n % k == 0]
    span = max(spans) if spans else n
    for col in sorted({0, n - 1, span - 1, min(span, n - 1), n // 2}):
        logits = rng.normal(size=(3, n)).astype(np.float32)
        logits[1, col] = bad
        ids, best, probe = greedy(logits, 2)
        assert not np.isfinite(probe[1]), (col, probe)
        assert np.isfinite(probe[[0, 2]]).all(), (col, probe)  # the other rows: finite, checked alone
        if spans:
            assert probe[0] == 0 and probe[2] == 0, (col, probe)
        assert ids[2] == logits[2].argmax() and best[2] == logits[2].max()
    if spans:
        logits = rng.normal(size=(3, n)).astype(np.float32)
        logits[0, span - 1] = bad
        assert not np.isfinite(greedy(logits, 1)[2]).any()
