"""Runs ``slime_probe.py SCENARIO`` in a slime tree's environment (one process per tag and scenario, cached: slime's
modules are process-wide) and returns the JSON it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parent / "slime_probe.py"
_runs: dict[tuple[str, str], dict] = {}
_skips: dict[tuple[str, str], str] = {}


def run_probe(slime_env: dict, scenario: str) -> dict:
    """What ``slime_probe.py scenario`` found in ``slime_env``'s tree; ``AssertionError`` with its output if it
    printed nothing (a skip where the tree's slime imports Megatron-LM's ``megatron.training`` and no Megatron-LM
    checkout was given)."""
    key = (slime_env["tag"], scenario)
    if key in _skips:
        pytest.skip(_skips[key])
    if key not in _runs:
        proc = subprocess.run([sys.executable, str(PROBE), scenario], env=slime_env["env"], capture_output=True,
                              text=True, timeout=1500)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SLIME_PROBE_JSON ")]
        if not lines and slime_env["megatron"] is None and "No module named 'megatron.training'" in proc.stderr:
            _skips[key] = (f"slime {slime_env['tag']} imports megatron.training where slime-ext patches it: set "
                           f"MEGATRON_LM_GIT to a clone of github.com/NVIDIA/Megatron-LM (ci/host_test)")
            pytest.skip(_skips[key])
        if not lines:
            raise AssertionError(f"the probe ({scenario}) failed at {slime_env['tag']} (exit {proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        _runs[key] = json.loads(lines[-1][len("SLIME_PROBE_JSON "):])
    return _runs[key]
