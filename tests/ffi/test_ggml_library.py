"""Which libggml runs: the pinned ggml built for this machine when it is built,
the libggml-python wheel as a loud fallback; a cluster mixing the two is refused
at HELLO, never computes."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from ggml_ffi import ORIGIN, CpuBackend, describe, ggml_build, ggml_identity
from rpc_daemon.client import PeerFailed, RpcClient

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILT = ggml_build.find_build() is not None
needs_build = pytest.mark.skipif(not BUILT, reason="the pinned ggml is not built here (python -m ggml_ffi.ggml_build)")

PROBE = """
import json, ggml_ffi
from ggml_ffi import CpuBackend, Context, Gallocr, lib, tensor_array
be = CpuBackend(1)
with Context(16) as ctx:
    a = ctx.new_tensor(lib.GGML_TYPE_F32, [4]); b = ctx.new_tensor(lib.GGML_TYPE_F32, [4])
    c = lib.ggml_add(ctx.ptr, a, b); gf = ctx.new_graph(16); lib.ggml_build_forward_expand(gf, c)
    ga = Gallocr(be); assert ga.alloc_graph(gf)
    tensor_array(a)[:] = [1, 2, 3, 4]; tensor_array(b)[:] = 10
    assert be.compute(gf) == 0
    print(json.dumps({"sum": tensor_array(c).tolist(), **ggml_ffi.describe(), "identity": ggml_ffi.ggml_identity()}))
    ga.close()
be.close()
"""


def _probe(env: dict) -> tuple[dict, str]:
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT, **env))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stdout + run.stderr  # structlog prints to stdout


@needs_build
def test_the_build_is_preferred_and_says_what_it_is():
    assert ORIGIN.kind == "build" or os.environ.get("GGML_DISTRIBUTED_GGML"), ORIGIN
    facts, log = _probe({})
    assert facts["origin"] == "build" and facts["ggml_version"] == ggml_build.GGML_VERSION, facts
    assert facts["sum"] == [11.0, 12.0, 13.0, 14.0]
    assert facts["cpu_variant"] and facts["cpu_features"], facts
    assert "built for this machine" in log and facts["cpu_variant"] in log, log


def test_the_wheel_still_runs_as_a_loud_fallback():
    facts, log = _probe({"GGML_DISTRIBUTED_GGML": "wheel"})
    assert facts["origin"] == "wheel" and facts["sum"] == [11.0, 12.0, 13.0, 14.0], facts
    assert "FALLBACK to the libggml-python wheel" in log, log


def test_cpu_backend_reports_its_variant():
    with CpuBackend(1):
        facts = describe()
    assert facts["cpu_variant"] and os.path.exists(facts["cpu_library"]), facts
    assert facts["ggml_version"] == ggml_identity()["version"]


@needs_build
def test_wheel_and_build_have_different_op_tables():
    other, _ = _probe({"GGML_DISTRIBUTED_GGML": "wheel"})
    assert other["identity"]["op_table"] != ggml_identity()["op_table"], (other, ggml_identity())


@needs_build
def test_mixed_cluster_is_refused_at_hello(start_daemon):
    """A worker on the other libggml than this client: the connection fails at HELLO
    naming both ggml versions; nothing is allocated or computed."""
    other = {"GGML_DISTRIBUTED_GGML": "wheel"} if ORIGIN.kind == "build" else {}
    worker = start_daemon("-t", "1", env=other)
    assert worker.wait_log("cpu_variant=")

    async def connect():
        client = await RpcClient.connect(worker.endpoint, connect_timeout=10)
        await client.aclose()

    with pytest.raises(PeerFailed, match="ggml mismatch") as info:
        asyncio.run(connect())
    assert "0.20.2" in str(info.value) and ggml_build.GGML_VERSION in str(info.value), info.value
    assert worker.alive()


def test_install_without_cmake_goes_on_and_says_why(tmp_path):
    """The build backend as pip runs it (ggml_ffi/ on sys.path, `backend-path`), with no cmake
    or compiler on PATH and an empty cache: no ggml is built, the install is not failed, and
    the reason is printed."""
    code = ("import sys; sys.path.insert(0, 'ggml_ffi'); import _build_backend; "
            "print('BUILT', _build_backend._build_ggml())")
    env = dict(os.environ, PATH=str(tmp_path), GGML_DISTRIBUTED_CACHE=str(tmp_path / "cache"))
    env.pop("GGML_DISTRIBUTED_GGML", None)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "BUILT None" in run.stdout, run.stdout
    assert "cmake" in run.stderr and "not found" in run.stderr and "libggml-python wheel" in run.stderr, run.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("ggml-*"))


def test_only_a_whole_build_is_taken_for_one(tmp_path, monkeypatch):
    """A build directory counts once its build-info.json (written last) reads and its libggml is
    there: a directory an interrupted build left is built again, not loaded."""
    monkeypatch.setenv("GGML_DISTRIBUTED_CACHE", str(tmp_path))
    monkeypatch.delenv("GGML_DISTRIBUTED_GGML_VARIANT", raising=False)
    d = ggml_build.build_dir()
    assert d.parent == tmp_path and not ggml_build.is_finished(d) and ggml_build.find_build() is None
    (d / "lib").mkdir(parents=True)
    (d / "lib" / "libggml.so.0").write_bytes(b"\x7fELF")
    assert not ggml_build.is_finished(d) and ggml_build.find_build() is None  # no build-info.json
    (d / ggml_build.INFO_FILE).write_text('{"ggml_version": "0.25')  # cut short
    assert not ggml_build.is_finished(d) and ggml_build.find_build() is None
    (d / ggml_build.INFO_FILE).write_text(json.dumps({"ggml_version": ggml_build.GGML_VERSION}))
    assert ggml_build.is_finished(d) and ggml_build.find_build() == d
    (d / "lib" / "libggml.so.0").unlink()
    assert not ggml_build.is_finished(d) and ggml_build.find_build() is None


def test_worker_reports_its_ggml_in_log_device_info_and_metrics(start_daemon):
    import socket
    import urllib.request

    from rpc_daemon.wire.protocol import Command, Status
    from rpc_helpers import RawConn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mport = s.getsockname()[1]
    worker = start_daemon("-t", "1", "--metrics-port", str(mport))
    with CpuBackend(1):
        ours = describe()  # the worker loads the same library as this process
    line = worker.wait_log("cpu_variant=")
    assert f"cpu_variant={ours['cpu_variant']}" in line and f"origin={ours['origin']}" in line, line
    with RawConn(worker.port, timeout=10) as conn:
        conn.hello()
        h, _ = conn.call(Command.DEVICE_INFO)
    assert h["status"] == Status.SUCCESS, h
    assert h["cpu_variant"] == ours["cpu_variant"], h
    assert h["ggml"] == dict(ggml_identity(), origin=ours["origin"]), h
    assert set(h["cpu_features"]) == {f.lower() for f in ours["cpu_features"]}, h
    assert {k: v for k, v in h["kernels"].items() if k != "extra_buffers"} == ours["kernels"], h
    assert isinstance(h["kernels"]["extra_buffers"], dict), h  # filled once the start's probe has run
    assert f"llamafile={ours['kernels']['llamafile']}" in line and "tiled_k_quants=" in line, line
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
    info = [ln for ln in text.splitlines() if ln.startswith("ggml_rpc_ggml_info{")]
    assert len(info) == 1 and f'cpu_variant="{ours["cpu_variant"]}"' in info[0], info
    assert f'version="{ours["ggml_version"]}"' in info[0] and info[0].endswith(" 1.0"), info
    assert f'llamafile="{ours["kernels"]["llamafile"]}"' in info[0] and "tiled_k_quants=" in info[0], info
