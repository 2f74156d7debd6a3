"""A tiny `llama` GGUF with random weights, written with the `gguf` package.

n_embd 64, 4 layers, 4 heads with 2 KV heads (GQA), n_ff 128, a 300-token
SentencePiece-style vocabulary (<unk>, <s>, </s>, the 256 byte tokens and
"▁"-prefixed word pieces with scores), f32 norms, weights in f32, f16 and q8_0.
Weights are scaled (std 0.02..0.1, a stronger token embedding and output head)
so activations stay sane and greedy generation moves between many tokens.
"""
from __future__ import annotations

import os

import numpy as np
import gguf

N_EMBD = 64
N_LAYER = 4
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 128
N_CTX_TRAIN = 256
N_VOCAB = 300

TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_BYTE = 1, 2, 3, 6
SPACE = "\u2581"

_WORDS = ("the capital of france is paris a an and to in that it was for on are with as his they be at "
          "one have this from or had by hot word but what some we can out other were all there when up "
          "use your how said each she which do their time if will way about many then them write would "
          "like so these her long make thing see him two has look more day could go come did number "
          "sound no most people my over know water than call first who may down side been now find").split()


def tiny_vocab(n_vocab: int = N_VOCAB) -> tuple[list[str], list[float], list[int]]:
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


def write_tiny_llama(path: str | os.PathLike, seed: int = 0, head: str = "own") -> str:
    """head: "own" (an output.weight of its own), "tied" (none: the token embedding
    is the output head, as gemma's), or "ties" (output.weight whose rows repeat
    every 50 tokens, so every logit is tied with those of 5 other token ids), or
    "nan" (output.weight whose row 260 is NaN: that logit is NaN in every step)."""
    if head not in ("own", "tied", "ties", "nan"):
        raise ValueError(head)
    rng = np.random.default_rng(seed)
    tokens, scores, types = tiny_vocab()
    n_vocab = len(tokens)

    def mat(rows: int, cols: int, std: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def norm_weight() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(N_EMBD)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random-llama")
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)

    q8 = gguf.GGMLQuantizationType.Q8_0

    def add(name: str, x: np.ndarray, kind: str) -> None:
        if kind == "f32":
            w.add_tensor(name, x.astype(np.float32))
        elif kind == "f16":
            w.add_tensor(name, x.astype(np.float16))
        elif kind == "q8_0":
            with np.errstate(invalid="ignore"):  # head="nan": a NaN row quantizes to a NaN scale
                w.add_tensor(name, gguf.quants.quantize(x, q8), raw_dtype=q8)
        else:
            raise ValueError(kind)

    # numpy shapes are (rows, cols) = ggml ne reversed: a weight is (n_out, n_in)
    add("token_embd.weight", mat(n_vocab, N_EMBD, 1.0), "f16")
    n_kv = N_HEAD_KV * HEAD_DIM
    for il in range(N_LAYER):
        p = f"blk.{il}."
        # alternate the storage types so every layer range of a split sees more than one
        big, small = ("q8_0", "f16") if il % 2 == 0 else ("f16", "f32")
        add(p + "attn_norm.weight", norm_weight(), "f32")
        add(p + "attn_q.weight", mat(N_EMBD, N_EMBD, 0.1), big)
        add(p + "attn_k.weight", mat(n_kv, N_EMBD, 0.1), small)
        add(p + "attn_v.weight", mat(n_kv, N_EMBD, 0.1), big)
        add(p + "attn_output.weight", mat(N_EMBD, N_EMBD, 0.05), small)
        add(p + "ffn_norm.weight", norm_weight(), "f32")
        add(p + "ffn_gate.weight", mat(N_FF, N_EMBD, 0.1), big)
        add(p + "ffn_up.weight", mat(N_FF, N_EMBD, 0.1), small)
        add(p + "ffn_down.weight", mat(N_EMBD, N_FF, 0.05), big)
    add("output_norm.weight", norm_weight(), "f32")
    if head == "own":
        add("output.weight", mat(n_vocab, N_EMBD, 0.3), "q8_0")
    elif head == "nan":
        out = mat(n_vocab, N_EMBD, 0.3)
        out[260] = np.nan
        add("output.weight", out, "q8_0")
    elif head == "ties":
        add("output.weight", mat(50, N_EMBD, 0.3)[np.arange(n_vocab) % 50], "q8_0")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


if __name__ == "__main__":
    import sys

    print(write_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama.gguf"))
