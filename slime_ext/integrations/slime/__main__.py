"""``python -m slime_ext.integrations.slime SCRIPT [slime args...]``: run slime's driver with slime-ext on.

It runs SCRIPT as ``python SCRIPT`` would (its folder first on ``sys.path``), after :func:`enable`, and says in one
line on stderr that slime-ext is active: the slime revision it patches and the ``--dp-schedule`` scheme. A missing
script, a Python without slime, or a slime revision slime-ext does not know is refused in one line (exit 2).
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys

from . import PatchError, enable
from slime_ext.patches import slime_host
from slime_ext.schemes import DEFAULT

PROG = "python -m slime_ext.integrations.slime"


def _refuse(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _scheme(args: list[str]) -> str:
    """The ``--dp-schedule`` the job names (slime's parser checks the value), else the default."""
    for i, arg in enumerate(args):
        if arg == "--dp-schedule" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--dp-schedule="):
            return arg.split("=", 1)[1]
    return DEFAULT


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nexample: python -m slime_ext.integrations.slime train.py --balance-data "
              "--use-dynamic-batch-size --max-tokens-per-gpu 16384 ...")
        raise SystemExit(0 if argv else 2)
    script, *rest = argv
    if not os.path.isfile(script):
        _refuse(f"{script}: no such file; give the path of slime's driver, e.g. /path/to/slime/train.py")
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` puts it
    if importlib.util.find_spec("slime") is None:
        _refuse(f"slime is not importable in this Python ({sys.executable}); install it (pip install -e "
                f"/path/to/slime) or run a train.py inside slime's checkout")
    enable()
    try:
        revision = slime_host.detect_revision()  # imports slime.ray.rollout, as the driver's first lines do
    except PatchError as e:
        _refuse(str(e))
    print(f"slime-ext: active: slime {revision.version} patched, dp_schedule {_scheme(rest)} "
          f"({'slime-ext plans the rollout' if _scheme(rest) == DEFAULT else 'slime plans as before'})",
          file=sys.stderr, flush=True)
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
