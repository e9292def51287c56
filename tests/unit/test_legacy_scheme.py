"""The runtime legacy scheme: first-fit counts, all-reduce MAX, VPP rounding (down, as upstream), an even deal without
a cap, LR by gbs -- and the same schedule as the benchmark's legacy baseline on the same rollout."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from slime_ext.schedule import BatchConfig, ParallelConfig, RankPayload, SampleBatch
from slime_ext.schemes import LegacyPlanError, LegacyStepRecord, RankSteps, RecordError, get_dp_schedule
from slime_ext.schemes.legacy import LegacyRank, split_over_ranks
from slime_ext.schemes import data
from slime_ext.schemes.data import RolloutDataError

LEGACY = get_dp_schedule("legacy")


@pytest.fixture
def fake_parallel(monkeypatch):
    """dp=2, no real process group: the peer rank's first-fit counts come from ``peer_counts``."""
    state = SimpleNamespace(dp=2, vpp=1, group=1, peer_counts=None)
    monkeypatch.setattr(data, "parallel_sizes", lambda model: (state.dp, None, state.vpp, state.group, 1))

    def all_reduce(tensor, op=None, group=None):
        tensor.copy_(torch.maximum(tensor, torch.tensor(state.peer_counts, dtype=tensor.dtype)))

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return state


def _payload(lengths, gbs=8, dp_rank=0, partition=None):
    n = len(lengths)
    samples = SampleBatch(tokens=[[1] * L for L in lengths], total_lengths=list(lengths),
                          response_lengths=[1] * n, loss_masks=[[1]] * n, rewards=[0.0] * n, advantages=[0.0] * n,
                          rollout_ids=list(range(n)))
    return RankPayload(rollout_id=0, dp_rank=dp_rank, dp_size=2, partition=partition or list(range(n)),
                       samples=samples, global_batch_size=gbs)


DYNAMIC = SimpleNamespace(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=50,
                          micro_batch_size=None)


def test_dynamic_counts_take_the_dp_max_and_the_deal_fills_them_without_a_cap(fake_parallel):
    lengths = [40, 30, 20, 10, 45, 5, 5, 5]  # steps of 4 local samples: first fit needs 2 and 2 bins
    fake_parallel.peer_counts = [3, 1]  # the other rank needs 3 in step 0
    steps = LEGACY.iterators(DYNAMIC, None, _payload(lengths))
    assert steps.num_microbatches == [3, 2] and steps.local_microbatches == [2, 2]
    mbs = steps.iterators[0].micro_batch_indices
    assert len(mbs) == 5 and sorted(i for mb in mbs[:3] for i in mb) == [0, 1, 2, 3]
    assert sorted(i for mb in mbs[3:] for i in mb) == [4, 5, 6, 7]
    fake_parallel.peer_counts = [1, 1]
    steps = LEGACY.iterators(DYNAMIC, None, _payload([30, 30, 30, 30, 2, 2, 2, 2]))
    assert steps.num_microbatches == [4, 1]  # no two 30-token samples share a 50-token bin


def test_runtime_is_the_benchmarks_legacy_schedule(fake_parallel):
    """Per rank, the runtime's micro-batches are exactly those of the benchmark's ``LegacySchedule.schedule`` (one
    implementation), and both refuse the same rollouts."""
    rng = random.Random(3)
    batch = BatchConfig(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=50, balance_data=True)
    refused = 0
    for _ in range(30):
        longest = rng.choice([12, 60])  # short steps fit one bin: below one VPP group, refused
        lengths = [rng.randint(2, longest) for _ in range(16)]
        vpp, group = rng.choice([(1, 1), (2, 2)])
        parallel = ParallelConfig(dp_size=2, vpp_size=vpp, microbatch_group_size_per_vp_stage=group)
        try:
            sched = LEGACY.schedule(lengths, parallel, batch, global_batch_size=8)
        except LegacyPlanError:  # only where upstream's rounding clamps below one group
            sched = None
        split = split_over_ranks(lengths, 2, True)
        counts = [LegacyRank(8, 2, cap=50, micro_batch_size=None).counts([lengths[i] for i in p]) for p in split]
        fake_parallel.vpp, fake_parallel.group = vpp, group
        for r, part in enumerate(split):
            fake_parallel.peer_counts = counts[1 - r]
            payload = _payload([lengths[i] for i in part], dp_rank=r, partition=part)
            if sched is None:
                with pytest.raises(LegacyPlanError, match="below one microbatch_group_size_per_vp_stage"):
                    LEGACY.iterators(DYNAMIC, None, payload)
                refused += 1
                continue
            steps = LEGACY.iterators(DYNAMIC, None, payload)
            iterators, nmb = steps.iterators, steps.num_microbatches
            assert nmb == sched.num_microbatches and len(iterators) == vpp and steps.local_microbatches == counts[r]
            assert [[part[i] for i in mb] for mb in iterators[0].micro_batch_indices] == \
                [[sched.partitions[r][i] for i in mb] for mb in sched.micro_batch_indices[r]]
    assert 0 < refused < 60  # both outcomes were met


def test_vpp_rounds_down_as_upstream_and_refuses_below_one_group(fake_parallel):
    fake_parallel.vpp, fake_parallel.group = 2, 2
    args = SimpleNamespace(**{**vars(DYNAMIC), "max_tokens_per_gpu": 35})
    fake_parallel.peer_counts = [3]
    steps = LEGACY.iterators(args, None, _payload([10, 20, 30, 15]))
    # 3 bins by first fit, rounded down to the group of 2
    assert steps.num_microbatches == [2] and len(steps.iterators) == 2 and steps.local_microbatches == [3]
    fake_parallel.peer_counts = [1]
    with pytest.raises(LegacyPlanError, match="below one microbatch_group_size_per_vp_stage=2"):
        LEGACY.iterators(SimpleNamespace(**{**vars(DYNAMIC), "max_tokens_per_gpu": 100}), None,
                                          _payload([10, 20, 30, 15]))


def test_static_counts_and_loud_errors(fake_parallel):
    args = SimpleNamespace(global_batch_size=8, use_dynamic_batch_size=False, micro_batch_size=2,
                           max_tokens_per_gpu=None)
    steps = LEGACY.iterators(args, None, _payload([5] * 8))
    assert steps.num_microbatches == [2, 2] == steps.local_microbatches
    assert steps.iterators[0].micro_batch_indices == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(LegacyPlanError, match="would drop 1 samples"):
        LEGACY.iterators(args, None, _payload([5] * 9))
    with pytest.raises(LegacyPlanError, match="multiple of dp_size=2"):
        LEGACY.iterators(args, None, _payload([5] * 8, gbs=7))
    planned = RankPayload(**{**vars(_payload([5] * 2)), "global_batch_size": None, "micro_batch_indices": [[0, 1]],
                             "num_microbatches": [1], "samples_per_step": [2], "rollouts_per_step": [2]})
    with pytest.raises(RolloutDataError, match="planned for dp_schedule=rollout"):
        LEGACY.iterators(args, None, planned)


def test_lr_steps_by_the_global_batch_size_whatever_the_step_held():
    assert LEGACY.lr_increment(SimpleNamespace(global_batch_size=32), _payload([5] * 8, gbs=32), 0) == 32
    # use_dynamic_global_batch_size: no --global-batch-size; the rollout side's step size (samples) is the increment
    dynamic = SimpleNamespace(global_batch_size=None, use_dynamic_global_batch_size=True)
    assert LEGACY.lr_increment(dynamic, _payload([5] * 6, gbs=6), 0) == 6


def test_static_counts_must_fill_whole_vpp_groups(fake_parallel):
    """The same refusal as the run-config pre-check (one function, LegacyRank.counts, decides both)."""
    fake_parallel.vpp, fake_parallel.group = 2, 2
    args = SimpleNamespace(global_batch_size=6, use_dynamic_batch_size=False, micro_batch_size=1,
                           max_tokens_per_gpu=None)
    with pytest.raises(LegacyPlanError, match="3 micro-batches per rank and step is not a multiple of "
                                              "microbatch_group_size_per_vp_stage=2"):
        LEGACY.iterators(args, None, _payload([5] * 3, gbs=6))
    assert LEGACY.iterators(args, None, _payload([5] * 4, gbs=8)).num_microbatches == [4]


def test_each_step_records_the_count_this_rank_needed_before_the_ranks_agreed(fake_parallel):
    fake_parallel.peer_counts = [3, 1]
    payload = _payload([40, 30, 20, 10, 45, 5, 5, 5])
    steps = LEGACY.iterators(DYNAMIC, None, payload)
    measured = dict(loss=0.5, lr=1e-3, samples=8, seconds=0.1, ledger=[[0]], loss_tokens=4, grad_norm=None,
                    lr_increment=8, scheduler_samples=8, update_successful=True)
    records = [LEGACY.record(steps, payload, step=s, num_microbatches=n, **measured)
               for s, n in enumerate(steps.num_microbatches)]
    assert all(type(r) is LEGACY.step_record is LegacyStepRecord for r in records)
    # step 0: 2 first-fit bins here, 3 on the peer: one micro-batch split off to keep the ranks in lockstep
    assert [(r.num_microbatches, r.local_microbatches) for r in records] == [(3, 2), (2, 2)]
    with pytest.raises(RecordError, match="LegacyStepRecord.local_microbatches=0: must be an integer >= 1"):
        LegacyStepRecord(step=0, num_microbatches=1, local_microbatches=0, **measured)
    with pytest.raises(TypeError, match="records steps from its own iterators"):
        LEGACY.record(RankSteps(steps.iterators, steps.num_microbatches), payload, step=0, num_microbatches=3,
                      **measured)
