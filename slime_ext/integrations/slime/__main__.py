"""``python -m slime_ext.integrations.slime SCRIPT [slime args...]``: run slime's driver with slime-ext on."""

from __future__ import annotations

import runpy
import sys

from . import enable


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nexample: python -m slime_ext.integrations.slime train.py --balance-data "
              "--use-dynamic-batch-size --max-tokens-per-gpu 16384 ...")
        raise SystemExit(0 if argv else 2)
    script, *rest = argv
    enable()
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
