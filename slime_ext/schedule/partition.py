"""Balanced partitioning of weighted items into ``k`` groups (used to give DP ranks equal work).

:func:`karmarkar_karp` is the largest-differencing method (optionally with equal group sizes), vectorised over
the ``k`` groups of each partial solution; :func:`refine_equal_size` then swaps items between the heaviest group
and the others while that lowers the maximum.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np


def karmarkar_karp(weights: Sequence[float], k: int, equal_size: bool) -> list[list[int]]:
    """Partition ``range(len(weights))`` into ``k`` groups of balanced total weight.

    With ``equal_size`` every group gets exactly ``len(weights) // k`` items (``len(weights)`` must be a multiple
    of ``k``). Each partial solution holds ``k`` groups sorted by decreasing sum; the two partial solutions with
    the largest spread are merged, heaviest group of one with the lightest of the other.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    if k < 1 or n < k:
        raise ValueError(f"cannot split {n} items into k={k} non-empty groups")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs len(weights) % k == 0, got {n} % {k}")
    order = np.argsort(w, kind="stable")
    heap: list[tuple[float, int, np.ndarray, list[list[int]]]] = []
    if equal_size:
        for s, off in enumerate(range(0, n, k)):
            chunk = order[off:off + k][::-1]  # decreasing
            sums = w[chunk].copy()
            heap.append((-(sums[0] - sums[-1]), s, sums, [[int(i)] for i in chunk]))
    else:
        for s, i in enumerate(order[::-1]):
            sums = np.zeros(k)
            sums[0] = w[i]
            groups: list[list[int]] = [[int(i)]] + [[] for _ in range(k - 1)]
            heap.append((-sums[0], s, sums, groups))
    heapq.heapify(heap)
    serial = len(heap)
    while len(heap) > 1:
        _, _, sums_a, groups_a = heapq.heappop(heap)
        _, _, sums_b, groups_b = heapq.heappop(heap)
        merged = sums_a + sums_b[::-1]
        for i in range(k):
            groups_a[i].extend(groups_b[k - 1 - i])
        perm = np.argsort(-merged, kind="stable")
        sums = merged[perm]
        groups = [groups_a[i] for i in perm]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), serial, sums, groups))
        serial += 1
    return heap[0][3]


def refine_equal_size(
    weights: Sequence[float], groups: list[list[int]], max_rounds: int = 64, candidates: int = 8
) -> list[list[int]]:
    """Lower the heaviest group's sum by swapping one of its items with a lighter item of another group.

    Group sizes never change. Each round takes the heaviest group and the best single swap with one of the
    ``candidates`` lightest groups (largest reduction of ``max(sum_heavy, sum_other)``); stops when none helps.
    """
    w = np.asarray(weights, dtype=np.float64)
    k = len(groups)
    if k < 2:
        return groups
    groups = [list(g) for g in groups]
    sums = np.array([w[g].sum() for g in groups])
    for _ in range(max_rounds):
        h = int(np.argmax(sums))
        heavy = np.asarray(groups[h])
        wh = w[heavy]
        best = (0.0, -1, -1, -1)
        for o in np.argsort(sums, kind="stable")[:candidates]:
            o = int(o)
            if o == h or sums[o] >= sums[h]:
                continue
            other = np.asarray(groups[o])
            wo = w[other]
            # swapping a (heavy) with b (other) moves d = wa - wb; want 0 < d < sums[h] - sums[o]
            d = wh[:, None] - wo[None, :]
            gap = sums[h] - sums[o]
            new_max = np.maximum(sums[h] - d, sums[o] + d)
            new_max[(d <= 0) | (d >= gap)] = np.inf
            flat = int(np.argmin(new_max))
            gain = sums[h] - new_max.flat[flat]
            if gain > best[0] * (1 + 1e-12) + 1e-300:
                a, b = divmod(flat, len(other))
                best = (gain, o, a, b)
        gain, o, a, b = best
        if o < 0:
            break
        ia, ib = groups[h][a], groups[o][b]
        groups[h][a], groups[o][b] = ib, ia
        sums[h] += w[ib] - w[ia]
        sums[o] += w[ia] - w[ib]
    return groups
