"""Timed single-token decode steps, the loop the decode benchmarks share."""
from __future__ import annotations

import argparse
import time
from typing import Callable

from coordinator import Batch, Coordinator
from coordinator.serving.benchmark import bench_model


def timed_steps(c: Coordinator, n: int, greedy: bool, warmup: int, prompt_len: int = 32,
                before_measuring: Callable[[], None] | None = None) -> list[float]:
    """From an empty KV cache: a `prompt_len`-token prompt, then `warmup` + `n`
    single-token steps, each fed the last token (greedy: the worker's argmax;
    else from the full logits); the seconds of each of the last `n` steps.
    `before_measuring` runs once, after the warm-up (graphs sent, allocators placed)."""
    return side_by_side_steps([c], n, greedy, warmup, prompt_len, before_measuring)[0]


def side_by_side_steps(coordinators: list[Coordinator], n: int, greedy: bool, warmup: int, prompt_len: int = 32,
                       before_measuring: Callable[[], None] | None = None) -> list[list[float]]:
    """timed_steps for several coordinators at once, taking turns step by step
    (so load from elsewhere on the machine hits them all alike): each one's
    seconds of its last `n` steps."""
    toks = []
    for c in coordinators:
        c.kv_clear()
        if c.decode(Batch.single(list(range(10, 10 + prompt_len)), 0), greedy=greedy) != 0:
            raise SystemExit(f"prompt decode failed: {c.last_error}")
        toks.append(c.token(-1))
    times: list[list[float]] = [[] for _ in coordinators]
    for i in range(warmup + n):
        if i == warmup and before_measuring is not None:
            before_measuring()
        for k, c in enumerate(coordinators):
            t = time.perf_counter()
            if c.decode(Batch.single([toks[k]], prompt_len + i), greedy=greedy) != 0:
                raise SystemExit(f"decode failed: {c.last_error}")
            times[k].append(time.perf_counter() - t)
            toks[k] = c.token(-1)
    return [t[warmup:] for t in times]


def add_model_flags(ap: argparse.ArgumentParser) -> None:
    """--model PATH and --model-1b, the decode benchmarks' choice of model."""
    ap.add_argument("--model", default=None, help="GGUF path (default: the bundled gemma3-270m)")
    ap.add_argument("--model-1b", action="store_true", help="the 1B-class bench model")


def chosen_model(ap: argparse.ArgumentParser, args) -> str | None:
    """The GGUF add_model_flags' flags name (None: the bundled model); a parser error when the
    1B-class model is asked for and not built (`python bench/bench_models.py build`)."""
    if not args.model_1b:
        return args.model
    if args.model is not None:
        ap.error("--model and --model-1b name two models: give one")
    model, why = bench_model("1b")
    if model is None:
        ap.error(why)
    return model
