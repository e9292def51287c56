"""Runs ``slime_probe.py SCENARIO`` in a slime tree's environment (one process per tag and scenario, cached: slime's
modules are process-wide) and returns the JSON it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parent / "slime_probe.py"
_runs: dict[tuple[str, str], dict] = {}


def run_probe(slime_env: dict, scenario: str) -> dict:
    """What ``slime_probe.py scenario`` found in ``slime_env``'s tree; ``AssertionError`` with its output if it
    printed nothing."""
    key = (slime_env["tag"], scenario)
    if key not in _runs:
        proc = subprocess.run([sys.executable, str(PROBE), scenario], env=slime_env["env"], capture_output=True,
                              text=True, timeout=1500)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SLIME_PROBE_JSON ")]
        if not lines:
            raise AssertionError(f"the probe ({scenario}) failed at {slime_env['tag']} (exit {proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        _runs[key] = json.loads(lines[-1][len("SLIME_PROBE_JSON "):])
    return _runs[key]
