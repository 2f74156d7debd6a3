"""coordinator/config.py: the configuration checks made before the model is
read or anything is connected (is_int, checked_setup). Pure: no sockets, no
daemons."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.config import checked_setup, is_int


@pytest.mark.parametrize("x", [0, -3, 2**70, np.int8(1), np.int64(-1), np.uint64(5)])
def test_is_int(x):
    assert is_int(x)


@pytest.mark.parametrize("x", [True, False, np.bool_(True), 1.0, np.float32(1), "1", None, [1], 1j])
def test_is_int_refuses(x):
    assert not is_int(x)


def refused(endpoints=("127.0.0.1:50052",), split=None, n_batch=512, threads=1) -> str:
    with pytest.raises(ValueError) as info:
        checked_setup(endpoints, split, n_batch, threads)
    return str(info.value)


# ---------------------------------------------------------------- accepted

def test_a_good_setup_comes_back_as_lists():
    endpoints, split = checked_setup(("10.0.0.2:50052", "local", "[::1]:1"), (1, 2.5, np.float32(0.5)), 1, 4)
    assert endpoints == ["10.0.0.2:50052", "local", "[::1]:1"] and split == [1, 2.5, np.float32(0.5)]
    assert type(endpoints) is list and type(split) is list
    assert checked_setup(["local"], None, np.int64(8), 1) == (["local"], None)
    assert checked_setup(iter(["h:65535"]), [np.int32(3)], 1, 1) == (["h:65535"], [3])


# ---------------------------------------------------------------- endpoints

def test_endpoints_as_one_string():
    assert refused("127.0.0.1:50052") == ("endpoints must be a list of 'host:port' strings (or ['local']), not the "
                                          "string '127.0.0.1:50052'")


def test_no_endpoint():
    assert refused([]) == "at least one endpoint is required"


@pytest.mark.parametrize("endpoint, message", [
    ("127.0.0.1", "endpoint '127.0.0.1' must be host:port (no scheme or path), e.g. 10.0.0.2:50052"),
    ("http://h:80", "endpoint 'http://h:80' must be host:port (no scheme or path), e.g. 10.0.0.2:50052"),
    (":50052", "endpoint ':50052' must be host:port (no scheme or path), e.g. 10.0.0.2:50052"),
    ("h:port", "endpoint 'h:port' must be host:port (no scheme or path), e.g. 10.0.0.2:50052"),
    ("h:0", "endpoint 'h:0': port 0 is not in 1..65535"),
    ("h:65536", "endpoint 'h:65536': port 65536 is not in 1..65535"),
    (50052, "endpoint 50052 must be a 'host:port' string"),
    ("Local", "endpoint 'Local' must be host:port (no scheme or path), e.g. 10.0.0.2:50052"),
])
def test_a_bad_endpoint(endpoint, message):
    assert refused(["local", endpoint]) == message


# ---------------------------------------------------------------- split

def test_a_split_of_the_wrong_length():
    assert refused(["a:1", "b:2"], [1]) == "split has 1 proportions for 2 endpoints"
    assert refused(["a:1"], [1, 1, 1]) == "split has 3 proportions for 1 endpoints"


@pytest.mark.parametrize("split", [[1, 0], [1, -1], [1, float("nan")], [1, float("inf")], [1, True], [1, "1"],
                                   [1, None], [np.float64("nan"), 1]], ids=repr)
def test_split_proportions_must_be_positive_finite_numbers(split):
    assert refused(["a:1", "b:2"], split) == (
        f"split proportions must be positive numbers (every endpoint holds at least one layer): {split}")


# ---------------------------------------------------------------- n_batch and threads

@pytest.mark.parametrize("name", ["n_batch", "threads"])
@pytest.mark.parametrize("value", [0, -1, 1.0, True, "8", None])
def test_n_batch_and_threads_are_positive_integers(name, value):
    kw = {"n_batch": 512, "threads": 1, name: value}
    assert refused(**kw) == f"{name} must be a positive integer, not {value!r}"


def test_endpoints_are_checked_before_the_split_and_the_numbers():
    assert refused([], [0], 0, 0) == "at least one endpoint is required"
    assert refused(["a:1"], [0], 0, 0).startswith("split proportions must be positive numbers")
    assert refused(["a:1"], None, 0, 0) == "n_batch must be a positive integer, not 0"


def test_an_unknown_coordinator_option_is_a_type_error_naming_it_and_the_options():
    from coordinator.config import CoordinatorConfig
    with pytest.raises(TypeError) as info:
        CoordinatorConfig.of(["local"], None, {"n_ctx": 64, "bogus": 1, "head_splt": True})
    message = str(info.value)
    assert message.startswith("Coordinator has no option 'bogus', 'head_splt'; its options are split, n_ctx")
    assert "head_split" in message and "step_links" in message


def test_a_checked_configuration_has_lists_and_an_integer_context():
    from coordinator.config import CoordinatorConfig
    config = CoordinatorConfig.of(("127.0.0.1:1", "127.0.0.1:2"), None, {"split": (1, 3), "n_ctx": 256.0})
    assert config.endpoints == ["127.0.0.1:1", "127.0.0.1:2"] and config.split == [1, 3]
    assert config.n_ctx == 256 and isinstance(config.n_ctx, int)
    with pytest.raises(ValueError, match="n_ctx must be at least 1"):
        CoordinatorConfig.of(["local"], None, {"n_ctx": 0})
