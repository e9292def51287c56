"""``slime-ext calibrate`` on a real (tiny) megatron-core model, and ``ci/gpu_all``'s CPU dry run and refusal.

Real processes, real training steps: the calibration times steps through ``TrainWorker.train_rollout`` and fits a
profile; the dry run plans DP=8 schedules of every scheme and replays them rank by rank. Nothing here is timed
against a threshold (speed targets live in the benchmarks); the checks are on what the commands produce.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slime_ext.schedule.profile import TERM_NAMES, CostProfile
from slime_ext.training.calibrate import MIN_BACKWARD_FORWARD_RATIO
from slime_ext.schemes import BASELINES

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
       "CUDA_VISIBLE_DEVICES": ""}


def test_calibrate_cli_writes_a_profile_the_planner_takes(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 128\n"
                   "vocab_size: 128\nseq_length: 256\noptimizer: sgd\nlr: 0.01\n")
    out = tmp_path / "profile.json"
    res = subprocess.run([sys.executable, "-m", "slime_ext.cli", "calibrate", "--config", str(cfg), "--max-tokens",
                          "256", "--repeats", "3", "--threads", "1", "--out", str(out)],
                         capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=400)
    assert res.returncode == 0, res.stderr
    assert "fit error: rms" in res.stdout and f"wrote {out}" in res.stdout
    prof = CostProfile.load(str(out))
    assert prof.meta["device"] == "cpu" and prof.meta["timer"] == "thread"
    assert prof.meta["num_points"] >= 7 and prof.meta["model"]["hidden_size"] == 64
    assert all(getattr(prof, t) >= 0 for t in TERM_NAMES)
    # a longer micro-batch is predicted to take longer: the fit priced tokens or attention
    assert prof.microbatch_time([256]) > prof.microbatch_time([32])
    # what the pipeline model reads: a backward/forward ratio that is physical (a backward pass costs at least its
    # forward pass) and fitted, not the default 2, or held at its floor with a warning that names the fix when a
    # busy machine's timings put the fit below it; and a measured two-process send/recv of one capped
    # micro-batch's activation over gloo. (No upper bound: a ratio of measured times has none a loaded machine
    # cannot break; the floor is the physical fact.)
    assert prof.backward_forward_ratio >= MIN_BACKWARD_FORWARD_RATIO and prof.backward_forward_ratio != 2.0
    how = prof.meta["pipeline"]["backward_forward_ratio"]
    if prof.backward_forward_ratio == MIN_BACKWARD_FORWARD_RATIO:
        assert "physical floor" in how and "--repeats" in res.stderr and "idle node" in res.stderr, res.stderr
    else:
        assert how.startswith("fitted on ")
    assert set(prof.meta["repeat_spread"]) == {"training", "forward-only"}
    assert prof.p2p_s > 0 and prof.meta["pipeline"]["p2p_s"].startswith("gloo: 256 x 64 float32")
    assert "pipeline: backward/forward = " in res.stdout
    lengths = tmp_path / "lengths.npy"
    import numpy as np

    np.save(lengths, np.array([30, 200, 120, 60, 250, 40, 90, 100]))
    res = subprocess.run([sys.executable, "-m", "slime_ext.cli", "plan", str(lengths), "--dp-size", "2",
                          "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256", "--global-batch-size", "8",
                          "--balance-data", "--cost-profile", str(out)],
                         capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "measured profile" in res.stdout


def test_gpu_all_dry_run_proves_the_offline_gpu_path_on_cpu(tmp_path):
    """``ci/gpu_all --dry-run``: every step of the offline GPU run but the device. It builds the two-wheel wheelhouse
    (ci/build_wheelhouse), installs it offline into a fresh folder, hides ray, pytest and yaml, then runs the Ray-free
    e2e check (torch.multiprocessing ranks over gloo, fp32 invariance across token caps) and the calibration + replay
    benchmark, both importing slime-ext and megatron-core from the carried wheels."""
    out = tmp_path / "gpu_all"
    res = subprocess.run([str(REPO / "ci" / "gpu_all"), "--dry-run"], capture_output=True, text=True, timeout=900,
                         env={**ENV, "PYTHON": sys.executable, "OUT_DIR": str(out)})
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]
    wheels = sorted(p.name for p in (out / "wheelhouse").iterdir())
    assert len(wheels) == 2 and wheels[0].startswith("megatron_core-") and wheels[1].startswith("slime_ext-"), wheels
    assert sum(p.stat().st_size for p in (out / "wheelhouse").iterdir()) < 64 * 2**20
    assert f"slime-ext from {out / 'site'}" in log  # megatron-core and slime-ext imported from the wheels
    e2e = (out / "gpu_e2e.log").read_text()
    assert re.search(r"^PASS \([1-9][0-9]* cases\): 0 failed check\(s\)$", e2e, re.M) and "FAIL" not in e2e
    for check in ("every rank imported slime-ext from " + str(out / "site"), "Ray was never imported",
                  "cap A and cap B cut different micro-batches", "fp32 parameters after training, cap A vs cap B",
                  "every rank ran gloo on cpu"):
        assert f"ok   {check}" in e2e or any(line.startswith("  ok") and check in line for line in e2e.splitlines()), \
            f"no passed check {check!r} in the e2e log"
    text = (out / "gpu_bench.md").read_text()
    schemes = ["legacy", "reference", "ours:strided", "ours:balance_data", "ours:balance_by_flops"]
    if BASELINES["reference"].missing():  # upstream's own planner: an installed slime or SLIME_GIT, else it says so
        schemes.remove("reference")
        assert "- reference: skipped: upstream slime is not available" in text
    for dist in ("rl", "heavy", "reasoning"):
        for scheme in schemes:
            assert f"| {dist} | {scheme} |" in text, f"no row for {dist} / {scheme}"
    assert "## Cost profile" in text and "## Targets" in text
    assert (out / "gpu_profile.json").exists()
    assert "ci/gpu_all --dry-run: e2e exit 0, bench exit 0" in log


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi: the refusal is "
                                                                     "for machines without a GPU")
@pytest.mark.parametrize("script", ["gpu_all", "gpu_bench", "gpu_e2e"])
def test_gpu_scripts_refuse_without_a_gpu(script):
    res = subprocess.run([str(REPO / "ci" / script)], capture_output=True, text=True, env=ENV, timeout=60)
    assert res.returncode == 2
    assert "no NVIDIA GPU here" in res.stderr
