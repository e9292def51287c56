"""Stage 4: give every DP rank the same number of micro-batches (``rank_of_bin`` over packed bins), or with
:func:`build_rank_bins` deal samples, not bins, into bins chosen per rank."""

from __future__ import annotations

from bisect import bisect_left, insort
from heapq import heapify, heappop, heappush
from typing import Iterable

import numpy as np

from .packing import bins_to_labels, grow_to_count
from .planner_config import DEFAULT_CONFIG


def serpentine(bin_costs: np.ndarray, dp_size: int) -> np.ndarray:
    """``rank_of_bin``: bins by decreasing cost dealt 0..dp-1, dp-1..0, 0..dp-1, ..."""
    count = len(bin_costs)
    by_cost = np.argsort(-bin_costs, kind="stable")
    pos = np.arange(count)
    rnd, r = np.divmod(pos, dp_size)
    rank_of_bin = np.empty(count, dtype=np.int64)
    rank_of_bin[by_cost] = np.where(rnd % 2 == 0, r, dp_size - 1 - r)
    return rank_of_bin


def lpt_equal_count(bin_costs: np.ndarray, dp_size: int) -> np.ndarray:
    """``rank_of_bin`` with ``len / dp`` bins per rank: round ``k`` gives bins ``k*dp..`` (by decreasing cost) to
    the ranks in increasing order of their load so far."""
    count = len(bin_costs)
    by_cost = np.argsort(-bin_costs, kind="stable")
    rank_of_bin = np.empty(count, dtype=np.int64)
    load = np.zeros(dp_size)
    for start in range(0, count, dp_size):
        chunk = by_cost[start:start + dp_size]
        ranks = np.argsort(load, kind="stable")
        rank_of_bin[chunk] = ranks
        load[ranks] += bin_costs[chunk]
    return rank_of_bin


def refine_by_swaps(
    bin_costs: np.ndarray, rank_of_bin: np.ndarray, dp_size: int, tolerance: float,
    max_rounds: int = DEFAULT_CONFIG.packing.refine_rounds, dense_limit: int = DEFAULT_CONFIG.packing.dense_swap_limit,
) -> np.ndarray:
    """Lower the heaviest ranks by swapping bins with light ranks (each keeps its number of bins): each round pairs
    the i-th heaviest rank with the i-th lightest and makes the one swap that brings them closest to their average,
    until within ``tolerance`` of the mean, no better, or ``max_rounds``. Above ``dense_limit`` bins per rank the
    same swaps are found by binary search (less memory)."""
    count = len(bin_costs)
    per_rank = count // dp_size
    by_rank = np.argsort(rank_of_bin, kind="stable").reshape(dp_size, per_rank)  # bin ids, one row per rank
    sums = bin_costs[by_rank].sum(axis=1)
    goal = sums.mean() * (1 + tolerance)
    half = dp_size // 2
    for _ in range(max_rounds):
        ranked = np.argsort(sums, kind="stable")
        if sums[ranked[-1]] <= goal:
            break
        heavy, light = ranked[::-1][:half], ranked[:half]
        gap = sums[heavy] - sums[light]
        ch, cl = bin_costs[by_rank[heavy]], bin_costs[by_rank[light]]  # (half, per_rank)
        if per_rank <= dense_limit:
            d = ch[:, :, None] - cl[:, None, :]  # cost each swap moves from heavy to light
            score = np.abs(d - gap[:, None, None] / 2)
            score[(d <= 0) | (d >= gap[:, None, None])] = np.inf
            flat = score.reshape(half, -1).argmin(axis=1)
            a, b = np.divmod(flat, per_rank)
            ok = np.isfinite(score.reshape(half, -1)[np.arange(half), flat])
        else:  # large groups: the best partner of each heavy bin by binary search, pair by pair
            a = np.zeros(half, dtype=np.int64)
            b = np.zeros(half, dtype=np.int64)
            ok = np.zeros(half, dtype=bool)
            for i in range(half):
                srt = np.argsort(cl[i], kind="stable")
                lc = cl[i][srt]
                j = np.clip(np.searchsorted(lc, ch[i] - gap[i] / 2), 1, per_rank - 1)
                best = np.inf
                for cand in (j - 1, j):
                    d = ch[i] - lc[cand]
                    sc = np.where((d > 0) & (d < gap[i]), np.abs(d - gap[i] / 2), np.inf)
                    k = int(np.argmin(sc))
                    if sc[k] < best:
                        best, a[i], b[i], ok[i] = sc[k], k, srt[cand[k]], True
        if not ok.any():
            break
        before = sums.max()
        rows = np.flatnonzero(ok)
        hi, lo, ai, bi = heavy[rows], light[rows], a[rows], b[rows]
        moved = bin_costs[by_rank[hi, ai]] - bin_costs[by_rank[lo, bi]]
        by_rank[hi, ai], by_rank[lo, bi] = by_rank[lo, bi], by_rank[hi, ai]
        sums[hi] -= moved
        sums[lo] += moved
        if sums.max() >= before:
            break
    out = np.empty(count, dtype=np.int64)
    out[by_rank] = np.arange(dp_size)[:, None]
    return out


class LightestWithRoom:
    """The lightest of some bins (or ranks) with room, for samples that come longest first: ``pop(need)`` removes
    and returns ``(load, item)`` of the lightest item with ``room >= need`` (ties: the lowest), or ``None``; a
    too-full item waits in a second heap keyed by its room."""

    __slots__ = ("ready", "waiting")

    def __init__(self, entries: Iterable[tuple[float, int, int]]) -> None:
        self.ready = list(entries)  # (load, item, room)
        heapify(self.ready)
        self.waiting: list[tuple[int, float, int]] = []  # (-room, load, item)

    def push(self, load: float, item: int, room: int) -> None:
        heappush(self.ready, (load, item, room))

    def pop(self, need: int) -> tuple[float, int] | None:
        ready, waiting = self.ready, self.waiting
        while waiting and -waiting[0][0] >= need:
            neg_room, load, item = heappop(waiting)
            heappush(ready, (load, item, -neg_room))
        while ready:
            load, item, room = heappop(ready)
            if room >= need:
                return load, item
            heappush(waiting, (-room, load, item))
        return None


def build_rank_bins(
    lengths: np.ndarray, costs: np.ndarray, order: np.ndarray, cap: int, dp_size: int, per_rank: int, by_cost: bool
) -> list[list[list[int]]] | None:
    """Bins chosen per rank: samples (decreasing cost) dealt to the lightest rank with room, inside it to the
    fullest bin it fits (``by_cost``: the cheapest); empty bins are filled. ``None`` when some sample fits no rank."""
    stride = per_rank + 1
    keys = [list(range(cap * stride, cap * stride + per_rank)) for _ in range(dp_size)]  # room*stride+bin, sorted
    room = [[cap] * per_rank for _ in range(dp_size)]
    bins = [[[] for _ in range(per_rank)] for _ in range(dp_size)]
    cheapest = [LightestWithRoom((0.0, b, cap) for b in range(per_rank)) for _ in range(dp_size)] if by_cost else None
    ranks = LightestWithRoom((0.0, r, cap) for r in range(dp_size))  # a rank's room is its roomiest bin's
    for idx, length, cost in zip(order.tolist(), lengths[order].tolist(), costs[order].tolist()):
        need = length if length < cap else cap  # an oversize sample needs an empty bin
        picked = ranks.pop(need)
        if picked is None:
            return None
        rank_cost, r = picked
        rk, rr = keys[r], room[r]
        if cheapest is not None:  # the cheapest bin of this rank that has room (the rank has one)
            bin_cost, b = cheapest[r].pop(need)  # type: ignore[misc]
            pos = bisect_left(rk, rr[b] * stride + b)
        else:  # best fit: the fullest bin that has room
            pos = bisect_left(rk, need * stride)
            b = rk[pos] % stride
        del rk[pos]
        bins[r][b].append(idx)
        rr[b] -= length
        if rr[b] > 0:
            insort(rk, rr[b] * stride + b)
            if cheapest is not None:
                cheapest[r].push(bin_cost + cost, b, rr[b])
        if rk:
            ranks.push(rank_cost + cost, r, rk[-1] // stride)
    _give_every_bin_a_sample(bins, costs, per_rank)
    for r in range(dp_size):
        filled = [b for b in bins[r] if b]
        if len(filled) < per_rank:
            grow_to_count(filled, per_rank, lengths)
        bins[r] = filled
    return bins


def _give_every_bin_a_sample(bins: list[list[list[int]]], costs: np.ndarray, per_rank: int) -> None:
    """Move the cheapest samples of ranks holding more than ``per_rank`` samples to ranks holding fewer."""
    counts = [sum(len(b) for b in rb) for rb in bins]
    if min(counts) >= per_rank:
        return
    # callers guarantee n >= dp_size * per_rank, so donors never run out
    donors = [(float(costs[i]), i, d, k) for d, db in enumerate(bins) if counts[d] > per_rank
              for k, b in enumerate(db) for i in b]
    heapify(donors)
    for r, rb in enumerate(bins):
        while counts[r] < per_rank:
            _, i, d, k = heappop(donors)
            if counts[d] <= per_rank:
                continue  # that rank gave all it can spare
            bins[d][k].remove(i)
            counts[d] -= 1
            next(b for b in rb if not b).append(i)
            counts[r] += 1


def rank_bins_to_labels(rank_bins: list[list[list[int]]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(bin_of, rank_of_bin)`` for bins given per rank, numbered rank by rank."""
    bin_of = bins_to_labels([members for rb in rank_bins for members in rb], n)
    return bin_of, np.repeat(np.arange(len(rank_bins), dtype=np.int64), [len(rb) for rb in rank_bins])
