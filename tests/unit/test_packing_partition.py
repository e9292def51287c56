"""The building blocks: packers and the alignment splitter (ours), the upstream partitioner -- against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_ext import baselines  # upstream's algorithms in our words: the oracle
from slime_ext.schedule import distribute
from slime_ext.schedule.packing import (best_fit_decreasing, cost_lpt_pack, expand_bins_by_splitting, lpt_rounds,
                                        split_bin_by_tokens)
from tests.brute_force import min_bins, min_max_load

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
def test_best_fit_decreasing_is_valid_and_never_worse_than_first_fit(lengths, cap):
    bins = best_fit_decreasing(np.array(lengths), cap)
    assert_packing(bins, lengths, cap)
    assert len(bins) <= len(baselines.first_fit_pack(lengths, cap))


@quick
@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), cap_st)
def test_best_fit_decreasing_within_its_guarantee_of_the_optimum(lengths, cap):
    """BFD uses at most 11/9 OPT + 6/9 bins (Dosa 2007); OPT by brute force over set partitions."""
    opt = min_bins(lengths, cap)
    assert len(best_fit_decreasing(np.array(lengths), cap)) <= 11 * opt / 9 + 6 / 9


def labels_to_bins(bin_of, count):
    return [np.flatnonzero(bin_of == b).tolist() for b in range(count)]


@quick
@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), st.integers(1, 4), st.booleans())
def test_lpt_packs_exactly_the_count_and_balances_like_lpt(lengths, count, by_cost):
    """Without a binding cap both packers must succeed: sequential LPT within Graham's bound (4/3 - 1/(3m)) of the
    optimal max load (brute force); the rounds (one sample per bin per round, heaviest to the lightest bin) keep
    max - min load within the largest weight. With a cap, what they return is a valid packing into ``count``."""
    x = np.array(lengths)
    weights = (x * (x + 50) if by_cost else x).astype(float)
    order = np.argsort(-x, kind="stable")
    count = min(count, len(lengths))
    roomy = int(x.sum())
    opt = min_max_load(weights.tolist(), count)
    bin_of = lpt_rounds(x, weights, order, count, roomy)
    bins = cost_lpt_pack(x, weights, order, count, roomy)
    assert bin_of is not None and bins is not None
    rounds = labels_to_bins(bin_of, count)
    for packing in (rounds, bins):
        assert_packing(packing, lengths, roomy)
        assert len(packing) == count
    assert max(weights[b].sum() for b in bins) <= (4 / 3 - 1 / (3 * count)) * opt + 1e-9
    loads = [weights[b].sum() for b in rounds]
    assert max(loads) - min(loads) <= weights.max() + 1e-9
    cap = max(lengths)
    bin_of = lpt_rounds(x, weights, order, count, cap)
    if bin_of is not None:
        assert_packing(labels_to_bins(bin_of, count), lengths, cap)


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
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=8), st.integers(1, 3), st.booleans())
def test_upstream_karmarkar_karp_against_brute_force(weights, k, equal):
    """Largest differencing is within 4/3 - 1/(3k) of the optimal max group sum (Michiels et al. 2007), keeps
    equal group sizes when asked, and places every item exactly once."""
    if equal:
        weights = weights[: len(weights) // k * k]
    if len(weights) < k:
        with pytest.raises(ValueError):
            baselines.get_seqlen_balanced_partitions(weights, k, equal)
        return
    groups = baselines.karmarkar_karp(weights, k, equal)
    assert len(groups) == k and sorted(i for g in groups for i in g) == list(range(len(weights)))
    sums = [sum(weights[i] for i in g) for g in groups]
    assert sums == sorted(sums, reverse=True)  # heaviest group first, as upstream
    if equal:
        assert {len(g) for g in groups} == {len(weights) // k}
    else:
        assert max(sums) <= (4 / 3 - 1 / (3 * k)) * min_max_load(weights, k) + 1e-9


def test_karmarkar_karp_known_answer():
    # the textbook run of largest differencing on {8,7,6,5,4}: 8-7=1, 6-5=1, 4-1=3, 3-1=2 -> sums 16 and 14
    groups = baselines.karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)
    assert [sum([8, 7, 6, 5, 4][i] for i in g) for g in groups] == [16, 14]
    groups = baselines.karmarkar_karp([1, 2, 3, 4, 5, 6], 3, equal_size=True)
    assert sorted(sum(i + 1 for i in g) for g in groups) == [7, 7, 7]


@pytest.mark.parametrize("per_rank", [3, 20, 130])
def test_refine_by_swaps_both_searches_find_the_same_swaps(per_rank, monkeypatch):
    """The binary-search branch (more than DENSE_SWAP_LIMIT bins per rank) makes the same swaps as the dense one;
    130 bins per rank reach it without the limit lowered. Sizes are kept and the maximum never rises."""
    rng = np.random.default_rng(per_rank)
    for dp in (2, 5):
        costs = rng.lognormal(0.0, 1.0, dp * per_rank)
        start = np.repeat(np.arange(dp), per_rank)
        rng.shuffle(start)
        dense = distribute.refine_by_swaps(costs, start, dp, 1e-9)
        monkeypatch.setattr(distribute, "DENSE_SWAP_LIMIT", 0 if per_rank <= 128 else 10**9)
        other = distribute.refine_by_swaps(costs, start, dp, 1e-9)
        monkeypatch.undo()
        assert dense.tolist() == other.tolist()
        assert np.bincount(dense, minlength=dp).tolist() == [per_rank] * dp
        loads = lambda r: np.bincount(r, weights=costs, minlength=dp).max()  # noqa: E731
        assert loads(dense) <= loads(start) + 1e-9
        assert loads(dense) < loads(start) or loads(start) <= costs.sum() / dp * (1 + 1e-9)
