"""The planner with pipeline parallelism: every invariant holds, the predicted makespan never loses to the
pp-unaware plan of the same step, the stats survive JSON, and pp = 1 plans as before.

Plans are judged by :func:`oracle_makespans` -- the invariant checker's re-pricing from the documented rule through
the public pipeline model -- never by the planner's own :class:`PipelinePricing`, so a pricing bug cannot make a
plan look as good as the planner thinks it is."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from slime_ext.schedule import (BatchConfig, CostModel, CostProfile, DPSchedule, ParallelConfig, ScheduleError,
                                check_schedule, plan_schedule)
from slime_ext.schedule.invariants import replica_makespans
from slime_ext.schedule.pipeline_orders import heuristic_orders
from slime_ext.schedule.pipeline_pricing import pipeline_pricing, predicted_makespans
from slime_ext.schedule.planner_config import PlannerConfig

FLOPS_MICROBATCH_OVERHEAD = PlannerConfig().objective.microbatch_overhead

DIMS = dict(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2, vocab_size=1000, swiglu=True)
PROFILE = CostProfile(step_overhead_s=0.01, microbatch_overhead_s=0.004, per_token_s=2e-5,
                      per_sample_quadratic_s=3e-9, packed_quadratic_s=1e-10, backward_forward_ratio=2.5, p2p_s=0.002)


def oracle_makespans(sched: DPSchedule, step: int, parallel: ParallelConfig | None = None) -> np.ndarray:
    """``(dp,)`` each replica's makespan of ``step`` by the independent oracle (:func:`replica_makespans`), on
    ``parallel``'s pipeline when given (to price a pp-unaware plan on the pipelined layout)."""
    if parallel is not None:
        sched = dataclasses.replace(sched, parallel=parallel)
    return replica_makespans(sched, step)[0]


def oracle_work(sched: DPSchedule, step: int, parallel: ParallelConfig | None = None) -> np.ndarray:
    """``(dp,)`` each replica's forward work of ``step`` summed over stages and micro-batches, by the oracle."""
    if parallel is not None:
        sched = dataclasses.replace(sched, parallel=parallel)
    return replica_makespans(sched, step)[1].sum(axis=(1, 2))


def step_microbatches(sched: DPSchedule, step: int) -> list[list[list[int]]]:
    """Per rank, the global sample ids of each micro-batch of ``step``, in run order: what the plan does."""
    start, m = sum(sched.num_microbatches[:step]), sched.num_microbatches[step]
    return [[sorted(sched.partitions[r][i] for i in mb) for mb in sched.micro_batch_indices[r][start:start + m]]
            for r in range(sched.dp_size)]


def reordered(sched: DPSchedule, rank: int, step: int, order) -> DPSchedule:
    """``sched`` with rank ``rank``'s micro-batches of ``step`` run in ``order`` (positions within the step)."""
    start, m = sum(sched.num_microbatches[:step]), sched.num_microbatches[step]
    mbi = [list(rows) for rows in sched.micro_batch_indices]
    step_mbs = mbi[rank][start:start + m]
    assert sorted(int(i) for i in order) == list(range(m)), order
    mbi[rank][start:start + m] = [step_mbs[int(i)] for i in order]
    return dataclasses.replace(sched, micro_batch_indices=mbi)


def workload(rng: np.random.Generator, n: int) -> np.ndarray:
    kind = rng.integers(3)
    if kind == 0:  # rl-like
        return (rng.integers(100, 1500, n) + np.minimum(rng.lognormal(7.0, 1.0, n), 12000)).astype(int)
    if kind == 1:  # bimodal: 80% short, 20% long
        return np.where(rng.random(n) < 0.8, rng.integers(200, 1200, n), rng.integers(5000, 12000, n))
    return (rng.integers(50, 600, n) + np.minimum(300 * rng.pareto(1.2, n), 20000)).astype(int)  # long tail


def random_case(seed: int):
    rng = np.random.default_rng(seed)
    dp = int(rng.choice([1, 2, 4]))
    pp = int(rng.choice([2, 4]))
    vpp = int(rng.choice([1, 1, 2]))
    group = pp + int(rng.integers(0, 2)) if vpp > 1 else None
    dynamic = bool(rng.random() < 0.75)
    n = int(rng.integers(40, 200))
    lengths = workload(rng, n)
    cost = [None, CostModel(**DIMS), PROFILE][int(rng.integers(3))]
    parallel = ParallelConfig(dp_size=dp, pp_size=pp, vpp_size=vpp, microbatch_group_size_per_vp_stage=group,
                              overlap_p2p_comm=bool(rng.random() < 0.5))
    if dynamic:
        batch = BatchConfig(global_batch_size=int(rng.integers(n // 3, n + 1)), use_dynamic_batch_size=True,
                            max_tokens_per_gpu=int(rng.choice([8192, 16384])), balance_data=bool(rng.random() < 0.7),
                            balance_by_flops=bool(rng.random() < 0.3))
    else:
        mbs = int(rng.integers(1, 4))
        per_step = parallel.align * mbs * int(rng.integers(2, 5))
        batch = BatchConfig(global_batch_size=per_step, micro_batch_size=mbs, balance_data=bool(rng.random() < 0.5))
    return lengths, parallel, batch, cost


@pytest.mark.parametrize("seed", range(32))
def test_pipelined_plans_hold_every_invariant_and_never_predict_slower_than_the_pp_unaware_plan(seed):
    lengths, parallel, batch, cost = random_case(seed)
    sched = plan_schedule(lengths.tolist(), parallel, batch, cost_model=cost)  # every seed plans (refusals: below)
    assert check_schedule(sched) == []
    unaware = plan_schedule(lengths.tolist(), dataclasses.replace(parallel, pp_size=1), batch, cost_model=cost)
    assert unaware.num_steps == sched.num_steps
    pricing = pipeline_pricing(parallel, cost, batch.cap(parallel.cp_size))
    for s, st in enumerate(sched.stats):
        mine = oracle_makespans(sched, s)
        before = float(oracle_makespans(unaware, s, parallel).max())  # pp-unaware bins, ranks and order
        assert st.predicted_makespan <= before * (1 + 1e-9), (s, st.strategy)
        assert st.predicted_makespan == pytest.approx(float(mine.max()), rel=1e-9)
        np.testing.assert_allclose(predicted_makespans(sched, s), mine, rtol=1e-9)
        np.testing.assert_allclose(predicted_makespans(unaware, s, pricing), oracle_makespans(unaware, s, parallel),
                                   rtol=1e-9)
        assert 0.0 <= st.bubble_fraction < 1.0
        assert unaware.stats[s].predicted_makespan is None and unaware.stats[s].bubble_fraction is None
        if step_microbatches(sched, s) == step_microbatches(unaware, s):  # the pp-unaware plan, as emitted
            assert st.predicted_makespan == pytest.approx(before, rel=1e-9)


@pytest.mark.parametrize("lengths, parallel, batch", [
    # fewer samples than DP ranks: every rank needs a micro-batch
    ([500, 700], ParallelConfig(dp_size=4, pp_size=2), BatchConfig(global_batch_size=2, use_dynamic_batch_size=True,
                                                                    max_tokens_per_gpu=8192)),
    # static micro-batches that cannot make a count aligned to dp
    ([300] * 6, ParallelConfig(dp_size=4, pp_size=4), BatchConfig(global_batch_size=6, micro_batch_size=1)),
    # a sample over the cap in a step that needs more micro-batches than it has samples
    ([9000, 9000, 9000], ParallelConfig(dp_size=2, pp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2),
     BatchConfig(global_batch_size=3, use_dynamic_batch_size=True, max_tokens_per_gpu=4096)),
])
def test_a_pipelined_refusal_is_the_pp_unaware_refusal(lengths, parallel, batch):
    """The pipeline search never refuses what the pp-unaware planner plans, nor refuses differently."""
    with pytest.raises(ScheduleError) as flat:
        plan_schedule(lengths, dataclasses.replace(parallel, pp_size=1), batch, cost_model=CostModel(**DIMS))
    with pytest.raises(ScheduleError) as piped:
        plan_schedule(lengths, parallel, batch, cost_model=CostModel(**DIMS))
    assert str(piped.value) == str(flat.value)


def test_stats_survive_the_json_round_trip_and_a_wrong_prediction_is_caught():
    lengths, parallel, batch, _ = random_case(3)
    parallel = ParallelConfig(dp_size=2, pp_size=4)
    batch = BatchConfig(global_batch_size=60, use_dynamic_batch_size=True, max_tokens_per_gpu=8192,
                        balance_data=True)
    sched = plan_schedule(lengths.tolist(), parallel, batch, cost_model=PROFILE)
    back = DPSchedule.from_dict(json.loads(json.dumps(sched.to_dict())))
    assert back == sched and back.stats[0].predicted_makespan == sched.stats[0].predicted_makespan
    assert back.parallel.pp_size == 4 and back.cost_model.p2p_s == PROFILE.p2p_s
    assert check_schedule(back) == []
    wrong = dataclasses.replace(sched, stats=[dataclasses.replace(sched.stats[0], predicted_makespan=1.0)]
                                + sched.stats[1:])
    assert any("predicted_makespan" in p for p in check_schedule(wrong))
    d = sched.to_dict()
    d["stats"][0]["bubble_fraction"] = "0.3"
    with pytest.raises(ScheduleError, match=r"stats\[0\].bubble_fraction"):
        DPSchedule.from_dict(d)
    # with pp = 1 the fields are None, and a schedule saved before they existed still loads
    flat = plan_schedule(lengths.tolist(), ParallelConfig(dp_size=2), batch)
    d = flat.to_dict()
    for st in d["stats"]:
        del st["predicted_makespan"], st["bubble_fraction"]
    del d["parallel"]["pp_size"], d["parallel"]["overlap_p2p_comm"]
    assert DPSchedule.from_dict(d) == flat and check_schedule(DPSchedule.from_dict(d)) == []
    claims = dataclasses.replace(flat, stats=[dataclasses.replace(flat.stats[0], bubble_fraction=0.1)]
                                 + flat.stats[1:])
    assert any("pp_size = 1" in p for p in check_schedule(claims))


def test_pp1_plans_exactly_as_before():
    rng = np.random.default_rng(5)
    lengths = workload(rng, 300)
    batch = BatchConfig(global_batch_size=100, use_dynamic_batch_size=True, max_tokens_per_gpu=8192,
                        balance_data=True)
    a = plan_schedule(lengths.tolist(), ParallelConfig(dp_size=4), batch, cost_model=CostModel(**DIMS))
    b = plan_schedule(lengths.tolist(), ParallelConfig.from_megatron(4, pipeline_model_parallel_size=1), batch,
                      cost_model=CostModel(**DIMS))
    assert a == b and all(st.predicted_makespan is None for st in a.stats)
    # (bench.plan_digest --check covers 424 pinned cases the same way)


def test_order_is_chosen_by_the_model_not_heaviest_first():
    """1F1B with costs of very different size: the plan does not run heaviest first where the model says another
    order is faster."""
    lengths = [9000, 7000, 5000, 3000, 1500, 800, 400, 200]
    parallel = ParallelConfig(dp_size=1, pp_size=4)
    batch = BatchConfig(global_batch_size=8, micro_batch_size=1)  # static: 8 micro-batches, fixed
    sched = plan_schedule(lengths, parallel, batch, cost_model=CostModel(**DIMS))
    assert check_schedule(sched) == []
    costs = replica_makespans(sched, 0)[1][0].sum(axis=0)  # rank 0's micro-batches' forward work, run order
    heaviest_first = np.argsort(-costs, kind="stable")
    assert not np.array_equal(heaviest_first, np.arange(len(costs)))
    chosen = float(oracle_makespans(sched, 0)[0])
    assert sched.stats[0].predicted_makespan == pytest.approx(chosen, rel=1e-9)
    assert chosen < float(oracle_makespans(reordered(sched, 0, 0, heaviest_first), 0)[0]) * 0.99
    # the pp-unaware micro-batches' samples are kept; only where they run moved (a behaviour, not a label)
    flat = plan_schedule(lengths, ParallelConfig(dp_size=1), batch, cost_model=CostModel(**DIMS))
    assert sorted(step_microbatches(sched, 0)[0]) == sorted(step_microbatches(flat, 0)[0])
    assert step_microbatches(sched, 0) != step_microbatches(flat, 0)
    # and no heuristic order the planner tries beats the one it chose, by the oracle
    for cand in heuristic_orders(costs[None, :]):
        assert float(oracle_makespans(reordered(sched, 0, 0, cand[0]), 0)[0]) >= chosen * (1 - 1e-12)


def test_rank_holding_the_largest_sample_gets_less_of_the_rest():
    rng = np.random.default_rng(11)
    lengths = np.concatenate([[16000], rng.integers(500, 3000, 127)]).tolist()
    parallel = ParallelConfig(dp_size=4, pp_size=4)
    batch = BatchConfig(global_batch_size=128, use_dynamic_batch_size=True, max_tokens_per_gpu=16384,
                        balance_data=True)
    sched = plan_schedule(lengths, parallel, batch, cost_model=CostModel(**DIMS))
    assert check_schedule(sched) == []
    holder = next(r for r in range(4) if 0 in sched.partitions[r])
    work = oracle_work(sched, 0)
    others = np.delete(work, holder)
    assert work[holder] < others.min()  # its longer fill and drain are paid for with less work
    flat = plan_schedule(lengths, ParallelConfig(dp_size=4), batch, cost_model=CostModel(**DIMS))
    assert float(oracle_makespans(sched, 0).max()) < float(oracle_makespans(flat, 0, parallel).max())


def test_more_smaller_microbatches_when_filling_the_pipeline_pays():
    """Few large micro-batches per rank leave a long fill and drain: the planner spends more (aligned, under the
    cap) when the model says the slowest replica gets faster, and says so in the strategy."""
    rng = np.random.default_rng(2)
    lengths = np.where(rng.random(256) < 0.8, rng.integers(200, 1200, 256), rng.integers(5000, 12000, 256))
    parallel = ParallelConfig(dp_size=4, pp_size=8)
    batch = BatchConfig(global_batch_size=256, use_dynamic_batch_size=True, max_tokens_per_gpu=16384,
                        balance_data=True)
    sched = plan_schedule(lengths.tolist(), parallel, batch, cost_model=CostModel(**DIMS))
    flat = plan_schedule(lengths.tolist(), ParallelConfig(dp_size=4), batch, cost_model=CostModel(**DIMS))
    assert check_schedule(sched) == []
    assert sched.num_microbatches[0] > flat.num_microbatches[0]
    # ... because the oracle says the slowest replica gets faster than with the pp-unaware count
    assert float(oracle_makespans(sched, 0).max()) < float(oracle_makespans(flat, 0, parallel).max())
    # under VPP the extra micro-batches come in whole groups: every rank's count stays a multiple of the group
    vpp = ParallelConfig(dp_size=4, pp_size=4, vpp_size=2, microbatch_group_size_per_vp_stage=4)
    grouped = plan_schedule(lengths.tolist(), vpp, batch, cost_model=CostModel(**DIMS))
    assert check_schedule(grouped) == []
    assert all(m % 4 == 0 for m in grouped.num_microbatches)
    assert grouped.num_microbatches[0] > plan_schedule(
        lengths.tolist(), ParallelConfig(dp_size=4, vpp_size=2, microbatch_group_size_per_vp_stage=4), batch,
        cost_model=CostModel(**DIMS)).num_microbatches[0]


def test_pricing_states_its_units_and_defaults():
    p = pipeline_pricing(ParallelConfig(dp_size=2, pp_size=4), CostModel(**DIMS), 16384)
    assert p.units == "forward FLOPs per stage" and p.backward_forward_ratio == 2.0 and p.spec.p2p_s == 0.0
    assert p.overhead == pytest.approx(FLOPS_MICROBATCH_OVERHEAD * CostModel(**DIMS).coefficients()[0] * 16384)
    f, b = p.stage_costs(np.array([4.0e9]))  # the output layer makes the last stage heavier: one row per stage
    assert f.shape == (4, 1) and f.sum() == pytest.approx(4.0e9 + p.overhead) and np.allclose(b, 2 * f)
    assert f[3, 0] > f[0, 0] == pytest.approx(f[1, 0]) == pytest.approx(f[2, 0])
    even = pipeline_pricing(ParallelConfig(dp_size=2, pp_size=4), CostModel(**{**DIMS, "vocab_size": 0}), 16384)
    f, b = even.stage_costs(np.array([4.0e9]))  # no output layer: every stage alike, one row
    assert even.stage_share is None and f[0] == pytest.approx((4.0e9 + even.overhead) / 4)
    q = pipeline_pricing(ParallelConfig(dp_size=2, pp_size=4), PROFILE, 16384)
    assert q.units == "seconds" and q.spec.p2p_s == 0.002
    f, b = q.stage_costs(np.array([0.7]))
    assert f[0] + b[0] == pytest.approx(0.7 / 4) and b[0] == pytest.approx(2.5 * f[0])  # fwd+bwd split 1 : 2.5
    assert pipeline_pricing(ParallelConfig(dp_size=2), PROFILE, 16384) is None
    # a group below pp_size under VPP (megatron-core refuses it) never reaches the pricing: the layout refuses it
    with pytest.raises(ScheduleError, match="microbatch_group_size_per_vp_stage=2: Megatron's interleaved schedule "
                                            "needs it >= pp_size = 4"):
        ParallelConfig(dp_size=2, pp_size=4, vpp_size=2, microbatch_group_size_per_vp_stage=2)


def test_profile_gains_pipeline_fields_and_old_files_load(tmp_path):
    path = tmp_path / "p.json"
    PROFILE.save(str(path))
    back = CostProfile.load(str(path))
    assert back == PROFILE and back.backward_forward_ratio == 2.5 and back.p2p_s == 0.002
    d = json.loads(path.read_text())
    del d["backward_forward_ratio"], d["p2p_s"]  # a profile written before the fields existed
    old = CostProfile.from_dict(d)
    assert old.backward_forward_ratio == 2.0 and old.p2p_s == 0.0
    for field, value in (("backward_forward_ratio", 0.0), ("backward_forward_ratio", float("inf")),
                         ("p2p_s", -1e-3), ("p2p_s", "0.1")):
        with pytest.raises(ScheduleError, match=f"CostProfile.{field}"):
            dataclasses.replace(PROFILE, **{field: value})
