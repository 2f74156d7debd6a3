"""The serving issue's OpenAI and operations details, against one real
`ggml-coordinator serve` (its own two local workers, the bundled Gemma 3 270M)
started with --port 0 and the flags in the `server` fixture."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import version

import aiohttp
import pytest

AUTH: dict = {}  # no API key yet
PROMPT = "The capital of France is"


def coordinator(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True, text=True,
                          timeout=60, **kw)


async def call(method: str, url: str, body=None, headers: dict | None = None, timeout: float = 60):
    """(status, headers, parsed JSON body or text)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        data = None if body is None else (body if isinstance(body, (str, bytes)) else json.dumps(body))
        async with s.request(method, url, data=data, headers=headers) as r:
            text = await r.text()
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError:
                parsed = text
            return r.status, r.headers, parsed


def request(method: str, url: str, body=None, headers: dict | None = AUTH, **kw):
    return asyncio.run(call(method, url, body, headers, **kw))


async def sse(url: str, body: dict, headers: dict = AUTH, first_event: asyncio.Event | None = None) -> list:
    events = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async with s.post(url, json=dict(body, stream=True), headers=headers) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                line = line.strip()
                if line.startswith(b"data: "):
                    payload = line[6:].decode()
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
                    if first_event is not None:
                        first_event.set()
    return events


def metric_values(text: str) -> dict:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def local_tokenizer():
    from coordinator.planning import default_model_path
    from coordinator.tokenizer import Tokenizer
    return Tokenizer.from_gguf(default_model_path())


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
            m = re.search(r"serving (http://\S+) \(model (.+?), ", self.text())
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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Serve(str(tmp_path_factory.mktemp("serve")), "--parallel", "1", "--ctx-per-slot", "256")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.text()[-2000:]


def test_version_and_a_taken_port_fails_before_the_model_is_read():
    expected = f"ggml-coordinator {version('ggml-distributed')}"
    for args in (("--version",), ("serve", "--version")):
        r = coordinator(*args)
        assert r.returncode == 0 and r.stdout.strip() == expected, r
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # no worker to reach and no model file: only the port can be what it reports
        started = time.monotonic()
        r = coordinator("serve", "--port", str(port), "--endpoints", "127.0.0.1:1", "-m", "/nonexistent.gguf")
    assert r.returncode != 0 and time.monotonic() - started < 20
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr


def test_ready_line_names_the_url_it_serves(server):
    assert server.url.startswith("http://127.0.0.1:") and server.text().count("serving http://") == 1
    status, _, body = request("GET", server.url + "/health")
    assert status == 200, body
