"""The Scheduler's part of n choices, logprobs and echo (coordinator/serving/batching.py),
with a fake coordinator whose logits are a fixed function of (token, position): the
choices of one request decode the prompt once and share its KV rows (kv_seq_cp);
a choice whose first has gone decodes the prompt itself; a prompt whose logprobs
are asked is decoded in steps of at most 64 rows, every row's logits returned."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.decode.values import DecodeOutcome, DecodeResult, StepOutput
from coordinator.serving.batching import BEST_FOR_BANS, PROMPT_LOGPROBS_CHUNK, Scheduler
from coordinator.text.sampling import Sampler, token_logprobs
from coordinator.text.tokenizer import Tokenizer

N_VOCAB = 300


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tiny_models import write_tiny_llama
    return Tokenizer.from_gguf(write_tiny_llama(tmp_path_factory.mktemp("m") / "tiny.gguf", seed=0))


def logits_of(token: int, pos: int) -> np.ndarray:
    """What the fake model answers for `token` at `pos`: a fixed draw, with EOS and BOS never likely."""
    z = np.random.default_rng(token * 4096 + pos).normal(size=N_VOCAB).astype(np.float32) * 3
    z[:3] = -30  # <unk>, <s>, </s>
    return z


class FakeCoordinator:
    n_batch = 512
    pipelined = False

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.batches = []  # (tokens, pos, seqs, logits wanted) of every step
        self.greedy = []  # what every step asked for instead of logits (decode's `greedy`)
        self.copies, self.removed = [], []

    def endpoints(self):
        return [{}]

    async def adecode_outcome(self, batch, greedy: int = 0) -> DecodeOutcome:
        self.batches.append(batch)
        self.greedy.append(int(greedy))
        await asyncio.sleep(0)
        rows = np.flatnonzero(batch.logits)
        logits = np.stack([logits_of(batch.tokens[i], batch.pos[i]) for i in rows])
        if greedy:  # each row's `greedy` best tokens, best first, as Coordinator.decode(greedy=k) gives them
            order = np.argsort(-logits, axis=1, kind="stable")[:, :int(greedy)].astype(np.int32)
            return DecodeOutcome(DecodeResult.OK, StepOutput(rows, tokens=order if greedy > 1 else order[:, 0]))
        return DecodeOutcome(DecodeResult.OK, StepOutput(rows, logits=logits))

    def kv_seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        self.copies.append((src, dst))

    def kv_seq_rm(self, seq: int, p0: int = 0, p1: int = -1) -> None:
        self.removed.append(seq)


async def events_of(slot) -> list:
    out = []
    while True:
        ev = await slot.events.get()
        out.append(ev)
        if ev.kind in ("done", "error"):
            return out


def run(coord, scenario):
    async def main():
        scheduler = Scheduler(coord, 4, 256)
        scheduler.start()
        try:
            return await asyncio.wait_for(scenario(scheduler), 30)
        finally:
            await scheduler.stop()
    return asyncio.run(main())


def text(events) -> str:
    return "".join(ev.text for ev in events if ev.kind in ("text", "done"))


PROMPT = [1, 40, 41, 42, 43, 44]


def test_choices_decode_the_prompt_once_and_share_its_rows(tokenizer):
    coord = FakeCoordinator(tokenizer)

    async def scenario(s):
        samplers = [Sampler(0.9, 0, 1.0, seed) for seed in (5, 6, 7)]
        slots = [await s.submit(PROMPT, 5, samplers[0], [])]
        for sampler in samplers[1:]:
            slots.append(await s.submit(PROMPT, 5, sampler, [], share_from=slots[0]))
        return slots, [await events_of(slot) for slot in slots]

    slots, events = run(coord, scenario)
    fed = [t for b in coord.batches for t, p in zip(b.tokens, b.pos) if p < len(PROMPT)]
    assert fed == PROMPT  # once, not three times
    leader = slots[0].seq
    assert coord.copies == [(leader, slots[1].seq), (leader, slots[2].seq)]
    assert all(ev[-1].kind == "done" and ev[-1].finish_reason == "length" for ev in events)
    assert all(slot.generated == 5 for slot in slots)
    # each choice drew its first token from the prompt's last logits with its own seed, as alone
    first = logits_of(PROMPT[-1], len(PROMPT) - 1)
    for slot, seed in zip(slots, (5, 6, 7)):
        alone = Sampler(0.9, 0, 1.0, seed).sample(first)
        fed_next = [t for b in coord.batches for t, p, q in zip(b.tokens, b.pos, b.seq_ids)
                    if q == [slot.seq] and p == len(PROMPT)]
        assert fed_next == [alone]


def test_a_choice_whose_first_is_gone_decodes_the_prompt_itself(tokenizer):
    coord = FakeCoordinator(tokenizer)

    async def scenario(s):
        leader = await s.submit(PROMPT, 3, Sampler(0.0), [])
        follower = await s.submit(PROMPT, 3, Sampler(0.0), [], share_from=leader)
        assert follower.leader is leader
        s.cancel(leader)  # the client went away before the prompt was decoded
        return leader, follower, await events_of(follower)

    leader, follower, events = run(coord, scenario)
    assert events[-1].kind == "done" and follower.generated == 3
    assert coord.copies == []
    fed = [t for b in coord.batches for t, q in zip(b.tokens, b.seq_ids) if q == [follower.seq]][:len(PROMPT)]
    assert fed == PROMPT
    # a choice that asks to share a prompt already decoded decodes its own too
    coord = FakeCoordinator(tokenizer)

    async def late(s):
        first = await s.submit(PROMPT, 20, Sampler(0.0), [])
        while first.first_token_at is None:
            await asyncio.sleep(0)
        second = await s.submit(PROMPT, 2, Sampler(0.0), [], share_from=first)
        assert second.leader is None
        return await events_of(second)

    assert run(coord, late)[-1].kind == "done" and coord.copies == []


def test_greedy_choices_are_the_same_text_and_logprobs_come_with_the_text(tokenizer):
    coord = FakeCoordinator(tokenizer)

    async def scenario(s):
        a = await s.submit(PROMPT, 6, Sampler(0.0), [], logprobs=2)
        b = await s.submit(PROMPT, 6, Sampler(0.0), [], logprobs=2, share_from=a)
        return [await events_of(a), await events_of(b)]

    events = run(coord, scenario)
    assert text(events[0]) == text(events[1]) and text(events[0])
    entries = [e for ev in events[0] for e in (ev.logprobs or [])]
    assert len(entries) == 6
    pos, token = len(PROMPT) - 1, PROMPT[-1]
    for e in entries:  # each the model's log-softmax at its step, greedy: the top alternative is itself
        lp, top = token_logprobs(logits_of(token, pos), e.token, 2)
        assert (e.logprob, list(e.top)) == (lp, top) and e.top[0][0] == e.token
        token, pos = e.token, pos + 1
    offsets = [e.offset for e in entries]
    assert offsets == sorted(offsets) and offsets[0] == 0
    for ev in events[0]:  # a text event carries the tokens that brought its text
        if ev.kind == "text":
            assert ev.logprobs


def test_echo_with_logprobs_scores_every_prompt_row_in_steps_of_64(tokenizer):
    coord = FakeCoordinator(tokenizer)
    prompt = [1] + [40 + (i % 50) for i in range(149)]

    async def scenario(s):
        slot = await s.submit(prompt, 2, Sampler(0.0), [], logprobs=1, echo=True)
        return await events_of(slot)

    events = run(coord, scenario)
    assert [ev.kind for ev in events][0] == "prompt"
    prompt_steps = [b for b in coord.batches if b.pos[0] < len(prompt)]
    assert [len(b.tokens) for b in prompt_steps] == [64, 64, 22] and PROMPT_LOGPROBS_CHUNK == 64
    assert all(all(b.logits) for b in prompt_steps)  # every row's logits
    entries = events[0].logprobs
    assert len(entries) == len(prompt) and entries[0].logprob is None
    for i in range(1, len(prompt)):
        lp, top = token_logprobs(logits_of(prompt[i - 1], i - 1), prompt[i], 1)
        assert (entries[i].token, entries[i].logprob, list(entries[i].top)) == (prompt[i], lp, top)
    decoded = [tokenizer.decode(prompt[:i]) for i in range(len(prompt))]
    assert [e.offset for e in entries] == [len(d) for d in decoded]
    # echo without logprobs: the event, no entries, and the prompt in one step
    coord = FakeCoordinator(tokenizer)

    async def plain(s):
        return await events_of(await s.submit(prompt, 1, Sampler(0.0), [], echo=True))

    events = run(coord, plain)
    assert events[0].kind == "prompt" and events[0].logprobs is None
    assert len(coord.batches[0].tokens) == len(prompt) and sum(coord.batches[0].logits) == 1


def test_penalties_see_the_prompt(tokenizer):
    """llama-server feeds the prompt to the penalties: a token of the prompt is penalized at the first draw."""
    first = logits_of(PROMPT[-1], len(PROMPT) - 1)
    top = int(np.argmax(first))
    prompt = PROMPT[:-1] + [top, PROMPT[-1]]  # the greedy answer is in the prompt
    coord = FakeCoordinator(tokenizer)

    async def scenario(s):
        slot = await s.submit(prompt, 1, Sampler(0.0, repeat_penalty=1e6), [], logprobs=0)
        return await events_of(slot)

    events = run(coord, scenario)
    drawn = [e.token for ev in events for e in (ev.logprobs or [])]
    assert drawn and drawn[0] != top


def test_greedy_steps_ask_for_the_best_tokens_not_the_logits(tokenizer):
    """A step whose samplers all take the highest logit asks for each row's argmax (greedy=1); one
    with a sampler that only bans tokens (ignore_eos, a -inf bias) for the best BEST_FOR_BANS, and
    takes the best it allows (what sampling the logits takes); anything that reads the logits
    (temperature, penalties, logprobs) makes the step return them."""
    want = [int(t) for t in np.argsort(-logits_of(PROMPT[-1], len(PROMPT) - 1), kind="stable")[:4]]
    ban = {want[0]: -np.inf, want[1]: -np.inf}

    def ask(sampler, **kw):
        coord = FakeCoordinator(tokenizer)
        events = run(coord, lambda s: _events_of_one(s, sampler, **kw))
        return text(events), coord.greedy

    assert ask(Sampler(0.0)) == (tokenizer.decode([want[0]]), [1])
    assert ask(Sampler(0.0, logit_bias=ban)) == (tokenizer.decode([want[2]]), [BEST_FOR_BANS])
    assert ask(Sampler(0.0, logit_bias=ban), logprobs=1) == (tokenizer.decode([want[2]]), [0])
    for sampler in (Sampler(0.7, seed=1), Sampler(0.0, repeat_penalty=1.3), Sampler(0.0, logit_bias={want[3]: 5.0})):
        assert ask(sampler)[1] == [0]


async def _events_of_one(s, sampler, **kw):
    return await events_of(await s.submit(PROMPT, 1, sampler, [], **kw))
