"""The daemon's test entry point: `python -m rpc_daemon.testing.daemon_cli ...`.

Every flag of `ggml-rpc-server` plus the test-only ones, which the production
command line does not have (it answers "unrecognized arguments" for them):

  --test-fault SPEC        misbehave on purpose at a chosen point (faults.py; repeatable)
  --unsafe-no-validation   graphs reach libggml with schema checks only (isolation tests)

Not installed as a script; tests/conftest.py starts it for the tests that pass these flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from rpc_daemon.daemon import cli
from rpc_daemon.daemon.config import DaemonConfig

PROG = "python -m rpc_daemon.testing.daemon_cli"
TEST_FLAGS = ("--test-fault", "--unsafe-no-validation")


def parse_args(argv=None) -> tuple[DaemonConfig, argparse.Namespace]:
    p = cli.build_parser(prog=PROG)
    t = p.add_argument_group("test only")
    t.add_argument("--test-fault", action="append", default=[], metavar="SPEC",
                   help="misbehave on purpose at a chosen point (rpc_daemon/testing/faults.py)")
    t.add_argument("--unsafe-no-validation", action="store_true",
                   help="let graphs reach libggml with schema checks only")
    args = p.parse_args(argv)
    config = cli.config_from(p, args)
    if args.test_fault:
        from rpc_daemon.testing.faults import FaultSpec, FaultSpecError
        try:
            for spec in args.test_fault:
                FaultSpec.parse(spec)
        except FaultSpecError as exc:
            p.error(str(exc))
    config = dataclasses.replace(config, unsafe_no_validation=args.unsafe_no_validation,
                                 test_faults=tuple(args.test_fault))
    return config, args


def main(argv=None) -> int:
    config, args = parse_args(argv)
    return cli.run_daemon(config, args)


if __name__ == "__main__":
    sys.exit(main())
