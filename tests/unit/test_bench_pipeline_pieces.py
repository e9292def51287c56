"""The pure pieces of ``bench/pipeline.py`` (issue 15): the p2p fit, the repeat rule, the reordered payload of the
real-compute run, and the slowest-replica choice. The replay itself runs in ``tests/e2e/test_bench_pipeline.py``."""

from __future__ import annotations

import numpy as np
import pytest

from bench.pipeline import Layout, Setup, bench_profile, fit_p2p, plan_rows, spec_for
from bench.pipeline_replay import settled
from bench.workloads import REPLAY_WORKLOADS, Workload
from slime_ext.schedule.pipeline_model import PipelineSpec, pipeline_makespan


@pytest.mark.parametrize("pp, vpp, overlap", [(2, 1, False), (4, 1, False), (2, 2, True), (2, 2, False)])
def test_fit_p2p_recovers_the_p2p_cost_of_a_measurement(pp, vpp, overlap):
    rng = np.random.default_rng(pp * 10 + vpp)
    f = rng.uniform(0.02, 0.08, size=2 * pp)
    b = 2 * f

    def spec(p2p):
        return PipelineSpec(pp, vpp, p2p_s=p2p, overlap_p2p_comm=overlap)

    measured = pipeline_makespan(f, b, spec(0.0025)) + 0.01
    assert fit_p2p(f, b, spec, measured, offset=0.01) == pytest.approx(0.0025, abs=1e-7)
    # a measurement the model without p2p cost already reaches: nothing to fit
    assert fit_p2p(f, b, spec, pipeline_makespan(f, b, spec(0.0)) * 0.99) == 0.0


def test_settled_needs_two_agreeing_fast_calls_or_the_limit():
    assert not settled([], 2, 8, 0.005)
    assert not settled([1.0], 1, 8, 0.005)  # one call never agrees with itself
    assert settled([1.0, 1.004], 2, 8, 0.005)
    assert not settled([1.0, 1.2], 2, 8, 0.005)
    assert settled([1.3, 1.0, 1.2, 1.003], 2, 8, 0.005)  # the two fastest agree; slow calls are interference
    assert not settled([1.0, 1.004], 3, 8, 0.005)  # fewer than min_repeats
    assert settled([1.0, 1.2, 1.4], 2, 3, 0.005)  # the limit


def test_rows_replay_each_plans_slowest_replica():
    setup = Setup(Layout(4), False, ("rl-like",))
    rows = plan_rows(setup, {"rl-like": Workload("rl-like", "rl", 96, 5)}, bench_profile(),
                     "skipped: no SLIME_GIT in this test")
    assert [r.plan for r in rows] == ["before", "after", "slime"] and rows[2].skipped
    for row in rows[:2]:
        spans = pipeline_makespan(row.all_fwd, row.all_bwd, spec_for(setup))
        assert row.replica == int(np.argmax(spans)) and row.num_microbatches == row.all_fwd.shape[1]
        np.testing.assert_array_equal(row.fwd, row.all_fwd[row.replica])
    before, after = rows[0], rows[1]
    assert np.all(np.diff(before.fwd) <= 1e-15), "the pp-unaware plan runs its micro-batches heaviest first"
    # the pipeline-aware plan of the same samples is predicted no slower (the planner's promise)
    assert pipeline_makespan(after.fwd, after.bwd, spec_for(setup)) <= \
        pipeline_makespan(before.fwd, before.bwd, spec_for(setup)) * (1 + 1e-12)
    assert set(REPLAY_WORKLOADS) == {"rl-like", "bimodal", "long-tail"}


def test_heaviest_first_reorders_micro_batches_and_keeps_the_samples():
    from bench.pipeline_real import heaviest_first, load_profile
    from slime_ext.schedule import BatchConfig, ParallelConfig, SampleBatch, plan_schedule

    rng = np.random.default_rng(3)
    lengths = rng.integers(20, 400, size=24).tolist()
    batch = SampleBatch(tokens=[[1] * n for n in lengths], total_lengths=lengths,
                        response_lengths=[n // 2 for n in lengths], loss_masks=[[1] * (n // 2) for n in lengths],
                        rewards=[0.0] * 24, advantages=[1.0] * 24, rollout_ids=list(range(24)))
    profile = load_profile()
    sched = plan_schedule(lengths, ParallelConfig(dp_size=1, pp_size=2),
                          BatchConfig(global_batch_size=24, use_dynamic_batch_size=True, max_tokens_per_gpu=512),
                          rollout_ids=list(range(24)), cost_model=profile)
    payload = sched.rank_payload(0, batch)
    out = heaviest_first(payload, profile)

    def groups(p):
        return [[p.partition[i] for i in mb] for mb in p.micro_batch_indices]

    assert sorted(map(sorted, groups(out))) == sorted(map(sorted, groups(payload)))
    times = [profile.microbatch_time([lengths[g] for g in mb]) for mb in groups(out)]
    assert times == sorted(times, reverse=True)
    assert [out.samples.total_lengths[k] for k in range(len(out.partition))] == [lengths[g] for g in out.partition]


def test_replay_runs_take_per_stage_and_per_virtual_stage_costs():
    from bench.pipeline_replay import Layout, ReplayRun

    even = ReplayRun("even", [1.0, 2.0], [2.0, 4.0])
    assert even.chunk_times(1, 1, Layout(2, 2)) == ([0.5, 1.0], [1.0, 2.0])  # each chunk 1 / vpp of the stage
    assert not even.per_stage and even.num_microbatches == 2
    stages = ReplayRun("stages", [[1.0, 2.0], [3.0, 4.0]], [[2.0, 4.0], [6.0, 8.0]])
    assert stages.per_stage and stages.num_microbatches == 2
    assert stages.chunk_times(1, 0, Layout(2)) == ([3.0, 4.0], [6.0, 8.0])
    assert stages.chunk_times(1, 1, Layout(2, 2)) == ([1.5, 2.0], [3.0, 4.0])
    rows = [[1.0, 1.5], [2.0, 2.5], [3.0, 3.5], [4.0, 4.5]]
    virtual = ReplayRun("virtual", rows, rows)
    assert virtual.chunk_times(0, 1, Layout(2, 2)) == ([3.0, 3.5], [3.0, 3.5])  # chunk 1 of rank 0: stage 2
    f, b = virtual.model_costs()
    assert f.shape == (1, 4, 2) and pipeline_makespan(f, b, PipelineSpec(2, 2)).shape == (1,)
    with pytest.raises(ValueError, match="4 rows of costs, but the layout has 3 stages x 2 chunks"):
        virtual.chunk_times(0, 0, Layout(3, 2))
    with pytest.raises(ValueError, match="one row per stage"):
        ReplayRun("bad", [[1.0, 2.0]], [[1.0]])


def test_uneven_stage_cases_scale_every_sleep_above_the_floor():
    from bench.pipeline_replay import Layout
    from bench.pipeline_stages import build_runs, cases_for, qwen3_weights

    setup = Setup(Layout(4), False, ("rl-like",))
    f = np.array([0.5, 1.0, 2.0])
    cases = cases_for(setup.layout, quick=False)
    scale = build_runs(setup, cases, f, 2 * f, min_op_s=0.02, max_run_s=100.0)
    lightest = min(c.weights.min() for c in cases)
    assert scale == pytest.approx(0.02 / (0.5 * lightest))  # the lightest stage's smallest forward sleeps 20 ms
    for c in cases:
        fw, bw = c.run.model_costs()
        assert fw.shape == (1, 4, 3) and fw.min() >= 0.02 - 1e-12
        np.testing.assert_allclose(fw[0], c.weights[:, None] * f[None] * scale)
    w = qwen3_weights(setup.layout)  # Qwen3-8B-like: the output layer makes the last stage heavier
    assert w.mean() == pytest.approx(1.0) and w[-1] > 1.3 * w[0] and np.ptp(w[:3]) == 0


def test_order_for_stages_is_a_permutation_the_model_prices_no_slower():
    from bench.pipeline_stages import order_for_stages

    rng = np.random.default_rng(11)
    gains = 0
    for weights in ([1.3, 1, 1, 1], [1, 1, 1, 1.6], [1.3, 1, 1, 1.5]):
        w = np.array(weights)
        f = np.sort(rng.lognormal(0, 0.6, 9))[::-1]  # heaviest first, as a pp-unaware plan runs them
        fw, bw = w[:, None] * f[None], 2 * w[:, None] * f[None]
        order = order_for_stages(fw, bw, PipelineSpec(4))
        assert sorted(order) == list(range(9))
        before = pipeline_makespan(fw[None], bw[None], PipelineSpec(4))[0]
        after = pipeline_makespan(fw[None][:, :, order], bw[None][:, :, order], PipelineSpec(4))[0]
        assert after <= before * (1 + 1e-12)
        gains += after < before * (1 - 1e-3)
        # a local optimum: no single swap improves it further
        for i in range(9):
            for j in range(i + 1, 9):
                o = order.copy()
                o[i], o[j] = o[j], o[i]
                assert pipeline_makespan(fw[None][:, :, o], bw[None][:, :, o], PipelineSpec(4))[0] >= \
                    after * (1 - 1e-9)
    assert gains  # heaviest first is not the best order for these stages
