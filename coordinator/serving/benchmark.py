"""`ggml-coordinator bench`: pp/tg tokens/s in process and over the workers,
side by side, interleaved repetitions so every row sees the same machine
load, with llama.cpp's llama-bench on the same model as the reference rows
(llama_cpp_reference.py) when it is built. `--model-1b` runs them on the 1B
bench model bench/bench_models.py builds into the cache (bench_model())."""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import time

from coordinator.api import Coordinator
from coordinator.serving.cluster_setup import endpoints_for, security_options
from ggml_ffi import ggml_build

BENCH_MODELS = "bench-models"  # the cache's folder of bench models: bench/bench_models.py writes, bench reads


def bench_model_pointer(name: str) -> pathlib.Path:
    """The file that names bench model `name`'s GGUF (JSON: path, type, description, ...)."""
    return ggml_build.cache_root() / BENCH_MODELS / f"{name}.json"


def bench_model(name: str) -> tuple[str | None, str]:
    """(path, what it is) of bench model `name` as bench/bench_models.py built it into the cache,
    or (None, why there is none and how to build it)."""
    pointer = bench_model_pointer(name)
    build = f"python bench/bench_models.py build (once; cached in {pointer.parent})"
    try:
        info = json.loads(pointer.read_text())
        path, what = str(info["path"]), str(info["description"])
    except FileNotFoundError:
        return None, f"the {name} bench model is not built: {build}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"the {name} bench model's {pointer} is unreadable ({exc}): {build}"
    if not os.path.isfile(path):
        return None, f"the {name} bench model {path} is gone: {build}"
    return path, what


def setups(endpoints: list[str], threads: int, split, head_split: str, step_links: str,
           split_mode: str = "layer", split_sums: bool = False) -> dict:
    """{row name: (endpoints, Coordinator options)}: in process with one worker's threads, with all the
    workers' threads, and over the workers as --split-mode, --head-split, --step-links and
    --split-sums ask."""
    rpc = f"rpc x{len(endpoints)}"
    rows = {"local": (["local"], {})}
    total = threads * len(endpoints)
    if total > threads:  # the workers' cores, all in one process: what one machine alone would do
        rows[f"local -t {total}"] = (["local"], {"threads": total})
    for links in (("on", True), ("off", False)):
        if step_links not in (links[0], "both"):
            continue
        name, opts = rpc + ("" if links[1] else " relayed"), {"split": split, "step_links": links[1]}
        if head_split in ("on", "both") or len(endpoints) == 1:
            rows[name] = (endpoints, dict(opts, head_split=True))
        if head_split in ("off", "both") and len(endpoints) > 1:
            rows[name + " head whole"] = (endpoints, dict(opts, head_split=False))
    if split_mode == "layer" or len(endpoints) < 2:
        return rows
    if split_mode == "tensor":
        rows = {k: v for k, v in rows.items() if not k.startswith(rpc)}
    rows[rpc + " tensor"] = (endpoints, {"split": split, "split_mode": "tensor"})
    if split_sums:
        rows[rpc + " tensor split sums"] = (endpoints, {"split": split, "split_mode": "tensor", "exact_sums": False})
    return rows


# A prompt size is decoded again (from an empty cache) until PP_MIN_SECONDS of it are measured, at most
# PP_MAX_DECODES times, and the median rate taken: one pp64 decode of the 1B model lasts 0.3 s, where a
# moment of the host's noise moved single runs by 20 % on the 2-core VM (pp512's 2.7 s is decoded once)
PP_MIN_SECONDS, PP_MAX_DECODES = 1.0, 5


def measure(c, pps: tuple, n_tg: int) -> tuple:
    """pp tokens/s for each prompt size of `pps` (the median of its decodes: PP_MIN_SECONDS); then,
    after the first size's prompt, tg tokens/s reading full logits (llama-bench's measure) and tg
    tokens/s with greedy=True (what generate does at temperature 0)."""
    from coordinator import Batch, DecodeError

    rng = __import__("numpy").random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(10, 1000, n)] for n in pps]
    rates = []
    for prompt in prompts:
        times: list[float] = []
        while not times or (sum(times) < PP_MIN_SECONDS and len(times) < PP_MAX_DECODES):
            c.kv_clear()
            t = time.perf_counter()
            code = c.decode(Batch.single(prompt, 0))
            times.append(time.perf_counter() - t)
            if code != 0:
                raise DecodeError(code, None, "prompt decode failed")
        rates.append(len(prompt) / statistics.median(times))
    for greedy in (False, True):
        c.kv_clear()
        code = c.decode(Batch.single(prompts[0], 0))
        if code != 0:
            raise DecodeError(code, None, "prompt decode failed")
        tok, pos = c.token(-1), len(prompts[0])
        t = time.perf_counter()
        for _ in range(n_tg):
            code = c.decode(Batch.single([tok], pos), greedy=greedy)
            if code != 0:
                raise DecodeError(code, None, "decode failed")
            tok, pos = c.token(-1), pos + 1
        rates.append(n_tg / (time.perf_counter() - t))
    return tuple(rates)


def reference_runner(args, n_workers: int):
    """llama.cpp's llama-bench on the same model, threads, pp and tg, in process and over as
    many of its rpc-servers: (a function measuring one repetition of those rows -> ({row:
    {"pp", "tg"}}, notes), None) or (None, why the rows are skipped)."""
    from coordinator.serving import llama_cpp_reference as ref

    why = ref.missing()
    if why:
        return None, f"llama.cpp reference skipped: {why}"
    from coordinator.model.default_model import default_model_path

    model = args.model or default_model_path()
    return (lambda: ref.reference_rows(model, args.threads, args.pp, args.tg, 1, n_workers)), None


def cmd_bench(args) -> int:
    load_before = os.getloadavg()[0]  # printed with the results: other jobs on the cores move every row
    results, ref_results = {}, {}
    with endpoints_for(args) as endpoints:
        rows = setups(endpoints, args.threads, args.split, args.head_split, args.step_links, args.split_mode,
                      args.split_sums)
        coords = {}
        try:
            for name, (eps, opts) in rows.items():
                opts = {"threads": args.threads, "micro_batch": args.micro_batch, "cache_type_k": args.cache_type_k,
                        "cache_type_v": args.cache_type_v, "n_batch": max(512, *args.pp), **opts}
                coords[name] = Coordinator(eps, model=args.model,
                                           n_ctx=max(args.ctx_size, max(args.pp) + args.tg + 1),
                                           **opts, **security_options(args))
        except BaseException:
            for c in coords.values():
                c.close()
            raise
        reference_run, notes = reference_runner(args, len(endpoints)) if args.reference else (None, None)
        notes = [notes] if notes else []
        for name, c in coords.items():  # which sums each tensor row's workers settled on (exact where they can)
            choice = c.health().get("split_choice") or {}
            if choice.get("chosen") == "tensor":
                why = choice.get("sums_reason")
                notes.append(f"{name}: {choice.get('sums')} sums" + (f" ({why})" if why else ""))
        if getattr(args, "model_description", None):
            notes.insert(0, f"model: {args.model_description}")
        try:
            for c in coords.values():
                # warm up with the measured shapes, as llama-bench does: the pp graph sent, built and
                # placed once, compute processes started (else the first repetition pays for it)
                measure(c, args.pp, 2)
            for _ in range(args.reps):  # interleaved, so all see the same machine load
                for name, c in coords.items():
                    results.setdefault(name, []).append(measure(c, args.pp, args.tg))
                if reference_run is not None:
                    try:
                        ref_rows, ref_notes = reference_run()
                    except (RuntimeError, OSError, ValueError, KeyError) as exc:
                        notes.append(f"llama.cpp reference failed: {exc}")
                        reference_run = None
                        continue
                    for name, r in ref_rows.items():
                        ref_results.setdefault(name, []).append(r)
                    notes += [n for n in ref_notes if n not in notes]
        finally:
            for c in coords.values():
                c.close()
    goal = TENSOR_TG_GOAL_BUNDLED if args.model is None else TENSOR_TG_GOAL
    for line in report(results, ref_results, notes, f"rpc x{len(endpoints)}", args.pp, args.tg,
                       (load_before, os.getloadavg()[0]), os.cpu_count(), goal):
        print(line)
    return 0


# issue #27's tg target for the tensor split, as a ratio to llama.cpp RPC: 1.5x for a 1B-class model
# (the size people split), 1.4x for the bundled gemma3-270m (whose 262k-row head the layer split shares too)
TENSOR_TG_GOAL, TENSOR_TG_GOAL_BUNDLED = 1.5, 1.4


def report(results: dict[str, list[tuple]], ref_results: dict[str, list[dict]], notes: list[str], rpc: str,
           pps: tuple, n_tg: int, load: tuple[float, float], n_cores: int | None,
           tensor_tg_goal: float = TENSOR_TG_GOAL) -> list[str]:
    """The lines bench prints: per row the medians of `results` (its repetitions' measure(): a
    pp column per prompt size of `pps`, then tg and tg greedy) and of `ref_results` (llama.cpp's
    {"pp64", ..., "tg"}), the ratios, the targets, `notes`, and
    what the columns mean. `rpc`: the name of the row over the workers; `load`: the 1 minute
    load average before and after; `tensor_tg_goal`: the tensor row's tg target against
    llama.cpp RPC for this model."""
    lines = []
    pp_keys = [f"pp{n}" for n in pps]
    reference = {name: {k: statistics.median(r[k] for r in rs) for k in (*pp_keys, "tg")}
                 for name, rs in ref_results.items()}
    notes = list(notes)
    if reference:
        notes.append("llama.cpp: llama-bench --repack 0 (-ngl 99 --rpc over its rpc-servers), the same model, "
                     "threads, pp and tg, one repetition after each of ours")
        notes.append("both sides: ggml 0.25.3 from the same pinned source built -march=native, plain CPU buffers "
                     "(no repacked weights: llama.cpp's --repack 1 also turns on AMX, which dies on VMs that list "
                     "it; CPU_REPACK made no measurable difference to ours), flash attention, f16 KV cache, the "
                     "last layer's FFN for the output rows only, llamafile's tinyBLAS (ours: for quantized "
                     "weights only, as this model's are, and not for under 12 rows times a weight over 16 MiB, "
                     "which vec_dot computes faster with the same bits; docs/architecture.md, \"Kernels\")")
    cols = [f"{k} t/s" for k in pp_keys] + [f"tg{n_tg} t/s", f"tg{n_tg} greedy"]
    tg_col = len(pps)
    width = max(len(name) for name in results) + 20
    lines.append(f"{'setup':<{width}}" + "".join(f"{c:>14}" for c in cols))
    med = {}
    for name, rs in results.items():
        med[name] = [statistics.median(r[k] for r in rs) for k in range(len(cols))]
        lines.append(f"{name:<{width}}" + "".join(f"{v:>14.1f}" for v in med[name]))
    baselines = [name for name in med if name.startswith("local")]
    for base in baselines:
        for name in med:
            if name not in baselines:
                label = f"ratio {name}" + (f" / {base}" if base != "local" else "")
                lines.append(f"{label:<{width}}" + "".join(f"{r / b:>14.3f}" for r, b in zip(med[name], med[base])))
    for name, r in reference.items():
        lines.append(f"{name:<{width}}" + "".join(f"{r[k]:>14.1f}" for k in (*pp_keys, "tg")) + f"{'-':>14}")
    for ours, theirs in (("local", "llama.cpp"), (rpc, f"llama.cpp {rpc}")):
        if ours in med and theirs in reference:
            label = f"ratio {ours} / {theirs}"
            lines.append(f"{label:<{width}}" + "".join(f"{m / reference[theirs][k]:>14.3f}" for m, k in
                                                       zip(med[ours], (*pp_keys, "tg"))) + f"{'-':>14}")
    targets = []  # issue #14's speed targets, as ratios to llama.cpp measured in this same run
    for ours, theirs, key, goal in (*(("local", "llama.cpp", k, 0.95) for k in pp_keys),
                                    *((rpc, f"llama.cpp {rpc}", k, 0.95) for k in pp_keys),
                                    (rpc, f"llama.cpp {rpc}", "tg", 1.4)):
        if ours in med and theirs in reference:
            ratio = med[ours][tg_col if key == "tg" else pp_keys.index(key)] / reference[theirs][key]
            what = f"tg{n_tg}" if key == "tg" else key
            targets.append(f"{ours} {what} {ratio:.2f}x (>= {goal:g}: {'met' if ratio >= goal else 'MISSED'})")
    tensor = rpc + " tensor"
    if tensor in med and f"llama.cpp {rpc}" in reference:  # issue #27's, to llama.cpp RPC
        ratio = med[tensor][tg_col] / reference[f"llama.cpp {rpc}"]["tg"]
        targets.append(f"{tensor} tg{n_tg} {ratio:.2f}x (>= {tensor_tg_goal:g}: "
                       f"{'met' if ratio >= tensor_tg_goal else 'MISSED'})")
    if targets:
        lines.append("targets vs llama.cpp: " + " | ".join(targets))
    local_all = next((name for name in med if name.startswith("local -t")), None)
    if tensor in med and local_all is not None:  # issue #27's, to this machine's cores in one process
        own = [f"{what} {med[tensor][k] / med[local_all][k]:.2f}x (>= 0.85: "
               f"{'met' if med[tensor][k] / med[local_all][k] >= 0.85 else 'MISSED'})"
               for k, what in (*enumerate(pp_keys), (tg_col, f"tg{n_tg}"))]
        lines.append(f"targets {tensor} vs {local_all}: " + " | ".join(own))
    lines += notes
    lines.append(f"load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after, on {n_cores} "
                 f"cores: other jobs share them with every row, so on a busy machine run this more than once")
    lines.append("ratio: against the in-process path with one worker's threads; '/ local -t N': against it with all "
                 "the workers' threads")
    lines.append(f"pp: per repetition the median of a prompt's decodes, repeated until {PP_MIN_SECONDS:g} s or "
                 f"{PP_MAX_DECODES} decodes")
    lines.append("tg: full logits read back each step (as llama-bench); greedy: the last worker returns the argmax")
    if any(name.endswith("head whole") for name in med):
        lines.append("head whole: the last worker computes the whole output head (--no-head-split); the other rows "
                     "split it over the workers, computed at the same time")
    if tensor in med:
        lines.append("tensor: every worker holds a shard of every layer and all compute every token, exchanging "
                     "results worker to worker (--split-mode tensor): exact sums gather whole inputs (4 exchanges a "
                     "layer, logits bit-equal to one process), split sums all-reduce partial sums (2 a layer, "
                     "--no-exact-sums); the other rpc rows split the layers")
    if any(" relayed" in name for name in med):
        lines.append("relayed: hidden states come back through the coordinator between stages (--step-links off); "
                     "the other rpc rows send them worker to worker")
    return lines
