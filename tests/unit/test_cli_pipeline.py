"""``slime-ext plan`` with pipeline parallelism: the per-step predicted makespan and bubble, the makespan-based step
time, every scheme's predicted makespan beside ours, and ``--plot-pipeline``."""

from __future__ import annotations

import re

import numpy as np
import pytest

from slime_ext.schedule import BatchConfig, CostModel, ParallelConfig, plan_schedule
from slime_ext.schedule.invariants import replica_makespans
from slime_ext.schedule.pipeline_pricing import pipeline_pricing

from test_cli import MODEL_FLAGS, parse_compare_table, parse_table, run_main

SPEC = "lognormal:n=256,mu=7.5,sigma=1.0,prompt=100-1500,cap=16000,seed=3"
FLAGS = ["--synthetic", SPEC, "--dp-size", "2", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
         "--global-batch-size", "64", "--balance-data", "--no-legend", "-q", *MODEL_FLAGS]


def test_pipelined_plan_prints_each_steps_predicted_makespan_and_bubble():
    out = run_main("plan", *FLAGS, "--pipeline-model-parallel-size", "4").stdout
    assert "pp_size=4" in out and "makespan" in out and "bubble" in out
    assert "no pipeline bubble" not in out  # the time estimate is the pipeline's makespan
    rows, total = parse_table(out)
    assert rows, out
    # the same plan, made here: the printed makespan is the schedule's own prediction, the bubble in (0, 100%)
    from slime_ext.cli.inputs import load_samples
    lengths = load_samples(None, SPEC, progress=False).total_lengths
    model = CostModel(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=1024,
                      vocab_size=32000)
    schedule = plan_schedule(lengths, ParallelConfig(dp_size=2, pp_size=4),
                             BatchConfig(global_batch_size=64, use_dynamic_batch_size=True, max_tokens_per_gpu=16384,
                                         balance_data=True), cost_model=model)
    assert len(rows) == schedule.num_steps
    for row, stats in zip(rows, schedule.stats):
        assert float(row["makespan_FLOPs"]) == pytest.approx(stats.predicted_makespan, rel=5e-3)
        bubble = float(row["bubble"].rstrip("%")) / 100
        assert 0 < bubble < 1 and bubble == pytest.approx(stats.bubble_fraction, abs=1e-3)
        # the recorded makespan is the slowest replica's, as the invariant checker re-prices the planned order
        assert stats.predicted_makespan == pytest.approx(float(replica_makespans(schedule, stats.step)[0].max()),
                                                         rel=1e-9)


def test_without_pipeline_the_table_has_no_pipeline_columns():
    out = run_main("plan", *FLAGS).stdout
    assert "makespan" not in out and "no pipeline bubble" in out


def test_compare_prices_every_scheme_by_its_pipeline_makespan():
    """Under pp the --compare table's times and the verdict's ratio are pipeline makespans, ours' equal to the main
    table's: one step time per step, one ratio."""
    out = run_main("plan", *FLAGS, "--pipeline-model-parallel-size", "4", "--compare", "legacy,reference").stdout
    rows, total = parse_table(out)
    compare = parse_compare_table(out)
    for row in [*rows, total]:
        assert compare[row["step"], "ours"]["makespan_FLOPs"] == row["makespan_FLOPs"]
        assert compare[row["step"], "ours"]["time_s"] == row["time_s"]
    ours, legacy = (float(compare["all", s]["makespan_FLOPs"]) for s in ("ours", "legacy"))
    assert ours <= legacy  # ours is planned for this pipeline, legacy is not
    ratio = float(re.search(r"^legacy: .*est. step time x([0-9.]+) of ours", out, re.M)[1])
    assert ratio == pytest.approx(legacy / ours, rel=1e-2)
    assert "pipeline: predicted makespan" not in out  # no second figure for the same thing


def test_plot_pipeline_draws_ours_and_each_compared_scheme(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "pipe.png"
    out = run_main("plan", *FLAGS, "--pipeline-model-parallel-size", "4", "--compare", "legacy",
                   "--plot-pipeline", png, "--plot-steps", "1").stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    drawn = [l for l in out.splitlines() if ": step 1, slowest replica" in l]
    assert [l.split(":")[0] for l in drawn] == ["ours", "legacy"], out


def test_plot_pipeline_needs_a_pipeline(tmp_path):
    err = run_main("plan", *FLAGS, "--plot-pipeline", tmp_path / "p.png", expect=2).stderr
    assert "--pipeline-model-parallel-size" in err and not (tmp_path / "p.png").exists()


def test_pipeline_timeline_of_the_plot_matches_the_recorded_makespan():
    """The picture is the model's own timeline: its last box ends at the step's recorded makespan."""
    from slime_ext.schedule.pipeline_model import pipeline_timeline
    from slime_ext.schedule.pipeline_pricing import step_microbatch_costs

    rng = np.random.default_rng(0)
    lengths = rng.integers(200, 9000, size=96)
    schedule = plan_schedule(lengths, ParallelConfig(dp_size=2, pp_size=4),
                             BatchConfig(global_batch_size=48, use_dynamic_batch_size=True, max_tokens_per_gpu=16384))
    pricing = pipeline_pricing(schedule.parallel, schedule.cost_model, schedule.cap)
    for s, stats in enumerate(schedule.stats):
        costs = step_microbatch_costs(schedule, s)
        rank = int(np.argmax(pricing.makespans(costs)))
        f, b = pricing.stage_costs(costs[rank])
        end = max(op[4] for stage in pipeline_timeline(f, b, pricing.spec) for op in stage)
        assert end == pytest.approx(stats.predicted_makespan)
