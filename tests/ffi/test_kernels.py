"""Which matrix-product kernels run, and what a row's result depends on.

The speed comes from kernels that take over from ggml's per-row vec_dot once a
step has enough rows: llamafile's tinyBLAS (from 2 rows: q8_0, q5_0, q4_0) and
ggml's tiled K-quant kernel (from 8 rows: q4_K, q6_K, ...). The guarantees the
rest of the system is built on (docs/architecture.md, "Kernels and what a
result depends on") are checked here on the real library, on this machine:

* a row's result never depends on the thread count, on how many rows of the
  weight are multiplied (a worker's share of the output head against the whole
  head), nor on the other batch rows beside it;
* for the 32-element quants and for float weights it does not depend on the
  number of batch rows either (tinyBLAS sums exactly as vec_dot; the build keeps
  tinyBLAS off float weights, ggml_build._SOURCE_PATCHES);
* for the K-quants there are two classes of batch sizes, 1-7 (vec_dot) and 8 or
  more (tiled): equal within a class.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from ggml_ffi import ORIGIN, Context, cpu_library, describe, ffi, lib
from coordinator.model.architectures.common import PAIRED_ROWS, GraphBuilder
from rpc_daemon.wire.graph_limits import DOT_TYPES, WEIGHT_TYPES

BATCHES = [1, 2, 3, 7, 8, 9, 16, 63, 64, 65, 130]
ROWS = 36  # not a multiple of 8 or 16: tinyBLAS's row tiles and its fallback both occur
needs_build = pytest.mark.skipif(ORIGIN.kind != "build", reason="the kernels of the pinned build are tested")


def products(type_name: str, k: int, rows: int, threads: int, seed: int = 0, cast: bool = False,
             paired: bool = False, dot_inputs: bool = False) -> dict[int, np.ndarray]:
    """{n: the [n, rows] product of a `type_name` weight [k, rows] and the first n of a fixed
    set of f32 activation rows}, each computed as a graph of its own; `cast`: the rows
    converted to the weight's dot type first (ggml_cast), as a shared input is; `paired`:
    by GraphBuilder.product where CONCAT is taken (its even and odd rows apart, where
    PAIRED_ROWS says so); `dot_inputs`: that builder's graph runs where dot-type inputs are
    taken (it converts an f32 x once for both halves)."""
    wtype = getattr(lib, "GGML_TYPE_" + type_name)
    x = np.random.default_rng(seed).standard_normal((max(BATCHES), k)).astype(np.float32)
    w = np.random.default_rng(seed + 1).standard_normal((rows, k)).astype(np.float32)  # row i: the same for any `rows`
    out = {}
    for n in BATCHES:
        with Context(16, no_alloc=False, mem_size=(rows + n) * k * 4 * 2 + (8 << 20)) as ctx:
            a = ctx.new_tensor(wtype, [k, rows])
            b = ctx.new_tensor(lib.GGML_TYPE_F32, [k, n])
            if type_name == "F32":
                ffi.memmove(a.data, w.tobytes(), w.nbytes)
            elif type_name == "F16":
                ffi.memmove(a.data, w.astype(np.float16).tobytes(), w.size * 2)
            else:
                lib.ggml_quantize_chunk(wtype, ffi.cast("float *", ffi.from_buffer(w)), a.data, 0, rows, k, ffi.NULL)
            ffi.memmove(b.data, x[:n].tobytes(), n * k * 4)
            if cast:
                b = lib.ggml_cast(ctx.ptr, b, DOT_TYPES[wtype])
            if paired:
                builder = GraphBuilder(ctx, None, {}, None, None, None, None)
                builder.concat, builder.dot_type_inputs = True, dot_inputs
                c = builder.product(a, b)
                assert (c.op == lib.GGML_OP_RESHAPE) == (n in PAIRED_ROWS[wtype]), (type_name, n)
            else:
                c = lib.ggml_mul_mat(ctx.ptr, a, b)
            gf = ctx.new_graph(16)
            lib.ggml_build_forward_expand(gf, c)
            assert cpu_library().lib.ggml_graph_compute_with_ctx(ctx.ptr, gf, threads) == lib.GGML_STATUS_SUCCESS
            out[n] = np.frombuffer(ffi.buffer(c.data, rows * n * 4), np.float32).reshape(n, rows).copy()
    return out


def classes(out: dict[int, np.ndarray]) -> list[list[int]]:
    """Batch sizes grouped by the bits of every row they share with the largest batch."""
    groups: list[list[int]] = []
    for n in BATCHES:
        for g in groups:
            if all(np.array_equal(out[n][j], out[g[0]][j]) for j in range(min(n, g[0]))):
                g.append(n)
                break
        else:
            groups.append([n])
    return groups


@needs_build
@pytest.mark.parametrize("type_name,k", [("Q8_0", 640), ("Q5_0", 640), ("Q4_0", 640), ("F16", 640), ("F32", 640)])
def test_a_row_does_not_depend_on_its_batch(type_name, k):
    """gemma3's q5_0/q8_0 tensors and float weights: one class for every batch size, so a
    token's logits are the same decoded alone or in any batch (tinyBLAS from 2 rows on)."""
    assert classes(products(type_name, k, ROWS, threads=1)) == [BATCHES]


@needs_build
@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0"])
def test_a_row_does_not_depend_on_its_batch_over_weights_beyond_the_caches(type_name):
    """The build's edit sends fewer than 12 columns times weights over 16 MiB (gemma3's head) to
    vec_dot, the rest to tinyBLAS: still one class for every batch size, as with small weights.
    (Which kernel ran is a matter of speed, bench/; the loaded build must carry the edit.)"""
    from ggml_ffi import ggml_build, row_size
    assert any(f"n < {ggml_build.SGEMM_SMALL_N}" in new for _, _, new in ORIGIN.info.get("source_patches", [])), \
        ORIGIN.info.get("source_patches")
    wtype = getattr(lib, "GGML_TYPE_" + type_name)
    rows = ggml_build.SGEMM_LARGE_WEIGHT_BYTES // row_size(wtype, 640) + 40
    assert classes(products(type_name, 640, rows, threads=2)) == [BATCHES]


@needs_build
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_quants_have_two_batch_classes(type_name):
    """The tiled kernel runs from 8 batch rows on, vec_dot below: equal within each class.
    With GGML_CPU_TILED_MM=0 (ggml_ffi/_loader.py's opt-out) vec_dot runs for all."""
    tiled = os.environ.get("GGML_CPU_TILED_MM", "1") != "0"
    want = [[n for n in BATCHES if n < 8], [n for n in BATCHES if n >= 8]] if tiled else [BATCHES]
    assert classes(products(type_name, 512, ROWS, threads=1)) == want


@needs_build
@pytest.mark.parametrize("type_name,k", [("Q4_K", 512), ("Q6_K", 512), ("Q5_0", 640), ("Q8_0", 640), ("F16", 640)])
def test_a_row_does_not_depend_on_threads_or_on_the_rows_beside_it(type_name, k):
    """Threads split a product by rows and columns, never inside a sum; a weight's first
    rows multiplied alone (a head shard: 20 of 36 rows) give the same bits as in the whole."""
    one, two = products(type_name, k, ROWS, threads=1), products(type_name, k, ROWS, threads=2)
    shard = products(type_name, k, 20, threads=1)  # the same seed: the first 20 rows of the same weight
    for n in BATCHES:
        assert np.array_equal(one[n], two[n]), (type_name, n)
        assert np.array_equal(one[n][:, :20], shard[n]), (type_name, n)


def test_dot_types_are_the_loaded_ggmls():
    """graph_limits.DOT_TYPES (the wire contract of a MUL_MAT's converted src1) is what this
    ggml's CPU matmul converts src1 to, for every quantized weight type; float ones have none."""
    for wtype in WEIGHT_TYPES:
        dot = cpu_library().lib.ggml_get_type_traits_cpu(wtype).vec_dot_type
        assert DOT_TYPES.get(wtype, dot if dot == wtype else None) == dot, (wtype, dot)
    assert set(DOT_TYPES) == {t for t in WEIGHT_TYPES if lib.ggml_is_quantized(t)}


@pytest.mark.parametrize("type_name,k", [("Q4_K", 512), ("Q6_K", 512), ("Q5_0", 640), ("Q8_0", 640), ("Q4_0", 640)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_product_of_a_converted_input_has_the_same_bits(type_name, k, threads):
    """An input converted once to the weight's dot type (ggml_cast) and then multiplied gives
    the bits of the plain product, which converts it itself, at every batch size (vec_dot,
    tinyBLAS and tiled alike): what lets graphs share one conversion among products."""
    plain, cast = products(type_name, k, ROWS, threads), products(type_name, k, ROWS, threads, cast=True)
    for n in BATCHES:
        assert np.array_equal(plain[n], cast[n]), (type_name, n)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_product_by_even_and_odd_rows_apart_has_the_same_bits(type_name, threads):
    """A weight whose rows are an odd number of blocks (5 here) multiplied by its even and its
    odd rows apart (GraphBuilder.product, for the batch sizes PAIRED_ROWS names; the others
    as one product) gives the plain product's bits at every batch size: with x f32 (each half
    converting it), converted once by the builder for both halves, or converted before."""
    plain = products(type_name, 1280, ROWS, threads)
    for how in ({"paired": True}, {"paired": True, "dot_inputs": True}, {"paired": True, "cast": True}):
        paired = products(type_name, 1280, ROWS, threads, **how)
        for n in BATCHES:
            assert np.array_equal(plain[n], paired[n]), (type_name, n, how)


@needs_build
def test_the_build_has_the_fast_kernels():
    """What the speed targets rest on (docs/architecture.md): llamafile compiled in, and the
    tiled K-quant kernel on unless GGML_CPU_TILED_MM=0 opts out."""
    facts = describe()
    assert facts["cpu_features"] and "LLAMAFILE" in facts["cpu_features"], facts
    assert facts["kernels"]["llamafile"] == "quantized" and facts["kernels"]["tiled_k_quants"] == (
        os.environ.get("GGML_CPU_TILED_MM", "1") != "0"), facts


@needs_build
@pytest.mark.system  # a child process
def test_extra_buffer_types_are_probed_in_a_child_and_remembered(tmp_path):
    """CPU_REPACK, AMX, ...: each is tried in a child process, so a kernel the CPU or the OS
    does not really allow (AMX on a VM that lists it) is a line in the answer, never a crash;
    the answer is kept per library, CPU and kernel in the cache."""
    import json
    import subprocess
    import sys

    from ggml_ffi import extra_buffers

    env = dict(os.environ, GGML_DISTRIBUTED_GGML=str(ORIGIN.directory), GGML_DISTRIBUTED_CACHE=str(tmp_path),
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    run = subprocess.run([sys.executable, "-m", "ggml_ffi.extra_buffers"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout[run.stdout.index("{"):])
    assert set(found) == set(extra_buffers.buffer_types()), found
    for name, verdict in found.items():
        assert verdict.startswith(("ok (", "died of SIG", "takes none", "results differ", "failed")), (name, verdict)
    memo = list(tmp_path.glob("extra-buffers-*.json"))
    assert len(memo) == 1 and json.loads(memo[0].read_text()) == found
