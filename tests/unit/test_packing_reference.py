"""The packers against plain-loop references written from their docstrings (not from their code): the same bins,
sample by sample, ties included, on random inputs with many equal lengths. The vectorised packers of
:mod:`slime_ext.schedule.packing` must make exactly the packing their documentation describes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slime_ext.schedule.packing import best_fit_decreasing, bins_to_labels, grow_to_count, halve_by_tokens, lpt_pack


def reference_bfd(lengths, cap):
    """Longest first (equal lengths in index order); each into the bin with the least room that still has room for
    it (the lowest bin index among equals), else a new bin."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fitting = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fitting:
            b = min(fitting, key=lambda b: (room[b], b))
            bins[b].append(i)
            room[b] -= lengths[i]
        else:
            bins.append([i])
            room.append(cap - lengths[i])
    return bins


def reference_halve(members, lengths):
    """Longest first (ties in bin order), each to the half holding fewer tokens so far (the first on a tie)."""
    halves, tokens = ([], []), [0, 0]
    for i in sorted(members, key=lambda m: -lengths[m]):
        h = 0 if tokens[0] <= tokens[1] else 1
        halves[h].append(i)
        tokens[h] += lengths[i]
    return [halves[0], halves[1]]


def reference_grow(bins, target, lengths):
    """Halve the bin with the most tokens among those of two or more samples (the higher index among equals),
    appending the second half, until ``target`` bins or nothing can be halved."""
    bins = [list(b) for b in bins]
    while len(bins) < target:
        cuttable = [j for j, b in enumerate(bins) if len(b) > 1]
        if not cuttable:
            break
        j = max(cuttable, key=lambda j: (sum(lengths[i] for i in bins[j]), j))
        kept, moved = reference_halve(bins[j], lengths)
        bins[j] = kept
        bins.append(moved)
    return bins


def reference_lpt(lengths, weights, order, num_bins, cap, graham=False):
    """Rounds: the waiting samples (earlier leftovers first, largest first) are dealt to the open bins, the k-th to
    the k-th lightest by weight (ties: lower bin); with ``graham`` the round ends before the first sample whose bin
    would no longer be the lightest. A sample that overflows its bin tries the bins unused this round, most room
    first; else it waits. An oversize sample takes an empty bin and closes it. ``None`` when a round places
    nothing."""
    n = len(order)
    if n < num_bins:
        return None
    lens = [int(lengths[i]) for i in order]
    w = [float(weights[i]) for i in order]
    where, load, wload = [-1] * n, [0] * num_bins, [0.0] * num_bins
    open_bins, waiting, nxt = list(range(num_bins)), [], 0
    while nxt < n or waiting:
        fresh = min(n - nxt, max(0, len(open_bins) - len(waiting)))
        take = waiting[:len(open_bins)] + list(range(nxt, nxt + fresh))
        later, nxt = waiting[len(open_bins):], nxt + fresh
        dest = sorted(open_bins, key=lambda b: wload[b])[:len(take)]
        keep = len(take)
        if graham:
            lowest = math.inf
            for k in range(len(take) - 1):
                lowest = min(lowest, wload[dest[k]] + w[take[k]])
                if lowest < wload[dest[k + 1]]:
                    keep = k + 1
                    break
        cut, take, dest = take[keep:], take[:keep], dest[:keep]
        fits = [load[d] == 0 or load[d] + lens[t] <= cap for t, d in zip(take, dest)]
        used = {d for d, f in zip(dest, fits) if f}
        spare = [b for b in sorted(open_bins, key=lambda b: load[b]) if b not in used]
        for k, alt in zip([k for k, f in enumerate(fits) if not f], spare):
            if load[alt] == 0 or load[alt] + lens[take[k]] <= cap:
                dest[k], fits[k] = alt, True
        placed = [(t, d) for t, d, f in zip(take, dest, fits) if f]
        for t, d in placed:
            where[t] = d
            load[d] += lens[t]
            wload[d] += w[t]
        if any(lens[t] > cap for t, _ in placed):
            open_bins = [b for b in open_bins if load[b] <= cap]
        waiting = sorted([t for t, f in zip(take, fits) if not f] + cut + later)
        if not placed:
            return None
    bin_of = [0] * n
    for pos, i in enumerate(order):
        bin_of[i] = where[pos]
    return bin_of


def random_lengths(rng, n):
    """Lengths with many ties (a few distinct values) or spread, some over a cap of 100."""
    if rng.random() < 0.5:
        return rng.choice(rng.integers(1, 130, int(rng.integers(1, 5))), n).astype(np.int64)
    return rng.integers(1, 130, n).astype(np.int64)


@pytest.mark.parametrize("seed", range(60))
def test_best_fit_decreasing_is_the_documented_deal(seed):
    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng, int(rng.integers(1, 200)))
    assert best_fit_decreasing(lengths, 100) == reference_bfd(lengths.tolist(), 100)


@pytest.mark.parametrize("seed", range(60))
def test_halving_and_growing_are_the_documented_cuts(seed):
    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng, int(rng.integers(2, 60)))
    members = rng.permutation(len(lengths)).tolist()
    assert halve_by_tokens(members, lengths) == reference_halve(members, lengths.tolist())
    bins = reference_bfd(lengths.tolist(), 100)
    for target in (len(bins), len(bins) + 1, len(bins) + 7, len(lengths), len(lengths) + 3):
        grown = [list(b) for b in bins]
        grow_to_count(grown, target, lengths if seed % 2 else lengths.tolist())
        assert grown == reference_grow(bins, target, lengths.tolist()), target
        assert all(grown) and len(grown) == min(target, len(lengths)) or len(grown) == len(bins) >= target


def test_halving_examples():
    assert halve_by_tokens([0, 1], [5, 3]) == [[0], [1]]
    assert halve_by_tokens([1, 0], [4, 4]) == [[1], [0]]  # a tie goes to the first half, bin order kept
    # 5 | 4 4 | 1 joins the first (5 < 8) | 1 joins the first again (6 < 8)
    assert halve_by_tokens([0, 1, 2, 3, 4], [5, 4, 4, 1, 1]) == [[0, 3, 4], [1, 2]]


@pytest.mark.parametrize("seed", range(150))
def test_lpt_is_the_documented_deal(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 90))
    lengths = random_lengths(rng, n)
    weights = lengths.astype(np.float64) ** 2 if seed % 3 == 0 else lengths.astype(np.float64)
    order = np.lexsort((-weights, -lengths)) if seed % 2 else np.argsort(-lengths, kind="stable")
    num_bins = int(rng.integers(1, max(2, n // 2 + 1)))
    cap = int(rng.choice([100, 160, 300, 1000]))
    for graham in (False, True):
        got = lpt_pack(lengths, weights, order, num_bins, cap, graham=graham)
        want = reference_lpt(lengths, weights, order, num_bins, cap, graham=graham)
        assert (got is None) == (want is None), (graham, got, want)
        if got is not None:
            assert got.tolist() == want and got.dtype == np.int64, graham  # labels index arrays


def test_lpt_edges():
    order = np.array([0, 1])
    # a bin filled exactly to the cap is fine
    assert lpt_pack(np.array([60, 40]), np.array([60.0, 40.0]), order, 1, 100).tolist() == [0, 0]
    # an oversize sample takes an empty bin and closes it; the rest go elsewhere
    got = lpt_pack(np.array([500, 30, 20]), np.array([500.0, 30.0, 20.0]), np.array([0, 1, 2]), 2, 100)
    assert got.tolist() == [0, 1, 1]
    # the second chance: the lightest bin by weight has no room, the spare bin (most room) takes the sample
    lengths, weights = np.array([10, 6, 6, 4]), np.array([100.0, 36.0, 36.0, 16.0])
    assert lpt_pack(lengths, weights, np.arange(4), 3, 12).tolist() == \
        reference_lpt(lengths, weights, np.arange(4), 3, 12)
    assert lpt_pack(np.array([5]), np.array([5.0]), np.array([0]), 2, 100) is None  # fewer samples than bins
    # whole rounds by default: [3, 1, 1, 1] into 2 bins is 4 | 2 (graham would give 3 | 3)
    four = np.array([3, 1, 1, 1])
    assert np.bincount(lpt_pack(four, four.astype(float), np.arange(4), 2, 100), weights=four).tolist() == [4, 2]


@pytest.mark.parametrize("lengths, weights, order, num_bins, cap, graham", [
    # found by a differential search over mutants (zero weights): the second chance takes a bin filled exactly
    # to the cap, and a sample of exactly the cap does not close its bin
    ([3, 1, 6, 21, 8, 6, 1, 8, 15, 22, 22, 5, 15], [0, 1, 6, 21, 8, 6, 1, 0, 15, 22, 22, 5, 15],
     [9, 10, 3, 8, 12, 4, 7, 2, 5, 11, 0, 1, 6], 9, 12, False),
    ([6, 8, 19, 5, 13, 21, 20], [0, 0, 0, 0, 13, 21, 0], [5, 6, 2, 4, 1, 0, 3], 5, 20, True),
])
def test_lpt_at_the_cap_with_weightless_samples(lengths, weights, order, num_bins, cap, graham):
    lengths, weights, order = np.array(lengths), np.array(weights, dtype=float), np.array(order)
    got = lpt_pack(lengths, weights, order, num_bins, cap, graham=graham)
    assert got is not None
    assert got.tolist() == reference_lpt(lengths, weights, order, num_bins, cap, graham=graham)


def test_bins_to_labels():
    labels = bins_to_labels([[2, 0], [1], [3]], 4)
    assert labels.tolist() == [0, 1, 0, 2] and labels.dtype == np.int64
