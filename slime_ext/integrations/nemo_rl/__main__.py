"""``python -m slime_ext.integrations.nemo_rl [--cost-profile JSON] [--pad-to-longest] SCRIPT [its arguments]``:
run a NeMo-RL entry script (``examples/run_grpo.py``, ...) with slime-ext planning its Megatron micro-batches (see
the package docstring)."""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys

from . import enable_on_import


def parse(argv: list[str]) -> tuple[argparse.Namespace, str, list[str]]:
    """slime-ext's options, the script, and everything after it (the script's own arguments, untouched)."""
    parser = argparse.ArgumentParser(
        prog="python -m slime_ext.integrations.nemo_rl",
        usage="%(prog)s [--cost-profile JSON] [--pad-to-longest] SCRIPT [NeMo-RL arguments]",
        description="Run a NeMo-RL entry script with slime-ext planning its Megatron micro-batches. Options before "
                    "the script are slime-ext's; everything after it goes to the script unchanged.")
    parser.add_argument("--cost-profile", default=None,
                        help="a JSON file from `slime-ext calibrate`: plan with measured seconds instead of tokens")
    parser.add_argument("--pad-to-longest", action="store_true",
                        help="under pipeline parallelism, keep NeMo-RL's Megatron worker class and its pad of every "
                             "packed micro-batch to the longest (default: slime-ext's worker class runs each at its "
                             "own length, and the workers must import slime-ext); for workers that cannot import "
                             "slime-ext, or a worker_extension_cls_fqn of your own")
    parser.add_argument("script", help="NeMo-RL's entry script, e.g. examples/run_grpo.py")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the script's arguments")
    ns = parser.parse_args(argv)
    if not os.path.isfile(ns.script):
        parser.error(f"{ns.script!r} is not a file; pass the path of NeMo-RL's entry script (e.g. "
                     f"examples/run_grpo.py)")
    return ns, ns.script, ns.rest


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO)
    ns, script, rest = parse(sys.argv[1:] if argv is None else argv)
    script_dir = os.path.dirname(os.path.abspath(script))
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)
    enable_on_import(cost_profile=ns.cost_profile, pad_to_longest=ns.pad_to_longest)
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
