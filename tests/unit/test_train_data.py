"""DataIterator, the rollout scheme's training side and RankPayload validation; micro-batch packing; loss scaling."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from slime_ext.schedule import BatchConfig, ParallelConfig, RankPayload, SampleBatch, ScheduleError, plan_schedule
from slime_ext.schemes import get_dp_schedule
from slime_ext.training.batch import pack_micro_batch
from slime_ext.schemes.data import DataIterator, RolloutDataError
from slime_ext.training.loss import loss_scale, policy_loss_sum, token_log_probs

ROLLOUT = get_dp_schedule("rollout")


def _samples(lengths, responses) -> SampleBatch:
    n = len(lengths)
    return SampleBatch(tokens=[list(range(10 * i, 10 * i + L)) for i, L in enumerate(lengths)],
                       total_lengths=list(lengths), response_lengths=list(responses),
                       loss_masks=[[1] * r for r in responses], rewards=[0.0] * n,
                       advantages=[float(i) for i in range(n)], rollout_ids=list(range(n)))


def _payload(**changes) -> RankPayload:
    fields = dict(rollout_id=0, dp_rank=0, dp_size=1, partition=[100, 101, 102], samples=_samples([3, 4, 5], [1, 2, 3]),
                  micro_batch_indices=[[0, 1], [2]], num_microbatches=[2], samples_per_step=[3],
                  rollouts_per_step=[3])
    return RankPayload(**{**fields, **changes})


def test_get_next_returns_lists_per_key():
    it = DataIterator(_payload(), [[0, 2], [1]])
    assert it.get_next(["total_lengths", "sample_indices", "local_index"]) == {
        "total_lengths": [3, 5], "sample_indices": [100, 102], "local_index": [0, 2]}
    assert it.peek(1) == [[1]] and it.offset == 1
    assert it.get_next(["tokens"]) == {"tokens": [[10, 11, 12, 13]]}
    with pytest.raises(RolloutDataError, match="exhausted"):
        it.get_next(["tokens"])
    assert it.reset() is it and it.get_next(["total_lengths"])["total_lengths"] == [3, 5]


def test_rollout_scheme_one_iterator_per_vpp_stage_over_a_real_schedule():
    lengths = [30, 5, 12, 40, 7, 9, 22, 3]
    schedule = plan_schedule(lengths, ParallelConfig(dp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2),
                             BatchConfig(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=48),
                             loss_tokens=[L // 2 for L in lengths])
    rollout = _samples(lengths, [L // 2 for L in lengths])
    for rank in range(2):
        part = schedule.partitions[rank]
        payload = pickle.loads(pickle.dumps(schedule.rank_payload(rank, rollout, rollout_id=4)))  # as through Ray
        assert payload.partition == part and payload.samples.total_lengths == [lengths[i] for i in part]
        steps = ROLLOUT.iterators(None, None, payload, vpp=2)
        iterators, nmb = steps.iterators, steps.num_microbatches
        assert nmb == schedule.num_microbatches and len(iterators) == 2 and iterators[0] is not iterators[1]
        for it in iterators:  # every VPP stage walks the same micro-batches
            got = [it.get_next(["sample_indices"])["sample_indices"] for _ in range(sum(nmb))]
            assert got == [[part[i] for i in mb] for mb in schedule.micro_batch_indices[rank]]
        assert [ROLLOUT.lr_increment(None, payload, s) for s in range(len(nmb))] == schedule.samples_per_step
    with pytest.raises(ScheduleError, match="pass the whole rollout"):
        schedule.rank_payload(0, rollout.take([0, 1]))


def test_the_schemes_refuse_each_others_payloads():
    legacy = _payload(micro_batch_indices=None, num_microbatches=None, samples_per_step=None,
                      rollouts_per_step=None, global_batch_size=3)
    with pytest.raises(RolloutDataError, match="planned for dp_schedule=legacy but this trainer runs "
                                               "dp_schedule=rollout"):
        ROLLOUT.iterators(None, None, legacy, vpp=1)
    with pytest.raises(RolloutDataError, match="takes a slime_ext.schedule.RankPayload, got dict"):
        ROLLOUT.iterators(None, None, {"tokens": []}, vpp=1)


@pytest.mark.parametrize("changes, message", [
    (dict(num_microbatches=[1]), r"num_microbatches=\[1\]: must sum to the 2 micro-batches"),
    (dict(micro_batch_indices=[[1, 0], [2]]), "must tile range"),
    (dict(micro_batch_indices=[[0, 1, 2], []], num_microbatches=[2]), "must tile range"),
    (dict(samples_per_step=[3, 3]), r"samples_per_step=\[3, 3\]: give one entry per step \(1\)"),
    (dict(dp_rank=1), r"dp_rank=1: must be in \[0, dp_size=1\)"),
    (dict(partition=[1]), "give one global id per sample"),
    (dict(micro_batch_indices=None), "the legacy path"),
])
def test_bad_payload_is_rejected_naming_the_field(changes, message):
    with pytest.raises(ScheduleError, match=message):
        _payload(**changes)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(advantages=[0.0]), r"SampleBatch.advantages=<1 entries>"),
    (lambda d: d["loss_masks"].__setitem__(0, [1, 1]), r"loss_masks\[0\]=<2 entries>"),
    (lambda d: d["response_lengths"].__setitem__(1, 4), r"response_lengths\[1\]=4: must be in \[1, total_length-1=3\]"),
    (lambda d: d["tokens"].__setitem__(2, [1]), r"total_lengths\[2\]=5: must equal len\(tokens\[2\]\)=1"),
])
def test_bad_samples_are_rejected_naming_the_field(mutate, message):
    fields = dataclasses.asdict(_samples([3, 4, 5], [1, 2, 3]))
    mutate(fields)
    with pytest.raises(ScheduleError, match=message):
        SampleBatch(**fields)


def test_pack_micro_batch_keeps_samples_apart():
    batch = {"tokens": [[5, 6, 7], [8, 9]], "total_lengths": [3, 2], "response_lengths": [2, 1],
             "loss_masks": [[1, 0], [1]], "advantages": [0.5, -2.0], "sample_indices": [7, 3]}
    packed = pack_micro_batch(batch)
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert packed.logit_positions.tolist() == [0, 1, 3]  # logits at t-1 predict token t
    assert packed.targets.tolist() == [6, 7, 9]
    assert packed.loss_mask.tolist() == [1.0, 0.0, 1.0] and packed.advantages.tolist() == [0.5, 0.5, -2.0]
    assert packed.num_loss_tokens == 2 and packed.sample_ids == [7, 3]
    # THD, as slime's get_batch: sample i is tokens[cu_seqlens[i]:cu_seqlens[i + 1]]
    assert packed.cu_seqlens.tolist() == [0, 3, 5] and packed.cu_seqlens.dtype == torch.int32
    params = packed.packed_seq_params
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 3
    assert params.cu_seqlens_q is params.cu_seqlens_kv is packed.cu_seqlens
    with pytest.raises(ValueError, match="max_position_embeddings=2"):
        pack_micro_batch(batch, max_positions=2)


def test_policy_loss_is_minus_advantage_times_log_prob_over_mask():
    batch = {"tokens": [[1, 2, 3]], "total_lengths": [3], "response_lengths": [2], "loss_masks": [[1, 1]],
             "advantages": [2.0]}
    packed = pack_micro_batch(batch)
    logits = torch.randn(1, 3, 5)
    logp = torch.log_softmax(logits[0], -1)
    expected = -(2.0 * (logp[0, 2] + logp[1, 3]))
    assert torch.allclose(token_log_probs(logits, packed), torch.stack([logp[0, 2], logp[1, 3]]))
    assert torch.allclose(policy_loss_sum(logits, packed), expected)


def test_loss_scale_undoes_megatron_and_ddp_averaging():
    # 3 micro-batches on each of 2 ranks, 40 loss tokens in the step: Megatron divides by 3, DDP by 2
    assert loss_scale(3, 2, 40) == pytest.approx(3 * 2 / 40)
    assert loss_scale(3, 2, 0) == 0.0
