"""Samples -> train data: fields, group advantages over rollouts, clear errors for bad samples."""

from __future__ import annotations

import pytest

from slime_ext.rollout.train_data import SampleError, flatten_samples, group_advantages, samples_to_train_data
from slime_ext.rollout.types import Sample


def S(index, group, reward, tokens=(1, 2, 3, 4), response_length=2, loss_mask=None):
    return Sample(index=index, group_index=group, tokens=list(tokens), response_length=response_length,
                  loss_mask=loss_mask, reward=reward)


def test_fields_and_loss_tokens():
    samples = [S(0, 0, 1.0, loss_mask=[1, 0]), S(1, 0, 0.0, tokens=(5, 6, 7), response_length=1)]
    data = samples_to_train_data(samples, vocab_size=8, seq_length=4)
    assert data.tokens == [[1, 2, 3, 4], [5, 6, 7]]
    assert data.total_lengths == [4, 3] and data.response_lengths == [2, 1]
    assert data.loss_masks == [[1, 0], [1]] and data.loss_tokens == [1, 1]
    assert data.rollout_ids == [0, 1]
    assert data.rewards == [1.0, 0.0] and data.advantages == [0.5, -0.5]


def test_advantage_counts_a_multi_sample_rollout_once():
    # group 0: rollout 0 (reward 1, three samples) and rollout 1 (reward 0): mean 0.5, not 0.75
    samples = [S(0, 0, 1.0), S(0, 0, 1.0), S(0, 0, 1.0), S(1, 0, 0.0), S(2, 1, 3.0)]
    assert group_advantages(samples) == [0.5, 0.5, 0.5, -0.5, 0.0]


def test_flatten_groups_and_flat_lists():
    a, b, c = S(0, 0, 0.0), S(1, 0, 0.0), S(2, 1, 0.0)
    assert flatten_samples([[a, b], [c]]) == [a, b, c]
    assert flatten_samples([a, b]) == [a, b]
    with pytest.raises(SampleError, match="no samples"):
        flatten_samples([])
    with pytest.raises(SampleError, match="not a slime_ext.rollout.types.Sample"):
        flatten_samples([{"tokens": [1]}])
    with pytest.raises(SampleError, match="returned dict"):
        flatten_samples({"samples": []})


@pytest.mark.parametrize("sample, message", [
    (S(7, 0, 0.0, response_length=4), r"sample 0 \(rollout 7\): response_length=4 must be in \[1, len\(tokens\)-1=3\]"),
    (S(7, 0, 0.0, tokens=range(9)), r"9 tokens exceed seq_length=8"),
    (S(7, 0, 0.0, tokens=(1, 2, 3, 99)), r"outside \[0, vocab_size=10\)"),
    (S(7, 0, 0.0, loss_mask=[1]), r"loss_mask has 1 entries but response_length=2"),
    (S(7, 0, 0.0, loss_mask=[1, 2]), r"values other than 0 and 1"),
    # slime's Sample.index may be None (the slime integration makes each such sample a rollout of its own);
    # slime-ext's own Sample requires the id: said, not an int() TypeError
    (S(None, 0, 0.0), r"sample 0: index=None is not an integer; give every sample its rollout id"),
])
def test_bad_samples_name_the_sample_and_the_fix(sample, message):
    with pytest.raises(SampleError, match=message):
        samples_to_train_data([sample], vocab_size=10, seq_length=8)


def test_a_rollout_needs_one_reward_and_one_group():
    with pytest.raises(SampleError, match="rollout 3 has samples with different rewards"):
        group_advantages([S(3, 0, 1.0), S(3, 0, 0.0)])
    with pytest.raises(SampleError, match="rollout 3 has samples in groups 0 and 1"):
        group_advantages([S(3, 0, 1.0), S(3, 1, 1.0)])
