"""Shared fixtures: real ggml-rpc-server processes on 127.0.0.1."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

_LISTEN = re.compile(r"listening.*port=(\d+)")


class DaemonProcess:
    """A real daemon process on a free loopback port."""

    def __init__(self, *args: str, env: dict | None = None, startup_timeout: float = 20.0):
        self.args = args
        cmd = [sys.executable, "-m", "rpc_daemon", "-H", "127.0.0.1", "-p", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, **(env or {})), start_new_session=True)
        self.log_lines: list[str] = []
        deadline = time.monotonic() + startup_timeout
        self.port = None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log_lines.append(line)
            m = _LISTEN.search(line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port is None:
            self.kill()
            raise RuntimeError("daemon did not start:\n" + "".join(self.log_lines))
        # keep draining stderr so the daemon never blocks on a full pipe
        import threading
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log_lines.append(line)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the compute child too
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                return self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


@pytest.fixture
def start_daemon():
    started: list[DaemonProcess] = []

    def start(*args: str, **kw) -> DaemonProcess:
        d = DaemonProcess(*args, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
        d.kill()


@pytest.fixture
def daemon(start_daemon) -> DaemonProcess:
    return start_daemon("-t", "1")
