"""The daemon's test entry point: `python -m rpc_daemon.testing.daemon_cli ...`.

Every flag of `ggml-rpc-server` plus the test-only ones, which the production
command line does not have (it answers "unrecognized arguments" for them):

  --test-fault SPEC        misbehave on purpose at a chosen point (faults.py; repeatable)
  --unsafe-no-validation   graphs reach libggml with schema checks only (isolation tests)
  --test-older FEATURE     act as a daemon from before FEATURE (protocol.FEATURES): not offered in
                           HELLO, and its requests refused as that daemon refused them (repeatable)

Not installed as a script; tests/conftest.py starts it for the tests that pass these flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from rpc_daemon.daemon import cli
from rpc_daemon.daemon.config import DaemonConfig

PROG = "python -m rpc_daemon.testing.daemon_cli"
TEST_FLAGS = ("--test-fault", "--unsafe-no-validation", "--test-older")


def parse_args(argv=None) -> tuple[DaemonConfig, argparse.Namespace]:
    p = cli.build_parser(prog=PROG)
    t = p.add_argument_group("test only")
    t.add_argument("--test-fault", action="append", default=[], metavar="SPEC",
                   help="misbehave on purpose at a chosen point (rpc_daemon/testing/faults.py)")
    t.add_argument("--test-older", action="append", default=[], metavar="FEATURE",
                   help="act as a daemon from before FEATURE (faulty_connection.OLDER)")
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
    from rpc_daemon.testing.faulty_connection import OLDER
    unknown = sorted(set(args.test_older) - set(OLDER))
    if unknown:
        p.error(f"--test-older: no older behaviour known for {', '.join(unknown)} (known: {', '.join(OLDER)})")
    config = dataclasses.replace(config, unsafe_no_validation=args.unsafe_no_validation,
                                 test_faults=tuple(args.test_fault), test_older=tuple(args.test_older))
    return config, args


def main(argv=None) -> int:
    config, args = parse_args(argv)
    return cli.run_daemon(config, args)


if __name__ == "__main__":
    sys.exit(main())
