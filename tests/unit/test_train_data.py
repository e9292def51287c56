"""DataIterator, get_data_iterator and rollout_data validation; micro-batch packing; loss scaling."""

from __future__ import annotations

import pytest
import torch

from slime_ext.schedule import BatchConfig, ParallelConfig, plan_schedule
from slime_ext.training.batch import block_causal_mask, pack_micro_batch
from slime_ext.training.data import DataIterator, RolloutDataError, get_data_iterator, step_bounds
from slime_ext.training.loss import loss_scale, policy_loss_sum, token_log_probs


def _rollout_data(lengths, responses, schedule=None, rank=0):
    n = len(lengths)
    data = {
        "tokens": [list(range(10 * i, 10 * i + L)) for i, L in enumerate(lengths)],
        "total_lengths": list(lengths),
        "response_lengths": list(responses),
        "loss_masks": [[1] * r for r in responses],
        "rewards": [0.0] * n,
        "advantages": [float(i) for i in range(n)],
        "sample_indices": [100 + i for i in range(n)],
    }
    if schedule is not None:
        data.update(schedule.rank_payload(rank))
    return data


def test_get_next_returns_lists_per_key_and_none_for_absent_keys():
    data = _rollout_data([3, 4, 5], [1, 2, 3])
    it = DataIterator(data, [[0, 2], [1]])
    assert it.get_next(["total_lengths", "sample_indices", "nope"]) == {
        "total_lengths": [3, 5], "sample_indices": [100, 102], "nope": None}
    assert it.peek(1) == [[1]] and it.offset == 1
    assert it.get_next(["tokens"]) == {"tokens": [[10, 11, 12, 13]]}
    with pytest.raises(RolloutDataError, match="exhausted"):
        it.get_next(["tokens"])
    assert it.reset() is it and it.get_next(["total_lengths"])["total_lengths"] == [3, 5]


def test_data_iterator_rejects_micro_batch_size():
    with pytest.raises(TypeError, match="takes micro_batch_indices"):
        DataIterator({}, 4)


def test_get_data_iterator_one_per_vpp_stage_over_a_real_schedule():
    lengths = [30, 5, 12, 40, 7, 9, 22, 3]
    schedule = plan_schedule(lengths, ParallelConfig(dp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2),
                             BatchConfig(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=48),
                             loss_tokens=[L // 2 for L in lengths])
    for rank in range(2):
        part = schedule.partitions[rank]
        data = _rollout_data([lengths[i] for i in part], [lengths[i] // 2 for i in part], schedule, rank)
        iterators = get_data_iterator(data, vpp_size=2)
        assert len(iterators) == 2 and iterators[0] is not iterators[1]
        for it in iterators:  # every VPP stage walks the same micro-batches
            got = [it.get_next(["total_lengths"])["total_lengths"] for _ in range(sum(data["num_microbatches"]))]
            assert got == [[lengths[part[i]] for i in mb] for mb in schedule.micro_batch_indices[rank]]
    assert step_bounds([2, 3, 1]) == [(0, 2), (2, 5), (5, 6)]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("micro_batch_indices"), "missing the schedule fields"),
    (lambda d: d.update(num_microbatches=[1]), r"sum\(num_microbatches\)=1"),
    (lambda d: d.update(micro_batch_indices=[[1, 0], [2]]), "must tile range"),
    (lambda d: d.update(micro_batch_indices=[[0, 1, 2], []]), "must tile range"),
    (lambda d: d.update(samples_per_step=[3, 3]), "samples_per_step has 2 entries"),
    (lambda d: d.update(advantages=[0.0]), r"rollout_data\['advantages'\] has 1 entries"),
    (lambda d: d["loss_masks"].__setitem__(0, [1, 1]), "len\\(loss_masks\\)=2 but response_lengths=1"),
    (lambda d: d["response_lengths"].__setitem__(1, 4), r"response_lengths=4 must be in \[1, total_length-1=3\]"),
    (lambda d: d["tokens"].__setitem__(2, [1]), "len\\(tokens\\)=1 but total_lengths=5"),
])
def test_bad_rollout_data_is_rejected_naming_the_field(mutate, message):
    data = _rollout_data([3, 4, 5], [1, 2, 3])
    data.update(micro_batch_indices=[[0, 1], [2]], num_microbatches=[2], samples_per_step=[3])
    mutate(data)
    with pytest.raises(RolloutDataError, match=message):
        get_data_iterator(data, vpp_size=1)


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
    allowed = ~block_causal_mask([3, 2])[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]],
                            dtype=torch.bool)
    assert torch.equal(allowed, expected)
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
