"""What a decode step's two paths share (pipeline.py relays the activations,
step_links.py sends them worker to worker): a step with its inputs fixed,
the failure a step raises, a stage's inputs, and a stage's reply read back
and checked."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from coordinator.cluster.failures import StageFailed
from coordinator.decode.values import FailureKind
from coordinator.model.architectures.common import StepShape
from coordinator.model.stage import StageOutput


@dataclass
class PreparedStep:
    """One step (a micro-batch, or a whole batch) with the inputs fixed when its KV rows were assigned."""
    tokens: object  # the token ids (a sequence of int)
    rows: np.ndarray  # int64: the KV rows it writes
    pos: np.ndarray  # int64 positions
    seqs: np.ndarray  # uint64 sequence masks
    out_rows: np.ndarray  # int32: the rows the last stage returns (one dropped row if none is wanted)
    wanted: bool  # some row wants logits (else the KV rows are all it is for)
    head_in_shares: bool  # its head runs in shares at once, on `head_places` (else whole on the last stage, or not at all)
    shape: StepShape
    common: dict  # the inputs every stage takes: positions, kv_rows, masks
    mask: np.ndarray
    mask_swa: np.ndarray
    head_places: tuple = ()  # the places whose shares compute its head (HeadPlacement's "split" or "here")


class StepFailed(Exception):
    """`reported`: what the decode reports (a StageFailed, or any other
    exception: a bug of ours); `lost`: the failures of connections, to latch."""

    def __init__(self, reported: BaseException, lost: list[StageFailed]):
        super().__init__(str(reported))
        self.reported, self.lost = reported, lost


def read_output(p, data: bytes, shape: StepShape, head: bool = False) -> StageOutput:
    """Stage `p`'s reply taken apart, if it has the size its layout says."""
    expect = p.stage.output_size(shape, head)
    if len(data) != expect:
        raise StageFailed(FailureKind.COMPUTE, p.endpoint, f"compute failed on worker {p.endpoint}: it returned "
                                                 f"{len(data)} bytes, expected {expect}")
    return p.stage.read_output(data, shape, head)


def checked_tokens(tokens: np.ndarray, n_vocab: int, endpoint: str) -> np.ndarray:
    if ((tokens < 0) | (tokens >= n_vocab)).any():
        raise StageFailed(FailureKind.COMPUTE, endpoint,
                          f"compute failed on worker {endpoint}: argmax token id out of range")
    return tokens


def no_rows(shape, n_vocab: int) -> np.ndarray:
    """A step's result when no row wanted an output (its KV rows are written all the same)."""
    if shape.argmax > 1:
        return np.empty((0, shape.argmax), np.int32)
    return np.empty(0, np.int32) if shape.argmax else np.empty((0, n_vocab), np.float32)


def ranked(first: np.ndarray, ids: list, values: list, k: int) -> np.ndarray:
    """Each row's k best tokens, best first (i32 [rows, k]), from the shards' best_tokens (`ids`
    already in vocabulary numbering, and their `values`: lists of [rows, k_shard] arrays) and
    the row's argmax (`first`, argmax_first's, exact on ties), which leads. Among equal logits
    the lower id comes first, as far as the shards' top-k cuts let one see them."""
    ids, values = np.concatenate(ids, axis=1), np.concatenate(values, axis=1)
    order = np.lexsort((ids, -values), axis=1)
    out = np.empty((len(first), k), np.int32)
    for r, (lead, row) in enumerate(zip(first.tolist(), np.take_along_axis(ids, order, axis=1).tolist())):
        out[r] = ([lead] + [t for t in row if t != lead])[:k]
    return out


# Floats from which a step's logits are checked (and a head's shards put side by side) on a thread of
# their own, not on the event loop thread, whose other connections' I/O would wait for it: every row's
# logits of a 256-token step of a 262k vocabulary (268 MB) took 0.1-0.8 s there. Below it inline, as
# a generation's row (or a served batch's rows: fewer than 16 of Gemma 3's 262k) always were: 2.5 ms
# at most there (idle), and as long or longer through a thread, which adds its hand-offs and page faults.
OFF_LOOP = 1 << 22
FINITE_CHUNK = 1 << 20  # elements checked at once by `all_finite` (its temporary: this many bools)


def all_finite(a: np.ndarray) -> bool:
    """np.isfinite(a).all(), a large array in slices of its first axis of about FINITE_CHUNK elements:
    the same answer without a temporary the size of the array (67 MB for 268 MB of logits), and
    it stops at the first slice that is not finite."""
    if a.ndim == 0 or a.size < FINITE_CHUNK:
        return bool(np.isfinite(a).all())
    step = max(1, FINITE_CHUNK // (a.size // len(a)))
    return all(np.isfinite(a[i: i + step]).all() for i in range(0, len(a), step))


def checked_logits(logits: np.ndarray, endpoint: str) -> np.ndarray:
    if not all_finite(logits):
        raise StageFailed(FailureKind.COMPUTE, endpoint,
                          f"compute failed on worker {endpoint}: logits contain NaN or infinity")
    return logits


async def off_loop_from(floats: int, fn, *args):
    """fn(*args): inline below OFF_LOOP `floats`, else on a thread of its own (numpy releases the
    GIL while it reads them); the same result, or the same exception raised here."""
    if floats < OFF_LOOP:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def checked_logits_off_loop(logits: np.ndarray, endpoint: str) -> np.ndarray:
    """checked_logits, on a thread of its own from OFF_LOOP elements."""
    return await off_loop_from(logits.size, checked_logits, logits, endpoint)


def side_by_side(n_outputs: int, n_vocab: int, shards: list) -> np.ndarray:
    """The head shards' logits put side by side (f32[n_outputs, n_vocab]), each checked:
    `shards` (in the places' order) are (endpoint, its head rows, its logits, or the exception
    reading its reply raised, raised when its turn comes: the failure of the first shard that
    fails, as when each reply was read in turn). Touches no place: it may run on a thread."""
    logits = np.empty((n_outputs, n_vocab), dtype=np.float32)
    for endpoint, r, shard in shards:
        if isinstance(shard, BaseException):
            raise shard
        logits[:, r.start: r.stop] = checked_logits(shard, endpoint)
    return logits


def stage_inputs(p, common: dict, tokens, hidden, out_rows) -> dict:
    """Stage `p`'s graph inputs: the step's common ones, and the tokens (first
    stage) or the hidden state from the stage before, and the output rows (last)."""
    inputs = dict(common)
    if p.stage.first:
        inputs["tokens"] = p.stage.token_ids(tokens)
    else:
        inputs["hidden"] = hidden
    if p.stage.last:
        inputs["out_rows"] = out_rows
    return inputs


def step_failed(failures: list[BaseException]) -> StepFailed:
    """Several failures of one step as the one it reports, in the order given
    (micro-batch, then stage or endpoint): a bug of ours first, else the first
    lost connection (ENDPOINT_FAILED before COMPUTE_FAILED), else the first;
    every lost connection, to latch."""
    flat: list[BaseException] = []
    for exc in failures:
        flat.extend([exc.reported, *(e for e in exc.lost if e is not exc.reported)]
                    if isinstance(exc, StepFailed) else [exc])
    lost = [exc for exc in flat if isinstance(exc, StageFailed) and exc.lost_connection]
    bug = next((exc for exc in flat if not isinstance(exc, StageFailed)), None)
    return StepFailed(bug or (lost or flat)[0], lost)
