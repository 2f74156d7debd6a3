"""`ggml-coordinator serve` processes for tests (Server: on given workers; Serve: on its own
local workers, with `served` as a module fixture's body), and small aiohttp clients for
their HTTP and SSE, and the official openai client (`openai_client`)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import aiohttp

from conftest import SLACK, free_port, stop_process


class Server:
    def __init__(self, endpoints: list[str], parallel: int = 8, args: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "coordinator", "serve", "--endpoints", ",".join(endpoints),
               "--port", str(self.port), "--parallel", str(parallel), "--ctx-per-slot", "256",
               "--log-level", "info", *args]
        self.log = open(f"/tmp/serve-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited: " + open(self.log.name).read())
            try:
                status, _ = asyncio.run(get(self.url + "/health"))
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy: " + open(self.log.name).read())

    def stop(self) -> None:
        stop_process(self.proc, 20)


async def get(url: str) -> tuple[int, dict | str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.get(url) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except json.JSONDecodeError:
                return r.status, text


async def post(url: str, body, timeout: float = 60) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        async with s.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json(content_type=None)


async def stream(url: str, body: dict, timeout: float = 60, stop_after: int | None = None) -> list:
    """SSE events as parsed JSON ('[DONE]' as the string)."""
    events = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(url, json=dict(body, stream=True)) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].decode()
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                if stop_after is not None and len(events) >= stop_after:
                    return events
    return events


async def head_of(method: str, url: str, body=None, headers: dict | None = None) -> tuple:
    """Status and headers of a request."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.request(method, url, json=body, headers=headers) as r:
            await r.read()
            return r.status, r.headers.copy()  # case-insensitive names


def stream_text(events: list, chat: bool = False) -> str:
    out = []
    for ev in events:
        if isinstance(ev, dict) and "choices" in ev:
            c = ev["choices"][0]
            out.append(c["delta"].get("content", "") if chat else c["text"])
    return "".join(out)


def wait_healthy(server, timeout: float = 30.0) -> None:
    """/health answers 200 within `timeout` (times SLACK; e.g. once a worker is back)."""
    deadline = time.monotonic() + timeout * SLACK
    status = health = None
    while time.monotonic() < deadline:
        try:
            status, health = asyncio.run(get(server.url + "/health"))
        except OSError:  # not listening yet
            status = None
        if status == 200:
            return
        time.sleep(0.2)
    assert status == 200, health


class Serve:
    """`ggml-coordinator serve --port 0 ...`: its URL is the one it prints once ready."""

    def __init__(self, tmp_dir, *args: str, env: dict | None = None):
        self.log_path = os.path.join(tmp_dir, "serve.log")
        self.log = open(self.log_path, "w+")
        cmd = [sys.executable, "-m", "coordinator", "serve", "--port", "0", "--local-workers", "2",
               "--log-level", "info", "--log-format", "json", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, **(env or {})))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            m = re.search(r"serving (https?://\S+) \(model (.+?), ", self.text())
            if m:
                self.url, self.model = m.group(1), m.group(2)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not say it serves:\n" + self.text())

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        stop_process(self.proc, 30)


def served(tmp_path_factory, *args: str, env: dict | None = None):
    """A module fixture's body (`yield from served(...)`): a Serve with `args`, stopped after the
    module, which must then have exited cleanly."""
    s = Serve(str(tmp_path_factory.mktemp("serve")), *args, env=env)
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.text()[-2000:]


def openai_client(server, timeout: float = 120.0, api_key: str = "unused", **options):
    """The official openai client on `server`'s /v1, without retries (a test sees the first answer)."""
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, timeout=timeout, max_retries=0, **options)
