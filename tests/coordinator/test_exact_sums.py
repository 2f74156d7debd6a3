"""The tensor split with exact sums (Coordinator(split_mode="tensor", exact_sums=True), CLI
--exact-sums): the members cut attn_output and ffn_down by their rows instead of summing
partial products, gather each product's whole input and then its whole output (PAD: zeros
around a member's part; workers offering "tensor_gather" exchange only their parts and put
each in place, older ones sum the padded parts, x + 0 = x), so every logit is in process's to
the last bit. Workers that do not take PAD (a daemon from before the HELLO feature "pad":
the test entry point's --test-older pad) cannot run it: "tensor" says so naming the worker,
"auto" keeps the layer split with that reason, and the split sums still run on them.

Real daemons on 127.0.0.1, real libggml; the tiny models of tests/tiny_models.py.
tests/coordinator/test_tensor_split.py has the plans and cuts, tests/daemon/ PAD's rule."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.api import Batch, Coordinator, DecodeResult
from coordinator.config import CoordinatorConfig
from coordinator.model.architectures.common import StepShape
from ggml_ffi import lib
from tiny_models import write_tiny_model

pytestmark = pytest.mark.system

PROMPT = "the capital of france is paris and the capital of"
# 64 tokens in the tiny models' SentencePiece vocabulary: products of many rows, run by ggml's tiled kernels
# (the tiny llama's own logits move by up to 0.07 when it is decoded in other steps: for bits only)
LONG_PROMPT = "the capital of france is paris and the capital of germany is berlin and the capital of italy is rome"


def all_logits(c: Coordinator, text: str = PROMPT) -> np.ndarray:
    """Every row's logits of `text` decoded in one step from an empty cache."""
    c.kv_clear()
    toks = c.tokenize(text)
    assert c.decode(Batch.single(toks, 0, all_logits=True)) == DecodeResult.OK, c.last_error
    return np.stack([c.logits(i) for i in range(len(toks))])


def reference(model: str, prompt: str = PROMPT) -> tuple[np.ndarray, str]:
    """In process: the prompt's logits and 12 greedy tokens' text."""
    with Coordinator(["local"], model=model, n_ctx=128) as c:
        return all_logits(c, prompt), c.generate(prompt, max_tokens=12)


def pads(c: Coordinator, n_tokens: int) -> list[int]:
    """PAD nodes in each member's layer graph of a step of n_tokens (the gathers of exact sums)."""
    counts = []
    for p in c._places:
        g, _ = p.stage.graph(StepShape(n_tokens, 64, 1))
        nodes = (lib.ggml_graph_node(g.gf, i) for i in range(lib.ggml_graph_n_nodes(g.gf)))
        counts.append(sum(node.op == lib.GGML_OP_PAD for node in nodes))
    return counts


def assert_exact(c: Coordinator, want: np.ndarray, text: str, prompt: str = PROMPT) -> None:
    """Every logit of the prompt and the greedy text are in process's, bit for bit, and the
    members exchanged what they gathered worker to worker."""
    got = all_logits(c, prompt)
    assert got.shape == want.shape
    assert np.array_equal(got, want), f"max deviation {np.abs(got - want).max()}: not in process's bits"
    assert c.generate(prompt, max_tokens=12) == text
    assert all(p.executor.exchange_us > 0 for p in c._places)


# ---------------------------------------------------------------- the option

@pytest.mark.parametrize("value", [1, 0, "true", "", 1.0])
def test_exact_sums_must_be_a_bool_or_none(value):
    with pytest.raises(ValueError, match=r"exact_sums must be None, True or False, not "):
        CoordinatorConfig.of(["127.0.0.1:1", "127.0.0.1:2"], None, {"split_mode": "tensor", "exact_sums": value})


def test_exact_sums_need_a_tensor_split():
    """Refused before anything is read or connected: port 1 is never dialled, the model never read."""
    for mode in ("tensor", "auto"):
        assert CoordinatorConfig.of(["127.0.0.1:1"], None, {"split_mode": mode, "exact_sums": True}).exact_sums
    assert CoordinatorConfig.of(["127.0.0.1:1"], None, {}).exact_sums is None  # exact where they can be
    for mode in ("layer", "tensor", "auto"):  # split sums never need asking for; nor does the default
        for value in (None, False):
            assert CoordinatorConfig.of(["127.0.0.1:1"], None, {"split_mode": mode, "exact_sums": value})
    with pytest.raises(ValueError, match=r"exact_sums needs split_mode='tensor' or 'auto'"):
        CoordinatorConfig.of(["127.0.0.1:1"], None, {"exact_sums": True})  # split_mode defaults to layer
    with pytest.raises(ValueError, match=r"exact_sums needs split_mode='tensor' or 'auto'"):
        Coordinator(["127.0.0.1:1", "127.0.0.1:2"], model="/nonexistent.gguf", split_mode="layer", exact_sums=True)
    with pytest.raises(ValueError, match=r"exact_sums must be None, True or False"):
        Coordinator(["127.0.0.1:1", "127.0.0.1:2"], model="/nonexistent.gguf", split_mode="tensor", exact_sums="no")


def test_the_cli_flag_reaches_the_coordinators_options():
    from coordinator.serving.cli import parse_args
    for command in (["generate", "-p", "x"], ["serve"]):
        args = parse_args([*command, "-m", "/m.gguf", "--endpoints", "127.0.0.1:1,127.0.0.1:2", "-sm", "tensor",
                           "--exact-sums"])
        assert args.exact_sums is True and args.split_mode == "tensor"
        assert parse_args([*command, "-m", "/m.gguf"]).exact_sums is None
        assert parse_args([*command, "-m", "/m.gguf", "--no-exact-sums"]).exact_sums is False


# ---------------------------------------------------------------- bit for bit

def test_the_tiny_llama_is_in_process_bit_for_bit(tmp_path, workers):
    """Shares 1:2: the output rows 20 + 44 of 64 (tiles of 4), the FFN rows 64 + 64 of 128 (tiles of 64;
    split sums: 32 + 96, q8_0 blocks). Every logit of the prompt and 12 greedy tokens are in process's.
    (The split sums happen to give this tiny model's bits too: the qwen3-wide test below tells them apart.)"""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama")
    want, text = reference(model)
    ws = workers(2)
    pair = [ws.endpoint(0), ws.endpoint(1)]
    with Coordinator(pair, model=model, n_ctx=128, split=[1, 2], split_mode="tensor", exact_sums=True) as c:
        health = c.health()
        assert health["split_mode"] == "tensor"
        assert health["split_choice"] == {"asked": "tensor", "chosen": "tensor", "sums": "exact"}
        shards = [e["shard"] for e in health["endpoints"]]
        assert [s["out_rows"] for s in shards] == [[0, 20], [20, 64]], shards
        assert [s["ffn_rows"] for s in shards] == [[0, 64], [64, 128]], shards
        assert [s["heads"] for s in shards] == [[0, 2], [2, 4]], shards
        assert [e["shard"]["out_rows"] for e in c.endpoints()] == [[0, 20], [20, 64]]
        # 4 layers, each gathers the heads' outputs, then attn_output's rows, the FFN's rows, then ffn_down's
        assert pads(c, 1) == pads(c, 7) == [16, 16]
        assert_exact(c, want, text)
    with Coordinator(pair, model=model, n_ctx=128, split=[1, 2], split_mode="tensor", exact_sums=False) as c:
        health = c.health()
        assert health["split_choice"] == {"asked": "tensor", "chosen": "tensor", "sums": "split"}
        shards = [e["shard"] for e in health["endpoints"]]
        assert [s["out_rows"] for s in shards] == [None, None]
        assert [s["ffn_rows"] for s in shards] == [[0, 32], [32, 128]]
        assert pads(c, 7) == [0, 0]
        split = all_logits(c)
    assert np.abs(split - want).max() <= 1e-3 * np.abs(want).max()


def sent_gathers(c: Coordinator) -> list:
    """Watch each member's step requests as they are sent: the list fills with each one's
    `tensor.gather` (None where the request sums every exchange)."""
    seen = []
    for p in c._places:
        send = p.executor.send_step

        async def watched(request, send=send):
            seen.append(request.fields["tensor"].get("gather"))
            return await send(request)
        p.executor.send_step = watched
    return seen


def test_members_that_gather_send_their_pieces_and_an_older_one_gets_padded_sums(tmp_path, start_daemon):
    """Current workers gather (each exchange of the heads', FFN's and projections' rows carries
    every member's length: tensor.gather); with a worker from before "tensor_gather" in the group
    no member does, and the padded parts are summed. Both give in process's bits."""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama")
    want, text = reference(model)
    current, other, older = (start_daemon("-t", "1"), start_daemon("-t", "1"),
                             start_daemon("-t", "1", "--test-older", "tensor_gather"))
    with Coordinator([current.endpoint, other.endpoint], model=model, n_ctx=128, split=[1, 2],
                     split_mode="tensor", exact_sums=True) as c:
        seen = sent_gathers(c)
        assert_exact(c, want, text)
        assert seen and all(g is not None for g in seen)
        # the embedding summed; per layer the heads' outputs (2 heads of 16), attn_output's rows, the FFN's, ffn_down's
        assert [tuple(x) if x else None for x in seen[0][:5]] == [None, (32, 32), (20, 44), (64, 64), (20, 44)]
    for pair in ((current, older), (older, current)):
        with Coordinator([d.endpoint for d in pair], model=model, n_ctx=128, split=[1, 2],
                         split_mode="tensor", exact_sums=True) as c:
            assert [p.executor.tensor_gather for p in c._places] == [d is current for d in pair]
            seen = sent_gathers(c)
            assert_exact(c, want, text)
            assert seen and all(g is None for g in seen)


def test_three_members_gather_their_pieces_in_rank_order(tmp_path, start_daemon):
    """The tiny phi3 (3 heads with 3 KV heads, 160 FFN rows, n_embd 96) over 3 workers: each member
    places the other two's pieces on either side of its own, and every logit is in process's."""
    model = write_tiny_model(tmp_path / "phi3.gguf", "phi3")
    want, text = reference(model)
    daemons = [start_daemon("-t", "1") for _ in range(3)]
    with Coordinator([d.endpoint for d in daemons], model=model, n_ctx=128, split_mode="tensor",
                     exact_sums=True) as c:
        seen = sent_gathers(c)
        assert_exact(c, want, text)
        # the embedding summed; per layer one head of 32 each, attn_output's rows, the FFN's (64, 64, 32), ffn_down's
        assert [tuple(x) if x else None for x in seen[0][:5]] == [None, (32, 32, 32), (32, 32, 32), (64, 64, 32),
                                                                   (32, 32, 32)]


def f32_llama(path) -> str:
    """A llama whose weights are all f32 (2 layers of n_embd 256, n_ff 512): its products run by
    tinyBLAS's tiles, its SwiGLU in vectors of 64 floats."""
    from tiny_models import Dims, write_plain_llama
    return write_plain_llama(path, Dims(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512), "f32",
                             layer_std=0.05)


@pytest.mark.parametrize("name", ["qwen3-wide", "f32-llama"])
def test_where_split_sums_round_otherwise_exact_sums_do_not(name, tmp_path, workers):
    """Two models whose logits the split sums move in the last bits (measured: 2.9e-6 and 2.2e-5):
    qwen3-wide (q4_K/q6_K weights, 8 query heads over 2 KV heads), summing partial products in
    another order; the f32 llama, whose 64-token prompt runs its products by tiles. Exact sums give
    in process's bits: with shares 1:2 the f32 llama's FFN rows fall on 192 (tiles of 64; rows
    cut on 172, whole tiles of 4, move its logits by 7e-6). Exact sums are the default."""
    model = f32_llama(tmp_path / "f32.gguf") if name == "f32-llama" else \
        write_tiny_model(tmp_path / f"{name}.gguf", name)
    prompt = LONG_PROMPT if name == "f32-llama" else PROMPT
    want, text = reference(model, prompt)
    assert len(want) == (64 if name == "f32-llama" else 12)
    ws = workers(2)
    pair = [ws.endpoint(0), ws.endpoint(1)]
    with Coordinator(pair, model=model, n_ctx=128, split=[1, 2], split_mode="tensor", exact_sums=False) as c:
        split = all_logits(c, prompt)
    assert not np.array_equal(split, want)
    assert np.abs(split - want).max() <= 1e-3 * np.abs(want).max()
    with Coordinator(pair, model=model, n_ctx=128, split=[1, 2], split_mode="tensor") as c:
        health = c.health()
        assert health["split_choice"]["sums"] == "exact"
        if name == "f32-llama":
            assert [e["shard"]["ffn_rows"] for e in health["endpoints"]] == [[0, 192], [192, 512]]
            assert [e["shard"]["out_rows"] for e in health["endpoints"]] == [[0, 84], [84, 256]]
        assert_exact(c, want, text, prompt)


def test_the_tiny_qwen3_that_split_sums_refuse_runs_bit_for_bit(tmp_path, workers):
    """Its KV group's 128 columns of attn_output are half a q4_K block: the split sums cannot cut it;
    exact sums (the default) cut attn_output by rows and deal one KV group to each member."""
    model = write_tiny_model(tmp_path / "qwen3.gguf", "qwen3")
    want, text = reference(model)
    ws = workers(2)
    pair = [ws.endpoint(0), ws.endpoint(1)]
    with pytest.raises(ValueError, match=r"split_mode='tensor': .*quantization blocks"):
        Coordinator(pair, model=model, n_ctx=128, split_mode="tensor", exact_sums=False)
    with Coordinator(pair, model=model, n_ctx=128, split_mode="tensor") as c:
        health = c.health()
        assert health["split_mode"] == "tensor" and health["split_choice"]["sums"] == "exact"
        shards = [e["shard"] for e in health["endpoints"]]
        assert [s["kv_heads"] for s in shards] == [[0, 1], [1, 2]], shards
        assert [s["out_rows"] for s in shards] == [[0, 128], [128, 256]], shards
        assert_exact(c, want, text)
    # auto weighs it where split sums are refused: no reason, its figures, four exchanges a layer (and the
    # embedding's) at the round trip it measured
    with Coordinator(pair, model=model, n_ctx=128, split_mode="auto", exact_sums=False) as c:
        assert "quantization blocks" in c.health()["split_choice"]["reason"]
    with Coordinator(pair, model=model, n_ctx=128, split_mode="auto") as c:
        choice = c.health()["split_choice"]
        assert "reason" not in choice, choice
        assert choice["exchanges_ms_per_token"] == pytest.approx((4 * 2 + 1) * choice["exchange_us"] / 1e3,
                                                                 abs=0.011), choice


def test_mixture_of_experts_are_refused_at_start(tmp_path, workers):
    """Insisted on, exact sums refuse a mixture of experts; by default it takes split sums and says why."""
    model = write_tiny_model(tmp_path / "qwen3moe.gguf", "qwen3moe")
    ws = workers(2)
    pair = [ws.endpoint(0), ws.endpoint(1)]
    with Coordinator(pair, model=model, n_ctx=64, split_mode="tensor") as c:
        choice = c.health()["split_choice"]
        assert choice["chosen"] == "tensor" and choice["sums"] == "split", choice
        assert choice["sums_reason"].startswith("exact sums are not built for mixture-of-experts"), choice
    with pytest.raises(ValueError, match=r"split_mode='tensor': exact sums are not built for mixture-of-experts"):
        Coordinator(pair, model=model, n_ctx=64, split_mode="tensor", exact_sums=True)
    with Coordinator(pair, model=model, n_ctx=64, split_mode="auto", exact_sums=True) as c:
        assert c.health()["split_mode"] == "layer"
        assert "mixture-of-experts" in c.health()["split_choice"]["reason"]


# ---------------------------------------------------------------- a worker from before PAD

def test_an_older_daemon_refuses_pad_and_does_not_offer_the_feature(start_daemon):
    """What the test below leans on: --test-older pad acts as a daemon from before PAD."""
    from graph_helpers import COMPUTE, INPUT, OUTPUT, T, f32s, i32s
    from rpc_daemon.wire.protocol import Command, Status
    from rpc_helpers import RawConn
    tensors = [T(lib.GGML_TYPE_F32, [2, 2], flags=INPUT),
               T(lib.GGML_TYPE_F32, [5, 2], op=lib.GGML_OP_PAD, src=[0], params=i32s(1, 2, 0, 0, 0, 0, 0, 0, 0),
                 flags=OUTPUT | COMPUTE)]
    request = {"tensors": tensors, "inputs": [[0, 0, 16]], "outputs": [1]}
    older = RawConn(start_daemon("-t", "1", "--test-older", "pad").port)
    hello = older.hello()
    assert "pad" not in hello["features"] and "concat" in hello["features"], hello
    h, _ = older.call(Command.GRAPH_COMPUTE, request, f32s(1, 2, 3, 4))
    assert h["status"] == Status.INVALID_REQUEST and "op PAD is not supported" in h["error"], h
    current = RawConn(start_daemon("-t", "1").port)
    assert "pad" in current.hello()["features"]
    h, out = current.call(Command.GRAPH_COMPUTE, request, f32s(1, 2, 3, 4))
    assert h["status"] == Status.SUCCESS, h
    assert np.frombuffer(out, np.float32).tolist() == [0, 1, 2, 0, 0, 0, 3, 4, 0, 0]


def test_a_worker_from_before_pad_cannot_gather_exact_sums(tmp_path, start_daemon):
    """"tensor" with exact sums names the older worker (in either place), "auto" keeps the layer split
    and says why (its logits in process's, as the layer split's always are), and by default the
    tensor split runs on it with split sums, naming it as the reason."""
    model = write_tiny_model(tmp_path / "llama.gguf", "llama")
    want, text = reference(model)
    current, older = start_daemon("-t", "1"), start_daemon("-t", "1", "--test-older", "pad")
    for pair in ([current, older], [older, current]):
        with pytest.raises(ValueError) as err:
            Coordinator([d.endpoint for d in pair], model=model, n_ctx=128, split_mode="tensor", exact_sums=True)
        message = str(err.value)
        assert f"worker {older.endpoint} cannot gather exact sums" in message and current.endpoint not in message
    endpoints = [current.endpoint, older.endpoint]
    with Coordinator(endpoints, model=model, n_ctx=128, split_mode="auto", exact_sums=True) as c:
        health = c.health()
        assert health["split_mode"] == "layer" and all(e["shard"] is None for e in health["endpoints"])
        choice = health["split_choice"]
        assert choice["asked"] == "auto" and choice["chosen"] == "layer" and "sums" not in choice, choice
        assert f"worker {older.endpoint} cannot gather exact sums" in choice["reason"], choice
        assert np.array_equal(all_logits(c), want) and c.generate(PROMPT, max_tokens=12) == text
    with Coordinator(endpoints, model=model, n_ctx=128, split_mode="tensor") as c:
        health = c.health()
        assert health["split_mode"] == "tensor"
        assert health["split_choice"] == {"asked": "tensor", "chosen": "tensor", "sums": "split", "sums_reason":
                                          f"worker {older.endpoint} cannot gather exact sums (an older "
                                          f"ggml-rpc-server: it does not take PAD)"}
        got = all_logits(c)  # no PAD in its graphs: the older worker would refuse them
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
        assert len(c.generate(PROMPT, max_tokens=12)) > 0
