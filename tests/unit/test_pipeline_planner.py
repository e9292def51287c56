"""The planner with pipeline parallelism: every invariant holds, the predicted makespan never loses to the
pp-unaware plan of the same step, the stats survive JSON, and pp = 1 plans as before."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from slime_ext.schedule import (BatchConfig, CostModel, CostProfile, DPSchedule, ParallelConfig, ScheduleError,
                                check_schedule, plan_schedule)
from slime_ext.schedule.cost import sample_costs
from slime_ext.schedule.pipeline_orders import heuristic_orders
from slime_ext.schedule.pipeline_pricing import pipeline_pricing, predicted_makespans
from slime_ext.schedule.planner_config import PlannerConfig

FLOPS_MICROBATCH_OVERHEAD = PlannerConfig().microbatch_overhead

DIMS = dict(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2, vocab_size=1000, swiglu=True)
PROFILE = CostProfile(step_overhead_s=0.01, microbatch_overhead_s=0.004, per_token_s=2e-5,
                      per_sample_quadratic_s=3e-9, packed_quadratic_s=1e-10, backward_forward_ratio=2.5, p2p_s=0.002)


def rank_costs(sched: DPSchedule, step: int) -> np.ndarray:
    """``(dp, M)``: each rank's micro-batch costs of ``step`` in run order, priced as the planner prices them."""
    lengths = np.asarray(sched.total_lengths)
    costs = sample_costs(lengths, sched.cost_model)
    before = sum(sched.num_microbatches[:step])
    m = sched.num_microbatches[step]
    rows = []
    for r in range(sched.dp_size):
        row = []
        for mb in sched.micro_batch_indices[r][before:before + m]:
            members = [sched.partitions[r][i] for i in mb]
            row.append(sched.cost_model.microbatch_time(lengths[members]) if isinstance(sched.cost_model, CostProfile)
                       else float(costs[members].sum()))
        rows.append(row)
    return np.asarray(rows)


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
    try:
        sched = plan_schedule(lengths.tolist(), parallel, batch, cost_model=cost)
    except ScheduleError as e:  # the same refusal as without the pipeline (too few samples, ...)
        with pytest.raises(ScheduleError, match=str(e)[:40].replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("*", r"\*").replace("+", r"\+")):
            plan_schedule(lengths.tolist(), dataclasses.replace(parallel, pp_size=1), batch, cost_model=cost)
        return
    assert check_schedule(sched) == []
    unaware = plan_schedule(lengths.tolist(), dataclasses.replace(parallel, pp_size=1), batch, cost_model=cost)
    assert unaware.num_steps == sched.num_steps
    pricing = pipeline_pricing(parallel, cost, batch.cap(parallel.cp_size))
    for s, st in enumerate(sched.stats):
        before = float(pricing.makespans(rank_costs(unaware, s)).max())  # heaviest first, pp-unaware bins and ranks
        assert st.predicted_makespan <= before * (1 + 1e-9), (s, st.strategy)
        assert st.predicted_makespan == pytest.approx(float(pricing.makespans(rank_costs(sched, s)).max()))
        np.testing.assert_allclose(predicted_makespans(sched, s), pricing.makespans(rank_costs(sched, s)))
        np.testing.assert_allclose(predicted_makespans(unaware, s, pricing), pricing.makespans(rank_costs(unaware, s)))
        assert 0.0 <= st.bubble_fraction < 1.0
        assert unaware.stats[s].predicted_makespan is None and unaware.stats[s].bubble_fraction is None
        if "+pp" not in st.strategy:  # nothing beat the pp-unaware plan: it is that plan, as emitted
            assert st.strategy == unaware.stats[s].strategy
            assert st.predicted_makespan == pytest.approx(before, rel=1e-12)
    if not any("+pp" in st.strategy for st in sched.stats):
        assert sched.partitions == unaware.partitions
        assert sched.micro_batch_indices == unaware.micro_batch_indices


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
    run = rank_costs(sched, 0)[0]
    pricing = pipeline_pricing(parallel, CostModel(**DIMS), None)
    heaviest_first = np.sort(run)[::-1]
    assert not np.array_equal(run, heaviest_first)
    assert sched.stats[0].predicted_makespan < float(pricing.makespans(heaviest_first)[0]) * 0.99
    assert "+pp-order" in sched.stats[0].strategy  # the pp-unaware micro-batches, reordered (and refined)
    # and no heuristic or swap the planner tries beats the one it chose
    for cand in heuristic_orders(run[None, :]):
        assert float(pricing.makespans(run[cand])[0]) >= sched.stats[0].predicted_makespan * (1 - 1e-12)


def test_rank_holding_the_largest_sample_gets_less_of_the_rest():
    rng = np.random.default_rng(11)
    lengths = np.concatenate([[16000], rng.integers(500, 3000, 127)]).tolist()
    parallel = ParallelConfig(dp_size=4, pp_size=4)
    batch = BatchConfig(global_batch_size=128, use_dynamic_batch_size=True, max_tokens_per_gpu=16384,
                        balance_data=True)
    sched = plan_schedule(lengths, parallel, batch, cost_model=CostModel(**DIMS))
    assert check_schedule(sched) == []
    holder = next(r for r in range(4) if 0 in sched.partitions[r])
    work = rank_costs(sched, 0).sum(axis=1)
    others = np.delete(work, holder)
    assert work[holder] < others.min()  # its longer fill and drain are paid for with less work
    flat = plan_schedule(lengths, ParallelConfig(dp_size=4), batch, cost_model=CostModel(**DIMS))
    pricing = pipeline_pricing(parallel, CostModel(**DIMS), 16384)
    assert sched.stats[0].predicted_makespan < float(pricing.makespans(rank_costs(flat, 0)).max())


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
    assert "count+" in sched.stats[0].strategy or "shape+" in sched.stats[0].strategy
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
