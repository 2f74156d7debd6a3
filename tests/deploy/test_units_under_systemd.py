"""The units in deploy/ run under a real systemd, hardening and all.

Opt-in (GGML_TEST_REAL_SYSTEMD=1), for a root shell on a machine or container
whose PID 1 is not systemd (CI's runners and developers' desktops have their
own systemd, which must not be disturbed). It boots systemd 252+ as PID 1 of new
PID, mount, UTS and IPC namespaces, into an empty target, with a private /run
and /var/cache and an overlay on /etc holding /etc/ggml-distributed; the units
are used as shipped, plus a drop-in that is test plumbing only: this tree on
PYTHONPATH, the interpreter's and the model's directories bound read-only
(the units hide /root and /home), output to files, no boot-time dependencies.
It leaves nothing behind but the cgroups systemd made, which it removes.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import SLACK, free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BIN = pathlib.Path(sys.executable).parent
SYSTEMD = "/lib/systemd/systemd"
CGROUPS = pathlib.Path("/sys/fs/cgroup")

pytestmark = [pytest.mark.system, pytest.mark.skipif(
    os.environ.get("GGML_TEST_REAL_SYSTEMD") != "1" or os.geteuid() != 0 or not os.path.exists(SYSTEMD)
    or shutil.which("unshare") is None or shutil.which("nsenter") is None or os.path.exists("/run/systemd/system"),
    reason="opt-in (GGML_TEST_REAL_SYSTEMD=1): needs root, unshare/nsenter, systemd installed but not running")]

INNER = """#!/bin/sh
set -e
mount --make-rprivate /
mount --make-rshared /  # new peer groups in this namespace only: systemd moves credential mounts
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /var/cache
mkdir -p /run/systemd/system
cp -r {root}/units/. /run/systemd/system/
mount -t overlay overlay -o lowerdir=/etc,upperdir={root}/etc-upper,workdir={root}/etc-work /etc
export container=ggml-test
exec {systemd} --system --unit=ggml-test.target </dev/null >{root}/systemd.log 2>&1
"""

PLUMBING = """[Unit]
DefaultDependencies=no
[Service]
Environment=PYTHONPATH={tree}
ProtectHome=tmpfs
BindReadOnlyPaths={binds}
StandardOutput=append:{root}/%n.log
StandardError=append:{root}/%n.log
"""


def systemd_cgroups() -> set[pathlib.Path]:
    """The cgroups named like systemd's (*.slice, *.scope, *.service) in every hierarchy."""
    return {p for p in CGROUPS.rglob("*") if p.is_dir() and p.suffix in (".slice", ".scope", ".service")}


class Systemd:
    """systemd as PID 1 of its own namespaces; commands run inside them."""

    def __init__(self, root: pathlib.Path):
        from coordinator.model.default_model import default_model_path
        self.root = root
        self.model = default_model_path()
        units = root / "units"
        units.mkdir()
        (units / "ggml-test.target").write_text("[Unit]\nDescription=ggml test target\nDefaultDependencies=no\n")
        binds = " ".join(sorted({sys.base_prefix, sys.prefix, str(ROOT), os.path.dirname(self.model)}))
        for name in ("ggml-rpc-server@.service", "ggml-coordinator.service"):
            (units / name).write_text((DEPLOY / name).read_text().replace("/opt/ggml-distributed/venv/bin/",
                                                                         f"{BIN}/"))
            (units / f"{name}.d").mkdir()
            (units / f"{name}.d" / "plumbing.conf").write_text(PLUMBING.format(tree=ROOT, binds=binds, root=root))
        (root / "etc-upper" / "ggml-distributed").mkdir(parents=True)
        (root / "etc-work").mkdir()
        (root / "inner.sh").write_text(INNER.format(root=root, systemd=SYSTEMD))
        (root / "inner.sh").chmod(0o755)
        self.cgroups_before = systemd_cgroups()
        self.unshare = subprocess.Popen(["unshare", "--pid", "--fork", "--mount", "--uts", "--ipc", "--mount-proc",
                                         str(root / "inner.sh")], start_new_session=True)
        self.pid = None
        deadline = time.monotonic() + 30 * SLACK
        while time.monotonic() < deadline:
            children = pathlib.Path(f"/proc/{self.unshare.pid}/task/{self.unshare.pid}/children")
            if self.pid is None and children.exists() and children.read_text().split():
                self.pid = int(children.read_text().split()[0])
            if self.pid is not None and self.run("systemctl", "is-system-running", check=False).stdout.strip() in (
                    "running", "degraded"):
                return
            time.sleep(0.2)
        self.close()
        raise RuntimeError("systemd did not come up:\n" + (root / "systemd.log").read_text())

    def run(self, *cmd: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        r = subprocess.run(["nsenter", "-t", str(self.pid), "-m", "-p", "-u", "-i", "--", *cmd],
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{cmd}: {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    def sh(self, script: str) -> None:
        self.run("sh", "-c", script)

    def start(self, unit: str) -> tuple[bool, float]:
        started = time.monotonic()
        ok = self.run("systemctl", "start", unit, check=False).returncode == 0
        return ok, time.monotonic() - started

    def show(self, unit: str) -> dict:
        out = self.run("systemctl", "show", "-p", "Result,ActiveState,ExecMainStatus", unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def log(self, unit: str) -> str:
        path = self.root / f"{unit}.log"
        return path.read_text() if path.exists() else ""

    def close(self) -> None:
        if self.pid is not None:
            self.run("systemctl", "stop", "ggml-coordinator.service", "ggml-rpc-server@*.service", check=False)
            os.kill(self.pid, signal.SIGKILL)  # PID 1 of the namespace: everything in it goes
        self.unshare.wait(timeout=30)
        for path in sorted(systemd_cgroups() - self.cgroups_before, key=lambda p: len(p.parts), reverse=True):
            try:  # what systemd made (empty now), deepest first
                path.rmdir()
            except OSError:
                pass


@pytest.fixture(scope="module")
def systemd(tmp_path_factory):
    root = tmp_path_factory.mktemp("systemd")
    root.chmod(0o755)
    s = Systemd(root)
    try:
        s.sh("umask 077 && openssl rand -hex 32 > /etc/ggml-distributed/rpc-secret")
        yield s
    finally:
        s.close()


def write_env(systemd: Systemd, name: str, text: str) -> None:
    systemd.sh(f"cat > /etc/ggml-distributed/{name} <<'EOF'\n{text}EOF\n")


def completion(port: int) -> dict:
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


def test_worker_and_coordinator_serve_hardened(systemd):
    port, http = free_port(), free_port()
    write_env(systemd, "rpc-server.env", "GGML_RPC_HOST=127.0.0.1\nGGML_RPC_THREADS=1\n")
    worker = f"ggml-rpc-server@{port}.service"
    assert systemd.start(worker)[0], systemd.log(worker)
    assert '"auth": "hmac-sha256"' in systemd.log(worker)  # the secret came from the credential
    # the clients' memory on the unit's own tmpfs, with 2 MiB pages where the kernel has them
    shm = next(json.loads(line) for line in systemd.log(worker).splitlines() if '"shared memory"' in line)
    assert shm["source"] == "/run/ggml-rpc-shm" and "huge=within_size" in shm["why"], shm
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/shmem_enabled"):
        assert shm["huge_pages"] is True, shm
    write_env(systemd, "coordinator.env", f"GGML_ENDPOINTS=127.0.0.1:{port}\nGGML_MODEL={systemd.model}\n"
                                          f"GGML_HTTP_PORT={http}\nGGML_PARALLEL=1\n"
                                          f"GGML_COORDINATOR_EXTRA_ARGS=--ctx-per-slot 64 --threads 1\n")
    coordinator = "ggml-coordinator.service"
    assert systemd.start(coordinator)[0], systemd.log(coordinator)
    out = completion(http)
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["text"], out
    systemd.run("systemctl", "stop", coordinator, worker)
    for unit in (coordinator, worker):
        assert systemd.show(unit)["Result"] == "success", systemd.log(unit)


def test_env_file_and_secret_are_required(systemd):
    coordinator = "ggml-coordinator.service"
    systemd.sh("rm -f /etc/ggml-distributed/coordinator.env")
    assert not systemd.start(coordinator)[0]
    assert systemd.show(coordinator)["Result"] == "resources"  # "Failed to load environment files"
    write_env(systemd, "coordinator.env", "")
    assert not systemd.start(coordinator)[0]
    assert systemd.show(coordinator)["ExecMainStatus"] == "2"
    assert "--endpoints is empty (under systemd: set GGML_ENDPOINTS" in systemd.log(coordinator)
    worker = f"ggml-rpc-server@{free_port()}.service"
    write_env(systemd, "rpc-server.env", "GGML_RPC_HOST=127.0.0.1\nGGML_RPC_THREADS=1\n")
    systemd.sh("cp /etc/ggml-distributed/rpc-secret /etc/ggml-distributed/good-secret && "
               "echo change-me-to-a-long-random-string > /etc/ggml-distributed/rpc-secret")
    try:
        assert not systemd.start(worker)[0]
        assert systemd.show(worker)["ExecMainStatus"] == "2"
        assert "the shared secret is the example value" in systemd.log(worker)
        systemd.sh("rm /etc/ggml-distributed/rpc-secret")
        assert not systemd.start(worker)[0]
        assert systemd.show(worker)["ExecMainStatus"] == "243"  # 243/CREDENTIALS
    finally:
        systemd.sh("cp /etc/ggml-distributed/good-secret /etc/ggml-distributed/rpc-secret")
        systemd.run("systemctl", "stop", coordinator, worker, check=False)  # Restart=on-failure would go on


def timed_start(systemd: Systemd, unit: str, seconds: float = 300) -> tuple[float | None, float | None]:
    """Start `unit` without waiting; seconds until `systemctl show` first has an
    upload STATUS, and until the unit is active (None: it never was)."""
    started = time.monotonic()
    systemd.run("systemctl", "start", "--no-block", unit)
    uploading = None
    while time.monotonic() - started < seconds:
        out = systemd.run("systemctl", "show", "-p", "ActiveState,StatusText", unit).stdout
        if uploading is None and "StatusText=uploading weights" in out:
            uploading = time.monotonic() - started
        if "ActiveState=active" in out:
            return uploading, time.monotonic() - started
        if "ActiveState=failed" in out or "ActiveState=inactive" in out:
            return uploading, None
        time.sleep(0.05)
    return uploading, None


def test_upload_extends_the_start_timeout(systemd):
    """A start that lasts longer than TimeoutStartSec= succeeds because the
    upload sends EXTEND_TIMEOUT_USEC. A first start (default timeout, a worker
    with a cold tensor cache) measures when the upload begins and when the
    service is ready; a second one (another cold worker) runs with
    TimeoutStartSec= halfway between: past the first EXTEND_TIMEOUT_USEC, before
    READY=1."""
    write_env(systemd, "rpc-server.env", "GGML_RPC_HOST=127.0.0.1\nGGML_RPC_THREADS=1\n")
    coordinator = "ggml-coordinator.service"
    times = []
    for timeout in (None, "halfway"):
        port, http = free_port(), free_port()
        worker = f"ggml-rpc-server@{port}.service"
        assert systemd.start(worker)[0], systemd.log(worker)
        write_env(systemd, "coordinator.env", f"GGML_ENDPOINTS=127.0.0.1:{port}\nGGML_MODEL={systemd.model}\n"
                                              f"GGML_HTTP_PORT={http}\nGGML_PARALLEL=1\n"
                                              f"GGML_COORDINATOR_EXTRA_ARGS=--ctx-per-slot 64 --threads 1\n")
        if timeout is not None:
            uploading, ready = times[0]
            if ready - uploading < 2:
                pytest.skip(f"the upload took {ready - uploading:.1f} s: too short to fit a timeout inside")
            timeout = round((uploading + ready) / 2, 1)
            systemd.sh(f"printf '[Service]\\nTimeoutStartSec={timeout}\\n' > "
                       f"/run/systemd/system/{coordinator}.d/short.conf && systemctl daemon-reload")
        try:
            times.append(timed_start(systemd, coordinator))
            assert times[-1][1] is not None, (timeout, times, systemd.show(coordinator), systemd.log(coordinator))
            assert 'Status: "serving"' in systemd.run("systemctl", "status", "--no-pager", coordinator,
                                                      check=False).stdout
        finally:
            systemd.sh(f"rm -f /run/systemd/system/{coordinator}.d/short.conf && systemctl daemon-reload")
            systemd.run("systemctl", "stop", coordinator, worker, check=False)
    print(f"(upload began, ready) at {times} s; TimeoutStartSec={timeout}")
    assert times[1][1] > timeout, times  # it did outlive TimeoutStartSec=
