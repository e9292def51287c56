"""The run order of a replica's micro-batches (free: the gradient is a sum, so any order trains the same): the best
of a few heuristic orders, improved by pair swaps (:func:`best_orders`).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .pipeline_pricing import Budget, PipelinePricing, beats

__all__ = ["best_orders", "group_peaks", "heuristic_best", "heuristic_orders", "heuristic_spans", "improve_orders"]


def group_peaks(costs: np.ndarray, group: int) -> np.ndarray:
    """``(R, K)`` each row's positions reordered within consecutive groups of ``group`` micro-batches: every group
    rising to its costliest in the middle, then falling."""
    r, k = costs.shape
    out = np.empty((r, k), dtype=np.int64)
    for a in range(0, k, group):
        seg = costs[:, a:a + group]
        d = np.argsort(-seg, axis=1, kind="stable")
        h = seg.shape[1] // 2
        out[:, a:a + group] = a + np.concatenate([d[:, :h][:, ::-1], d[:, h:]], axis=1)
    return out


def heuristic_orders(costs: np.ndarray, group: int = 1) -> np.ndarray:
    """``(H, R, K)`` candidate orders (indices into each row of ``costs``): heaviest first, ascending, cheapest at
    both ends, the cheapest two at the ends with the rest descending, and under VPP (``group`` > 1) heaviest first
    in :func:`group_peaks`."""
    r, k = costs.shape
    asc = np.argsort(costs, axis=1, kind="stable")
    desc = np.argsort(-costs, axis=1, kind="stable")
    # valley: the i-th cheapest alternately to the front and the back
    i = np.arange(k)
    pos = np.where(i % 2 == 0, i // 2, k - 1 - i // 2)
    valley = np.empty_like(asc)
    valley[:, pos] = asc
    ends = desc  # the cheapest first and the second cheapest last, the rest heaviest first
    if k >= 3:
        ends = np.concatenate([asc[:, :1], asc[:, :1:-1], asc[:, 1:2]], axis=1)
    orders = [desc, asc, valley, ends]
    if group > 1:
        orders.append(np.take_along_axis(desc, group_peaks(np.take_along_axis(costs, desc, axis=1), group), axis=1))
    return np.stack(orders)


def _group(pricing: PipelinePricing) -> int:
    """The interleaved schedule's group of micro-batches (``microbatch_group_size_per_vp_stage``), 1 without VPP."""
    spec = pricing.spec
    return spec.microbatch_group_size_per_vp_stage if spec.vpp_size > 1 else 1


def _price(pricing: PipelinePricing, budget: Budget | None, rows: np.ndarray) -> np.ndarray:
    return pricing.makespans(rows) if budget is None else budget.price(rows)


@lru_cache(maxsize=256)
def swap_pairs(k: int, most: int, group: int = 1) -> np.ndarray:
    """``(P, 2)`` the position pairs an order improvement tries, in lexicographic order (read-only, cached): every
    pair while there are at most ``most``, else adjacent pairs, every position with the first and last two, and
    under VPP (``group`` > 1) the pairs within a group and one group apart."""
    i, j = np.triu_indices(k, 1)
    if len(i) > most:
        ends = np.zeros(k, dtype=bool)
        ends[[0, 1, k - 2, k - 1]] = True
        keep = (j == i + 1) | ends[i] | ends[j]
        if group > 1:
            keep |= (i // group == j // group) | (j - i == group)
        i, j = i[keep], j[keep]
    out = np.stack((i, j), axis=1).astype(np.int64).reshape(-1, 2)
    out.flags.writeable = False
    return out


def heuristic_spans(pricing: PipelinePricing, costs: np.ndarray,
                    budget: Budget | None = None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`heuristic_orders` of ``(R, K)`` costs and their makespans ``(H, R)``, in one call of the model."""
    r, k = costs.shape
    orders = heuristic_orders(costs, _group(pricing))
    h = len(orders)
    rows = np.take_along_axis(np.broadcast_to(costs, (h, r, k)), orders, axis=-1).reshape(h * r, k)
    return orders, _price(pricing, budget, rows).reshape(h, r)


def heuristic_best(pricing: PipelinePricing, costs: np.ndarray,
                   budget: Budget | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``(R, K)`` costs, the best of :func:`heuristic_orders` (ties: the earlier) and its makespan."""
    orders, spans = heuristic_spans(pricing, costs, budget)
    r = len(costs)
    pick = spans.argmin(axis=0)
    return orders[pick, np.arange(r)], spans[pick, np.arange(r)]


def improve_orders(pricing: PipelinePricing, costs: np.ndarray, order: np.ndarray, span: np.ndarray,
                   budget: Budget | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rows' orders improved by rounds of pair swaps (:func:`swap_pairs`, all priced at once, each row taking
    its best where it beats its makespan), at most ``refinement.order_rounds`` rounds, as far as the budget pays:
    ``(order, span)``."""
    cfg = pricing.config
    order, span = order.copy(), span.copy()
    r, k = costs.shape
    pairs = swap_pairs(k, cfg.refinement.max_order_swaps, _group(pricing))
    p = len(pairs)
    if not p or not r:
        return order, span
    a, b = pairs[:, 0], pairs[:, 1]
    cols = np.arange(p)
    for _ in range(cfg.refinement.order_rounds):
        if budget is not None and not budget.allows(budget.model_cost(r * p, k) + budget.cfg.loop_round):
            break
        if budget is not None:
            budget.charge_round()
        cand = np.repeat(order[:, None, :], p, axis=1)  # (R, P, K)
        cand[:, cols, a], cand[:, cols, b] = order[:, b], order[:, a]
        c = np.take_along_axis(np.broadcast_to(costs[:, None, :], cand.shape), cand, axis=2)
        useful = c[:, cols, a] != c[:, cols, b]  # swapping equal costs changes nothing
        if not useful.any():
            break
        got = np.full((r, p), np.inf)
        got[useful] = _price(pricing, budget, c[useful])
        best = got.argmin(axis=1)
        rows = np.flatnonzero(beats(got[np.arange(r), best], span, cfg))
        if not len(rows):
            break
        order[rows] = cand[rows, best[rows]]
        span[rows] = got[rows, best[rows]]
    return order, span


def best_orders(pricing: PipelinePricing, costs: np.ndarray,
                budget: Budget | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``(R, K)`` costs, the order the model predicts fastest and its makespan (for hosts that order a
    rank's micro-batches themselves)."""
    order, span = heuristic_best(pricing, costs, budget)
    return improve_orders(pricing, costs, order, span, budget)
