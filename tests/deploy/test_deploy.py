"""deploy/: the systemd units verify and score "OK" in systemd-analyze
security, and both services speak the notify protocol for real: READY=1 once
serving, WATCHDOG=1 from the event loop, no WATCHDOG=1 while the process is
stopped (a wedged loop gets restarted), and EXTEND_TIMEOUT_USEC while the
coordinator uploads weights."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import SLACK, DaemonProcess, free_port

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
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
                       "LimitNOFILE=", "CapabilityBoundingSet=\n", "SystemCallFilter=@system-service",
                       "UMask=0077", "LoadCredential=rpc-secret:/etc/ggml-distributed/rpc-secret"):
            assert needed in text, f"{name} lacks {needed}"
        # the env file is required (no "-" prefix), and the secret never travels in the environment
        env_files = [line for line in text.splitlines() if line.startswith("EnvironmentFile=")]
        assert env_files and all(line.startswith("EnvironmentFile=/etc/ggml-distributed/") for line in env_files)
        assert "GGML_RPC_SECRET" not in text and "--secret-file" not in text
    for example in DEPLOY.glob("*.example"):
        assert "GGML_RPC_SECRET=" not in example.read_text(), example
    # no default for what must come from the env file: unset, it reaches the command line empty (refused below)
    coordinator = (DEPLOY / "ggml-coordinator.service").read_text()
    assert "--endpoints ${GGML_ENDPOINTS}" in coordinator and "--model ${GGML_MODEL}" in coordinator
    assert "Environment=GGML_ENDPOINTS" not in coordinator and "Environment=GGML_MODEL" not in coordinator


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", ["ggml-rpc-server@.service", "ggml-coordinator.service"])
def test_unit_security_exposure_is_ok(tmp_path, name):
    """`systemd-analyze security` rates both units "OK" (2.5 or less; 5.7 and
    5.6 before they were hardened), offline, from the unit file alone."""
    target = tmp_path / name.replace("@.", "@50052.")
    target.write_text((DEPLOY / name).read_text())
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(target)],
                       capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout + r.stderr)
    assert found, r.stdout + r.stderr
    assert float(found.group(1)) <= 2.5, r.stdout


@pytest.mark.parametrize("argv, message", [
    (["--endpoints", "", "--model", ""], "--endpoints is empty (under systemd: set GGML_ENDPOINTS"),
    (["--endpoints", "127.0.0.1:1", "--model", ""], "--model is empty (under systemd: set GGML_MODEL"),
])
def test_coordinator_refuses_empty_endpoints_or_model(argv, message):
    """What the unit's `--endpoints ${GGML_ENDPOINTS}` becomes when the env
    file does not set it: an empty argument, refused at once, instead of local
    workers serving the bundled model."""
    r = subprocess.run([sys.executable, "-m", "coordinator", "serve", "--port", "0", *argv], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.parametrize("source", ["env", "credential", "file"])
def test_coordinator_refuses_weak_secret_at_start(tmp_path, source):
    weak = "a" * 40
    env = dict(os.environ)
    env.pop("GGML_RPC_SECRET", None)
    args = []
    if source == "env":
        env["GGML_RPC_SECRET"] = weak
    elif source == "credential":
        (tmp_path / "rpc-secret").write_text(weak + "\n")
        env["CREDENTIALS_DIRECTORY"] = str(tmp_path)
    else:
        (tmp_path / "secret").write_text("change-me-to-a-long-random-string\n")
        args = ["--secret-file", str(tmp_path / "secret")]
    r = subprocess.run([sys.executable, "-m", "coordinator", "serve", "--port", "0", *args], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert ("example value" if source == "file" else "1-byte pattern repeated") in r.stderr, r.stderr
    assert "openssl rand -hex 32" in r.stderr and "serving" not in r.stderr


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
        seconds *= SLACK
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
    beats = [m for _, m in notify.messages(1.0 * SLACK) if m == "WATCHDOG=1"]
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
    port = free_port()
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

    mport = free_port()
    d = DaemonProcess("-t", "1", "--metrics-port", str(mport))
    try:
        async def use_it():
            c = await RpcClient.connect(d.endpoint)
            h, _ = await c.request(Command.ALLOC_BUFFER, {"size": 4096})
            await c.request(Command.SET_TENSOR, {"buffer": h["buffer"], "offset": 0, "size": 4096}, b"\1" * 4096)
            info, _ = await c.request(Command.DEVICE_INFO)
            return c, info["shared_memory"]["page"]

        loop = asyncio.new_event_loop()
        client, page = loop.run_until_complete(use_it())
        import urllib.request
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line and not line.startswith("#")}
        assert values["ggml_rpc_clients"] == 1
        # a buffer counts whole pages of its arena: 4 KiB, or 2 MiB on huge pages (DEVICE_INFO shared_memory.page)
        assert values["ggml_rpc_buffers"] == 1 and values["ggml_rpc_buffer_bytes"] == page
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
    assert d.proc.wait(timeout=20 * SLACK) == 0
    deadline = time.monotonic() + 5 * SLACK
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


SLOW_START = """
import sys, time
class SlowDaemonCode:  # the daemon's code loads 2 s late: a wide window before it serves
    def find_spec(self, name, path=None, target=None):
        if name == "rpc_daemon.daemon.app":
            time.sleep(2.0)
        return None
sys.meta_path.insert(0, SlowDaemonCode())
"""


def test_the_first_compute_process_starts_before_the_daemon_code_loads(tmp_path):
    """A worker starts its first compute process (~0.2 s of imports) before it
    loads its own code and libggml, so the two start on two cores at once,
    and a restarted worker's first requests do not share the CPU with it. The
    worker's code is made to load 2 s late (a sitecustomize on its path): the
    compute process is started well before `listening`."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_START)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    proc = subprocess.Popen([sys.executable, "-m", "rpc_daemon", "-H", "127.0.0.1", "-p", "0", "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    seen: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 60 * SLACK
        while "listening" not in seen and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break  # it exited
            for event in ("compute process started", "listening"):
                if event in line:
                    seen.setdefault(event, time.monotonic())
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert set(seen) == {"compute process started", "listening"}, seen
    assert seen["listening"] - seen["compute process started"] >= 1.0, seen


def test_the_daemon_process_serves_without_numpy(start_daemon, tiny_model):
    """numpy costs a worker's start ~50-100 ms of imports: the daemon's own
    process (not its compute processes) never loads it, neither to start nor
    to serve a generation (uploads, cached graphs, inline row ids checked)."""
    from coordinator.api import Coordinator

    a, b = start_daemon("-t", "1"), start_daemon("-t", "1")
    with Coordinator([a.endpoint, b.endpoint], model=tiny_model, n_ctx=64) as c:
        assert c.generate("water", max_tokens=4, temperature=0.7, seed=1)
        c.kv_clear()
    for d in (a, b):
        maps = pathlib.Path(f"/proc/{d.proc.pid}/maps").read_text()
        assert "_multiarray_umath" not in maps, "the daemon process loaded numpy"
        assert "libggml" in maps  # what it does load, so the look is at the right process


def test_coordinator_extends_start_timeout_while_uploading(tmp_path, secret_file):
    """While `serve` uploads the model it tells systemd EXTEND_TIMEOUT_USEC
    (with the progress as STATUS=), so a big model does not outlive
    TimeoutStartSec=; READY=1 comes after the upload. The workers' secret comes
    from systemd's credentials directory, as the unit passes it."""
    from rpc_helpers import SECRET
    notify = NotifySocket(tmp_path / "notify.sock")
    worker = DaemonProcess("-t", "1", "--secret-file", secret_file)
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "rpc-secret").write_bytes(SECRET + b"\n")
    env = dict(os.environ, NOTIFY_SOCKET=notify.path, CREDENTIALS_DIRECTORY=str(creds))
    env.pop("GGML_RPC_SECRET", None)
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "serve", "--endpoints", worker.endpoint,
                             "--port", "0", "--parallel", "1", "--ctx-per-slot", "64"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        messages, deadline = [], time.monotonic() + 120 * SLACK
        while not any("READY=1" in m.split("\n") for m in messages) and time.monotonic() < deadline:
            messages += [m for _, m in notify.messages(0.2)]
            assert proc.poll() is None, f"coordinator exited {proc.returncode}: {messages}"
        ready = next(i for i, m in enumerate(messages) if "READY=1" in m.split("\n"))
        fields = [dict(line.split("=", 1) for line in m.split("\n")) for m in messages]
        extends = [f for f in fields[:ready] if "EXTEND_TIMEOUT_USEC" in f]
        assert len(extends) >= 3, messages
        assert all(int(f["EXTEND_TIMEOUT_USEC"]) >= 10_000_000 for f in extends), messages
        percents = [int(re.match(r"uploading weights: (\d+)% of \d+ MiB", f["STATUS"]).group(1)) for f in extends]
        assert percents == sorted(percents) and percents[0] == 0 and percents[-1] == 100, percents
        assert fields[ready].get("STATUS") == "serving", messages
        assert not any("EXTEND_TIMEOUT_USEC" in f for f in fields[ready:]), messages
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        worker.stop()
        notify.close()


def test_start_timeout_extender_sends_on_progress_only(tmp_path):
    """At the start, at each twentieth of the total, and at least every
    `every` seconds of progress; nothing without progress."""
    from rpc_daemon.service.systemd import StartTimeoutExtender
    notify = NotifySocket(tmp_path / "notify.sock")
    now = [0.0]
    extend = StartTimeoutExtender(extend_by=30.0, every=5.0, env={"NOTIFY_SOCKET": notify.path},
                                  clock=lambda: now[0])
    try:
        sent = []
        for t, done in ((0, 0), (1, 1), (2, 2), (4.9, 3), (5.1, 4), (5.2, 5), (5.3, 6), (60, 100)):
            now[0] = t
            extend(done, 100)
            sent += [m for _, m in notify.messages(0.05)]
        assert [m.split("\n")[1] for m in sent] == [f"STATUS=uploading weights: {p}% of 0 MiB" for p in (0, 4, 5, 100)]
        assert all(m.startswith("EXTEND_TIMEOUT_USEC=30000000\n") for m in sent)
    finally:
        notify.close()
