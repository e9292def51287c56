"""One verdict for every benchmark target: PASS or FAIL over the cases it measured, SKIP and why over none.

A check over zero cases proves nothing, so it never reads as passed: every bench prints its targets through
:func:`verdict` (``tests/unit/test_bench_verdicts.py`` runs the quick modes without upstream code and fails on a
PASS that does not name its cases).
"""

from __future__ import annotations

import re

#: how a PASS reads: it names at least one case
PASS_OVER_CASES = re.compile(r"\bPASS \([1-9][0-9]* cases?\)")
#: how a SKIP reads: it says why
SKIP_WITH_REASON = re.compile(r"\bSKIP \(no cases: [^)]+\)")


def verdict(ok: bool, cases: int, why_none: str) -> str:
    """``"PASS (3 cases)"``, ``"FAIL (3 cases)"``, or ``"SKIP (no cases: <why_none>)"`` when ``cases`` is 0.

    ``cases``: how many cases the check looked at; ``why_none``: why there can be none (an upstream checkout
    missing, a mode not run), the fix where there is one."""
    if cases < 0:
        raise ValueError(f"cases={cases}: a count of checked cases, >= 0")
    if cases == 0:
        return f"SKIP (no cases: {why_none})"
    return f"{'PASS' if ok else 'FAIL'} ({cases} case{'' if cases == 1 else 's'})"


def unfounded(output: str) -> list[str]:
    """The lines of a bench's output with a PASS that names no case or a SKIP that names no reason (for tests)."""
    return [line for line in output.splitlines()
            if ("PASS" in line and not PASS_OVER_CASES.search(line))
            or ("SKIP" in line and not SKIP_WITH_REASON.search(line))]
