"""Train data -> per-DP-rank payloads: the rollout-side schedule and the legacy split; no sample is lost silently."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slime_ext.rollout.dispatch import plan_rollout
from slime_ext.rollout.synthetic import SYNTHETIC_DEFAULTS, generate_rollout
from slime_ext.rollout.train_data import flatten_samples, samples_to_train_data
from slime_ext.schedule import SampleBatch, ScheduleError, check_schedule
from slime_ext.schemes.legacy import balanced_groups

MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=128)


def _args(**kw):
    base = dict(rollout_batch_size=6, n_samples_per_prompt=2, rollout_seed=5, global_batch_size=4,
                use_dynamic_batch_size=True, max_tokens_per_gpu=96, micro_batch_size=1, balance_data=True,
                dp_schedule="rollout", **MODEL)
    return SimpleNamespace(**{**SYNTHETIC_DEFAULTS, **base, **kw})


def _data(args, rollout_id=0):
    return samples_to_train_data(flatten_samples(generate_rollout(args, rollout_id)))


def _tpc(dp, vpp=1, group=1):
    return {"dp_size": dp, "cp_size": 1, "vpp_size": vpp, "microbatch_group_size_per_vp_stage": group}


def _assert_every_sample_once(plan, data):
    owned = [i for p in plan.partitions for i in p]
    assert len(owned) == len(set(owned))
    assert sorted(owned + plan.dropped) == list(range(len(data)))
    assert sorted(i for s in plan.step_samples for i in s) == sorted(owned)
    for r, payload in enumerate(plan.payloads):
        for key in SampleBatch.KEYS:
            assert getattr(payload.samples, key) == [getattr(data, key)[i] for i in plan.partitions[r]], key
        assert payload.dp_rank == r and payload.partition == plan.partitions[r]


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("balance", [False, True])
def test_rollout_path_payload_is_partition_plus_rank_slice(dp, balance):
    args = _args(balance_data=balance, global_batch_size=5)
    data = _data(args)
    plan = plan_rollout(data, args, _tpc(dp), rollout_id=3)
    _assert_every_sample_once(plan, data)
    assert check_schedule(plan.schedule, total_lengths=data.total_lengths) == []
    for r, payload in enumerate(plan.payloads):
        assert payload == plan.schedule.rank_payload(r, data, rollout_id=3) and payload.planned
    # 12 rollouts, 5 per step: two steps, the last 2 rollouts dropped -- and the reason says so
    assert plan.num_steps == 2 and plan.dropped
    dropped_rollouts = {data.rollout_ids[i] for i in plan.dropped}
    assert len(dropped_rollouts) == 2 and "2 trailing rollouts" in plan.dropped_reason
    assert plan.schedule.loss_tokens_per_step == [sum(data.loss_tokens[i] for i in s) for s in plan.step_samples]


def test_rollout_path_keeps_a_rollout_in_one_step():
    args = _args(global_batch_size=3)
    data = _data(args)
    plan = plan_rollout(data, args, _tpc(2))
    step_of = {i: s for s, samples in enumerate(plan.step_samples) for i in samples}
    for rid in set(data.rollout_ids):
        steps = {step_of.get(i, "dropped") for i, r in enumerate(data.rollout_ids) if r == rid}
        assert len(steps) == 1


def test_rollout_path_vpp_alignment():
    args = _args(global_batch_size=6)
    plan = plan_rollout(_data(args), args, _tpc(1, vpp=2, group=2))
    assert all(n % 2 == 0 for n in plan.schedule.num_microbatches)


def test_planner_errors_pass_through():
    args = _args(global_batch_size=1)  # one rollout per step, dp=4: a rank without a sample
    with pytest.raises(ScheduleError, match="dp_size = 4"):
        plan_rollout(_data(args, 0), args, _tpc(4))


def test_legacy_strided_split_trims_by_samples():
    args = _args(dp_schedule="legacy", global_batch_size=6, balance_data=False)
    data = _data(args)
    n = len(data)
    plan = plan_rollout(data, args, _tpc(2))
    keep = n // 6 * 6
    assert plan.schedule is None
    assert plan.partitions == [list(range(0, keep, 2)), list(range(1, keep, 2))]
    assert plan.dropped == list(range(keep, n)) and bool(plan.dropped_reason) == (keep < n)
    _assert_every_sample_once(plan, data)
    # the training side cuts each rank's samples into steps of global_batch_size / dp_size
    assert plan.step_samples[0] == sorted(plan.partitions[0][:3] + plan.partitions[1][:3])
    assert all(not p.planned and p.global_batch_size == 6 for p in plan.payloads)


def test_legacy_balanced_split_is_an_equal_size_deal_by_tokens():
    args = _args(dp_schedule="legacy", global_batch_size=6, balance_data=True)
    data = _data(args)
    plan = plan_rollout(data, args, _tpc(2))
    keep = len(data) // 6 * 6
    assert plan.partitions == balanced_groups(data.total_lengths[:keep], 2, equal_size=True)
    assert len({len(p) for p in plan.partitions}) == 1
    _assert_every_sample_once(plan, data)


def test_legacy_dynamic_global_batch_size():
    args = _args(dp_schedule="legacy", use_dynamic_global_batch_size=True, global_batch_size=None)
    data = _data(args)
    n = len(data)
    plan = plan_rollout(data, args, _tpc(4))
    assert plan.num_steps == 1 and len(plan.step_samples[0]) == n // 4 * 4
    assert all(p.global_batch_size == n // 4 * 4 for p in plan.payloads)
    assert plan.dropped == list(range(n // 4 * 4, n))


def test_legacy_trim_disabled_is_an_error():
    args = _args(dp_schedule="legacy", global_batch_size=100, disable_rollout_trim_samples=True)
    with pytest.raises(ScheduleError, match="not even one step"):
        plan_rollout(_data(args), args, _tpc(2))
    args = _args(dp_schedule="legacy", global_batch_size=10, disable_rollout_trim_samples=True)
    data = _data(args)
    if len(data) % 10:
        with pytest.raises(ScheduleError, match="disable-rollout-trim-samples"):
            plan_rollout(data, args, _tpc(2))


def test_unknown_dp_schedule():
    with pytest.raises(ScheduleError, match="dp_schedule='planner'"):
        plan_rollout(_data(_args()), _args(dp_schedule="planner"), _tpc(2))
