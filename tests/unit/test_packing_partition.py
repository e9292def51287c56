"""The building blocks: packers, the alignment splitter and the balanced partitioners."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_ext.schedule import best_fit_decreasing, expand_bins_by_splitting, first_fit_pack, karmarkar_karp, lpt_rounds
from slime_ext import baselines  # upstream's loops, spelled out: the oracle
from slime_ext.schedule.packing import cost_lpt_pack
from slime_ext.schedule.packing import split_bin_by_tokens
from slime_ext.schedule.partition import refine_equal_size

lengths_st = st.lists(st.integers(1, 300), min_size=1, max_size=120)
cap_st = st.integers(50, 400)
quick = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_packing(bins, lengths, cap):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    for b in bins:
        assert b, "empty bin"
        assert sum(lengths[i] for i in b) <= cap or len(b) == 1


@quick
@given(lengths_st, cap_st)
def test_first_fit_matches_upstream_loop(lengths, cap):
    assert first_fit_pack(lengths, cap) == baselines.first_fit_pack(lengths, cap)


@quick
@given(lengths_st, cap_st)
def test_best_fit_decreasing_is_valid_and_never_worse_than_first_fit(lengths, cap):
    bins = best_fit_decreasing(np.array(lengths), cap)
    assert_packing(bins, lengths, cap)
    assert len(bins) <= len(baselines.first_fit_pack(lengths, cap))


def labels_to_bins(bin_of, count):
    return [np.flatnonzero(bin_of == b).tolist() for b in range(count)]


@quick
@given(lengths_st, cap_st, st.integers(1, 40), st.booleans())
def test_lpt_gives_exactly_the_count_or_none(lengths, cap, count, by_cost):
    x = np.array(lengths)
    weights = x * (x + 50) if by_cost else x
    order = np.argsort(-x, kind="stable")
    bin_of = lpt_rounds(x, weights, order, count, cap)
    if bin_of is not None:
        assert_packing(labels_to_bins(bin_of, count), lengths, cap)
    bins = cost_lpt_pack(x, weights.astype(float), order, count, cap) if count <= len(lengths) else None
    if bins is not None:
        assert len(bins) == count
        assert_packing(bins, lengths, cap)


def test_lpt_refuses_what_does_not_fit():
    x = np.array([60, 60, 60])
    assert lpt_rounds(x, x, np.arange(3), 2, 100) is None
    assert lpt_rounds(np.array([60]), np.array([60]), np.arange(1), 2, 100) is None  # fewer samples than bins
    bin_of = lpt_rounds(np.array([500, 20, 10]), np.array([500, 20, 10]), np.arange(3), 2, 100)
    assert sorted(map(sorted, labels_to_bins(bin_of, 2))) == [[0], [1, 2]]


def test_lpt_rounds_balances_the_given_weights():
    x = np.array([40, 40, 30, 30, 20, 20, 10, 10])
    bin_of = lpt_rounds(x, x, np.argsort(-x, kind="stable"), 2, 1000)
    assert np.bincount(bin_of, weights=x).tolist() == [100, 100]


@quick
@given(lengths_st, cap_st, st.integers(0, 60))
def test_expand_matches_upstream_and_keeps_the_cap(lengths, cap, extra):
    ours = baselines.first_fit_pack(lengths, cap)
    theirs = [list(b) for b in ours]
    target = len(ours) + extra
    expand_bins_by_splitting(ours, target, lengths)
    baselines.expand_bins_by_splitting(theirs, target, lengths)
    assert ours == theirs
    assert_packing(ours, lengths, cap)
    assert len(ours) == min(target, len(lengths))


def test_split_halves_never_exceed_the_parent():
    lengths = [7, 5, 4, 3, 1]
    left, right = split_bin_by_tokens([0, 1, 2, 3, 4], lengths)
    assert sorted(left + right) == [0, 1, 2, 3, 4]
    assert sum(lengths[i] for i in left) == 10 and sum(lengths[i] for i in right) == 10


@quick
@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=60), st.integers(1, 8), st.booleans())
def test_karmarkar_karp_partitions(weights, k, equal):
    if equal:
        weights = weights[: len(weights) // k * k]
    if len(weights) < k:
        with pytest.raises(ValueError):
            karmarkar_karp(weights, k, equal)
        return
    groups = karmarkar_karp(weights, k, equal)
    assert len(groups) == k
    assert sorted(i for g in groups for i in g) == list(range(len(weights)))
    if equal:
        assert {len(g) for g in groups} == {len(weights) // k}
    # largest differencing never does worse than putting the largest item alone on top of the mean
    sums = [sum(weights[i] for i in g) for g in groups]
    assert max(sums) <= sum(weights) / k + max(weights) + 1e-6


def test_karmarkar_karp_known_answer():
    # the textbook run of largest differencing on {8,7,6,5,4}: 8-7=1, 6-5=1, 4-1=3, 3-1=2 -> sums 16 and 14
    groups = karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in g) for g in groups) == [14, 16]
    groups = karmarkar_karp([1, 2, 3, 4, 5, 6], 3, equal_size=True)
    assert sorted(sum(i + 1 for i in g) for g in groups) == [7, 7, 7]


@quick
@given(st.lists(st.floats(0, 1e3), min_size=4, max_size=60), st.integers(2, 6))
def test_refinement_keeps_sizes_and_never_raises_the_maximum(weights, k):
    weights = weights[: len(weights) // k * k]
    if len(weights) < k:
        return
    groups = karmarkar_karp(weights, k, equal_size=True)
    before = max(sum(weights[i] for i in g) for g in groups)
    refined = refine_equal_size(weights, groups)
    assert sorted(map(len, refined)) == sorted(map(len, groups))
    assert sorted(i for g in refined for i in g) == list(range(len(weights)))
    assert max(sum(weights[i] for i in g) for g in refined) <= before + 1e-9
