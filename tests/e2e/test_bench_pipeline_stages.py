"""``python -m bench.pipeline_stages --quick``: uneven pipeline stages replayed through megatron-core's schedule.

A smoke test: the command runs, replays every case and prints a well-formed table. How close the model comes to
the replay is the benchmark's target (printed PASS/FAIL; the documented full run shows <= 3%), not asserted here:
a replay's wall time on a loaded machine says more about the machine than about the model."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.verdict import unfounded

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_quick_uneven_replay_prints_the_model_beside_the_measurement():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run([sys.executable, "-m", "bench.pipeline_stages", "--quick"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = res.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| layout |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    rows = [dict(zip(columns, (c.strip() for c in line.strip("|").split("|"))))
            for line in lines[header + 2:] if line.startswith("|")]
    assert [r["case"] for r in rows] == ["even", "last 1.5x"]
    for r in rows:
        predicted, measured = float(r["predicted s"]), float(r["measured s"])
        assert 0 < measured and math.isfinite(measured) and 0 < predicted and math.isfinite(predicted), r
    even, uneven = rows
    # the per-stage model sees the heavy last stage (a longer makespan); the model told every stage alike does not
    assert float(even["predicted s"]) == pytest.approx(float(even["as even s"]), rel=1e-3)
    assert float(uneven["predicted s"]) > float(uneven["as even s"])
    assert any(line.strip().startswith(("PASS", "FAIL")) for line in lines[lines.index("targets:") + 1:])
    assert unfounded(res.stdout) == []  # no PASS over zero cases
