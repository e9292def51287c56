"""Bin packing of samples into micro-batches of at most ``cap`` tokens (a longer sample sits alone)."""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from itertools import chain
from typing import Sequence

import numpy as np


def best_fit_decreasing(lengths: np.ndarray, cap: int, order: np.ndarray | None = None) -> list[list[int]]:
    """Best fit decreasing (within 11/9 OPT + 1): longest first (``order``), each into the fullest bin with room."""
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


def halve_by_tokens(members: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """One bin cut in two halves of about equal tokens: members longest first, each to the half with fewer tokens
    (the first on a tie)."""
    first: list[int] = []
    second: list[int] = []
    lead = 0  # tokens in ``first`` minus tokens in ``second``
    for i in sorted(members, key=lambda m: int(lengths[m]), reverse=True):  # a stable sort: ties keep bin order
        if lead <= 0:
            first.append(i)
            lead += int(lengths[i])
        else:
            second.append(i)
            lead -= int(lengths[i])
    return [first, second]


def grow_to_count(
    bins: list[list[int]], target_count: int, lengths: Sequence[int], loads: Sequence[int] | None = None
) -> None:
    """Grow ``bins`` in place towards ``target_count`` by halving the fullest bin of two or more samples (of equal
    ones the higher index); ``loads``: the bins' tokens, when the caller has them."""
    if len(bins) >= target_count:
        return
    lens = lengths.tolist() if isinstance(lengths, np.ndarray) else lengths
    if loads is None:
        loads = [sum(lens[i] for i in b) for b in bins]
    # a max-heap on (tokens, bin index) of the bins that can still be cut
    heap = [(-load, -j) for j, (load, b) in enumerate(zip(loads, bins)) if len(b) > 1]
    heapq.heapify(heap)
    while len(bins) < target_count and heap:
        j = -heapq.heappop(heap)[1]
        kept, moved = halve_by_tokens(bins[j], lens)
        bins[j] = kept
        bins.append(moved)
        for k, half in ((j, kept), (len(bins) - 1, moved)):
            if len(half) > 1:
                heapq.heappush(heap, (-sum(lens[i] for i in half), -k))


def lpt_pack(
    lengths: np.ndarray, weights: np.ndarray, order: np.ndarray, num_bins: int, cap: int, graham: bool = False
) -> np.ndarray | None:
    """LPT into exactly ``num_bins`` capped bins, by rounds: ``bin_of`` per sample, or ``None`` when a round places
    nothing. Each round deals the next samples (``order``), the largest to the lightest bin by ``weights``; whole
    rounds give every open bin one sample, ``graham`` ends a round where sequential LPT would (within ``4/3`` of the
    optimum). A sample that overflows its bin gets a bin unused this round, else waits; an oversize one closes its
    bin."""
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
        # graham: the k-th sample may take the k-th lightest bin only while every bin filled before it this round
        # stays at least as heavy (as sequential LPT would); the rest of the round waits for the next one
        keep = len(take)
        if graham and keep > 1:
            after = np.minimum.accumulate(wload[dest] + w[take])
            keep = 1 + int(np.argmax(np.r_[after[:-1] < wload[dest[1:]], True]))
        cut, take, dest = take[keep:], take[:keep], dest[:keep]
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
        pending = np.sort(np.concatenate((take[~fits], cut, later)))
        if not len(placed):
            return None  # nothing fits (or every bin is closed by an oversize sample)
    bin_of = np.empty(n, dtype=np.int64)  # no bin is empty: the first round gives each one a sample
    bin_of[order] = bin_of_sorted
    return bin_of


def bins_to_labels(bins: Sequence[Sequence[int]], n: int) -> np.ndarray:
    """``bin_of[i]`` = index of the bin holding sample ``i``."""
    sizes = np.fromiter(map(len, bins), dtype=np.int64, count=len(bins))
    members = np.fromiter(chain.from_iterable(bins), dtype=np.int64, count=int(sizes.sum()))
    bin_of = np.empty(n, dtype=np.int64)
    bin_of[members] = np.repeat(np.arange(len(bins)), sizes)
    return bin_of
