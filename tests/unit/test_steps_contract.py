"""Stage 1 (:mod:`slime_ext.schedule.steps`) at its edges: the exact boundaries of the dynamic step, the order of
samples inside a step, and refusals that name the field, the value and the fix."""

from __future__ import annotations

import numpy as np
import pytest

from slime_ext.schedule import BatchConfig, ParallelConfig, ScheduleError
from slime_ext.schedule.steps import (compute_dynamic_global_batch_size, dynamic_step_rollouts, rollout_ordinals,
                                      split_into_steps)

DYN = dict(use_dynamic_global_batch_size=True, global_batch_size=None)


def test_dynamic_global_batch_size_edges_and_refusals():
    assert compute_dynamic_global_batch_size(0, 4) == 4  # no samples: still one dp-sized step (upstream's rule)
    assert compute_dynamic_global_batch_size(11, 4) == 8
    with pytest.raises(ScheduleError, match=r"^num_samples must be an integer >= 0, got -1"):
        compute_dynamic_global_batch_size(-1, 4)
    with pytest.raises(ScheduleError, match=r"^dp_size must be a positive integer, got 0; pass the data-parallel "
                                            r"world size$"):
        compute_dynamic_global_batch_size(5, 0)


def test_rollout_ordinals_by_first_occurrence_any_int_ids():
    assert rollout_ordinals(None, 3).tolist() == [0, 1, 2]
    assert rollout_ordinals([-5, 7, -5, 2**40, 7], 5).tolist() == [0, 1, 0, 2, 1]  # negative and large ids are ids
    with pytest.raises(ScheduleError, match=r"^rollout_ids has 2 entries but total_lengths has 3; give exactly one "
                                            r"per sample$"):
        rollout_ordinals([1, 2], 3)
    with pytest.raises(ScheduleError, match=r"^rollout_ids\[1\]"):
        rollout_ordinals([1, 2.5, 3], 3)


def _dynamic(static_mbs=None, **flags):
    return BatchConfig(**DYN, use_dynamic_batch_size=static_mbs is None, max_tokens_per_gpu=None if static_mbs
                       else 1000, micro_batch_size=static_mbs, **flags)


def test_the_dynamic_step_starts_at_exactly_align_samples():
    parallel = ParallelConfig(dp_size=4)
    one_each = np.arange(4)
    assert dynamic_step_rollouts(one_each, np.full(4, 10), parallel, _dynamic()) == 4  # n == align: trains
    with pytest.raises(ScheduleError, match=r"the rollout has 3 samples \(3 rollouts\) but dp_size = 4 micro-batch "
                                            r"slots each need a sample; collect at least 4 samples"):
        dynamic_step_rollouts(np.arange(3), np.full(3, 10), parallel, _dynamic())
    # rollouts of 2, 2, 1 samples: the prefix of 2 rollouts holds exactly 4 = align samples, and is kept
    ordinals = np.array([0, 0, 1, 1, 2])
    rounds = _dynamic(dynamic_global_batch_rounds_samples=True)  # 5 samples rounded down to 4: 2 rollouts
    assert dynamic_step_rollouts(ordinals, np.full(5, 10), parallel, rounds) == 2
    vpp = ParallelConfig(dp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2)
    with pytest.raises(ScheduleError, match=r"but dp_size\*mb_group = 4 micro-batch slots"):
        dynamic_step_rollouts(np.arange(3), np.full(3, 10), vpp, _dynamic())


def test_the_dynamic_step_rounds_inside_the_budget_only_from_align_up():
    parallel = ParallelConfig(dp_size=2)
    # rollouts of 1, 1, 3 samples; budget 4: only the prefix of 2 samples (>= align, <= budget) qualifies
    ordinals = np.array([0, 1, 2, 2, 2])
    assert dynamic_step_rollouts(ordinals, np.full(5, 10), parallel,
                                 _dynamic(dynamic_global_batch_rounds_samples=True)) == 2
    # a first rollout of one sample is below align even though it is inside the budget
    assert dynamic_step_rollouts(np.array([0, 1, 1, 1]), np.full(4, 10), parallel,
                                 _dynamic(dynamic_global_batch_rounds_samples=True)) == 2


def test_static_dynamic_steps_need_a_multiple_of_align_micro_batches():
    parallel = ParallelConfig(dp_size=2)
    # rollouts of 1, 2, 2, 2 samples ending at 1, 3, 5, 7; micro_batch_size 2: ceil(e/2) = 1, 2, 3, 4 micro-batches
    ordinals = np.array([0, 1, 1, 2, 2, 3, 3])
    assert dynamic_step_rollouts(ordinals, np.full(7, 10), parallel, _dynamic(static_mbs=2)) == 4
    # ending at 3 and 7 with micro_batch_size 3: 1 and 3 micro-batches, none a multiple of 2
    ordinals = np.array([0, 0, 0, 1, 1, 1, 1])
    with pytest.raises(ScheduleError) as e:
        dynamic_step_rollouts(ordinals, np.full(7, 10), parallel, _dynamic(static_mbs=3))
    assert str(e.value) == (
        "use_dynamic_global_batch_size: no run of whole rollouts from the first that make a multiple of dp_size = 2 "
        "micro-batches of micro_batch_size=3: the 2 rollouts end at samples 3, 7; collect more samples, change "
        "--micro-batch-size or use --use-dynamic-batch-size")


def test_a_refused_dynamic_step_lists_the_rollout_ends_and_the_fix():
    parallel = ParallelConfig(dp_size=4)
    lengths = np.full(10, 900)  # 10 one-sample rollouts of 900 tokens under a cap of 1000: one per micro-batch ...
    batch = BatchConfig(**DYN, use_dynamic_batch_size=True, max_tokens_per_gpu=1000)
    assert dynamic_step_rollouts(np.arange(10), lengths, parallel, batch) == 8  # ... 8 of them, aligned to 4
    ordinals = np.repeat(np.arange(10), 1)
    lengths = np.full(10, 3000)  # each oversize: alone; 10 rollouts end at 1..10, each prefix fits its count
    assert dynamic_step_rollouts(ordinals, lengths, parallel, batch) == 8
    sizes = [1, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1]  # ends 1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15: none a multiple of 4
    ordinals = np.repeat(np.arange(12), sizes)
    with pytest.raises(ScheduleError) as e:
        dynamic_step_rollouts(ordinals, np.full(15, 10), parallel, _dynamic(static_mbs=1))
    assert "the 12 rollouts end at samples 1, 2, 3, 5, 6, 7, 9, 10, ... 15; collect more samples" in str(e.value)
    with pytest.raises(ScheduleError) as e:
        dynamic_step_rollouts(np.zeros(5, dtype=np.int64), np.full(5, 800), parallel,  # 5 bins, 8 aligned
                              BatchConfig(**DYN, use_dynamic_batch_size=True, max_tokens_per_gpu=1000))
    assert str(e.value).endswith("the 1 rollouts end at samples 5; collect more samples or raise "
                                 "--max-tokens-per-gpu"), str(e.value)


def test_steps_keep_each_rollouts_samples_in_index_order():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 12, 200)
    ordinals = rollout_ordinals(ids, 200)
    steps, per_step, dropped = split_into_steps(ordinals, np.full(200, 10), ParallelConfig(dp_size=2),
                                                BatchConfig(global_batch_size=5, micro_batch_size=1))
    assert per_step == [5, 5] and len(steps) == 2
    for step in steps:
        runs = [[int(i) for i in step if ordinals[i] == k] for k in sorted(set(ordinals[step].tolist()))]
        assert [i for run in runs for i in run] == step.tolist()  # grouped by rollout, first-occurring first
        assert all(run == sorted(run) for run in runs)  # each rollout's samples in index order
    assert dropped.tolist() == sorted(int(i) for i in np.flatnonzero(ordinals >= 10))


def test_every_dynamic_rule_must_hold_at_once():
    """A prefix below align is never kept, even inside the v0.2.4 budget; a static prefix must also stay inside
    the budget; the refusal names both rules."""
    rounds = dict(dynamic_global_batch_rounds_samples=True)
    # rollouts of 1, 1, 7 samples, dp 4, budget 8: prefixes of 1 and 2 samples are inside it but below align
    with pytest.raises(ScheduleError, match="no run of whole rollouts from the first inside slime v0.2.4's 8 "
                                            "samples"):
        dynamic_step_rollouts(np.repeat(np.arange(3), [1, 1, 7]), np.full(9, 10), ParallelConfig(dp_size=4),
                              _dynamic(**rounds))
    # rollouts of 2 and 5 samples, dp 2, micro_batch_size 2, budget 6: 7 samples make 4 micro-batches (a multiple
    # of 2) but lie outside the budget; 2 samples make 1
    with pytest.raises(ScheduleError) as e:
        dynamic_step_rollouts(np.repeat(np.arange(2), [2, 5]), np.full(7, 10), ParallelConfig(dp_size=2),
                              _dynamic(static_mbs=2, **rounds))
    assert ("inside slime v0.2.4's 6 samples (the sample count rounded down to a multiple of dp_size) that make a "
            "multiple of dp_size = 2 micro-batches of micro_batch_size=2: the 2 rollouts end at samples 2, 7") \
        in str(e.value)


def test_eight_rollout_ends_are_shown_whole():
    ordinals = np.repeat(np.arange(8), [1, 1, 1, 2, 1, 1, 2, 1])  # ends 1, 2, 3, 5, 6, 7, 9, 10
    with pytest.raises(ScheduleError) as e:
        dynamic_step_rollouts(ordinals, np.full(10, 10), ParallelConfig(dp_size=4), _dynamic(static_mbs=1))
    assert "the 8 rollouts end at samples 1, 2, 3, 5, 6, 7, 9, 10; collect" in str(e.value)
