"""Micro-batches composed for the pipeline: each replica's samples packed into a *shape* of micro-batch sizes
(:func:`ramp_weights`: small first and last micro-batches fill and drain the pipeline fast), by :func:`shape_pack`,
many rows and ``(count, shape)`` combinations in one call priced in one pass of the model (:func:`pack_each`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Callable

import numpy as np

from .cost import bin_costs
from .pipeline_pricing import Budget
from .planner_config import ShapeSpec
from .profile import CostProfile

__all__ = ["RISING", "Shape", "ShapeSamples", "by_decreasing_cost", "pack_each", "pack_many", "pack_rows",
           "ramp_weights", "replica_members", "shape_pack"]


@dataclass(frozen=True)
class Shape:
    """A target shape of one replica's micro-batch sizes (see :func:`ramp_weights`)."""

    up: int  # micro-batches rising to the plateau
    down: int  # micro-batches falling from it at the end
    low: float  # the first (last) micro-batch's target, as a share of the plateau's
    order: str = "target"  # the run order: "target", or "rising" (cheapest first, the costliest second to last)
    grouped: bool = False  # the ramps count groups of ``microbatch_group_size_per_vp_stage`` micro-batches
    rise: float = 0.0  # > 1: a geometric rise, each of the ``up`` micro-batches ``1 / rise`` of the next

    def weights(self, k: int, group: int = 1) -> np.ndarray:
        """``(k,)`` target shares (read-only: one array per shape, count and group, made once)."""
        return _weights(self, k, group)

    def run_order(self, mb_costs: np.ndarray, counts: np.ndarray | None = None) -> np.ndarray:
        """``(R, k)`` the order each row's micro-batches run in (indices into its bins); ``counts``: row ``r`` has
        only its first ``counts[r]`` micro-batches, the rest stay in place."""
        r, k = mb_costs.shape
        if self.order == "target":
            return np.broadcast_to(np.arange(k), (r, k))
        c = np.full((r, 1), k) if counts is None else np.asarray(counts)[:, None]
        at = np.arange(k)[None, :]
        asc = np.argsort(np.where(at < c, mb_costs, np.inf), axis=1, kind="stable")  # a row's own bins first
        # position c - 2 runs the costliest, c - 1 the second costliest (rows of two or more)
        src = np.where((at == c - 2) & (c >= 2), c - 1, np.where((at == c - 1) & (c >= 2), c - 2, at))
        return np.take_along_axis(asc, src, axis=1)

    @classmethod
    def of(cls, spec: ShapeSpec | tuple, pp: int = 1) -> "Shape":
        """The shape a :class:`~.planner_config.ShapeSpec` (or its fields) configures for ``pp`` stages (cached: the
        same spec and depth give the same object)."""
        spec = ShapeSpec.of(spec)
        return _shape_of(spec, int(pp) if spec.per_stage else 1)


@lru_cache(maxsize=1024)
def _shape_of(spec: ShapeSpec, depth: int) -> Shape:
    up, down = spec.up, spec.down
    if spec.per_stage:  # ramps in micro-batches per stage: times the depth, rounded half up, at least one
        up, down = (max(1, int(x * depth + 0.5)) if x > 0 else x for x in (up, down))
    return Shape(RISING if up < 0 else int(up), int(down), spec.low, spec.order, spec.grouped, spec.rise)


#: ``up = RISING`` is a ramp over the whole step
RISING = 1 << 20


@lru_cache(maxsize=4096)
def _weights(shape: Shape, k: int, group: int) -> np.ndarray:
    if not shape.grouped or group <= 1:
        w = ramp_weights(k, shape.up, shape.down, shape.low, shape.rise)
    else:
        slots = -(-k // group)
        w = np.repeat(ramp_weights(slots, shape.up, shape.down, shape.low, shape.rise), group)[:k]
        w = w / w.sum()
    w.flags.writeable = False
    return w


def ramp_weights(k: int, up: int, down: int, low: float, rise: float = 0.0) -> np.ndarray:
    """``(k,)`` target shares summing to 1: ``up`` rising from ``low`` towards 1, the plateau (at least one), ``down``
    falling towards ``low`` (``down < 0``: every micro-batch after the peak falls)."""
    w = np.ones(k)
    if down < 0:  # the peak, then a fall over every micro-batch after it (one at least where there are three)
        up = min(up, max(k - 2, 0))
        down = k - 1 - up
    up, down = min(up, k - 1), min(down, k - 1)
    while up + down >= k and (up or down):  # keep at least one plateau micro-batch
        if down >= up:
            down -= 1
        else:
            up -= 1
    if up and rise > 1:
        w[:up] = rise ** -np.arange(up, 0, -1, dtype=np.float64)
    elif up:
        w[:up] = np.linspace(low, 1.0, up + 1)[:-1]
    if down:
        w[k - down:] = np.linspace(1.0, low, down + 1)[1:]
    return w / w.sum()


def by_decreasing_cost(costs: np.ndarray) -> np.ndarray:
    """Indices by decreasing cost, ties by index (a stable sort's order from unstable sorts: faster on floats)."""
    order = np.argsort(-costs)
    value = costs[order]
    if len(order) > 1 and (value[1:] == value[:-1]).any():  # equal costs: by index within each run of them
        rank = np.concatenate(([0], np.cumsum(value[1:] != value[:-1])))
        key = np.empty(len(order), dtype=np.int64)
        key[order] = rank
        order = np.argsort(key * len(order) + np.arange(len(order)))
    return order


def replica_members(replica_of: np.ndarray, costs: np.ndarray, dp: int,
                    order: np.ndarray | None = None) -> np.ndarray:
    """``(dp, n_max)``: each replica's samples by decreasing cost (ties by index), padded with -1; ``order``: the
    samples' :func:`by_decreasing_cost`, where known."""
    order = by_decreasing_cost(costs) if order is None else order
    # by replica, keeping that order (a stable sort of small integers is a radix sort)
    owner = np.asarray(replica_of)[order]
    order = order[np.argsort(owner.astype(np.int16) if dp < 1 << 15 else owner, kind="stable")]
    counts = np.bincount(replica_of, minlength=dp)
    n_max = int(counts.max()) if len(counts) else 0
    out = np.full((dp, n_max), -1, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    col = np.arange(len(order)) - np.repeat(starts, counts)
    out[replica_of[order], col] = order
    return out


def shape_pack(lengths: np.ndarray, costs: np.ndarray, members: np.ndarray, weights: np.ndarray,
               cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack each row's samples, costliest first, each into the micro-batch with the most target cost left that takes
    it under ``cap``. ``members``: ``(R, n)`` sample ids by decreasing cost, padded with -1; ``weights``: ``(R, k)``
    target shares per row, negative for a micro-batch the row lacks. Returns ``bin_of`` ``(R, n)`` (-1 for padding)
    and ``ok`` ``(R,)``: the row holds the cap (a sample over it sits alone) and fills every micro-batch."""
    rows, n = members.shape
    k = weights.shape[1]
    # rows with more samples first: the rows still placing samples are a shrinking prefix (undone at the end)
    by_size = np.argsort(-(members >= 0).sum(axis=1), kind="stable")
    members, weights = members[by_size], weights[by_size]
    valid, unused, room, tok, limit, lens_t, cst_t = _pack_tables(lengths, costs, members, weights, cap)
    # slack: samples left minus micro-batches still empty (at <= 0 a sample must open an empty one); it drops by
    # one at most per sample, so it is tracked only from sample ``min(slack)`` on
    size = valid.sum(axis=1)
    used = (~unused).sum(axis=1)
    slack = size - used
    calm = int(slack.min(initial=n))
    active = np.searchsorted(-size, -np.arange(n), side="left")  # rows still placing sample rank j
    bin_t = np.empty((n, rows), dtype=np.int64)
    flat_room, flat_tok = room.ravel(), tok.ravel()
    base = np.arange(rows) * k
    neg = -np.inf
    last = -1
    masked = False
    for j in range(n):
        a = int(active[j])
        if a != last:
            if a == 0:
                break
            tok_a, room_a, base_a, slack_a, last = tok[:a], room[:a], base[:a], slack[:a], a
        if j < calm:
            allowed = limit[j, :a]
        else:
            if j == calm:  # from here on, track it: samples left minus micro-batches still empty
                slack = size - j - (used - ((tok > 0) & ~unused).sum(axis=1))
                slack_a = slack[:a]
            allowed = np.where(slack_a <= 0, 0, limit[j, :a])  # forced: only an empty micro-batch takes it
        # the most room left among the micro-batches that take the sample: first the most room overall (one pass,
        # the common case), once a row needs the second pass every row takes it directly (the same pick)
        pick = (np.where(tok_a <= allowed[:, None], room_a, neg) if masked else room_a).argmax(axis=1)
        flat = base_a + pick
        held = flat_tok[flat]
        bad = () if masked else np.flatnonzero(held > allowed)
        if len(bad):
            masked = True
            pick[bad] = np.where(tok_a[bad] <= allowed[bad, None], room_a[bad], neg).argmax(axis=1)
            flat[bad] = base_a[bad] + pick[bad]
            held[bad] = flat_tok[flat[bad]]
        if j >= calm:
            slack_a -= held > 0
        flat_room[flat] -= cst_t[j, :a]
        flat_tok[flat] = held + lens_t[j, :a]
        bin_t[j, :a] = pick
    bin_of = bin_t.T.copy()
    bin_of[~valid] = -1
    # a row fails where a micro-batch is over the cap (a sample fitted nowhere) or empty
    counts = np.bincount((base[:, None] + bin_of)[valid], minlength=rows * k).reshape(rows, k)
    ok = ((counts > 0) | unused).all(axis=1) & ((tok <= cap) | (counts == 1) | unused).all(axis=1)
    back = np.argsort(by_size)
    return bin_of[back], ok[back]


def _pack_tables(lengths: np.ndarray, costs: np.ndarray, members: np.ndarray, weights: np.ndarray, cap: int):
    """:func:`shape_pack`'s tables: ``(valid, unused micro-batches, target cost left, tokens held, per sample rank
    the most tokens a micro-batch may hold before taking it, the lengths and costs per sample rank)``."""
    valid = members >= 0
    safe = np.where(valid, members, 0)
    lens = np.where(valid, lengths[safe], 0)
    cst = np.where(valid, costs[safe], 0.0)
    unused = weights < 0
    room = np.where(unused, -np.inf, weights * cst.sum(axis=1, keepdims=True))  # a lacking micro-batch: no room
    tok = np.where(unused, cap + 1, 0).astype(np.int64)  # and "full"
    # cap - L, or 0 (only an empty micro-batch) for a sample over the cap; padding (L = 0) fits anywhere
    limit = np.ascontiguousarray(np.where(lens > cap, 0, cap - lens).T)
    return valid, unused, room, tok, limit, np.ascontiguousarray(lens.T), np.ascontiguousarray(cst.T)


# ---------------------------------------------------------------------------------------------------- a step's samples
@dataclass(frozen=True)
class ShapeSamples:
    """What shaping a step's micro-batches needs (dynamic batches only): the samples' ``lengths`` and ``costs``, the
    token ``cap``, the ``profile`` (or ``None``: FLOPs), and ``step``: the per-replica count moves by multiples of it
    (``microbatch_group_size_per_vp_stage`` under VPP, else 1)."""

    lengths: np.ndarray
    costs: np.ndarray
    cap: int
    profile: CostProfile | None
    step: int
    #: per group of samples (an array of ids, never changed in place): its cost and its ids cheapest first
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _once(self, what: str, ids: np.ndarray, make: Callable[[], object]):
        hit = self._memo.get((what, id(ids)))
        if hit is None or hit[0] is not ids:  # the memo holds the array: its id is not reused meanwhile
            hit = (ids, make())
            self._memo[(what, id(ids))] = hit
        return hit[1]

    @cached_property
    def order(self) -> np.ndarray:
        """The step's sample ids by decreasing cost, ties by id (:func:`by_decreasing_cost`)."""
        return by_decreasing_cost(self.costs)

    @cached_property
    def rank(self) -> np.ndarray:
        """Each sample's place in :attr:`order`."""
        return np.argsort(self.order)

    @cached_property
    def ascending(self) -> tuple[np.ndarray, np.ndarray]:
        """The step's sample ids by increasing cost, ties by id, and each sample's place in that order."""
        order = np.argsort(self.costs, kind="stable")
        return order, np.argsort(order)

    def group_cost(self, ids: np.ndarray) -> float:
        return self._once("cost", ids, lambda: float(self.costs[ids].sum()))

    def cheapest_first(self, ids: np.ndarray) -> np.ndarray:
        """The group's ids by increasing cost, ties by id."""
        return self._once("order", ids, lambda: ids[np.lexsort((ids, self.costs[ids]))])

    def bin_rows(self, members: np.ndarray, bin_of: np.ndarray, k: int) -> np.ndarray:
        """``(R, k)`` micro-batch costs of packed rows (:func:`shape_pack`'s ``bin_of`` over ``members``)."""
        rows = members.shape[0]
        valid = members >= 0
        flat = (np.arange(rows)[:, None] * k + bin_of)[valid]
        ids = members[valid]
        return bin_costs(self.lengths[ids], self.costs[ids], flat, rows * k, self.profile).reshape(rows, k)

    def pad(self, groups: list[np.ndarray]) -> np.ndarray:
        """Rows of sample ids by decreasing cost (ties by id), padded with -1."""
        sizes = np.asarray([len(g) for g in groups], dtype=np.int64)
        out = np.full((len(groups), int(sizes.max())), -1, dtype=np.int64)
        ids = np.concatenate(groups).astype(np.int64, copy=False)
        row = np.repeat(np.arange(len(groups)), sizes)
        order = np.argsort(row * len(self.costs) + self.rank[ids])
        out[row, np.arange(len(ids)) - np.repeat(np.cumsum(sizes) - sizes, sizes)] = ids[order]
        return out


def pack_each(budget: Budget, samples: ShapeSamples, members: np.ndarray,
              combos: list[tuple[int, Shape]]) -> tuple[np.ndarray, np.ndarray]:
    """Row ``i`` of ``members`` (sample ids by decreasing cost, padded with -1) packed for ``combos[i]`` (a count
    and a shape) in one :func:`shape_pack` call, relabelled to its shape's run order and priced in one pass of the
    model, both charged to ``budget``: ``(spans (R,), bin_of (R, n))``, ``inf`` where a row does not fit."""
    index: dict[tuple[int, Shape], list[int]] = {}
    for i, combo in enumerate(combos):
        index.setdefault(combo, []).append(i)
    width = max(k for k, _ in index)
    w = np.full((len(combos), width), -1.0)
    turned: dict[Shape, list[int]] = {}  # the rows of each shape not run in target order
    for (k, shape), rows in index.items():
        w[rows, :k] = shape.weights(k, samples.step)
        if shape.order != "target":
            turned.setdefault(shape, []).extend(rows)
    budget.spent += budget.pack_cost(len(members), members.shape[1], width)
    bin_of, ok = shape_pack(samples.lengths, samples.costs, members, w, samples.cap)
    count_of = np.asarray([k for k, _ in combos], dtype=np.int64)
    prices = samples.bin_rows(members, bin_of, width)  # (R, width): a row's bins beyond its count are empty
    for shape, rows in turned.items():
        own = np.asarray(rows)
        run = shape.run_order(prices[own], count_of[own])  # the bins in run order (beyond the count: in place)
        rank = np.argsort(run, axis=1)  # bin -> its run position
        b = bin_of[own]
        bin_of[own] = np.where(b >= 0, np.take_along_axis(rank, np.maximum(b, 0), axis=1), -1)
        prices[own] = np.take_along_axis(prices[own], run, axis=1)
    groups = [np.flatnonzero((count_of == k) & ok) for k in sorted(set(count_of.tolist()))]
    groups = [(sel, prices[sel, :count_of[sel[0]]]) for sel in groups if len(sel)]
    spans = np.full(len(members), np.inf)
    for (sel, _), got in zip(groups, budget.price_many([p for _, p in groups]) if groups else []):
        spans[sel] = got
    return spans, bin_of


def pack_many(budget: Budget, samples: ShapeSamples, members: np.ndarray,
              combos: list[tuple[int, Shape]]) -> tuple[np.ndarray, np.ndarray]:
    """Every row of ``members`` packed for every ``(count, shape)`` of ``combos`` in one call: ``(spans (C, R),
    bin_of (C, R, n))``; a packing that does not fit is ``inf``."""
    # shapes whose targets coincide at a count pack alike: each distinct (count, targets, run order) is packed once
    first: dict[tuple, int] = {}
    of = [first.setdefault((k, shape.order, shape.weights(k, samples.step).tobytes()), i)
          for i, (k, shape) in enumerate(combos)]
    distinct = sorted(first.values())
    r, c = len(members), len(distinct)
    rows = [combos[i] for i in distinct for _ in range(r)]
    spans, bin_of = pack_each(budget, samples, np.tile(members, (c, 1)), rows)
    at = np.asarray([distinct.index(i) for i in of])
    return spans.reshape(c, r)[at], bin_of.reshape(c, r, -1)[at]


def pack_rows(budget: Budget, samples: ShapeSamples, members: np.ndarray, rows: list[np.ndarray],
              combos: list[tuple[int, Shape]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The rows ``rows[i]`` of ``members`` packed for ``combos[i]``, in one call: per part its spans and ``bin_of``."""
    spans, bin_of = pack_each(budget, samples, members[np.concatenate(rows)],
                              [combo for combo, part in zip(combos, rows) for _ in part])
    cuts = np.cumsum([len(part) for part in rows])[:-1]
    return np.split(spans, cuts), np.split(bin_of, cuts)
