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


def test_calibrate_takes_the_pipeline_layout_flags(tmp_path):
    """Checked before any timing, against the config's num_layers as Megatron checks them; a profile records each
    stage's share of its cost (meta.stages)."""
    import argparse

    from slime_ext.cli.calibrate import add_parser, pipeline_layout, stage_meta

    cfg = tmp_path / "train.yaml"
    cfg.write_text("num_layers: 8\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 1000\n")
    base = ["calibrate", "--config", cfg, "--max-tokens", 512, "--out", tmp_path / "p.json"]
    res = run_main(*base, "--pipeline-model-parallel-size", 4, "--decoder-first-pipeline-num-layers", 3, expect=2)
    assert "leave 5 layers for 3 middle ranks" in res.stderr and "num_layers = 8" in res.stderr
    res = run_main(*base, "--decoder-last-pipeline-num-layers", 2, expect=2)
    assert "--decoder-last-pipeline-num-layers needs --pipeline-model-parallel-size" in res.stderr
    res = run_main(*base, "--pipeline-model-parallel-size", 4, "--pipeline-model-parallel-layout", "Et|tt|tt|tL",
                   "--account-for-loss-in-pipeline-split", expect=2)
    assert "cannot be combined" in res.stderr
    assert not (tmp_path / "p.json").exists()

    sub = argparse.ArgumentParser().add_subparsers()
    parser = add_parser(sub)
    args = parser.parse_args(["--config", "x", "--max-tokens", "512", "--out", "p.json",
                              "--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout",
                              "Et|ttt|ttt|tL"])
    parallel = pipeline_layout(args, 8)
    assert parallel.stage_layers(8).decoder == (1, 3, 3, 1)
    import dataclasses

    profile = dataclasses.replace(PROFILE, meta={"model": {"num_layers": 8, "hidden_size": 64,
                                                           "num_attention_heads": 4, "vocab_size": 1000}})
    meta = stage_meta(profile, parallel)
    assert meta["pipeline_model_parallel_layout"] == "Et|ttt|ttt|tL" and meta["pp_size"] == 4
    assert sum(meta["linear_share"]) == pytest.approx(1.0, abs=1e-5)
    assert meta["quadratic_share"] == pytest.approx([1 / 8, 3 / 8, 3 / 8, 1 / 8], abs=1e-6)
    assert meta["linear_share"][3] > meta["linear_share"][0]  # the output layer
    assert pipeline_layout(parser.parse_args(["--config", "x", "--max-tokens", "512", "--out", "p.json"]), 8) is None
