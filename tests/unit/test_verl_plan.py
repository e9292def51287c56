"""The verl engine-depth plan (slime_ext.integrations.verl.plan) and the switch, without verl installed."""

import numpy as np
import pytest

from slime_ext.integrations.verl import ENV, switch_from_env
from slime_ext.integrations.verl.plan import EngineLayout, check_engine_plan, plan_dispatch, plan_engine_step
from slime_ext.schedule import CostModel, ScheduleError

MODEL = CostModel(hidden_size=1024, num_layers=8, num_attention_heads=16, vocab_size=32000, swiglu=True)
LAYOUTS = [EngineLayout(), EngineLayout(pp_size=4), EngineLayout(pp_size=2, vpp_size=2, vpp_group=2),
           EngineLayout(pp_size=2, vpp_size=2, vpp_group=4)]


def _ranks(seed, dp, n, hi=3000):
    rng = np.random.default_rng(seed)
    return [np.maximum(1, rng.lognormal(6.0, 1.0, size=n)).astype(int).clip(max=hi).tolist() for _ in range(dp)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("seed", range(4))
def test_plan_holds_the_invariants_on_every_layout(layout, seed):
    lengths = _ranks(seed, dp=4, n=24)
    plan = plan_engine_step(lengths, 4096, layout, cost_model=MODEL)
    check_engine_plan(plan, [len(x) for x in lengths], lengths, layout.align)  # count, coverage, cap
    if layout.pp_size == 1:  # no pipeline: the largest count any rank's own plan needs
        assert plan.count == max(plan.own_counts)
    else:  # a pipeline may choose fewer (its slowest replica predicted faster), never more
        assert plan.count <= max(plan.own_counts)
    assert plan.count % layout.align == 0
    for r, x in enumerate(lengths):  # the cap never needed fewer micro-batches than ceil(tokens / cap)
        assert plan.count >= -(-sum(x) // 4096)


def test_verl_over_cap_example_is_held():
    # verl's ceil(tokens / cap) = 2 bins for [6, 6, 6] under cap 10 puts 12 tokens in one; slime-ext needs 3
    plan = plan_engine_step([[6, 6, 6]], 10)
    assert plan.count == 3
    assert sorted(len(mb) for mb in plan.micro_batches[0]) == [1, 1, 1]


def test_ranks_agree_on_the_largest_count_and_are_planned_alike():
    lengths = [[6, 6, 6], [3, 3, 3]]
    plan = plan_engine_step(lengths, 10)
    assert plan.own_counts == (3, 1) and plan.count == 3 and plan.how == ("own", "recount")
    # deterministic: every rank computes the same plan from the same gathered lengths
    assert plan_engine_step(lengths, 10) == plan


def test_min_count_rounds_up_to_the_vpp_group():
    plan = plan_engine_step([[10] * 12, [10] * 12], 1000, EngineLayout(pp_size=2, vpp_size=2, vpp_group=4),
                            min_count=5)
    assert plan.count == 8


def test_too_few_samples_for_the_cap_is_a_clear_error():
    with pytest.raises(ScheduleError, match="raise max_token_len_per_gpu"):
        plan_engine_step([[9, 9, 9, 9], [9]], 10)


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
