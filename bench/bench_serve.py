"""Load test of `ggml-coordinator serve`: 1, 4 and 8 concurrent streaming
clients; aggregate tokens/s, p50/p99 time to first token, and the ratio of
8-client to 1-client throughput; and the prompt cache: the time to first
token of a long prompt (about 414 tokens) decoded whole (`cache_prompt:
false`) and sent again (its rows reused), all measured in one run.

    python bench/bench_serve.py [--tokens 32] [--rounds 2]

Starts two local workers (1 thread each) and the server on free loopback ports.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import time

import aiohttp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from conftest import DaemonProcess  # noqa: E402
from http_helpers import Server  # noqa: E402

# about 414 tokens of Gemma 3's tokenizer (the row prints the count the server reports)
LONG_PROMPT = " ".join(f"Paragraph {i}: the river runs past the old mill, the miller counts his sacks of grain, "
                       f"and the children race the water down to the bridge." for i in range(13))
PROMPTS = ["The capital of France is", "Once upon a time", "The best way to learn is", "My favourite food is",
           "Water boils at", "The sun is", "In 1990,", "A cat and a dog"]


async def one_client(session, url: str, prompt: str, n_tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    ttft, n = None, 0
    body = {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                if ev.get("choices") and ev["choices"][0]["text"]:
                    ttft = ttft or time.perf_counter() - started
                    n += 1
    return ttft or float("nan"), n


async def round_of(url: str, clients: int, n_tokens: int) -> tuple[float, list[float]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_client(s, url, PROMPTS[i % len(PROMPTS)], n_tokens)
                                         for i in range(clients)))
        elapsed = time.perf_counter() - started
    tokens = sum(n for _, n in results)
    return tokens / elapsed, [t for t, _ in results]


async def long_prompt(url: str, cache_prompt: bool) -> tuple[float, dict]:
    """(time to first token, usage) of LONG_PROMPT, one streaming client."""
    body = {"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0, "stream": True, "cache_prompt": cache_prompt,
            "stream_options": {"include_usage": True}}
    ttft, usage = None, {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        started = time.perf_counter()
        async with s.post(url + "/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    ev = json.loads(line[6:])
                    if ev.get("choices") and ev["choices"][0]["text"]:
                        ttft = ttft or time.perf_counter() - started
                    usage = ev.get("usage") or usage
    return ttft or float("nan"), usage


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    load_before = os.getloadavg()
    workers = [DaemonProcess("-t", "1"), DaemonProcess("-t", "1")]
    server = Server([w.endpoint for w in workers], parallel=8, args=("--ctx-per-slot", "1024"))
    try:
        asyncio.run(round_of(server.url, 2, 4))  # warm up: graphs sent to the workers
        rows = {}
        for _ in range(args.rounds):  # interleaved so every level sees the same machine load
            for clients in (1, 4, 8):
                tps, ttfts = asyncio.run(round_of(server.url, clients, args.tokens))
                rows.setdefault(clients, []).append((tps, ttfts))
            first, usage = asyncio.run(long_prompt(server.url, False))  # decoded whole (and now in a slot)
            again, usage_again = asyncio.run(long_prompt(server.url, True))  # the same prompt again
            rows.setdefault("repeat", []).append((first, again, usage, usage_again))
    finally:
        server.stop()
        for w in workers:
            w.stop()
    print(f"{'clients':>7} {'tokens/s':>10} {'ttft p50 ms':>12} {'ttft p99 ms':>12}")
    agg = {}
    repeat = rows.pop("repeat")
    for clients, rs in rows.items():
        agg[clients] = statistics.median(r[0] for r in rs)
        ttfts = sorted(t for r in rs for t in r[1])
        p99 = ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))]
        print(f"{clients:>7} {agg[clients]:>10.1f} {statistics.median(ttfts) * 1e3:>12.1f} {p99 * 1e3:>12.1f}")
    print(f"throughput ratio 8 clients / 1 client: {agg[8] / agg[1]:.2f}")
    first = statistics.median(r[0] for r in repeat)
    again = statistics.median(r[1] for r in repeat)
    n_prompt = repeat[-1][2].get("prompt_tokens")
    cached = [r[3].get("prompt_tokens_details", {}).get("cached_tokens") for r in repeat]
    print(f"repeated prompt ({n_prompt} tokens): ttft first {first * 1e3:.1f} ms (cache_prompt false), "
          f"again {again * 1e3:.1f} ms ({'/'.join(map(str, cached))} cached), ratio {again / first:.3f} "
          f"(target <= 0.15: {'met' if again / first <= 0.15 else 'MISSED'})")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
