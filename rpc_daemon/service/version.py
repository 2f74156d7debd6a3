"""The installed package's version: what both CLIs' --version print."""
from __future__ import annotations

import argparse
import sys


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ggml-distributed")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class VersionAction(argparse.Action):
    """`--version`: prints "<prog> <version>" and exits, like argparse's own, but
    looks the version up only when asked: importlib.metadata scans every
    installed distribution (~40 ms), which every start of a worker would pay."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, prog: str | None = None,
                 help="show program's version number and exit"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)
        self.prog = prog

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{self.prog or parser.prog} {package_version()}", file=sys.stdout)  # argparse's goes to stdout too
        parser.exit()
