"""The installed package's version: what both CLIs' --version print."""
from __future__ import annotations


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ggml-distributed")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"
