"""`ggml-coordinator generate`: one prompt's text to stdout as it is
generated, then a summary (tokens/s, each worker's share) to stderr."""
from __future__ import annotations

import sys
import time

from coordinator.api import Coordinator
from coordinator.serving.cluster_setup import cannot_start, endpoints_for, resume_options, security_options
from rpc_daemon.service.logs import say

EXIT_DECODE_FAILED = 2


def cmd_generate(args) -> int:
    from coordinator import DecodeError

    with endpoints_for(args) as endpoints:
        try:
            c = Coordinator(endpoints, model=args.model, split=args.split, n_ctx=args.ctx_size,
                            **security_options(args), threads=args.threads, progress=sys.stderr.isatty(),
                            head_split=args.head_split, step_links=args.step_links,
                            step_channels=args.step_channels,
                            micro_batch=args.micro_batch, split_mode=args.split_mode, tensor_group=args.tensor_group,
                            exact_sums=args.exact_sums,
                            cache_type_k=args.cache_type_k,
                            cache_type_v=args.cache_type_v, **resume_options(args), warmup=args.warmup)
        except (ConnectionError, OSError, ValueError) as exc:
            return cannot_start(exc)
        with c:
            started, n = time.perf_counter(), 0
            generated0 = c.stats["generated"]
            first = None  # (seconds, tokens) when the first piece came: the prompt's step and the first token
            try:
                for piece in c.stream(args.prompt, max_tokens=args.n_predict, temperature=args.temp,
                                      top_k=args.top_k, top_p=args.top_p, seed=args.seed):
                    if first is None:
                        first = (time.perf_counter() - started, c.stats["generated"] - generated0)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except DecodeError as exc:
                say(f"generation failed: {exc}", "error", new_line=True)
                return EXIT_DECODE_FAILED
            elapsed = time.perf_counter() - started
            n = c.stats["generated"] - generated0
            # the rate after the first piece, as llama.cpp's "eval" line: the prompt's step (and a new
            # prompt length's first graphs) not in it
            after = (n - first[1], elapsed - first[0]) if first and n > first[1] else None
            n_layer = c.hp.n_layer
            share = ", ".join(f"{e['endpoint']} " + (
                f"shard {e['shard']['rank'] + 1}/{e['shard']['of']} of "  # tensor-parallel
                + ("every layer" if e["layers"] == [0, n_layer] else f"layers {e['layers'][0]}-{e['layers'][1] - 1}")
                if e.get("shard") else f"layers {e['layers'][0]}-{e['layers'][1] - 1} "
                                       f"({(e['layers'][1] - e['layers'][0]) / n_layer:.0%})")
                + (f" head {(e['head_rows'][1] - e['head_rows'][0]) / c.hp.n_vocab:.0%}" if e["head_rows"] else "")
                for e in c.endpoints())
            sums = (c.health().get("split_choice") or {}).get("sums")  # the tensor split's: exact or split
            if args.log_format == "json":
                say("generated", tokens=n, seconds=round(elapsed, 3), tokens_per_second=round(n / elapsed, 1),
                    first_piece_seconds=round(first[0], 3) if first else None,
                    tokens_per_second_after_first=round(after[0] / after[1], 1) if after else None,
                    endpoints=c.endpoints(), sums=sums)
            else:
                rate = f", {after[0] / after[1]:.1f} after the first" if after else ""
                print(f"\n[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tokens/s{rate}; {share}"
                      f"{f'; {sums} sums' if sums else ''}]", file=sys.stderr)
    return 0
