"""Shaped micro-batches for the pipeline (``slime_ext.schedule.pipeline_shape``) and the yardstick search
(``bench/pipeline_search.py``): every packing is a valid plan, the shape's targets are met where samples allow,
and the search never returns worse than its seeds."""

from __future__ import annotations

import numpy as np
import pytest

from bench import pipeline_search
from slime_ext.schedule import BatchConfig, CostModel, ParallelConfig, check_schedule, plan_schedule
from slime_ext.schedule.cost import sample_costs
from slime_ext.schedule.pipeline_plan import pipeline_pricing
from slime_ext.schedule.pipeline_shape import RISING, SHAPES, Shape, ramp_weights, replica_members, shape_pack

DIMS = dict(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2, vocab_size=1000, swiglu=True)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 30])
@pytest.mark.parametrize("shape", SHAPES)
def test_ramp_weights_are_shares_with_a_plateau(shape: Shape, k: int) -> None:
    w = shape.weights(k)
    assert w.shape == (k,) and np.all(w > 0) and w.sum() == pytest.approx(1.0)
    assert w.max() == pytest.approx(w.max())  # finite
    if shape.up and shape.up != RISING and k > shape.up + shape.down:
        assert np.all(np.diff(w[:shape.up + 1]) > 0)  # the ramp rises to the plateau
    if shape.down and k > 2:
        assert w[-1] < w.max()  # the step ends below the peak


def test_ramp_weights_shorten_ramps_on_few_microbatches() -> None:
    assert np.allclose(ramp_weights(1, 3, 6, 0.3), [1.0])
    w = ramp_weights(3, 3, 6, 0.3)
    assert w.argmax() == 1 and w[0] == pytest.approx(w[2])


def test_replica_members_sorts_each_replica_by_cost() -> None:
    costs = np.array([5.0, 1.0, 3.0, 3.0, 9.0])
    members = replica_members(np.array([0, 1, 0, 0, 1]), costs, 3)
    assert members.tolist() == [[0, 2, 3], [4, 1, -1], [-1, -1, -1]]


@pytest.mark.parametrize("seed", range(6))
def test_shape_pack_is_a_valid_packing(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cap = 4096
    lengths = np.minimum(rng.lognormal(6.5, 1.0, size=300).astype(np.int64) + 1, 6000)  # some over the cap
    costs = lengths * (1.0 + lengths / 3000.0)
    replica_of = rng.integers(0, 6, size=300)
    members = replica_members(replica_of, costs, 6)
    for shape in SHAPES:
        for k in (4, 9, 17):
            bin_of, ok = shape_pack(lengths, costs, members, np.tile(shape.weights(k), (6, 1)), cap)
            for r in range(6):
                got = bin_of[r][members[r] >= 0]
                assert (bin_of[r][members[r] < 0] == -1).all()
                assert got.min() >= 0 and got.max() < k
                if not ok[r]:
                    continue
                ids = members[r][members[r] >= 0]
                for b in range(k):
                    inside = ids[got == b]
                    assert len(inside), "no empty micro-batch in a row marked ok"
                    assert len(inside) == 1 or lengths[inside].sum() <= cap, "the cap holds"


def test_shape_pack_fills_every_microbatch_when_samples_equal_microbatches() -> None:
    lengths = np.array([30000, 100, 120, 130, 90])
    costs = lengths * (1.0 + lengths / 5000.0)
    members = replica_members(np.zeros(5, dtype=np.int64), costs, 1)
    for shape in SHAPES:
        bin_of, ok = shape_pack(lengths, costs, members, shape.weights(5)[None, :], 16384)
        assert ok[0] and sorted(bin_of[0].tolist()) == [0, 1, 2, 3, 4]


def test_shape_pack_rows_of_fewer_microbatches_leave_the_rest_empty() -> None:
    lengths = np.arange(1, 41) * 50
    costs = lengths.astype(float)
    members = replica_members(np.zeros(40, dtype=np.int64), costs, 1)
    w = np.full((2, 8), -1.0)
    w[0, :5], w[1] = ramp_weights(5, 1, 2, 0.5), ramp_weights(8, 1, 2, 0.5)
    bin_of, ok = shape_pack(lengths, costs, np.tile(members, (2, 1)), w, 10**6)
    assert ok.all() and bin_of[0].max() == 4 and set(bin_of[1].tolist()) == set(range(8))


def test_shape_pack_targets_put_the_largest_samples_on_the_peak() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(100, 3000, size=200)
    costs = lengths.astype(float)
    members = replica_members(np.zeros(200, dtype=np.int64), costs, 1)
    shape = Shape(3, 6, 0.3)
    bin_of, ok = shape_pack(lengths, costs, members, shape.weights(16)[None, :], 10**6)
    loads = np.bincount(bin_of[0], weights=costs[members[0]], minlength=16)
    target = shape.weights(16) * costs.sum()
    assert ok[0] and np.abs(loads - target).max() <= lengths.max()  # within one sample of every target
    assert loads[0] < loads[3] and loads[-1] < loads[3]


@pytest.mark.parametrize("pp,vpp", [(4, 1), (2, 2)])
@pytest.mark.parametrize("cost", ["flops", "tokens"])
@pytest.mark.parametrize("dp,tail", [(4, False), (32, False), (32, True)])  # dp 32: water_fill rebalances
def test_planner_with_shapes_keeps_every_invariant_and_beats_the_unaware_plan(pp: int, vpp: int, cost: str, dp: int,
                                                                              tail: bool) -> None:
    rng = np.random.default_rng(pp * 10 + vpp)
    n = 100 * dp
    response = 300 * rng.pareto(1.2, size=n) if tail else rng.lognormal(7.0, 1.0, size=n)
    lengths = (rng.integers(100, 1500, size=n) + np.minimum(response, 20000)).astype(int)
    model = CostModel(**DIMS) if cost == "flops" else None
    batch = BatchConfig(global_batch_size=n // 2, use_dynamic_batch_size=True, max_tokens_per_gpu=8192,
                        balance_data=True)
    parallel = ParallelConfig(dp_size=dp, pp_size=pp, vpp_size=vpp, microbatch_group_size_per_vp_stage=pp if vpp > 1
                              else None)
    sched = plan_schedule(lengths.tolist(), parallel, batch, cost_model=model)
    assert check_schedule(sched) == []
    unaware = plan_schedule(lengths.tolist(), ParallelConfig(dp_size=dp, vpp_size=vpp,
                                                             microbatch_group_size_per_vp_stage=pp if vpp > 1
                                                             else None), batch, cost_model=model)
    pricing = pipeline_pricing(parallel, model, 8192)
    from slime_ext.schedule.pipeline_plan import predicted_makespans
    for s in range(sched.num_steps):
        assert sched.stats[s].predicted_makespan <= predicted_makespans(unaware, s, pricing).max() * (1 + 1e-9)
        assert sched.stats[s].predicted_makespan == pytest.approx(predicted_makespans(sched, s).max())


def test_yardstick_search_returns_a_valid_plan_no_worse_than_its_seeds() -> None:
    case = pipeline_search.SearchCase("t", "rl", dp=2, pp=4, vpp=1, per_replica=24, seed=5)
    lengths = pipeline_search.make_lengths(case.dist, case.n, case.seed)
    model = CostModel(**pipeline_search.SEARCH_DIMS)
    batch = BatchConfig(global_batch_size=case.n, use_dynamic_batch_size=True, max_tokens_per_gpu=16384,
                        balance_data=True)
    pricing = pipeline_pricing(case.parallel(), model, 16384)
    costs = sample_costs(lengths, model)
    unaware = plan_schedule(lengths.tolist(), case.parallel(pp=1), batch, cost_model=model)
    seed = pipeline_search.plan_from_schedule(unaware, 0, lengths, costs, 16384, pricing)
    best = pipeline_search.search([seed], budget_s=1.0, step=1, seed=0)
    best.check(case.n)
    assert best.key() <= seed.key()
    assert np.allclose(best.spans, pricing.makespans(best.cost_rows()))


def test_speed_benchmark_prints_both_times_and_their_ratio(capsys) -> None:
    from bench import pipeline_speed
    assert pipeline_speed.main(["--quick", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if "pp4 v1" in line).split()
    base, aware, ratio = float(row[4]), float(row[5]), float(row[6])  # dp, samples, "pp4", "v1", then times
    assert base > 0 and aware > 0 and ratio == pytest.approx(aware / base, rel=0.06)  # printed with one decimal
    assert lines[-1].startswith("worst ratio:")


def test_grouped_shapes_ramp_over_whole_groups() -> None:
    shape = Shape(1, 2, 0.3, grouped=True)
    w = shape.weights(16, 4)  # 4 groups of 4: low, plateau, then two falling groups
    assert w.sum() == pytest.approx(1.0)
    groups = w.reshape(4, 4)
    assert np.allclose(groups, groups[:, :1])  # alike within a group
    assert groups[0, 0] < groups[1, 0] and groups[3, 0] < groups[2, 0] < groups[1, 0]
    assert np.allclose(shape.weights(16, 1), ramp_weights(16, 1, 2, 0.3))  # without VPP groups: the plain ramp
    assert len(shape.weights(10, 4)) == 10  # a last group of fewer micro-batches
