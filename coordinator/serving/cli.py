"""`ggml-coordinator`: generate text or benchmark over ggml-rpc-server workers.

Without --endpoints it starts --local-workers daemons on free loopback ports,
uses them and stops them at exit.

This module is the command line alone: the flags, their checks, and main(),
which runs the command's module: generate.py, benchmark.py, or lifecycle.py
(serve). cluster_setup.py turns the flags they share into endpoints and
Coordinator options.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import signal
import sys

from coordinator.api import Coordinator
from coordinator.config import CoordinatorConfig
from coordinator.decode.kv_cells import MAX_SEQ  # a serving slot is a KV sequence id
from rpc_daemon.service.logs import say  # stderr lines: plain, or JSON under --log-format json
from rpc_daemon.service.version import VersionAction

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it
EXIT_TERMINATED = 143  # 128 + SIGTERM
SERVE_RESUME_WITHIN = 30.0  # serve's default: a worker restarted by systemd is back well within it
SERVE_CTX_PER_SLOT = 2048  # serve's default context a slot


def _defaults(fn) -> dict:
    """The keyword defaults of `fn`: the CLI's defaults are the library's, stated there once."""
    return {n: p.default for n, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


LIBRARY = {f.name: f.default for f in dataclasses.fields(CoordinatorConfig)}  # n_ctx, threads, ...
GENERATION = _defaults(Coordinator.stream)  # max_tokens, temperature, top_k, top_p, seed


MAX_PP = 8192  # bench --pp: the largest prompt size


def _counts(minimum: int, maximum: int):
    """An argparse type: comma-separated integers in minimum..maximum, as a tuple (llama-bench's -p)."""
    one = _count(minimum, maximum)

    def parse(text: str) -> tuple:
        values = tuple(one(part.strip()) for part in text.split(","))
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"{text!r} names a size twice")
        return values
    return parse


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


class StrictParser(argparse.ArgumentParser):
    """argparse without its guesses, so that no llama-server flag turns into
    another: no abbreviations (allow_abbrev=False), and a single-dash word
    that is not one of the flags is an error naming it, not short flags run
    together (`-ctk q8_0` is not `-c tk`, `-hf` not `-h -f`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _parse_optional(self, arg_string):
        # a command's own flags only: the top parser sees them too, before handing them to the command
        if self._subparsers is None and arg_string.startswith("-") and not arg_string.startswith("--") \
                and len(arg_string) > 2 and arg_string.split("=", 1)[0] not in self._option_string_actions \
                and not self._negative_number_matcher.match(arg_string):
            self.error(f"unrecognized argument: {arg_string} ({self.prog} --help lists the flags)")
        return super()._parse_optional(arg_string)


def _refused(message: str, nargs=0):
    """An argparse action for a llama-server flag this program does not have: an error with `message`."""
    class Refused(argparse.Action):
        def __init__(self, option_strings, dest, **kwargs):
            kwargs.pop("nargs", None)
            super().__init__(option_strings, dest, nargs=nargs, **kwargs)

        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string}: {message}")
    return Refused


KV_CACHE_TYPES = ("f16", "q8_0", "q4_0")


def _kv_type(text: str) -> str:
    """-ctk/-ctv: the KV cache's type, as llama.cpp names them (docs/architecture.md, "KV cache")."""
    if text not in KV_CACHE_TYPES:
        raise argparse.ArgumentTypeError(f"a KV cache of type {text!r} is not supported: choose "
                                         f"{', '.join(KV_CACHE_TYPES)}")
    return text


def _pooling(text: str) -> str:
    """--pooling: llama-server's mean, last, cls; its none and rank are not served."""
    if text in ("mean", "last", "cls"):
        return text
    if text == "none":
        raise argparse.ArgumentTypeError("'none' is not supported: /v1/embeddings returns one pooled vector per "
                                         "input; choose mean, last or cls")
    if text == "rank":
        raise argparse.ArgumentTypeError("'rank' is not supported: there is no reranking endpoint (it needs a "
                                         "reranker model's classification head); choose mean, last or cls")
    raise argparse.ArgumentTypeError(f"{text!r} is not a pooling: choose mean, last or cls")


def _common(p: argparse.ArgumentParser, with_head_flag: bool = True) -> None:
    p.add_argument("--endpoints", default=None, help="comma-separated host:port list (default: start local workers)")
    p.add_argument("--local-workers", type=_count(1), default=2, help="workers to start when --endpoints is not given")
    p.add_argument("-m", "--model", default=None, help="GGUF path (default: the bundled Gemma 3 270M, from 'ggml-distributed[model]')")
    p.add_argument("-t", "--threads", type=_count(1), default=LIBRARY["threads"], help="compute threads per worker")
    p.add_argument("-c", "--ctx-size", type=_count(1), default=None,
                   help=f"KV cache size in tokens (default {LIBRARY['n_ctx']}; serve: the total over its slots, "
                        f"each --ctx-per-slot, default --parallel x {SERVE_CTX_PER_SLOT})")
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
        p.add_argument("-sm", "--split-mode", dest="split_mode", choices=("layer", "tensor", "auto"),
                       default="auto",
                       help="llama.cpp's flag: each worker a range of layers, one after another (layer); every "
                            "worker a shard of every layer, all computing every token together (tensor: workers "
                            "that offer tensor links, no TLS); or tensor where its exchanges, timed on the workers' "
                            "own link, cost less than the compute it saves, else layer (auto, the default here; "
                            "the library's default is layer). "
                            "docs/operations.md, \"Which split\"")
        p.add_argument("--tensor-group", dest="tensor_group", type=_count(2), default=None, metavar="N",
                       help="with a tensor split: the endpoints, in order, form groups of N workers; each group "
                            "a range of layers, the groups one after another (default: all in one group)")
        p.add_argument("--exact-sums", dest="exact_sums", action=argparse.BooleanOptionalAction, default=None,
                       help="with a tensor split: each worker computes whole rows of the output projections over "
                            "their gathered inputs, so logits are bit-equal to one process's, for two more "
                            "exchanges a layer (default: where the model and every worker allow it; --exact-sums "
                            "insists, --no-exact-sums all-reduces partial sums: faster, logits differ in the last "
                            "bits; docs/operations.md, \"Which split\")")
        p.add_argument("--no-step-links", dest="step_links", action="store_false",
                       help="hidden states come back through the coordinator between stages (default: worker "
                            "to worker when every worker offers it; docs/protocol.md, Step links)")
        p.add_argument("--no-step-channels", dest="step_channels", action="store_false",
                       help="tensor-parallel steps go through each worker's daemon (default: straight to its "
                            "compute process where the worker grants a channel; docs/protocol.md, Step channels)")
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
    p.add_argument("-ctk", "--cache-type-k", type=_kv_type, default="f16", metavar="TYPE",
                   help="the KV cache's type of K on the workers: f16 (default), q8_0 (about half the memory per "
                        "token), q4_0 (about a quarter)")
    p.add_argument("-ctv", "--cache-type-v", type=_kv_type, default="f16", metavar="TYPE",
                   help="the KV cache's type of V: f16 (default), q8_0, q4_0")
    p.add_argument("-hf", "-hfr", "--hf-repo", action=_refused("downloading a model is not supported: give its "
                                                                  "GGUF file with -m PATH", nargs=1),
                   help=argparse.SUPPRESS)


def _warmup_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="after loading, run one token through the workers and clear the cache, so the first "
                        "request does not pay their first computes (default: on; llama.cpp's --no-warmup "
                        "turns it off)")


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


def _slot_context(s: argparse.ArgumentParser, args) -> None:
    """serve's --ctx-per-slot from -c/--ctx-size as llama-server sizes a slot with -np: the
    KV cache's total over the --parallel slots, rounded up to a multiple of 256 tokens
    (GGML_PAD in llama_context); or its default. Both at once is an error."""
    if args.ctx_size is None:
        args.ctx_per_slot = SERVE_CTX_PER_SLOT if args.ctx_per_slot is None else args.ctx_per_slot
        return
    if args.ctx_per_slot is not None:
        s.error("-c/--ctx-size (the total, divided over the slots) and --ctx-per-slot both size a slot: give one")
    share = args.ctx_size // args.parallel
    if share == 0:
        s.error(f"argument -c/--ctx-size: {args.ctx_size} tokens over {args.parallel} slots leaves none a slot")
    args.ctx_per_slot = -(-share // 256) * 256


def parse_args(argv=None) -> argparse.Namespace:
    p = StrictParser(prog="ggml-coordinator", description=__doc__.split("\n")[0])
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
    _warmup_flag(g)
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
    s.add_argument("--ctx-per-slot", type=_count(8), default=None, metavar="N",
                   help=f"each slot's context in tokens (default {SERVE_CTX_PER_SLOT}; or -c/--ctx-size N, "
                        "the total, which llama-server divides over the slots)")
    s.add_argument("--alias", default=None, metavar="NAME",
                   help="the model id clients see (default: the GGUF's general.name, lowercased, spaces as '-')")
    s.add_argument("--api-key", default=os.environ.get("GGML_COORDINATOR_API_KEY") or None, metavar="KEY[,KEY...]",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics; several "
                        "keys comma-separated (default: $GGML_COORDINATOR_API_KEY; none: open)")
    s.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="more API keys, one a line ('#' starts a comment line), as llama-server reads them")
    s.add_argument("--ssl-cert-file", default=None, metavar="PEM",
                   help="serve HTTPS with this certificate (chain), with --ssl-key-file")
    s.add_argument("--ssl-key-file", default=None, metavar="PEM", help="the private key of --ssl-cert-file")
    s.add_argument("-n", "--n-predict", type=_count(-1), default=-1, metavar="N",
                   help="the most tokens a request generates, and what it gets when it asks no number "
                        "(default: -1, no limit: completions 16, chat the rest of the slot's context)")
    s.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True,
                   help="serve llama-server's /slots, what each slot is doing (default: on)")
    s.add_argument("--jinja", action="store_true", help="accepted: chat templates are always Jinja here")
    s.add_argument("--no-jinja", action=_refused("chat templates are always Jinja here (built-ins included)"),
                   help=argparse.SUPPRESS)
    s.add_argument("--context-shift", action=argparse.BooleanOptionalAction, default=False,
                   help="llama-server's flag: a generation that reaches its slot's context keeps the request's "
                        "n_keep prompt tokens, drops half of the rest and goes on (the kept tokens are decoded "
                        "again: one prefill per shift), and max_tokens may pass the context; a prompt must still "
                        "fit (default: off, a generation ends there with finish_reason \"length\")")
    s.add_argument("--embedding", "--embeddings", dest="embeddings", action="store_true",
                   help="serve /v1/embeddings (without it, 501 as llama-server answers); completions are served "
                        "too, on the same slots")
    s.add_argument("--pooling", type=_pooling, default="mean", metavar="{mean,last,cls}",
                   help="how /v1/embeddings pools an input's tokens into one vector, then L2-normalized: their "
                        "mean (default), the last token's, or the first's (cls)")
    s.add_argument("--cors-origin", default="*", metavar="ORIGIN",
                   help="the Access-Control-Allow-Origin every response carries (default: *)")
    s.add_argument("--max-queue", type=_count(0), default=None, metavar="N",
                   help="requests that may wait for a free slot; more get 429 (default: no limit)")
    s.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help="the chat template of /v1/chat/completions: a built-in (chatml, gemma, llama3, mistral, "
                        "phi3) or a Jinja template file (default: the model's own, else a generic fallback)")
    _resume_flags(s, SERVE_RESUME_WITHIN, "a request")
    _warmup_flag(s)
    b = sub.add_parser("bench", help="pp64/tg32 tokens/s: in-process against local workers, side by side")
    _common(b, with_head_flag=False)
    b.add_argument("--reps", type=_count(1), default=3)
    b.add_argument("--pp", type=_counts(1, MAX_PP), default=None, metavar="N[,N...]",
                   help="prompt sizes, each a column (default: 64; with --model-1b 64,512: issue #27's two)")
    b.add_argument("--tg", type=_count(1), default=32)
    b.add_argument("--head-split", choices=("on", "off", "both"), default="both",
                   help="run the workers with the output head split over them, whole on the last, or both "
                        "(both: two rows side by side; the workers hold the model twice)")
    b.add_argument("-sm", "--split-mode", dest="split_mode", choices=("layer", "tensor", "both"), default="both",
                   help="the workers' rows with the layer split, the tensor-parallel split, or both side by side "
                        "(both: the workers hold the model twice)")
    b.add_argument("--split-sums", dest="split_sums", action="store_true",
                   help="with -sm tensor or both: a row of the tensor split with split sums (--no-exact-sums) "
                        "beside its own (exact sums where they can be)")
    b.add_argument("--exact-sums", action=_refused("the tensor row has exact sums by default now (where they can "
                                                   "be); --split-sums adds a row with split sums beside it"),
                   help=argparse.SUPPRESS)
    b.add_argument("--step-links", choices=("on", "off", "both"), default="on",
                   help="activations worker to worker (on), through the coordinator (off), or both rows side by "
                        "side (the workers hold the model once more)")
    b.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the reference rows: llama.cpp's llama-bench in process and over as many of its "
                        "rpc-servers (built by bench/llama_cpp_reference.py)")
    b.add_argument("--model-1b", dest="model_1b", action="store_true",
                   help="bench the 1B-class bench model instead of -m: TinyLlama 1.1B's shape with random weights, "
                        "Q4_K_M (built once into the cache by bench/bench_models.py build)")
    args = p.parse_args(argv)
    if args.command == "bench" and args.pp is None:
        args.pp = (64, 512) if args.model_1b else (64,)
    if args.command == "bench" and args.model_1b:
        from coordinator.serving.benchmark import bench_model
        if args.model is not None:
            b.error("-m/--model and --model-1b name two models: give one")
        args.model, args.model_description = bench_model("1b")
        if args.model is None:  # before any worker is started
            b.error(args.model_description)
    if args.command == "serve":
        _slot_context(s, args)
        _check_serve(s, args)
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


def _check_serve(s: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """serve's API keys (--api-key a,b and --api-key-file, as one list in args.api_key) and HTTPS
    (args.ssl_context), read before any worker is started or the model read."""
    from coordinator.serving.access import keys_in

    if args.n_predict == 0:
        s.error("argument -n/--n-predict: must be -1 (no limit) or at least 1, not 0")
    keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()]
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                from_file = keys_in(f.read())
        except (OSError, UnicodeDecodeError) as exc:
            s.error(f"cannot read --api-key-file {args.api_key_file}: {exc}")
        if not from_file:
            s.error(f"--api-key-file {args.api_key_file} holds no key (one a line; '#' starts a comment)")
        keys += from_file
    args.api_key = keys or None
    args.ssl_context = None
    if (args.ssl_cert_file is None) != (args.ssl_key_file is None):
        s.error("--ssl-cert-file and --ssl-key-file go together: give both")
    if args.ssl_cert_file is not None:
        import ssl
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(args.ssl_cert_file, args.ssl_key_file)
        except (OSError, ssl.SSLError) as exc:
            s.error(f"cannot serve HTTPS with --ssl-cert-file {args.ssl_cert_file} and --ssl-key-file "
                    f"{args.ssl_key_file}: {exc}")
        args.ssl_context = context


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


class Terminated(BaseException):
    """SIGTERM, raised like KeyboardInterrupt so every `with` unwinds: the
    coordinator frees its remote buffers and local workers are stopped."""


def _terminate(signum, frame):
    raise Terminated()


def _command(name: str):
    """The function that runs command `name` (imported only now: serve's module brings aiohttp)."""
    if name == "generate":
        from coordinator.serving.generate import cmd_generate
        return cmd_generate
    if name == "bench":
        from coordinator.serving.benchmark import cmd_bench
        return cmd_bench
    from coordinator.serving.lifecycle import cmd_serve
    return cmd_serve


def main(argv=None) -> int:
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    args = parse_args(argv)
    from rpc_daemon.service import logs

    logs.configure(args.log_format, args.log_level)
    if args.command != "serve":  # serve handles its signals in its event loop (graceful drain)
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return _command(args.command)(args)
    except KeyboardInterrupt:
        say("interrupted", "warning", new_line=True)
        return EXIT_INTERRUPTED
    except Terminated:
        say("terminated", "warning", new_line=True)
        return EXIT_TERMINATED


if __name__ == "__main__":
    sys.exit(main())
