"""A `ggml-coordinator serve` process for tests, and small aiohttp clients for its HTTP and SSE."""
from __future__ import annotations

import asyncio
import json
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
