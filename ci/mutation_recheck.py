"""Re-check the survivors of a finished ``ci/mutation MODULE`` run against tests written since, without re-running
every mutant: ``python ci/mutation_recheck.py MODULE TEST_FILE...`` copies the test files into
``.mutation/MODULE/mutants/``, runs them once per surviving mutant (mutmut's ``MUTANT_UNDER_TEST`` switch) and
prints which survivors the new tests kill. A fresh ``ci/mutation MODULE`` gives the same verdicts (slower)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
from pathlib import Path

import pytest


def main(module: str, tests: list[str]) -> int:
    root = Path(__file__).resolve().parents[1]
    work = root / ".mutation" / module / "mutants"
    survivors = [line.rsplit(":", 1)[0].strip() for line in (work.parent / "results.txt").read_text().splitlines()
                 if line.rstrip().endswith(": survived")]
    for test in tests:
        shutil.copy(root / test, work / test)
    os.chdir(work)
    sys.path.insert(0, str(work))
    killed = []
    for name in survivors:
        os.environ["MUTANT_UNDER_TEST"] = name
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rc = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:xdist", *tests])
        if rc not in (0, 5):
            killed.append(name)
        print(f"{'killed  ' if name in killed else 'survived'} {name}", flush=True)
    print(f"{module}: {len(killed)} of {len(survivors)} survivors killed by {' '.join(tests)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
