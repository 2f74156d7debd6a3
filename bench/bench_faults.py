"""Fault detection latency, and what the liveness mechanism costs.

    python bench/bench_faults.py [--reps N] [--liveness S] [--model PATH|tiny] [--tg N]

Starts two workers on 127.0.0.1 (A: first half of the layers, B: second half,
the one that returns logits), with a tensor cache so reconnecting is cheap,
and prints:

  (a) detection latency of a kill -9 and of a SIGSTOP of worker B, sent from
      another thread at a random moment while decodes run back to back:
      from the signal to the decode that returns ENDPOINT_FAILED; median and
      max over --reps, next to the configured bound (--liveness, default 2 s:
      the Coordinator's default). After each repetition B is restarted on its
      port and the coordinator reconnect()s.
  (b) tg throughput (a 16-token prompt, then --tg single-token decodes, greedy)
      with the liveness pings on (default settings) and off
      (liveness_timeout=None, which exists for this measurement), interleaved,
      median of --reps; the ratio on/off, and how many pings the "on" runs sent.
      A third row pings every 5 ms (liveness 20 ms) to show the cost of pings
      that actually fire.

Every loop is bounded; with the bundled Gemma 3 270M it takes about a minute.

    python bench/bench_faults.py --resume [--reps N] [--faults N] [--model PATH|tiny]

measures resuming instead (Coordinator(resume_within=...), two workers A and B
plus one spare S, every one with a tensor cache):

  (c) kill -9 of B at a random token of a stream, B restarted on its port
      0.5 s later: the text against the fault-free one, the pause (from the
      kill to the next piece of text), how long B took to listen again, and
      the pause after that (reconnect with its upload from the cache, replay)
      and the replay alone.
  (d) kill -9 of the worker holding the second stage, no restart: the spare
      takes over (after spare_after, 1 s); the pause, the upload and the
      replay. The killed worker is restarted afterwards; the stage moves back
      to it before the next repetition.
  (e) `ggml-coordinator serve` with the same three workers, 4 concurrent
      greedy streams and --faults randomized faults (kill -9 with a restart
      after 0.2-1.5 s, kill -9 without one, SIGSTOP with SIGCONT after 1-3 s)
      at a random moment of each round, on a random worker holding a stage:
      error events and texts that differ from the fault-free round's.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import signal
import statistics
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # DaemonProcess lives in the tests' conftest

from conftest import DaemonProcess, WorkerSet  # noqa: E402
from coordinator.api import Batch, Coordinator, DecodeResult  # noqa: E402

PROMPT_TOKENS = 16


def tg_run(c: Coordinator, n_tg: int) -> float:
    """Tokens/s of n_tg single-token greedy decodes after a short prompt."""
    c.kv_clear()
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    assert c.decode(Batch.single(prompt, 0)) == DecodeResult.OK, c.last_error
    tok, pos = int(c.logits(-1).argmax()), PROMPT_TOKENS
    t = time.perf_counter()
    for _ in range(n_tg):
        code = c.decode(Batch.single([tok], pos))
        assert code == DecodeResult.OK, c.last_error
        tok, pos = int(c.logits(-1).argmax()), pos + 1
    return n_tg / (time.perf_counter() - t)


def detection(c: Coordinator, b: DaemonProcess, sig: int, rng: random.Random, budget: float) -> float:
    """Decode back to back; another thread sends `sig` to B after a random
    0.05-0.3 s. Returns seconds from the signal to the failing decode's return."""
    c.kv_clear()
    sent: list[float] = []

    def shoot():
        time.sleep(rng.uniform(0.05, 0.3))
        sent.append(time.monotonic())
        b.signal(sig)

    threading.Thread(target=shoot, daemon=True).start()
    prompt = list(range(100, 100 + PROMPT_TOKENS))
    pos, tok = 0, prompt
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline:
        if pos + len(tok) >= c.n_ctx:
            c.kv_clear()
            pos, tok = 0, prompt
        code = c.decode(Batch.single(tok, pos))
        if code != DecodeResult.OK:
            done = time.monotonic()
            assert code == DecodeResult.ENDPOINT_FAILED, (code, c.last_error)
            assert sent, "failed before the signal was sent"
            return done - sent[0]
        pos += len(tok)
        tok = [int(c.logits(-1).argmax())]
    raise RuntimeError(f"no failure detected within {budget} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--liveness", type=float, default=2.0, help="detection bound, seconds (default 2, the default)")
    ap.add_argument("--model", default=None, help="GGUF path, or 'tiny' (default: the bundled Gemma 3 270M)")
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--resume", action="store_true", help="measure resuming (c, d, e) instead of (a, b)")
    ap.add_argument("--faults", type=int, default=20, help="--resume: faults injected into the HTTP server")
    args = ap.parse_args()
    model = args.model
    tmp = tempfile.TemporaryDirectory(prefix="bench-faults-")
    if model == "tiny":
        from tiny_models import write_tiny_llama
        model = write_tiny_llama(pathlib.Path(tmp.name) / "tiny.gguf", seed=0)
    cache = str(pathlib.Path(tmp.name) / "cache")
    wargs = ("-t", str(args.threads), "--cache", cache)
    if args.resume:
        try:
            return resume_bench(args, model, cache)
        finally:
            tmp.cleanup()
    a = DaemonProcess(*wargs)
    b = DaemonProcess(*wargs)
    port_b = b.port
    coords: dict[str, Coordinator] = {}
    rng = random.Random(0)
    try:
        c = Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=256, threads=args.threads,
                        liveness_timeout=args.liveness)
        coords["detect"] = c
        lat: dict[str, list[float]] = {"kill -9": [], "SIGSTOP": []}
        for _ in range(args.reps):
            for name, sig in (("kill -9", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
                lat[name].append(detection(c, b, sig, rng, budget=args.liveness + 30))
                b.kill()
                b = DaemonProcess(*wargs, port=port_b)
                c.reconnect()
        # (b) liveness cost: on (defaults), off, and pinging every 5 ms
        coords["on"] = Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=256,
                                   threads=args.threads)
        coords["off"] = Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=256,
                                    threads=args.threads, liveness_timeout=None)
        coords["ping 5 ms"] = Coordinator([a.endpoint, b.endpoint], model=model, split=[1, 1], n_ctx=256,
                                          threads=args.threads, liveness_timeout=0.02)
        names = ["on", "off", "ping 5 ms"]
        for n in names:
            tg_run(coords[n], 4)  # warm up: graphs sent, compute processes started
        pings0 = {n: sum(p.executor.client.pings_sent for p in coords[n]._places) for n in names}
        tps: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.reps):
            for n in names:  # interleaved, so all see the same machine load
                tps[n].append(tg_run(coords[n], args.tg))
        pings = {n: sum(p.executor.client.pings_sent for p in coords[n]._places) - pings0[n] for n in names}
    finally:
        for co in coords.values():
            co.close()
        for d in (a, b):
            d.stop()
            d.kill()
        tmp.cleanup()

    print(f"model: {model or 'bundled Gemma 3 270M'}; two workers, faults on the second; {args.reps} repetitions")
    print(f"\n(a) detection latency, signal -> decode returns ENDPOINT_FAILED (bound {args.liveness:g} s)")
    print(f"    {'fault':<10} {'median':>9} {'max':>9} {'bound':>9}")
    for name, xs in lat.items():
        bound = "-" if name == "kill -9" else f"{args.liveness:.3f}"
        print(f"    {name:<10} {statistics.median(xs):>9.3f} {max(xs):>9.3f} {bound:>9}")
    med = {n: statistics.median(v) for n, v in tps.items()}
    print(f"\n(b) tg{args.tg} throughput, median of {args.reps} (tokens/s)")
    print(f"    {'liveness':<10} {'t/s':>9} {'vs off':>9} {'pings':>9}")
    for n in names:
        print(f"    {n:<10} {med[n]:>9.1f} {med[n] / med['off']:>9.3f} {pings[n]:>9}")
    return 0


PROMPT = "The capital of France is"  # --model tiny: "water" (its greedy text runs on)
RESUME_TOKENS = 48
HTTP_PROMPTS = ("The capital of France is", "Once upon a time", "Water boils at", "My favourite food is")


def baseline(c: Coordinator) -> tuple[str, int]:
    """The fault-free text of the stream, and its number of pieces."""
    c.generate(PROMPT, max_tokens=4)  # warm: graphs sent
    started = time.perf_counter()
    pieces = list(c.stream(PROMPT, max_tokens=RESUME_TOKENS))
    print(f"fault-free stream: {(time.perf_counter() - started) / RESUME_TOKENS * 1000:.1f} ms a token",
          file=sys.stderr)
    if len(pieces) < 4:
        raise SystemExit(f"the model stops after {len(pieces)} pieces of {PROMPT!r}: too few to fault")
    return "".join(pieces), len(pieces)


def faulted_stream(c: Coordinator, at: int, fault) -> tuple[str, float, float]:
    """The text of a stream with `fault()` run after piece `at`; the kill time and the next piece's time."""
    pieces, killed, resumed = [], 0.0, 0.0
    for i, piece in enumerate(c.stream(PROMPT, max_tokens=RESUME_TOKENS)):
        pieces.append(piece)
        if i == at:
            killed = time.monotonic()
            fault()
        elif killed and not resumed:
            resumed = time.monotonic()
    return "".join(pieces), killed, resumed


def resume_bench(args, model, cache) -> int:
    from coordinator.api import Coordinator as C

    global PROMPT
    if model and model.endswith("tiny.gguf"):
        PROMPT = "water"
    rng = random.Random(1)
    w = WorkerSet(cache, 3)
    rows_c, rows_d, http = [], [], None
    try:
        with C([w.endpoint(0), w.endpoint(1)], model=model, split=[1, 1], n_ctx=256, threads=args.threads,
               resume_within=30, spares=[w.endpoint(2)], spare_after=10.0) as c:
            want, n = baseline(c)
            for _ in range(args.reps):  # (c) kill -9, restart after 0.5 s: B comes back (spare_after is 10 s)
                stats0 = dict(c.stats)
                text, killed, resumed = faulted_stream(c, rng.randint(1, n - 2), lambda: w.kill(1, 0.5))
                w.join()
                back = w.listening[-1]
                replay = c.stats["replay_seconds"] - stats0["replay_seconds"]
                rows_c.append((text == want, resumed - killed, back - killed, resumed - back,
                               c.stats["reconnect_seconds"] - stats0.get("reconnect_seconds", 0.0), replay,
                               c.stats["replayed_tokens"] - stats0["replayed_tokens"], resumed - killed - replay))
        with C([w.endpoint(0), w.endpoint(1)], model=model, split=[1, 1], n_ctx=256, threads=args.threads,
               resume_within=30, spares=[w.endpoint(2)]) as c:
            want, n = baseline(c)
            for _ in range(args.reps):  # (d) kill -9 of the second stage's worker, no restart: a spare takes it
                holder = w.index(c.endpoints()[1]["endpoint"])
                stats0 = dict(c.stats)
                text, killed, resumed = faulted_stream(c, rng.randint(1, n - 2), lambda: w.kill(holder))
                took_over = c.endpoints()[1]["endpoint"] != w.endpoint(holder)
                upload = c.stats["reconnect_seconds"] - stats0.get("reconnect_seconds", 0.0)
                replay = c.stats["replay_seconds"] - stats0["replay_seconds"]
                rows_d.append((text == want and took_over, resumed - killed, upload, replay,
                               c.stats["replayed_tokens"] - stats0["replayed_tokens"], resumed - killed - upload - replay))
                w.restart(holder)  # back: the stage moves back to it (HOME_EVERY), the spare is free again
                deadline = time.monotonic() + 30
                while c.health()["status"] != "ok" and time.monotonic() < deadline:
                    time.sleep(0.1)
                c.generate(PROMPT, max_tokens=1)  # after the move's replay (health is ok before it ends)
        http = http_faults(args, model, w, rng) if args.faults else None
    finally:
        w.close()
    print(f"model: {model or 'bundled Gemma 3 270M'}; workers A, B and spare S on loopback; "
          f"{RESUME_TOKENS}-token greedy streams")
    print("\n(c) kill -9 of B, restarted on its port 0.5 s later (seconds)")
    print(f"    {'same text':>9} {'pause':>7} {'B back':>7} {'after':>7} {'upload':>7} {'replay':>7} {'tokens':>7}"
          f" {'-replay':>7}")
    for same, pause, back, after, upload, replay, tokens, rest in rows_c:
        print(f"    {str(same):>9} {pause:>7.3f} {back:>7.3f} {after:>7.3f} {upload:>7.3f} {replay:>7.3f} {tokens:>7}"
              f" {rest:>7.3f}")
    print("    pause: kill -> next piece; B back: kill -> B listening again; after: B listening -> next piece;")
    print("    upload: connect and weights (tensor cache); replay: rebuilding the KV cache; -replay: pause - replay")
    print("    (the target: -replay <= 1 s)")
    print("\n(d) kill -9 of the second stage's worker, no restart: a spare takes over (seconds)")
    print(f"    {'same text':>9} {'pause':>7} {'upload':>7} {'replay':>7} {'tokens':>7} {'rest':>7}")
    for same, pause, upload, replay, tokens, rest in rows_d:
        print(f"    {str(same):>9} {pause:>7.3f} {upload:>7.3f} {replay:>7.3f} {tokens:>7} {rest:>7.3f}")
    print("    pause: kill -> next piece (spare_after 1 s included); upload: connect and weights to the spare;")
    print("    rest: pause - upload - replay (the target: <= 2 s)")
    if http:
        kinds, errors, differing, rounds = http
        print(f"\n(e) serve, 4 concurrent streams, {rounds} rounds with one randomized fault each "
              f"({', '.join(f'{k}: {n}' for k, n in sorted(kinds.items()))})")
        print(f"    error events: {errors}; texts differing from the fault-free round: {differing} of {rounds * 4}")
    return 0


def http_faults(args, model, w: WorkerSet, rng: random.Random):
    import asyncio

    from test_http_server import Server, get, stream, stream_text

    server = Server([w.endpoint(0), w.endpoint(1)], parallel=4,
                    args=("--spares", w.endpoint(2), *(("-m", str(model)) if model else ())))
    url = server.url + "/v1/completions"

    async def round_(fault=None):
        tasks = [asyncio.create_task(stream(url, {"prompt": p, "max_tokens": RESUME_TOKENS, "temperature": 0},
                                            timeout=120)) for p in HTTP_PROMPTS]
        if fault:
            await asyncio.sleep(rng.uniform(0.1, 1.0))
            await asyncio.get_running_loop().run_in_executor(None, fault)
        return await asyncio.gather(*tasks)

    def holders() -> list[int]:
        _, body = asyncio.run(get(server.url + "/health"))
        return [w.index(e["endpoint"]) for e in body["endpoints"]]

    def settle() -> None:
        """Every worker up, the server serving on two of them."""
        w.join()
        for i in range(3):
            if not w.workers[i].alive():
                w.restart(i)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, body = asyncio.run(get(server.url + "/health"))
            if status == 200 and not any(e.get("failed") for e in body["endpoints"]):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the server did not settle: {body}")

    kinds: dict[str, int] = {}
    errors = differing = 0
    try:
        want = [stream_text(ev) for ev in asyncio.run(round_())]
        for _ in range(args.faults):
            settle()
            victim = rng.choice(holders())
            kind = rng.choice(("kill -9 + restart", "kill -9", "SIGSTOP + SIGCONT"))
            kinds[kind] = kinds.get(kind, 0) + 1

            def fault():
                if kind == "SIGSTOP + SIGCONT":
                    w.workers[victim].signal(signal.SIGSTOP)
                    threading.Timer(rng.uniform(1.0, 3.0), w.workers[victim].signal, (signal.SIGCONT,)).start()
                else:
                    w.kill(victim, rng.uniform(0.2, 1.5) if kind == "kill -9 + restart" else None)
            events = asyncio.run(round_(fault))
            errors += sum(1 for ev in events for e in ev if isinstance(e, dict) and "error" in e)
            differing += sum(1 for ev, t in zip(events, want) if stream_text(ev) != t)
        return kinds, errors, differing, args.faults
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
