"""A layer split over a current worker and one from before a HELLO feature (the test
entry point's --test-older, which refuses what such a daemon refused): the older one
must get graphs without the feature, and every logit must be in process's."""
from __future__ import annotations

import numpy as np

from coordinator.api import Coordinator


def assert_an_older_worker_changes_no_logit(model: str, feature: str, start_daemon, logits_of) -> None:
    """Both orders of a current and an older worker, and two current ones: `logits_of(c)`
    equals in process's bit for bit, and only the current workers offer `feature`."""
    with Coordinator(["local"], model=model, n_ctx=64) as c:
        want = logits_of(c)
    current, older = start_daemon("-t", "1"), start_daemon("-t", "1", "--test-older", feature)
    for pair in ((current, older), (older, current), (current, current)):
        with Coordinator([d.endpoint for d in pair], model=model, n_ctx=64, split_mode="layer") as c:
            assert len(c._places) == 2
            offered = [feature in p.executor.client.server_hello.get("features", ()) for p in c._places]
            assert offered == [d is current for d in pair], offered
            got = logits_of(c)
        assert np.array_equal(got, want), np.abs(got - want).max()
