"""Interop with llama.cpp, both ways: its RPC clients pointed at our worker are
told at once (a HELLO reply in llama.cpp's framing that it reports as a version
mismatch), and our coordinator pointed at llama.cpp's rpc-server names the
likely cause. Real daemons; llama.cpp's real binaries when they are built
(bench/ builds them into ~/.cache/ggml-distributed; skipped otherwise)."""
from __future__ import annotations

import os
import pathlib
import re
import socket
import struct
import subprocess
import sys
import time

import pytest

from conftest import SLACK, free_port, stop_process
from rpc_daemon.wire.protocol import PROTOCOL_VERSION, Status
from rpc_helpers import RawConn

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

LOG_LINE = "a llama.cpp RPC client connected; this worker speaks the ggml-distributed protocol"
# llama.cpp's HELLO as ggml-rpc.cpp sends it: | cmd u8 = RPC_CMD_HELLO (14) | input_size u64 | input |,
# input = conn_caps[24] today, nothing in older versions. Written out here, not taken from our code.
HELLO_NOW = bytes([14]) + struct.pack("<Q", 24) + bytes(24)
HELLO_OLD = bytes([14]) + struct.pack("<Q", 0)
HELLO_TIMEOUT = 10.0  # s: how long our worker waits for a HELLO
LLAMACPP_MAJOR = 7  # RPC_PROTO_MAJOR_VERSION of the llama.cpp these tests were written against
# llama.cpp built from the llama-cpp-python 0.3.36 sdist (the one bench/vocab_fixtures.py fetches)
LLAMACPP_BIN = pathlib.Path(os.environ.get("GGML_LLAMACPP_BIN") or pathlib.Path(
    os.environ.get("GGML_DISTRIBUTED_CACHE") or pathlib.Path.home() / ".cache" / "ggml-distributed")
    / "llama.cpp-0.3.36" / "build" / "bin")


def llamacpp_tool(*names: str) -> pathlib.Path:
    """The first of `names` built in LLAMACPP_BIN (tools were renamed across
    llama.cpp versions: rpc-server is ggml-rpc-server, llama-cli's one-shot
    mode is llama-completion); the test is skipped if none is."""
    for name in names:
        path = LLAMACPP_BIN / name
        if os.access(path, os.X_OK):
            return path
    pytest.skip(f"llama.cpp's {' / '.join(names)} is not built in {LLAMACPP_BIN} (set GGML_LLAMACPP_BIN to the "
                f"folder of its binaries)")


def llama_reply(sock: socket.socket, deadline: float) -> bytes:
    """Everything the daemon sends until it closes (bounded by `deadline`)."""
    data = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(256)
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the daemon neither answered nor closed in time: {data!r}")


@pytest.mark.parametrize("hello, body_size", [(HELLO_NOW, 28), (HELLO_OLD, 3)], ids=["conn_caps", "older"])
@pytest.mark.parametrize("trickle", [False, True], ids=["whole", "byte-by-byte"])
def test_a_llamacpp_hello_gets_a_version_mismatch_at_once(d, hello, body_size, trickle):
    """The reply comes well under the hello timeout (10 s), in llama.cpp's framing
    (u64 size, then major.minor.patch[, pad, conn_caps]), with a major version
    no llama.cpp has; the daemon logs why and closes; normal clients go on."""
    mark = len(d.log_lines)
    with socket.create_connection(("127.0.0.1", d.port), timeout=5) as s:
        started = time.monotonic()
        if trickle:
            for i in range(len(hello)):
                s.sendall(hello[i:i + 1])
                time.sleep(0.01)
        else:
            s.sendall(hello)
        reply = llama_reply(s, started + 5 * SLACK)
        waited = time.monotonic() - started
    assert waited < min(3 * SLACK, 0.9 * HELLO_TIMEOUT), waited  # not the hello timeout, whatever the slack
    assert len(reply) == 8 + body_size and struct.unpack("<Q", reply[:8])[0] == body_size, reply
    major, minor, patch = reply[8:11]
    assert major != LLAMACPP_MAJOR and (major, minor, patch) == (0, 0, 0), reply
    assert reply[11:] == bytes(body_size - 3)  # padding and conn_caps: none offered
    line = d.wait_log(LOG_LINE, timeout=5, start=mark)
    assert "rpc-server" in line  # the hint names what to point llama.cpp at
    assert "LIMIT_EXCEEDED" not in "".join(d.log_lines[mark:])


def test_bytes_like_a_llamacpp_hello_but_not_one_are_framed_as_before(d):
    """Only cmd 14 with input_size 0 or 24 is taken for llama.cpp; other openings
    meet the usual pre-auth framing checks, from their first byte."""
    conn = RawConn(d.port)
    conn.send_raw(bytes([14]) + struct.pack("<Q", 25) + bytes(3))  # header_len 6414: past the pre-auth bound
    header, _ = conn.recv_frame()
    assert header["status"] == -103 and "before authentication" in header["error"], header
    conn.sock.close()
    mark = len(d.log_lines)
    conn = RawConn(d.port)
    conn.send_raw(b"\x0f" + bytes(11))  # header_len 15, blob 0: waits for a 15-byte header, as ever
    conn.send_raw(b"\x82\xa3cmd\x00\xa7version\x01")  # {"cmd": 0, "version": 1}: a 15-byte HELLO
    header, _ = conn.recv_frame()
    # framed and answered by our protocol: protocol 1's HELLO gets our version error, not llama.cpp's reply
    assert header["version"] == PROTOCOL_VERSION and header["status"] == Status.VERSION_MISMATCH, header
    assert "protocol version 1 not supported" in header["error"], header
    conn.sock.close()
    assert LOG_LINE not in "".join(d.log_lines[mark:])


# ---------------------------------------------------------------- llama.cpp's real programs

def test_llamacpp_rpc_client_reports_a_version_mismatch_at_once(d):
    """llama.cpp's own RPC client code (libggml-rpc, as llama-cli --rpc uses it)
    against our worker: it prints its version mismatch and gives up, at once."""
    lib = llamacpp_tool("libggml-rpc.so")
    probe = (f"import ctypes\nlib = ctypes.CDLL({str(lib)!r})\nfree, total = ctypes.c_size_t(), ctypes.c_size_t()\n"
             f"lib.ggml_backend_rpc_get_device_memory(b'{d.endpoint}', 0, ctypes.byref(free), ctypes.byref(total))\n"
             f"print('answered', free.value, total.value)")
    mark = len(d.log_lines)
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    assert time.monotonic() - started < min(8 * SLACK, 0.9 * HELLO_TIMEOUT), r.stderr  # not after our hello timeout
    assert "RPC server version mismatch: 0.0.0" in r.stderr and "answered" not in r.stdout, r.stderr
    assert f"RPC handshake failed for {d.endpoint}" in r.stderr, r.stderr
    d.wait_log(LOG_LINE, timeout=5, start=mark)


@pytest.mark.parametrize("tool", ["llama-completion", "llama-bench"])
def test_llamacpp_tools_against_our_worker_report_a_version_mismatch(d, tmp_path, tool):
    """llama.cpp's programs with --rpc pointed at our worker, on a small GGUF."""
    from tiny_models import write_tiny_llama
    model = str(write_tiny_llama(tmp_path / "tiny.gguf", seed=0))
    if tool == "llama-completion":
        cmd = [str(llamacpp_tool("llama-completion", "llama-cli")), "--rpc", d.endpoint, "-m", model,
               "-p", "Hello", "-n", "1", "-no-cnv", "--no-warmup"]
    else:
        cmd = [str(llamacpp_tool("llama-bench")), "--rpc", d.endpoint, "-m", model, "-p", "8", "-n", "1", "-r", "1"]
    mark = len(d.log_lines)
    started = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                           env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{tool} hung against our worker: {exc.stderr!r}") from None
    out = r.stdout + r.stderr
    # ggml-rpc.cpp logs "RPC server version mismatch: 0.0.0", then aborts with "RPC handshake failed" (only
    # a failed version check leads there; a bad reply aborts with "malformed response"). These tools log
    # through a thread the abort may cut short, so the first line is not always printed.
    assert r.returncode != 0 and f"RPC handshake failed for {d.endpoint}" in out, out[-3000:]
    assert "malformed response" not in out and ("version mismatch" not in out or "mismatch: 0.0.0" in out), out
    assert time.monotonic() - started < 30 * SLACK
    d.wait_log(LOG_LINE, timeout=5, start=mark)


def test_our_coordinator_against_llamacpp_rpc_server_names_the_likely_cause(tmp_path):
    """`ggml-coordinator generate --endpoints` at llama.cpp's rpc-server: the error
    says first that the peer is probably not our worker (e.g. llama.cpp's
    rpc-server), then the TLS hint."""
    rpc_server = llamacpp_tool("ggml-rpc-server", "rpc-server")
    from tiny_models import write_tiny_llama
    model = write_tiny_llama(tmp_path / "tiny.gguf", seed=0)
    port = free_port()
    server = subprocess.Popen([str(rpc_server), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30 * SLACK
        while True:  # it listens once its backends are up
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "rpc-server did not start"
                time.sleep(0.1)
        r = subprocess.run([sys.executable, "-m", "coordinator", "generate", "--endpoints", f"127.0.0.1:{port}",
                            "-m", str(model), "-p", "Hello", "-n", "1"], capture_output=True, text=True, timeout=60)
    finally:
        stop_process(server, 10)
    assert r.returncode == 3, r.stderr
    err = r.stderr
    assert "probably not a ggml-distributed worker" in err and "llama.cpp's rpc-server" in err, err
    assert err.index("probably not a ggml-distributed worker") < err.index("give its CA"), err
    assert re.search(r"it hung up on our HELLO \((EOF|connection reset by peer)\), as", err), err
