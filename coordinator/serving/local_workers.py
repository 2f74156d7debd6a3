"""Start ggml-rpc-server processes on free loopback ports and stop them again:
what `ggml-coordinator` does when no --endpoints are given."""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

import structlog

log = structlog.get_logger("coordinator")

# the daemon's "listening" log line, console or JSON format
_PORT = re.compile(r'\bport"?[=:] ?(\d+)')


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the coordinator dies, even by
    SIGKILL, so local workers never outlive it (Linux PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except Exception:  # not Linux: the coordinator's own shutdown still stops them
        pass


class LocalWorker:
    def __init__(self, threads: int = 1, extra_args=(), startup_timeout: float = 30.0, port: int = 0):
        cmd = [sys.executable, "-m", "rpc_daemon", "-H", "127.0.0.1", "-p", str(port), "-t", str(threads),
               "--log-format", "json", *extra_args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.lines: list[str] = []
        self.port = None
        try:
            self._wait_listening(startup_timeout)
        except BaseException:  # e.g. SIGTERM while it starts: it is not ours to forget yet
            self.stop()
            raise
        if self.port is None:
            self.stop()
            raise RuntimeError("local worker did not start: " + "".join(self.lines[-5:]))
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_listening(self, startup_timeout: float) -> None:
        # raw reads of the pipe: a buffered readline() could pull the "listening" line into
        # Python's buffer behind an earlier line, where select() never sees it
        deadline, pending, fd = time.monotonic() + startup_timeout, b"", self.proc.stderr.fileno()
        while self.port is None:
            if b"\n" in pending:
                raw, pending = pending.split(b"\n", 1)
                line = raw.decode(errors="replace") + "\n"
                self.lines.append(line)
                m = _PORT.search(line) if "listening" in line else None
                if m:
                    self.port = int(m.group(1))
                continue
            left = deadline - time.monotonic()
            # never block on a silent daemon: wait for output at most until the deadline
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            pending += chunk
        if pending:  # lines after "listening" that came in the same read
            self.lines += [ln.decode(errors="replace") + "\n" for ln in pending.split(b"\n") if ln]

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            del self.lines[:-200]

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class LocalWorkers:
    def __init__(self, n: int, threads: int = 1, extra_args=()):
        self.threads, self.extra_args = threads, tuple(extra_args)
        self.workers: list[LocalWorker] = []
        self._lock = threading.Lock()  # the supervisor's restarts against stop()
        self._stopping = threading.Event()
        try:
            for _ in range(n):
                self.workers.append(LocalWorker(threads, extra_args))
        except BaseException:
            self.stop()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [w.endpoint for w in self.workers]

    def supervise(self, interval: float = 0.5) -> None:
        """Restart a worker that dies (crash, OOM killer, kill -9) on its port,
        where the coordinator's automatic reconnect finds it: a long-running
        server over local workers recovers by itself."""
        threading.Thread(target=self._supervise, args=(interval,), name="local-workers", daemon=True).start()

    def _supervise(self, interval: float) -> None:
        while not self._stopping.wait(interval):
            for i, w in enumerate(list(self.workers)):
                status = w.proc.poll()  # also reaps it: no zombie
                if status is None:
                    continue
                with self._lock:
                    if self._stopping.is_set():
                        return
                    # a structured line: under --log-format json every line the coordinator prints is JSON
                    log.warning("local worker exited; restarting it", port=w.port, exit_status=status)
                    try:
                        self.workers[i] = LocalWorker(self.threads, self.extra_args, port=w.port)
                    except Exception as exc:  # e.g. the port is taken meanwhile: try again next round
                        log.error("restarting the local worker failed; trying again", port=w.port, error=str(exc))

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            for w in self.workers:
                w.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
