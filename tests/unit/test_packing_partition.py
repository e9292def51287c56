"""The building blocks: packers and the alignment splitter (ours) against brute force, and the splitter against
upstream slime's own (loaded at run time; skipped without an installed slime or ``SLIME_GIT``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_ext.schedule import distribute
from slime_ext.schedule.bounds import bin_lower_bound
from slime_ext.schedule.packing import best_fit_decreasing, grow_to_count, halve_by_tokens, lpt_pack
from slime_ext.schemes import UpstreamUnavailable, upstream
from slime_ext.schemes.legacy import first_fit_count
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
def test_best_fit_decreasing_is_valid_and_opens_no_needless_bin(lengths, cap):
    """Any two bins together hold more than ``cap`` (a bin is opened only for a sample no earlier bin has room for)."""
    bins = best_fit_decreasing(np.array(lengths), cap)
    assert_packing(bins, lengths, cap)
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > cap


def test_best_fit_decreasing_can_lose_to_first_fit_in_the_given_order():
    """Why the bound above is not "never worse than first fit": in the given order [7, 13, 31, 9, 19, 28] packs as
    7+13+31 | 9+19+28 under 56; decreasing order packs 31+19 | 28+13+9 | 7."""
    lengths = [7, 13, 31, 9, 19, 28]
    assert first_fit_count(lengths, 56) == 2
    assert len(best_fit_decreasing(np.array(lengths), 56)) == 3


@quick
@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), cap_st)
def test_best_fit_decreasing_within_its_guarantee_of_the_optimum(lengths, cap):
    """BFD uses at most 11/9 OPT + 6/9 bins (Dosa 2007); OPT by brute force over set partitions."""
    opt = min_bins(lengths, cap)
    assert len(best_fit_decreasing(np.array(lengths), cap)) <= 11 * opt / 9 + 6 / 9


@quick
@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), cap_st)
def test_bin_lower_bound_never_exceeds_the_optimum(lengths, cap):
    """The planner's count bound (tokens, halves, count; oversize alone) is a true lower bound: brute force."""
    assert bin_lower_bound(np.array(lengths), cap) <= min_bins(lengths, cap)


def test_bin_lower_bound_by_count():
    # 9 samples of 10 under cap 25: tokens say 4 bins, but at most 2 samples share a bin, so 5
    assert bin_lower_bound(np.array([10] * 9), 25) == 5 == min_bins([10] * 9, 25)


def labels_to_bins(bin_of, count):
    return [np.flatnonzero(bin_of == b).tolist() for b in range(count)]


def lpt(lengths, weights, count, cap, graham):
    x = np.asarray(lengths)
    bin_of = lpt_pack(x, np.asarray(weights, dtype=float), np.argsort(-x, kind="stable"), count, cap, graham=graham)
    return None if bin_of is None else labels_to_bins(bin_of, count)


@quick
@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), st.integers(1, 4), st.booleans())
def test_lpt_packs_exactly_the_count_and_balances_like_lpt(lengths, count, by_cost):
    """Without a binding cap both deals succeed: with ``graham`` (sequential LPT) within Graham's bound
    4/3 - 1/(3m) of the optimal max load (brute force); whole rounds (one sample per bin per round, heaviest to
    the lightest bin) keep max - min load within the largest weight."""
    x = np.array(lengths)
    weights = (x * (x + 50) if by_cost else x).astype(float)
    count = min(count, len(lengths))
    roomy = int(x.sum())
    opt = min_max_load(weights.tolist(), count)
    for graham in (False, True):
        bins = lpt(x, weights, count, roomy, graham)
        assert bins is not None
        assert_packing(bins, lengths, roomy)
        assert len(bins) == count
        loads = [weights[b].sum() for b in bins]
        if graham:
            assert max(loads) <= (4 / 3 - 1 / (3 * count)) * opt + 1e-9
        else:
            assert max(loads) - min(loads) <= weights.max() + 1e-9


@quick
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 8), cap_st, st.booleans(),
       st.booleans())
def test_lpt_under_a_cap_is_a_valid_packing_or_none(lengths, count, cap, zero_weights, graham):
    """Under a binding cap: exactly ``count`` non-empty bins, the cap holds for every multi-sample bin (an oversize
    sample sits alone), also when every weight is 0 (nothing then steers samples into empty bins). Sequential LPT
    by tokens refuses no step with half its room free: a sample that fits no bin would be above cap/2, and so would
    every sample before it, one per bin."""
    x = np.array(lengths)
    weights = np.zeros(len(x)) if zero_weights else x
    bins = lpt(x, weights, count, cap, graham)
    if bins is not None:
        assert len(bins) == count
        assert_packing(bins, lengths, cap)
    elif graham and not zero_weights and count <= len(lengths) and x.max() <= cap and 2 * x.sum() <= cap * count:
        pytest.fail("sequential LPT refused a step with half its room free")


def test_whole_rounds_break_grahams_bound_and_graham_keeps_it():
    # [3, 1, 1, 1] into 2 bins: whole rounds deal 3|1 then 1|1 (lightest first) -> 4 | 2; sequential LPT: 3 | 1+1+1
    assert sorted(sum([3, 1, 1, 1][i] for i in b) for b in lpt([3, 1, 1, 1], [3, 1, 1, 1], 2, 100, False)) == [2, 4]
    assert sorted(sum([3, 1, 1, 1][i] for i in b) for b in lpt([3, 1, 1, 1], [3, 1, 1, 1], 2, 100, True)) == [3, 3]


def test_each_exception_fits_where_the_deal_before_it_cannot():
    """Why the step packer keeps its fallbacks. Whole rounds stall on [12, 9, 5, 3, 3, 2, 2, 2] into 3 bins of 13
    (the 2s wait behind full bins) where sequential LPT fits (12 | 9+2+2 | 5+3+3+2); and LPT (either deal) spreads
    [5, 5, 4, 3, 3] as 5+4 | 5+3, leaving no room of 3 under a cap of 10, where best fit decreasing fits 5+5 | 4+3+3.
    """
    tight = [12, 9, 5, 3, 3, 2, 2, 2]
    assert lpt(tight, tight, 3, 13, graham=False) is None
    bins = lpt(tight, tight, 3, 13, graham=True)
    assert_packing(bins, tight, 13)
    assert sorted(sum(tight[i] for i in b) for b in bins) == [12, 13, 13]
    little_slack = [5, 5, 4, 3, 3]
    assert lpt(little_slack, little_slack, 2, 10, graham=False) is None
    assert lpt(little_slack, little_slack, 2, 10, graham=True) is None
    bins = best_fit_decreasing(np.array(little_slack), 10)
    assert_packing(bins, little_slack, 10)
    assert len(bins) == 2


@pytest.mark.parametrize("graham", [False, True])
def test_lpt_refuses_what_does_not_fit(graham):
    assert lpt([60, 60, 60], [60, 60, 60], 2, 100, graham) is None
    assert lpt([60], [60], 2, 100, graham) is None  # fewer samples than bins
    assert lpt([500, 400, 10], [500, 400, 10], 2, 100, graham) is None  # two oversize samples close both bins
    bins = lpt([500, 20, 10], [500, 20, 10], 2, 100, graham)
    assert sorted(map(sorted, bins)) == [[0], [1, 2]]


def test_lpt_balances_the_given_weights():
    x = [40, 40, 30, 30, 20, 20, 10, 10]
    for graham in (False, True):
        assert sorted(sum(x[i] for i in b) for b in lpt(x, x, 2, 1000, graham)) == [100, 100]
    weights = [x * x for x in x]  # by FLOPs-like weights: 40^2+30^2+20^2+10^2 on each side
    assert sorted(sum(weights[i] for i in b) for b in lpt(x, weights, 2, 1000, True)) == [3000, 3000]


@quick
@given(lengths_st, cap_st, st.integers(0, 60))
def test_grow_matches_upstream_and_keeps_the_cap(lengths, cap, extra):
    """From upstream's own first-fit bins, our grow_to_count halves exactly as upstream's splitter does."""
    try:
        theirs_module = upstream.load().seqlen_balancing
    except UpstreamUnavailable as e:
        pytest.skip(str(e))
    ours = theirs_module.first_fit_pack(lengths, cap)
    theirs = [list(b) for b in ours]
    target = len(ours) + extra
    grow_to_count(ours, target, lengths)
    theirs_module.expand_bins_by_splitting(theirs, target, lengths)
    assert ours == theirs
    assert_packing(ours, lengths, cap)
    assert len(ours) == min(target, len(lengths))


def test_split_halves_never_exceed_the_parent():
    lengths = [7, 5, 4, 3, 1]
    left, right = halve_by_tokens([0, 1, 2, 3, 4], lengths)
    assert sorted(left + right) == [0, 1, 2, 3, 4]
    assert sum(lengths[i] for i in left) == 10 and sum(lengths[i] for i in right) == 10


@pytest.mark.parametrize("per_rank", [3, 20, 130])
def test_refine_by_swaps_both_searches_find_the_same_swaps(per_rank, monkeypatch):
    """The binary-search branch (more than dense_limit bins per rank) makes the same swaps as the dense one;
    130 bins per rank reach it without the limit lowered. Sizes are kept and the maximum never rises."""
    rng = np.random.default_rng(per_rank)
    for dp in (2, 5):
        costs = rng.lognormal(0.0, 1.0, dp * per_rank)
        start = np.repeat(np.arange(dp), per_rank)
        rng.shuffle(start)
        dense = distribute.refine_by_swaps(costs, start, dp, 1e-9)
        other = distribute.refine_by_swaps(costs, start, dp, 1e-9, dense_limit=0 if per_rank <= 128 else 10**9)
        monkeypatch.undo()
        assert dense.tolist() == other.tolist()
        assert np.bincount(dense, minlength=dp).tolist() == [per_rank] * dp
        loads = lambda r: np.bincount(r, weights=costs, minlength=dp).max()  # noqa: E731
        assert loads(dense) <= loads(start) + 1e-9
        assert loads(dense) < loads(start) or loads(start) <= costs.sum() / dp * (1 + 1e-9)


def test_refine_by_swaps_stops_after_max_rounds():
    """Each round makes at most one swap per (heavy, light) pair: with dp = 2 one round moves one bin each way,
    and further rounds keep lowering the maximum toward the mean."""
    costs = np.array([10.0, 9, 8, 7, 1, 1, 1, 1])
    start = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    loads = lambda r: np.bincount(r, weights=costs, minlength=2)  # noqa: E731
    one = distribute.refine_by_swaps(costs, start, 2, 1e-9, max_rounds=1)
    assert np.count_nonzero(one != start) == 2  # one swap: a bin each way
    assert np.bincount(one, minlength=2).tolist() == [4, 4]
    more = distribute.refine_by_swaps(costs, start, 2, 1e-9)
    assert loads(more).max() < loads(one).max() < loads(start).max()
    assert loads(more).max() == costs.sum() / 2  # 10+7+1+1 = 9+8+1+1


@quick
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 30), st.integers(0, 20)), min_size=1, max_size=40),
       st.integers(1, 6))
def test_lightest_with_room_matches_a_scan(steps, items):
    """Against a plain scan over all items: with needs that never grow, ``pop`` returns the lightest item (lowest
    on ties) whose room is at least the need, or ``None`` when none has room; the popped item comes back with its
    new load and room."""
    needs = sorted((need for need, _, _ in steps), reverse=True)
    heap = distribute.LightestWithRoom((0.0, i, 50) for i in range(items))
    state = {i: (0.0, 50) for i in range(items)}  # item -> (load, room) of the items on offer
    for need, (_, add, used) in zip(needs, steps):
        fits = [(load, i) for i, (load, room) in state.items() if room >= need]
        got = heap.pop(need)
        assert got == (min(fits) if fits else None)
        if got is not None:
            load, i = got
            room = state.pop(i)[1] - min(used, need)
            if room > 0:
                heap.push(load + add, i, room)
                state[i] = (load + add, room)
