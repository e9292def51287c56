"""Shaped micro-batches for the pipeline (``slime_ext.schedule.pipeline_shape``) and the yardstick search
(``bench/pipeline_search.py``): every packing is a valid plan, the shape's targets are met where samples allow,
and the search never returns worse than its seeds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bench import pipeline_search
from slime_ext.schedule import BatchConfig, CostModel, ParallelConfig, check_schedule, plan_schedule
from slime_ext.schedule.cost import sample_costs
from slime_ext.schedule.invariants import micro_batch_makespans, replica_makespans
from slime_ext.schedule.pipeline_pricing import Budget, pipeline_pricing
from slime_ext.schedule.pipeline_rebalance import lockstep, rebalance_run
from slime_ext.schedule.pipeline_shape import (RISING, Shape, ShapeSamples, pack_many, ramp_weights, replica_members,
                                               shape_pack)
from slime_ext.schedule.planner_config import PlannerConfig

#: every configured shape as a pipeline of 1, 4 and 8 stages resolves it (per-stage ramps scale with the depth)
SHAPES = list(dict.fromkeys(Shape.of(s, pp) for pp in (1, 4, 8) for s in PlannerConfig().shaping.shapes))

DIMS = dict(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2, vocab_size=1000, swiglu=True)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 30])
@pytest.mark.parametrize("shape", SHAPES)
def test_ramp_weights_are_shares_with_a_plateau(shape: Shape, k: int) -> None:
    w = shape.weights(k)
    assert w.shape == (k,) and np.isfinite(w).all() and np.all(w > 0) and w.sum() == pytest.approx(1.0)
    peak = int(np.argmax(w))
    if shape.up and shape.up != RISING and k > 2:
        up = min(shape.up, k - 2 if shape.down < 0 else k - 1)  # the ramp as ramp_weights shortens it
        if k > up + max(shape.down, 1):
            assert np.all(np.diff(w[:up + 1]) > 0) and peak >= up  # the ramp rises to the plateau
    if shape.down and k > 2:
        assert w[-1] < w.max()  # the step ends below the peak
    if shape.down < 0 and k > 2:  # a fall over every micro-batch after the peak
        assert np.all(np.diff(w[peak:]) < 0)


def test_per_stage_ramps_are_as_long_as_the_pipeline_is_deep() -> None:
    fields = (1.25, 2.0, 0.05, "target", False, 1.5, True)
    assert Shape.of(fields, 8) == Shape(10, 16, 0.05, "target", False, 1.5)
    assert Shape.of(fields, 4) == Shape(5, 8, 0.05, "target", False, 1.5)
    assert Shape.of(fields, 2) == Shape(3, 4, 0.05, "target", False, 1.5)  # rounded half up
    assert Shape.of((0.1, -1, 0.3, "target", False, 0.0, True), 2) == Shape(1, -1, 0.3)  # at least one; -1 stays
    assert Shape.of((0, 0.5, 0.3, "target", False, 0.0, True), 8) == Shape(0, 4, 0.3)  # no ramp stays none
    assert Shape.of(fields, 8) is Shape.of(list(fields), 8)  # one object per tuple and depth
    assert Shape.of((3, 8, 0.3), 8) == Shape(3, 8, 0.3) == Shape.of((3, 8, 0.3, "target", False, 0.0, False), 8)
    w = Shape.of((1.25, -1, 0.05, "target", False, 0.0, True), 8).weights(36)
    assert np.all(np.diff(w[:11]) > 0) and w.argmax() == 10 and np.all(np.diff(w[10:]) < 0)
    assert w[0] == pytest.approx(0.05 * w[10])


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
    for s in range(sched.num_steps):  # judged by the invariant checker's re-pricing, not the planner's pricing
        before = float(replica_makespans(dataclasses.replace(unaware, parallel=parallel), s)[0].max())
        assert sched.stats[s].predicted_makespan <= before * (1 + 1e-9)
        assert sched.stats[s].predicted_makespan == pytest.approx(float(replica_makespans(sched, s)[0].max()),
                                                                  rel=1e-9)


def oracle_spans(plan: "pipeline_search.Plan", case: "pipeline_search.SearchCase") -> np.ndarray:
    """``(dp,)`` the makespans of a yardstick plan (one step) by :func:`micro_batch_makespans`, the invariant
    checker's re-pricing from the documented rule through the public pipeline model."""
    lengths, model, _ = case.inputs()
    replicas = [[lengths[list(mb)] for mb in rep] for rep in plan.mbs()]
    return micro_batch_makespans(case.parallel(), model, plan.cap, replicas)[0]


def _yardstick_plans(case, planned: bool = False):
    """The yardstick's seed plan of ``case`` (its pp-unaware schedule), and with ``planned`` this planner's plan."""
    lengths, model, batch = case.inputs()
    pricing = pipeline_pricing(case.parallel(), model, 16384)
    costs = sample_costs(lengths, model)
    unaware = plan_schedule(lengths.tolist(), case.parallel(pp=1), batch, cost_model=model)
    seed = pipeline_search.plan_from_schedule(unaware, 0, lengths, costs, 16384, pricing)
    if not planned:
        return seed
    return seed, pipeline_search.plan_from_schedule(plan_schedule(lengths.tolist(), case.parallel(), batch,
                                                                  cost_model=model), 0, lengths, costs, 16384, pricing)


def test_yardstick_search_returns_a_valid_plan_no_worse_than_its_seeds() -> None:
    case = pipeline_search.SearchCase("t", "rl", dp=2, pp=4, vpp=1, per_replica=24, seed=5)
    seed, planned = _yardstick_plans(case, planned=True)
    best = pipeline_search.search(seed, budget=400, step=1, seed=0, more_seeds=[planned])
    best.check(case.n)
    assert best.key() <= min(seed.key(), planned.key())
    assert best.key()[0] < seed.key()[0] * 0.97  # the pp-unaware plan is far from the best
    # its makespans as the invariant checker re-prices them, not through the search's own pricing
    np.testing.assert_allclose(best.spans, oracle_spans(best, case), rtol=1e-9)
    # the same seed gives the same search
    again = pipeline_search.search(seed, budget=400, step=1, seed=0, more_seeds=[planned])
    assert again.key() == best.key()


def test_yardstick_moves_keep_the_plan_valid() -> None:
    """Every move the annealing makes leaves a valid plan whose kept sums and makespans are exact."""
    case = pipeline_search.SearchCase("t", "bimodal", dp=3, pp=2, vpp=2, per_replica=20, seed=2)
    plan = _yardstick_plans(case)
    rng = np.random.default_rng(1)
    for _ in range(5):
        plan = pipeline_search.anneal(plan, rng, 40, float(plan.spans.max()), pipeline_search.Anneal())
        plan.check(case.n)  # re-derives every sum and makespan from the samples' places
    k = plan.k
    bigger = pipeline_search.recounted(plan, k + 2)
    assert bigger is not None and bigger.k == k + 2
    bigger.check(case.n)


def test_yardstick_batches_over_many_replicas_keep_every_plan_valid() -> None:
    """A batch of ``batch_per_replica`` moves per replica (here 16 x 12 = 192, over the 96 floor) makes moves on
    many replicas at once (order moves included, their permutations built as arrays): after every batch the plan
    is valid (every sample exactly once, the same count on every replica, no empty micro-batch, the cap held) and
    its kept sums and makespans are exact."""
    case = pipeline_search.SearchCase("t", "rl", dp=12, pp=4, vpp=1, per_replica=16, seed=4)
    plan = _yardstick_plans(case)
    settings = pipeline_search.Anneal(batch_per_replica=16)
    rng = np.random.default_rng(3)
    scale = float(plan.spans.max())
    touched = []
    for _ in range(60):  # one batch a call: ``plan`` is changed in place, batch by batch
        before = plan.copy()
        pipeline_search.anneal(plan, rng, 1, scale, settings)
        plan.check(case.n)
        assert plan.cost.shape == (case.dp, before.k)
        assert sorted(np.flatnonzero(plan.rep >= 0)) == list(range(case.n))
        assert (np.bincount(plan.rep, minlength=case.dp) == plan.size.sum(axis=1)).all()
        assert ((plan.tok <= 16384) | (plan.size == 1)).all()
        touched.append(int((~np.all(before.cost == plan.cost, axis=1)).sum()))
    assert max(touched) > 2  # moves on more than one or two replicas in one batch


def test_yardstick_counts_start_from_the_strongest_seed_recounted() -> None:
    """With ``recount_best`` every count also starts from the strongest seed recounted (valid plans at every count
    the scan visits), and the search is never worse than its seeds."""
    case = pipeline_search.SearchCase("t", "bimodal", dp=4, pp=4, vpp=1, per_replica=24, seed=6)
    seed, planned = _yardstick_plans(case, planned=True)
    made = 0
    for k in range(max(1, seed.k - 1), int(2.2 * seed.k) + 1):
        got = pipeline_search.recounted(planned, k)
        if got is not None:
            got.check(case.n)
            assert got.k == k
            made += 1
    assert made >= 3
    for flag in (0, 1):
        best = pipeline_search.search(seed, budget=200, step=1, seed=0, more_seeds=[planned],
                                      settings=pipeline_search.Anneal(recount_best=flag))
        best.check(case.n)
        assert best.key() <= min(seed.key(), planned.key())


def test_speed_benchmark_prints_both_times_and_their_ratio(capsys) -> None:
    from bench import pipeline_speed
    assert pipeline_speed.main(["--quick", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if "pp4 v1" in line).split()
    base, aware, ratio = float(row[4]), float(row[5]), float(row[6])  # dp, samples, "pp4", "v1", then times
    assert base > 0 and aware > 0
    # the three are rounded to one decimal (times in ms): the printed ratio is the true one within 0.05, and the
    # true one lies between the ratios the printed times allow (each within 0.05 ms) -- absolute, as rounding is
    half = 0.05 + 1e-9
    low, high = (aware - half) / (base + half), (aware + half) / (base - half) if base > half else float("inf")
    assert low - half <= ratio <= high + half, (base, aware, ratio)
    assert lines[-1].startswith("worst ratio (issue-22 grid):")


def test_grouped_shapes_ramp_over_whole_groups() -> None:
    shape = Shape(1, 2, 0.3, grouped=True)
    w = shape.weights(16, 4)  # 4 groups of 4: low, plateau, then two falling groups
    assert w.sum() == pytest.approx(1.0)
    groups = w.reshape(4, 4)
    assert np.allclose(groups, groups[:, :1])  # alike within a group
    assert groups[0, 0] < groups[1, 0] and groups[3, 0] < groups[2, 0] < groups[1, 0]
    assert np.allclose(shape.weights(16, 1), ramp_weights(16, 1, 2, 0.3))  # without VPP groups: the plain ramp
    assert len(shape.weights(10, 4)) == 10  # a last group of fewer micro-batches


# ---------------------------------------------------------------------------------------------------- speed, exactly
# The planner's speed-ups (issue 22, item 2) must not change a plan: each is checked here against the plain way.

def _random_rows(rng, lengths, costs, rows: int, most: int) -> np.ndarray:
    members = np.full((rows, most), -1, dtype=np.int64)
    for r in range(rows):
        ids = rng.choice(len(lengths), int(rng.integers(1, most + 1)), replace=False)
        members[r, :len(ids)] = ids[np.lexsort((ids, -costs[ids]))]
    return members


def test_shape_pack_packs_each_row_as_it_would_alone() -> None:
    # rows of different sizes and counts in one call (the call sorts them by size and stops the short ones early)
    rng = np.random.default_rng(3)
    lengths = rng.integers(10, 20000, 3000)
    costs = lengths + lengths.astype(float) ** 2 / 8000
    for cap in (4000, 16384):
        members = _random_rows(rng, lengths, costs, 30, 50)
        weights = np.full((30, 20), -1.0)
        for r in range(30):
            k = int(rng.integers(1, 21))
            weights[r, :k] = SHAPES[r % len(SHAPES)].weights(k)
        bin_of, ok = shape_pack(lengths, costs, members, weights, cap)
        for r in range(30):
            alone = shape_pack(lengths, costs, members[r:r + 1], weights[r:r + 1], cap)
            np.testing.assert_array_equal(bin_of[r], alone[0][0])
            assert ok[r] == alone[1][0]


def test_replica_members_orders_ties_by_index() -> None:
    rng = np.random.default_rng(4)
    for costs in (rng.choice([1.0, 2.0, 3.0], 500), rng.random(500)):
        replica_of = rng.integers(0, 7, 500)
        members = replica_members(replica_of, costs, 7)
        for r in range(7):
            mine = np.flatnonzero(replica_of == r)
            want = mine[np.lexsort((mine, -costs[mine]))]
            np.testing.assert_array_equal(members[r, :len(mine)], want)
            assert (members[r, len(mine):] == -1).all()


def _shape_samples(seed: int, n: int = 1600, step: int = 1):
    rng = np.random.default_rng(seed)
    lengths = (rng.integers(100, 1500, n) + np.minimum(rng.lognormal(7.0, 1.0, n), 12000)).astype(np.int64)
    model = CostModel(**DIMS)
    return ShapeSamples(lengths, sample_costs(lengths, model), 8192, None, step), model


def test_pack_many_packs_coinciding_shapes_once_and_alike() -> None:
    samples, model = _shape_samples(5, step=4)
    pricing = pipeline_pricing(ParallelConfig(dp_size=8, pp_size=4, vpp_size=2,
                                              microbatch_group_size_per_vp_stage=4), model, 8192)
    members = replica_members(np.arange(1600) % 8, samples.costs, 8)
    # at 12 micro-batches (3 groups of 4) the three grouped shapes' ramps are cut to the same targets
    grouped = [s for s in SHAPES if s.grouped]
    assert len({s.weights(12, 4).tobytes() for s in grouped}) == 1
    combos = [(12, s) for s in grouped] + [(16, SHAPES[0]), (12, SHAPES[0])]
    budget = Budget(pricing, float("inf"))
    spans, bin_of = pack_many(budget, samples, members, combos)
    for i, combo in enumerate(combos):
        alone = pack_many(budget, samples, members, [combo])
        np.testing.assert_array_equal(spans[i], alone[0][0])
        np.testing.assert_array_equal(bin_of[i], alone[1][0])


def test_rebalancing_counts_side_by_side_equals_each_alone() -> None:
    samples, model = _shape_samples(6, n=800)
    dp = 32
    pricing = pipeline_pricing(ParallelConfig(dp_size=dp, pp_size=4), model, 8192)
    budget = Budget(pricing, float("inf"))
    members = replica_members(np.arange(800) % dp, samples.costs, dp)
    groups = [row[row >= 0] for row in members]
    runs = []
    for k, shape in ((12, SHAPES[4]), (14, SHAPES[5])):
        spans = pack_many(budget, samples, members, [(k, shape)])[0][0]
        assert np.isfinite(spans).all()
        runs.append((k, [shape] * dp, spans))
    together = lockstep(budget, samples, [rebalance_run(budget, samples, groups, k, shapes, spans, [None] * dp)
                                          for k, shapes, spans in runs])
    for (k, shapes, spans), got in zip(runs, together):
        alone = lockstep(budget, samples, [rebalance_run(budget, samples, groups, k, shapes, spans, [None] * dp)])[0]
        np.testing.assert_array_equal(got[2], alone[2])
        for a, b in zip(got[0], alone[0]):
            np.testing.assert_array_equal(a, b)
        # a re-packed replica keeps the packing it was priced with: its samples, each in one of its k micro-batches
        repacked = [t for t, pack in enumerate(got[3]) if pack is not None]
        assert repacked
        for t in repacked:
            mem, labels = got[3][t]
            assert sorted(mem.tolist()) == sorted(got[0][t].tolist())
            assert set(labels.tolist()) == set(range(k))
            row = samples.bin_rows(mem[None, :], labels[None, :], k)
            assert pricing.makespans(row)[0] == got[2][t]


def test_pricing_tables_equal_the_model_on_per_stage_costs() -> None:
    # makespans_many writes stage costs straight into the model's tables (stages that cost alike share rows)
    model = CostModel(**DIMS)
    rng = np.random.default_rng(7)
    for pp, vpp in ((4, 1), (4, 2), (2, 3)):
        parallel = ParallelConfig(dp_size=2, pp_size=pp, vpp_size=vpp,
                                  microbatch_group_size_per_vp_stage=pp if vpp > 1 else None)
        pricing = pipeline_pricing(parallel, model, 8192)
        groups = [rng.random((5, m)) * 1e12 for m in ((pp * 3, pp * 4) if vpp > 1 else (3, 7))]
        from slime_ext.schedule.pipeline_model import pipeline_makespan
        for got, c in zip(pricing.makespans_many(groups), groups):
            np.testing.assert_array_equal(got, pipeline_makespan(*pricing.stage_costs(c), pricing.spec))


def test_yardstick_batches_grow_with_the_replicas_beyond_budget_replicas(monkeypatch) -> None:
    """A case of more than ``Anneal.budget_replicas`` replicas searches ``dp / budget_replicas`` times the batches
    (the slowest of many near-equal replicas drops only where most of them improve); up to it, the budget as given."""
    runs: list[int] = []

    def counted(plan, rng, batches, scale, s):  # the annealing runs' batches, the plan unchanged
        runs.append(batches)
        return plan.copy()

    monkeypatch.setattr(pipeline_search, "anneal", counted)
    spent = {}
    for dp, reach in ((4, 4), (4, 2), (8, 4)):
        case = pipeline_search.SearchCase("t", "rl", dp=dp, pp=4, vpp=1, per_replica=8, seed=7)
        seed = _yardstick_plans(case)
        runs.clear()
        pipeline_search.search(seed, budget=1000, step=1, settings=pipeline_search.Anneal(budget_replicas=reach))
        spent[dp, reach] = sum(runs)
    assert 900 <= spent[4, 4] <= 1000  # (each round's share rounds down)
    assert 1800 <= spent[4, 2] <= 2000 and 1800 <= spent[8, 4] <= 2000
