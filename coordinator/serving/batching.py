"""Continuous batching: N slots share every decode step.

Each slot is one request with its own sequence id in the shared KV cache. A
loop builds a batch from every active slot of its group (the last sampled
token) and decodes it once, so N clients cost one step each instead of N. A new
prompt is decoded in steps of its own, in the chunks it would be decoded in
alone (`step_slots`). With pipelining (the coordinator's micro_batch, and
several workers) there is one group, and one loop, per worker: each new slot
joins the group with the fewest, and the groups' steps are in flight at once,
so worker A computes one group's step while worker B computes another's
(coordinator/decode/gate.py). A failed step ends every slot that was in it
with the error; no token from that step reaches anybody.

The prompt cache: a slot that ends keeps its KV rows, and the scheduler
remembers the tokens they hold. A new request takes the free slot whose
rows share the longest prefix with its prompt (ties: the least recently
used; `choose_slot`), removes that slot's rows past the common prefix
(kv_seq_rm) and decodes only the rest of its prompt, at least its last
token (its logits are sampled). Nothing moves on the workers: the rows stay
where they are, and the KV journal keeps the steps they depend on (they are
live rows), so a resume rebuilds them too.

Context shift (llama-server's --context-shift; Scheduler(context_shift=True)): a
slot whose next token would not fit its context (pos + 1 >= n_ctx_slot, where
it would otherwise end with "length") keeps its first n_keep tokens, drops the
n_discard = (pos - n_keep) // 2 after them, and goes on generating
(`shift_span`, llama-server's arithmetic). It is done by re-evaluation, not by
rotating cached keys: the sequence's rows from n_keep on are removed
(kv_seq_rm) and the kept remainder, with the token just sampled, is decoded
again at its new positions behind the first n_keep rows, in a step of its own
as a prompt is (`step_slots`). The positions are llama-server's; the keys are
fresh, as a fresh decode of the kept history computes them. The journal needs
nothing new: the removed rows are dead, the re-decoded ones are recorded as
any step's, so a resume rebuilds them too.

Embeddings (`embed`) take free slots too, but not through the loop: each
input is decoded on a sequence of its own in steps of their own
(Coordinator.aembed, one whole step between the loop's), several inputs in
one step while they fit in n_batch tokens. The sequence's rows are removed as
soon as its input is done, and it goes back with no prompt cache: a later
request never reuses an embedding's rows.
"""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import structlog

from coordinator.decode.values import Batch, DecodeResult
from coordinator.decode.kv_cells import MAX_SEQ
from coordinator.text.sampling import Sampler, TokenLogprob, token_logprobs
from coordinator.text.stream import TextStream

log = structlog.get_logger("batching")

# Slot groups pay where the layers are most of what a token reads: one group's layers on worker A while the other's
# run on B. The output head runs on every worker at once (split) or on the last, so a head-heavy model's groups wait
# for each other there. Measured over 2 workers on loopback, 4 streams on 2 slots: a 1.1B llama (head 8 % of the
# weights a token reads) 18.0 tokens/s in groups against 14.6 in one batch; gemma3-270m (its 262k-row head 72 %)
# 41 against 55, and 65 against 82 with 8 streams on 4 slots. Half is between the two, not a measured crossover.
SLOT_GROUPS_HEAD_SHARE = 0.5
BEST_FOR_BANS = 8  # best tokens per row a step asks for when a sampler bans tokens (ignore_eos: gemma3 bans 2)
PROMPT_LOGPROBS_CHUNK = 64  # a prompt whose logprobs are asked is fed in steps of at most this many rows of logits


class ShuttingDown(Exception):
    """The server is stopping: no slot for a new request."""


class QueueFull(Exception):
    """Every slot is busy and max_queue requests already wait for one."""

    def __init__(self, waiting: int):
        super().__init__(f"{waiting} requests wait for a slot")
        self.waiting = waiting


class EmbeddingFailed(Exception):
    """An embedding step did not return OK: its DecodeOutcome's code, error and endpoint."""

    def __init__(self, code: DecodeResult, message: str, endpoint: str | None = None):
        super().__init__(message)
        self.code, self.message, self.endpoint = code, message, endpoint


@dataclass
class SlotEvent:
    kind: str  # "text", "done", "error"
    text: str = ""
    finish_reason: str | None = None
    code: DecodeResult | None = None
    message: str = ""
    endpoint: str | None = None
    # "text"/"done": the logprobs of the tokens sampled since the last event; "prompt": the prompt's
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Slot:
    seq: int
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    text: TextStream
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: list[int] = field(default_factory=list)  # tokens still to feed
    pos: int = 0
    fed: int = 0  # tokens of `pending` in the step being decoded
    generated: int = 0
    cancelled: bool = False
    group: int = 0  # the loop that steps it
    logprobs: int | None = None  # alternatives per sampled token's logprob; None: no logprobs
    echo: bool = False  # a "prompt" event once the prompt is decoded (with its logprobs if asked)
    leader: "Slot | None" = None  # another choice of the same request whose prompt KV rows this one will share
    prompt_lp: list[TokenLogprob] | None = None  # the prompt's logprobs (echo with logprobs), as they are decoded
    pending_lp: list[TokenLogprob] = field(default_factory=list)  # sampled tokens' logprobs not yet in an event
    first_token_at: float | None = None
    finished_at: float | None = None
    started_at: float = field(default_factory=time.monotonic)
    cache_prompt: bool = True  # reuse the rows of the prompt's prefix the slot's KV cache already holds
    cached: int = 0  # prompt tokens whose KV rows were reused, not decoded (usage.prompt_tokens_details)
    kv: list[int] | None = None  # the tokens its sequence's KV rows hold (positions 0..); None: not set up yet
    request_id: str | None = None  # the HTTP request's id (X-Request-Id), shown by /slots
    n_keep: int = 0  # a context shift keeps this many tokens of the prompt (-1: all of it; plus BOS)
    shifts: int = 0  # context shifts done


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` share from the start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def choose_slot(prompt: Sequence[int], free: Mapping[int, float], cached: Mapping[int, Sequence[int]]) -> int:
    """The free sequence for `prompt`: the one whose cached tokens share the longest prefix with it;
    among equals the least recently used. `free`: sequence -> when it was freed; `cached`: sequence ->
    the tokens its KV rows hold. An empty `prompt` (no cache wanted): the least recently used."""
    return max(free, key=lambda seq: (common_prefix(cached.get(seq, ()), prompt), -free[seq], -seq))


def reusable(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """The tokens of `prompt` whose KV rows can be kept: the common prefix, but never the whole prompt
    (its last token is decoded again, for logits to sample from)."""
    return min(common_prefix(cached, prompt), len(prompt) - 1)


def shift_span(n_tokens: int, n_prompt: int, n_keep: int, add_bos: bool, n_ctx: int) -> tuple[int, int]:
    """llama-server's context shift (server-context.cpp, pre_decode): of a slot's `n_tokens` cached
    tokens, keep the first n_keep (the request's; -1: the whole prompt of `n_prompt`; one more for the
    BOS the model adds, as llama-server counts it; at most n_ctx - 4) and discard the next n_discard,
    half of the rest (at most all of it but one). Returns (n_keep, n_discard)."""
    keep = n_prompt if n_keep < 0 else n_keep
    if add_bos:
        keep += 1
    keep = max(0, min(n_ctx - 4, keep))
    n_left = n_tokens - keep
    return keep, min(max(n_left // 2, 0), max(0, n_left - 1))


def feeding(slot: Slot) -> bool:
    """It decodes more than its last sampled token next: its prompt, or what a context shift keeps."""
    return slot.first_token_at is None or len(slot.pending) > 1


def step_slots(slots: list[Slot]) -> list[Slot]:
    """The slots the next step decodes: the first one still feeding its prompt (or the tokens a
    context shift decodes again), alone, else all.
    A step's token count picks ggml's kernels (docs/architecture.md, "Kernels and what a result
    depends on"): a prompt in a step of its own gets the same bits as the request alone, and so
    does a sampled token in a step of up to 7 (the per-row classes 1-7, 8-63, 64+)."""
    for slot in slots:
        if feeding(slot):
            return [slot]
    return slots


class Scheduler:
    def __init__(self, coord, n_slots: int, n_ctx_slot: int, metrics=None, max_queue: int | None = None,
                 context_shift: bool = False):
        if not 1 <= n_slots <= MAX_SEQ:  # a slot is a KV sequence id
            raise ValueError(f"the number of slots must be in 1..{MAX_SEQ}, not {n_slots}")
        self.coord = coord
        self.n_slots = n_slots
        self.n_ctx_slot = n_ctx_slot
        self.metrics = metrics
        self.max_queue = max_queue  # requests allowed to wait for a slot; None: any number
        self.context_shift = context_shift  # a slot at the end of its context shifts it (else: "length")
        self.waiting = 0
        self.free: dict[int, float] = {seq: 0.0 for seq in range(n_slots)}  # free sequence -> when it was freed
        self.cache: dict[int, list[int]] = {}  # sequence -> the tokens its KV rows hold (positions 0..)
        self._waiters: collections.deque = collections.deque()  # (prompt, future of a sequence), first come first
        self.active: list[Slot] = []
        # one group of slots per stage when steps are pipelined (and the output head is not most of a token's
        # weights: SLOT_GROUPS_HEAD_SHARE), each stepped by its own loop
        pipelined = getattr(coord, "pipelined", False) and getattr(coord, "head_share", 0.0) < SLOT_GROUPS_HEAD_SHARE
        self.n_groups = max(1, min(n_slots, coord.pipeline_stages)) if pipelined else 1
        self._wake = [asyncio.Event() for _ in range(self.n_groups)]
        self._tasks: list[asyncio.Task] = []
        self._started: dict[int, float] = {}  # group -> when its step in flight started
        self.closing = False
        self.last_step_end = time.monotonic()
        self.generated = 0  # tokens sampled for any request, ever (the cluster view's tokens/s)

    @property
    def decode_started(self) -> float | None:
        """When the oldest step in flight started; None if none is."""
        return min(self._started.values(), default=None)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(g)) for g in range(self.n_groups)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def drain(self, message: str) -> None:
        """Shutting down: no new requests; the decode loop stops (a step in
        flight is cancelled and rolled back); every request in flight ends with
        an ABORTED error event carrying `message`, so its client gets a
        complete answer instead of a cut connection."""
        self.closing = True
        await self.stop()
        for slot in list(self.active):
            slot.events.put_nowait(SlotEvent("error", code=DecodeResult.ABORTED, message=message))
            self._release(slot, keep=False)

    @property
    def alive(self) -> bool:
        return bool(self._tasks) and not any(task.done() for task in self._tasks)

    @property
    def busy(self) -> int:
        return len(self.active)

    async def submit(self, prompt: list[int], max_tokens: int, sampler: Sampler, stop: Sequence[str], *,
                     logprobs: int | None = None, echo: bool = False, share_from: Slot | None = None,
                     cache_prompt: bool = True, request_id: str | None = None, n_keep: int = 0) -> Slot:
        """A slot for this request, once one is free; ShuttingDown if the
        server stops first; QueueFull at once if it would have to wait
        behind max_queue others. `logprobs`: alternatives per token (None: no
        logprobs); `echo`: a "prompt" event once the prompt is decoded, with its
        logprobs if asked. `share_from`: another choice of the same prompt; if it
        is still feeding the prompt, this slot waits and shares its KV rows
        (kv_seq_cp) and last logits instead of decoding the prompt again.
        `cache_prompt`: reuse the KV rows of the longest prefix of the prompt a
        free slot holds (the slot is chosen for it); without, the prompt is
        decoded whole. `request_id`: the request's id, for /slots. `n_keep`: the tokens a context
        shift keeps (shift_span; only with context_shift)."""
        seq = await self._queue_for(prompt if cache_prompt else [])
        sizes = [sum(s.group == g for s in self.active) for g in range(self.n_groups)]
        slot = Slot(seq, prompt, max_tokens, sampler, TextStream(self.coord.tokenizer, tuple(stop)),
                    pending=list(prompt), group=sizes.index(min(sizes)), logprobs=logprobs, echo=echo,
                    cache_prompt=cache_prompt, request_id=request_id, n_keep=n_keep)
        sampler.accept(prompt)  # the penalties look back at the prompt too, as llama-server's
        if echo and logprobs is not None:
            slot.prompt_lp = [TokenLogprob(prompt[0], None)]  # nothing predicts the first token
        if share_from is not None and share_from in self.active and share_from.first_token_at is None \
                and share_from.prompt == slot.prompt:
            slot.leader = share_from
        self.active.append(slot)
        self._wake[slot.group].set()
        return slot

    async def _queue_for(self, prompt: list[int]) -> int:
        """A free sequence (_take), waited for as a request waits: ShuttingDown, QueueFull."""
        if self.closing:
            raise ShuttingDown()
        if not self.free and self.max_queue is not None and self.waiting >= self.max_queue:
            raise QueueFull(self.waiting)
        self.waiting += 1
        try:
            seq = await self._take(prompt)
        finally:
            self.waiting -= 1
        if self.closing:
            self._give_back(seq)
            raise ShuttingDown()
        return seq

    async def embed(self, inputs: Sequence[Sequence[int]],
                    wanted: Callable[[int], list[bool]]) -> list[np.ndarray]:
        """Each input's rows of the final normed hidden state that `wanted(n_tokens)` selects
        ([k, n_embd], in position order), in the inputs' order. On free slots: one, waited for as a
        request waits (ShuttingDown, QueueFull), and more if they are free at once, up to one per
        input (the least recently used: their prompt caches are worth least). The inputs on them
        share steps of up to n_batch tokens; an input longer than that is fed in chunks. A slot's
        cached rows are removed before, its input's rows as soon as it is done: its sequence goes
        back with no prompt cache. EmbeddingFailed if a step fails. Cancelled (the client went
        away), the step in flight ends first and the slots are freed all the same."""
        seqs = [await self._queue_for([])]
        while len(seqs) < len(inputs) and self.free and not self._waiters:
            seqs.append(self._pick([]))
        stop = asyncio.Event()
        job = asyncio.ensure_future(self._embed_on(seqs, inputs, wanted, stop))
        job.add_done_callback(lambda t: t.cancelled() or t.exception())  # read, even when nobody awaits it
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            stop.set()  # no step after the one in flight; the job frees the slots
            raise

    async def _embed_on(self, seqs: list[int], inputs, wanted, stop: asyncio.Event) -> list[np.ndarray]:
        marks = [wanted(len(ids)) for ids in inputs]
        out: list[np.ndarray | None] = [None] * len(inputs)
        todo = collections.deque(range(len(inputs)))
        idle, running = list(seqs), {}  # running: sequence -> [input, tokens fed, rows so far]
        dirty: set[int] = set()  # sequences that may hold rows
        try:
            for seq in seqs:
                if self.cache.pop(seq, None):
                    dirty.add(seq)
                    self.coord.kv_seq_rm(seq)
                    dirty.discard(seq)
            while todo or running:
                if stop.is_set():
                    raise asyncio.CancelledError()
                while idle and todo:
                    running[idle.pop(0)] = [todo.popleft(), 0, []]
                tokens, pos, seq_ids, want, owners, fed = [], [], [], [], [], {}
                for seq, (i, p, _) in running.items():
                    chunk = inputs[i][p: p + self.coord.n_batch - len(tokens)]
                    if not chunk:
                        break
                    for k, tok in enumerate(chunk):
                        if marks[i][p + k]:
                            owners.append((len(tokens), seq))
                        want.append(marks[i][p + k])
                        tokens.append(tok)
                        pos.append(p + k)
                        seq_ids.append([seq])
                    fed[seq] = len(chunk)
                    dirty.add(seq)
                if not any(want):
                    want[-1] = True  # a step returns at least one row; this one is read by nobody
                started = time.perf_counter()
                outcome = await self.coord.aembed(Batch(tokens, pos, seq_ids, want))
                self.last_step_end = time.monotonic()
                if self.metrics:
                    self.metrics.observe_decode(time.perf_counter() - started, outcome.code, len(tokens))
                if outcome.code != DecodeResult.OK:
                    endpoint = outcome.endpoint if outcome.code == DecodeResult.ENDPOINT_FAILED else None
                    log.error("embedding step failed", code=outcome.code.name, error=outcome.error)
                    raise EmbeddingFailed(outcome.code, outcome.error or outcome.code.name, endpoint)
                if self.metrics:
                    self.metrics.prompt_tokens.inc(len(tokens))
                for row, seq in owners:
                    running[seq][2].append(np.asarray(outcome.hidden(row), dtype=np.float32))
                for seq, n in fed.items():
                    job = running[seq]
                    job[1] += n
                    if job[1] == len(inputs[job[0]]):
                        out[job[0]] = np.stack(job[2])
                        del running[seq]
                        self.coord.kv_seq_rm(seq)
                        dirty.discard(seq)
                        idle.append(seq)
            return out
        finally:
            for seq in seqs:
                if seq in dirty:
                    try:
                        self.coord.kv_seq_rm(seq)
                    except Exception:
                        log.exception("freeing an embedding's KV rows failed; its sequence is retired", seq=seq)
                        continue
                self._give_back(seq)

    async def _take(self, prompt: list[int]) -> int:
        """A free sequence, chosen for `prompt` (choose_slot), at once or when one is freed (first come first)."""
        if self.free and not self._waiters:
            return self._pick(prompt)
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((prompt, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # given a sequence as it was cancelled: it goes back
                self._give_back(fut.result())
            elif (prompt, fut) in self._waiters:  # (a sequence freed meanwhile may have passed it over already)
                self._waiters.remove((prompt, fut))
            raise

    def _pick(self, prompt: list[int]) -> int:
        seq = choose_slot(prompt, self.free, self.cache)
        del self.free[seq]
        return seq

    def _give_back(self, seq: int) -> None:
        """`seq` is free (its KV rows are what self.cache says): to the first request waiting, if any."""
        self.free[seq] = time.monotonic()
        while self._waiters and self.free:
            prompt, fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(self._pick(prompt))

    def _set_up(self, slot: Slot) -> None:
        """Before the slot's first step: keep the KV rows of the prompt's prefix its sequence holds
        (the rest removed) and feed only what follows; all removed without cache_prompt, for a
        choice that shares another's rows, or where the prompt's logprobs are asked."""
        cached = self.cache.pop(slot.seq, [])
        keep = reusable(cached, slot.prompt) if slot.cache_prompt and slot.prompt_lp is None else 0
        if cached and self.coord.kv_seq_pos_max(slot.seq) != len(cached) - 1:
            keep = 0  # the table was cleared behind us (a worker's KV cache lost): nothing to reuse
        if keep == 0 and cached:
            self.coord.kv_seq_rm(slot.seq)  # the whole sequence (and nothing of it left to re-feed)
        elif keep < len(cached):
            self.coord.kv_seq_rm(slot.seq, keep)
        slot.kv, slot.cached = list(slot.prompt[:keep]), keep
        slot.pos, slot.pending = keep, list(slot.prompt[keep:])

    def cancel(self, slot: Slot) -> None:
        """The client went away: the loop frees the slot before its next step."""
        slot.cancelled = True
        self._wake[slot.group].set()

    def _release(self, slot: Slot, keep: bool = True) -> None:
        """`slot` ends; its sequence is free again. `keep`: its KV rows stay, the prompt cache of the next
        request that takes it (a slot ended by a failed step, or by a drain, drops them)."""
        if slot not in self.active:
            return
        self.active.remove(slot)
        self._orphan_followers(slot)
        if keep and slot.kv is not None:
            self.cache[slot.seq] = slot.kv
        elif not keep:
            self.cache.pop(slot.seq, None)
            try:
                self.coord.kv_seq_rm(slot.seq)
            except Exception:  # it runs in the loop's error handling too: never let it end the loop
                log.exception("freeing a slot's KV rows failed; its sequence is retired", seq=slot.seq)
                return
        self._give_back(slot.seq)

    def _finish(self, slot: Slot, reason: str, piece: str = "") -> None:
        slot.finished_at = time.monotonic()
        piece += slot.text.finish()
        if piece:
            slot.events.put_nowait(SlotEvent("text", piece, logprobs=self._take_logprobs(slot)))
        slot.events.put_nowait(SlotEvent("done", finish_reason=reason, logprobs=self._take_logprobs(slot)))
        self._release(slot)

    @staticmethod
    def _take_logprobs(slot: Slot) -> list[TokenLogprob] | None:
        if slot.logprobs is None:
            return None
        taken, slot.pending_lp = slot.pending_lp, []
        return taken

    def _orphan_followers(self, leader: Slot) -> None:
        """`leader` is gone before its prompt was decoded: the choices waiting for it decode the prompt themselves."""
        for slot in self.active:
            if slot.leader is leader:
                slot.leader = None
                self._wake[slot.group].set()

    def _adopt(self, slot: Slot, leader: Slot, logits) -> None:
        """`leader` has just decoded the prompt `slot` waits for: `slot` shares its KV rows
        (nothing is copied on the workers) and samples from the same logits."""
        slot.leader = None
        if self.cache.pop(slot.seq, None):  # its own cached rows go: it takes the leader's
            self.coord.kv_seq_rm(slot.seq)
        self.coord.kv_seq_cp(leader.seq, slot.seq)  # the leader has the prompt's positions alone so far
        slot.pos, slot.pending, slot.kv, slot.cached = leader.pos, [], list(leader.kv), leader.cached
        if leader.prompt_lp is not None and slot.prompt_lp is not None:
            slot.prompt_lp = list(leader.prompt_lp)
        self._prompt_done(slot)
        self._sample(slot, logits)
        self._wake[slot.group].set()

    def _prompt_done(self, slot: Slot) -> None:
        """Echo: the "prompt" event, with the prompt's logprobs (their text offsets now known) if asked."""
        if not slot.echo:
            return
        entries = None
        if slot.prompt_lp is not None:
            detok, offset, entries = self.coord.tokenizer.detokenizer(), 0, []
            for e in slot.prompt_lp:
                entries.append(TokenLogprob(e.token, e.logprob, e.top, offset))
                offset += len(detok.feed(e.token))
        slot.events.put_nowait(SlotEvent("prompt", logprobs=entries))

    async def _run(self, group: int) -> None:
        while True:
            try:
                await self._step(group)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must end the requests in flight, not the loop
                log.exception("decode loop step failed")
                for slot in [s for s in self.active if s.group == group]:
                    slot.events.put_nowait(SlotEvent("error", code=DecodeResult.COMPUTE_FAILED,
                                                     message=f"internal error: {type(exc).__name__}: {exc}"))
                    self._release(slot, keep=False)

    async def _step(self, group: int) -> None:
        n_batch = self.coord.n_batch
        for slot in [s for s in self.active if s.cancelled and s.group == group]:
            self._release(slot)
        mine = [s for s in self.active if s.group == group and s.leader is None]  # not those waiting for a leader
        for slot in mine:
            if slot.kv is None:
                self._set_up(slot)
        if not mine:
            self._wake[group].clear()
            await self._wake[group].wait()
            return
        tokens, pos, seqs, want, rows = [], [], [], [], []
        prompt_rows: list[tuple[int, Slot, int]] = []  # (row, slot, position) of a prompt whose logprobs are asked
        in_batch: list[Slot] = []
        for slot in step_slots(mine):
            scored = slot.prompt_lp is not None and slot.first_token_at is None
            chunk = slot.pending[: min(n_batch - len(tokens), PROMPT_LOGPROBS_CHUNK if scored else n_batch)]
            if not chunk:
                break
            completes = len(chunk) == len(slot.pending)  # logits only after the last pending token
            for k, tok in enumerate(chunk):
                last = completes and k == len(chunk) - 1
                if scored and not last:
                    prompt_rows.append((len(tokens), slot, slot.pos + k))
                tokens.append(tok)
                pos.append(slot.pos + k)
                seqs.append([slot.seq])
                want.append(last or scored)
            if completes:
                rows.append((len(tokens) - 1, slot))
            slot.fed = len(chunk)
            in_batch.append(slot)
        self._started[group] = time.monotonic()
        started = time.perf_counter()
        try:
            # with resume_within set, a lost worker is a pause here, not an error (coordinator/decode/resume.py)
            greedy = self._best_wanted(rows, prompt_rows)
            outcome = await self.coord.adecode_outcome(Batch(tokens, pos, seqs, want), greedy)
        finally:
            del self._started[group]
            self.last_step_end = time.monotonic()
        code = outcome.code
        if self.metrics:
            outputs = "none" if not rows else "logits" if not greedy else "argmax" if greedy == 1 else "best_tokens"
            self.metrics.observe_decode(time.perf_counter() - started, code, len(tokens), outputs)
        if code != DecodeResult.OK:
            err = outcome.error or code.name
            endpoint = outcome.endpoint if code == DecodeResult.ENDPOINT_FAILED else None
            log.error("decode step failed", code=code.name, error=err, slots=len(in_batch))
            for slot in in_batch:
                slot.events.put_nowait(SlotEvent("error", code=code, message=err, endpoint=endpoint))
                self._release(slot, keep=False)
            return
        for slot in in_batch:
            if self.metrics and slot.generated == 0:
                self.metrics.prompt_tokens.inc(slot.fed)
            slot.pos += slot.fed
            slot.kv += slot.pending[: slot.fed]
            del slot.pending[: slot.fed]
            slot.fed = 0
        for row, slot, p in prompt_rows:  # row p predicts the prompt's token p + 1
            lp, top = token_logprobs(outcome.logits(row), slot.prompt[p + 1], slot.logprobs)
            slot.prompt_lp.append(TokenLogprob(slot.prompt[p + 1], lp, tuple(top)))
        for row, slot in rows:
            if slot.cancelled:
                continue
            if greedy:  # no follower waits for this slot's logits (_best_wanted)
                if slot.first_token_at is None:
                    self._prompt_done(slot)
                self._emit(slot, slot.sampler.take_best(outcome.best_tokens(row)))
                continue
            logits = outcome.logits(row)
            if slot.first_token_at is None:  # its prompt is decoded
                for follower in [s for s in self.active if s.leader is slot and not s.cancelled]:
                    self._adopt(follower, slot, logits)
                self._prompt_done(slot)
            self._sample(slot, logits)

    def _best_wanted(self, rows: list, prompt_rows: list) -> int:
        """How many best tokens per row the step's samplers need instead of logits (decode's
        `greedy`): 0 (the logits) if any slot needs them (sampling, penalties, a constraint,
        logprobs, choices waiting for its prompt's logits); 1 (the argmax) if none bans a
        token; else BEST_FOR_BANS, enough for every sampler's bans (ignore_eos). Logits are
        4 x n_vocab bytes a row from every worker holding a share of the head, 1 MiB for gemma3."""
        if prompt_rows or not rows:  # (no row sampled: a prompt's chunk keeps the graphs it had)
            return 0
        banned = 0
        for _, slot in rows:
            bans = slot.sampler.greedy_bans()
            if bans is None or slot.logprobs is not None or len(bans) >= BEST_FOR_BANS or \
                    slot.first_token_at is None and any(s.leader is slot for s in self.active):
                return 0
            banned = max(banned, len(bans))
        return BEST_FOR_BANS if banned else 1

    def _sample(self, slot: Slot, logits) -> None:
        self._emit(slot, slot.sampler.sample(logits), logits)

    def _emit(self, slot: Slot, token: int, logits=None) -> None:
        """`token`, just sampled for `slot` (from `logits` when the step returned them)."""
        if slot.first_token_at is None:
            slot.first_token_at = time.monotonic()
        if self.coord.tokenizer.is_eog(token):
            return self._finish(slot, "stop")
        slot.generated += 1
        self.generated += 1
        if self.metrics:
            self.metrics.tokens_generated.inc()
        if slot.logprobs is not None:
            lp, top = token_logprobs(logits, token, slot.logprobs)
            slot.pending_lp.append(TokenLogprob(token, lp, tuple(top), slot.text.decoded))
        piece = slot.text.feed(token)
        if slot.text.stopped:
            return self._finish(slot, "stop", piece)
        if piece:
            slot.events.put_nowait(SlotEvent("text", piece, logprobs=self._take_logprobs(slot)))
        if slot.generated >= slot.max_tokens:
            return self._finish(slot, "length")
        if slot.pos + 1 >= self.n_ctx_slot:
            if not self.context_shift:
                return self._finish(slot, "length")
            return self._shift(slot, token)
        slot.pending = [token]

    def _shift(self, slot: Slot, token: int) -> None:
        """The slot's context is full: keep its first n_keep rows, drop n_discard tokens after them, and
        decode the rest again behind them, with `token` (just sampled) last (shift_span; the module's doc)."""
        n_keep, n_discard = shift_span(slot.pos, len(slot.prompt), slot.n_keep,
                                       bool(getattr(self.coord.tokenizer, "add_bos", False)), self.n_ctx_slot)
        kept = slot.kv[n_keep + n_discard:]
        self.coord.kv_seq_rm(slot.seq, n_keep)
        log.info("context shift", seq=slot.seq, n_keep=n_keep, n_left=slot.pos - n_keep, n_discard=n_discard,
                 request_id=slot.request_id)
        slot.kv, slot.pos, slot.pending = slot.kv[:n_keep], n_keep, kept + [token]
        slot.shifts += 1

