"""The ``slime-ext`` command line (console script ``slime-ext``, or ``python -m slime_ext.cli``).

Subcommands:

* ``slime-ext plan`` -- :mod:`slime_ext.cli.plan`: see what the scheduler will do with a rollout's lengths and
  the training flags, before launching the job; validate a saved schedule.
* ``slime-ext calibrate`` -- :mod:`slime_ext.cli.calibrate`: time training steps of the model on this device and
  write a measured cost profile for ``plan --cost-profile`` and run configs (needs the ``train`` extra).

A thin layer over :mod:`slime_ext.schedule`: it reads inputs, calls the planner once and reports; it never plans
by itself. It imports nothing heavy (no torch, ray or megatron; matplotlib only for ``--plot``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .. import __version__
from .errors import CLIError

PROG = "slime-ext"


def build_parser() -> argparse.ArgumentParser:
    from . import calibrate, plan

    parser = argparse.ArgumentParser(prog=PROG, description="slime-ext: rollout-side micro-batch scheduling tools")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    plan.add_parser(sub)
    calibrate.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 invalid saved schedule, 2 bad input or flags, or out of memory)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CLIError as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except MemoryError:  # the planner's arrays or a parsed file past this process's memory (ulimit -v, a container)
        print(f"{PROG} {args.command}: error: out of memory: the input does not fit in this process's memory limit; "
              f"give fewer samples (plan the rollout in parts) or raise the limit (ulimit -v)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `slime-ext plan ... | head`
        sys.stderr.close()
        return 0


__all__ = ["CLIError", "build_parser", "main"]
