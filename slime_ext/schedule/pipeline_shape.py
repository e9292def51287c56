"""Micro-batches composed for the pipeline: each replica's samples packed into a *shape* of micro-batch sizes.

Under megatron-core's 1F1B schedule a replica's step waits ``pp - 1`` stage-forwards of its first micro-batch
before the last stage starts, and ``pp - 1`` stage-backwards of its last one after the last stage ends; in between,
a stage idles whenever a micro-batch is much cheaper than the one the stage ran before it in the other direction. So
the fastest plans (a long search under the model: ``bench/pipeline_search.py``) start with small micro-batches,
rise to the largest within a few micro-batches, step down slowly and end with a ramp of small ones; and they use
more micro-batches than the fewest the cap allows (each extra one costs its overhead but shortens fill and drain).

This module builds such plans, vectorised over replicas and candidate shapes:

* :func:`ramp_weights`: the target share of each of ``k`` micro-batches: ``up`` micro-batches rising linearly
  from ``low`` of the plateau, the plateau, ``down`` micro-batches falling linearly to ``low``;
* :func:`shape_pack`: every row's samples (largest cost first) each into the micro-batch with the most room left
  below its target that still holds it under the token cap; the largest samples land on the first plateau
  micro-batches (the peak), the smallest fill the ramps. Micro-batches run in target order.

The planner (:func:`slime_ext.schedule.pipeline_plan.plan_pipeline_step`) prices the candidates with the pipeline
model and keeps a shaped plan only where it predicts the slowest replica faster. Pure: standard library and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["Shape", "by_decreasing_cost", "ramp_weights", "replica_members", "shape_pack", "SHAPES", "RISING"]


@dataclass(frozen=True)
class Shape:
    """A target shape of one replica's micro-batch sizes (see :func:`ramp_weights`)."""

    up: int  # micro-batches rising to the plateau
    down: int  # micro-batches falling from it at the end
    low: float  # the first (last) micro-batch's target, as a share of the plateau's
    #: the run order: "target" (as shaped), or "rising": cheapest first up to the costliest, which runs second
    #: to last (the interleaved schedule's best plans of evenly loaded micro-batches)
    order: str = "target"
    #: the ramps count groups of ``microbatch_group_size_per_vp_stage`` micro-batches, alike within a group (the
    #: interleaved schedule runs a group through every model chunk together)
    grouped: bool = False

    def weights(self, k: int, group: int = 1) -> np.ndarray:
        """``(k,)`` target shares (read-only: one array per shape, count and group, made once)."""
        return _weights(self, k, group)

    def run_order(self, bin_costs: np.ndarray) -> np.ndarray:
        """``(R, k)`` the order each row's micro-batches run in (indices into its bins)."""
        r, k = bin_costs.shape
        if self.order == "target":
            return np.broadcast_to(np.arange(k), (r, k))
        asc = np.argsort(bin_costs, axis=1, kind="stable")
        if k >= 2:
            asc = np.concatenate([asc[:, :k - 2], asc[:, -1:], asc[:, k - 2:k - 1]], axis=1)
        return asc


#: ``up = RISING`` is a ramp over the whole step (the interleaved schedule's best plans rise to a peak near the end)
RISING = 1 << 20
SHAPES = (Shape(0, 0, 1.0), Shape(1, 4, 0.3), Shape(2, 4, 0.3), Shape(2, 6, 0.5), Shape(3, 6, 0.3),
          Shape(3, 8, 0.3), Shape(4, 8, 0.3), Shape(2, 2, 0.5), Shape(RISING, 1, 0.5), Shape(RISING, 2, 0.6),
          Shape(0, 0, 1.0, "rising"), Shape(3, 8, 0.6), Shape(5, 10, 0.5), Shape(4, 12, 0.4),
          Shape(1, 1, 0.3, grouped=True), Shape(1, 2, 0.3, grouped=True), Shape(2, 3, 0.3, grouped=True))


@lru_cache(maxsize=4096)
def _weights(shape: Shape, k: int, group: int) -> np.ndarray:
    if not shape.grouped or group <= 1:
        w = ramp_weights(k, shape.up, shape.down, shape.low)
    else:
        slots = -(-k // group)
        w = np.repeat(ramp_weights(slots, shape.up, shape.down, shape.low), group)[:k]
        w = w / w.sum()
    w.flags.writeable = False
    return w


def ramp_weights(k: int, up: int, down: int, low: float) -> np.ndarray:
    """``(k,)`` target shares summing to 1: ``up`` rising from ``low`` (share of the plateau) towards 1, the
    plateau, ``down`` falling towards ``low``. Ramps are shortened (the plateau kept >= 1) when ``k`` is small."""
    w = np.ones(k)
    up, down = min(up, k - 1), min(down, k - 1)
    while up + down >= k and (up or down):  # keep at least one plateau micro-batch
        if down >= up:
            down -= 1
        else:
            up -= 1
    if up:
        w[:up] = np.linspace(low, 1.0, up + 1)[:-1]
    if down:
        w[k - down:] = np.linspace(1.0, low, down + 1)[1:]
    return w / w.sum()


def by_decreasing_cost(costs: np.ndarray) -> np.ndarray:
    """Indices by decreasing cost, ties by index (a stable sort's order, from two unstable sorts: several times
    faster on floats)."""
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
    """``(dp, n_max)``: each replica's samples by decreasing cost (ties by index), padded with -1. ``order``: the
    samples' :func:`by_decreasing_cost` where the caller has it already."""
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
    """Pack each row's samples into ``k`` micro-batches shaped by ``weights``.

    ``members``: ``(R, n)`` sample ids by decreasing cost, padded with -1; ``weights``: ``(R, k)`` target shares
    per row (each row's non-negative entries sum to 1; row ``r``'s targets are ``weights[r] * its total cost``); a
    negative weight marks a micro-batch the row does not have (rows of fewer micro-batches in one call). Returns
    ``bin_of`` ``(R, n)`` (the micro-batch of each member, -1 for padding) and ``ok`` ``(R,)``: the row holds the
    cap (a sample over the cap sits alone) and leaves none of its micro-batches empty.
    """
    rows, n = members.shape
    k = weights.shape[1]
    # rows with more samples first, so that the rows still placing samples are a prefix that shrinks as the
    # shorter rows finish (their padding would change nothing); undone at the end
    by_size = np.argsort(-(members >= 0).sum(axis=1), kind="stable")
    members, weights = members[by_size], weights[by_size]
    valid = members >= 0
    safe = np.where(valid, members, 0)
    lens = np.where(valid, lengths[safe], 0)
    cst = np.where(valid, costs[safe], 0.0)
    unused = weights < 0
    # target cost left per micro-batch; a micro-batch the row lacks never has room
    room = np.where(unused, -np.inf, weights * cst.sum(axis=1, keepdims=True))
    tok = np.where(unused, cap + 1, 0).astype(np.int64)  # tokens; a lacking micro-batch is "full"
    # the most tokens a micro-batch may hold before taking the sample: cap - L, or 0 (empty) for a sample over
    # the cap; padding (L = 0) fits anywhere and changes nothing. Per sample rank, contiguous over rows.
    limit = np.ascontiguousarray(np.where(lens > cap, 0, cap - lens).T)
    lens_t, cst_t = np.ascontiguousarray(lens.T), np.ascontiguousarray(cst.T)
    # samples left minus micro-batches still empty: at <= 0 every sample left must open an empty micro-batch
    # (padding comes last in a row, so what it does to this count never matters). It drops by one at most per
    # sample, so no row is forced before sample ``min(slack)``: until then it is not tracked.
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
        # the micro-batch with the most room left that takes the sample under the cap
        pick = np.where(tok_a <= allowed[:, None], room_a, neg).argmax(axis=1)
        flat = base_a + pick
        held = flat_tok[flat]
        if j >= calm:
            slack_a -= held > 0
        flat_room[flat] -= cst_t[j, :a]
        flat_tok[flat] = held + lens_t[j, :a]
        bin_t[j, :a] = pick
    bin_of = bin_t.T.copy()
    bin_of[~valid] = -1
    # a sample that fitted nowhere went to a micro-batch over the cap: the row fails; so does an empty micro-batch
    counts = np.zeros(rows * k, dtype=np.int64)
    np.add.at(counts, (base[:, None] + bin_of)[valid], 1)
    counts = counts.reshape(rows, k)
    ok = ((counts > 0) | unused).all(axis=1) & ((tok <= cap) | (counts == 1) | unused).all(axis=1)
    back = np.empty_like(by_size)
    back[by_size] = np.arange(rows)
    return bin_of[back], ok[back]
