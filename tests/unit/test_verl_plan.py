"""The verl engine-depth plan (slime_ext.integrations.verl.plan) and the switch, without verl installed.

Every plan goes through ``check_engine_plan`` (count, alignment, coverage, cap); the pipeline's predictions are
checked by re-pricing the returned micro-batches from the documented rule through the public pipeline model
(``invariants.micro_batch_makespans``: not the planner's ``PipelinePricing``), not by re-reading what the plan says
of itself. The one-replica shaping it plans with is tested in ``test_shape_replica.py``."""

import numpy as np
import pytest

from slime_ext.schedule.planner_config import ShapingConfig
from slime_ext.integrations.verl import ENV, switch_from_env
from slime_ext.integrations.verl.plan import (GRID_MULTIPLES, Ballot, EngineLayout, EngineSearch, agree,
                                              check_engine_plan, check_rank_plan, draft_rank, finish_rank,
                                              plan_dispatch, plan_engine_step)
from slime_ext.schedule import CostModel, CostProfile, PlannerConfig, ScheduleError, shape_replica
from slime_ext.schedule.invariants import micro_batch_makespans

MODEL = CostModel(hidden_size=1024, num_layers=8, num_attention_heads=16, vocab_size=32000, swiglu=True)
PROFILE = CostProfile(step_overhead_s=0.01, microbatch_overhead_s=0.004, per_token_s=2e-5,
                      per_sample_quadratic_s=3e-9, packed_quadratic_s=1e-9, backward_forward_ratio=2.0, p2p_s=1e-4)
LAYOUTS = [EngineLayout(), EngineLayout(pp_size=4), EngineLayout(pp_size=2, vpp_size=2, vpp_group=2),
           EngineLayout(pp_size=2, vpp_size=2, vpp_group=4)]


def _ranks(seed, dp, n, hi=3000):
    rng = np.random.default_rng(seed)
    return [np.maximum(1, rng.lognormal(6.0, 1.0, size=n)).astype(int).clip(max=hi).tolist() for _ in range(dp)]


def _priced(layout, cost_model, cap, lengths, micro_batches):
    """Each rank's predicted makespan of its micro-batches in run order, re-priced from the documented rule through
    the public model (an oracle apart from the planner's pricing)."""
    out = []
    for x, mbs in zip(lengths, micro_batches):
        x = np.asarray(x)
        spans = micro_batch_makespans(layout.parallel(), cost_model, cap, [[x[list(mb)] for mb in mbs]])[0]
        out.append(float(spans[0]))
    return np.array(out)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_plan_holds_the_invariants_on_every_layout(layout, seed):
    lengths = _ranks(seed, dp=4, n=24)
    plan = plan_engine_step(lengths, 4096, layout, cost_model=MODEL)
    check_engine_plan(plan, [len(x) for x in lengths], lengths, layout.align)  # count, coverage, cap
    assert plan.count >= max(plan.needs)  # every rank can hold the cap at the agreed count
    if layout.pp_size == 1:  # no pipeline: the largest need
        assert plan.count == max(plan.needs)
    for x in lengths:  # the cap never needs fewer micro-batches than ceil(tokens / cap)
        assert plan.count >= -(-sum(x) // 4096)


def test_verl_over_cap_example_is_held():
    # verl's ceil(tokens / cap) = 2 bins for [6, 6, 6] under cap 10 puts 12 tokens in one; slime-ext needs 3
    plan = plan_engine_step([[6, 6, 6]], 10)
    assert plan.count == 3
    assert sorted(len(mb) for mb in plan.micro_batches[0]) == [1, 1, 1]


def test_ranks_agree_on_the_largest_need_and_the_plan_is_deterministic():
    lengths = [[6, 6, 6], [3, 3, 3]]
    plan = plan_engine_step(lengths, 10)
    assert plan.needs == (3, 1) and plan.count == 3 and plan.how == ("own", "recount")
    assert plan_engine_step(lengths, 10) == plan


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_each_rank_plans_alone_from_its_samples_and_the_reduced_ballot(layout):
    """What the engine runs: each rank drafts its own samples, the ballots meet in one MAX, each rank finishes. The
    result is the in-process plan, and a rank's plan depends on the other ranks only through the reduced ballot."""
    lengths = _ranks(7, dp=4, n=20)
    plan = plan_engine_step(lengths, 4096, layout, cost_model=MODEL)
    drafts = [draft_rank(x, 4096, layout, rank=r, cost_model=MODEL) for r, x in enumerate(lengths)]
    vectors = [d.ballot.vector() for d in drafts]
    assert {len(v) for v in vectors} == {Ballot.HEAD + len(GRID_MULTIPLES)}  # the same small vector at any DP size
    reduced = Ballot.reduce(vectors)
    for r, d in enumerate(drafts):
        agreement = agree(reduced, layout, 4096, mine=d)
        assert agreement == plan.agreement
        assert finish_rank(d, agreement).micro_batches == plan.micro_batches[r]
    # the other ranks shuffled: rank 0's ballot and plan do not change with them
    shuffled = [lengths[0]] + lengths[:0:-1]
    assert plan_engine_step(shuffled, 4096, layout, cost_model=MODEL).micro_batches[0] == plan.micro_batches[0]


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=str)
@pytest.mark.parametrize("cost_model", [MODEL, PROFILE, None], ids=["flops", "profile", "tokens"])
def test_pipeline_predictions_are_what_the_public_model_says(layout, cost_model):
    lengths = _ranks(3, dp=4, n=32, hi=8000)
    plan = plan_engine_step(lengths, 8192, layout, cost_model=cost_model)
    check_engine_plan(plan, [len(x) for x in lengths], lengths, layout.align)
    spans = _priced(layout, cost_model, 8192, lengths, plan.micro_batches)
    drafts = [draft_rank(x, 8192, layout, rank=r, cost_model=cost_model) for r, x in enumerate(lengths)]
    grid = list(layout.grid())
    bounded = []
    for r, d in enumerate(drafts):
        got = finish_rank(d, plan.agreement)
        assert got.predicted == pytest.approx(spans[r], rel=1e-9)
        ballot_span = d.ballot.spans[grid.index(plan.count)] if plan.count in grid else -np.inf
        if np.isfinite(ballot_span):  # the finished plan is never slower than the rank's ballot said
            assert spans[r] <= ballot_span * (1 + 1e-9)
            bounded.append(spans[r])
    if plan.agreement.predicted is not None:  # the agreed estimate bounds every rank that priced the count
        assert bounded and max(bounded) <= plan.agreement.predicted * (1 + 1e-9)


def test_agreement_takes_the_count_whose_slowest_rank_is_fastest():
    layout = EngineLayout(pp_size=4)
    grid = list(layout.grid())

    def ballot(need, samples, spans):
        row = np.full(len(GRID_MULTIPLES), -np.inf)
        for count, span in spans.items():
            row[grid.index(count)] = span
        return Ballot(need, samples, 0, row).vector()

    a = ballot(4, 20, {4: 10.0, 5: 8.0, 6: 7.0, 7: np.inf})  # cannot run 7
    b = ballot(5, 30, {5: 9.0, 6: 9.5, 7: 5.0, 8: 6.0})  # 8: nobody else priced it, nobody refused it
    got = agree(Ballot.reduce([a, b]), layout, 100)
    assert (got.count, got.predicted, got.need, got.fewest) == (8, 6.0, 5, 20)  # 5: 9, 6: 9.5, 7: inf, 8: 6
    tie = agree(Ballot.reduce([ballot(4, 20, {4: 3.0, 5: 3.0})]), layout, 100)
    assert tie.count == 4  # ties: the smaller count
    unpriced = agree(Ballot.reduce([ballot(17, 20, {})]), layout, 100)
    assert (unpriced.count, unpriced.predicted) == (17, None)  # nothing priced: the largest need


def test_min_count_rounds_up_to_the_vpp_group():
    plan = plan_engine_step([[10] * 12, [10] * 12], 1000, EngineLayout(pp_size=2, vpp_size=2, vpp_group=4),
                            min_count=5)
    assert plan.count % 4 == 0 and plan.count >= 8


def test_too_few_samples_for_the_cap_is_the_same_clear_error_on_every_rank():
    lengths = [[9, 9, 9, 9], [9]]
    with pytest.raises(ScheduleError, match="raise max_token_len_per_gpu"):
        plan_engine_step(lengths, 10)
    reduced = Ballot.reduce([draft_rank(x, 10, rank=r).ballot.vector() for r, x in enumerate(lengths)])
    messages = set()
    for r in range(2):
        with pytest.raises(ScheduleError) as err:
            agree(reduced, EngineLayout(), 10, mine=draft_rank(lengths[r], 10, rank=r))
        messages.add(str(err.value))
    assert len(messages) == 1 and "a rank holds only 1 samples" in messages.pop()


def test_a_rank_whose_draft_fails_is_named_on_every_rank_after_the_collective():
    lengths = [[100, 200], [100, 0, 50]]  # a zero-length sample: the planner refuses it on rank 1 only
    drafts = [draft_rank(x, 1000, rank=r) for r, x in enumerate(lengths)]
    assert drafts[0].error is None and "DP rank 1" in drafts[1].error  # nothing raised before the collective
    reduced = Ballot.reduce([d.ballot.vector() for d in drafts])
    with pytest.raises(ScheduleError, match=r"DP rank 1 \(3 samples, 150 tokens.*raise max_token_len_per_gpu"):
        agree(reduced, EngineLayout(), 1000, mine=drafts[1])
    with pytest.raises(ScheduleError, match="DP rank 1 cannot be planned"):
        agree(reduced, EngineLayout(), 1000, mine=drafts[0])
    raised = Ballot.reduce([drafts[0].ballot.vector(), Ballot.failed_by(0).vector()])
    with pytest.raises(ScheduleError, match="DP rank 0 cannot be planned"):
        agree(raised, EngineLayout(), 1000)


def test_pipeline_wish_gives_way_to_a_rank_with_few_samples():
    lengths = [[500] * 4, [100] * 40]
    plan = plan_engine_step(lengths, 4096, EngineLayout(pp_size=4), cost_model=MODEL)
    assert plan.count <= 4
    check_engine_plan(plan, [4, 40], lengths)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_bad_cap_is_refused(bad):
    with pytest.raises(ScheduleError, match="cap="):
        plan_engine_step([[1, 2]], bad)


def test_empty_rank_is_refused():
    with pytest.raises(ScheduleError, match="at least one sample"):
        plan_engine_step([[1, 2], []], 10)


def test_ballot_round_trip_and_a_wrong_size_is_refused():
    b = Ballot(4, 9, 0, np.linspace(1, 2, len(GRID_MULTIPLES)))
    back = Ballot.from_vector(b.vector())
    assert (back.need, back.samples, back.failed) == (4, 9, 0) and np.array_equal(back.spans, b.spans)
    with pytest.raises(ScheduleError, match="same slime-ext version"):
        Ballot.from_vector(b.vector()[:-1])


def test_search_knobs_are_validated():
    with pytest.raises(ValueError, match="reach"):
        EngineSearch(reach=0.5)
    with pytest.raises(ValueError, match="must be a PlannerConfig"):
        EngineSearch(planner={"shapes": ()})
    with pytest.raises(ValueError, match="order_band"):
        EngineSearch(order_band="all")


def test_the_ranks_near_the_slowest_take_the_model_s_run_order():
    """order_band: a rank within it of the slowest runs its scanned packing in the heuristic order the model
    prices fastest (never slower than its ballot); with the band off it keeps the shape's order."""
    layout = EngineLayout(pp_size=4)
    lengths = _ranks(9, dp=4, n=16, hi=8000)  # two ranks whose heuristic order beats the shape's (0.98, 0.985)
    ordered = plan_engine_step(lengths, 8192, layout, cost_model=MODEL,
                               search=EngineSearch(order_band=1.0, polish_band=-1.0))
    as_shaped = plan_engine_step(lengths, 8192, layout, cost_model=MODEL,
                                 search=EngineSearch(order_band=-1.0, polish_band=-1.0))
    assert ordered.count == as_shaped.count
    a = _priced(layout, MODEL, 8192, lengths, ordered.micro_batches)
    b = _priced(layout, MODEL, 8192, lengths, as_shaped.micro_batches)
    assert (a <= b * (1 + 1e-9)).all() and (a < b * (1 - 1e-6)).any()
    for x, mine, theirs in zip(lengths, ordered.micro_batches, as_shaped.micro_batches):  # the same packing
        assert {frozenset(mb) for mb in mine} == {frozenset(mb) for mb in theirs}


def test_the_shapes_are_the_planner_configs():
    """One set of shapes: a PlannerConfig with the flat shape alone reaches every rank's scan and finish, which
    then pack exactly what shape_replica packs with that config."""
    flat = PlannerConfig(shaping=ShapingConfig(shapes=((0, 0, 1.0),), scan_shapes=((0, 0, 1.0),)))
    layout = EngineLayout(pp_size=4)
    lengths = _ranks(5, dp=2, n=24)
    plan = plan_engine_step(lengths, 4096, layout, cost_model=MODEL, search=EngineSearch(planner=flat))
    default = plan_engine_step(lengths, 4096, layout, cost_model=MODEL)
    assert plan.micro_batches != default.micro_batches  # the config changed the plans
    for x, mbs in zip(lengths, plan.micro_batches):
        alone = shape_replica(x, plan.count, layout.parallel(), 4096, cost_model=MODEL, config=flat)
        assert {frozenset(mb) for mb in mbs} == {frozenset(mb) for mb in alone.micro_batches}


def test_forward_only_passes_are_asked_for_forward_only():
    lengths = _ranks(2, dp=2, n=16)
    layout = EngineLayout(pp_size=4)
    drafts = [draft_rank(x, 4096, layout, rank=r, cost_model=MODEL, forward_only=True) for r, x in enumerate(lengths)]
    assert all(d.forward_only for d in drafts)
    assert not any(d.error for d in drafts)
    plan = plan_engine_step(lengths, 4096, layout, cost_model=MODEL, forward_only=True)
    check_engine_plan(plan, [16, 16], lengths)
    # without a pipeline nothing is priced: a forward-only pass packs as a training pass
    assert plan_engine_step(lengths, 4096, forward_only=True) == plan_engine_step(lengths, 4096)


def test_a_tight_cap_takes_the_planners_need_with_a_pipeline():
    # 5 x 4 tokens under cap 10: tokens / cap says 2, but 2 micro-batches of <= 10 hold only 4 samples
    plan = plan_engine_step([[4] * 5], 10, EngineLayout(pp_size=4), cost_model=MODEL)
    assert plan.needs == (3,) and plan.count >= 3
    check_engine_plan(plan, [5], [[4] * 5])


def test_a_light_rank_packs_a_count_above_its_reach_when_it_is_agreed():
    heavy = [3000] * 12  # needs 9 micro-batches of <= 4096 tokens
    light = [50] * 30  # needs 1; prices counts up to 1 + MIN_REACH_STEPS only
    layout = EngineLayout(pp_size=4)
    plan = plan_engine_step([heavy, light], 4096, layout, cost_model=MODEL)
    drafts = [draft_rank(x, 4096, layout, rank=r, cost_model=MODEL) for r, x in enumerate([heavy, light])]
    assert plan.count not in drafts[1].scan  # agreed above the light rank's reach
    assert plan.how[1] == "shape"
    check_engine_plan(plan, [12, 30], [heavy, light])
    spans = _priced(layout, MODEL, 4096, [heavy, light], plan.micro_batches)
    assert spans[1] < spans[0]  # the light rank is not the one the step waits for


# ---------------------------------------------------------------------------------------------- the switch
@pytest.mark.parametrize("value,depth", [("1", "engine"), ("true", "engine"), ("engine", "engine"),
                                         ("trainer", "trainer"), ("", None), ("0", None), ("off", None)])
def test_switch_values(value, depth):
    assert switch_from_env({ENV: value}) == depth
    assert switch_from_env({}) is None


def test_bad_switch_value_names_the_fix():
    with pytest.raises(ValueError, match=f"set {ENV}=1"):
        switch_from_env({ENV: "maybe"})


# ---------------------------------------------------------------------------------------------- the trainer depth
@pytest.mark.parametrize("dp,mini", [(2, 8), (4, 32), (8, 64)])
def test_dispatch_keeps_mini_batches_and_equal_chunks_and_balances(dp, mini):
    lengths = np.concatenate(_ranks(11, dp=1, n=4 * mini, hi=8000))
    order = np.asarray(plan_dispatch(lengths, dp, mini, cost_model=MODEL))
    assert sorted(order.tolist()) == list(range(len(lengths)))
    chunks = order.reshape(dp, -1)  # verl: rank r's chunk; its m-th slice of mini // dp samples is mini-batch m
    per = mini // dp
    costs = MODEL.flops(lengths)
    for m in range(4):
        parts = chunks[:, m * per:(m + 1) * per]
        assert set(parts.ravel().tolist()) == set(range(m * mini, (m + 1) * mini)), "a sample changed mini-batch"
        loads = costs[parts].sum(axis=1)
        # no equal-count split beats the mean, nor the costliest sample with the cheapest others to fill its rank;
        # the planner gets within 5% of that bound
        ranked = np.sort(costs[parts].ravel())
        bound = max(loads.mean(), ranked[-1] + ranked[:per - 1].sum())
        assert loads.max() <= 1.05 * bound, (m, loads.max() / loads.mean())


@pytest.mark.parametrize("n,dp,mini", [(30, 4, 8), (32, 3, 8), (32, 4, 6)])
def test_dispatch_refuses_steps_that_are_not_whole_mini_batches(n, dp, mini):
    with pytest.raises(ScheduleError, match="whole mini-batches"):
        plan_dispatch([100] * n, dp, mini)
