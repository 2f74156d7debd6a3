"""The coordinator's configuration and its checks, before the model is read or anything is connected."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Callable, Sequence

import numpy as np

from coordinator.decode.microbatch import DEFAULT_MICRO_BATCH
from rpc_daemon.client import parse_endpoint


def is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def checked_setup(endpoints, split, n_batch, threads) -> tuple[list[str], list[float] | None]:
    """Refuse a bad configuration before the model is read or anything is connected."""
    if isinstance(endpoints, str):
        raise ValueError(f"endpoints must be a list of 'host:port' strings (or ['local']), not the string "
                         f"{endpoints!r}")
    endpoints = list(endpoints)
    if not endpoints:
        raise ValueError("at least one endpoint is required")
    for e in endpoints:
        if e != "local":
            parse_endpoint(e)
    if split is not None:
        split = list(split)
        if len(split) != len(endpoints):
            raise ValueError(f"split has {len(split)} proportions for {len(endpoints)} endpoints")
        if not all((is_int(w) or isinstance(w, (float, np.floating))) and math.isfinite(w) and w > 0
                   for w in split):
            raise ValueError(f"split proportions must be positive numbers (every endpoint holds at least one "
                             f"layer): {split}")
    for name, value in (("n_batch", n_batch), ("threads", threads)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return endpoints, split


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything a Coordinator is built from (Coordinator(**fields) takes the same names).

    `model`: a GGUF path; None: the bundled Gemma 3 270M, from the `model`
    extra (without it: FileNotFoundError, before anything is started).

    Fault handling: `connect_timeout` bounds connecting plus HELLO;
    `liveness_timeout` is the detection bound for a stopped, hung or cut-off
    worker while a request is outstanding (None disables the liveness pings:
    for measurements only); `request_timeout` bounds any single request even
    from a worker that keeps answering pings. `auto_reconnect` reconnects a
    failed endpoint in the background, waiting `reconnect_backoff[0]` seconds
    before the first attempt and doubling up to `reconnect_backoff[1]`.

    Security (docs/security.md): `secret` or `secret_file` (else systemd's
    credential $CREDENTIALS_DIRECTORY/rpc-secret, else the environment
    variable GGML_RPC_SECRET) is the workers' shared secret, proven in both
    directions at HELLO; `tls_ca` (a PEM CA bundle) turns on TLS and verifies
    each worker's certificate against it.

    `head_split` (with several endpoints) is where the output head runs, one
    of coordinator/decode/head_placement.py's modes: True ("split"): every
    endpoint computes a share of the head's vocabulary rows, in the split's
    proportions, all at once after the last layer; faster when the head is a
    large part of a step, but one more network hop. False ("whole"): the last
    endpoint computes all of it. "here": the last endpoint computes its share
    and this process the rest of the rows (from the normed rows the last stage
    replies with: the split's compute at the whole head's hops; this process
    holds those rows and computes them with `threads` threads). "auto" (the
    default): every endpoint holds its share, and the last one the whole head
    too where the round trips measured before the upload say a step could take
    it whole (and it has the memory), and then this process the rows besides
    the last one's share; each step takes the fastest by the measured round
    trips and head compute times. Same logits whichever runs.

    `micro_batch` (tokens; with several endpoints): a batch is cut into
    micro-batches that follow each other through the stages, so every worker
    computes at once (coordinator/decode/microbatch.py): a prompt longer than
    this in chunks of at most this many tokens, a batch of several sequences
    in about as many groups as there are endpoints (of at least micro_batch / 2
    tokens each). The logits are those of decoding the same micro-batches one
    after another. 0 turns it off: every batch is one step, the stages one
    after another.

    `step_links` (with several remote endpoints that offer them): a step's
    hidden state goes from worker to worker, and the last stage's normed state
    straight to the head shards, instead of back through the coordinator
    between stages (docs/protocol.md, "Step links"). Same logits; fewer network
    hops per token. False: always relayed.

    `step_channels` (tensor split, workers that grant one): a member's steps go
    straight to its worker's compute process over a second connection, not
    through its daemon (docs/protocol.md, "Step channels"). Same logits, the
    same failure reports; 1-2 ms less a token on a busy machine. False: always
    through the daemon (e.g. where the coordinator cannot reach the workers'
    ephemeral ports).

    `split_mode` (llama.cpp's name): "layer" (the default): each endpoint holds a
    contiguous range of layers, the stages one after another. "tensor": every
    endpoint (a worker that offers tensor links: not `local`, not over TLS)
    holds a shard of every layer (attention by heads, FFN by rows, in the
    split's proportions) and all compute every token together, summing their
    partial results worker to worker twice a layer (docs/architecture.md,
    "Tensor parallelism"); refused with a ValueError saying why where it
    cannot be. "auto": tensor where it can be and the round trips measured at
    connect say a token's exchanges cost less than the compute the split
    saves, else layer. Logits differ from the layer split's by the order of
    summation only with split sums (with exact sums, the default where they can
    be, not at all).

    `tensor_group` (with a tensor split): the workers of one tensor-parallel
    group; the endpoints, in order, form groups of that many, the groups hold
    consecutive ranges of layers (in proportion to their members' split) and
    run one after another (a pipeline of tensor-parallel groups: for more
    workers than one group should hold, or groups far apart). None (the
    default): every endpoint in one group. At least 2, and it must divide the
    number of endpoints.

    `exact_sums` (with a tensor split): None (the default): exact sums where
    the model and every worker allow them, else split sums, with the reason in
    `health()["split_choice"]` ("sums", "sums_reason"). Exact sums: no member
    sums part of a product's reduction; each computes its rows of the output
    projections over their whole inputs, gathered from the members: logits
    bit-equal to one process's, for two more exchanges a layer (4 instead of
    2). Not for mixture-of-experts models, nor workers from before PAD. True
    insists on them (a tensor split that cannot have them is refused, naming
    why); False: split sums, the partial results all-reduced (fewer exchanges;
    logits differ from one process's in the last bits).

    `cache_type_k`, `cache_type_v` (llama.cpp's -ctk/-ctv): the KV cache's K
    and V types on the workers: "f16" (the default), "q8_0" (about half the
    memory per token) or "q4_0" (about a quarter); rows are quantized as they
    are written, and attention reads them so (docs/architecture.md, "KV cache").

    `on_upload(done, total)` (bytes of weights) is called when the upload
    starts and after every chunk, from the coordinator's I/O thread: the server
    uses it to keep systemd's start timeout from expiring while a big model
    uploads (rpc_daemon/service/systemd.py, StartTimeoutExtender).

    Resuming (docs/failure-semantics.md, "Resuming"): with `resume_within`
    (seconds) set, generate/stream/astream (and decode_resuming) pause instead
    of failing when a worker is lost: the endpoint is reconnected automatically
    (backoff 0.01 s doubling to 0.02 s unless `reconnect_backoff` says
    otherwise) or, once it has been down for a while (`spare_after` seconds;
    default min(1 s, resume_within / 4)), its stage moves to one of `spares`
    (host:port workers), and back to its own endpoint once that is back; the
    KV cache is rebuilt by replaying the steps exactly as first decoded, and
    the step is retried: the same text as without the failure. Not back within
    `resume_within`: the original error.

    `warmup`: after loading, decode one token at position 0 twice (the argmax's
    step, then the full logits': a generation's two kinds of one-token step),
    the cache cleared after each, so the first request does not pay the
    workers' first computes: those steps' graphs sent, validated, built and
    placed (one-token steps over the first 256 cells; longer contexts, other
    batch sizes and greedy=k steps still pay on their first use), and each
    compute process's first pass over its weights (0.2-0.45 s on gemma3-270m
    over 2 workers). What llama.cpp's tools do unless --no-warmup; off here, as
    in its library, on in `ggml-coordinator generate` and `serve`. Its steps
    count nowhere (stats, the head placement's steps, logits()); a failed one
    is logged and leaves its endpoint latched, as any decode's failure does,
    and the start goes on."""
    endpoints: Sequence[str] = ("local",)
    model: str | None = None
    split: Sequence[float] | None = None
    n_ctx: int = 2048
    n_batch: int = 512
    threads: int = 1
    connect_timeout: float = 5.0
    liveness_timeout: float | None = 2.0
    use_cache: bool = True
    progress: bool = False
    request_timeout: float | None = 900.0
    auto_reconnect: bool = False
    reconnect_backoff: tuple[float, float] | None = None
    secret: str | bytes | None = None
    secret_file: str | None = None
    tls_ca: str | None = None
    head_split: bool | str = "auto"
    on_upload: Callable[[int, int], None] | None = None
    resume_within: float | None = None
    spares: Sequence[str] = ()
    spare_after: float | None = None
    micro_batch: int = DEFAULT_MICRO_BATCH
    step_links: bool = True
    step_channels: bool = True
    split_mode: str = "layer"
    tensor_group: int | None = None
    exact_sums: bool | None = None
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    warmup: bool = False

    @classmethod
    def of(cls, endpoints, model, options: dict) -> "CoordinatorConfig":
        """Coordinator(endpoints, model, **options) as a checked configuration: an
        unknown option is a TypeError naming it, a bad value a ValueError."""
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"Coordinator has no option {', '.join(map(repr, unknown))}; its options are "
                            f"{', '.join(f.name for f in fields(cls) if f.name not in ('endpoints', 'model'))}")
        return cls(endpoints, model, **options).checked()

    def checked(self) -> "CoordinatorConfig":
        """This configuration with its endpoints and split as lists, or ValueError
        naming what is wrong; nothing is read or connected."""
        endpoints, split = checked_setup(self.endpoints, self.split, self.n_batch, self.threads)
        spares = checked_setup(list(self.spares), None, self.n_batch, self.threads)[0] if self.spares else []
        n_ctx = int(self.n_ctx)
        if n_ctx < 1:
            raise ValueError("n_ctx must be at least 1")
        for name, kind in (("cache_type_k", self.cache_type_k), ("cache_type_v", self.cache_type_v)):
            if kind not in ("f16", "q8_0", "q4_0"):
                raise ValueError(f"{name} must be 'f16', 'q8_0' or 'q4_0', not {kind!r}")
        if self.split_mode not in ("layer", "tensor", "auto"):
            raise ValueError(f"split_mode must be 'layer', 'tensor' or 'auto', not {self.split_mode!r}")
        if self.tensor_group is not None:
            size = self.tensor_group
            if isinstance(size, bool) or not isinstance(size, int) or size < 2:
                raise ValueError(f"tensor_group must be a number of workers, at least 2, not {size!r}")
            if len(endpoints) % size:
                raise ValueError(f"tensor_group={size}: {len(endpoints)} endpoints do not form groups of {size}")
            if self.split_mode == "layer":
                raise ValueError("tensor_group needs split_mode='tensor' or 'auto' (the layer split has no groups)")
        if self.exact_sums is not None and not isinstance(self.exact_sums, bool):
            raise ValueError(f"exact_sums must be None, True or False, not {self.exact_sums!r}")
        if self.exact_sums and self.split_mode == "layer":
            raise ValueError("exact_sums needs split_mode='tensor' or 'auto' (the layer split sums nothing apart)")
        return replace(self, endpoints=endpoints, split=split, spares=spares, n_ctx=n_ctx)
