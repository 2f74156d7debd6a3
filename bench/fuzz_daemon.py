"""Long-running protocol fuzzer against a live daemon (the test suite runs a
few thousand cases of the same: tests/daemon/test_fuzz_daemon.py).

    python bench/fuzz_daemon.py [--cases 50000] [--seed N] [--families raw,commands,graphs,lies,bursts,channel]
                                [--huge-pages]
                                [--mem MiB] [--daemon-arg=--flag ...]

Starts its own daemon on 127.0.0.1 (a free port), sends --cases messages split
over the families (strategies in tests/fuzz_protocol.py; `channel`: requests
and refused frames over a session's step channel, straight to its compute
process, run first, while that session is the daemon's only one), and reports
throughput, reply statistics, and whether the daemon is alive, correct and
back at its memory baseline afterwards. A failing case
is shrunk by hypothesis and printed with a blob to reproduce it
(@reproduce_failure). Exit status 0 only if everything held.
"""
from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # DaemonProcess, the strategies and helpers live with the tests

from hypothesis import HealthCheck, Phase, given, seed as hseed, settings  # noqa: E402

from conftest import DaemonProcess  # noqa: E402
from fuzz_protocol import (daemon_failures, ChannelFuzzer, FuzzClient, channel_messages, command_messages,  # noqa: E402
                           graph_messages, lying_prefixes, raw_messages, tiny_buffer_bursts)
from rpc_daemon.client import RpcClient  # noqa: E402
from rpc_daemon.wire.protocol import Command  # noqa: E402
from rpc_helpers import normal_session, rss  # noqa: E402

FAMILIES = {"raw": raw_messages, "commands": command_messages, "graphs": graph_messages, "lies": lying_prefixes,
            "bursts": tiny_buffer_bursts, "channel": channel_messages}
# share of the cases each family gets: lies and bursts are slower and cover less ground
WEIGHTS = {"raw": 1.0, "commands": 1.0, "graphs": 1.0, "lies": 0.1, "bursts": 0.02, "channel": 0.5}


async def free_memory(endpoint: str) -> int:
    c = await RpcClient.connect(endpoint)
    try:
        h, _ = await c.request(Command.DEVICE_INFO)
        return h["free_memory"]
    finally:
        await c.aclose()


def fuzz_channel(fuzzer: ChannelFuzzer, d, n: int, seed: int) -> None:
    """The channel family: one session, its graph cached, its step channel open (the daemon
    grants one only to a session alone on it: this runs before the other families' clients)."""
    fuzzer.start()
    try:
        fuzz_family(fuzzer, d, "channel", n, seed)
        fuzzer.check()
    finally:
        fuzzer.close()


def fuzz_family(client, d, name: str, n: int, seed: int) -> None:
    strategy = FAMILIES[name]()
    last = [time.monotonic()]

    @hseed(seed)
    @settings(max_examples=n, deadline=None, database=None, print_blob=True,
              phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck))
    @given(msg=strategy)
    def case(msg):
        client.send(msg)
        if not d.alive():
            raise AssertionError("daemon died:\n" + "".join(d.log_lines[-40:]))
        now = time.monotonic()
        if now - last[0] > 10:
            print(f"  ... {client.cases} cases", file=sys.stderr)
            last[0] = now

    case()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=50000, help="messages in total (default 50000)")
    p.add_argument("--seed", type=int, default=int(time.time()), help="hypothesis seed (default: the time)")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--mem", type=int, default=32, help="daemon --mem in MiB (default 32)")
    p.add_argument("--huge-pages", action="store_true",
                   help="client arenas on 2 MiB pages, the daemon's default (every buffer counts 2 MiB: give --mem "
                        "room, e.g. 4096, and leave out the bursts family, whose hundreds of buffers meet the cap); "
                        "default: --no-huge-pages, 4 KiB pages")
    p.add_argument("--daemon-arg", action="append", default=[], help="extra daemon flag (repeatable)")
    args = p.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = set(families) - set(FAMILIES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; choose from {sorted(FAMILIES)}")

    # memfd arenas on 4 KiB pages unless asked, as tests/daemon/test_fuzz_daemon.py: on 2 MiB ones a 32 MiB cap
    # holds 16 buffers
    pages = [] if args.huge_pages else ["--no-huge-pages"]
    d = DaemonProcess("-t", "1", "-m", str(args.mem), "--max-requests-per-second", "0", *pages, *args.daemon_arg)
    ok = True
    try:
        asyncio.run(normal_session(d.endpoint))
        base_free, base_rss = asyncio.run(free_memory(d.endpoint)), rss(d.proc.pid)
        client = FuzzClient(d.port, pid=d.proc.pid)
        t0 = time.monotonic()
        total = sum(WEIGHTS[f] for f in families)
        print(f"fuzzing {d.endpoint}: {args.cases} cases ({', '.join(families)}), seed {args.seed}", file=sys.stderr)
        channel = None
        try:
            for i, name in sorted(enumerate(families), key=lambda f: f[1] != "channel"):
                n = max(1, round(args.cases * WEIGHTS[name] / total))
                if name == "channel":
                    channel = ChannelFuzzer(d)  # its counts and failures go into the report
                    fuzz_channel(channel, d, n, args.seed + i)
                else:
                    fuzz_family(client, d, name, n, args.seed + i)
        except Exception as exc:  # a failing case, already shrunk and printed by hypothesis
            ok = False
            print(f"FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            for text in client.failures[:3] + (channel.failures[:3] if channel is not None else []):
                print(f"first failure seen: {text}", file=sys.stderr)
        elapsed = time.monotonic() - t0
        client.close()
        client.close_victim()
        alive = d.alive()
        served = False
        if alive:
            try:
                for s in range(3):
                    asyncio.run(asyncio.wait_for(normal_session(d.endpoint, s), 30))
                served = True
            except Exception as exc:
                print(f"normal session failed after fuzzing: {exc}", file=sys.stderr)
        free = asyncio.run(free_memory(d.endpoint)) if alive else None
        deadline = time.monotonic() + 10
        while alive and free != base_free and time.monotonic() < deadline:
            time.sleep(0.1)
            free = asyncio.run(free_memory(d.endpoint))
        grown = (rss(d.proc.pid) - base_rss) / (1 << 20) if alive else float("nan")
        failures = daemon_failures(d.log_lines)
        tracebacks = len(failures)
        for i in failures:  # what failed, to reproduce it (--seed)
            print("".join(d.log_lines[max(0, i - 2): i + 30]), file=sys.stderr)
        ok = ok and alive and served and free == base_free and grown < 64 and not tracebacks
        print(f"{client.cases} cases in {elapsed:.1f} s ({client.cases / max(elapsed, 1e-9):.0f}/s), "
              f"{client.reconnects} connections, {client.unencodable} unencodable draws skipped")
        print(f"daemon alive: {alive}; serves correct results: {served}; free_memory back to baseline: "
              f"{free == base_free} ({free} vs {base_free}); RSS {grown:+.1f} MiB; tracebacks in log: {tracebacks}")
        print(f"lying connections: at most {client.max_lie_growth / (1 << 20):.1f} MiB of daemon RSS for "
              f"{client.LIES_HELD} held open")
        print("replies: " + ", ".join(f"{k[0]}:{k[1]}={v}" for k, v in sorted(client.statuses.items())))
        if channel is not None:
            print(f"step channel: {channel.cases} cases, opened {channel.reopened} times; replies: "
                  + ", ".join(f"{k}={v}" for k, v in sorted(channel.statuses.items())))
        print("OK" if ok else "FAILED")
    finally:
        d.stop()
        d.kill()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
