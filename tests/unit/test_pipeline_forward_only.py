"""Forward-only (log-prob) passes: the pipeline model's forward-only schedules against closed forms, an independent
event simulation, megatron-core's own schedule functions (recorded, and replayed in virtual time), the bound by
brute force; the forward-only pricing; the pipeline search on it; and ``bench.log_probs --quick``."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from slime_ext.schedule import BatchConfig, CostModel, CostProfile, ParallelConfig, PlannerConfig, ScheduleError
from slime_ext.schedule.invariants import check_schedule, replica_makespans
from slime_ext.schedule.pipeline_model import (PipelineSpec, bubble_fraction, pipeline_lower_bound, pipeline_makespan,
                                               pipeline_timeline, stage_programs)
from slime_ext.schedule.pipeline_pricing import pipeline_pricing
from tests.unit.test_pipeline_model import (LAYOUTS, event_simulation, megatron_programs, normalise, random_costs,
                                            random_spec, random_stage_costs)


def forward_only(spec: PipelineSpec) -> PipelineSpec:
    return dataclasses.replace(spec, forward_only=True)


# ---------------------------------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 5, 9])
def test_equal_costs_give_the_closed_form_without_vpp(pp, m):
    """Every stage ``f`` per micro-batch, no p2p cost: the last micro-batch leaves the last stage after
    ``(m + pp - 1) f``; no backward is run, whatever ``bwd`` says."""
    spec = PipelineSpec(pp, forward_only=True)
    assert pipeline_makespan(np.full(m, 2.0), None, spec) == pytest.approx((m + pp - 1) * 2.0)
    assert pipeline_makespan(np.full(m, 2.0), np.full(m, 7.0), spec) == pytest.approx((m + pp - 1) * 2.0)
    assert bubble_fraction(np.full(m, 2.0), None, spec) == pytest.approx(1 - m / (m + pp - 1))


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 2), (2, 2, 6), (4, 2, 8), (4, 2, 12), (3, 3, 6)])
def test_equal_costs_interleaved_give_the_closed_form(pp, vpp, m):
    """Under VPP with groups of ``pp``: ``m vpp`` chunk-forwards of ``f / vpp`` per rank, one fill of ``pp - 1``."""
    spec = PipelineSpec(pp, vpp, forward_only=True)
    assert pipeline_makespan(np.ones(m), None, spec) == pytest.approx((m * vpp + pp - 1) / vpp)


def test_forward_only_runs_forwards_only_and_a_training_pass_needs_backward_costs():
    spec = PipelineSpec(4, forward_only=True)
    timeline = pipeline_timeline(np.ones(3), None, spec)
    assert [[op[:3] for op in stage] for stage in timeline] == [[("F", i, 0) for i in range(3)]] * 4
    with pytest.raises(ScheduleError, match="bwd is None on a training pass"):
        pipeline_makespan(np.ones(3), None, PipelineSpec(4))
    with pytest.raises(ScheduleError, match="forward_only must be a bool"):
        PipelineSpec(4, forward_only="yes")


# ---------------------------------------------------------------------------------------------------- references
def test_model_equals_the_event_simulation_on_random_cases():
    """The vectorised model and an independent event simulation of the same programs agree on forward-only passes
    (every layout, p2p mode and per-stage cost form drawn)."""
    rng = np.random.default_rng(35)
    seen = set()
    for i in range(200):
        spec, m = random_spec(rng)
        spec = forward_only(spec)
        seen.add((spec.pp_size > 1, spec.vpp_size > 1))
        if i % 2:
            f, _ = random_stage_costs(rng, spec, m, per_virtual=bool(i % 4 == 1))
            model = pipeline_makespan(f[None], None, spec)
        else:
            f, _ = random_costs(rng, m)
            model = pipeline_makespan(f, None, spec)
        ref, _ = event_simulation(stage_programs(spec, m), f, np.zeros_like(f), spec.p2p_s, spec.chunks)
        assert model == pytest.approx(ref, rel=1e-12), (spec, m)
    assert {(True, False), (True, True), (False, False)} <= seen


@pytest.mark.parametrize("pp, vpp, group, m, overlap",
                         [lay + (False,) for lay in LAYOUTS] + [lay + (True,) for lay in LAYOUTS if lay[1] > 1])
def test_forward_only_programs_are_megatron_cores(pp, vpp, group, m, overlap):
    """Our forward-only programs are what megatron-core's schedule functions issue with ``forward_only=True``:
    the same forwards and the same p2p calls (which transfers each combines, whether it blocks) in the same order."""
    theirs = megatron_programs(pp, vpp, group, m, overlap, forward_only=True)
    ours = normalise(stage_programs(PipelineSpec(pp, vpp, group, overlap_p2p_comm=overlap, forward_only=True), m), pp)
    assert all(op[0] != "C" or op[1] == "F" for rank in theirs for op in rank)
    for rank, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, f"rank {rank}"


def test_model_equals_megatron_cores_forward_only_schedule_replayed():
    """megatron-core's own forward-only schedule functions, replayed in virtual time with injected durations and
    blocking sends, against the model over ``bench.schedule_replay``'s grid (pp 2 and 4, vpp 1 and 2, several
    counts; random costs every stage alike, per stage and per virtual stage; p2p 0 and > 0; both p2p modes under
    VPP): the figure the docs quote."""
    pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from bench.schedule_replay import GRID, grid_errors
    errors = grid_errors(seed=6)
    assert len(errors) == 3 * len(GRID) and {layout[:2] for layout in GRID} == {(2, 1), (2, 2), (4, 1), (4, 2)}
    assert max(error for _, error in errors) < 1e-9


def test_training_model_equals_the_replay_too():
    """The replay harness itself, on training passes (a model checked independently above and in
    test_pipeline_model.py): a harness that mis-timed megatron-core's calls would fail here."""
    pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from bench.schedule_replay import replay_makespan
    rng = np.random.default_rng(7)
    for pp, vpp, m, overlap in [(2, 1, 5, False), (4, 1, 9, False), (2, 2, 4, False), (4, 2, 8, True)]:
        spec = PipelineSpec(pp, vpp, p2p_s=0.05, overlap_p2p_comm=overlap)
        f, b = random_costs(rng, m)
        assert replay_makespan(f, b, spec) == pytest.approx(pipeline_makespan(f, b, spec), rel=1e-9)


def test_the_order_matters_when_sends_block_and_the_model_sees_it():
    """The notes' case (P 4, 8 micro-batches of costs 2..9): largest first and smallest in the middle runs ~20%
    longer than ascending when every send waits for its receiver (megatron-core on GPU); with sends completed in the
    background (this repo's CPU transport) the order does not matter without VPP. The model follows the first."""
    pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from bench.schedule_replay import replay_makespan
    rising, valley = np.arange(2.0, 10.0), np.array([9.0, 7, 5, 3, 2, 4, 6, 8])
    spec = PipelineSpec(4, forward_only=True)
    blocking = [replay_makespan(order, None, spec) for order in (rising, valley)]
    buffered = [replay_makespan(order, None, spec, sends_block=False) for order in (rising, valley)]
    model = [pipeline_makespan(order, None, spec) for order in (rising, valley)]
    assert blocking[1] > 1.15 * blocking[0]
    assert buffered[1] == pytest.approx(buffered[0]) == pytest.approx(rising.sum() + 3 * rising.max())
    assert model == pytest.approx(blocking)


# ---------------------------------------------------------------------------------------------------- the bound
@pytest.mark.parametrize("seed", range(12))
def test_lower_bound_never_exceeds_the_best_order_brute_force(seed):
    rng = np.random.default_rng(400 + seed)
    pp = int(rng.integers(2, 5))
    vpp = int(rng.integers(1, 3))
    m = int(rng.integers(pp, 7)) if vpp > 1 else int(rng.integers(1, 7))
    if vpp > 1 and 0 < m % pp < pp:
        m = pp
    spec = PipelineSpec(pp, vpp, p2p_s=float(rng.choice([0.0, 0.2])), forward_only=True)
    f = rng.lognormal(0, 0.7, m)
    if seed % 2:
        f = f * rng.uniform(0.5, 2.0, pp)[:, None]  # uneven stages, (pp, M)
        orders = [f[:, list(p)] for p in itertools.permutations(range(m))]
        best = min(pipeline_makespan(o[None], None, spec)[0] for o in orders)
        bound = pipeline_lower_bound(f[None], None, spec)[0]
    else:
        orders = np.asarray([f[list(p)] for p in itertools.permutations(range(m))])
        best = float(pipeline_makespan(orders, None, spec).min())
        bound = pipeline_lower_bound(f, None, spec)
    assert bound <= best * (1 + 1e-12)
    trip = pp * f.max() if f.ndim == 1 else f.sum(axis=0).max()  # the largest micro-batch through every stage
    assert bound >= trip + (pp * vpp - 1) * spec.p2p_s * (1 - 1e-12)  # not vacuous


def test_lower_bound_forward_only_has_one_transfer_per_boundary():
    """Equal costs without VPP: the model meets the bound, ``(m + pp - 1) f + (pp - 1) c`` at ``m = 1``."""
    spec = PipelineSpec(4, p2p_s=0.5, forward_only=True)
    assert pipeline_lower_bound(np.ones(1), None, spec) == pytest.approx(4 + 3 * 0.5)
    assert pipeline_makespan(np.ones(1), None, spec) == pytest.approx(4 + 3 * 0.5)


# ---------------------------------------------------------------------------------------------------- the pricing
PROFILE = CostProfile(step_overhead_s=0.05, microbatch_overhead_s=0.004, per_token_s=2e-6,
                      per_sample_quadratic_s=1e-10, backward_forward_ratio=2.5, p2p_s=0.002)


def test_pricing_forward_only_is_the_forward_part_and_no_backward():
    parallel = ParallelConfig(dp_size=2, pp_size=4)
    costs = np.array([[1.0, 3.0, 2.0]])
    for model, cap in ((PROFILE, 8192), (CostModel(hidden_size=64, num_layers=4, num_attention_heads=4), 4096),
                       (None, 4096)):
        train = pipeline_pricing(parallel, model, cap)
        fwd = pipeline_pricing(parallel, model, cap, forward_only=True)
        assert fwd.spec == dataclasses.replace(train.spec, forward_only=True)
        f_train, _ = train.stage_costs(costs)
        f, b = fwd.stage_costs(costs)
        np.testing.assert_allclose(f, f_train)  # the same forwards ...
        assert not b.any()  # ... and no backward
        expected = pipeline_makespan(f, None, PipelineSpec(4, p2p_s=train.spec.p2p_s, forward_only=True))
        np.testing.assert_allclose(fwd.makespans(costs), expected, rtol=1e-12)
        assert (fwd.makespans(costs) < train.makespans(costs)).all()
    # a profile's forward is 1 / (1 + ratio) of its seconds, split over the stages
    profile_f, _ = pipeline_pricing(parallel, PROFILE, None, forward_only=True).stage_costs(costs)
    np.testing.assert_allclose(profile_f, costs / 3.5 / 4)
    assert pipeline_pricing(ParallelConfig(dp_size=2), PROFILE, 8192, forward_only=True) is None
    with pytest.raises(ScheduleError, match="forward_only"):
        pipeline_pricing(parallel, PROFILE, 8192, forward_only=1)


def test_default_pricing_is_the_training_pricing():
    parallel = ParallelConfig(dp_size=2, pp_size=4, vpp_size=2)
    assert pipeline_pricing(parallel, PROFILE, 8192) == pipeline_pricing(parallel, PROFILE, 8192, forward_only=False)
    assert not pipeline_pricing(parallel, PROFILE, 8192).spec.forward_only


# ---------------------------------------------------------------------------------------------------- the search
def _cases():
    rng = np.random.default_rng(77)
    models = (None, CostModel(hidden_size=256, num_layers=8, num_attention_heads=8, vocab_size=1000), PROFILE)
    for i in range(8):
        pp = (2, 4)[i % 2]
        vpp = (1, 2)[(i // 2) % 2]
        dp = int(rng.integers(1, 4))
        n = int(rng.integers(8 * pp * dp, 20 * pp * dp))
        lengths = 1 + np.minimum(rng.lognormal(6.5, 1.0, n), 6000).astype(int)
        yield (ParallelConfig(dp_size=dp, pp_size=pp, vpp_size=vpp,
                              microbatch_group_size_per_vp_stage=pp if vpp > 1 else None),
               lengths, models[i % 3], int(rng.choice([4096, 8192])))


@pytest.mark.parametrize("candidates", [("unaware",), ("unaware", "ordered"), ("unaware", "shaped"),
                                        ("unaware", "refined"), None])
def test_every_candidate_plans_forward_only(candidates):
    """The pipeline search on forward-only prices (backward zero), each candidate generator alone and all
    together: valid schedules, whose recorded prediction is the forward-only model's re-priced from the documented
    rule (not by the planner's pricing), never slower than the pp-unaware plan the search starts from."""
    from bench.log_probs import plan_log_probs
    config = PlannerConfig() if candidates is None else PlannerConfig(candidates=candidates)
    for parallel, lengths, model, cap in _cases():
        batch = BatchConfig(global_batch_size=len(lengths), use_dynamic_batch_size=True, max_tokens_per_gpu=cap,
                            balance_data=True)
        sched = plan_log_probs(lengths, parallel, batch, config, cost_model=model)
        assert sched.forward_only and check_schedule(sched) == []  # re-priced for the pass it records
        spans = replica_makespans(sched, 0, forward_only=True)[0]
        assert np.isfinite(spans).all() and (spans > 0).all()
        assert sched.stats[0].predicted_makespan == pytest.approx(float(spans.max()), rel=1e-9)
        unaware = plan_log_probs(lengths, parallel, batch, PlannerConfig(candidates=("unaware",)), cost_model=model)
        assert spans.max() <= replica_makespans(unaware, 0, forward_only=True)[0].max() * (1 + 1e-9)


# ---------------------------------------------------------------------------------------------------- the bench
def test_bench_log_probs_quick_prints_a_passing_table(capsys):
    from bench import log_probs
    assert log_probs.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("rl ")]
    assert len(rows) == len(log_probs.PP_SIZES) * len(log_probs.CAP_FACTORS)
    for row in rows:
        assert float(row[6]) <= 1.0 + log_probs.TOLERANCE + 5e-4  # printed with 3 decimals
        assert row[-1] == "ok"
    assert "geometric mean of forward-only / reused over 6 cases" in out
    assert out.rstrip().endswith("PASS (6 cases)")


def test_bench_log_probs_never_passes_over_zero_cases():
    from bench import log_probs
    with pytest.raises(ValueError, match="no cases"):
        log_probs.print_table([], None)
