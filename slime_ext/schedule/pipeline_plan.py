"""The planner's objective with pipeline parallelism (``pp_size > 1``): the slowest replica's predicted makespan.

A pipelined replica's step time is the makespan of megatron-core's schedule over its micro-batches
(:mod:`slime_ext.schedule.pipeline`), which depends on their order and count, not only on their sum. This module
prices micro-batches for that model and improves one planned step by comparing candidates with it:

* **order** of each rank's micro-batches (free: the gradient is a sum): heaviest first (the pp-unaware order),
  ascending, cheapest at both ends with the largest in the middle, the cheapest two at the ends with the rest
  descending; the best per rank, then improved by swapping pairs while the model says it gets faster;
* **DP assignment** (with ``balance_data``): bins move between the slowest replica and the fastest ones while that
  lowers the slowest replica's makespan, so the rank holding the largest micro-batch (the longest fill and drain)
  gets less of the rest;
* **count**: more, smaller micro-batches (``align`` more at a time, equal on every rank, under the cap), kept only
  when the slowest replica gets faster.

**Pricing.** A micro-batch's cost ``c`` is the planner's own: forward FLOPs from the ``CostModel`` (tokens without
one), or seconds of forward + backward from a ``CostProfile`` (which prices the micro-batch whole, its overhead
included). Per stage (layers split evenly over ``pp`` stages):

* profile: forward ``c / ((1 + r) pp)``, backward ``r`` times that, ``r = backward_forward_ratio``, p2p ``p2p_s``;
  makespans in **seconds**;
* FLOPs or tokens: forward ``(c + o) / pp``, backward ``2`` times that, p2p ``0``, where ``o`` charges every
  micro-batch :data:`FLOPS_MICROBATCH_OVERHEAD` of a full one (``cap`` tokens at the linear rate), so that more,
  smaller micro-batches are not free; makespans in **per-stage forward-FLOP units** (tokens without a model): a
  GPU's achieved FLOP/s turns them into seconds.

The schedule records each step's slowest predicted makespan and that replica's bubble fraction (``StepStats``).
Pure: standard library and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .config import ParallelConfig
from .cost import CostModel
from .errors import ScheduleError
from .pipeline import PipelineSpec, pipeline_makespan
from .profile import CostProfile

#: FLOPs (or token) plans charge every micro-batch this share of a full one (``cap`` tokens at the linear rate)
FLOPS_MICROBATCH_OVERHEAD = 0.02
#: FLOPs plans: backward = this many times forward
DEFAULT_BACKWARD_FORWARD_RATIO = 2.0
#: pair swaps tried per rank and round of order improvement (beyond it: adjacent pairs and pairs with the ends)
MAX_ORDER_SWAPS = 528
ORDER_ROUNDS = 6
#: moves of bins between replicas, per step and count; partners tried per move (the fastest replicas)
MAX_BALANCE_MOVES = 64
BALANCE_PARTNERS = 3
BALANCE_SWAPS_PER_PARTNER = 8
#: extra rounds of ``align`` micro-batches tried; the search stops after this many that do not pay off in a row
MAX_EXTRA_COUNT_ROUNDS = 8
EXTRA_COUNT_PATIENCE = 2


@dataclass(frozen=True)
class PipelinePricing:
    """How the planner's micro-batch costs become per-stage forward/backward times for the pipeline model."""

    spec: PipelineSpec
    backward_forward_ratio: float
    scale: float  # per-stage forward = (cost + overhead) * scale
    overhead: float  # added to every micro-batch's cost (FLOPs plans)
    units: str  # "seconds", "forward FLOPs per stage" or "tokens per stage"

    def stage_costs(self, mb_costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        f = (np.asarray(mb_costs, dtype=np.float64) + self.overhead) * self.scale
        return f, self.backward_forward_ratio * f

    def makespans(self, mb_costs: np.ndarray) -> np.ndarray:
        """``(R, M)`` micro-batch costs in run order -> ``(R,)`` predicted makespans."""
        f, b = self.stage_costs(np.atleast_2d(mb_costs))
        return np.atleast_1d(pipeline_makespan(f, b, self.spec))

    def bubble(self, mb_costs: np.ndarray) -> float:
        """One replica's bubble fraction: ``1 - (one stage's work) / makespan``."""
        f, b = self.stage_costs(mb_costs)
        span = float(pipeline_makespan(f, b, self.spec))
        return 1.0 - float(f.sum() + b.sum()) / span if span > 0 else 0.0


def pipeline_pricing(parallel: ParallelConfig, cost_model: CostModel | CostProfile | None,
                     cap: int | None) -> PipelinePricing | None:
    """The pricing for this layout and cost model; ``None`` without pipeline parallelism (``pp_size == 1``)."""
    pp = parallel.pp_size
    if pp == 1:
        return None
    vpp = parallel.vpp_size
    group = parallel.microbatch_group_size_per_vp_stage if vpp > 1 else None
    if vpp > 1 and group < pp:  # type: ignore[operator]
        raise ScheduleError(
            f"microbatch_group_size_per_vp_stage = {group} < pp_size = {pp}: megatron-core's interleaved schedule "
            f"refuses it; pass a group size >= {pp} (Megatron's default is the pipeline size)")
    if isinstance(cost_model, CostProfile):
        ratio = cost_model.backward_forward_ratio
        spec = PipelineSpec(pp, vpp, group, p2p_s=cost_model.p2p_s, overlap_p2p_comm=parallel.overlap_p2p_comm)
        return PipelinePricing(spec, ratio, 1.0 / ((1.0 + ratio) * pp), 0.0, "seconds")
    linear = cost_model.coefficients()[0] if cost_model is not None else 1.0
    overhead = FLOPS_MICROBATCH_OVERHEAD * linear * cap if cap is not None else 0.0
    spec = PipelineSpec(pp, vpp, group, p2p_s=0.0, overlap_p2p_comm=parallel.overlap_p2p_comm)
    units = "forward FLOPs per stage" if cost_model is not None else "tokens per stage"
    return PipelinePricing(spec, DEFAULT_BACKWARD_FORWARD_RATIO, 1.0 / pp, overhead, units)


# ---------------------------------------------------------------------------------------------------- order
def heuristic_orders(costs: np.ndarray) -> np.ndarray:
    """``(H, R, K)`` candidate orders (indices into each row of ``costs``), heaviest first being the first."""
    r, k = costs.shape
    asc = np.argsort(costs, axis=1, kind="stable")
    desc = np.argsort(-costs, axis=1, kind="stable")
    # cheapest at both ends, largest in the middle: the i-th cheapest goes alternately to the front and the back
    i = np.arange(k)
    pos = np.where(i % 2 == 0, i // 2, k - 1 - i // 2)
    valley = np.empty_like(asc)
    valley[:, pos] = asc
    # the cheapest first and the second cheapest last, the rest heaviest first
    ends = desc
    if k >= 3:
        ends = np.concatenate([asc[:, :1], asc[:, :1:-1], asc[:, 1:2]], axis=1)
    return np.stack([desc, asc, valley, ends])


def _take(costs: np.ndarray, orders: np.ndarray) -> np.ndarray:
    return np.take_along_axis(costs, orders, axis=-1)


def quick_makespans(pricing: PipelinePricing, costs: np.ndarray) -> np.ndarray:
    """``(R,)`` the best makespan of each row of ``(R, K)`` costs over :func:`heuristic_orders`."""
    orders = heuristic_orders(costs)
    h, r, k = orders.shape
    rows = _take(np.broadcast_to(costs, (h, r, k)), orders).reshape(h * r, k)
    return pricing.makespans(rows).reshape(h, r).min(axis=0)


def _swap_pairs(k: int) -> np.ndarray:
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    if len(pairs) > MAX_ORDER_SWAPS:  # adjacent pairs, and every position with the first and last two
        ends = {0, 1, k - 2, k - 1}
        pairs = [(i, j) for i, j in pairs if j == i + 1 or i in ends or j in ends]
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)


def best_orders(pricing: PipelinePricing, costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``(R, K)`` costs, the order the model predicts fastest and its makespan.

    Starts from the best of :func:`heuristic_orders` (ties: the earlier, so heaviest first wins a tie), then swaps
    pairs of positions while that lowers the makespan (all pairs per round, each rank taking its best swap), for
    at most :data:`ORDER_ROUNDS` rounds.
    """
    r, k = costs.shape
    orders = heuristic_orders(costs)
    h = len(orders)
    spans = pricing.makespans(_take(np.broadcast_to(costs, (h, r, k)), orders).reshape(h * r, k)).reshape(h, r)
    pick = spans.argmin(axis=0)
    order = orders[pick, np.arange(r)]
    span = spans[pick, np.arange(r)]
    pairs = _swap_pairs(k)
    if not len(pairs):
        return order, span
    p = len(pairs)
    for _ in range(ORDER_ROUNDS):
        cand = np.repeat(order[:, None, :], p, axis=1)  # (R, P, K)
        a, b = pairs[:, 0], pairs[:, 1]
        rows = np.arange(p)
        cand[:, rows, a], cand[:, rows, b] = order[:, b], order[:, a]
        c = np.take_along_axis(np.broadcast_to(costs[:, None, :], cand.shape), cand, axis=2)
        useful = c[:, rows, a] != c[:, rows, b]  # swapping equal costs changes nothing
        if not useful.any():
            break
        got = np.full((r, p), np.inf)
        got[useful] = pricing.makespans(c[useful])
        best = got.argmin(axis=1)
        gain = got[np.arange(r), best] < span * (1 - 1e-12)
        if not gain.any():
            break
        order[gain] = cand[np.flatnonzero(gain), best[gain]]
        span[gain] = got[np.flatnonzero(gain), best[gain]]
    return order, span


# ---------------------------------------------------------------------------------------------------- DP assignment
def balance_makespans(pricing: PipelinePricing, bin_costs: np.ndarray, rank_of_bin: np.ndarray,
                      dp: int) -> np.ndarray:
    """Move bins between the slowest replica and the fastest ones while the slowest one's makespan drops.

    Each move swaps one bin of the slowest replica with a cheaper one of one of the :data:`BALANCE_PARTNERS`
    fastest. Candidate swaps are ranked by how close they bring the two replicas' makespans to each other, if each
    makespan moved by the cost swapped (the rank's bubble held fixed); the :data:`BALANCE_SWAPS_PER_PARTNER` best
    are priced by the model, and the best of those is made when it lowers the larger of the two below the slowest
    replica's makespan. Every rank keeps its number of bins.
    """
    if dp == 1:
        return rank_of_bin
    count = len(bin_costs)
    k = count // dp
    by_rank = np.argsort(rank_of_bin, kind="stable").reshape(dp, k)
    costs = bin_costs[by_rank]
    span = quick_makespans(pricing, costs)
    for _ in range(MAX_BALANCE_MOVES):
        s = int(np.argmax(span))
        partners = [int(t) for t in np.argsort(span, kind="stable") if t != s][:BALANCE_PARTNERS]
        rows, moves = [], []
        for t in partners:
            d = costs[s][:, None] - costs[t][None, :]  # cost moved from s to t by swapping (i, j)
            est = np.maximum(span[s] - d, span[t] + d)
            est[d <= 0] = np.inf
            flat = np.argsort(est, axis=None, kind="stable")[:BALANCE_SWAPS_PER_PARTNER]
            for f in flat:
                if not np.isfinite(est.flat[f]):
                    break
                i, j = divmod(int(f), k)
                cs, ct = costs[s].copy(), costs[t].copy()
                cs[i], ct[j] = costs[t][j], costs[s][i]
                rows += [cs, ct]
                moves.append((t, i, j))
        if not moves:
            break
        got = quick_makespans(pricing, np.asarray(rows)).reshape(-1, 2)
        worse = got.max(axis=1)
        best = int(np.argmin(worse))
        if worse[best] >= span[s] * (1 - 1e-9):
            break
        t, i, j = moves[best]
        by_rank[s, i], by_rank[t, j] = by_rank[t, j], by_rank[s, i]
        costs[s, i], costs[t, j] = costs[t, j], costs[s, i]
        span[s], span[t] = got[best]
    out = np.empty(count, dtype=np.int64)
    out[by_rank] = np.arange(dp)[:, None]
    return out


# ---------------------------------------------------------------------------------------------------- one step
@dataclass(frozen=True)
class PipelineStep:
    """One step's micro-batches for the pipeline: ``bin_of``/``rank_of_bin`` as ``StepPlan``; ``emit`` the bins
    in rank-major run order; ``makespans`` per replica; the slowest replica's ``bubble``."""

    bin_of: np.ndarray
    rank_of_bin: np.ndarray
    count: int
    emit: np.ndarray
    makespans: np.ndarray
    bubble: float
    how: str  # what changed from the pp-unaware plan: "" (nothing), "order", "balance", "count+N"

    @property
    def slowest(self) -> float:
        return float(self.makespans.max())


def arrange(pricing: PipelinePricing, bin_costs: np.ndarray, bin_of: np.ndarray, rank_of_bin: np.ndarray,
            count: int, dp: int, *, reorder: bool = True, balance: bool = False, how: str = "") -> PipelineStep:
    """Order (and with ``balance`` first rebalance) one step's bins by the model. Without ``reorder`` the bins run
    heaviest first on every rank: the pp-unaware plan's order."""
    if balance:
        rank_of_bin = balance_makespans(pricing, bin_costs, rank_of_bin, dp)
    k = count // dp
    # heaviest first, ties by bin id: the order the pp-unaware planner emits
    by_rank = np.lexsort((np.arange(count), -bin_costs, rank_of_bin)).reshape(dp, k)
    costs = bin_costs[by_rank]
    if reorder:
        order, spans = best_orders(pricing, costs)
        by_rank = np.take_along_axis(by_rank, order, axis=1)
        costs = bin_costs[by_rank]
    else:
        spans = pricing.makespans(costs)
    slowest = int(np.argmax(spans))
    return PipelineStep(bin_of, rank_of_bin, count, by_rank.reshape(-1), spans, pricing.bubble(costs[slowest]), how)


def plan_pipeline_step(
    pricing: PipelinePricing,
    bin_of: np.ndarray,
    rank_of_bin: np.ndarray,
    count: int,
    dp: int,
    bin_costs_of: Callable[[np.ndarray, int], np.ndarray],
    *,
    balance: bool,
    recount: Callable[[int], tuple[np.ndarray, np.ndarray] | None] | None,
    align: int,
) -> PipelineStep:
    """The best arrangement of one step by the model, never slower than the pp-unaware plan of the step.

    ``bin_of``/``rank_of_bin``/``count``: the pp-unaware plan; ``bin_costs_of(bin_of, count)`` prices bins;
    ``balance``: rebalance the DP assignment by makespan; ``recount(count)``: a packing and assignment with that
    many micro-batches (``None`` when it cannot), or ``None`` when the count is fixed (static batches).
    """
    costs = bin_costs_of(bin_of, count)
    best = arrange(pricing, costs, bin_of, rank_of_bin, count, dp, reorder=False)  # the pp-unaware plan
    for cand in (arrange(pricing, costs, bin_of, rank_of_bin, count, dp, how="order"),
                 arrange(pricing, costs, bin_of, rank_of_bin, count, dp, balance=True, how="balance")
                 if balance and dp > 1 else None):
        if cand is not None and cand.slowest < best.slowest * (1 - 1e-9):
            best = cand
    if recount is None:
        return best
    misses = 0
    for extra in range(1, MAX_EXTRA_COUNT_ROUNDS + 1):
        k_count = count + extra * align
        packed = recount(k_count)
        if packed is None:
            break
        b_of, r_of_b = packed
        cand = arrange(pricing, bin_costs_of(b_of, k_count), b_of, r_of_b, k_count, dp,
                       balance=balance and dp > 1, how=f"count+{k_count - count}")
        if cand.slowest < best.slowest * (1 - 1e-9):
            best, misses = cand, 0
        else:
            misses += 1
            if misses >= EXTRA_COUNT_PATIENCE:
                break
    return best


__all__ = ["DEFAULT_BACKWARD_FORWARD_RATIO", "FLOPS_MICROBATCH_OVERHEAD", "PipelinePricing", "PipelineStep",
           "arrange", "balance_makespans", "best_orders", "heuristic_orders", "pipeline_pricing",
           "plan_pipeline_step", "quick_makespans"]
