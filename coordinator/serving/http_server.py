"""The HTTP side of the OpenAI-compatible server: the aiohttp app, its routes,
and the bytes of answers and Server-Sent Event streams.

What the bytes mean is decided elsewhere, without I/O: request and reply
bodies in openai_api.py (llama-server's extras in llama_server_api.py: /completion,
/infill, /slots...; /v1/embeddings' in embeddings.py), the
API key and CORS in access.py, /health in health.py, /metrics in metrics.py.
The web page at / and the cluster view behind it (/cluster, /cluster/events)
are web_page.py's and cluster_view.py's; lifecycle.py runs the app.
A failed decode ends a stream with an SSE error event, or answers 503 (worker
unreachable or timed out) / 500 (compute failed) / 400 (context full).
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid

import structlog
from aiohttp import web

from coordinator.serving import access, chat_templates, embeddings, llama_server_api, openai_api, structured_output
from coordinator.serving import web_page
from coordinator.serving import tools as tool_requests
from coordinator.serving.batching import EmbeddingFailed, QueueFull, Scheduler, ShuttingDown
from coordinator.serving.cluster_view import ClusterView
from coordinator.serving.health import ServerHealth
from coordinator.serving.metrics import CONTENT_TYPE, Metrics
from coordinator.serving.openai_api import ApiError, CompletionReply
from coordinator.text import tool_calls

log = structlog.get_logger("http")

QUEUE_FULL_RETRY_SECONDS = 1  # Retry-After of a 429: a slot frees as soon as any request ends
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")  # a client's X-Request-Id we take as it is
SSE_DONE = b"data: [DONE]\n\n"


def _request_id(given: str | None) -> str:
    """The client's X-Request-Id when it is a sane token (it goes into every
    log line of the request), else a new one."""
    return given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]


def _sse_data(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.response_headers())


class CompletionServer:
    def __init__(self, coord, model_name: str, n_slots: int, n_ctx_slot: int, reconnect_interval: float = 1.0,
                 api_key: str | None = None, cors_origin: str = "*", max_queue: int | None = None,
                 chat_template: str | None = None, metrics_endpoint: bool = True, n_predict: int | None = None,
                 slots_endpoint: bool = True, pooling: str | None = None, context_shift: bool = False):
        """`chat_template`: a built-in template's name or a Jinja file (--chat-template;
        ChatTemplateError if it is neither); default the model's own, else a generic fallback.
        `metrics_endpoint`: serve /metrics (--metrics/--no-metrics). `n_predict`: the most tokens a
        request generates, and what it gets when it asks no number (-n); None: no limit.
        `slots_endpoint`: serve llama-server's /slots (--slots/--no-slots). `api_key`: one key or a list.
        `pooling`: /v1/embeddings' (mean, last, cls: --embeddings --pooling); None: embeddings refused.
        `context_shift` (--context-shift): a generation that reaches its slot's context shifts it and goes
        on (batching.py), and max_tokens may pass the context; else it ends there ("length")."""
        self.coord = coord
        self.model_name = model_name
        self.metrics = Metrics(coord)
        self.scheduler = Scheduler(coord, n_slots, n_ctx_slot, self.metrics, max_queue=max_queue,
                                   context_shift=context_shift)
        self.context_shift = context_shift
        self.cluster = ClusterView(coord, self.scheduler, model_name)
        self.health_check = ServerHealth(coord, self.scheduler)
        self.api_key = access.ApiKey(api_key) if api_key else None
        self.cors_origin = cors_origin
        self.metrics_endpoint = metrics_endpoint
        self.n_predict = n_predict
        self.slots_endpoint = slots_endpoint
        if pooling is not None and pooling not in embeddings.POOLING:
            raise ValueError(f"pooling must be one of {', '.join(embeddings.POOLING)}, not {pooling!r}")
        self.pooling = pooling
        self.created = int(time.time())
        tok = coord.tokenizer
        self.n_vocab = min(coord.hp.n_vocab, len(tok.tokens))  # an id beyond either is refused
        self.bos_token = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""  # what chat templates call them
        self.eos_token = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
        self.n_ctx_slot = n_ctx_slot
        self.reconnect_interval = reconnect_interval
        self.chat = chat_templates.select(chat_template, coord.gguf.get("tokenizer.chat_template"),
                                          coord.hp.arch, coord.arch.FALLBACK_CHAT_TEMPLATE)
        if self.chat.source == "fallback":
            log.warning(f"the model has no chat template (tokenizer.chat_template): chat uses the generic "
                        f"{self.chat.name} template, and a base model mostly continues the user's text; choose "
                        f"one with --chat-template NAME or FILE", chat_template=self.chat.name,
                        builtin=sorted(chat_templates.BUILTIN))
        else:
            log.info("chat template", chat_template=self.chat.name, source=self.chat.source)
        self.call_format = tool_requests.call_format(self.chat)  # how a forced tool call is written (serving/tools.py)

    # ------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=4 << 20, middlewares=[self._frame])
        app.router.add_get("/health", self.health)
        if self.metrics_endpoint:
            app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/completion", self.native_completion)
        app.router.add_post("/completions", self.native_completion)  # llama-server's alias
        app.router.add_post("/infill", self.infill)
        app.router.add_post("/apply-template", self.apply_template)
        for path in ("/v1/embeddings", "/embeddings", "/embedding"):
            app.router.add_post(path, self.embeddings)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/props", self.props)
        if self.slots_endpoint:
            app.router.add_get("/slots", self.slots)
        app.router.add_get("/cluster", self.cluster.handle_snapshot)
        app.router.add_get("/cluster/events", self.cluster.handle_stream)
        web_page.add_routes(app, auth_required=self.api_key is not None)
        app.on_response_prepare.append(self._response_headers)
        app.on_startup.append(self._startup)
        app.on_shutdown.append(self.cluster.close)  # ends the event streams before the wait for handlers
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app) -> None:
        self.scheduler.start()
        self.cluster.start()
        # a failed worker is retried in the background with backoff; service resumes by itself
        if self.coord.resume_within is None:  # resuming keeps its own, faster backoff (coordinator/decode/resume.py)
            self.coord.set_auto_reconnect(True, backoff=(self.reconnect_interval, 10.0))

    async def _cleanup(self, app) -> None:
        self.coord.set_auto_reconnect(False)
        await self.scheduler.stop()

    @web.middleware
    async def _frame(self, request, handler):
        """Every request: its id (the client's X-Request-Id or a new one) in
        every log line and echoed back, CORS preflight, the API key, errors as
        JSON, one access log line and the request metrics."""
        request_id = _request_id(request.headers.get("X-Request-Id"))
        request["request_id"] = request_id
        request["started"] = started = time.monotonic()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        status = 500
        try:
            response = await self._handle(request, handler)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away first (nginx's code for it)
            raise
        except web.HTTPException as exc:  # below 400, passed on as aiohttp answers it
            status = exc.status
            raise
        finally:
            duration = time.monotonic() - started
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "other"  # no label per unknown path
            self.metrics.observe_request(route, status, duration)
            log.info("request", method=request.method, path=request.path, status=status,
                     duration_ms=round(duration * 1000, 1))
            structlog.contextvars.unbind_contextvars("request_id")

    async def _handle(self, request, handler) -> web.StreamResponse:
        try:
            if request.method == "OPTIONS":  # CORS preflight: no credentials, by the browser's rules
                requested = request.headers.get("Access-Control-Request-Headers")
                return web.Response(status=204, headers=access.preflight_headers(requested))
            if self.api_key is not None and access.needs_key(request.path):
                self.api_key.check(request.headers.get("Authorization", ""))
            return await handler(request)
        except ApiError as exc:
            log.info("request refused", status=exc.status, error=exc.message)
            return error_response(exc)
        except web.HTTPException as exc:  # aiohttp's own 404, 405, 413...: the same JSON error body
            if exc.status < 400:
                raise
            return error_response(ApiError(exc.status, exc.reason if exc.status != 413 else exc.text or exc.reason))

    async def _response_headers(self, request, response) -> None:
        """On every response, streams and errors included."""
        for name, value in access.cors_headers(self.cors_origin).items():
            response.headers[name] = value
        if "request_id" in request:
            response.headers["X-Request-Id"] = request["request_id"]

    # ------------------------------------------------------------ health and metrics
    async def health(self, request) -> web.Response:
        status, body = self.health_check.state()
        headers = {"Retry-After": str(math.ceil(self.health_check.retry_after()))} if status == 503 else None
        return web.json_response(body, status=status, headers=headers)

    async def metrics_handler(self, request) -> web.Response:
        return web.Response(body=self.metrics.render(self.scheduler), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request) -> web.Response:
        return web.json_response(openai_api.model_list(self.model_name, self.created))

    async def model(self, request) -> web.Response:
        wanted = request.match_info["model_id"]
        if wanted != self.model_name:
            raise openai_api.model_not_found(wanted, self.model_name)
        return web.json_response(openai_api.model_object(self.model_name, self.created))

    async def props(self, request) -> web.Response:
        from rpc_daemon.service.version import package_version
        health = self.coord.health()
        split = {"split_mode": health.get("split_mode", "layer"), "split_choice": health.get("split_choice"),
                 "workers": [{k: e[k] for k in ("endpoint", "layers", "head_rows", "shard") if k in e}
                             for e in self.coord.endpoints()]}
        return web.json_response(llama_server_api.props(self.model_name, self.scheduler.n_slots, self.n_ctx_slot,
                                                        self.chat, package_version(), split))

    async def slots(self, request) -> web.Response:
        sched = self.scheduler
        busy = {slot.seq: {"request_id": slot.request_id, "n_prompt_tokens": len(slot.prompt),
                           "n_prompt_tokens_cache": slot.cached, "n_decoded": slot.generated,
                           "n_remain": slot.max_tokens - slot.generated} for slot in sched.active}
        cached = {seq: len(tokens) for seq, tokens in sched.cache.items()}
        cached.update({slot.seq: len(slot.kv) for slot in sched.active if slot.kv is not None})
        return web.json_response(llama_server_api.slots(sched.n_slots, self.n_ctx_slot, busy, cached))

    async def apply_template(self, request) -> web.Response:
        """llama-server's /apply-template: a chat body's messages (and tools, chat_template_kwargs) rendered
        by the chat template, ready for the assistant's answer: {"prompt": text}."""
        req = openai_api.parse_chat(await self._body(request), self.n_ctx_slot, self.n_vocab, self.n_predict,
                                    self.call_format, self.context_shift)
        return web.json_response({"prompt": openai_api.chat_prompt(self.chat, req.messages, self.bos_token,
                                                                   self.eos_token, req.template_kwargs,
                                                                   req.tools)})

    async def embeddings(self, request) -> web.Response:
        """/v1/embeddings (and llama-server's /embeddings, /embedding): one pooled, L2-normalized vector
        per input (embeddings.py), computed on free slots (Scheduler.embed); 501 without --embeddings.
        A text is tokenized as llama-server does (special tokens added and parsed); token ids are taken
        as they are."""
        if self.pooling is None:
            raise ApiError(501, "This server does not support embeddings. Start it with `--embeddings`",
                           "not_supported_error")
        req = embeddings.parse_embeddings(await self._body(request), self.n_vocab)
        param = req.param
        texts = [x for x in req.inputs if isinstance(x, str)]
        for text in texts:
            openai_api.check_text_fits(text, self.n_ctx_slot, param)
        encoded = iter(await asyncio.get_running_loop().run_in_executor(
            None, lambda: [self.coord.tokenize(t, add_special=True, parse_special=True) for t in texts]) if texts else [])
        inputs = [next(encoded) if isinstance(x, str) else list(x) for x in req.inputs]
        for i, ids in enumerate(inputs):
            if not ids:
                raise ApiError(400, f"input {i} holds no token", param=param)
            if len(ids) > self.n_ctx_slot:
                raise ApiError(400, f"input {i} of {len(ids)} tokens exceeds the context of {self.n_ctx_slot} "
                                    f"tokens per slot", param=param, code="context_length_exceeded")
        if self.scheduler.closing:
            raise openai_api.shutting_down()
        self._refuse_for_outage()
        try:
            rows = await self.scheduler.embed(inputs, lambda n: embeddings.rows_wanted(n, self.pooling))
        except ShuttingDown:
            raise openai_api.shutting_down() from None
        except QueueFull as exc:
            raise openai_api.server_busy(self.scheduler.n_slots, exc.waiting, self.scheduler.max_queue,
                                         QUEUE_FULL_RETRY_SECONDS) from None
        except EmbeddingFailed as exc:
            raise openai_api.decode_failed(exc.message, exc.code, self.health_check.retry_after()) from None
        vectors = [embeddings.pool(r, self.pooling) for r in rows]
        return web.json_response(embeddings.reply(vectors, self.model_name, sum(map(len, inputs)),
                                                  req.encoding_format))

    # ------------------------------------------------------------ tokens
    async def tokenize(self, request) -> web.Response:
        """llama-server's /tokenize: {content, add_special (default false),
        parse_special (default true)} -> {tokens}."""
        req = llama_server_api.parse_tokenize(await self._body(request))
        ids = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.coord.tokenize(req.content, add_special=req.add_special,
                                              parse_special=req.parse_special))
        return web.json_response({"tokens": ids})

    async def detokenize(self, request) -> web.Response:
        ids = llama_server_api.parse_detokenize(await self._body(request), self.n_vocab)
        text = await asyncio.get_running_loop().run_in_executor(None, lambda: self.coord.detokenize(ids))
        return web.json_response({"content": text})

    # ------------------------------------------------------------ completions
    @staticmethod
    async def _body(request) -> dict:
        try:
            text = await request.text()
        except ValueError:  # UnicodeDecodeError: not in the body's charset
            raise ApiError(400, "request body is not valid JSON") from None
        return openai_api.request_body(text)

    async def completions(self, request) -> web.StreamResponse:
        req = openai_api.parse_completion(await self._body(request), self.n_vocab, self.n_ctx_slot, self.n_predict,
                                          self.context_shift)
        gen = req.generation
        if isinstance(req.prompt, str):
            ids, echo = await self._tokenize(req.prompt, gen.max_tokens or 1), req.prompt
        else:
            ids, echo = req.prompt, self.coord.detokenize(req.prompt) if gen.echo else ""
        max_tokens = gen.max_tokens if gen.max_tokens is not None else self.n_ctx_slot - len(ids)
        return await self._serve(request, ids, max_tokens, gen, False, echo if gen.echo else None)

    async def _tokenize(self, text: str, max_tokens: int, chat: bool = False) -> list[int]:
        """Off the event loop (a megabyte prompt takes seconds; /health and the
        other streams must not wait), and refused early when it cannot fit."""
        param = "messages" if chat else "prompt"
        openai_api.check_text_fits(text, self.n_ctx_slot, param)
        kw = {"add_special": False, "parse_special": True} if chat else {}
        ids = await asyncio.get_running_loop().run_in_executor(None, lambda: self.coord.tokenize(text, **kw))
        openai_api.check_fits(len(ids), max_tokens, self.n_ctx_slot, param, self.context_shift)
        return ids

    async def chat_completions(self, request) -> web.StreamResponse:
        req = openai_api.parse_chat(await self._body(request), self.n_ctx_slot, self.n_vocab, self.n_predict,
                                    self.call_format, self.context_shift)
        gen = req.generation
        text = openai_api.chat_prompt(self.chat, req.messages, self.bos_token, self.eos_token, req.template_kwargs,
                                      req.tools)
        ids = await self._tokenize(text, gen.max_tokens or 1, chat=True)
        max_tokens = gen.max_tokens if gen.max_tokens is not None else self.n_ctx_slot - len(ids)
        return await self._serve(request, ids, max_tokens, gen, True, tools=req.tools)

    # ------------------------------------------------------------ llama-server's /completion and /infill
    async def native_completion(self, request) -> web.StreamResponse:
        """llama-server's /completion: its fields and reply shape (llama_server_api.py)."""
        req = llama_server_api.parse_native_completion(await self._body(request), self.n_vocab, self.n_ctx_slot,
                                                       self.n_predict, context_shift=self.context_shift)
        gen = req.generation
        if isinstance(req.prompt, str):
            ids = await self._tokenize(req.prompt, gen.max_tokens or 1)
            text = req.prompt
        else:
            ids, text = req.prompt, self.coord.detokenize(req.prompt)
        return await self._serve_native(request, ids, gen, text)

    async def infill(self, request) -> web.StreamResponse:
        """llama-server's /infill: the FIM prompt of input_prefix, input_suffix, input_extra and prompt
        (llama_server_api.infill_prompt), completed as /completion does; 400 for a model without FIM tokens."""
        tok = self.coord.tokenizer
        fim = llama_server_api.fim_tokens(self.coord.gguf.get, tok.piece_to_id, self.n_vocab)
        if fim.missing:
            raise ApiError(400, f"infill is not supported by this model: it has no fill-in-the-middle tokens "
                                f"({', '.join(fim.missing)}; the GGUF's tokenizer.ggml.fim_pre_token_id, "
                                f"fim_suf_token_id, fim_mid_token_id)")
        req = llama_server_api.parse_infill(await self._body(request), self.n_vocab, self.n_ctx_slot, self.n_predict,
                                            self.context_shift)
        gen = req.completion.generation
        for param, text in (("input_prefix", req.input_prefix), ("input_suffix", req.input_suffix),
                            ("prompt", req.completion.prompt)):
            openai_api.check_text_fits(text, self.n_ctx_slot, param)

        def assemble() -> list[int]:
            plain = lambda text: self.coord.tokenize(text, add_special=False, parse_special=False)  # noqa: E731
            prompt = self.coord.tokenize(req.completion.prompt, add_special=False, parse_special=True)
            return llama_server_api.infill_prompt(
                fim, plain, req.input_prefix, req.input_suffix, req.input_extra, prompt, self.coord.n_batch,
                self.n_predict or -1, self.n_ctx_slot, tok.bos_id if tok.add_bos else None)
        ids = await asyncio.get_running_loop().run_in_executor(None, assemble)
        openai_api.check_fits(len(ids), gen.max_tokens or 1, self.n_ctx_slot, context_shift=self.context_shift)
        return await self._serve_native(request, ids, gen, self.coord.detokenize(ids))

    async def _serve_native(self, request, ids: list[int], gen: openai_api.Generation,
                            prompt_text: str) -> web.StreamResponse:
        """One completion in llama-server's shape: whole, or streamed as `data: {...}` events
        (`content` pieces, then a last one with `stop` true and the counts; no [DONE], as llama-server)."""
        max_tokens = gen.max_tokens if gen.max_tokens is not None else self.n_ctx_slot - len(ids)
        slots = []
        try:
            await self._submit(request, slots, ids, max_tokens, gen)
            slot = slots[0]
            probs = (lambda entries: llama_server_api.completion_probabilities(entries or [], self._piece)) \
                if gen.logprobs is not None else (lambda entries: None)

            def final(content: str, finish_reason: str, probabilities=None) -> dict:
                started, first = slot.started_at, slot.first_token_at or slot.started_at
                ended = slot.finished_at or time.monotonic()
                timing = llama_server_api.timings(slot.cached, len(ids) - slot.cached, first - started,
                                                  slot.generated, ended - first)
                return llama_server_api.native_final(content, self.model_name, slot.seq, slot.generated, len(ids),
                                                     prompt_text, finish_reason, slot.text.stop_word, slot.cached,
                                                     timing, probabilities, truncated=slot.shifts > 0)
            if not gen.stream:
                parts, entries = [], []
                while True:
                    ev = await slot.events.get()
                    if ev.kind == "error":
                        raise openai_api.decode_failed(ev.message, ev.code, self.health_check.retry_after())
                    parts.append(ev.text)
                    entries += ev.logprobs or []
                    if ev.kind == "done":
                        return web.json_response(final("".join(parts), ev.finish_reason, probs(entries)))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            try:
                while True:
                    ev = await slot.events.get()
                    if ev.kind == "error":
                        await resp.write(_sse_data(openai_api.stream_error(ev.message, ev.code, ev.endpoint)))
                        break
                    if ev.text or ev.logprobs:
                        await resp.write(_sse_data(llama_server_api.native_partial(
                            ev.text, slot.seq, slot.generated, len(ids), probs(ev.logprobs))))
                    if ev.kind == "done":
                        await resp.write(_sse_data(final("", ev.finish_reason)))
                        break
                await resp.write_eof()
            except (ConnectionResetError, asyncio.CancelledError):
                log.info("client disconnected mid-stream; slot freed", seq=slot.seq)
                raise
            return resp
        finally:
            for slot in slots:
                self.scheduler.cancel(slot)
            if slots:
                self.metrics.observe_latency(request["started"], slots[0])

    async def _serve(self, request, ids: list[int], max_tokens: int, gen: openai_api.Generation,
                     chat: bool, echo: str | None = None,
                     tools: tool_requests.Tools | None = None) -> web.StreamResponse:
        """One slot per choice (gen.n): the first decodes the prompt, the others
        share its KV rows when they get their slots before it is done
        (Scheduler.submit's share_from). `echo`: the prompt's text, before the completion.
        `tools`: a chat's tools; when active the answers are parsed for tool calls."""
        reply = CompletionReply(openai_api.new_completion_id(chat), int(time.time()), self.model_name, chat)
        slots = []
        try:
            await self._submit(request, slots, ids, max_tokens, gen, echo is not None)
            answer = _Answer(reply, gen, chat, echo, len(ids), self._piece,
                             tools if tools is not None and tools.active else None)
            if gen.stream:
                return await self._stream(request, slots, answer)
            return await self._collect(slots, answer)
        finally:
            for slot in slots:
                self.scheduler.cancel(slot)
            if slots:
                self.metrics.observe_latency(request["started"], slots[0])

    async def _submit(self, request, slots: list, ids: list[int], max_tokens: int, gen: openai_api.Generation,
                      echo: bool = False) -> None:
        """A slot per choice (gen.n) into `slots` (the caller cancels them, all it got, when it ends);
        the refusals of a request the server cannot take now (shutting down, an outage, 429)."""
        if self.scheduler.closing:
            raise openai_api.shutting_down()
        if not self.scheduler.alive:
            raise openai_api.decode_loop_stopped()
        self._refuse_for_outage()
        try:
            samplers = gen.samplers(self.coord.tokenizer.eog_ids)
            if gen.grammar is not None:  # a matcher per choice (the first builds the vocabulary's table: ~4 s)
                await asyncio.to_thread(structured_output.constrain, samplers, self.coord.tokenizer, gen.grammar)
            for sampler in samplers:
                slots.append(await self.scheduler.submit(ids, max_tokens, sampler, gen.stop, logprobs=gen.logprobs,
                                                         echo=echo, share_from=slots[0] if slots else None,
                                                         cache_prompt=gen.cache_prompt,
                                                         request_id=request.get("request_id"), n_keep=gen.n_keep))
        except ShuttingDown:
            raise openai_api.shutting_down() from None
        except QueueFull as exc:
            raise openai_api.server_busy(self.scheduler.n_slots, exc.waiting, self.scheduler.max_queue,
                                         QUEUE_FULL_RETRY_SECONDS) from None
        self._refuse_for_outage()  # it waited for a slot while an outage gave up: it ends now, with the others

    def _piece(self, token: int) -> bytes:
        """A token's bytes in logprobs (special tokens as their text)."""
        return self.coord.tokenizer.token_to_piece(token, special=True)

    def _refuse_for_outage(self) -> None:
        """503 for a failed worker exactly when /health says 503 for it (health.refused_for): resuming off,
        or its outage past --resume-within. While its stage resumes a request is taken, and waits like
        those in flight (at most until the outage's deadline)."""
        failed = self.health_check.refused_for()
        if failed is not None:
            raise openai_api.worker_unavailable(failed["endpoint"], failed["cause"], self.health_check.retry_after())

    async def _collect(self, slots, answer: "_Answer") -> web.Response:
        """Each choice's events in turn (a slot's queue holds them until read)."""
        choices = []
        for index, slot in enumerate(slots):
            parts, entries, prompt_entries = [], [], None
            while True:
                ev = await slot.events.get()
                if ev.kind == "prompt":
                    prompt_entries = ev.logprobs
                elif ev.kind in ("text", "done"):
                    parts.append(ev.text)
                    entries += ev.logprobs or []
                    if ev.kind == "done":
                        break
                else:
                    raise openai_api.decode_failed(ev.message, ev.code, self.health_check.retry_after())
            choices.append(answer.choice(index, "".join(parts), ev.finish_reason, entries, prompt_entries))
        return web.json_response(answer.reply.completions(choices, answer.n_prompt, sum(s.generated for s in slots),
                                                          slots[0].cached))

    async def _stream(self, request, slots, answer: "_Answer") -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        events: asyncio.Queue = asyncio.Queue()  # (choice, event) of every choice, as they come

        async def forward(index: int, slot) -> None:
            while True:
                ev = await slot.events.get()
                events.put_nowait((index, ev))
                if ev.kind in ("done", "error"):
                    return

        forwarders = [asyncio.create_task(forward(i, slot)) for i, slot in enumerate(slots)]
        include_usage = answer.gen.include_usage
        try:
            running = len(slots)
            while running:
                index, ev = await events.get()
                if ev.kind == "error":
                    await resp.write(_sse_data(openai_api.stream_error(ev.message, ev.code, ev.endpoint)))
                    break
                for chunk in answer.chunks(index, ev):
                    await resp.write(_sse_data(chunk))
                if ev.kind == "done":
                    running -= 1
            else:
                if include_usage:
                    await resp.write(_sse_data(answer.reply.usage_chunk(answer.n_prompt,
                                                                        sum(s.generated for s in slots),
                                                                        slots[0].cached)))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client disconnected mid-stream; slot freed", seq=[slot.seq for slot in slots])
            raise
        finally:
            for task in forwarders:
                task.cancel()
        return resp


class _Answer:
    """How one request's choices are shown: its reply's objects, with the echoed
    prompt and the logprobs in the endpoint's shape."""

    def __init__(self, reply: CompletionReply, gen: openai_api.Generation, chat: bool, echo: str | None,
                 n_prompt: int, piece, tools: tool_requests.Tools | None = None):
        self.reply, self.gen, self.chat, self.echo, self.n_prompt, self.piece = reply, gen, chat, echo, n_prompt, piece
        self.base = len(echo) if echo is not None else 0  # the completion's text offsets start after the echo
        self.tools = tools  # active tools: answers are parsed for calls
        self.splitters: dict[int, tool_calls.CallSplitter] = {}  # a stream's, per choice
        self.held_logprobs: dict[int, list] = {}  # the logprobs of the text a splitter holds

    def calls(self, text: str) -> tool_calls.Parsed | None:
        """The tool calls an answer holds (only the first without parallel_tool_calls), or None."""
        parsed = tool_calls.parse(text, self.tools.names)
        if not parsed.calls:
            return None
        return parsed if self.tools.parallel else tool_calls.Parsed(parsed.content, parsed.calls[:1])

    def logprobs(self, entries, prompt=(), base: int = 0, whole: bool = False) -> dict | None:
        """The logprobs object of these entries; None without logprobs, or for a chunk of no token."""
        if self.gen.logprobs is None or (not whole and not entries and not prompt):
            return None
        if self.chat:
            return openai_api.chat_logprobs(entries, self.piece)
        return openai_api.completion_logprobs(entries, self.piece, base, prompt)

    def choice(self, index: int, text: str, finish_reason: str, entries, prompt_entries) -> dict:
        """A whole choice: the echo first, then the completion."""
        logprobs = self.logprobs(entries, prompt_entries or (), self.base, whole=True)
        parsed = self.calls(text) if self.tools is not None else None
        if parsed is not None:
            return openai_api.tool_call_choice(parsed, index, logprobs)
        return openai_api.choice((self.echo or "") + text, finish_reason, self.chat, False, index, logprobs)

    def chunks(self, index: int, ev) -> list[dict]:
        """A stream's chunks for an event of choice `index`. With tools, text that may be a call is
        held (tool_calls.CallSplitter) and, at the end, sent as `delta.tool_calls` or as content."""
        if self.tools is None or ev.kind == "prompt":
            return [self.chunk(index, ev)]
        splitter = self.splitters.setdefault(index, tool_calls.CallSplitter())
        held = self.held_logprobs.setdefault(index, [])
        held += ev.logprobs or []
        text = splitter.feed(ev.text)
        out = []
        if ev.kind == "done":
            rest = splitter.finish()
            parsed = self.calls(rest) if rest else None
            if parsed is not None:
                if parsed.content:
                    text += parsed.content
                if text:
                    out.append(self.reply.chunk(text, None, self.gen.include_usage, index, self.logprobs(held)))
                    held = []
                for delta in openai_api.tool_call_deltas(parsed.calls):
                    out.append(self.reply.delta_chunk(delta, None, self.gen.include_usage, index,
                                                      self.logprobs(held)))
                    held = []
                out.append(self.reply.delta_chunk({}, "tool_calls", self.gen.include_usage, index))
                return out
            text += rest
            return [self.reply.chunk(text, ev.finish_reason, self.gen.include_usage, index, self.logprobs(held))]
        if not text:
            return []
        self.held_logprobs[index] = []
        return [self.reply.chunk(text, None, self.gen.include_usage, index, self.logprobs(held))]

    def chunk(self, index: int, ev) -> dict:
        """A stream's chunk for a "prompt", "text" or "done" event of choice `index`."""
        if ev.kind == "prompt":
            return self.reply.chunk(self.echo or "", None, self.gen.include_usage, index,
                                    self.logprobs((), ev.logprobs or ()))
        finish = ev.finish_reason if ev.kind == "done" else None
        return self.reply.chunk(ev.text, finish, self.gen.include_usage, index,
                                self.logprobs(ev.logprobs or [], (), self.base))
