"""A soak: `ggml-coordinator serve` under steady load and random worker faults.

    python bench/soak.py [--minutes 60] [--clients 6] [--seed 0] [--fault-every 30:90]
                         [--kinds kill9_restart,...] [--sample-every 30] [--json PATH] [--keep-logs DIR]

Issue #29, "A soak". Everything runs on 127.0.0.1 and is started (and
stopped, whatever happens: try/finally, atexit, PR_SET_PDEATHSIG) by this
script:

* three `ggml-rpc-server` daemons (`python -m rpc_daemon -t 1 --cache DIR`,
  one shared tensor cache), each behind a small TCP proxy of this file
  (`ResetProxy`) whose connections can be reset (RST, both ways). While its
  daemon is down (killed, or between a SIGTERM's exit and the restart) a
  proxy stops listening, so a reconnect sees "connection refused" as it
  would without the proxy. Two daemons hold the stages, the third is the
  spare (`--spares`).
* `python -m coordinator serve --endpoints P0,P1 --spares P2 --parallel 4
  --api-key K` (the bundled Gemma 3 270M, `--resume-within` 30 s: serve's
  default).
* `--clients` (default 6) client tasks (aiohttp), each sending requests back
  to back: completions and chat completions over a few fixed prompts of about
  5 to 400 tokens, temperature 0, max_tokens 16-64, half of them streamed;
  every request has a client-side timeout of 120 s (`--timeout`).
* a fault every `--fault-every` seconds (uniform, default 30-90; seeded RNG),
  the kinds (`--kinds`, default all) taken in shuffled rounds so that every
  kind comes up, on a worker holding a stage:
    kill9_restart   kill -9 (process group), restarted on its port 0-5 s later
    kill9_spare     kill -9, not restarted for 10-20 s: the spare takes the
                    stage, the worker goes home when it is back
    sigstop         SIGSTOP (process group) for 0.5-10 s, then SIGCONT
    reset           every proxied connection to the worker reset (RST both
                    ways; the daemon itself untouched)
    restart         SIGTERM, wait for the exit, start again on its port

Reference texts: before any fault, each (endpoint, prompt, max_tokens) spec
is asked once, not streamed; greedy, so every later completed response,
streamed or not, must equal it.

Checks, printed at the end (and written as JSON with --json):

* texts: every completed response equals its reference. Logits depend on
  the shape of the batch a sequence is decoded in (docs/architecture.md,
  "Logits depend on how a prompt is batched"; docs/operations.md on the
  prompt cache), so with --parallel > 1 some greedy texts differ from the
  solo reference without any fault. Every request sends cache_prompt false
  (unless --cache-prompt) and differing texts are classified: in requests
  that overlapped no fault (batch-shape variants), overlapping a fault but a
  variant also seen without one, and seen only with a fault (suspect: the
  check fails on these). `--parallel 1` decodes every request alone, in the
  reference's shapes: then every difference is suspect (the strict check);
* nothing lost: every request is `completed` (HTTP 200 and, streamed, a
  finish_reason and [DONE]), `errored` (an HTTP error with its status, code
  and message, or an SSE error event), or a client `timeout`; anything else
  (a connection cut, a stream ending without [DONE] or without an error
  event) is `lost` and must be 0;
* resources: RSS and open fds of the serve process and of each daemon (its
  process tree: the daemon and its compute children; each process's own RSS,
  anonymous/file/shared, is in the JSON's samples) sampled every
  `--sample-every` s; the last sample at most 10 % above the median of the first
  5 minutes' (the first third for runs shorter than 15 minutes). A daemon
  restarted meanwhile is judged by its last process's own drift. The spare,
  once it has held a stage, is judged "settled": its last sample (idle: the
  run waits for that) against the median of its idle samples in the same
  window after its first stage moved back. Serving a stage raises a daemon's
  own heap once, to its requests' high-water mark (the spare's tree 78 to 82
  MB in its first takeovers, then flat: docs/operations.md, the soak), so its
  fresh first minutes are no baseline for it; growth with every takeover
  would still show. The plain ratio is printed beside it;
* time to first token (streamed requests sent while healthy: no fault in the
  last 10 s nor until the first token, and the last /health poll 200 `ok`):
  p99 of the first 10 minutes against the last 10 (thirds for runs shorter
  than 30 minutes), drift at most --ttft-drift (1.5x);
* per fault kind: how many, and what became of the requests in flight at the
  fault (completed equal / differing, errored, timeout, lost);
* /health against the answers: requests that got 503 while the last /health
  poll (at most 1 s before) said 200 (docs/operations.md: "no request is
  refused for the outage while /health says 200"), reported, not a failure
  of the soak by itself.

Exit status 0 when texts, lost, resources and ttft pass. Every loop is
bounded in count and time; the run ends at --minutes plus at most the
in-flight requests' timeout plus shutdown.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import pathlib
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import aiohttp

ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("kill9_restart", "kill9_spare", "sigstop", "reset", "restart")
HEALTHY_QUIET = 10.0  # seconds after a fault before TTFTs count as "healthy"
OVERLAP_MARGIN = 3.0  # seconds after a fault's end (restart, SIGCONT) a request still counts as overlapping it

_BASE = ("The quick brown fox jumps over the lazy dog while the river runs past the old mill and the "
         "children count the boats that drift toward the harbour in the evening light. ")
# about 5, 40, 120, 250 and 400 tokens (Gemma's tokenizer: ~1.3 tokens a word here)
PROMPTS = [
    "Name three colours.",
    "Write a short note about the weather. " + _BASE,
    "Summarize the following text in one sentence. " + _BASE * 3,
    "Continue the story. " + _BASE * 7,
    "What happens next in this long story? " + _BASE * 11,
]


# ------------------------------------------------------------------ processes

_PROCS: list[subprocess.Popen] = []  # every process started here, stopped at exit whatever happens


def _die_with_parent() -> None:
    """In the child: SIGKILL when this script dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def _stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    if proc.poll() is None:
        _signal_group(proc, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)  # the compute child too
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _cleanup() -> None:
    for p in list(_PROCS):
        _stop(p)
    _PROCS.clear()


atexit.register(_cleanup)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[int]:
    """pid and its descendants (bounded)."""
    out, todo = [], [pid]
    while todo and len(out) < 64:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return out


def proc_usage(pid: int) -> dict | None:
    """RSS (KiB) and open fds of pid's process tree, and each process's own
    (`each`: pid, rss and its anon/file/shmem parts in KiB, fds: the daemon
    apart from its compute processes); None if it is gone."""
    rss = fds = 0
    each = []
    try:
        for p in _tree(pid):
            one = {"pid": p}
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    key = _STATUS_KEYS.get(line.split(":", 1)[0])
                    if key:
                        one[key] = int(line.split()[1])
            one["fds"] = len(os.listdir(f"/proc/{p}/fd"))
            rss += one.get("rss", 0)
            fds += one["fds"]
            each.append(one)
    except OSError:
        return None
    return {"pid": pid, "procs": len(each), "rss_kib": rss, "fds": fds, "each": each}


_STATUS_KEYS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


class Daemon:
    """One ggml-rpc-server on a fixed loopback port, restartable there."""

    def __init__(self, name: str, port: int, cache: str, logdir: pathlib.Path):
        self.name, self.port, self.cache, self.logdir = name, port, cache, logdir
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.lock = threading.Lock()

    def start(self, timeout: float = 60.0) -> None:
        self.starts += 1
        log = self.logdir / f"{self.name}.{self.starts}.log"
        cmd = [sys.executable, "-m", "rpc_daemon", "-H", "127.0.0.1", "-p", str(self.port), "-t", "1",
               "--cache", self.cache, "--log-format", "json", "--log-level", "info"]
        deadline = time.monotonic() + timeout
        while True:  # the port may be in TIME_WAIT a moment after a kill: bounded retries
            with open(log, "w") as f:
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                             cwd=ROOT, start_new_session=True, preexec_fn=_die_with_parent)
            _PROCS.append(self.proc)
            while time.monotonic() < deadline and self.proc.poll() is None:
                if '"listening"' in log.read_text(errors="replace"):
                    return
                time.sleep(0.05)
            _stop(self.proc)
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{self.name} did not listen on {self.port}: {log.read_text()[-2000:]}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        _signal_group(self.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def sigterm_and_wait(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        _signal_group(self.proc, signal.SIGKILL)  # a compute child left behind


# ------------------------------------------------------------------ proxy

class ResetProxy:
    """127.0.0.1:port -> the daemon's port, on an event loop thread of its own.
    `reset()` aborts every connection with RST both ways; `listen(False)` stops
    accepting (connection refused, as with the daemon down)."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"proxy-{self.port}", daemon=True)
        self.server = None
        self.conns: set[tuple] = set()
        self.resets = 0
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def listen(self, on: bool) -> None:
        self._call(self._listen(on))

    async def _listen(self, on: bool) -> None:
        if on and self.server is None:
            for _ in range(100):  # bounded: the port may linger a moment
                try:
                    self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port,
                                                             reuse_address=True)
                    return
                except OSError:
                    await asyncio.sleep(0.05)
            raise RuntimeError(f"proxy could not listen on {self.port} again")
        if not on and self.server is not None:
            self.server.close()
            self.server = None

    def reset(self) -> int:
        return self._call(self._reset())

    async def _reset(self) -> int:
        n = 0
        for pair in list(self.conns):
            for w in pair:
                _abort(w)
            n += 1
        self.resets += n
        return n

    async def _serve(self, c_reader, c_writer) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            _abort(c_writer)
            return
        pair = (c_writer, u_writer)
        self.conns.add(pair)

        async def pump(reader, writer, other):
            try:
                while data := await reader.read(256 << 10):
                    writer.write(data)
                    await writer.drain()
                writer.close()  # EOF: pass it on
            except (OSError, asyncio.IncompleteReadError):
                _abort(writer)  # a reset: pass it on as one
                _abort(other)

        try:
            await asyncio.gather(pump(c_reader, u_writer, c_writer), pump(u_reader, c_writer, u_writer))
        finally:
            self.conns.discard(pair)
            for w in pair:
                with contextlib.suppress(Exception):
                    w.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _close(self) -> None:
        await self._listen(False)
        await self._reset()


def _abort(writer) -> None:
    """Close with RST (SO_LINGER 0)."""
    with contextlib.suppress(Exception):
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()


# ------------------------------------------------------------------ the run

class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.t0 = 0.0
        self.end_at = 0.0
        self.key = secrets.token_hex(16)
        self.tmp = tempfile.mkdtemp(prefix="soak-")
        self.logdir = pathlib.Path(args.keep_logs or self.tmp)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.daemons: list[Daemon] = []
        self.proxies: list[ResetProxy] = []
        self.serve: subprocess.Popen | None = None
        self.url = ""
        self.specs: list[dict] = []
        self.reference: dict[int, str] = {}
        self.requests: list[dict] = []  # every request: spec, sent, outcome, ...
        self.inflight: dict[int, dict] = {}
        self.faults: list[dict] = []
        self.last_fault_at = -1e9
        self.health: list[tuple[float, int, str]] = []  # (t, status, body status)
        self.samples: list[dict] = []
        self.notes: list[str] = []
        self.stopping = False
        self.holding: list[str] = []  # the daemons holding a stage, as the last /health poll said

    # -- setup

    def start(self) -> None:
        cache = str(pathlib.Path(self.tmp) / "cache")
        for name in ("worker0", "worker1", "spare"):
            d = Daemon(name, free_port(), cache, self.logdir)
            d.start()
            self.daemons.append(d)
            p = ResetProxy(d.port)
            p.listen(True)
            self.proxies.append(p)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "coordinator", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--endpoints", f"{self.proxies[0].endpoint},{self.proxies[1].endpoint}",
               "--spares", self.proxies[2].endpoint, "--parallel", str(self.args.parallel),
               "--ctx-per-slot", "1024", "--resume-within", str(self.args.resume_within),
               "--api-key", self.key, "--log-level", "info", "--log-format", "json"]
        self.serve_log = self.logdir / "serve.log"
        with open(self.serve_log, "w") as f:
            self.serve = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                          cwd=ROOT, start_new_session=True, preexec_fn=_die_with_parent)
        _PROCS.append(self.serve)

    def stop(self) -> None:
        if self.serve is not None:
            _stop(self.serve, 30)
        for d in self.daemons:
            if d.proc is not None:
                _stop(d.proc)
        for p in self.proxies:
            p.close()
        _cleanup()
        if not self.args.keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)

    async def wait_healthy(self, session, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        body = None
        while time.monotonic() < deadline:
            if self.serve.poll() is not None:
                raise RuntimeError("serve exited: " + self.serve_log.read_text()[-3000:])
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    body = await r.json(content_type=None)
                    if r.status == 200 and body.get("status") == "ok":
                        return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"serve not healthy within {timeout:g} s: {body}")

    def make_specs(self) -> None:
        rng = random.Random(self.args.seed + 1)
        for kind in ("completion", "chat"):
            for i, prompt in enumerate(PROMPTS):
                self.specs.append({"id": len(self.specs), "kind": kind, "prompt": i,
                                   "max_tokens": rng.choice((16, 32, 48, 64))})

    def _body(self, spec: dict, stream: bool) -> tuple[str, dict]:
        prompt = PROMPTS[spec["prompt"]]
        body = {"max_tokens": spec["max_tokens"], "temperature": 0, "stream": stream}
        if not self.args.cache_prompt:
            body["cache_prompt"] = False  # docs/operations.md: a reused prefix changes the step's shape (and text)
        if spec["kind"] == "chat":
            return "/v1/chat/completions", dict(body, messages=[{"role": "user", "content": prompt}])
        return "/v1/completions", dict(body, prompt=prompt)

    # -- one request

    async def request(self, session, spec: dict, stream: bool) -> dict:
        path, body = self._body(spec, stream)
        chat = spec["kind"] == "chat"
        rec = {"n": len(self.requests), "spec": spec["id"], "stream": stream, "sent": self.now(),
               "outcome": None, "text": None, "status": None, "error": None, "ttft": None,
               "healthy_at_send": self.healthy_now()}
        self.requests.append(rec)
        self.inflight[rec["n"]] = rec
        t = time.monotonic()
        try:
            async with asyncio.timeout(self.args.timeout):
                async with session.post(self.url + path, json=body,
                                        headers={"Authorization": f"Bearer {self.key}"}) as r:
                    rec["status"] = r.status
                    if r.status != 200:
                        text = await r.text()
                        rec["outcome"], rec["error"] = "errored", _error_of(text)
                    elif not stream:
                        data = await r.json(content_type=None)
                        c = (data.get("choices") or [{}])[0]
                        if "error" in data:
                            rec["outcome"], rec["error"] = "errored", _error_of(json.dumps(data))
                        elif c.get("finish_reason") is None:
                            rec["outcome"], rec["error"] = "lost", "200 without a finish_reason"
                        else:
                            rec["text"] = c["message"].get("content") or "" if chat else c.get("text", "")
                            rec["outcome"] = "completed"
                    else:
                        await self._read_stream(r, rec, chat, t)
        except TimeoutError:
            rec["outcome"] = "timeout"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            rec["outcome"], rec["error"] = "lost", f"{type(exc).__name__}: {exc}"
        finally:
            rec["done"] = self.now()
            self.inflight.pop(rec["n"], None)
            if rec["outcome"] is None:  # cancelled at the end of the run
                rec["outcome"] = "cancelled"
        if rec["outcome"] == "completed":
            rec["equal"] = rec["text"] == self.reference.get(spec["id"])
        return rec

    async def _read_stream(self, r, rec: dict, chat: bool, t: float) -> None:
        parts, finish, done, error = [], None, False, None
        buf = b""
        async for line in r.content:
            buf += line
            if not buf.endswith(b"\n"):
                continue
            line, buf = buf.strip(), b""
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            ev = json.loads(payload)
            if "error" in ev:
                error = ev["error"]
                continue
            c = (ev.get("choices") or [{}])[0]
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            if piece:
                if rec["ttft"] is None:
                    rec["ttft"] = time.monotonic() - t
                parts.append(piece)
            if c.get("finish_reason"):
                finish = c["finish_reason"]
        if error is not None:
            rec["outcome"] = "errored"
            rec["error"] = {"code": error.get("code"), "type": error.get("type"),
                            "message": str(error.get("message"))[:300]}
            rec["partial"] = "".join(parts)
        elif done and finish:
            rec["outcome"], rec["text"] = "completed", "".join(parts)
        else:
            rec["outcome"] = "lost"
            rec["error"] = f"stream ended without {'[DONE]' if not done else 'a finish_reason'} nor an error event"
            rec["partial"] = "".join(parts)

    # -- loops

    def now(self) -> float:
        return time.monotonic() - self.t0

    def healthy_now(self) -> bool:
        if self.now() - self.last_fault_at < HEALTHY_QUIET or not self.health:
            return False
        t, status, st = self.health[-1]
        return status == 200 and st == "ok" and self.now() - t < 2.5

    async def client(self, session, idx: int) -> None:
        rng = random.Random(self.args.seed * 1000 + idx)
        for _ in range(1_000_000):  # bounded; ends at end_at
            if self.now() >= self.end_at:
                return
            if self.serve.poll() is not None:
                self.notes.append(f"serve exited with {self.serve.returncode} at {self.now():.1f} s")
                self.end_at = self.now()
                return
            await self.request(session, rng.choice(self.specs), stream=rng.random() < 0.5)

    async def health_loop(self, session) -> None:
        for _ in range(10_000_000):
            if self.stopping:
                return
            status, st = 0, "unreachable"
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    body = await r.json(content_type=None)
                    status, st = r.status, body.get("status", "?")
                    eps = [e.get("endpoint") for e in body.get("endpoints", [])]
                    self.holding = [d.name for d, p in zip(self.daemons, self.proxies) if p.endpoint in eps]
            if not self.health or self.health[-1][1:] != (status, st):
                self.transitions.append((round(self.now(), 2), status, st))
            self.health.append((self.now(), status, st))
            await asyncio.sleep(1.0)

    async def sample_loop(self) -> None:
        for _ in range(10_000_000):
            self.sample()
            for _ in range(int(self.args.sample_every * 10)):
                if self.stopping:
                    return
                await asyncio.sleep(0.1)

    def sample(self) -> None:
        s = {"t": round(self.now(), 1), "serve": proc_usage(self.serve.pid), "holding": list(self.holding)}
        for d in self.daemons:
            s[d.name] = proc_usage(d.proc.pid) if d.alive() else None
            # a daemon SIGSTOPped is sampled too: its memory is what it is
        self.samples.append(s)

    def idle(self, name: str, usage: dict | None, holding) -> bool:
        """Whether daemon `name` holds no stage and serves no client: /health names
        it nowhere and its process tree is the daemon and its spare compute process
        (a client's own compute process is gone once its connection is: the stage
        moved away, its memory freed)."""
        return usage is not None and name not in holding and usage["procs"] <= 2

    async def spare_idle(self, timeout: float) -> None:
        """Until the spare is idle (a stage that moved home closes the spare's
        connection after the replay, a moment after /health says ok), bounded."""
        spare = self.daemons[2]
        for _ in range(int(timeout * 2)):
            if not spare.alive() or self.idle(spare.name, proc_usage(spare.proc.pid), self.holding):
                return
            await asyncio.sleep(0.5)
        self.notes.append(f"the spare was not idle within {timeout:g} s of the end")

    async def holders(self, session) -> list[int]:
        with contextlib.suppress(Exception):
            async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                body = await r.json(content_type=None)
                eps = [e.get("endpoint") for e in body.get("endpoints", [])]
                return [i for i, p in enumerate(self.proxies) if p.endpoint in eps]
        return [0, 1]

    async def fault_loop(self, session) -> None:
        lo, hi = self.args.fault_every
        deck: list[str] = []
        loop = asyncio.get_running_loop()
        for _ in range(100_000):
            wait = self.rng.uniform(lo, hi)
            if self.now() + wait >= self.end_at - 5:
                return
            await asyncio.sleep(wait)
            await loop.run_in_executor(None, self.restore)  # the previous fault over: every daemon up
            if not deck:
                deck = list(self.args.kinds)
                self.rng.shuffle(deck)
            kind = deck.pop()
            victim = self.rng.choice((await self.holders(session)) or [0, 1])
            f = {"kind": kind, "victim": self.daemons[victim].name, "t": round(self.now(), 2),
                 "inflight": sorted(self.inflight)}
            self.last_fault_at = self.now()
            self.faults.append(f)
            await loop.run_in_executor(None, self.inject, f, victim)
            self.last_fault_at = self.now()  # healthy again counts from the fault's end (a restart, SIGCONT)
            f["end"] = round(self.now() + (f.get("down_s", 0) if kind == "kill9_spare" else 0), 2)

    def inject(self, f: dict, i: int) -> None:
        d, p, kind = self.daemons[i], self.proxies[i], f["kind"]
        with d.lock:
            if kind in ("kill9_restart", "kill9_spare"):
                d.kill9()
                p.listen(False)  # the port refuses, as the dead daemon's would
                delay = self.rng.uniform(0, 5) if kind == "kill9_restart" else self.rng.uniform(10, 20)
                f["down_s"] = round(delay, 2)
                if kind == "kill9_restart":
                    time.sleep(delay)
                    d.start()
                    p.listen(True)
                else:
                    d.restart_at = time.monotonic() + delay  # restore() starts it
            elif kind == "sigstop":
                f["stopped_s"] = round(self.rng.uniform(0.5, 10), 2)
                _signal_group(d.proc, signal.SIGSTOP)
                time.sleep(f["stopped_s"])
                _signal_group(d.proc, signal.SIGCONT)
            elif kind == "reset":
                f["connections_reset"] = p.reset()
            elif kind == "restart":
                d.sigterm_and_wait()
                p.listen(False)
                d.start()
                p.listen(True)

    def restore(self, force: bool = False) -> None:
        """Every daemon running and its proxy listening (a kill9_spare's restart once due)."""
        for d, p in zip(self.daemons, self.proxies):
            with d.lock:
                if d.proc is not None and d.proc.poll() is None:
                    _signal_group(d.proc, signal.SIGCONT)
                    continue
                due = getattr(d, "restart_at", 0)
                if not force and time.monotonic() < due:
                    time.sleep(max(0.0, min(due - time.monotonic(), 30)))
                d.start()
                p.listen(True)
                d.restart_at = 0
                self.last_fault_at = self.now()  # a stage moving home pauses too (replay)

    async def restore_loop(self) -> None:
        """Restarts a kill9_spare's worker when due, without waiting for the next fault."""
        loop = asyncio.get_running_loop()
        for _ in range(10_000_000):
            if self.stopping:
                return
            due = [d for d in self.daemons if getattr(d, "restart_at", 0) and time.monotonic() >= d.restart_at]
            if due:
                await loop.run_in_executor(None, self.restore)
            await asyncio.sleep(0.5)

    # -- main

    async def run(self) -> dict:
        self.transitions: list = []
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as session:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.start)
            self.t0 = time.monotonic()
            await self.wait_healthy(session, 300)
            print(f"serve healthy after {self.now():.1f} s; fetching references", flush=True)
            self.make_specs()
            for spec in self.specs:  # before any fault, one at a time
                rec = await self.request(session, spec, stream=False)
                if rec["outcome"] != "completed":
                    raise RuntimeError(f"reference request failed: {rec}")
                self.reference[spec["id"]] = rec["text"]
            self.requests.clear()
            ref_s = self.now()
            print(f"{len(self.specs)} references in {ref_s:.1f} s; soaking {self.args.minutes:g} min", flush=True)
            self.t0 = time.monotonic()
            self.end_at = self.args.minutes * 60
            helpers = [asyncio.create_task(self.health_loop(session)), asyncio.create_task(self.sample_loop()),
                       asyncio.create_task(self.restore_loop())]
            faults = asyncio.create_task(self.fault_loop(session))
            clients = [asyncio.create_task(self.client(session, i)) for i in range(self.args.clients)]
            progress = asyncio.create_task(self.progress())
            try:
                # clients end by themselves at end_at; each request ends within its timeout
                done, pending = await asyncio.wait(clients, timeout=self.end_at + self.args.timeout + 30)
                for t in pending:
                    t.cancel()
                await asyncio.gather(*clients, return_exceptions=True)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(faults, timeout=60)
            finally:
                faults.cancel()
                progress.cancel()
                await asyncio.gather(faults, progress, return_exceptions=True)
            await loop.run_in_executor(None, self.restore, True)
            with contextlib.suppress(Exception):
                await self.wait_healthy(session, 60)
            await self.spare_idle(60)
            self.sample()  # the last values, everything back and idle
            self.stopping = True
            await asyncio.gather(*helpers, return_exceptions=True)
            for t in helpers:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    self.notes.append(f"helper failed: {t.exception()!r}")
        return self.report(ref_s)

    async def progress(self) -> None:
        for _ in range(1_000_000):
            await asyncio.sleep(60)
            c = _count(self.requests)
            print(f"  {self.now() / 60:5.1f} min: {c} faults={len(self.faults)}", flush=True)

    # -- report

    def report(self, ref_s: float) -> dict:
        a, dur = self.args, self.args.minutes * 60
        reqs = [r for r in self.requests if r["outcome"] != "cancelled"]
        counts = _count(reqs)
        mismatches = [r for r in reqs if r["outcome"] == "completed" and not r["equal"]]
        errored = {}
        for r in reqs:
            if r["outcome"] == "errored":
                e = r["error"] if isinstance(r["error"], dict) else {"message": str(r["error"])}
                k = f"{r['status']} {e.get('code')}: {str(e.get('message'))[:120]}"
                errored[k] = errored.get(k, 0) + 1
        # resources: the last sample against the median of the first window's, per role; a daemon
        # restarted since (another pid) is not comparable that way, and is judged by its last
        # process's own drift instead (its last sample against the median of its first window)
        #
        # The spare is judged after the same event instead: its first samples are of a daemon that
        # has never served a stage, its last of one that has (a stage moved to it and back: its
        # connection, buffers and compute process gone). Serving a stage raises the daemon's own
        # heap once, to the high-water mark of its requests (Python's allocator keeps an arena
        # while any object lives in it), and it stays at that mark however many takeovers follow
        # (docs/operations.md, the soak). So once it has held a stage, the spare's last sample is
        # compared with the median of its idle samples (no stage, no client) in the window after
        # its first stage moved back ("settled"): growth with every takeover would show there.
        # The plain comparison is reported beside it.
        window = 300.0 if dur >= 900 else dur / 3
        resources = {}
        for role in ("serve", "worker0", "worker1", "spare"):
            got = [(s["t"], s[role], s.get("holding", [])) for s in self.samples if s.get(role)]
            if not got:
                continue
            last_pid = got[-1][1]["pid"]
            mine = [(t, u, h) for t, u, h in got if u["pid"] == last_pid]
            restarted = any(u["pid"] != last_pid for t, u, h in got if t <= window)
            released = None  # the last process's first idle sample after it held a stage
            if role == "spare":
                held = [i for i, (t, u, h) in enumerate(mine) if role in h]
                released = next((i for i in range(held[0] + 1, len(mine)) if self.idle(role, mine[i][1], mine[i][2])),
                                None) if held else None
            for metric in ("rss_kib", "fds"):
                first = [u[metric] for t, u, h in got if t <= window]
                last = got[-1][1][metric]
                med = statistics.median(first) if first else None
                ratio = (last / med) if med else None
                own_first = [u[metric] for t, u, h in mine if t <= mine[0][0] + window]
                own_med = statistics.median(own_first)
                own_ratio = last / own_med if own_med else None
                judged = own_ratio if restarted else ratio
                entry = resources[f"{role}.{metric}"] = {
                    "first_median": med, "last": last, "ratio": round(ratio, 3) if ratio else None,
                    "restarted": restarted, "starts": len({u["pid"] for t, u, h in got}),
                    "last_process_first_median": own_med, "last_process_samples": len(mine),
                    "last_process_ratio": round(own_ratio, 3) if own_ratio else None}
                if released is not None:
                    t_rel = mine[released][0]
                    settled = [u[metric] for t, u, h in mine[released:]
                               if t <= t_rel + window and self.idle(role, u, h)]
                    s_med = statistics.median(settled)
                    judged = last / s_med if s_med else None
                    entry["settled"] = {"since_t": t_rel, "samples": len(settled), "first_median": s_med,
                                        "ratio": round(judged, 3) if judged else None,
                                        "takeovers": sum(1 for a, b in zip(mine, mine[1:])
                                                         if role in b[2] and role not in a[2])}
                # growth is what a leak looks like; a shrink (a compute process gone with its
                # client, a heap trimmed after faults: 594 to 405 MB in a tensor-mode soak) is not
                entry["ok"] = judged is not None and judged <= 1.10
        # TTFT while healthy
        span = 600.0 if dur >= 1800 else dur / 3
        fault_ts = [f["t"] for f in self.faults]

        def healthy(r):
            if not (r["stream"] and r["ttft"] is not None and r["healthy_at_send"]):
                return False
            return not any(r["sent"] - HEALTHY_QUIET <= t <= r["sent"] + r["ttft"] for t in fault_ts)
        hs = [r for r in reqs if healthy(r)]
        early = [r["ttft"] for r in hs if r["sent"] <= span]
        late = [r["ttft"] for r in hs if r["sent"] >= dur - span]
        p_early, p_late = _p99(early), _p99(late)
        ttft = {"window_s": span, "first_n": len(early), "first_p99_s": p_early, "first_p50_s": _p50(early),
                "last_n": len(late), "last_p99_s": p_late, "last_p50_s": _p50(late), "bound": a.ttft_drift,
                "ratio": round(p_late / p_early, 3) if p_early and p_late else None}
        ttft["ok"] = ttft["ratio"] is not None and ttft["ratio"] <= a.ttft_drift
        # per fault kind
        by_n = {r["n"]: r for r in self.requests}
        kinds = {}
        for f in self.faults:
            k = kinds.setdefault(f["kind"], {"count": 0, "inflight": 0, "completed_equal": 0,
                                             "completed_differ": 0, "errored": 0, "timeout": 0, "lost": 0})
            k["count"] += 1
            for n in f["inflight"]:
                r = by_n.get(n)
                if r is None or r["outcome"] == "cancelled":
                    continue
                k["inflight"] += 1
                o = r["outcome"]
                k["completed_equal" if o == "completed" and r["equal"] else
                  "completed_differ" if o == "completed" else o] += 1
        # 503 while /health said 200
        refused_healthy = []
        for r in reqs:
            if r["outcome"] == "errored" and r["status"] == 503:
                before = [h for h in self.health if h[0] <= r["done"]]
                if before and before[-1][1] == 200 and r["done"] - before[-1][0] <= 1.5:
                    refused_healthy.append({"n": r["n"], "sent": round(r["sent"], 2), "done": round(r["done"], 2),
                                            "health": before[-1][2], "error": r["error"]})
        # texts that differ: logits depend on the batch's shape (docs/architecture.md), so under
        # concurrent load (--parallel > 1) greedy text may differ from the reference without any
        # fault. A differing text also seen in a request that overlapped no fault is such a variant;
        # one seen only in requests that overlapped a fault (in flight between the fault and its end,
        # plus OVERLAP_MARGIN for the replay or the move home) is suspect: the check. With
        # --parallel 1 every request is decoded alone, in the reference's shapes: every difference
        # is suspect.
        def overlaps(r):
            return [f["t"] for f in self.faults
                    if r["sent"] <= f.get("end", f["t"]) + OVERLAP_MARGIN and r["done"] >= f["t"]]
        variants: dict[int, set] = {}
        for r in mismatches:
            r["faults_overlapping"] = overlaps(r)
            if not r["faults_overlapping"]:
                variants.setdefault(r["spec"], set()).add(r["text"])
        suspect = [r for r in mismatches if a.parallel == 1
                   or (r["faults_overlapping"] and r["text"] not in variants.get(r["spec"], ()))]
        texts = {"equal": counts.get("completed", 0) - len(mismatches), "differ": len(mismatches),
                 "differ_fault_free": sum(1 for r in mismatches if not r["faults_overlapping"]),
                 "differ_variant_seen_fault_free": sum(1 for r in mismatches if r["faults_overlapping"]
                                                       and r not in suspect),
                 "differ_only_with_faults": len(suspect),
                 "specs_with_variants": {k: len(v) for k, v in variants.items()}}
        checks = {"texts": not suspect, "lost": counts.get("lost", 0) == 0,
                  "resources": all(v["ok"] for v in resources.values()), "ttft": ttft["ok"]}
        return {"args": {k: v for k, v in vars(a).items()}, "references_s": round(ref_s, 1),
                "requests": counts, "errors": errored,
                "texts": texts,
                "mismatches": [{"n": r["n"], "spec": r["spec"], "stream": r["stream"], "sent": round(r["sent"], 2),
                                "done": round(r["done"], 2), "faults_overlapping": r["faults_overlapping"],
                                "suspect": r in suspect, "text": r["text"], "want": self.reference[r["spec"]]}
                               for r in sorted(mismatches, key=lambda r: r not in suspect)[:40]],
                "lost": [{k: r[k] for k in ("n", "spec", "stream", "sent", "done", "status", "error")} | {
                    "partial": r.get("partial")} for r in reqs if r["outcome"] == "lost"][:20],
                "timeouts": [{k: r[k] for k in ("n", "spec", "stream", "sent")} for r in reqs
                             if r["outcome"] == "timeout"][:20],
                "faults": self.faults, "fault_kinds": kinds, "resources": resources, "ttft": ttft,
                "refused_while_health_200": refused_healthy, "health_transitions": self.transitions,
                "samples": self.samples, "notes": self.notes, "checks": checks, "ok": all(checks.values()),
                "logs": str(self.logdir) if a.keep_logs else None}


def _error_of(text: str) -> dict:
    try:
        e = json.loads(text).get("error", {})
        return {"code": e.get("code"), "type": e.get("type"), "message": str(e.get("message"))[:300]}
    except (ValueError, AttributeError):
        return {"code": None, "type": None, "message": text[:300]}


def _count(reqs) -> dict:
    c: dict[str, int] = {}
    for r in reqs:
        c[r["outcome"] or "in_flight"] = c.get(r["outcome"] or "in_flight", 0) + 1
    c["completed_differ"] = sum(1 for r in reqs if r["outcome"] == "completed" and not r.get("equal"))
    return c


def _p99(xs):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 3)


def _p50(xs):
    return round(statistics.median(xs), 3) if xs else None


def print_report(rep: dict) -> None:
    ok = lambda b: "ok  " if b else "FAIL"  # noqa: E731
    c = rep["requests"]
    print("\n=== soak report ===")
    print(f"requests: {sum(v for k, v in c.items() if k != 'completed_differ')} "
          f"completed={c.get('completed', 0)} errored={c.get('errored', 0)} timeout={c.get('timeout', 0)} "
          f"lost={c.get('lost', 0)}")
    tx = rep["texts"]
    print(f"[{ok(rep['checks']['texts'])}] texts: {tx['equal']} equal to their reference, {tx['differ']} differ: "
          f"{tx['differ_fault_free']} in requests that overlapped no fault (batch-shape variants), "
          f"{tx['differ_variant_seen_fault_free']} overlapping a fault but a variant also seen without one, "
          f"{tx['differ_only_with_faults']} suspect (seen only with a fault; with --parallel 1: every difference)")
    for m in [m for m in rep["mismatches"] if m["suspect"]][:5]:
        print(f"        suspect: n={m['n']} spec={m['spec']} stream={m['stream']} sent={m['sent']} "
              f"faults={m['faults_overlapping']}\n          got  {m['text']!r}\n          want {m['want']!r}")
    print(f"[{ok(rep['checks']['lost'])}] lost or cut without an error event: {c.get('lost', 0)}")
    for k, v in sorted(rep["errors"].items(), key=lambda kv: -kv[1]):
        print(f"        errored x{v}: {k}")
    for r in rep["lost"][:5]:
        print(f"        lost: {r}")
    print(f"[{ok(rep['checks']['resources'])}] resources (last vs median of the first window; a daemon "
          f"restarted meanwhile: its last process's own drift; the spare, once it has held a stage: "
          f"against its idle samples after that, 'settled'):")
    for k, v in rep["resources"].items():
        own = (f"  restarted ({v['starts']} processes): last process {v['last_process_first_median']} -> "
               f"{v['last']} ratio {v['last_process_ratio']} ({v['last_process_samples']} samples)"
               if v["restarted"] else "")
        st = v.get("settled")
        if st:
            own += (f"  settled (idle after its first stage moved back, t={st['since_t']:g} s; "
                    f"{st['takeovers']} takeovers sampled): {st['first_median']} -> {v['last']} ratio {st['ratio']}")
        print(f"        {k:15s} first {v['first_median']}  last {v['last']}  ratio {v['ratio']}{own}  "
              f"{'ok' if v['ok'] else 'OVER +10 %'}")
    t = rep["ttft"]
    print(f"[{ok(rep['checks']['ttft'])}] ttft p99 while healthy: first {t['window_s']:g} s {t['first_p99_s']} s "
          f"(n={t['first_n']}, p50 {t['first_p50_s']}), last {t['last_p99_s']} s (n={t['last_n']}, "
          f"p50 {t['last_p50_s']}), ratio {t['ratio']} (bound {t['bound']}x)")
    print("faults (in flight at the fault: completed equal / differ / errored / timeout / lost):")
    for kind, k in sorted(rep["fault_kinds"].items()):
        print(f"        {kind:14s} x{k['count']}: in flight {k['inflight']}: {k['completed_equal']} / "
              f"{k['completed_differ']} / {k['errored']} / {k['timeout']} / {k['lost']}")
    for f in rep["faults"]:
        extra = {k: v for k, v in f.items() if k not in ("kind", "victim", "t", "inflight")}
        print(f"        t={f['t']:7.1f} {f['kind']:14s} {f['victim']:8s} in flight {len(f['inflight'])} {extra}")
    print(f"503 while the last /health said 200: {len(rep['refused_while_health_200'])}")
    for r in rep["refused_while_health_200"][:5]:
        print(f"        {r}")
    print("health transitions (t, status, body):", rep["health_transitions"][:40])
    for n in rep["notes"]:
        print("note:", n)
    print("RESULT:", "PASS" if rep["ok"] else "FAIL")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients (4-8)")
    ap.add_argument("--parallel", type=int, default=4, help="serve --parallel")
    ap.add_argument("--resume-within", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-every", default="30:90", help="MIN:MAX seconds between faults (default 30:90)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"fault kinds to draw from, comma-separated (default: all, {','.join(KINDS)})")
    ap.add_argument("--sample-every", type=float, default=30.0, help="seconds between RSS/fd samples")
    ap.add_argument("--timeout", type=float, default=120.0, help="client-side timeout of every request")
    ap.add_argument("--ttft-drift", type=float, default=1.5, help="allowed ratio of the last p99 TTFT to the first")
    ap.add_argument("--cache-prompt", action="store_true",
                    help="leave the server's prompt cache on (default: every request sends cache_prompt false, "
                         "since a reused prefix changes greedy text by itself: docs/operations.md)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    ap.add_argument("--keep-logs", default=None, metavar="DIR", help="keep serve and daemon logs there")
    a = ap.parse_args(argv)
    lo, _, hi = a.fault_every.partition(":")
    a.fault_every = (float(lo), float(hi or lo))
    if not 0 < a.fault_every[0] <= a.fault_every[1]:
        ap.error("--fault-every: MIN:MAX with 0 < MIN <= MAX")
    a.kinds = tuple(k.strip() for k in a.kinds.split(",") if k.strip())
    if not a.kinds or set(a.kinds) - set(KINDS):
        ap.error(f"--kinds: a comma-separated list of {', '.join(KINDS)}")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    soak = Soak(args)

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    old = signal.signal(signal.SIGTERM, on_signal)
    try:
        rep = asyncio.run(soak.run())
    finally:
        soak.stop()
        signal.signal(signal.SIGTERM, old)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rep, indent=1))
    print_report(rep)
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
