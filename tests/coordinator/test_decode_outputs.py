"""OK means readable (docs/failure-semantics.md, rule 5): the outputs of a decode
that returned OK stay readable until the caller's next decode, whatever latches
in between; a failed decode leaves none. Real daemons on 127.0.0.1, a real
SIGKILL; the latch is made to land between decode() and token() by waiting
for it, not by timing."""
from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import SLACK
from coordinator import Batch, Coordinator, DecodeResult

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)


def wait_latched(c: Coordinator, endpoint: str, bound: float) -> None:
    """The coordinator notices the dead worker while idle (its connection's
    failure callback latches it); `bound` seconds at most, times SLACK."""
    deadline = time.monotonic() + bound * SLACK
    while not any(f.endpoint == endpoint for f in c.failed_endpoints()):
        assert time.monotonic() < deadline, f"{endpoint} was not latched within {bound * SLACK} s"
        time.sleep(0.01)


def test_an_ok_decodes_outputs_survive_a_latch_that_lands_before_they_are_read(tiny_model, start_daemon):
    a, b = start_daemon("-t", "1"), start_daemon("-t", "1")
    with Coordinator([a.endpoint, b.endpoint], model=tiny_model, n_ctx=64) as c:
        ids = list(range(1, 9))
        assert c.decode(Batch.single(ids, 0, all_logits=True)) is DecodeResult.OK
        expected_logits = np.array(c.logits(-1))
        expected_token = c.token(-1)
        b.kill()
        wait_latched(c, b.endpoint, 2.0)  # the latch lands here, between decode() and reading its outputs
        assert c.health()["status"] != "ok"
        assert c.token(-1) == expected_token
        np.testing.assert_array_equal(c.logits(-1), expected_logits)
        assert c.logits(0).shape == expected_logits.shape  # every row it asked for, not just the last
        # the caller's next decode fails and leaves nothing to read
        assert c.decode(Batch.single([3], len(ids))) is DecodeResult.ENDPOINT_FAILED
        try:
            c.token(-1)
        except RuntimeError as exc:
            assert "did not return OK" in str(exc)
        else:
            raise AssertionError("a failed decode left outputs readable")
