"""The install's PEP 517 build backend: setuptools, plus building the pinned
ggml for this machine first (ggml_build.py; cached, so only the first install
on a machine compiles).

pyproject.toml names it with `backend-path = ["ggml_ffi"]`, so this file and
ggml_build.py are imported as top-level modules, before any dependency exists:
both use the standard library only. If the build cannot run (no cmake or
compiler, no network for the source), the install goes on and the product
runs on the libggml-python wheel, saying so loudly at run time.

A non-editable wheel carries the build in `ggml_ffi/_ggml/` (so a service
running as another user finds it); an editable install uses the cache.
"""
from __future__ import annotations

import os
import pathlib
import shutil

import ggml_build
from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 (the hooks not overridden here)

BUNDLE = pathlib.Path(__file__).with_name("_ggml")


def _build_ggml() -> pathlib.Path | None:
    if os.environ.get("GGML_DISTRIBUTED_GGML") == "wheel":
        ggml_build.say("GGML_DISTRIBUTED_GGML=wheel: not building ggml; the libggml-python wheel will be used")
        return None
    try:
        return ggml_build.build()
    except ggml_build.BuildUnavailable as exc:
        ggml_build.say(f"WARNING: {exc}")
        ggml_build.say("WARNING: installing without a ggml built for this machine: it will run on the "
                       "libggml-python wheel (slower); build later with `python -m ggml_ffi.ggml_build`")
        return None


PACKAGES = ("ggml_ffi", "rpc_daemon", "coordinator")


def _compile_sources() -> None:
    """An editable install runs the source tree, and pip compiles no bytecode
    for it: a service user who cannot write there, or PYTHONDONTWRITEBYTECODE,
    would make every start compile ~40 modules again (~80 ms of a restarted
    worker's start, docs/failure-semantics.md "Resuming"). Compile them now, as
    pip does for a regular install."""
    import compileall

    root = pathlib.Path(__file__).resolve().parent.parent
    for package in PACKAGES:
        if (root / package).is_dir():
            compileall.compile_dir(str(root / package), quiet=1)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _build_ggml()
    _compile_sources()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    built = _build_ggml()
    if BUNDLE.exists():
        shutil.rmtree(BUNDLE)
    try:
        if built is not None:
            shutil.copytree(built, BUNDLE, symlinks=True)
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    finally:
        if BUNDLE.exists():
            shutil.rmtree(BUNDLE)
