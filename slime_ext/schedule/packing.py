"""Bin packing of samples into micro-batches under a token cap.

Packers return bins of indices into ``lengths`` (``list[list[int]]``), or, vectorised, ``bin_of`` labels per
sample. A sample longer than the cap always sits alone in its bin; every other bin holds at most ``cap`` tokens.

* :func:`best_fit_decreasing` -- fewest bins in practice (within 11/9 OPT + 1 of the optimum).
* :func:`lpt_rounds` -- exactly ``num_bins`` bins, evenly loaded by tokens or by FLOPs (worst-fit decreasing,
  vectorised by rounds); :func:`cost_lpt_pack` -- the same by FLOPs, sequential. ``None`` when they cannot fit.
* :func:`expand_bins_by_splitting` -- grow a packing to a target count by halving the largest multi-sample bins;
  halves never exceed their parent, so the cap keeps holding.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from itertools import chain
from typing import Sequence

import numpy as np


def best_fit_decreasing(lengths: np.ndarray, cap: int, order: np.ndarray | None = None) -> list[list[int]]:
    """Best fit decreasing: longest first, each into the fullest bin that still has room.

    ``order`` may pass a precomputed decreasing-length order. Residuals live in one sorted list of
    ``residual * stride + bin`` keys, so "smallest residual >= length" is a single bisect.
    """
    if order is None:
        order = np.argsort(-np.asarray(lengths), kind="stable")
    stride = len(order) + 1
    keys: list[int] = []  # sorted; only bins that can still take something
    bins: list[list[int]] = []
    lens = np.asarray(lengths)[order].tolist()
    for idx, length in zip(order.tolist(), lens):
        pos = bisect_left(keys, length * stride)
        if pos == len(keys):
            b = len(bins)
            bins.append([idx])
            residual = cap - length
        else:
            key = keys.pop(pos)
            b = key % stride
            bins[b].append(idx)
            residual = key // stride - length
        if residual > 0:
            insort(keys, residual * stride + b)
    return bins


def split_bin_by_tokens(bin_indices: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """Split one bin into two halves balanced by tokens (longest first, each to the lighter half).

    Both halves are subsets of the bin, so neither exceeds the bin's token count.
    """
    halves: list[list[int]] = [[], []]
    sums = [0, 0]
    for idx in sorted(bin_indices, key=lambda i: -int(lengths[i])):
        h = 0 if sums[0] <= sums[1] else 1
        halves[h].append(idx)
        sums[h] += int(lengths[idx])
    return halves


def expand_bins_by_splitting(
    bins: list[list[int]], target_count: int, lengths: Sequence[int], loads: Sequence[int] | None = None
) -> None:
    """Grow ``bins`` in place to ``target_count`` by repeatedly halving the largest multi-sample bin.

    Stops early when every bin is a single sample (the caller checks the count). Ties between equally large bins
    go to the later bin, as upstream. ``loads`` may pass the bins' token counts when the caller has them.
    """
    if len(bins) >= target_count:
        return
    lens = lengths.tolist() if isinstance(lengths, np.ndarray) else lengths
    if loads is None:
        loads = [sum(lens[i] for i in b) for b in bins]
    heap = [(-load, -j) for j, (load, b) in enumerate(zip(loads, bins)) if len(b) > 1]
    heapq.heapify(heap)
    while len(bins) < target_count and heap:
        _, neg_j = heapq.heappop(heap)
        j = -neg_j
        left, right = split_bin_by_tokens(bins[j], lens)
        bins[j] = left
        bins.append(right)
        for k, half in ((j, left), (len(bins) - 1, right)):
            if len(half) > 1:
                heapq.heappush(heap, (-sum(lens[i] for i in half), -k))


def lpt_rounds(
    lengths: np.ndarray, weights: np.ndarray, order: np.ndarray, num_bins: int, cap: int
) -> np.ndarray | None:
    """LPT into exactly ``num_bins`` capped bins, vectorised by rounds; returns ``bin_of`` per sample or ``None``.

    ``order`` lists the samples by decreasing length (and weight). Each round deals the next samples, one per open
    bin, the largest to the bin with the least ``weights`` load so far (tokens for even micro-batches, FLOPs for
    ``balance_by_flops``). A sample that would overflow its bin gets a second chance in a bin left unused this round
    (most room first), else waits for the next round. An oversize sample takes an empty bin and closes it. ``None``
    when a round places nothing: LPT spreads the free room evenly, so with little slack the last samples can be
    larger than every bin's room -- sequential best fit decreasing then packs tighter.
    """
    n = len(order)
    if n < num_bins:
        return None
    lens = lengths[order]
    w = weights[order].astype(np.float64)
    bin_of_sorted = np.full(n, -1, dtype=np.int64)
    load = np.zeros(num_bins, dtype=np.int64)
    wload = np.zeros(num_bins, dtype=np.float64)
    open_bins = np.arange(num_bins)
    pending = np.zeros(0, dtype=np.int64)  # positions (largest first) that did not fit their round
    nxt = 0
    while nxt < n or len(pending):
        fresh = min(n - nxt, max(0, len(open_bins) - len(pending)))
        take = np.concatenate((pending[:len(open_bins)], np.arange(nxt, nxt + fresh)))
        later = pending[len(open_bins):]
        nxt += fresh
        dest = open_bins[np.argsort(wload[open_bins], kind="stable")[:len(take)]]
        x = lens[take]
        fits = (load[dest] == 0) | (load[dest] + x <= cap)
        if not fits.all():
            # second chance: bins unused this round, most room first, for the failed samples (largest first)
            spare = open_bins[np.argsort(load[open_bins], kind="stable")]
            spare = spare[~np.isin(spare, dest[fits])]
            failed = np.flatnonzero(~fits)[:len(spare)]
            alt = spare[:len(failed)]
            ok = (load[alt] == 0) | (load[alt] + x[failed] <= cap)
            dest = dest.copy()
            dest[failed[ok]] = alt[ok]
            fits[failed[ok]] = True
        placed, where = take[fits], dest[fits]
        bin_of_sorted[placed] = where
        load[where] += lens[placed]
        wload[where] += w[placed]
        if (lens[placed] > cap).any():
            open_bins = open_bins[load[open_bins] <= cap]
        pending = np.sort(np.concatenate((take[~fits], later)))
        if not len(placed):
            return None  # nothing fits (or every bin is closed by an oversize sample)
    bin_of = np.empty(n, dtype=np.int64)
    bin_of[order] = bin_of_sorted
    if np.bincount(bin_of, minlength=num_bins).min() == 0:
        return None
    return bin_of


def cost_lpt_pack(
    lengths: np.ndarray, costs: np.ndarray, order: np.ndarray, num_bins: int, cap: int
) -> list[list[int]] | None:
    """``num_bins`` capped bins, each sample (decreasing cost) into the cheapest bin that still has room.

    Sequential: a sample goes wherever some bin has room, so it succeeds where the rounds of :func:`lpt_rounds`
    stall. A bin too full for the current sample waits in a heap keyed by its room and rejoins the cost heap once the
    (decreasing) samples are small enough for it, so every sample costs ``O(log bins)`` amortised.
    """
    heap = [(0.0, b) for b in range(num_bins)]  # (cost, bin) of bins that fit the current sample
    waiting: list[tuple[int, float, int]] = []  # (-room, cost, bin) of bins that do not
    room = [cap] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    heappop, heappush = heapq.heappop, heapq.heappush
    smallest = int(lengths[order[-1]])
    for idx, length, cost in zip(order.tolist(), lengths[order].tolist(), costs[order].tolist()):
        while waiting and -waiting[0][0] >= length:
            _, bc, b = heappop(waiting)
            heappush(heap, (bc, b))
        while heap:
            bc, b = heappop(heap)
            if room[b] >= length or room[b] == cap:  # an empty bin takes even an oversize sample
                break
            heappush(waiting, (-room[b], bc, b))
        else:
            return None
        bins[b].append(idx)
        room[b] -= length
        if room[b] >= smallest:
            heappush(heap, (bc + cost, b))
    return bins


def bins_to_labels(bins: Sequence[Sequence[int]], n: int) -> np.ndarray:
    """``bin_of[i]`` = index of the bin holding sample ``i``."""
    sizes = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
    members = np.fromiter(chain.from_iterable(bins), dtype=np.int64, count=int(sizes.sum()))
    bin_of = np.empty(n, dtype=np.int64)
    bin_of[members] = np.repeat(np.arange(len(bins)), sizes)
    return bin_of
