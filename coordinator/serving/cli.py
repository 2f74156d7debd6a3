"""`ggml-coordinator`: generate text or benchmark over ggml-rpc-server workers.

Without --endpoints it starts --local-workers daemons on free loopback ports,
uses them and stops them at exit.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import inspect
import os
import signal
import statistics
import sys
import time

from coordinator.api import Coordinator
from coordinator.decode.kv_cells import MAX_SEQ  # a serving slot is a KV sequence id
from rpc_daemon.service.logs import say  # stderr lines: plain, or JSON under --log-format json
from rpc_daemon.service.version import VersionAction

EXIT_DECODE_FAILED = 2
EXIT_CONNECT_FAILED = 3
EXIT_LISTEN_FAILED = 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
EXIT_TERMINATED = 143  # 128 + SIGTERM
SERVE_RESUME_WITHIN = 30.0  # serve's default: a worker restarted by systemd is back well within it


def _defaults(fn) -> dict:
    """The keyword defaults of `fn`: the CLI's defaults are the library's, stated there once."""
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


LIBRARY = _defaults(Coordinator.__init__)  # n_ctx, threads, ...
GENERATION = _defaults(Coordinator.stream)  # max_tokens, temperature, top_k, top_p, seed


def _count(minimum: int, maximum: int | None = None):
    """An argparse type: an integer in minimum..maximum."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, not {value}")
        return value
    return parse


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, at least 0, not {text!r}")
    return value


def _proportions(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers, e.g. 1,2") from None
    if not all(v > 0 and v != float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"proportions must be positive (every worker holds at least one layer): "
                                         f"{text!r}")
    return values


def _common(p: argparse.ArgumentParser, with_head_flag: bool = True) -> None:
    p.add_argument("--endpoints", default=None, help="comma-separated host:port list (default: start local workers)")
    p.add_argument("--local-workers", type=_count(1), default=2, help="workers to start when --endpoints is not given")
    p.add_argument("-m", "--model", default=None, help="GGUF path (default: the bundled Gemma 3 270M, from 'ggml-distributed[model]')")
    p.add_argument("-t", "--threads", type=_count(1), default=LIBRARY["threads"], help="compute threads per worker")
    p.add_argument("-c", "--ctx-size", type=_count(1), default=None,
                   help=f"KV cache size in tokens (default {LIBRARY['n_ctx']}; serve: --parallel x --ctx-per-slot)")
    p.add_argument("--split", type=_proportions, default=None, help="comma-separated layer proportions, e.g. 1,2")
    if with_head_flag:
        p.add_argument("--head-split", dest="head_split", choices=("auto", "split", "whole", "here"),
                       default=LIBRARY["head_split"],
                       help="where the output head runs: every worker a share (split), the last worker all of it "
                            "(whole), the last worker its share and this process the rest (here), or per step "
                            "whichever the measured round trips and head compute times make faster (auto, the "
                            "default; behind a slow link the last worker then holds the whole head, and this "
                            "process the rest besides its share)")
        p.add_argument("--no-head-split", dest="head_split", action="store_const", const="whole",
                       help="--head-split whole")
        p.add_argument("--no-step-links", dest="step_links", action="store_false",
                       help="hidden states come back through the coordinator between stages (default: worker "
                            "to worker when every worker offers it; docs/protocol.md, Step links)")
    p.add_argument("--micro-batch", type=_count(0), default=LIBRARY["micro_batch"], metavar="N",
                   help=f"pipelining over several workers: batches cut into micro-batches that keep every worker "
                        f"busy (prompts in chunks of at most N tokens, several sequences in as many groups as "
                        f"workers, N / 2 tokens or more each), and serve steps one group of slots per worker at once "
                        f"(default {LIBRARY['micro_batch']}; 0: off, the workers one after another)")
    p.add_argument("--log-format", choices=("console", "json"), default="console")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="the workers' shared secret (else systemd's credential $CREDENTIALS_DIRECTORY/rpc-secret, "
                        "else $GGML_RPC_SECRET); local workers get it too")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="connect with TLS, verifying workers against this CA")


def _resume_flags(p: argparse.ArgumentParser, default: float, what: str) -> None:
    """Resuming through a lost worker (docs/failure-semantics.md, "Resuming"), for generate and serve alike."""
    p.add_argument("--resume-within", type=_seconds, default=default, metavar="S",
                   help=f"{what} in flight when a worker fails pauses up to S seconds for its stage to come "
                        f"back (restarted, or on a spare), then goes on with the same text (default: "
                        f"{f'{default:g}; 0: fail at once' if default else '0, failing at once'})")
    p.add_argument("--spares", default=None, metavar="HOST:PORT,...",
                   help="workers that take over the stage of a worker that does not come back quickly "
                        "(needs --resume-within)")
    p.add_argument("--spare-after", type=_seconds, default=None, metavar="S",
                   help="how long a lost worker may take to come back before a spare takes its stage "
                        "(default: 1 s, or a quarter of --resume-within if that is less)")


def _resume_options(args) -> dict:
    return {"resume_within": args.resume_within or None, "spare_after": args.spare_after,
            "spares": [e.strip() for e in (args.spares or "").split(",") if e.strip()]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ggml-coordinator", description=__doc__.split("\n")[0])
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    _common(g)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("-n", "--n-predict", type=_count(0), default=GENERATION["max_tokens"])
    g.add_argument("--temp", type=float, default=GENERATION["temperature"])
    g.add_argument("--top-k", type=int, default=GENERATION["top_k"])
    g.add_argument("--top-p", type=float, default=GENERATION["top_p"])
    g.add_argument("--seed", type=int, default=GENERATION["seed"])
    _resume_flags(g, 0.0, "the generation")
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--version", action=VersionAction, prog="ggml-coordinator")
    _common(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_count(0, 65535), default=8080)
    s.add_argument("-np", "--parallel", type=_count(1, MAX_SEQ), default=4,
                   help="slots decoding together (continuous batching)")
    s.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="serve Prometheus metrics at /metrics (default: on; llama-server's flag, which is off "
                        "there by default)")
    s.add_argument("--ctx-per-slot", type=_count(8), default=2048)
    s.add_argument("--alias", default=None, metavar="NAME",
                   help="the model id clients see (default: the GGUF's general.name, lowercased, spaces as '-')")
    s.add_argument("--api-key", default=os.environ.get("GGML_COORDINATOR_API_KEY") or None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics "
                        "(default: $GGML_COORDINATOR_API_KEY; none: open)")
    s.add_argument("--cors-origin", default="*", metavar="ORIGIN",
                   help="the Access-Control-Allow-Origin every response carries (default: *)")
    s.add_argument("--max-queue", type=_count(0), default=None, metavar="N",
                   help="requests that may wait for a free slot; more get 429 (default: no limit)")
    s.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help="the chat template of /v1/chat/completions: a built-in (chatml, gemma, llama3, mistral, "
                        "phi3) or a Jinja template file (default: the model's own, else a generic fallback)")
    _resume_flags(s, SERVE_RESUME_WITHIN, "a request")
    b = sub.add_parser("bench", help="pp64/tg32 tokens/s: in-process against local workers, side by side")
    _common(b, with_head_flag=False)
    b.add_argument("--reps", type=_count(1), default=3)
    b.add_argument("--pp", type=_count(1), default=64)
    b.add_argument("--tg", type=_count(1), default=32)
    b.add_argument("--head-split", choices=("on", "off", "both"), default="both",
                   help="run the workers with the output head split over them, whole on the last, or both "
                        "(both: two rows side by side; the workers hold the model twice)")
    b.add_argument("--step-links", choices=("on", "off", "both"), default="on",
                   help="activations worker to worker (on), through the coordinator (off), or both rows side by "
                        "side (the workers hold the model once more)")
    b.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the reference rows: llama.cpp's llama-bench in process and over as many of its "
                        "rpc-servers (built by bench/llama_cpp_reference.py)")
    args = p.parse_args(argv)
    if args.command == "serve" and args.ctx_size is not None:
        s.error("serve sizes its KV cache as --parallel x --ctx-per-slot; -c/--ctx-size is not used")
    if args.command == "serve" and args.chat_template is not None:
        from coordinator.serving.chat_templates import ChatTemplateError, chosen
        try:  # before any worker is started or the model read
            chosen(args.chat_template)
        except ChatTemplateError as exc:
            s.error(str(exc))
    if args.ctx_size is None:
        args.ctx_size = LIBRARY["n_ctx"]
    _check_settings(p, args)
    if getattr(args, "spares", None) and not args.resume_within:
        p.error("--spares needs --resume-within: a spare takes over a stage while a generation waits")
    from coordinator.model.default_model import NO_DEFAULT_MODEL, default_model_available
    if args.model is None and not default_model_available():  # at once: before any worker is started
        p.error(NO_DEFAULT_MODEL)
    if args.command == "generate":
        from coordinator.text.sampling import Sampler
        try:  # before any worker is started or the model read
            Sampler(args.temp, args.top_k, args.top_p, args.seed)
        except ValueError as exc:
            g.error(str(exc))
    return args


def _check_settings(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any worker is started or the model read: a weak or
    example secret (the workers would refuse it too), and an --endpoints or
    --model that was given but is empty: a systemd unit's ${GGML_ENDPOINTS}
    with the variable unset, which would otherwise mean local workers serving
    the bundled model."""
    from rpc_daemon.wire.auth import SecretError, load_secret

    for flag, value, variable in (("--endpoints", args.endpoints, "GGML_ENDPOINTS"),
                                  ("--model", args.model, "GGML_MODEL")):
        if value is not None and not value.strip():
            p.error(f"{flag} is empty (under systemd: set {variable} in /etc/ggml-distributed/coordinator.env); "
                    f"leave the flag out for the default")
    try:
        args.secret = load_secret(secret_file=args.secret_file)
    except SecretError as exc:
        p.error(str(exc))


@contextlib.contextmanager
def endpoints_for(args, supervise: bool = False):
    if args.endpoints:
        yield [e.strip() for e in args.endpoints.split(",") if e.strip()]
        return
    from coordinator.serving.local_workers import LocalWorkers

    extra = ("--secret-file", args.secret_file) if args.secret_file else ()
    with LocalWorkers(args.local_workers, args.threads, extra) as workers:
        if supervise:  # a server restarts a local worker that dies; generate and bench report it and stop
            workers.supervise()
        yield workers.endpoints


def _security(args) -> dict:
    """Coordinator options for the workers' shared secret and TLS (docs/security.md)."""
    return {"secret": args.secret, "tls_ca": args.tls_ca}


def cmd_generate(args) -> int:
    from coordinator import DecodeError

    with endpoints_for(args) as endpoints:
        try:
            c = Coordinator(endpoints, model=args.model, split=args.split, n_ctx=args.ctx_size, **_security(args),
                            threads=args.threads, progress=sys.stderr.isatty(), head_split=args.head_split,
                            step_links=args.step_links,
                            micro_batch=args.micro_batch, **_resume_options(args))
        except (ConnectionError, OSError, ValueError) as exc:
            say(f"cannot start: {exc}", "error")
            return EXIT_CONNECT_FAILED
        with c:
            started, n = time.perf_counter(), 0
            generated0 = c.stats["generated"]
            try:
                for piece in c.stream(args.prompt, max_tokens=args.n_predict, temperature=args.temp,
                                      top_k=args.top_k, top_p=args.top_p, seed=args.seed):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except DecodeError as exc:
                say(f"generation failed: {exc}", "error", new_line=True)
                return EXIT_DECODE_FAILED
            elapsed = time.perf_counter() - started
            n = c.stats["generated"] - generated0
            n_layer = c.hp.n_layer
            share = ", ".join(f"{e['endpoint']} layers {e['layers'][0]}-{e['layers'][1] - 1} "
                              f"({(e['layers'][1] - e['layers'][0]) / n_layer:.0%})"
                              + (f" head {(e['head_rows'][1] - e['head_rows'][0]) / c.hp.n_vocab:.0%}"
                                 if e["head_rows"] else "") for e in c.endpoints())
            if args.log_format == "json":
                say("generated", tokens=n, seconds=round(elapsed, 3), tokens_per_second=round(n / elapsed, 1),
                    endpoints=c.endpoints())
            else:
                print(f"\n[{n} tokens in {elapsed:.2f} s, {n / elapsed:.1f} tokens/s; {share}]", file=sys.stderr)
    return 0


def _bench_one(c, n_pp: int, n_tg: int) -> tuple[float, float, float]:
    """pp tokens/s; tg tokens/s reading full logits (llama-bench's measure);
    tg tokens/s with greedy=True (what generate does at temperature 0)."""
    from coordinator import Batch, DecodeError

    rng = __import__("numpy").random.default_rng(0)
    prompt = [int(x) for x in rng.integers(10, 1000, n_pp)]
    rates = []
    for greedy in (None, False, True):
        c.kv_clear()
        t = time.perf_counter()
        code = c.decode(Batch.single(prompt, 0))
        if greedy is None:
            rates.append(n_pp / (time.perf_counter() - t))
            continue
        if code != 0:
            raise DecodeError(code, None, "prompt decode failed")
        tok, pos = c.token(-1), n_pp
        t = time.perf_counter()
        for _ in range(n_tg):
            code = c.decode(Batch.single([tok], pos), greedy=greedy)
            if code != 0:
                raise DecodeError(code, None, "decode failed")
            tok, pos = c.token(-1), pos + 1
        rates.append(n_tg / (time.perf_counter() - t))
    return tuple(rates)


def _reference(args, n_workers: int):
    """llama.cpp's llama-bench on the same model, threads, pp and tg, in process and over as
    many of its rpc-servers: (a function measuring one repetition of those rows -> ({row:
    {"pp", "tg"}}, notes), None) or (None, why the rows are skipped)."""
    import importlib.util
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "llama_cpp_reference.py"
    if not script.is_file():
        return None, f"llama.cpp reference skipped: {script} is not here (an installed package has no bench/)"
    spec = importlib.util.spec_from_file_location("llama_cpp_reference", script)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    why = ref.missing()
    if why:
        return None, f"llama.cpp reference skipped: {why}"
    from coordinator.model.default_model import default_model_path

    model = args.model or default_model_path()
    return (lambda: ref.reference_rows(model, args.threads, args.pp, args.tg, 1, n_workers)), None


def cmd_bench(args) -> int:
    load_before = os.getloadavg()[0]  # printed with the results: other jobs on the cores move every row
    results = {}
    with endpoints_for(args) as endpoints:
        rpc = f"rpc x{len(endpoints)}"
        setups = {"local": (["local"], {})}
        total = args.threads * len(endpoints)
        if total > args.threads:  # the workers' cores, all in one process: what one machine alone would do
            setups[f"local -t {total}"] = (["local"], {"threads": total})
        for links in (("on", True), ("off", False)):
            if args.step_links not in (links[0], "both"):
                continue
            name, opts = rpc + ("" if links[1] else " relayed"), {"split": args.split, "step_links": links[1]}
            if args.head_split in ("on", "both") or len(endpoints) == 1:
                setups[name] = (endpoints, dict(opts, head_split=True))
            if args.head_split in ("off", "both") and len(endpoints) > 1:
                setups[name + " head whole"] = (endpoints, dict(opts, head_split=False))
        coords = {}
        try:
            for name, (eps, opts) in setups.items():
                opts = {"threads": args.threads, "micro_batch": args.micro_batch, **opts}
                coords[name] = Coordinator(eps, model=args.model, n_ctx=max(args.ctx_size, args.pp + args.tg + 1),
                                           **opts, **_security(args))
        except BaseException:
            for c in coords.values():
                c.close()
            raise
        reference_run, notes = _reference(args, len(endpoints)) if args.reference else (None, None)
        notes, ref_results = [notes] if notes else [], {}
        try:
            for c in coords.values():
                # warm up with the measured shapes, as llama-bench does: the pp graph sent, built and
                # placed once, compute processes started (else the first repetition pays for it)
                _bench_one(c, args.pp, 2)
            for _ in range(args.reps):  # interleaved, so all see the same machine load
                for name, c in coords.items():
                    results.setdefault(name, []).append(_bench_one(c, args.pp, args.tg))
                if reference_run is not None:
                    try:
                        rows, ref_notes = reference_run()
                    except (RuntimeError, OSError, ValueError, KeyError) as exc:
                        notes.append(f"llama.cpp reference failed: {exc}")
                        reference_run = None
                        continue
                    for name, r in rows.items():
                        ref_results.setdefault(name, []).append(r)
                    notes += [n for n in ref_notes if n not in notes]
        finally:
            for c in coords.values():
                c.close()
    reference = {name: {k: statistics.median(r[k] for r in rs) for k in ("pp", "tg")}
                 for name, rs in ref_results.items()}
    if reference:
        notes.append("llama.cpp: llama-bench --repack 0 (-ngl 99 --rpc over its rpc-servers), the same model, "
                     "threads, pp and tg, one repetition after each of ours")
        notes.append("both sides: ggml 0.25.3 from the same pinned source built -march=native, plain CPU buffers "
                     "(no repacked weights: llama.cpp's --repack 1 also turns on AMX, which dies on VMs that list "
                     "it; CPU_REPACK made no measurable difference to ours), flash attention, f16 KV cache, the "
                     "last layer's FFN for the output rows only, llamafile's tinyBLAS (ours: for quantized "
                     "weights only, as this model's are; docs/architecture.md, \"Kernels\")")
    cols = [f"pp{args.pp} t/s", f"tg{args.tg} t/s", f"tg{args.tg} greedy"]
    width = max(len(name) for name in results) + 20
    print(f"{'setup':<{width}}" + "".join(f"{c:>14}" for c in cols))
    med = {}
    for name, rs in results.items():
        med[name] = [statistics.median(r[k] for r in rs) for k in range(3)]
        print(f"{name:<{width}}" + "".join(f"{v:>14.1f}" for v in med[name]))
    baselines = [name for name in med if name.startswith("local")]
    for base in baselines:
        for name in med:
            if name not in baselines:
                label = f"ratio {name}" + (f" / {base}" if base != "local" else "")
                print(f"{label:<{width}}" + "".join(f"{r / b:>14.3f}" for r, b in zip(med[name], med[base])))
    for name, r in reference.items():
        print(f"{name:<{width}}{r['pp']:>14.1f}{r['tg']:>14.1f}{'-':>14}")
    for ours, theirs in (("local", "llama.cpp"), (rpc, f"llama.cpp {rpc}")):
        if ours in med and theirs in reference:
            label = f"ratio {ours} / {theirs}"
            print(f"{label:<{width}}{med[ours][0] / reference[theirs]['pp']:>14.3f}"
                  f"{med[ours][1] / reference[theirs]['tg']:>14.3f}{'-':>14}")
    targets = []  # issue #14's speed targets, as ratios to llama.cpp measured in this same run
    for ours, theirs, col, goal in (("local", "llama.cpp", 0, 0.95), (rpc, f"llama.cpp {rpc}", 0, 0.95),
                                    (rpc, f"llama.cpp {rpc}", 1, 1.4)):
        if ours in med and theirs in reference:
            ratio = med[ours][col] / reference[theirs]["pp" if col == 0 else "tg"]
            what = f"pp{args.pp}" if col == 0 else f"tg{args.tg}"
            targets.append(f"{ours} {what} {ratio:.2f}x (>= {goal:g}: {'met' if ratio >= goal else 'MISSED'})")
    if targets:
        print("targets vs llama.cpp: " + " | ".join(targets))
    for note in notes:
        print(note)
    print(f"load average (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} "
          f"cores: other jobs share them with every row, so on a busy machine run this more than once")
    print("ratio: against the in-process path with one worker's threads; '/ local -t N': against it with all the "
          "workers' threads")
    print("tg: full logits read back each step (as llama-bench); greedy: the last worker returns the argmax")
    if any(name.endswith("head whole") for name in med):
        print("head whole: the last worker computes the whole output head (--no-head-split); the other rows "
              "split it over the workers, computed at the same time")
    if any(" relayed" in name for name in med):
        print("relayed: hidden states come back through the coordinator between stages (--step-links off); the "
              "other rpc rows send them worker to worker")
    return 0


def listen_sockets(host: str, port: int) -> list:
    """Bound, listening sockets for host:port (every address `host` resolves
    to), made before any worker is started or the model read, so a port that
    is taken fails at once. OSError if it cannot be bound."""
    import socket

    socks = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart while old connections linger
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:  # the same free port on every address
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
            sock.listen(128)
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def serving_url(host: str, sock) -> str:
    port = sock.getsockname()[1]
    shown = host or "0.0.0.0"
    return f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"


def model_id(c, alias: str | None) -> str:
    """The id clients see in /v1/models and every response's `model`: --alias,
    else the GGUF's general.name lowercased with spaces as '-', else the file's stem."""
    if alias:
        return alias
    name = str(c.gguf.get("general.name") or "").strip()
    if not name:
        name = os.path.splitext(os.path.basename(c.model_path))[0]
    return "-".join(name.lower().split())


def cmd_serve(args) -> int:
    os.environ.pop("GGML_COORDINATOR_API_KEY", None)  # read by parse_args; local workers need not inherit it
    try:
        socks = listen_sockets(args.host, args.port)
    except OSError as exc:
        say(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
            f"{' (another server on that port? choose one with --port)' if exc.errno == errno.EADDRINUSE else ''}",
            "error")
        return EXIT_LISTEN_FAILED
    try:
        return _serve(args, socks)
    finally:
        for sock in socks:
            sock.close()


def _serve(args, socks) -> int:
    from coordinator.cluster.loop import run_async
    from coordinator.serving.http_server import serve_http
    from rpc_daemon.service.systemd import StartTimeoutExtender

    with endpoints_for(args, supervise=True) as endpoints:
        try:  # under systemd, a big model's upload extends the start timeout while it progresses
            c = Coordinator(endpoints, model=args.model, split=args.split, threads=args.threads, **_security(args),
                            n_ctx=args.parallel * args.ctx_per_slot, progress=sys.stderr.isatty(),
                            head_split=args.head_split, step_links=args.step_links, **_resume_options(args),
                            on_upload=StartTimeoutExtender(), micro_batch=args.micro_batch)
        except (ConnectionError, OSError, ValueError) as exc:
            say(f"cannot start: {exc}", "error")
            return EXIT_CONNECT_FAILED
        with c:
            name = model_id(c, args.alias)
            opts = {"api_key": args.api_key, "cors_origin": args.cors_origin, "max_queue": args.max_queue,
                    "chat_template": args.chat_template, "metrics_endpoint": args.metrics}

            def announce() -> None:
                slots = f"{args.parallel} slot{'s' if args.parallel != 1 else ''}"
                url = serving_url(args.host, socks[0])
                say(f"serving {url} (model {name}, {slots} x {args.ctx_per_slot} tokens)", url=url, model=name)

            run_async(serve_http(c, socks, args.parallel, args.ctx_per_slot, name, announce=announce, **opts))
    return 0


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so every `with` unwinds: the
    coordinator frees its remote buffers and local workers are stopped."""


def _terminate(signum, frame):
    raise Terminated()


def main(argv=None) -> int:
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    args = parse_args(argv)
    from rpc_daemon.service import logs

    logs.configure(args.log_format, args.log_level)
    if args.command != "serve":  # serve handles its signals in its event loop (graceful drain)
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return {"generate": cmd_generate, "bench": cmd_bench, "serve": cmd_serve}[args.command](args)
    except KeyboardInterrupt:
        say("interrupted", "warning", new_line=True)
        return EXIT_INTERRUPTED
    except Terminated:
        say("terminated", "warning", new_line=True)
        return EXIT_TERMINATED


if __name__ == "__main__":
    sys.exit(main())
