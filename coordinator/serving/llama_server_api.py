"""llama-server's own endpoints that llama.cpp clients call next to the OpenAI
API (/tokenize, /detokenize, /props, /slots, /completion, /infill): their
bodies, without I/O, errors OpenAI-shaped as openai_api.py's."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from coordinator.serving import openai_api
from coordinator.serving.chat_templates import ChatTemplate
from coordinator.serving.openai_api import ApiError, token_ids, typed_param


@dataclass(frozen=True)
class TokenizeRequest:
    content: str
    add_special: bool  # BOS and the like (default false)
    parse_special: bool  # special tokens' text as those tokens (default true)


def parse_tokenize(body: dict) -> TokenizeRequest:
    """{content, add_special, parse_special}."""
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError(400, "'content' must be a string", param="content")
    return TokenizeRequest(content, typed_param(body, "add_special", bool, False),
                           typed_param(body, "parse_special", bool, True))


def parse_detokenize(body: dict, n_vocab: int) -> list[int]:
    """{tokens}: ids in the vocabulary."""
    return token_ids(body.get("tokens"), "tokens", n_vocab)


def props(model: str, n_slots: int, n_ctx_slot: int, chat: ChatTemplate, version: str,
          split: dict | None = None) -> dict:
    """What llama-server's /props tells (the fields that apply here), and `split`: how the model is
    split over the workers (`split_mode` and each worker's layers or tensor-parallel shard)."""
    out = {"model_alias": model, "total_slots": n_slots, "default_generation_settings": {"n_ctx": n_ctx_slot},
           "chat_template": chat.text, "chat_template_name": chat.name, "chat_template_source": chat.source,
           "build_info": f"ggml-distributed {version}"}
    if split is not None:
        out["split"] = split
    return out


def slots(n_slots: int, n_ctx_slot: int, busy: dict[int, dict], cached: dict[int, int]) -> list[dict]:
    """llama-server's /slots (the fields that apply here): one entry per slot. `busy` maps the id of a
    slot decoding a request to its request_id, n_prompt_tokens, n_prompt_tokens_cache (the prompt's
    tokens taken from the cache), n_decoded and n_remain; `cached`: slot id -> the tokens its KV rows
    hold (`n_cache_tokens`: what the next request's prompt can reuse, or is using)."""
    out = []
    for i in range(n_slots):
        state = busy.get(i)
        entry = {"id": i, "n_ctx": n_ctx_slot, "is_processing": state is not None,
                 "n_cache_tokens": cached.get(i, 0)}
        if state is not None:
            entry.update(request_id=state["request_id"], n_prompt_tokens=state["n_prompt_tokens"],
                         n_prompt_tokens_cache=state["n_prompt_tokens_cache"])
        entry["next_token"] = [{"has_next_token": state is not None,
                                "n_remain": state["n_remain"] if state else 0,
                                "n_decoded": state["n_decoded"] if state else 0}]
        out.append(entry)
    return out


# ------------------------------------------------------------ /completion (llama-server's native completion)
# fields /completion takes otherwise than /v1/completions (the rest: openai_api.FIELDS, as there)
NATIVE_ONLY = ("n_probs",)  # honoured here: `completion_probabilities`
NOT_NATIVE = {  # fields of the OpenAI shape, which /completion's replies do not have
    "logprobs": "ask 'n_probs' on /completion (`completion_probabilities`), or use /v1/completions",
    "echo": "/completion does not echo the prompt: use /v1/completions",
    "stream_options": "/completion's last event always carries the counts (`tokens_predicted`, `timings`)",
    "suffix": "fill-in-the-middle is /infill's (`input_prefix`, `input_suffix`)",
}
INFILL_FIELDS = ("input_prefix", "input_suffix", "input_extra")  # /infill's, next to /completion's


@dataclass(frozen=True)
class NativeCompletion:
    prompt: str | list[int]  # text to tokenize, or token ids (checked)
    generation: openai_api.Generation  # logprobs: n_probs alternatives per token, or None


def parse_native_completion(body: dict, n_vocab: int, n_ctx_slot: int, limit: int | None = None,
                            path: str = "/completion", prompt_required: bool = True,
                            context_shift: bool = False) -> NativeCompletion:
    """A /completion body: /v1/completions' fields (openai_api.FIELDS, the same checks and refusals)
    but those of the OpenAI reply shape (NOT_NATIVE), plus `n_probs` (0..20 alternatives per token in
    `completion_probabilities`). `n_predict` defaults to -1 (the rest of the slot's context), as
    llama-server's; one completion per request. `limit`: serve's -n; `context_shift`: its --context-shift."""
    prompt = body.get("prompt")
    if prompt is None and not prompt_required:
        prompt = ""
    prompt = openai_api.parse_prompt(prompt, n_vocab)
    for name, why in NOT_NATIVE.items():
        if body.get(name) not in (None, False):
            raise ApiError(400, f"'{name}' is not a field of {path}: {why}", param=name)
    n_probs = typed_param(body, "n_probs", int, 0, 0, openai_api.MAX_LOGPROBS)
    rest = {k: v for k, v in body.items() if k not in NATIVE_ONLY and k not in NOT_NATIVE}
    openai_api.check_fields(rest, openai_api.COMPLETIONS, path)
    gen = openai_api.parse_generation(rest, None, n_ctx_slot, openai_api.COMPLETIONS, n_vocab, limit, context_shift)
    if gen.n != 1:
        raise ApiError(400, f"{path} answers one completion per request: ask several ('n') on /v1/completions",
                       param="n" if body.get("n") is not None else "n_cmpl")
    gen = dataclasses.replace(gen, logprobs=n_probs or None)
    if not isinstance(prompt, str):
        openai_api.check_fits(len(prompt), gen.max_tokens or 1, n_ctx_slot, context_shift=context_shift)
    return NativeCompletion(prompt, gen)


def stop_type(finish_reason: str, stopping_word: str) -> str:
    """llama-server's stop_type: `limit` (n_predict or the context), `word` (a stop string), `eos`."""
    if finish_reason == "length":
        return "limit"
    return "word" if stopping_word else "eos"


def timings(n_cached: int, n_prompt_processed: int, prompt_seconds: float, n_predicted: int,
            predicted_seconds: float) -> dict:
    """llama-server's `timings` of a completion."""
    def per_token(seconds: float, n: int) -> float:
        return seconds * 1000 / n if n else 0.0

    def per_second(seconds: float, n: int) -> float:
        return n / seconds if seconds > 0 else 0.0
    return {"cache_n": n_cached, "prompt_n": n_prompt_processed, "prompt_ms": prompt_seconds * 1000,
            "prompt_per_token_ms": per_token(prompt_seconds, n_prompt_processed),
            "prompt_per_second": per_second(prompt_seconds, n_prompt_processed),
            "predicted_n": n_predicted, "predicted_ms": predicted_seconds * 1000,
            "predicted_per_token_ms": per_token(predicted_seconds, n_predicted),
            "predicted_per_second": per_second(predicted_seconds, n_predicted)}


def completion_probabilities(entries, piece) -> list[dict]:
    """/completion's `completion_probabilities`: per token its id, text, bytes, logprob and the
    `top_logprobs` alternatives (the model's own log-probabilities). `piece(id)`: a token's bytes."""
    def one(token: int, logprob: float) -> dict:
        p = piece(token)
        return {"id": token, "token": openai_api.token_text(p), "bytes": list(p), "logprob": logprob}
    return [dict(one(e.token, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top]) for e in entries]


def native_partial(content: str, id_slot: int, n_decoded: int, n_prompt: int,
                   probabilities: list[dict] | None = None) -> dict:
    """A /completion stream's event for a piece of text."""
    out = {"index": 0, "content": content, "tokens": [], "stop": False, "id_slot": id_slot,
           "tokens_predicted": n_decoded, "tokens_evaluated": n_prompt}
    if probabilities:
        out["completion_probabilities"] = probabilities
    return out


def native_final(content: str, model: str, id_slot: int, n_decoded: int, n_prompt: int, prompt: str,
                 finish_reason: str, stopping_word: str, n_cached: int, timing: dict,
                 probabilities: list[dict] | None = None, truncated: bool = False) -> dict:
    """/completion's answer (not streamed), or a stream's last event (`content` "" there): llama-server's
    fields that apply here (no `generation_settings`). `truncated`: the context was shifted."""
    out = {"index": 0, "content": content, "tokens": [], "id_slot": id_slot, "stop": True, "model": model,
           "tokens_predicted": n_decoded, "tokens_evaluated": n_prompt, "prompt": prompt,
           "has_new_line": "\n" in content, "truncated": truncated,
           "stop_type": stop_type(finish_reason, stopping_word), "stopping_word": stopping_word,
           "tokens_cached": n_cached, "timings": timing}
    if probabilities:
        out["completion_probabilities"] = probabilities
    return out


# ------------------------------------------------------------ /infill (fill-in-the-middle)
# The token texts llama.cpp takes for the FIM tokens when the GGUF names no id (llama-vocab.cpp)
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
FIM_KEYS = {"pre": ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
            "suf": ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
            "mid": ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
            "rep": ("tokenizer.ggml.fim_rep_token_id",), "sep": ("tokenizer.ggml.fim_sep_token_id",)}
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # llama-server's, between extra chunks of a model without FIM_SEP


@dataclass(frozen=True)
class FimTokens:
    pre: int | None
    suf: int | None
    mid: int | None
    rep: int | None = None  # repository name (Qwen's repo-level pattern)
    sep: int | None = None  # file separator

    @property
    def missing(self) -> list[str]:
        """What /infill needs and the model lacks, as llama-server words it."""
        return [f"{name} token is missing" for name, tid in (("prefix", self.pre), ("suffix", self.suf),
                                                                ("middle", self.mid)) if tid is None]


def fim_tokens(gguf_get, piece_to_id, n_vocab: int) -> FimTokens:
    """The model's FIM tokens: the GGUF's ids (tokenizer.ggml.fim_*_token_id, or the older
    prefix/suffix/middle ones), else a token whose text is one llama.cpp knows (FIM_TEXTS).
    `gguf_get(key)`: a GGUF value or None; `piece_to_id(text)`: a token's id or None."""
    found = {}
    for name, keys in FIM_KEYS.items():
        tid = next((gguf_get(k) for k in keys if gguf_get(k) is not None), None)
        if tid is None:
            tid = next((piece_to_id(t) for t in FIM_TEXTS[name] if piece_to_id(t) is not None), None)
        found[name] = int(tid) if tid is not None and 0 <= int(tid) < n_vocab else None
    return FimTokens(**found)


@dataclass(frozen=True)
class InfillRequest:
    input_prefix: str
    input_suffix: str
    input_extra: list[tuple[str, str]]  # (filename, text) chunks of context from other files
    completion: NativeCompletion  # prompt: the text after the prefix (the start of the middle)


def parse_infill(body: dict, n_vocab: int, n_ctx_slot: int, limit: int | None = None,
                 context_shift: bool = False) -> InfillRequest:
    """An /infill body: input_prefix and input_suffix (strings, required), input_extra ([{filename, text}],
    optional), `prompt` (a string, optional: the middle's start) and /completion's fields."""
    for name in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(name), str):
            raise ApiError(400, f"'{name}' is required, a string", param=name)
    extra = body.get("input_extra")
    chunks = []
    if extra is not None:
        if not isinstance(extra, list):
            raise ApiError(400, "'input_extra' must be an array of {\"filename\": string, \"text\": string}",
                           param="input_extra")
        for chunk in extra:
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
                raise ApiError(400, "an 'input_extra' chunk must have a string 'text'", param="input_extra")
            if not isinstance(chunk.get("filename", "tmp"), str):
                raise ApiError(400, "an 'input_extra' chunk's 'filename' must be a string", param="input_extra")
            chunks.append((chunk.get("filename", "tmp"), chunk["text"]))
    if body.get("prompt") is not None and not isinstance(body.get("prompt"), str):
        raise ApiError(400, "'prompt' must be a string", param="prompt")
    rest = {k: v for k, v in body.items() if k not in INFILL_FIELDS}
    completion = parse_native_completion(rest, n_vocab, n_ctx_slot, limit, "/infill", prompt_required=False,
                                         context_shift=context_shift)
    return InfillRequest(body["input_prefix"], body["input_suffix"], chunks, completion)


def infill_prompt(fim: FimTokens, tokenize, prefix: str, suffix: str, extra: list[tuple[str, str]],
                  prompt: list[int], n_batch: int, n_predict: int, n_ctx: int, bos: int | None) -> list[int]:
    """The FIM prompt, llama-server's (format_prompt_infill, repo-level pattern; not SPM order):
    [extra context] [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID. The extra context is
    FIM_REP "myproject\\n", then per chunk FIM_SEP filename "\\n" text (without FIM_SEP: a
    "--- snippet ---" separator and the text), then FIM_SEP "filename\\n". Prefix and suffix are
    cut to fit a batch (3:1: the prefix's end, the suffix's start); the extra context takes what
    is left of the context (its end). `tokenize(text)`: ids, no special tokens added or parsed.
    `bos`: prepended when the model adds one."""
    extra_tokens: list[int] = []
    if fim.rep is not None:
        extra_tokens += [fim.rep] + tokenize("myproject\n")
    for filename, text in extra:
        if fim.sep is not None:
            extra_tokens += [fim.sep] + tokenize(filename + "\n")
        else:
            extra_tokens += tokenize(CHUNK_SEPARATOR)
        extra_tokens += tokenize(text)
    if fim.sep is not None:
        extra_tokens += [fim.sep] + tokenize("filename\n")
    prefix_ids, suffix_ids = tokenize(prefix), tokenize(suffix)
    n_prefix = min(len(prefix_ids), 3 * (n_batch // 4))
    n_suffix = min(len(suffix_ids), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    head = [fim.pre] + prefix_ids[len(prefix_ids) - n_prefix:] + list(prompt)
    tail = [fim.suf] + suffix_ids[:n_suffix]
    if bos is not None:
        head = [bos] + head
    return extra_tokens[len(extra_tokens) - n_extra:] + head + tail + [fim.mid]
