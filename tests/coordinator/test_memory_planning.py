"""Splitting by free memory: the coordinator plans each stage from what every worker
reports free (DEVICE_INFO), checks that each stage fits (weights, KV cache and a
compute reserve) and refuses a model that fits nowhere with how many bytes are
missing and on which workers, before anything is uploaded. Real daemons started
with small --mem values; a model of 8 layers of ~4 MiB (f32) that one such worker
cannot hold."""
from __future__ import annotations


import pytest

from conftest import DaemonProcess, free_port
from coordinator import Coordinator, DoesNotFit
from coordinator.model.split_plan import fit_split
from rpc_helpers import bytes_in
from tiny_models import Dims, write_plain_llama

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

N_CTX, N_BATCH, N_LAYER = 64, 16, 8
MiB = 1 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """llama, 8 layers of 4 MiB of f32 weights each: ~33 MiB with its ends."""
    d = Dims(n_embd=256, n_layer=N_LAYER, n_head=4, n_head_kv=4, n_ff=1024)
    return write_plain_llama(tmp_path_factory.mktemp("plan") / "eight-layers.gguf", d, "f32")


def workers(*mem_mib: int, extra=()):
    """Daemons with these --mem values (MiB), each with a metrics port (bytes received)."""
    ds = []
    for mem in mem_mib:
        port = free_port()
        d = DaemonProcess("-t", "1", "--mem", str(mem), "--metrics-port", str(port), *extra)
        d.metrics_port = port
        ds.append(d)
    return ds


def stop(ds):
    for d in ds:
        d.stop()


def test_a_model_one_worker_cannot_hold_loads_over_two(model):
    ds = workers(24, 24)
    try:
        with pytest.raises(DoesNotFit) as err:
            Coordinator([ds[0].endpoint], model=model, n_ctx=N_CTX, n_batch=N_BATCH)
        msg = str(err.value)
        assert ds[0].endpoint in msg and "short" in msg and "layers 0-7" in msg, msg
        assert bytes_in(ds[0].metrics_port) < 64 << 10, "weights were uploaded before the plan was checked"
        with Coordinator(["local"], model=model, n_ctx=N_CTX, n_batch=N_BATCH) as ref:
            want = ref.generate("the capital of france is", max_tokens=8)
        with Coordinator([d.endpoint for d in ds], model=model, n_ctx=N_CTX, n_batch=N_BATCH) as c:
            layers = [e["layers"] for e in c.endpoints()]
            assert c.generate("the capital of france is", max_tokens=8) == want
        assert layers == [[0, 4], [4, 8]], layers
    finally:
        stop(ds)


def test_a_model_that_fits_nowhere_is_refused_before_any_upload(model):
    ds = workers(10, 10, 10)
    try:
        with pytest.raises(DoesNotFit) as err:
            Coordinator([d.endpoint for d in ds], model=model, n_ctx=N_CTX, n_batch=N_BATCH)
        msg = str(err.value)
        assert "does not fit" in msg and "MiB short" in msg, msg
        assert sum(d.endpoint in msg for d in ds) >= 1, msg
        assert all(bytes_in(d.metrics_port) < 64 << 10 for d in ds), "weights were uploaded"
    finally:
        stop(ds)


def test_the_per_client_cap_bounds_the_plan(model):
    """A worker with room in --mem but a smaller --max-client-mem: the plan counts what this
    client may allocate there (DEVICE_INFO client_free_memory)."""
    ds = workers(256, extra=("--max-client-mem", "12"))
    try:
        with pytest.raises(DoesNotFit, match=r"12\.00 MiB free"):
            Coordinator([ds[0].endpoint], model=model, n_ctx=N_CTX, n_batch=N_BATCH)
        assert bytes_in(ds[0].metrics_port) < 64 << 10
    finally:
        stop(ds)


# ---------------------------------------------------------------- the plan itself (pure)
def per_layer(size: int, first: int = 0, last: int = 0):
    """need(): `size` bytes per layer, plus `first`/`last` on the first/last stage."""
    return lambda i, r, h: size * len(r) + (first if r.start == 0 else 0) + (last if r.stop == N_LAYER else 0)


def test_proportional_split_is_kept_when_it_fits():
    layers, heads = fit_split(["a", "b"], [100, 300], N_LAYER, 1000, [100, 300], True, False, per_layer(10))
    assert layers == [range(0, 2), range(2, 8)] and heads == [range(0, 250), range(250, 1000)]


def test_layers_move_off_a_worker_the_ends_overfill():
    """A 1:1 split gives 4:4 layers, but the last stage's head (40) does not fit beside 4
    layers in 50: filling in order gives the first worker 7 layers and the last one."""
    layers, _ = fit_split(["a", "b"], [70, 50], N_LAYER, 10, [1, 1], False, False, per_layer(10, last=40))
    assert layers == [range(0, 7), range(7, 8)]


def test_a_given_split_that_does_not_fit_is_refused_not_changed():
    with pytest.raises(DoesNotFit, match=r"split as given.*b: layers 4-7 need 80 B, 50 B free \(30 B short\)"):
        fit_split(["a", "b"], [50, 50], N_LAYER, 10, [1, 1], False, True, per_layer(10, last=40))


def test_in_process_endpoints_are_unbounded():
    layers, _ = fit_split(["local", "b"], [None, 25], N_LAYER, 10, [1, 1], False, False, per_layer(10))
    assert layers == [range(0, 7), range(7, 8)]
