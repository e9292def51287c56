"""``python -m bench.pipeline --quick``: megatron-core's real pipeline schedule replayed with sleeps (issue 15).

A smoke test: the command runs, replays every plan, and prints a well-formed table and the target lines. Its
PASS/FAIL targets are speed targets on a shared machine and are not asserted here.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.verdict import unfounded

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_quick_replay_prints_a_well_formed_table():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run([sys.executable, "-m", "bench.pipeline", "--quick"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| layout |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    assert lines[header + 1] == "|" + "---|" * len(columns)
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(columns, (c.strip() for c in line.strip("|").split("|")))))
        assert len(line.strip("|").split("|")) == len(columns), line
    assert [r["plan"] for r in rows] == ["before", "after", "slime"]
    measured = [r for r in rows if r["measured s"]]
    assert [r["plan"] for r in measured][:2] == ["before", "after"]
    for r in measured:
        predicted, seconds = float(r["predicted s"]), float(r["measured s"])
        assert r["layout"] == "pp2" and r["workload"] == "rl-like"
        assert int(r["#mb"]) >= 1 and 0 <= int(r["replica"]) < 8
        assert 0 < seconds and math.isfinite(seconds) and math.isfinite(predicted) and predicted > 0
        assert float(r["bound s"]) <= predicted * (1 + 1e-9)  # a lower bound never exceeds the prediction
        assert re.fullmatch(r"[+-]\d+\.\d%", r["model err"])
    if len(measured) < 3:  # no SLIME_GIT: the slime row says how to get it
        assert "SLIME_GIT" in lines[header + 2 + 2]
    targets = lines[lines.index("targets:") + 1:]
    assert len(targets) == 7 and all(re.match(r"  (PASS|FAIL|SKIP) ", t) for t in targets), targets
    assert unfounded(res.stdout) == []  # no PASS over zero cases, no SKIP without its reason
