"""Perplexity of a model over a text, by llama-perplexity's method, in process.

    python bench/perplexity.py [--model PATH] [--file /usr/share/common-licenses/GPL-3]
                               [--ctx 512] [--chunks N] [--threads 1]
                               [--endpoints HOST:PORT,... [--split-mode layer|tensor|auto [--[no-]exact-sums]]]
                               [-ctk f16|q8_0|q4_0] [-ctv f16|q8_0|q4_0]

llama-perplexity's method (tools/perplexity/perplexity.cpp, perplexity()): the
text is tokenized once (with BOS when the model adds one); it is cut into
chunks of n_ctx tokens; each chunk is decoded from an empty KV cache with its
first token replaced by BOS; the tokens of its second half are scored
(first = n_ctx / 2): -log softmax(logits[i])[token[i + 1]]; the perplexity is
exp of the mean over all scored tokens. Prints it with the libggml that ran
(compare libraries with GGML_DISTRIBUTED_GGML=wheel).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator import Batch, Coordinator  # noqa: E402
from ggml_ffi import describe  # noqa: E402


def perplexity(c: Coordinator, tokens: list[int], n_ctx: int, n_chunks: int, bos: int | None) -> tuple[float, int]:
    nll, count = 0.0, 0
    first = n_ctx // 2
    for k in range(n_chunks):
        chunk = list(tokens[k * n_ctx:(k + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        c.kv_clear()
        code = c.decode(Batch.single(chunk, 0, all_logits=True))
        if code != 0:
            raise RuntimeError(f"decode failed: {code!r}")
        for i in range(first, n_ctx - 1):
            logits = c.logits(i).astype(np.float64)
            m = logits.max()
            nll += m + math.log(np.exp(logits - m).sum()) - logits[chunk[i + 1]]
            count += 1
        print(f"[{k + 1}] {math.exp(nll / count):.4f}", file=sys.stderr, flush=True)
    return math.exp(nll / count), count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--file", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=0, help="0: every whole chunk of the text")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--endpoints", default="local", help="comma-separated host:port workers (default: in process)")
    p.add_argument("--split-mode", default="layer", choices=("layer", "tensor", "auto"))
    p.add_argument("--exact-sums", action=argparse.BooleanOptionalAction, default=None,
                   help="with a tensor split: exact sums (the default where they can be), or with "
                        "--no-exact-sums split sums")
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=("f16", "q8_0", "q4_0"))
    p.add_argument("-ctv", "--cache-type-v", default="f16", choices=("f16", "q8_0", "q4_0"))
    args = p.parse_args(argv)
    text = open(args.file, encoding="utf-8").read()
    with Coordinator(args.endpoints.split(","), model=args.model, n_ctx=args.ctx, n_batch=args.ctx,
                     threads=args.threads, split_mode=args.split_mode, exact_sums=args.exact_sums,
                     cache_type_k=args.cache_type_k,
                     cache_type_v=args.cache_type_v) as c:
        tokens = c.tokenize(text, add_special=True)
        bos = tokens[0] if c.tokenize("", add_special=True) else None
        n_chunks = len(tokens) // args.ctx
        if args.chunks:
            n_chunks = min(n_chunks, args.chunks)
        t = time.perf_counter()
        ppl, n = perplexity(c, tokens, args.ctx, n_chunks, bos)
        took = time.perf_counter() - t
    lib = describe()
    print(f"perplexity {ppl:.6f} over {n} tokens ({n_chunks} chunks of {args.ctx}, {len(tokens)} tokens of "
          f"{args.file}); ggml {lib['ggml_version']} ({lib['origin']}, {lib['cpu_variant']}); {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
