"""Load test of `ggml-coordinator serve`: 1, 4 and 8 concurrent streaming
clients; aggregate tokens/s, p50/p99 time to first token, and the ratio of
8-client to 1-client throughput; and the prompt cache: the time to first
token of a long prompt (about 414 tokens) decoded whole (`cache_prompt:
false`) and sent again (its rows reused), all measured in one run; beside
each, llama.cpp's llama-server on the same model, slots and cores, measured
in the same run (interleaved with ours), and the ratios ours / llama-server.
A third server, ours in process (`serve --endpoints local --threads 2`: no
workers, the same two cores), tells the two parts of that ratio apart: what
our serving stack costs against llama-server's, and what spreading the model
over two processes costs on cores they share with everything else.

    python bench/bench_serve.py [--tokens 32] [--rounds 2] [--clients 1,4,8] [--parallel 8]
    python bench/bench_serve.py --clients 4 --tokens 64 --parallel 2   # issue #28's row

Starts two local workers (1 thread each) and the server on free loopback ports,
the in-process server (unless --no-in-process), and llama-server (`-t 2`: the
same two cores) when the llama.cpp reference is built (python
bench/llama_cpp_reference.py build; else ours only, saying so).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

import aiohttp

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"

# about 414 tokens of Gemma 3's tokenizer (the row prints the count the server reports)
LONG_PROMPT = " ".join(f"Paragraph {i}: the river runs past the old mill, the miller counts his sacks of grain, "
                       f"and the children race the water down to the bridge." for i in range(13))
PROMPTS = ["The capital of France is", "Once upon a time", "The best way to learn is", "My favourite food is",
           "Water boils at", "The sun is", "In 1990,", "A cat and a dog"]
OURS, THEIRS, IN_PROCESS = "ours", "llama-server", "ours in process"
REFERENCE_THREADS = 2  # llama-server's -t, and the in-process server's: the two cores our two 1-thread workers use
HEALTH_TIMEOUT = 120.0  # s for llama-server to load the model and answer /health 200


async def one_client(session, url: str, prompt: str, n_tokens: int) -> tuple[float, int]:
    """(time to first token, tokens generated) of one streaming completion. The tokens are the
    server's own count, usage.completion_tokens of the stream's last chunk (stream_options.include_usage:
    ours sends a last chunk with usage and no choices, llama-server's /v1/completions puts usage on its
    final chunk anyway); the count of chunks with text only if no usage came (one token per chunk on
    both, but a token that ends inside a UTF-8 character or a held stop string sends no text).
    ignore_eos on both (both honour it): every stream is max_tokens long, not cut at an end token."""
    started = time.perf_counter()
    ttft, n, usage = None, 0, {}
    body = {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}/v1/completions: {r.status} {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                if ev.get("choices") and ev["choices"][0]["text"]:
                    ttft = ttft or time.perf_counter() - started
                    n += 1
                usage = ev.get("usage") or usage
    return ttft or float("nan"), usage.get("completion_tokens", n)


async def round_of(url: str, clients: int, n_tokens: int) -> tuple[float, list[float], list[int]]:
    """(aggregate tokens/s, each client's time to first token, each client's tokens)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_client(s, url, PROMPTS[i % len(PROMPTS)], n_tokens)
                                         for i in range(clients)))
        elapsed = time.perf_counter() - started
    tokens = sum(n for _, n in results)
    return tokens / elapsed, [t for t, _ in results], [n for _, n in results]


async def long_prompt(url: str, cache_prompt: bool) -> tuple[float, dict]:
    """(time to first token, usage) of LONG_PROMPT, one streaming client."""
    body = {"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0, "stream": True, "cache_prompt": cache_prompt,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
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


def llama_server_command(binary: str, model: str, port: int, threads: int, parallel: int, ctx_per_slot: int,
                         help_text: str) -> list[str]:
    """llama-server as our serve is set up: the same GGUF, `parallel` slots of `ctx_per_slot` tokens each
    (-c is the total, split evenly over -np slots when the KV cache is not unified; ours:
    --parallel x --ctx-per-slot), flash attention over an f16 KV cache (ours), weights in plain CPU
    buffers (ours place none in CPU_REPACK; llama.cpp's repack also uses AMX, which dies of SIGILL
    on VMs that list AMX without granting it), --cache-reuse left at its default. Flags this
    llama-server's `--help` (help_text) does not list are left out."""
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-c", str(parallel * ctx_per_slot), "-np", str(parallel), "-fa", "on", "-ctk", "f16", "-ctv", "f16"]
    for flag in ("--no-kv-unified", "--no-repack", "--no-webui"):
        if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text):  # not --no-webui-mcp-proxy's prefix
            cmd.append(flag)
    return cmd


class LlamaServer:
    """llama-server on a free loopback port, healthy (a bounded wait), its output in /tmp/llama-server-PORT.log."""

    def __init__(self, cmd: list[str], port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/llama-server-{port}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:  # not healthy, or Ctrl-C while waiting: not left running
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        from coordinator.serving.llama_cpp_reference import describe_exit

        deadline = time.monotonic() + HEALTH_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited at start ({describe_exit(self.proc.returncode)}): "
                                   f"{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:  # not listening yet, or 503 while loading (HTTPError is an OSError)
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy within {HEALTH_TIMEOUT:g} s: {self.tail()}")
            time.sleep(0.2)

    def tail(self, n: int = 15) -> str:
        return "".join(open(self.log.name, errors="replace").readlines()[-n:])

    def stop(self) -> None:
        from conftest import stop_process
        stop_process(self.proc, 20)


def start_llama_server(args) -> tuple[LlamaServer | None, str]:
    """(llama-server, its command line) or (None, why not)."""
    from conftest import free_port
    from coordinator.model.default_model import default_model_path
    from coordinator.serving.llama_cpp_reference import bin_dir, missing

    why = missing("llama-server")
    if why:
        return None, why
    binary = str(bin_dir() / "llama-server")
    help_run = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    port = free_port()
    cmd = llama_server_command(binary, default_model_path(), port, REFERENCE_THREADS, args.parallel,
                               args.ctx_per_slot, help_run.stdout + help_run.stderr)
    try:
        return LlamaServer(cmd, port), " ".join(cmd)
    except RuntimeError as exc:
        return None, str(exc)


def _clients(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated client counts >= 1, e.g. 1,4,8")
    return levels


def our_split_mode(url: str) -> str:
    """The split our serve runs with (/props' split.split_mode): what auto chose, by default."""
    with urllib.request.urlopen(url + "/props", timeout=10) as r:
        return json.load(r)["split"]["split_mode"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens of each client's stream (ignore_eos)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=_clients, default=(1, 4, 8), metavar="N,N,...",
                    help="concurrent streaming clients, one row each (default 1,4,8)")
    ap.add_argument("--parallel", type=int, default=8,
                    help="slots of both servers: serve --parallel, llama-server -np (default 8)")
    ap.add_argument("--ctx-per-slot", type=int, default=1024,
                    help="each slot's context on both (serve --ctx-per-slot; llama-server -c is this x --parallel)")
    ap.add_argument("--split-mode", choices=("layer", "tensor", "auto"), default=None,
                    help="our serve's --split-mode (default: serve's own default)")
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="ours only: no llama-server row")
    ap.add_argument("--no-in-process", dest="in_process", action="store_false",
                    help="no row of ours in process (serve --endpoints local --threads 2)")
    return ap.parse_args(argv)


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(0.99 * (len(values) - 1))))]


def round_ratio(a: list, b: list) -> float:
    """The median over the rounds of a's tokens/s / b's (each round's pair measured back to back)."""
    return statistics.median(x[0] / y[0] for x, y in zip(a, b))


def table(rows: dict, ratio_to: dict | None = None, ratio_name: str = "ours/llama-server tokens/s") -> dict:
    """Print the clients table of `rows` ({clients: [(tps, ttfts, counts) per round]}); with ratio_to
    (the other server's rows of the same rounds) a last column, `ratio_name`: the median of the
    per-round ratios ratio_to / rows (each round's pair measured back to back). Returns {clients:
    median tokens/s}."""
    print(f"{'clients':>7} {'tokens/s':>10} {'ttft p50 ms':>12} {'ttft p99 ms':>12}"
          + (f" {ratio_name:>27}" if ratio_to else ""))
    agg = {}
    for clients, rs in rows.items():
        agg[clients] = statistics.median(r[0] for r in rs)
        ttfts = [t for r in rs for t in r[1]]
        line = f"{clients:>7} {agg[clients]:>10.1f} {statistics.median(ttfts) * 1e3:>12.1f} {_p99(ttfts) * 1e3:>12.1f}"
        if ratio_to:
            line += f" {round_ratio(ratio_to[clients], rs):>27.2f}"
        print(line)
    return agg


def repeat_line(label: str, repeat: list) -> tuple[float, float]:
    first = statistics.median(r[0] for r in repeat)
    again = statistics.median(r[1] for r in repeat)
    n_prompt = repeat[-1][2].get("prompt_tokens")
    cached = [(r[3].get("prompt_tokens_details") or {}).get("cached_tokens") for r in repeat]
    print(f"{label}repeated prompt ({n_prompt} tokens): ttft first {first * 1e3:.1f} ms (cache_prompt false), "
          f"again {again * 1e3:.1f} ms ({'/'.join(map(str, cached))} cached), ratio {again / first:.3f} "
          f"(target <= 0.15: {'met' if again / first <= 0.15 else 'MISSED'})")
    return first, again


def short_streams(label: str, rows: dict, n_tokens: int) -> None:
    """Say so if any stream generated other than max_tokens tokens (ignore_eos should prevent it)."""
    odd = sorted({n for rs in rows.values() for r in rs for n in r[2] if n != n_tokens})
    if odd:
        print(f"note: {label} streams of {'/'.join(map(str, odd))} tokens, not {n_tokens} (counted in tokens/s)")


def gap_lines(rows: dict, clients: int) -> list[str]:
    """With `clients` streams: ours / llama-server split into its two factors, our serving
    stack in process against llama-server, and the workers against in process."""
    ours, inproc, ref = rows.get(OURS, {}), rows.get(IN_PROCESS, {}), rows.get(THEIRS, {})
    lines = []
    if clients in inproc and clients in ref:
        lines.append(f"ours in process / llama-server ({clients} clients): {round_ratio(inproc[clients], ref[clients]):.2f}"
                     " (the serving stack: the same cores and slots; ggml's kernels but for our build's edits,"
                     " docs/architecture.md \"Kernels\")")
    if clients in inproc and clients in ours:
        lines.append(f"ours over 2 workers / ours in process ({clients} clients): "
                     f"{round_ratio(ours[clients], inproc[clients]):.2f} (two 1-thread workers against one 2-thread "
                     "process on these shared cores: the hops through the workers and a tensor split's exchanges "
                     "against each member's share of every product)")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(TESTS))
    from conftest import DaemonProcess  # noqa: E402
    from http_helpers import Server  # noqa: E402

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill runs the finally below: nothing left running
    load_before = os.getloadavg()
    running, theirs, note = [], None, "not asked (--no-reference)"
    try:
        workers = [DaemonProcess("-t", "1"), DaemonProcess("-t", "1")]
        running += workers
        server = Server([w.endpoint for w in workers], parallel=args.parallel,
                        args=("--ctx-per-slot", str(args.ctx_per_slot),
                              *(("--split-mode", args.split_mode) if args.split_mode else ())))
        running.append(server)
        inproc = None
        if args.in_process:
            inproc = Server(["local"], parallel=args.parallel,
                            args=("--ctx-per-slot", str(args.ctx_per_slot), "--threads", str(REFERENCE_THREADS)))
            running.append(inproc)
        if args.reference:
            theirs, note = start_llama_server(args)
            if theirs is not None:
                running.append(theirs)
        urls = {OURS: server.url, **({IN_PROCESS: inproc.url} if inproc else {}),
                **({THEIRS: theirs.url} if theirs else {})}
        split_mode = our_split_mode(server.url)
        for url in urls.values():
            asyncio.run(round_of(url, 2, 4))  # warm up: graphs sent to the workers, llama-server's first batches
        rows = {name: {} for name in urls}
        for i in range(args.rounds):  # interleaved so every level and both servers see the same machine load;
            order = list(urls) if i % 2 == 0 else list(urls)[::-1]  # who goes first alternates by round
            for clients in args.clients:
                for name in order:
                    rows[name].setdefault(clients, []).append(asyncio.run(round_of(urls[name], clients,
                                                                                   args.tokens)))
            for name in (n for n in order if n != IN_PROCESS):  # the prompt cache: ours and llama-server's
                first, usage = asyncio.run(long_prompt(urls[name], False))  # decoded whole (and now in a slot)
                again, usage_again = asyncio.run(long_prompt(urls[name], True))  # the same prompt again
                rows[name].setdefault("repeat", []).append((first, again, usage, usage_again))
    finally:
        for proc in reversed(running):
            proc.stop()
    ours = rows[OURS]
    repeat = ours.pop("repeat")
    print(f"ours: ggml-coordinator serve, split mode {split_mode}"
          + (" (chosen by --split-mode auto, serve's default)" if args.split_mode in (None, "auto") else ""))
    agg = table(ours)
    if 1 in agg and 8 in agg:
        print(f"throughput ratio 8 clients / 1 client: {agg[8] / agg[1]:.2f}")
    elif len(agg) > 1:
        lo, hi = min(agg), max(agg)
        print(f"throughput ratio {hi} clients / {lo} client{'s' if lo > 1 else ''}: {agg[hi] / agg[lo]:.2f}")
    first, again = repeat_line("", repeat)
    short_streams("our", ours, args.tokens)
    if IN_PROCESS in rows:
        print(f"ours in process (serve --endpoints local --threads {REFERENCE_THREADS}), same run, interleaved:")
        table(rows[IN_PROCESS], ratio_to=ours, ratio_name="workers/in process")
        short_streams("in-process", rows[IN_PROCESS], args.tokens)
    if theirs is None:
        print(f"llama-server reference row skipped: {note}")
    else:
        ref = rows[THEIRS]
        ref_repeat = ref.pop("repeat")
        print(f"llama-server, same run, interleaved: {note}")
        ref_agg = table(ref, ratio_to=ours)
        ref_first, ref_again = repeat_line("llama-server ", ref_repeat)
        short_streams("llama-server", ref, args.tokens)
        print(f"ours / llama-server repeated prompt ttft: first {first / ref_first:.2f}, again {again / ref_again:.2f}")
        if 4 in agg:
            r4 = round_ratio(ours[4], ref[4])
            issue = args.tokens == 64 and args.parallel == 2
            print(f"target: 4 concurrent {args.tokens}-token streams on {args.parallel} slots, aggregate tokens/s "
                  f"ours {agg[4]:.1f} vs llama-server {ref_agg[4]:.1f} (medians), ours/llama-server {r4:.2f} "
                  f"(median of the rounds' ratios; >= 1: {'met' if r4 >= 1 else 'MISSED'})"
                  + ("" if issue else "; issue #28's row is --clients 4 --tokens 64 --parallel 2"))
    for line in gap_lines(rows, 4 if 4 in agg else max(agg)):
        print(line)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
