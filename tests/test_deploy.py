"""deploy/: the systemd units verify, and both services speak the notify
protocol for real: READY=1 once serving, WATCHDOG=1 from the event loop, and
no WATCHDOG=1 while the process is stopped (a wedged loop gets restarted)."""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import DaemonProcess

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"
BIN = pathlib.Path(sys.executable).parent


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_units_verify(tmp_path):
    units = []
    for name in ("ggml-rpc-server@.service", "ggml-coordinator.service"):
        text = (DEPLOY / name).read_text().replace("/opt/ggml-distributed/venv/bin/", f"{BIN}/")
        target = tmp_path / name.replace("@.", "@50052.")
        target.write_text(text)
        units.append(str(target))
    r = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    relevant = [line for line in r.stderr.splitlines() if any(str(u) in line for u in units)]
    assert not relevant, relevant


def test_units_declare_notify_watchdog_and_hardening():
    for name in ("ggml-rpc-server@.service", "ggml-coordinator.service"):
        text = (DEPLOY / name).read_text()
        for needed in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "DynamicUser=yes",
                       "ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes", "CacheDirectory=",
                       "LimitNOFILE=", "EnvironmentFile="):
            assert needed in text, f"{name} lacks {needed}"


class NotifySocket:
    def __init__(self, path: pathlib.Path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.1)

    def messages(self, seconds: float) -> list[tuple[float, str]]:
        out, deadline = [], time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                out.append((time.monotonic(), self.sock.recv(4096).decode()))
            except socket.timeout:
                pass
        return out

    def wait_for(self, message: str, seconds: float) -> float:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if message in self.sock.recv(4096).decode().split("\n"):
                    return time.monotonic()
            except socket.timeout:
                pass
        raise AssertionError(f"no {message} within {seconds} s")

    def close(self):
        self.sock.close()


def _check_watchdog(notify: NotifySocket, pid: int) -> None:
    notify.wait_for("READY=1", 60)
    beats = [m for _, m in notify.messages(1.0) if m == "WATCHDOG=1"]
    assert len(beats) >= 3, beats  # WATCHDOG_USEC=200000: a beat every 0.1 s
    os.kill(pid, signal.SIGSTOP)  # a wedged process must stop petting
    try:
        notify.messages(0.3)  # drain what was sent before the stop took effect
        assert [m for _, m in notify.messages(0.8) if m == "WATCHDOG=1"] == []
    finally:
        os.kill(pid, signal.SIGCONT)
    notify.wait_for("WATCHDOG=1", 5)


def test_daemon_ready_and_watchdog(tmp_path):
    notify = NotifySocket(tmp_path / "notify.sock")
    d = DaemonProcess("-t", "1", env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "200000"})
    try:
        _check_watchdog(notify, d.proc.pid)
    finally:
        d.stop()
        notify.close()


def test_coordinator_ready_and_watchdog(tmp_path):
    notify = NotifySocket(tmp_path / "notify.sock")
    worker = DaemonProcess("-t", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, NOTIFY_SOCKET=notify.path, WATCHDOG_USEC="200000")
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "serve", "--endpoints", worker.endpoint,
                             "--port", str(port), "--parallel", "1", "--ctx-per-slot", "64"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _check_watchdog(notify, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        worker.stop()
        notify.close()


def test_daemon_metrics_port():
    import asyncio

    from rpc_daemon.client import RpcClient
    from rpc_daemon.wire.protocol import Command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mport = s.getsockname()[1]
    d = DaemonProcess("-t", "1", "--metrics-port", str(mport))
    try:
        async def use_it():
            c = await RpcClient.connect(d.endpoint)
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 4096})
            await c.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": 4096}, b"\1" * 4096)
            return c

        loop = asyncio.new_event_loop()
        client = loop.run_until_complete(use_it())
        import urllib.request
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line and not line.startswith("#")}
        assert values["ggml_rpc_clients"] == 1
        assert values["ggml_rpc_buffers"] == 1 and values["ggml_rpc_buffer_bytes"] == 4096
        assert values["ggml_rpc_bytes_in_total"] >= 4096
        for name in ("ggml_rpc_compute_seconds_total", "ggml_rpc_compute_restarts_total", "ggml_rpc_bytes_out_total"):
            assert name in values, name
        loop.run_until_complete(client.aclose())
        loop.close()
    finally:
        d.stop()


def test_ctrl_c_in_a_terminal_stops_the_daemon_without_a_traceback(start_daemon):
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group:
    the daemon and its compute processes. The daemon shuts down; a compute
    process printed a KeyboardInterrupt traceback between "shutting down" and
    "stopped". It now leaves shutdown to the daemon."""
    from rpc_helpers import assert_served
    d = start_daemon("-t", "1")
    assert_served(d)  # a client's compute process and the spare are up
    children = [int(c) for c in pathlib.Path(f"/proc/{d.proc.pid}/task/{d.proc.pid}/children").read_text().split()]
    assert children
    # the group's signal reaches the compute processes too, in no set order: give them it
    # first, and time to misbehave, before the daemon starts shutting them down
    for pid in children:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(d.proc.pid, signal.SIGINT)  # the daemon leads its own process group, as a shell's job would
    assert d.proc.wait(timeout=20) == 0
    deadline = time.monotonic() + 5
    while "stopped" not in "".join(d.log_lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    log = "".join(d.log_lines)
    assert "stopped" in log, log[-2000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]


def test_daemon_version():
    from importlib.metadata import version
    out = subprocess.run([sys.executable, "-m", "rpc_daemon", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and version("ggml-distributed") in out.stdout, out
