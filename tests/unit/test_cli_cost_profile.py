"""``slime-ext plan --cost-profile`` (and a config's ``cost_profile`` key) and ``slime-ext calibrate``'s input checks.

The profile files here are synthetic (:class:`CostProfile` written by hand); the real calibration is timed in
``tests/e2e/test_calibrate.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_cli import parse_table, run_main

from slime_ext.schedule import BatchConfig, DPSchedule, ParallelConfig, plan_schedule
from slime_ext.schedule.profile import CostProfile

PROFILE = CostProfile(step_overhead_s=0.01, microbatch_overhead_s=0.004, per_token_s=2e-5, per_sample_quadratic_s=3e-9,
                      packed_quadratic_s=0.0, meta={"device": "synthetic"})


@pytest.fixture()
def lengths_file(tmp_path):
    rng = np.random.default_rng(3)
    lengths = (rng.integers(50, 600, 96) + np.minimum(300 * rng.pareto(1.2, 96), 12000)).astype(np.int64)
    path = tmp_path / "lengths.npy"
    np.save(path, lengths)
    return path, lengths


def test_plan_with_cost_profile_balances_by_the_profile(lengths_file, tmp_path):
    path, lengths = lengths_file
    prof = tmp_path / "profile.json"
    PROFILE.save(str(prof))
    out_json = tmp_path / "sched.json"
    res = run_main("plan", path, "--dp-size", 4, "--use-dynamic-batch-size", "--max-tokens-per-gpu", 8192,
                   "--global-batch-size", 96, "--balance-data", "--cost-profile", prof, "--json", out_json)
    assert "measured profile" in res.stdout and "synthetic" in res.stdout
    saved = DPSchedule.from_dict(json.loads(out_json.read_text()))
    assert isinstance(saved.cost_model, CostProfile) and saved.cost_model == PROFILE
    expected = plan_schedule(lengths, ParallelConfig(dp_size=4),
                             BatchConfig(global_batch_size=96, use_dynamic_batch_size=True, max_tokens_per_gpu=8192,
                                         balance_data=True), rollout_ids=None, cost_model=PROFILE)
    assert saved.partitions == expected.partitions
    assert saved.micro_batch_indices == expected.micro_batch_indices
    rows, total = parse_table(res.stdout)
    assert len(rows) == 1


def test_cost_profile_from_a_config_key(lengths_file, tmp_path):
    path, _ = lengths_file
    prof = tmp_path / "profile.json"
    PROFILE.save(str(prof))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"dp_size: 2\nuse_dynamic_batch_size: true\nmax_tokens_per_gpu: 8192\nglobal_batch_size: 96\n"
                   f"cost_profile: {prof}\n")
    res = run_main("plan", path, "--config", cfg)
    assert "measured profile" in res.stdout


def test_bad_profile_files_are_clear_errors(lengths_file, tmp_path):
    path, _ = lengths_file
    flags = ["--dp-size", 2, "--use-dynamic-batch-size", "--max-tokens-per-gpu", 8192, "--global-batch-size", 96]
    res = run_main("plan", path, *flags, "--cost-profile", tmp_path / "missing.json", expect=2)
    assert "cannot be read" in res.stderr and "slime-ext calibrate" in res.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**PROFILE.to_dict(), "per_token_s": -1}))
    res = run_main("plan", path, *flags, "--cost-profile", bad, expect=2)
    assert "CostProfile.per_token_s = -1" in res.stderr
    cfg = tmp_path / "run.yaml"
    cfg.write_text("cost_profile: 3\n")
    res = run_main("plan", path, *flags, "--config", cfg, expect=2)
    assert "cost_profile" in res.stderr and "a file path" in res.stderr


def test_calibrate_rejects_bad_flags(tmp_path):
    cfg = tmp_path / "train.yaml"
    cfg.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n")
    res = run_main("calibrate", "--config", cfg, "--max-tokens", 64, "--out", tmp_path / "p.json", expect=2)
    assert "--max-tokens 64 must be at least" in res.stderr
    res = run_main("calibrate", "--config", cfg, "--max-tokens", 512, "--repeats", 0, "--out", tmp_path / "p.json",
                   expect=2)
    assert "--repeats 0" in res.stderr
