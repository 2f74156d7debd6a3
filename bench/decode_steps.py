"""Timed single-token decode steps, the loop the decode benchmarks share."""
from __future__ import annotations

import time
from typing import Callable

from coordinator import Batch, Coordinator


def timed_steps(c: Coordinator, n: int, greedy: bool, warmup: int, prompt_len: int = 32,
                before_measuring: Callable[[], None] | None = None) -> list[float]:
    """From an empty KV cache: a `prompt_len`-token prompt, then `warmup` + `n`
    single-token steps, each fed the last token (greedy: the worker's argmax;
    else from the full logits); the seconds of each of the last `n` steps.
    `before_measuring` runs once, after the warm-up (graphs sent, allocators placed)."""
    c.kv_clear()
    if c.decode(Batch.single(list(range(10, 10 + prompt_len)), 0), greedy=greedy) != 0:
        raise SystemExit(f"prompt decode failed: {c.last_error}")
    tok, pos, out = c.token(-1), prompt_len, []
    for i in range(warmup + n):
        if i == warmup and before_measuring is not None:
            before_measuring()
        t = time.perf_counter()
        if c.decode(Batch.single([tok], pos), greedy=greedy) != 0:
            raise SystemExit(f"decode failed: {c.last_error}")
        out.append(time.perf_counter() - t)
        tok, pos = c.token(-1), pos + 1
    return out[warmup:]
