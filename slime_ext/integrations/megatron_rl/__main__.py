"""``python -m slime_ext.integrations.megatron_rl [slime-ext options] train_rl.py [Megatron-LM arguments]``: run
Megatron-LM's ``train_rl.py`` with slime-ext's plans (see the package docstring). torchrun takes it as ``-m``."""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys

from . import enable


OPTIONS = ("--max-tokens-per-gpu", "--cost-profile")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m slime_ext.integrations.megatron_rl",
        usage="%(prog)s [--max-tokens-per-gpu N] [--cost-profile JSON] train_rl.py [Megatron-LM arguments]",
        description="Run Megatron-LM's train_rl.py with slime-ext planning its micro-batches. Options before the "
                    "script are slime-ext's; everything after it goes to the script unchanged.")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=None,
                        help="most tokens of one micro-batch per GPU (default: --seq-length / context parallel size)")
    parser.add_argument("--cost-profile", default=None,
                        help="a JSON file from `slime-ext calibrate`: plan with measured seconds instead of FLOPs")
    return parser


def parse(argv: list[str]) -> tuple[argparse.Namespace, str, list[str]]:
    """slime-ext's options, the training script, and everything after it (Megatron-LM's arguments, untouched: the
    split is at the first argument that is neither one of :data:`OPTIONS` nor its value)."""
    parser = _parser()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in OPTIONS:
            i += 2
        elif arg.startswith(tuple(f"{o}=" for o in OPTIONS)):
            i += 1
        elif arg in ("-h", "--help"):
            parser.print_help()
            raise SystemExit(0)
        elif arg.startswith("-"):
            parser.error(f"unknown slime-ext option {arg!r} before the script; slime-ext's options are {OPTIONS}, "
                         f"Megatron-LM's arguments go after the script")
        else:
            break
    if i >= len(argv):
        parser.error("no training script given; pass the path of Megatron-LM's train_rl.py")
    ns = parser.parse_args(argv[:i])
    script = argv[i]
    if not os.path.isfile(script):
        parser.error(f"{script!r} is not a file; pass the path of Megatron-LM's train_rl.py")
    return ns, script, argv[i + 1:]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO)
    ns, script, rest = parse(sys.argv[1:] if argv is None else argv)
    script_dir = os.path.dirname(os.path.abspath(script))
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)  # as `python train_rl.py` does: gpt_builders, model_provider, megatron/
    enable(max_tokens_per_gpu=ns.max_tokens_per_gpu, cost_profile=ns.cost_profile)
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
