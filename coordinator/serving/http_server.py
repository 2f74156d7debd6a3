"""OpenAI-compatible HTTP server over a Coordinator, with health that tells the truth.

/health answers 200 only while the model is loaded, every endpoint is
connected and not latched failed (or its stage resuming: requests pause, then
go on), and the decode loop is alive and not stuck; "degraded" (still 200,
with reasons) while a stage resumes or runs on a spare.
A failed decode ends a stream with an SSE error event, or answers 503 (worker
unreachable or timed out) / 500 (compute failed) / 400 (context full).
The web page at / and the cluster view behind it (/cluster, /cluster/events)
are web_page.py's and cluster_view.py's; this module only routes to them.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import re
import time
import uuid

import jinja2
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from coordinator.decode.values import DecodeResult
from coordinator.serving import chat_templates
from coordinator.serving import web_page
from coordinator.serving.batching import QueueFull, Scheduler, ShuttingDown
from coordinator.serving.cluster_view import ClusterView
from coordinator.text.sampling import Sampler
from rpc_daemon.service.lifecycle import serve_until_signalled

log = structlog.get_logger("http")

DECODE_STALL_SECONDS = 10.0  # a step in flight longer than this makes /health say so
QUEUE_FULL_RETRY_SECONDS = 1  # Retry-After of a 429: a slot frees as soon as any request ends
# open even with --api-key: probes, scrapers, and the web page (which asks for the key)
PUBLIC_PATHS = ("/health", "/metrics", *web_page.PATHS)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")  # a client's X-Request-Id we take as it is


def _request_id(given: str | None) -> str:
    """The client's X-Request-Id when it is a sane token (it goes into every
    log line of the request), else a new one."""
    return given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]


UNSUPPORTED = {  # OpenAI parameters this server does not implement: refused, not silently ignored
    "n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "logit_bias": None,
    "suffix": None, "tools": None, "tool_choice": None, "functions": None, "presence_penalty": 0,
    "frequency_penalty": 0,
}


class ApiError(Exception):
    """An OpenAI-shaped error answer. `retry_after` (seconds) becomes a
    Retry-After header; every 503 carries one (1 s unless told)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: float | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after = 1 if retry_after is None and status in (429, 503) else retry_after
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return web.json_response({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                            "code": self.code}}, status=self.status, headers=headers)


class Metrics:
    def __init__(self, coord):
        self.registry = r = CollectorRegistry()
        self.tokens_generated = Counter("ggml_tokens_generated", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("ggml_prompt_tokens", "Prompt tokens processed", registry=r)
        self.decode_latency = Histogram("ggml_decode_seconds", "Decode step latency", registry=r,
                                        buckets=(.005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10))
        self.decode_failures = Counter("ggml_decode_failures", "Failed decode steps by code", ["code"], registry=r)
        self.tokens_per_second = Gauge("ggml_tokens_per_second", "Tokens per second of the last step", registry=r)
        self.endpoint_up = Gauge("ggml_endpoint_up", "1 if the endpoint is connected and not latched failed",
                                 ["endpoint"], registry=r)
        self.endpoint_rtt = Gauge("ggml_endpoint_rtt_seconds", "Last ping round trip", ["endpoint"], registry=r)
        self.reconnects = Counter("ggml_reconnects", "Successful reconnects", registry=r)
        self.slots_busy = Gauge("ggml_slots_busy", "Slots serving a request", registry=r)
        self.requests_waiting = Gauge("ggml_requests_waiting", "Requests waiting for a free slot", registry=r)
        self.requests = Counter("ggml_http_requests", "HTTP requests answered, by route and status",
                                ["path", "status"], registry=r)
        self.request_seconds = Histogram("ggml_http_request_seconds", "HTTP request duration (a stream: to its end)",
                                         ["path"], registry=r,
                                         buckets=(.005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.ttft = Histogram("ggml_time_to_first_token_seconds", "Request arrival to its first sampled token "
                              "(queueing and prompt processing included)", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.tpot = Histogram("ggml_time_per_output_token_seconds", "A request's mean time between its tokens "
                              "after the first", registry=r,
                              buckets=(.005, .01, .02, .05, .1, .2, .5, 1, 2))
        self.resumes = Counter("ggml_resumes", "Decode steps that paused for a lost worker and went on", registry=r)
        self.resume_seconds = Counter("ggml_resume_seconds", "Seconds decode steps were paused for a lost worker",
                                      registry=r)
        self.replayed_tokens = Counter("ggml_replayed_tokens", "Tokens replayed to rebuild a lost KV cache",
                                       registry=r)
        self.spare_takeovers = Counter("ggml_spare_takeovers", "Stages moved to a spare worker", registry=r)
        self.linked_steps = Counter("ggml_linked_steps", "Decode steps whose activations went worker to worker "
                                                         "(step links; the others were relayed)", registry=r)
        self.head_steps = Counter("ggml_head_steps", "Decode steps by where their output head ran (split over "
                                  "every worker, whole on the last, or here: the last worker's share and the rest "
                                  "in the coordinator)", ["placement"], registry=r)
        self.head_split = Gauge("ggml_head_split", "1 if the last step's output head was split (over the workers, "
                                "or here), 0 if whole on the last worker", registry=r)
        self.head_one_way = Gauge("ggml_head_one_way_seconds", "The one-way delay the head placement was chosen by "
                                  "(half the slowest worker's median ping)", registry=r)
        self.coord = coord
        self._seen = {}  # the coordinator's counters as last copied into the metrics

    def observe_decode(self, seconds: float, code: DecodeResult, n_tokens: int) -> None:
        self.decode_latency.observe(seconds)
        if code != DecodeResult.OK:
            self.decode_failures.labels(code=DecodeResult(code).name).inc()
        elif seconds > 0:
            self.tokens_per_second.set(n_tokens / seconds)

    def _advance(self, counter, key: str, value) -> None:
        """Bring `counter` up to the coordinator's count `value` (copied under `key` last time)."""
        if value > self._seen.get(key, 0):
            counter.inc(value - self._seen.get(key, 0))
            self._seen[key] = value

    def refresh(self, scheduler: Scheduler) -> None:
        failed = {f.endpoint for f in self.coord.failed_endpoints()}
        for e in self.coord.endpoints():
            self.endpoint_up.labels(endpoint=e["endpoint"]).set(0 if e["endpoint"] in failed else 1)
            if e.get("rtt") is not None:
                self.endpoint_rtt.labels(endpoint=e["endpoint"]).set(e["rtt"])
        self.slots_busy.set(scheduler.busy)
        self.requests_waiting.set(scheduler.waiting)
        for key, counter in (("reconnects", self.reconnects), ("resumes", self.resumes),
                             ("resume_seconds", self.resume_seconds), ("replayed_tokens", self.replayed_tokens),
                             ("spare_takeovers", self.spare_takeovers), ("linked_steps", self.linked_steps)):
            self._advance(counter, key, self.coord.stats.get(key, 0))
        head = self.coord.head_placement()
        for placement in ("split", "whole", "here"):
            self._advance(self.head_steps.labels(placement=placement), f"head_{placement}",
                          head[f"steps_{placement}"])
        if head["choice"] is not None:
            self.head_split.set(0 if head["choice"] == "whole" else 1)
        if head["one_way_seconds"] is not None:
            self.head_one_way.set(head["one_way_seconds"])


class CompletionServer:
    def __init__(self, coord, model_name: str, n_slots: int, n_ctx_slot: int, reconnect_interval: float = 1.0,
                 api_key: str | None = None, cors_origin: str = "*", max_queue: int | None = None,
                 chat_template: str | None = None, metrics_endpoint: bool = True):
        """`chat_template`: a built-in template's name or a Jinja file (--chat-template;
        ChatTemplateError if it is neither); default the model's own, else a generic fallback.
        `metrics_endpoint`: serve /metrics (--metrics/--no-metrics)."""
        self.coord = coord
        self.model_name = model_name
        self.metrics = Metrics(coord)
        self.scheduler = Scheduler(coord, n_slots, n_ctx_slot, self.metrics, max_queue=max_queue)
        self.cluster = ClusterView(coord, self.scheduler, model_name)
        self.api_key = api_key.encode("utf-8", "surrogateescape") if api_key else None
        self.cors_origin = cors_origin
        self.metrics_endpoint = metrics_endpoint
        self.created = int(time.time())
        tok = coord.tokenizer
        self.n_vocab = min(coord.hp.n_vocab, len(tok.tokens))  # an id beyond either is refused
        self.n_ctx_slot = n_ctx_slot
        self.reconnect_interval = reconnect_interval
        self.loaded = True
        self.chat = chat_templates.select(chat_template, coord.gguf.get("tokenizer.chat_template"),
                                          coord.hp.arch, coord.arch.FALLBACK_CHAT_TEMPLATE)
        if self.chat.source == "fallback":
            log.warning(f"the model has no chat template (tokenizer.chat_template): chat uses the generic "
                        f"{self.chat.name} template, and a base model mostly continues the user's text; choose "
                        f"one with --chat-template NAME or FILE", chat_template=self.chat.name,
                        builtin=sorted(chat_templates.BUILTIN))
        else:
            log.info("chat template", chat_template=self.chat.name, source=self.chat.source)

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
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/props", self.props)
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
            self.metrics.requests.labels(path=route, status=str(status)).inc()
            self.metrics.request_seconds.labels(path=route).observe(duration)
            log.info("request", method=request.method, path=request.path, status=status,
                     duration_ms=round(duration * 1000, 1))
            structlog.contextvars.unbind_contextvars("request_id")

    async def _handle(self, request, handler) -> web.StreamResponse:
        try:
            if request.method == "OPTIONS":  # CORS preflight: no credentials, by the browser's rules
                return web.Response(status=204, headers={
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers")
                    or "Authorization, Content-Type, X-Request-Id",
                    "Access-Control-Max-Age": "86400"})
            if self.api_key is not None and request.path not in PUBLIC_PATHS:
                self._authorize(request)
            return await handler(request)
        except ApiError as exc:
            log.info("request refused", status=exc.status, error=exc.message)
            return exc.response()
        except web.HTTPException as exc:  # aiohttp's own 404, 405, 413...: the same JSON error body
            if exc.status < 400:
                raise
            return ApiError(exc.status, exc.reason if exc.status != 413 else exc.text or exc.reason).response()

    def _authorize(self, request) -> None:
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of the key was right
        if not (hmac.compare_digest(key.strip().encode("utf-8", "surrogateescape"), self.api_key)
                and scheme.lower() == "bearer"):
            raise ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _response_headers(self, request, response) -> None:
        """On every response, streams and errors included."""
        response.headers["Access-Control-Allow-Origin"] = self.cors_origin
        response.headers["Access-Control-Expose-Headers"] = "X-Request-Id, Retry-After"
        if self.cors_origin != "*":
            response.headers["Vary"] = "Origin"
        if "request_id" in request:
            response.headers["X-Request-Id"] = request["request_id"]

    def _retry_after(self) -> float:
        """Seconds until the next automatic reconnect of a failed worker, when one is scheduled."""
        times = [f.next_attempt for f in self.coord.failed_endpoints() if f.next_attempt is not None]
        return max(1.0, min(times) - time.time()) if times else 1.0

    # ------------------------------------------------------------ health and metrics
    def health_state(self) -> tuple[int, dict]:
        """The library's health (Coordinator.health(): the latch state decodes
        check) plus this server's own: the model loaded, the decode loop alive
        and not stuck."""
        health = self.coord.health()
        reasons = [] if self.loaded else ["model loading"]
        degraded = []  # serving, with a pause or on a spare: 200
        if health["status"] == "resuming":
            degraded += [f"stage on {e['endpoint']} resuming: requests pause" for e in health["endpoints"]
                         if not e["ok"]]
        elif health["status"] not in ("ok", "degraded"):
            reasons.append("endpoints failed")
            if health["status"] == "reconnecting":
                reasons.append("reconnecting")
        degraded += [f"{e['endpoint']} holds the stage of {e['spare_for']} (spare)" for e in health["endpoints"]
                     if e.get("spare_for")]
        reasons += self._decode_loop_problems(health["status"])
        failures = {e["endpoint"]: {"cause": e["cause"], "failed_since": e["since"]}
                    for e in health["endpoints"] if not e["ok"]}
        spare_for = {e["endpoint"]: {"spare_for": e["spare_for"]} for e in health["endpoints"] if e.get("spare_for")}
        status = "unavailable" if reasons else "degraded" if degraded else "ok"
        body = {"status": status, "slots_busy": self.scheduler.busy, "slots": self.scheduler.n_slots,
                "endpoints": [dict(e, **failures.get(e["endpoint"], {}), **spare_for.get(e["endpoint"], {}))
                              for e in self.coord.endpoints()],
                "head": self.coord.head_placement()}
        if reasons or degraded:
            body["reasons"] = reasons + degraded
        return (200 if not reasons else 503), body

    def _decode_loop_problems(self, status: str | None = None) -> list[str]:
        problems = [] if self.scheduler.alive else ["decode loop stopped"]
        started = self.scheduler.decode_started
        resuming = (status or self.coord.health()["status"]) == "resuming"  # a paused step is not a stuck one
        if started is not None and not resuming and time.monotonic() - started > DECODE_STALL_SECONDS:
            problems.append(f"decode step in flight for {time.monotonic() - started:.0f} s")
        return problems

    def decode_loop_healthy(self) -> bool:
        return not self._decode_loop_problems()

    async def health(self, request) -> web.Response:
        status, body = self.health_state()
        headers = {"Retry-After": str(math.ceil(self._retry_after()))} if status == 503 else None
        return web.json_response(body, status=status, headers=headers)

    async def metrics_handler(self, request) -> web.Response:
        self.metrics.refresh(self.scheduler)
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    def _model_object(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "ggml-distributed"}

    async def models(self, request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def model(self, request) -> web.Response:
        wanted = request.match_info["model_id"]
        if wanted != self.model_name:
            raise ApiError(404, f"model {wanted!r} not found; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        return web.json_response(self._model_object())

    async def props(self, request) -> web.Response:
        """What llama-server's /props tells (the fields that apply here)."""
        from rpc_daemon.service.version import package_version
        return web.json_response({
            "model_alias": self.model_name, "total_slots": self.scheduler.n_slots,
            "default_generation_settings": {"n_ctx": self.n_ctx_slot},
            "chat_template": self.chat.text, "chat_template_name": self.chat.name,
            "chat_template_source": self.chat.source, "build_info": f"ggml-distributed {package_version()}"})

    # ------------------------------------------------------------ tokens
    def _token_ids(self, value, name: str) -> list[int]:
        if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
            raise ApiError(400, f"'{name}' must be a list of token ids", param=name)
        bad = next((t for t in value if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} in '{name}' is outside the vocabulary (0..{self.n_vocab - 1})",
                           param=name)
        return value

    async def tokenize(self, request) -> web.Response:
        """llama-server's /tokenize: {content, add_special (default false),
        parse_special (default true)} -> {tokens}."""
        body = await self._body(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "'content' must be a string", param="content")
        add_special = self._param(body, "add_special", bool, False)
        parse_special = self._param(body, "parse_special", bool, True)
        ids = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.coord.tokenize(content, add_special=add_special, parse_special=parse_special))
        return web.json_response({"tokens": ids})

    async def detokenize(self, request) -> web.Response:
        body = await self._body(request)
        ids = self._token_ids(body.get("tokens"), "tokens")
        text = await asyncio.get_running_loop().run_in_executor(None, lambda: self.coord.detokenize(ids))
        return web.json_response({"content": text})

    # ------------------------------------------------------------ completions
    async def _body(self, request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise ApiError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        model = body.get("model")  # one model served: any name gets it (llama-server's way); `model` says which
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", param="model")
        return body

    @staticmethod
    def _param(body, name, kind, default, lo=None, hi=None):
        v = body.get(name, default)
        if v is None:
            return default
        ok = isinstance(v, kind) and not (isinstance(v, bool) and kind is not bool)
        if kind is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not ok:
            raise ApiError(400, f"'{name}' must be of type {kind.__name__}", param=name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ApiError(400, f"'{name}' must be between {lo} and {hi}", param=name)
        return v

    def _sampling(self, body, default_max_tokens: int | None) -> tuple[int | None, Sampler, list[str], bool]:
        for name, neutral in UNSUPPORTED.items():
            if body.get(name, neutral) not in (neutral, None):
                raise ApiError(400, f"'{name}' is not supported by this server", param=name)
        rf = body.get("response_format")
        if rf is not None and rf != {"type": "text"}:
            raise ApiError(400, "'response_format' other than {\"type\": \"text\"} is not supported",
                           param="response_format")
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
            body = dict(body, max_tokens=body["max_completion_tokens"])
        max_tokens = self._param(body, "max_tokens", int, default_max_tokens, 1, self.n_ctx_slot)
        temperature = self._param(body, "temperature", float, 1.0, 0.0, 2.0)
        top_p = self._param(body, "top_p", float, 1.0, 1e-6, 1.0)
        top_k = self._param(body, "top_k", int, 0, 0, 1 << 20)
        seed = self._param(body, "seed", int, None)
        stream = self._param(body, "stream", bool, False)
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
        if seed is not None and not 0 <= seed < 2**63:
            raise ApiError(400, "'seed' must be between 0 and 2**63 - 1", param="seed")
        try:
            return max_tokens, Sampler(temperature, top_k, top_p, seed), stop, stream
        except ValueError as exc:  # NaN, and whatever else the sampler refuses
            raise ApiError(400, str(exc)) from None

    def _check_fits(self, prompt_ids: list[int], max_tokens: int, param: str = "prompt") -> None:
        if len(prompt_ids) + max_tokens > self.n_ctx_slot:
            raise ApiError(400, f"prompt of {len(prompt_ids)} tokens plus max_tokens {max_tokens} exceeds the "
                                f"context of {self.n_ctx_slot} tokens per slot", param=param,
                           code="context_length_exceeded")

    @staticmethod
    def _stream_options(body, stream: bool) -> bool:
        """include_usage: a last chunk with `usage` and no choices (OpenAI's);
        without `stream` the answer has `usage` anyway."""
        options = body.get("stream_options")
        if options is None:
            return False
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise ApiError(400, "'stream_options' must be an object like {\"include_usage\": true}",
                           param="stream_options")
        return stream and options.get("include_usage", False)

    def _prompt(self, prompt) -> str | list[int]:
        """A string, a list of token ids, or a list holding one of those."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            return self._token_ids(prompt, "prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, f"'prompt' holds {len(prompt)} prompts; this server answers one prompt per request: "
                                f"send each in a request of its own", param="prompt")
        raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list holding one of those",
                       param="prompt")

    async def completions(self, request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = self._prompt(body.get("prompt"))
        max_tokens, sampler, stop, stream = self._sampling(body, 16)
        include_usage = self._stream_options(body, stream)
        if isinstance(prompt, str):
            ids = await self._tokenize(prompt, max_tokens)
        else:
            ids = prompt
            self._check_fits(ids, max_tokens)
        return await self._serve(request, ids, max_tokens, sampler, stop, stream, False, include_usage)

    async def _tokenize(self, text: str, max_tokens: int, chat: bool = False) -> list[int]:
        """Off the event loop (a megabyte prompt takes seconds; /health and the
        other streams must not wait), and refused early when it cannot fit."""
        if len(text.encode("utf-8", "surrogatepass")) > 64 * self.n_ctx_slot:  # no vocabulary packs 64 bytes a token
            raise ApiError(400, f"prompt of {len(text)} characters cannot fit the context of {self.n_ctx_slot} "
                                f"tokens per slot", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        kw = {"add_special": False, "parse_special": True} if chat else {}
        ids = await asyncio.get_running_loop().run_in_executor(None, lambda: self.coord.tokenize(text, **kw))
        self._check_fits(ids, max_tokens, "messages" if chat else "prompt")
        return ids

    @staticmethod
    def _message(i: int, m):
        """A message with `content` as text: a list of parts becomes its text
        parts joined; any other part type is refused by name."""
        if not isinstance(m, dict) or not isinstance(m.get("content"), list):
            return m
        texts = []
        for part in m["content"]:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ApiError(400, f"messages[{i}].content: parts of type {kind!r} are not supported; this server "
                                    f"takes text parts only", param="messages")
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: a text part needs a string 'text'", param="messages")
            texts.append(part["text"])
        return dict(m, content="".join(texts))

    async def chat_completions(self, request) -> web.StreamResponse:
        body = await self._body(request)
        messages = body.get("messages")
        if isinstance(messages, list):
            messages = [self._message(i, m) for i, m in enumerate(messages)]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        # chat clients leave max_tokens out expecting the whole answer: up to the slot's context
        max_tokens, sampler, stop, stream = self._sampling(body, None)
        include_usage = self._stream_options(body, stream)
        tok = self.coord.tokenizer
        try:
            text = self.chat.template.render(messages=messages, add_generation_prompt=True,
                                             bos_token=tok.tokens[tok.bos_id] if tok.bos_id is not None else "",
                                             eos_token=tok.tokens[tok.eos_id] if tok.eos_id is not None else "")
        except jinja2.TemplateError as exc:  # e.g. the template's raise_exception("roles must alternate")
            raise ApiError(400, f"the chat template ({self.chat.name}) refused the messages: {exc}",
                           param="messages") from None
        ids = await self._tokenize(text, max_tokens or 1, chat=True)
        if max_tokens is None:
            max_tokens = self.n_ctx_slot - len(ids)
        return await self._serve(request, ids, max_tokens, sampler, stop, stream, True, include_usage)

    async def _serve(self, request, ids, max_tokens, sampler, stop, stream, chat: bool,
                     include_usage: bool = False) -> web.StreamResponse:
        if self.scheduler.closing:
            raise ApiError(503, "the server is shutting down", "server_error", retry_after=5)
        if not self.scheduler.alive:
            raise ApiError(503, "the decode loop is not running", "server_error", retry_after=10)
        if self.coord.failed_endpoints():
            f = self.coord.failed_endpoints()[0]
            raise ApiError(503, f"worker {f.endpoint} unavailable: {f.cause}", "server_error",
                           retry_after=self._retry_after())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        try:
            slot = await self.scheduler.submit(ids, max_tokens, sampler, stop)
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down", "server_error", retry_after=5) from None
        except QueueFull as exc:
            raise ApiError(429, f"server busy: all {self.scheduler.n_slots} slots are in use and {exc.waiting} "
                                f"requests already wait for one (--max-queue {self.scheduler.max_queue}); "
                                f"retry later", "server_busy", code="rate_limit_exceeded",
                           retry_after=QUEUE_FULL_RETRY_SECONDS) from None
        try:
            if stream:
                return await self._stream(request, slot, rid, created, chat, len(ids), include_usage)
            return await self._collect(slot, rid, created, chat, len(ids))
        finally:
            self.scheduler.cancel(slot)
            self._observe_latency(request, slot)

    def _observe_latency(self, request, slot) -> None:
        if slot.first_token_at is None:
            return
        self.metrics.ttft.observe(slot.first_token_at - request["started"])
        if slot.finished_at is not None and slot.generated > 1:
            self.metrics.tpot.observe((slot.finished_at - slot.first_token_at) / (slot.generated - 1))

    def _choice(self, text: str, finish, chat: bool, stream: bool) -> dict:
        if chat:
            key = "delta" if stream else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    @staticmethod
    def _error_status(ev) -> int:
        return {DecodeResult.ENDPOINT_FAILED: 503, DecodeResult.ABORTED: 503, DecodeResult.NO_KV_SLOT: 400,
                DecodeResult.INVALID_BATCH: 400}.get(ev.code, 500)

    async def _collect(self, slot, rid, created, chat, n_prompt) -> web.Response:
        parts, finish = [], None
        while True:
            ev = await slot.events.get()
            if ev.kind == "text":
                parts.append(ev.text)
            elif ev.kind == "done":
                finish = ev.finish_reason
                break
            else:
                status = self._error_status(ev)
                raise ApiError(status, ev.message, "server_error", code=ev.code.name if ev.code is not None else None,
                               retry_after=self._retry_after() if status == 503 else None)
        text = "".join(parts)
        n_out = slot.generated
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": self.model_name, "choices": [self._choice(text, finish, chat, False)],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}})

    async def _stream(self, request, slot, rid, created, chat, n_prompt,
                      include_usage: bool = False) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload) -> None:
            if include_usage and "choices" in payload and "usage" not in payload:
                payload["usage"] = None  # as OpenAI: null on every chunk but the last
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        try:
            while True:
                ev = await slot.events.get()
                if ev.kind == "text":
                    await send({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                "choices": [self._choice(ev.text, None, chat, True)]})
                elif ev.kind == "done":
                    await send({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                "choices": [self._choice("", ev.finish_reason, chat, True)]})
                    if include_usage:
                        n_out = slot.generated
                        await send({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                    "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                                             "total_tokens": n_prompt + n_out}})
                    break
                else:
                    await send({"error": {"message": ev.message, "type": "server_error",
                                          "code": ev.code.name if ev.code is not None else None,
                                          "endpoint": ev.endpoint}})
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client disconnected mid-stream; slot freed", seq=slot.seq)
            raise
        return resp


async def serve_http(coord, socks, n_slots: int, n_ctx_slot: int, model_name: str,
                     ready: asyncio.Event | None = None, announce=None, **options) -> None:
    """Serve on `socks` (bound, listening sockets: cli.listen_sockets) until
    SIGTERM/SIGINT. `announce()` is called once requests are answered;
    `options`: CompletionServer's api_key, cors_origin, max_queue, chat_template, metrics_endpoint."""
    server = CompletionServer(coord, model_name, n_slots, n_ctx_slot, **options)
    # handler_cancellation: a client that goes away cancels its handler, which frees its slot
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    for sock in socks:
        await web.SockSite(runner, sock).start()
    log.info("serving", addresses=[sock.getsockname()[:2] for sock in socks], slots=n_slots,
             ctx_per_slot=n_ctx_slot, model=model_name)

    async def shutdown() -> None:
        # requests in flight end with an error event (and [DONE]) or a 503, not a cut connection
        await server.scheduler.drain("the server is shutting down")
        await runner.cleanup()

    # the watchdog is petted only while the decode loop runs and is not stuck
    await serve_until_signalled(shutdown, log, ready, healthy=server.decode_loop_healthy, announce=announce)
