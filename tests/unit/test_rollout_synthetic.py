"""The synthetic rollout generator: seeded, long-tailed, multi-sample rollouts, loss masks with holes."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

from slime_ext.rollout.synthetic import SYNTHETIC_DEFAULTS, generate_rollout, synthetic_bounds
from slime_ext.rollout.train_data import flatten_samples


def _args(**kw):
    base = dict(seq_length=128, vocab_size=100, rollout_batch_size=8, n_samples_per_prompt=4, rollout_seed=3)
    return SimpleNamespace(**{**SYNTHETIC_DEFAULTS, **base, **kw})


def _samples(args, rollout_ids=range(1)):
    return [s for rid in rollout_ids for s in flatten_samples(generate_rollout(args, rid))]


def test_same_seed_and_rollout_id_give_the_same_samples():
    a, b = _samples(_args()), _samples(_args())
    assert [(s.index, s.tokens, s.loss_mask, s.reward) for s in a] == [(s.index, s.tokens, s.loss_mask, s.reward)
                                                                      for s in b]
    other = _samples(_args(rollout_seed=4))
    assert [s.tokens for s in other] != [s.tokens for s in a]


def test_groups_rollout_ids_and_bounds():
    args = _args()
    groups = generate_rollout(args, 5)
    assert len(groups) == args.rollout_batch_size
    for p, group in enumerate(groups):
        assert {s.group_index for s in group} == {5 * args.rollout_batch_size + p}
        assert len({s.index for s in group}) == args.n_samples_per_prompt
    ids0 = {s.index for s in _samples(args, [0])}
    ids1 = {s.index for s in _samples(args, [1])}
    assert not ids0 & ids1, "rollout ids must be unique over the run"
    for s in _samples(args, range(4)):
        assert 0 <= min(s.tokens) and max(s.tokens) < args.vocab_size
        assert 1 <= s.response_length < len(s.tokens) <= args.seq_length
        assert len(s.loss_mask) == s.response_length


def test_response_lengths_are_long_tailed_and_capped():
    args = _args(rollout_batch_size=32)
    resp = np.array([s.response_length for s in _samples(args, range(8))])
    assert np.percentile(resp, 99) > 3 * np.median(resp)
    assert resp.max() <= args.seq_length - SYNTHETIC_DEFAULTS["synthetic_prompt_length_min"]


def test_multi_sample_rollouts_share_id_group_and_reward():
    args = _args()
    by_rollout = defaultdict(list)
    for s in _samples(args, range(4)):
        by_rollout[s.index].append(s)
    sizes = [len(v) for v in by_rollout.values()]
    assert max(sizes) > 1 and min(sizes) == 1 and max(sizes) <= args.synthetic_max_samples_per_rollout
    for samples in by_rollout.values():
        assert len({s.reward for s in samples}) == 1 and len({s.group_index for s in samples}) == 1
    single = _samples(_args(synthetic_multi_sample_prob=0.0), range(2))
    assert len(single) == len({s.index for s in single}) == 2 * args.rollout_batch_size * args.n_samples_per_prompt
    assert synthetic_bounds(_args(synthetic_multi_sample_prob=0.0))["max_samples_per_rollout"] == 1


def test_loss_masks_have_holes_but_keep_the_ends():
    samples = _samples(_args(), range(4))
    holed = [s for s in samples if 0 in s.loss_mask]
    assert holed, "some responses should have untrained spans"
    assert all(s.loss_mask[0] == 1 and s.loss_mask[-1] == 1 for s in samples)
    assert not any(0 in s.loss_mask for s in _samples(_args(synthetic_masked_span_prob=0.0)))


def test_rewards_vary_inside_a_group():
    groups = generate_rollout(_args(), 0)
    assert all(len({s.reward for s in g}) > 1 for g in groups)


def test_prompt_longer_than_seq_length_is_an_error():
    with pytest.raises(ValueError, match="synthetic_prompt_length_max"):
        generate_rollout(_args(seq_length=16, synthetic_prompt_length_max=16), 0)
