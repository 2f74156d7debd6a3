"""Shared fixtures: real ggml-rpc-server processes on 127.0.0.1."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import settings as hypothesis_settings

# CI runs property tests with a fixed seed so a submission's result is repeatable;
# developers' runs keep exploring new examples.
hypothesis_settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")


def _slack() -> float:
    value = os.environ.get("GGML_TEST_SLACK", "3")
    try:
        slack = float(value)
    except ValueError:
        slack = float("nan")
    if not slack >= 1.0 or slack == float("inf"):
        raise ValueError(f"GGML_TEST_SLACK must be a number >= 1 (a factor on wall-clock bounds), not {value!r}")
    return slack


# The one scale factor for every wall-clock bound a test asserts: an upper bound of
# b seconds (a documented detection guarantee, "fails fast", a wait for something
# promised "within b s") is asserted as b * SLACK. The default, 3, lets the suite
# pass on a 2-core machine running at load 4 (each test process then gets about a
# third of a core); set GGML_TEST_SLACK (>= 1) for a slower or busier machine, or
# GGML_TEST_SLACK=1 to assert the bounds as measured on an idle one. Lower bounds
# ("no earlier than") are never scaled, nor are the settings under test (a
# liveness_timeout, an idle timeout), nor hang guards (a subprocess's timeout).
SLACK = _slack()

_LISTEN = re.compile(r"listening.*port=(\d+)")


def daemon_module(args) -> str:
    """The module to run for daemon flags `args`: the production CLI, or, for a
    test-only flag (which ggml-rpc-server refuses), the test entry point."""
    from rpc_daemon.testing.daemon_cli import TEST_FLAGS
    return "rpc_daemon.testing.daemon_cli" if any(a in TEST_FLAGS for a in args) else "rpc_daemon"


class DaemonProcess:
    """A real daemon process on a loopback port: a free one, or `port` (e.g. to
    restart a worker where its clients expect it)."""

    def __init__(self, *args: str, env: dict | None = None, startup_timeout: float = 20.0, port: int = 0,
                 nofile: tuple[int, int] | None = None):
        """`nofile`: the daemon's RLIMIT_NOFILE (soft, hard)."""
        self.args = args
        cmd = [sys.executable, "-m", daemon_module(args), "-H", "127.0.0.1", "-p", str(port), *args]

        def limit_files():
            import resource
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, **(env or {})), start_new_session=True,
                                     preexec_fn=limit_files if nofile else None)
        self.log_lines: list[str] = []
        self.port = None
        # one thread reads stderr from the start (so the daemon never blocks on a
        # full pipe) and spots the listening line; waiting for it is bounded
        import threading
        self._listening = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._listening.wait(startup_timeout) or self.port is None:
            self.kill()
            raise RuntimeError("daemon did not start:\n" + "".join(self.log_lines))

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log_lines.append(line)
            if self.port is None:
                m = _LISTEN.search(line)
                if m:
                    self.port = int(m.group(1))
                    self._listening.set()
        self._listening.set()  # EOF: the daemon exited

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_log(self, fragment: str, timeout: float = 10.0, start: int = 0) -> str:
        """The first log line (from index `start`) containing `fragment`; waits
        for it at most `timeout` seconds (times SLACK)."""
        deadline = time.monotonic() + timeout * SLACK
        while True:
            for line in self.log_lines[start:]:
                if fragment in line:
                    return line
            if time.monotonic() > deadline:
                raise TimeoutError(f"no log line with {fragment!r} within {timeout * SLACK:g} s:\n"
                                   + "".join(self.log_lines[-20:]))
            time.sleep(0.01)

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


def free_port() -> int:
    """A loopback port free now (for a program that cannot be told to pick one)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, and if it has not exited within `timeout` s, SIGKILL to its whole group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A CA and a certificate for 127.0.0.1 (tests/tls_certs.py)."""
    from tls_certs import make_tls_files
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    """A 0600 file holding rpc_helpers.SECRET (and a newline, which is ignored)."""
    from rpc_helpers import SECRET
    path = tmp_path_factory.mktemp("secret") / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    return str(path)


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The path of tests/tiny_models.py's tiny llama (seed 0), written once per session."""
    from tiny_models import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", seed=0)


@pytest.fixture(scope="module")
def shared():
    """One plain daemon per test module, for cases it must survive one after another."""
    d = DaemonProcess("-t", "1")
    yield d
    d.stop()
    d.kill()


@pytest.fixture
def d(shared):
    """The module's shared daemon, checked to serve a normal client before and after the test."""
    from rpc_helpers import assert_served

    assert_served(shared)
    yield shared
    assert_served(shared)


class WorkerSet:
    """n workers on loopback sharing one tensor cache; any of them can be
    killed and restarted on its port (tests/coordinator/test_resume.py, bench/bench_faults.py)."""

    def __init__(self, cache_dir, n: int, *args: str):
        self.args = ("-t", "1", "--cache", str(cache_dir), *args)
        self.workers = [DaemonProcess(*self.args) for _ in range(n)]
        self.restarts: list = []
        self.listening: list[float] = []  # when each restart's worker was listening (monotonic)

    def endpoint(self, i: int) -> str:
        return self.workers[i].endpoint

    def index(self, endpoint: str) -> int:
        return [w.endpoint for w in self.workers].index(endpoint)

    def kill(self, i: int, restart_after: float | None = None) -> None:
        """kill -9 worker i; with `restart_after`, start it again on its port that much later."""
        self.workers[i].kill()
        if restart_after is not None:
            import threading

            t = threading.Thread(target=self.restart, args=(i,), kwargs={"after": restart_after}, daemon=True)
            t.start()
            self.restarts.append(t)

    def restart(self, i: int, *args: str, after: float = 0.0) -> None:
        """Worker i again on its port (with extra daemon `args`), `after` seconds from now."""
        time.sleep(after)
        self.workers[i].kill()
        self.workers[i] = DaemonProcess(*self.args, *args, port=self.workers[i].port)
        self.listening.append(time.monotonic())

    def join(self) -> None:
        for t in self.restarts:
            t.join(60)
        self.restarts.clear()

    def close(self) -> None:
        self.join()
        for w in self.workers:
            w.stop()
            w.kill()


@pytest.fixture
def workers(tmp_path):
    """make(n): n workers (a WorkerSet) sharing a tensor cache, closed after the test (a stopped one
    gets SIGCONT before SIGTERM, so it ends too)."""
    made = []

    def make(n: int) -> WorkerSet:
        made.append(WorkerSet(tmp_path / "tensor-cache", n))
        return made[-1]

    yield make
    for w in made:
        w.close()
