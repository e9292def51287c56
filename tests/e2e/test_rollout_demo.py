"""The demo job end to end, as a user runs it: ``python -m slime_ext.run --config configs/demo_cpu.yaml``.

It runs from a copy of the package outside the repository (as a non-editable install would place it), from an
unrelated working directory, so the driver *and every Ray worker* must import that copy -- the test checks where
each train rank's ``slime_ext`` came from.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from rollout_harness import CONFIGS, DEVICE, REPO, config

pytestmark = [pytest.mark.e2e]


def _installed_copy(tmp_path):
    site = tmp_path / "site"
    for pkg in ("slime_ext",):
        shutil.copytree(REPO / pkg, site / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return site


def _run_demo(tmp_path, *sets: str) -> tuple[subprocess.CompletedProcess, dict, object]:
    site = _installed_copy(tmp_path)
    out = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": str(site)}
    cmd = [sys.executable, "-m", "slime_ext.run", "--config", str(CONFIGS / "demo_cpu.yaml"), "--json", str(out)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), site


def test_demo_cpu_end_to_end(tmp_path):
    cfg = config("demo_cpu")
    proc, report, site = _run_demo(tmp_path)
    rows, layouts = report["rows"], report["layouts"]
    assert all(l["slime_ext"].startswith(str(site)) for l in layouts), layouts
    assert sorted(l["dp_rank"] for l in layouts) == list(range(cfg.dp_size))
    assert {r["rollout"] for r in rows} == set(range(cfg.options["num_rollout"]))
    for row in rows:
        assert len(row["mbs_per_rank"]) == cfg.dp_size and len(set(row["mbs_per_rank"])) == 1
        assert math.isfinite(row["loss"]) and row["samples"] > 0 and row["flops_balance"] >= 1.0
    # the table the README shows: a header, then one line per step with samples / mbs / balance / loss / LR / time
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["rollout", "step", "samples"])
    table = [line for line in lines[header + 1:] if line.split() and line.split()[0].isdigit()]
    assert len(table) == len(rows)
    assert "done: 3 rollouts" in proc.stdout
    # a line per phase, in order, the columns explained, and where the time went
    starts = [next(i for i, line in enumerate(lines) if line.startswith(prefix))
              for prefix in ("set-up:", "Ray start:", "process start-up:", "steps:", "rollout ", "columns:", "done:",
                             "where the time went:")]
    assert starts == sorted(starts), starts


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs SLIME_EXT_DEVICE=cuda and a CUDA GPU (a GPU machine with Ray and pytest)")
def test_demo_on_one_gpu_uses_nccl(tmp_path):
    _, report, _ = _run_demo(tmp_path, "actor_num_gpus_per_node=1", "data_parallel_size=1", "num_rollout=2")
    assert [(l["backend"], l["device"]) for l in report["layouts"]] == [("nccl", "cuda")]
