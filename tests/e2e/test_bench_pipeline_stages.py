"""``python -m bench.pipeline_stages --quick``: uneven pipeline stages replayed through megatron-core's schedule.

A smoke test: the command runs, replays every case and prints a well-formed table; the model agrees with the
replay within 10% (the documented full run shows <= 3%; a quick run on a loaded machine is noisier)."""

from __future__ import annotations

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
        assert 0 < measured < 60 and abs(predicted / measured - 1) < 0.10, r
    uneven = rows[1]
    # the per-stage model sees the heavy last stage; the model told every stage alike does not
    assert abs(float(uneven["predicted s"]) / float(uneven["measured s"]) - 1) < \
        abs(float(uneven["as even s"]) / float(uneven["measured s"]) - 1)
    assert any(line.strip().startswith(("PASS", "FAIL")) for line in lines[lines.index("targets:") + 1:])
    assert unfounded(res.stdout) == []  # no PASS over zero cases
