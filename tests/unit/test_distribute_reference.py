"""Stage 4's dealers against plain-loop references written from their docstrings (not from their code): the same
ranks, bin by bin, ties included, on random inputs with integer costs (exact sums, many ties)."""

from __future__ import annotations

import numpy as np
import pytest

from slime_ext.schedule.distribute import (build_rank_bins, lpt_equal_count, rank_bins_to_labels, refine_by_swaps,
                                           serpentine)
from tests.unit.test_packing_reference import reference_grow


def by_decreasing_cost(costs):
    return sorted(range(len(costs)), key=lambda b: -costs[b])  # equal costs in bin order


def reference_serpentine(costs, dp):
    """Bins by decreasing cost dealt 0..dp-1, dp-1..0, 0..dp-1, ..."""
    out = [0] * len(costs)
    for pos, b in enumerate(by_decreasing_cost(costs)):
        rnd, r = divmod(pos, dp)
        out[b] = r if rnd % 2 == 0 else dp - 1 - r
    return out


def reference_lpt_equal_count(costs, dp):
    """Round k gives the next dp bins (by decreasing cost) to the ranks in increasing order of their load so far."""
    out, load = [0] * len(costs), [0.0] * dp
    order = by_decreasing_cost(costs)
    for start in range(0, len(costs), dp):
        for b, r in zip(order[start:start + dp], sorted(range(dp), key=lambda r: load[r])):
            out[b] = r
            load[r] += costs[b]
    return out


def reference_refine(costs, rank_of_bin, dp, tolerance, max_rounds=50):
    """Each round pairs the i-th heaviest rank with the i-th lightest and in every pair makes the one swap that
    brings the two closest to their average (moving d with 0 < d < gap; the first such pair of positions on a
    tie); stops within tolerance of the mean, when a round does not lower the maximum, or after max_rounds."""
    rows = [[b for b in range(len(costs)) if rank_of_bin[b] == r] for r in range(dp)]
    sums = [float(sum(costs[b] for b in row)) for row in rows]
    goal = sum(sums) / dp * (1 + tolerance)
    for _ in range(max_rounds):
        ranked = sorted(range(dp), key=lambda r: sums[r])
        if sums[ranked[-1]] <= goal:
            break
        swaps = []
        for h, lo in zip(ranked[::-1][:dp // 2], ranked[:dp // 2]):
            gap, best = sums[h] - sums[lo], None
            for a, ba in enumerate(rows[h]):
                for b, bb in enumerate(rows[lo]):
                    d = costs[ba] - costs[bb]
                    if 0 < d < gap and (best is None or abs(d - gap / 2) < best[0]):
                        best = (abs(d - gap / 2), a, b)
            if best is not None:
                swaps.append((h, lo, best[1], best[2]))
        if not swaps:
            break
        before = max(sums)
        for h, lo, a, b in swaps:
            moved = costs[rows[h][a]] - costs[rows[lo][b]]
            rows[h][a], rows[lo][b] = rows[lo][b], rows[h][a]
            sums[h] -= moved
            sums[lo] += moved
        if max(sums) >= before:
            break
    out = [0] * len(costs)
    for r, row in enumerate(rows):
        for b in row:
            out[b] = r
    return out


def reference_rank_bins(lengths, costs, order, cap, dp, per_rank, by_cost):
    """Samples in ``order`` to the lightest rank (by cost dealt; lowest on ties) whose roomiest bin has room
    (an oversize sample needs an empty bin); in it, the fullest bin with room (best fit), or with ``by_cost`` the
    cheapest (lowest on ties). Then ranks with fewer samples than bins take the cheapest samples of ranks with
    more, and empty bins are filled by halving the rank's largest bins. ``None`` when a sample fits no rank."""
    room = [[cap] * per_rank for _ in range(dp)]
    bins = [[[] for _ in range(per_rank)] for _ in range(dp)]
    bin_cost = [[0.0] * per_rank for _ in range(dp)]
    rank_cost = [0.0] * dp
    for i in order:
        need = min(int(lengths[i]), cap)
        ranks = [r for r in range(dp) if max(room[r]) >= need]
        if not ranks:
            return None
        r = min(ranks, key=lambda r: (rank_cost[r], r))
        fitting = [b for b in range(per_rank) if room[r][b] >= need]
        b = min(fitting, key=(lambda b: (bin_cost[r][b], b)) if by_cost else (lambda b: (room[r][b], b)))
        bins[r][b].append(i)
        room[r][b] -= int(lengths[i])
        bin_cost[r][b] += float(costs[i])
        rank_cost[r] += float(costs[i])
    counts = [sum(map(len, rb)) for rb in bins]
    donors = sorted((float(costs[i]), i, d, k) for d, db in enumerate(bins) if counts[d] > per_rank
                    for k, b in enumerate(db) for i in b)
    for r, rb in enumerate(bins):
        while counts[r] < per_rank:
            _, i, d, k = donors.pop(0)
            if counts[d] <= per_rank:
                continue
            bins[d][k].remove(i)
            counts[d] -= 1
            next(b for b in rb if not b).append(i)
            counts[r] += 1
    return [reference_grow([b for b in rb if b], per_rank, [int(x) for x in lengths]) for rb in bins]


def integer_costs(rng, n):
    return rng.integers(1, int(rng.choice([4, 50, 1000])), n).astype(np.float64)


@pytest.mark.parametrize("seed", range(80))
def test_serpentine_lpt_and_swaps_are_the_documented_deals(seed):
    rng = np.random.default_rng(seed)
    dp = int(rng.integers(1, 9))
    costs = integer_costs(rng, dp * int(rng.integers(1, 12)))
    assert serpentine(costs, dp).tolist() == reference_serpentine(costs.tolist(), dp)
    start = lpt_equal_count(costs, dp)
    assert serpentine(costs, dp).dtype == start.dtype == np.int64  # ranks index arrays
    assert start.tolist() == reference_lpt_equal_count(costs.tolist(), dp)
    shuffled = rng.permutation(np.repeat(np.arange(dp), len(costs) // dp))
    # the binary-search branch (dense_limit=0) makes the same swaps only where no two swaps score alike: on tied
    # scores it may pick another of the best swaps, so it is compared on costs without ties
    untied = costs + rng.random(len(costs)) * 1e-3
    for initial in (start, shuffled):
        for tolerance in (0.0, 0.01, 0.2):
            want = reference_refine(costs.tolist(), initial.tolist(), dp, tolerance)
            assert refine_by_swaps(costs, initial, dp, tolerance).tolist() == want, tolerance
            # dense_limit bins per rank are still scored densely
            dense = refine_by_swaps(costs, initial, dp, tolerance, dense_limit=len(costs) // dp)
            assert dense.tolist() == want and dense.dtype == np.int64, tolerance
            want = reference_refine(untied.tolist(), initial.tolist(), dp, tolerance)
            assert refine_by_swaps(untied, initial, dp, tolerance, dense_limit=0).tolist() == want, tolerance


def test_no_swap_without_one_that_narrows_the_gap():
    """Loads 10 | 6: a swap of equal costs moves nothing, 5 <-> 1 moves the whole gap: neither is made, in either
    branch."""
    costs, start = np.array([5.0, 5.0, 5.0, 1.0]), np.array([0, 0, 1, 1])
    for dense_limit in (0, 8):
        assert refine_by_swaps(costs, start, 2, 0.0, dense_limit=dense_limit).tolist() == [0, 0, 1, 1]


def test_refine_stops_within_tolerance_and_after_max_rounds():
    costs = np.array([10.0, 9, 8, 7, 1, 1, 1, 1])
    start = np.array([0, 0, 0, 0, 1, 1, 1, 1])  # loads 34 | 4, mean 19
    assert refine_by_swaps(costs, start, 2, 1.0).tolist() == start.tolist()  # 34 <= 19 * 2: within tolerance
    assert refine_by_swaps(costs, start, 2, 0.7).tolist() != start.tolist()  # 34 > 19 * 1.7
    for rounds in (1, 2, 3):
        assert refine_by_swaps(costs, start, 2, 0.0, max_rounds=rounds).tolist() == \
            reference_refine(costs.tolist(), start.tolist(), 2, 0.0, max_rounds=rounds)


@pytest.mark.parametrize("seed", range(80))
def test_rank_bins_are_the_documented_deal(seed):
    rng = np.random.default_rng(seed)
    dp, per_rank = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    n = dp * per_rank + int(rng.integers(0, 40))
    lengths = rng.integers(1, int(rng.choice([60, 130, 400])), n).astype(np.int64)
    costs = lengths.astype(np.float64) ** 2 if seed % 2 else integer_costs(rng, n)
    order = np.lexsort((-lengths, -costs))
    cap = int(rng.choice([100, 200, 1000]))
    for by_cost in (False, True):
        got = build_rank_bins(lengths, costs, order, cap, dp, per_rank, by_cost)
        want = reference_rank_bins(lengths, costs, order.tolist(), cap, dp, per_rank, by_cost)
        assert got == want, by_cost
        if got is not None:
            bin_of, rank_of_bin = rank_bins_to_labels(got, n)
            assert bin_of.dtype == rank_of_bin.dtype == np.int64
            assert rank_of_bin.tolist() == [r for r in range(dp) for _ in got[r]]
            assert all(bin_of[i] == sum(len(rb) for rb in got[:r]) + k
                       for r in range(dp) for k, b in enumerate(got[r]) for i in b)


@pytest.mark.parametrize("seed", range(30, 90))  # seed 46: a donor gives its last spare sample, then is skipped
def test_ranks_left_short_by_a_costly_sample_take_the_cheapest_samples(seed):
    """A few very costly samples leave their ranks with fewer samples than bins: those ranks take the cheapest
    samples of ranks with more (the documented donation, never below a donor's own count), then halve their
    largest bins."""
    rng = np.random.default_rng(seed)
    dp, per_rank = int(rng.integers(2, 5)), int(rng.integers(2, 5))
    n = dp * per_rank + int(rng.integers(0, 3))
    lengths = rng.integers(1, 60, n).astype(np.int64)
    costs = rng.integers(1, 20, n).astype(np.float64)
    costs[rng.choice(n, int(rng.integers(1, dp)), replace=False)] = 10_000.0  # ranks that get nothing else
    order = np.lexsort((-lengths, -costs))
    for by_cost in (False, True):
        got = build_rank_bins(lengths, costs, order, 200, dp, per_rank, by_cost)
        assert got == reference_rank_bins(lengths, costs, order.tolist(), 200, dp, per_rank, by_cost), by_cost
        assert [len(rb) for rb in got] == [per_rank] * dp and all(b for rb in got for b in rb)


def test_cheapest_bin_among_bins_of_equal_room():
    """By cost, two bins of a rank can have the same room: the one chosen is the one whose room is updated (found
    by a differential search over surviving mutants; this deal ends with a sample that fits no rank)."""
    lengths = np.array([5, 5, 5, 3, 4, 4, 3, 3, 5, 2, 5, 5, 2, 4])
    costs = np.array([1.0, 5.0, 1.0, 3.0, 5.0, 4.0, 1.0, 4.0, 1.0, 5.0, 2.0, 5.0, 4.0, 4.0])
    order = np.array([1, 11, 4, 9, 5, 13, 7, 12, 3, 10, 0, 2, 8, 6])
    assert build_rank_bins(lengths, costs, order, 8, 2, 4, True) is None
    assert reference_rank_bins(lengths, costs, order.tolist(), 8, 2, 4, True) is None
