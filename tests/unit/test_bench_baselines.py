"""The benchmark's baselines and metrics on tiny inputs, against results worked out by hand; and a one-case run."""

import contextlib
import io
from types import SimpleNamespace

import numpy as np
import pytest

from slime_ext.baselines import (
    calculate_fwd_flops,
    expand_bins_by_splitting,
    first_fit_pack,
    get_minimum_num_micro_batch_size,
    get_seqlen_balanced_partitions,
    karmarkar_karp,
    legacy_schedule,
    reference_schedule,
    split_train_data_by_dp,
)
from slime_ext.metrics import fwd_flops, issue_bound, measure, valid_bound
from bench.run import run

TINY = dict(hidden_size=2, num_layers=1, num_attention_heads=2, num_query_groups=1, kv_channels=1,
            ffn_hidden_size=2, vocab_size=3)
TPC2 = {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}


def _args(**kw):
    base = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=10, micro_batch_size=1, balance_data=False,
                balance_by_flops=False, **TINY)
    base.update(kw)
    return SimpleNamespace(**base)


# ---------------------------------------------------------------------------------------------------- packing
def test_first_fit_is_arrival_order_first_fit():
    # 5 -> b0; 4 -> b1 (9 > 6); 3 -> b2; 2 -> b1 (6); 1 -> b0 (6)
    assert first_fit_pack([5, 4, 3, 2, 1], 6) == [[0, 4], [1, 3], [2]]
    # an oversize sample opens a bin and never takes a partner
    assert first_fit_pack([10, 2, 3], 6) == [[0], [1, 2]]
    assert get_minimum_num_micro_batch_size([5, 4, 3, 2, 1], 6) == 3


def test_expand_splits_the_largest_multi_sample_bin_later_on_ties():
    bins = [[0, 1, 2], [3]]
    expand_bins_by_splitting(bins, 3, [4, 3, 2, 9])  # bin 0 (9 tokens, 3 samples): 4 | 3+2
    assert bins == [[0], [3], [1, 2]]
    bins = [[0, 1], [2, 3]]  # equal sums: the later bin is split
    expand_bins_by_splitting(bins, 3, [1, 1, 1, 1])
    assert bins == [[0, 1], [2], [3]]
    bins = [[0], [1]]  # singletons only: stops short
    expand_bins_by_splitting(bins, 4, [5, 5])
    assert bins == [[0], [1]]


# ---------------------------------------------------------------------------------------------------- KK
def test_kk_equal_size_by_hand():
    # chunks (1,2) and (3,4); the state with the larger top set pops first: {4}+{1}, {3}+{2}
    assert karmarkar_karp([1, 2, 3, 4], 2, equal_size=True) == [[3, 0], [2, 1]]
    assert get_seqlen_balanced_partitions([1, 2, 3, 4], 2, equal_size=True) == [[0, 3], [1, 2]]


def test_kk_is_largest_differencing_not_optimal():
    # LDM on 8,7,6,5,4: differences 1, 1, 3, 2 -> sums 16/14, although 15/15 ({8,7} | {6,5,4}) exists
    parts = get_seqlen_balanced_partitions([8, 7, 6, 5, 4], 2, equal_size=False)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [14, 16]
    with pytest.raises(ValueError, match="2 items cannot fill k_partitions=3"):
        get_seqlen_balanced_partitions([1, 2], 3, equal_size=False)


# ---------------------------------------------------------------------------------------------------- FLOPs
def test_calculate_fwd_flops_by_hand():
    # L=1: q 8, kv 2*1*2*(2//1)*1 = 8, attention 2*2*1/2 + 2 = 4, out 8, mlp 24, lm head 12
    assert calculate_fwd_flops([1], _args()) == 64
    assert calculate_fwd_flops([1, 1], _args()) == 128
    lengths = [1, 7, 100, 4096]
    ours = fwd_flops(lengths, TINY, "upstream")
    assert ours.tolist() == [calculate_fwd_flops([x], _args()) for x in lengths]
    # upstream K/V: 2h*(heads//groups)*kv, exact: 2h*2*groups*kv; upstream output: 2h*h, exact: 2*heads*kv*h
    gqa = dict(TINY, num_attention_heads=4, num_query_groups=2)
    diff = fwd_flops([1], gqa, "exact")[0] - fwd_flops([1], gqa, "upstream")[0]
    assert diff == 2 * 2 * (2 * 2 - 4 // 2) * 1 + (2 * 4 * 1 * 2 - 2 * 2 * 2)


# ---------------------------------------------------------------------------------------------------- (b)
def test_reference_strided_by_hand():
    # first fit cap 10: [6,4] and [6,4]; K = 2 = dp; strided
    sched = reference_schedule(_args(), TPC2, [6, 6, 4, 4], global_batch_size=4, rollout_indices=[0, 1, 2, 3])
    assert sched.partitions == [[0, 2], [1, 3]]
    assert sched.micro_batch_indices == [[[0, 1]], [[0, 1]]]
    assert sched.num_microbatches == [1]


def test_reference_splits_to_align_and_flops_mode_breaks_the_cap():
    # first fit gives [8], [6], [6]: 3 bins, aligned to 4 by splitting... a single-sample bin cannot split
    with pytest.raises(AssertionError):
        reference_schedule(_args(), TPC2, [8, 6, 6], global_batch_size=3, rollout_indices=[0, 1, 2])
    # FLOPs mode: ceil(20 / 10) = 2 bins by KK on FLOPs, no cap: {8} and {6, 6} = 12 tokens > 10
    sched = reference_schedule(_args(balance_by_flops=True), TPC2, [8, 6, 6], global_batch_size=3,
                               rollout_indices=[0, 1, 2])
    tokens = sorted(sum([8, 6, 6][i] for i in p) for p in sched.partitions)
    assert tokens == [8, 12]
    m = measure(sched, [8, 6, 6], dp_size=2, cap=10, align=2, flops=fwd_flops([8, 6, 6], TINY))
    assert m.cap_violations == 1 and not m.problems


def test_reference_groups_rollouts_and_trims_the_tail():
    # rollouts 7 (samples 0, 2) and 9 (1, 3), then 5 (sample 4) trimmed with gbs=2 rollouts
    sched = reference_schedule(_args(), TPC2, [3, 3, 3, 3, 3], global_batch_size=2, rollout_indices=[7, 9, 7, 9, 5])
    assert sorted(i for p in sched.partitions for i in p) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------------- (a)
def test_legacy_takes_the_max_count_over_ranks():
    # strided: rank 0 gets [6, 4] (1 bin), rank 1 [6, 6] (2 bins); MAX = 2, so rank 0 runs two micro-batches
    sched = legacy_schedule([6, 6, 4, 6], dp_size=2, global_batch_size=4, max_tokens_per_gpu=10)
    assert sched.num_microbatches == [2]
    assert sorted(map(sorted, sched.partitions)) == [[0, 2], [1, 3]]
    assert [len(m) for m in sched.micro_batch_indices] == [2, 2]
    assert set(sched.timings) >= {"split", "count", "kk", "wall", "cpu"}


def test_legacy_vpp_rounds_down_and_split_balances_tokens():
    # counts per rank 3; vpp with group 2 rounds DOWN to 2 (upstream), packing 3 bins' worth into 2, over the cap
    lengths = [10, 10, 10, 10, 10, 10]
    sched = legacy_schedule(lengths, dp_size=2, global_batch_size=6, max_tokens_per_gpu=10, vpp_size=2,
                            microbatch_group_size_per_vp_stage=2)
    assert sched.num_microbatches == [2]
    m = measure(sched, lengths, dp_size=2, cap=10, align=2, flops=fwd_flops(lengths, TINY))
    assert m.cap_violations == 2
    # balance_data: equal-size KK on tokens over the whole rollout; each partition sorted
    assert split_train_data_by_dp([1, 2, 3, 4], 2, balance_data=True) == [[0, 3], [1, 2]]
    assert split_train_data_by_dp([1, 2, 3, 4, 5], 2, balance_data=False) == [[0, 2, 4], [1, 3]]


# ---------------------------------------------------------------------------------------------------- metrics
def test_bounds_by_hand():
    # three 16400-token samples: three micro-batches suffice, the token-only bound says 4
    assert valid_bound([16400] * 3, 16384, 1) == 3
    assert issue_bound(3 * 16400, 16384, 1) == 4
    # five 6000-token samples: 2 by tokens, but at most 2 fit a bin -> 3; aligned to 4
    assert valid_bound([6000] * 5, 16384, 1) == 3
    assert valid_bound([6000] * 5, 16384, 4) == 4


def test_measure_flags_a_broken_schedule():
    bad = SimpleNamespace(partitions=[[0, 1], [1]], micro_batch_indices=[[[0, 1]], [[0]]], num_microbatches=[1])
    m = measure(bad, [1, 1], dp_size=2, cap=10, align=2, flops=np.ones(2))
    assert any("twice" in p for p in m.problems)


def test_one_case_runs_every_scheme():
    """One small benchmark case end to end (its speed is the benchmark's business, not a test's)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run(["--cases", "rl-1k-dp8", "--repeats", "1"])
    text = out.getvalue()
    assert rc == 0
    for flags in ("strided", "balance_data", "balance_by_flops", "both"):
        for scheme in ("ours", "legacy", "reference"):
            assert any(line.split()[:2] == [flags, scheme] for line in text.splitlines()), (flags, scheme)
    assert "targets (issue 2)" in text and "zero cap violations (ours): 0" in text
    assert " bad" not in text  # every scheme's schedule passed the shape checks
