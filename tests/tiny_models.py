"""Tiny random-weight GGUFs of every supported architecture, written with the `gguf` package.

Deterministic from a seed (the same bytes every time: tests/fixtures/ records each
file's sha256 next to llama.cpp's logits for it). Any architecture and any tensor set:
`write_gguf(path, arch, metadata, vocab, tensors)` writes what it is given, and the
MODELS table describes the tiny model of each architecture as that metadata and a
list of `W` (name, numpy shape, std, storage type). Storage types: f32, f16, q8_0,
q4_0 (quantized from random floats by gguf.quants), q4_K and q6_K (random quant codes
and scales: gguf-py has no K-quant quantizer, and a random model needs none; their
rows must be multiples of 256 elements); any other ggml type name gets random bytes
(for tests that it is refused).

Vocabularies llama.cpp loads: a SentencePiece-style one ("spm": <unk> <s> </s>, 256
byte tokens, scored "▁word" prefixes) and a byte-level BPE one ("bpe": GPT-2's byte
alphabet, merges that build "Ġword" prefixes, then the family's special tokens).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import gguf
import numpy as np

TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_BYTE = 1, 2, 3, 6
SPACE = "\u2581"

_WORDS = ("the capital of france is paris a an and to in that it was for on are with as his they be at "
          "one have this from or had by hot word but what some we can out other were all there when up "
          "use your how said each she which do their time if will way about many then them write would "
          "like so these her long make thing see him two has look more day could go come did number "
          "sound no most people my over know water than call first who may down side been now find").split()


# ---------------------------------------------------------------- vocabularies
@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None  # tokenizer.ggml.pre
    ids: dict = field(default_factory=dict)  # bos/eos/unk/eot ids
    add_bos: bool = True


def tiny_vocab(n_vocab: int = 300) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of a SentencePiece-like vocabulary of exactly n_vocab entries.

    Pieces are every prefix of "▁word" (so the SPM pair merges can reach whole
    words) plus single letters; longer pieces get higher scores, as in a real
    SentencePiece model."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL] + [TOKEN_TYPE_BYTE] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    pieces: dict[str, None] = {SPACE: None}
    for ch in "etaoinshrdlucmfwypvbgkqjxz":
        pieces[ch] = None
    for w in _WORDS:
        s = SPACE + w
        for k in range(2, len(s) + 1):
            pieces[s[:k]] = None
    room = n_vocab - len(tokens)
    chosen: list[str] = []
    for p in pieces:  # keep prefixes before their extensions so every merge path exists
        if len(chosen) == room:
            break
        chosen.append(p)
    if len(chosen) < room:
        raise ValueError(f"vocabulary too small for n_vocab={n_vocab}")
    for i, p in enumerate(chosen):
        tokens.append(p)
        types.append(TOKEN_TYPE_NORMAL)
        scores.append(-10.0 + len(p) - i * 1e-3)  # longer pieces merge first; ties broken by order
    return tokens, scores, types


def spm_vocab(n_vocab: int = 300, specials: tuple[str, ...] = ()) -> Vocab:
    """tiny_vocab's pieces, then `specials` as control tokens (n_vocab in all)."""
    tokens, scores, types = tiny_vocab(n_vocab - len(specials))
    return Vocab("llama", tokens + list(specials), types + [TOKEN_TYPE_CONTROL] * len(specials),
                 scores=scores + [0.0] * len(specials), ids={"unk": 0, "bos": 1, "eos": 2})


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: byte b -> the printable character that stands for it."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def bpe_vocab(pre: str, specials: list[str], n_vocab: int, bos: str | None, eos: str, eot: str | None = None,
              add_bos: bool = False) -> Vocab:
    """The 256 byte tokens, merged "Ġword" prefixes up to n_vocab - len(specials), then the specials."""
    alphabet = _byte_alphabet()
    tokens, merges, known = list(alphabet), [], set(alphabet)
    room = n_vocab - len(specials)
    for w in _WORDS:
        s = alphabet[ord(" ")] + w
        cur = s[0]
        for ch in s[1:]:
            if len(tokens) == room:
                break
            if cur + ch not in known:
                merges.append(f"{cur} {ch}")
                tokens.append(cur + ch)
                known.add(cur + ch)
            cur += ch
    if len(tokens) < room:
        raise ValueError(f"vocabulary too small for n_vocab={n_vocab}")
    types = [TOKEN_TYPE_NORMAL] * len(tokens) + [TOKEN_TYPE_CONTROL] * len(specials)
    tokens += specials
    ids = {"eos": tokens.index(eos)}
    if bos is not None:
        ids["bos"] = tokens.index(bos)
    if eot is not None:
        ids["eot"] = tokens.index(eot)
    return Vocab("gpt2", tokens, types, merges=merges, pre=pre, ids=ids, add_bos=add_bos)


def _write_vocab(w: gguf.GGUFWriter, v: Vocab) -> None:
    w.add_tokenizer_model(v.model)
    if v.pre is not None:
        w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.types)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    if v.merges is not None:
        w.add_token_merges(v.merges)
    setters = {"unk": w.add_unk_token_id, "bos": w.add_bos_token_id, "eos": w.add_eos_token_id,
               "eot": w.add_eot_token_id}
    for role, token_id in v.ids.items():
        setters[role](token_id)
    w.add_add_bos_token(v.add_bos)
    w.add_add_eos_token(False)
    if v.model == "llama":
        w.add_add_space_prefix(True)


# ---------------------------------------------------------------- weights
@dataclass
class W:
    """One tensor: numpy shape (rows, cols) = ggml ne reversed, so a weight is (n_out, n_in).
    `std`: random N(0, std); `norm`: 1 + N(0, std) (norm weights); `values`: exactly these."""
    name: str
    shape: tuple
    std: float = 0.1
    kind: str = "f32"
    norm: bool = False
    values: np.ndarray | None = None


QK_K = 256


def _k_quant(rng: np.random.Generator, shape: tuple, std: float, kind: str) -> np.ndarray:
    """Random q4_K / q6_K blocks whose values are roughly N(0, std)-sized and zero-mean."""
    n_blocks = math.prod(shape) // QK_K
    if shape[-1] % QK_K:
        raise ValueError(f"{kind} rows must be multiples of {QK_K} elements, got {shape}")
    if kind == "q6_K":  # ql[128] qh[64] scales[16] (int8) d (f16); value = d * scale * (q - 32)
        codes = rng.integers(0, 256, (n_blocks, 192), dtype=np.uint8)
        scales = rng.integers(8, 17, (n_blocks, 16), dtype=np.int8).view(np.uint8)
        d = np.full((n_blocks, 1), std / (18.5 * 12.0), np.float16).view(np.uint8)
        blocks = np.concatenate([codes, scales, d], axis=1)
    else:  # q4_K: d, dmin (f16), scales[12] (6-bit scales and mins), qs[128]; value = d*sc*q - dmin*m
        sc = rng.integers(8, 16, (n_blocks, 8), dtype=np.uint8)  # 4 bits: no high bits to pack
        packed = np.concatenate([sc[:, :4], sc[:, :4], sc[:, 4:] | (sc[:, 4:] << 4)], axis=1)  # mins = scales
        d = std / (4.6 * 11.5)
        dd = np.tile(np.array([d, 7.5 * d], np.float16), (n_blocks, 1)).view(np.uint8)  # dmin*m = 7.5*d*sc
        blocks = np.concatenate([dd, packed, rng.integers(0, 256, (n_blocks, 128), dtype=np.uint8)], axis=1)
    return blocks.reshape(*shape[:-1], shape[-1] // QK_K * blocks.shape[1])


def _tensor_data(rng: np.random.Generator, t: W):
    """(numpy array, raw GGML type or None) as GGUFWriter.add_tensor takes them."""
    if t.kind in ("q4_K", "q6_K"):
        return _k_quant(rng, t.shape, t.std, t.kind), gguf.GGMLQuantizationType[t.kind.upper()]
    if t.values is not None:
        x = np.asarray(t.values, np.float32).reshape(t.shape)
    else:
        x = (rng.standard_normal(t.shape) * t.std + (1.0 if t.norm else 0.0)).astype(np.float32)
    if t.kind == "f32":
        return x, None
    if t.kind == "f16":
        return x.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType[t.kind.upper()]
    if t.kind not in ("q8_0", "q4_0"):  # any other type: random bytes (for tests that it is refused)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, (*t.shape[:-1], t.shape[-1] // block * size), dtype=np.uint8), qtype
    with np.errstate(invalid="ignore"):  # a NaN row (tests' "nan" head) quantizes to a NaN scale
        return gguf.quants.quantize(x, qtype), qtype


def write_gguf(path: str | os.PathLike, arch: str, metadata: dict, vocab: Vocab, tensors: list[W],
               seed: int = 0) -> str:
    """Write a GGUF: general.architecture `arch`, `metadata` (key -> int (u32), float (f32),
    str, bool or list of floats), the vocabulary, and the tensors in order with data drawn
    from numpy's generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-random-{arch}")
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, list(value))
    _write_vocab(w, vocab)
    for t in tensors:
        data, raw = _tensor_data(rng, t)
        w.add_tensor(t.name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# ---------------------------------------------------------------- the models
@dataclass
class Dims:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    head_dim: int = 0  # 0: n_embd / n_head

    def __post_init__(self):
        self.head_dim = self.head_dim or self.n_embd // self.n_head


def _common_metadata(arch: str, d: Dims, n_ctx: int = 256, rope_base: float = 10000.0, eps: float = 1e-5) -> dict:
    return {f"{arch}.context_length": n_ctx, f"{arch}.embedding_length": d.n_embd,
            f"{arch}.block_count": d.n_layer, f"{arch}.feed_forward_length": d.n_ff,
            f"{arch}.attention.head_count": d.n_head, f"{arch}.attention.head_count_kv": d.n_head_kv,
            f"{arch}.rope.dimension_count": d.head_dim, f"{arch}.rope.freq_base": rope_base,
            f"{arch}.attention.layer_norm_rms_epsilon": eps}


def _attention(p: str, d: Dims, big: str, small: str, fused: bool = False, bias: bool = False,
               qk_norm: bool = False) -> list[W]:
    q, kv = d.n_head * d.head_dim, d.n_head_kv * d.head_dim
    ws = [W(p + "attn_norm.weight", (d.n_embd,), 0.1, norm=True)]
    if fused:
        ws.append(W(p + "attn_qkv.weight", (q + 2 * kv, d.n_embd), 0.1, big))
    else:
        ws += [W(p + "attn_q.weight", (q, d.n_embd), 0.1, big), W(p + "attn_k.weight", (kv, d.n_embd), 0.1, small),
               W(p + "attn_v.weight", (kv, d.n_embd), 0.1, big)]
    if bias:
        ws += [W(p + "attn_q.bias", (q,), 0.1), W(p + "attn_k.bias", (kv,), 0.1), W(p + "attn_v.bias", (kv,), 0.1)]
    if qk_norm:
        ws += [W(p + "attn_q_norm.weight", (d.head_dim,), 0.1, norm=True),
               W(p + "attn_k_norm.weight", (d.head_dim,), 0.1, norm=True)]
    ws.append(W(p + "attn_output.weight", (d.n_embd, q), 0.05, small))
    return ws


def _ffn(p: str, d: Dims, big: str, small: str, fused: bool = False) -> list[W]:
    ws = [W(p + "ffn_norm.weight", (d.n_embd,), 0.1, norm=True)]
    if fused:  # gate and up in one tensor: the gate's rows first
        ws.append(W(p + "ffn_up.weight", (2 * d.n_ff, d.n_embd), 0.1, big))
    else:
        ws += [W(p + "ffn_gate.weight", (d.n_ff, d.n_embd), 0.1, big),
               W(p + "ffn_up.weight", (d.n_ff, d.n_embd), 0.1, small)]
    ws.append(W(p + "ffn_down.weight", (d.n_embd, d.n_ff), 0.05, big))
    return ws


def _ends(d: Dims, n_vocab: int, embd: str, head: str | None) -> tuple[list[W], list[W]]:
    """token_embd first; output_norm and (unless tied) output.weight last. A tied head
    gets a weaker embedding (else each token's own row wins its logits) and a stronger
    output norm."""
    last = [W("output_norm.weight", (d.n_embd,), 0.1, norm=True)]
    if head is not None:
        last.append(W("output.weight", (n_vocab, d.n_embd), 0.3, head))
    else:
        last[0].values = 4.0 + np.random.default_rng(d.n_embd).standard_normal(d.n_embd) * 0.4
    return [W("token_embd.weight", (n_vocab, d.n_embd), 1.0 if head else 0.1, embd)], last


def _layers(d: Dims, kinds, **opts) -> list[W]:
    """Every layer; kinds(il) -> (big, small) storage types, alternated so a split sees several."""
    out: list[W] = []
    for il in range(d.n_layer):
        big, small = kinds(il)
        p = f"blk.{il}."
        out += _attention(p, d, big, small, opts.get("fused_qkv", False), opts.get("bias", False),
                          opts.get("qk_norm", False))
        out += _ffn(p, d, big, small, opts.get("fused_ffn", False))
    return out


def _alternate(a: tuple[str, str], b: tuple[str, str]):
    return lambda il: a if il % 2 == 0 else b


def write_plain_llama(path: str | os.PathLike, d: Dims, wtype: str, n_ctx: int = 256,
                      layer_std: float | None = None, seed: int = 0) -> str:
    """A llama of shape `d` whose every matrix is `wtype` (an own output head,
    SentencePiece vocabulary of 300): for tests and benches that need a model of
    a given size, not coverage of types. `layer_std` overrides the layers'
    weight scale (0.02 keeps activations in range over many layers)."""
    vocab = spm_vocab(300)
    first, last = _ends(d, len(vocab.tokens), wtype, wtype)
    layers = _layers(d, lambda il: (wtype, wtype))
    if layer_std is not None:
        for w in layers:
            w.std = layer_std
    return write_gguf(path, "llama", _common_metadata("llama", d, n_ctx=n_ctx), vocab, first + layers + last,
                      seed=seed)


def model_llama(head: str = "own"):
    """Llama 1/2-style (SentencePiece): 4 layers, GQA 4/2, f32/f16/q8_0. head: "own" (an
    output.weight of its own), "tied" (none: the token embedding is the head), "ties"
    (output.weight whose rows repeat every 50 tokens, so every logit ties with those of 5
    other ids) or "nan" (row 260 of output.weight is NaN: that logit is NaN every step)."""
    if head not in ("own", "tied", "ties", "nan"):
        raise ValueError(head)
    d = Dims(n_embd=64, n_layer=4, n_head=4, n_head_kv=2, n_ff=128)
    vocab = spm_vocab(300)
    n_vocab = len(vocab.tokens)
    first, last = _ends(d, n_vocab, "f16", None if head == "tied" else "q8_0")
    if head in ("ties", "nan"):
        rows = np.random.default_rng(1234).standard_normal((n_vocab, d.n_embd)) * 0.3
        if head == "ties":
            rows = rows[np.arange(n_vocab) % 50]
        else:
            rows[260] = np.nan
        last[-1].values = rows
    tensors = first + _layers(d, _alternate(("q8_0", "f16"), ("f16", "f32"))) + last
    return "llama", _common_metadata("llama", d), vocab, tensors


def model_llama3():
    """Llama 3.x-style: byte-level BPE ("llama-bpe"), rope_freqs (llama3 RoPE scaling's
    per-dimension frequency divisors), GQA 4/1, q4_0/f16/f32, an own q8_0 head."""
    d = Dims(n_embd=64, n_layer=2, n_head=4, n_head_kv=1, n_ff=160)
    vocab = bpe_vocab("llama-bpe", ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], 320,
                      bos="<|begin_of_text|>", eos="<|end_of_text|>", eot="<|eot_id|>", add_bos=True)
    first, last = _ends(d, len(vocab.tokens), "q8_0", "q8_0")
    freqs = W("rope_freqs.weight", (d.head_dim // 2,), values=np.geomspace(1.0, 8.0, d.head_dim // 2))
    tensors = [freqs] + first + _layers(d, _alternate(("q4_0", "f16"), ("f16", "f32"))) + last
    # base 10000, not Llama 3's 500000: at a tiny model's few positions more pairs turn
    return "llama", _common_metadata("llama", d), vocab, tensors


def model_qwen2(yarn: bool = False):
    """Qwen 2/2.5-style: Q/K/V biases, NEOX RoPE, BPE ("qwen2"), the head tied to the
    embedding (as the small Qwen 2.5 models), q8_0/f16. yarn: YaRN RoPE scaling (factor 4
    over an original context of 64), as Qwen 2.5's long-context GGUFs carry."""
    d = Dims(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=192)
    vocab = bpe_vocab("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 352,
                      bos=None, eos="<|endoftext|>", eot="<|im_end|>")
    first, last = _ends(d, len(vocab.tokens), "q8_0", None)
    tensors = first + _layers(d, _alternate(("q8_0", "f16"), ("f16", "q8_0")), bias=True) + last
    meta = _common_metadata("qwen2", d, rope_base=1000000.0, eps=1e-6)
    if yarn:
        meta.update({"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
                     "qwen2.rope.scaling.original_context_length": 64})
    return "qwen2", meta, vocab, tensors


def model_qwen3(n_head: int = 4):
    """Qwen 3-style: per-head Q/K RMS norms, head_dim (64) apart from n_embd / n_head,
    NEOX RoPE, BPE ("qwen2"), K-quants: n_embd 256 so rows are whole q4_K/q6_K blocks.
    2 KV heads; n_head 4 (the default) makes a KV group's columns of attn_output 2 x 64 =
    128, half a block: refused in tensor mode. n_head 8 ("qwen3-wide"): 4 x 64 = 256, one
    block, as real Qwen3 models' head_dim 128 groups are whole blocks: it splits."""
    d = Dims(n_embd=256, n_layer=2, n_head=n_head, n_head_kv=2, n_ff=512, head_dim=64)
    vocab = bpe_vocab("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 384,
                      bos=None, eos="<|endoftext|>", eot="<|im_end|>")
    first, last = _ends(d, len(vocab.tokens), "q4_K", "q6_K")
    meta = _common_metadata("qwen3", d, rope_base=1000000.0, eps=1e-6)
    meta["qwen3.attention.key_length"] = meta["qwen3.attention.value_length"] = d.head_dim
    tensors = first + _layers(d, _alternate(("q4_K", "q6_K"), ("q6_K", "q4_0")), qk_norm=True) + last
    return "qwen3", meta, vocab, tensors


def model_phi3():
    """Phi-3-style: fused QKV (attn_qkv) and gate-up (ffn_up, 2 x n_ff rows), NEOX RoPE
    with LongRoPE's short/long frequency factors and attention factor, SentencePiece,
    n_embd 96 with 3 heads of 32 (no GQA, as Phi-3 mini), f16/q8_0/q4_0."""
    d = Dims(n_embd=96, n_layer=2, n_head=3, n_head_kv=3, n_ff=160)
    # llama.cpp sets attributes of <|endoftext|> for a model named phi3: it must exist
    vocab = spm_vocab(320, ("<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>"))
    vocab.ids["eot"] = vocab.tokens.index("<|end|>")
    first, last = _ends(d, len(vocab.tokens), "f16", "q8_0")
    meta = _common_metadata("phi3", d, n_ctx=1024)
    meta["phi3.rope.scaling.type"] = "longrope"  # as llama.cpp's converter writes it now
    meta["phi3.rope.scaling.original_context_length"] = 256
    meta["phi3.rope.scaling.attn_factor"] = math.sqrt(1 + math.log(1024 / 256) / math.log(256))
    half = d.head_dim // 2
    factors = [W("rope_factors_long.weight", (half,), values=np.geomspace(1.0, 6.0, half)),
               W("rope_factors_short.weight", (half,), values=np.linspace(1.0, 1.5, half))]
    tensors = (factors + first + _layers(d, _alternate(("q8_0", "f16"), ("q4_0", "f16")), fused_qkv=True,
                                          fused_ffn=True) + last)
    return "phi3", meta, vocab, tensors


# qwen3moe: 8 experts of which a token uses 2, stacked as llama.cpp stores them (ffn_{gate,up,down}_exps:
# one matrix per expert in ggml's ne[2]). The router is strong (std 1.0) so each token's choice is
# clear-cut and varies from token to token: near-ties would leave it to the logits' last bits.
N_EXPERT, N_EXPERT_USED, N_FF_EXP = 8, 2, 64


def _moe_ffn(p: str, d: Dims, kind: str) -> list[W]:
    return [W(p + "ffn_norm.weight", (d.n_embd,), 0.1, norm=True),
            W(p + "ffn_gate_inp.weight", (N_EXPERT, d.n_embd), 1.0),
            W(p + "ffn_gate_exps.weight", (N_EXPERT, N_FF_EXP, d.n_embd), 0.1, kind),
            W(p + "ffn_up_exps.weight", (N_EXPERT, N_FF_EXP, d.n_embd), 0.1, kind),
            W(p + "ffn_down_exps.weight", (N_EXPERT, d.n_embd, N_FF_EXP), 0.05, kind)]


def model_qwen3moe():
    """Qwen 3 MoE-style: qwen3's attention (per-head Q/K norms, head_dim 32 apart from
    n_embd / n_head), 8 experts, 2 used, BPE ("qwen2"), q8_0/f16/q4_0 experts."""
    d = Dims(n_embd=128, n_layer=2, n_head=4, n_head_kv=2, n_ff=N_FF_EXP * N_EXPERT_USED, head_dim=32)
    vocab = bpe_vocab("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 352,
                      bos=None, eos="<|endoftext|>", eot="<|im_end|>")
    first, last = _ends(d, len(vocab.tokens), "q8_0", "q8_0")
    meta = _common_metadata("qwen3moe", d, rope_base=1000000.0, eps=1e-6)
    meta.update({"qwen3moe.attention.key_length": d.head_dim, "qwen3moe.attention.value_length": d.head_dim,
                 "qwen3moe.expert_count": N_EXPERT, "qwen3moe.expert_used_count": N_EXPERT_USED,
                 "qwen3moe.expert_feed_forward_length": N_FF_EXP})
    layers = []
    for il, (big, small, experts) in enumerate([("q8_0", "f16", "q8_0"), ("f16", "q4_0", "f16")]):
        p = f"blk.{il}."
        layers += _attention(p, d, big, small, qk_norm=True) + _moe_ffn(p, d, experts)
    return "qwen3moe", meta, vocab, first + layers + last


MODELS = {"llama": model_llama, "llama3": model_llama3, "qwen2": model_qwen2,
          "qwen2-yarn": lambda: model_qwen2(yarn=True), "qwen3": model_qwen3,
          "qwen3-wide": lambda: model_qwen3(n_head=8), "phi3": model_phi3, "qwen3moe": model_qwen3moe}

# tests/coordinator/test_model_reference.py's cases, recorded by bench/record_reference_logits.py into
# tests/fixtures/reference/CASE.npz: case -> (model, n_ctx). Phi-3 twice: its LongRoPE
# short factors (n_ctx up to rope.scaling.original_context_length, 256) and long ones.
REFERENCE_CASES = {"llama": ("llama", 64), "llama3": ("llama3", 64), "qwen2": ("qwen2", 64),
                   "qwen2-yarn": ("qwen2-yarn", 64), "qwen3": ("qwen3", 64), "qwen3-wide": ("qwen3-wide", 64),
                   "phi3-short": ("phi3", 256), "phi3-long": ("phi3", 512), "qwen3moe": ("qwen3moe", 64)}


def write_tiny_model(path: str | os.PathLike, name: str, seed: int = 0, **opts) -> str:
    """The tiny model `name` (a key of MODELS) at `path`."""
    arch, metadata, vocab, tensors = MODELS[name](**opts)
    return write_gguf(path, arch, metadata, vocab, tensors, seed)


def write_tiny_llama(path: str | os.PathLike, seed: int = 0, head: str = "own") -> str:
    """The tiny `llama` (see model_llama for `head`)."""
    return write_tiny_model(path, "llama", seed, head=head)



# ---------------------------------------------------------------- a 1B-class llama for benches
TINYLLAMA_1B = Dims(n_embd=2048, n_layer=22, n_head=32, n_head_kv=4, n_ff=5632)  # TinyLlama 1.1B's shape


def filler_spm_vocab(n_vocab: int) -> Vocab:
    """A SentencePiece-style vocabulary of any size up to about 480k: spm_vocab(300)'s entries,
    then "▁" + every 2-, 3-, 4-letter string in order, as normal pieces of falling score."""
    import itertools

    v = spm_vocab(300)
    known, letters = set(v.tokens), "etaoinshrdlucmfwypvbgkqjxz"
    pieces = (SPACE + "".join(p) for k in (2, 3, 4) for p in itertools.product(letters, repeat=k))
    for piece in pieces:
        if len(v.tokens) >= n_vocab:
            break
        if piece not in known:
            v.tokens.append(piece)
            v.types.append(TOKEN_TYPE_NORMAL)
            v.scores.append(-20.0 - len(v.tokens) * 1e-4)
    if len(v.tokens) != n_vocab:
        raise ValueError(f"n_vocab {n_vocab} is not between 300 and the pieces there are")
    return v


def _nbytes(t: W) -> tuple[int, int]:
    """(bytes, GGML type) of tensor `t` as _tensor_data stores it."""
    qtype = gguf.GGMLQuantizationType[t.kind.upper()]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(t.shape[:-1]) * (t.shape[-1] // block) * size, qtype


def write_llama_1b(path: str | os.PathLike, wtype: str = "f16", seed: int = 0, d: Dims = TINYLLAMA_1B,
                   n_vocab: int = 32000, n_ctx: int = 2048, layer_std: float = 0.02) -> str:
    """A random-weight llama of TinyLlama 1.1B's shape (d; n_vocab tokens, an own output head), every
    matrix `wtype`: bench/bench_models.py's 1B bench model, llama-quantize's input. Written one tensor
    at a time (write_gguf holds them all in memory: 2.2 GB in f16); the same random draws as
    write_gguf would make of these tensors."""
    vocab = filler_spm_vocab(n_vocab)
    first, last = _ends(d, n_vocab, wtype, wtype)
    layers = _layers(d, lambda il: (wtype, wtype))
    for t in layers:
        t.std = layer_std
    tensors = first + layers + last
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("random-llama-1b")
    for key, value in _common_metadata("llama", d, n_ctx=n_ctx).items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(key, value)
    _write_vocab(w, vocab)
    for t in tensors:
        nbytes, qtype = _nbytes(t)
        raw = None if t.kind in ("f32", "f16") else qtype
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float16 if t.kind == "f16" else np.float32), nbytes, raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        data, _ = _tensor_data(rng, t)
        w.write_tensor_data(np.ascontiguousarray(data))
    w.close()
    return str(path)

if __name__ == "__main__":
    import sys

    print(write_tiny_model(sys.argv[2] if len(sys.argv) > 2 else "tiny.gguf", sys.argv[1] if len(sys.argv) > 1 else "llama"))
