"""slime's log-prob passes under ``--log-probs-max-tokens-per-gpu`` (without slime: slime's iterator and
``compute_log_prob`` shapes; tests/hosts runs the real ones): planned apart when the cap is set apart, the training
plan's micro-batches, untouched, when it is not."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from slime_ext.integrations.slime import log_probs
from slime_ext.schedule import ScheduleError


def slime_args(**overrides):
    base = dict(global_batch_size=2, micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=100,
                log_probs_max_tokens_per_gpu=100, balance_data=True, balance_by_flops=False,
                use_dynamic_global_batch_size=False, disable_rollout_trim_samples=False, dp_schedule="rollout",
                pipeline_model_parallel_size=1)
    return SimpleNamespace(**{**base, **overrides})


class SlimeIterator:  # the attributes of slime's DataIterator that slime's forward_only reads
    def __init__(self, rollout_data, micro_batch_indices):
        self.rollout_data, self.micro_batch_indices, self.offset = rollout_data, micro_batch_indices, 0


def _rank_lengths(dp, n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 300, size=n + r).tolist() for r in range(dp)]


def _plans_over_dp(args, rank_lengths, cap):
    """Every DP rank's log-prob plan, the ranks' agreement played out as the DP all-reduce would."""
    calls: list[list[int]] = [[] for _ in rank_lengths]

    def run(answers):  # every rank, each all-reduce answered with what the ranks put in last time
        plans = []
        for r, lengths in enumerate(rank_lengths):
            asked = iter(answers)

            def agree(value, op, r=r, asked=asked):
                calls[r].append(value)
                return next(asked)
            plans.append(log_probs.rank_plan(args, lengths, cap, agree))
        return plans

    run([10**9, 10**9, 0])  # what every rank puts in (its draft's count, its samples)
    most, fewest = max(c[0] for c in calls), min(c[1] for c in calls)
    for c in calls:
        c.clear()
    run([most, fewest, 0])  # the count agreed; whether a rank failed
    failed = max(c[2] for c in calls)
    return run([most, fewest, failed])


def test_the_cap_counts_only_when_set_apart_with_dynamic_batches():
    assert log_probs.log_probs_cap(slime_args()) is None  # slime set it to --max-tokens-per-gpu (unset)
    assert log_probs.log_probs_cap(slime_args(log_probs_max_tokens_per_gpu=None)) is None
    assert log_probs.log_probs_cap(slime_args(log_probs_max_tokens_per_gpu=400)) == 400
    assert log_probs.log_probs_cap(slime_args(log_probs_max_tokens_per_gpu=400, use_dynamic_batch_size=False)) is None
    with pytest.raises(ScheduleError, match="--log-probs-max-tokens-per-gpu 0 must be a positive token count"):
        log_probs.log_probs_cap(slime_args(log_probs_max_tokens_per_gpu=0))


@pytest.mark.parametrize("pp,vpp", [(1, None), (2, None), (2, 2)])
def test_each_rank_plans_its_own_samples_under_the_cap_at_one_count(pp, vpp):
    args = slime_args(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                      microbatch_group_size_per_vp_stage=2 if vpp else None)
    rank_lengths = _rank_lengths(dp=4, n=12, seed=pp)
    plans = _plans_over_dp(args, rank_lengths, cap=600)
    counts = {plan.num_microbatches[0] for plan in plans}
    assert len(counts) == 1 and all(len(p.num_microbatches) == 1 for p in plans), counts
    for plan, lengths in zip(plans, rank_lengths):
        assert len(plan.micro_batch_indices) == plan.num_microbatches[0]
        assert Counter(i for mb in plan.micro_batch_indices for i in mb) == Counter(range(len(lengths)))
        assert all(sum(lengths[i] for i in mb) <= 600 for mb in plan.micro_batch_indices if len(mb) > 1)
        if vpp:
            assert plan.num_microbatches[0] % 2 == 0


def test_a_rank_that_cannot_reach_the_agreed_count_keeps_every_rank_on_the_training_plan():
    args = slime_args()
    # 6 micro-batches of two at the least, against a rank of one sample: the count is 1, which 12 samples of 50
    # tokens cannot fit under a cap of 100
    plans = _plans_over_dp(args, [[50] * 12, [50]], cap=100)
    assert plans == [None, None]


@pytest.mark.parametrize("pp", [1, 2])
def test_a_rank_off_the_agreed_count_is_planned_again_at_it_by_the_planners_request(pp):
    """The lighter rank's own plan has fewer micro-batches than the heavier rank's: it is planned again at the agreed
    count (the request's microbatches_per_rank), every sample once, the cap held; the heavier rank keeps its draft."""
    args = slime_args(pipeline_model_parallel_size=pp)
    heavy, light = [90] * 8 + [60] * 8, [20] * 16
    own = [len(log_probs.plan_forward_only(args, lengths, 200)) for lengths in (heavy, light)]
    assert own[0] > own[1]  # the ranks' own plans disagree
    plans = _plans_over_dp(args, [heavy, light], cap=200)
    assert [p.num_microbatches for p in plans] == [[own[0]], [own[0]]]
    for plan, lengths in zip(plans, [heavy, light], strict=True):
        assert len(plan.micro_batch_indices) == own[0]
        assert sorted(i for mb in plan.micro_batch_indices for i in mb) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in mb) <= 200 for mb in plan.micro_batch_indices if len(mb) > 1)
    assert plans[0].micro_batch_indices == log_probs.plan_forward_only(args, heavy, 200)


def _compute(args, iterators, counts, agree=lambda value, op: value):  # one DP rank
    seen = []

    def slime_compute_log_prob(self, data_iterator, num_microbatches, store_prefix=""):
        seen.append(([list(map(list, it.micro_batch_indices)) for it in data_iterator], list(num_microbatches),
                     store_prefix, data_iterator))
        return {f"{store_prefix}log_probs": []}

    wrapped = log_probs.wrap_compute_log_prob(lambda a: a.dp_schedule == "rollout", slime_compute_log_prob, agree)
    actor = SimpleNamespace(args=args)
    for prefix in ("ref_", ""):  # the reference model's pass, then the actor's
        assert wrapped(actor, iterators, counts, prefix) == {f"{prefix}log_probs": []}
    return seen


def test_unset_the_log_prob_passes_get_the_training_iterators_themselves():
    rollout_data = {"total_lengths": [30, 70, 20, 90, 40]}
    training = [[[0, 1], [2]], [[3], [4]]]  # two steps
    for args in (slime_args(), slime_args(log_probs_max_tokens_per_gpu=400, dp_schedule="legacy")):
        iterators = [SlimeIterator(rollout_data, [mb for step in training for mb in step]) for _ in range(2)]
        for mbs, counts, _, passed in _compute(args, iterators, [2, 2]):
            assert passed is iterators and counts == [2, 2]  # the very objects: bit-identical packing


def test_set_apart_both_passes_walk_one_forward_only_plan_and_training_keeps_its_own():
    lengths = [30, 70, 20, 90, 40, 10]
    rollout_data = {"total_lengths": lengths}
    training = [[0, 1], [2], [3], [4, 5]]
    iterators = [SlimeIterator(rollout_data, training) for _ in range(2)]  # one per virtual stage
    args = slime_args(log_probs_max_tokens_per_gpu=400)
    (ref_mbs, ref_counts, _, ref_its), (mbs, counts, _, its) = _compute(args, iterators, [2, 2])
    assert mbs == ref_mbs and counts == ref_counts == [len(mbs[0])] and its is not iterators
    assert all(stage == mbs[0] for stage in mbs) and len(its) == 2  # every virtual stage walks the same plan
    assert Counter(i for mb in mbs[0] for i in mb) == Counter(range(len(lengths)))
    assert all(sum(lengths[i] for i in mb) <= 400 for mb in mbs[0])
    assert len(mbs[0]) < len(training)  # the larger cap packs the pass into fewer micro-batches
    assert [it.micro_batch_indices for it in iterators] == [training, training]  # training's iterators unchanged
