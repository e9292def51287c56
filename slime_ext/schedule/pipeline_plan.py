"""The planner's objective with pipeline parallelism (``pp_size > 1``): the slowest replica's predicted makespan.

A pipelined replica's step time is the makespan of megatron-core's schedule over its micro-batches
(:mod:`slime_ext.schedule.pipeline`), which depends on which samples share a micro-batch, how many micro-batches
there are and their order, not only on their sum. This module prices micro-batches for that model and plans one
step by comparing candidates with it:

* **shaped micro-batches** (dynamic batches; :func:`shaped_step`, :mod:`.pipeline_shape`): each replica's samples
  re-packed into a shape of micro-batch sizes (small first, rising to the largest, a slow descent, small last),
  the count and the shape chosen by the model (counts scanned on the replicas most likely to be slowest, every
  shape at the best counts on every replica), then samples moved off the slowest replicas
  (:func:`water_fill` for many replicas, :func:`rebalance_shaped`): a replica holding a dominant sample keeps it
  with only the step's cheapest samples;
* **order** of the pp-unaware plan's micro-batches per rank (free: the gradient is a sum): heaviest first (the
  pp-unaware order), ascending, cheapest at both ends with the largest in the middle, the cheapest two at the ends
  with the rest descending;
* on steps of at most :data:`FULL_SEARCH_MICROBATCHES` micro-batches also the older, costlier candidates of the
  pp-unaware bins: pair swaps of the order, bins moved between replicas (:func:`balance_makespans`), and more,
  smaller micro-batches re-packed by the planner's stage 2 (``align`` more at a time), the best few polished by
  swaps.

The fastest candidate by the slowest replica's predicted makespan wins, the pp-unaware plan included, so a step
is never predicted slower than it. ``bench/pipeline_search.py`` is the yardstick: a long local search under the
same model, and the planner's gap to it per case.

**Pricing.** A micro-batch's cost ``c`` is the planner's own: forward FLOPs from the ``CostModel`` (tokens without
one), or seconds of forward + backward from a ``CostProfile`` (which prices the micro-batch whole, its overhead
included). Per stage, where every stage costs alike:

* profile: forward ``c / ((1 + r) pp)``, backward ``r`` times that, ``r = backward_forward_ratio``, p2p ``p2p_s``;
  makespans in **seconds**;
* FLOPs or tokens: forward ``(c + o) / pp``, backward ``2`` times that, p2p ``0``, where ``o`` charges every
  micro-batch :data:`FLOPS_MICROBATCH_OVERHEAD` of a full one (``cap`` tokens at the linear rate), so that more,
  smaller micro-batches are not free; makespans in **per-stage forward-FLOP units** (tokens without a model): a
  GPU's achieved FLOP/s turns them into seconds.

Where the stages are uneven (:class:`~slime_ext.schedule.stages.StageCosts`: the embedding, the output layer,
Megatron's layout flags) each virtual stage takes its share of ``pp`` times that forward
(:attr:`PipelinePricing.stage_share`, :func:`pipeline_pricing`).

The schedule records each step's slowest predicted makespan and that replica's bubble fraction (``StepStats``).
Pure: standard library and numpy.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import numpy as np

from typing import TYPE_CHECKING

from .config import LAYOUT_FLAGS, ParallelConfig
from .cost import CostModel, sample_costs
from .errors import ScheduleError
from .pipeline import PipelineSpec, _table_makespans, pipeline_lower_bound, pipeline_makespan
from .pipeline_shape import SHAPES, Shape, by_decreasing_cost, replica_members, shape_pack
from .profile import CostProfile
from .stages import StageCosts

if TYPE_CHECKING:
    from .dp_schedule import DPSchedule

#: FLOPs (or token) plans charge every micro-batch this share of a full one (``cap`` tokens at the linear rate)
FLOPS_MICROBATCH_OVERHEAD = 0.02
#: FLOPs plans: backward = this many times forward
DEFAULT_BACKWARD_FORWARD_RATIO = 2.0
#: pair swaps tried per rank and round of order improvement (beyond it: adjacent pairs and pairs with the ends)
MAX_ORDER_SWAPS = 276
ORDER_ROUNDS = 6
#: the planner improves by swaps the orders of the replicas within this share of the slowest (and again, while
#: the slowest replica is one it has not improved)
POLISH_BAND = 0.02
#: moves of bins between replicas, per step and count; partners tried per move (the fastest replicas)
MAX_BALANCE_MOVES = 64
BALANCE_PARTNERS = 3
BALANCE_SWAPS_PER_PARTNER = 8
#: extra rounds of ``align`` micro-batches tried; the search stops after this many that do not pay off in a row
MAX_EXTRA_COUNT_ROUNDS = 8
EXTRA_COUNT_PATIENCE = 2
#: candidates improved by swaps before the final choice: the pp-unaware count's best and the best recounted ones
FINALISTS = 3
#: steps of at most this many micro-batches (all replicas) also try the reordered, rebalanced and recounted
#: candidates of the pp-unaware bins; larger ones keep the shaped plan (or the pp-unaware bins reordered)
FULL_SEARCH_MICROBATCHES = 256


@dataclass(frozen=True)
class PipelinePricing:
    """How the planner's micro-batch costs become per-stage forward/backward times for the pipeline model.

    Every stage alike (``stage_share is None``): stage forward = ``(cost + overhead) * scale``. Uneven stages
    (:class:`~slime_ext.schedule.stages.StageCosts`: the embedding, the output layer, Megatron's layout flags):
    virtual stage ``k``'s forward = ``(cost + overhead) * scale * pp * stage_share[k]``, one row per virtual stage
    (``pp * vpp`` shares summing to 1; an even split gives back the first form)."""

    spec: PipelineSpec
    backward_forward_ratio: float
    scale: float  # per-stage forward = (cost + overhead) * scale, every stage alike
    overhead: float  # added to every micro-batch's cost (FLOPs plans)
    units: str  # "seconds", "forward FLOPs per stage" or "tokens per stage"
    #: per virtual stage ``chunk * pp + rank``: its share of a micro-batch's cost; ``None`` when the stages are even
    stage_share: tuple[float, ...] | None = None

    def stage_costs(self, mb_costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward per stage: ``(..., M)`` every stage alike, or ``(..., pp * vpp, M)`` uneven."""
        f = (np.asarray(mb_costs, dtype=np.float64) + self.overhead) * self.scale
        if self.stage_share is not None:
            f = f[..., None, :] * (np.asarray(self.stage_share) * self.spec.pp_size)[:, None]
        return f, self.backward_forward_ratio * f

    @property
    def slope(self) -> float:
        """How much a replica's makespan grows per unit of cost it gains, at a fixed count and order: the busiest
        pipeline rank's forward and backward of it."""
        busiest = 1.0 if self.stage_share is None else \
            float(np.asarray(self.stage_share).reshape(-1, self.spec.pp_size).sum(axis=0).max() * self.spec.pp_size)
        return (1.0 + self.backward_forward_ratio) * self.scale * busiest

    def makespans(self, mb_costs: np.ndarray) -> np.ndarray:
        """``(R, M)`` micro-batch costs in run order -> ``(R,)`` predicted makespans."""
        return self.makespans_many([mb_costs])[0]

    def makespans_many(self, mb_costs: list[np.ndarray]) -> list[np.ndarray]:
        """Several groups of ``(R_i, M_i)`` micro-batch costs (each its own count) -> their ``(R_i,)`` makespans, in
        one pass of the model (:func:`~slime_ext.schedule.pipeline.pipeline_makespans`; the per-stage costs are
        written straight into the model's cost tables, the same numbers :meth:`stage_costs` gives)."""
        v = self.spec.chunks
        tables = []
        for c in mb_costs:
            c = np.atleast_2d(np.asarray(c, dtype=np.float64))
            f = ((c + self.overhead) * self.scale).T  # (M, R)
            m = f.shape[0]
            if self.stage_share is None:  # every stage alike: forwards then backwards, a chunk's share each
                table = np.empty((2 * m, f.shape[1]))
                table[:m] = f / v
                table[m:] = (self.backward_forward_ratio * f) / v
                tables.append((table, "even", m))
                continue
            share, kinds = self._share_kinds  # stages of equal share read one block of rows
            rows = len(share) * m  # (kind of stage, micro-batch) x replicas: forwards, then backwards
            table = np.empty((2 * rows, f.shape[1]))
            np.multiply(f[None, :, :], share[:, None, None], out=table[:rows].reshape(len(share), m, -1))
            np.multiply(self.backward_forward_ratio, table[:rows], out=table[rows:])
            tables.append((table, ("alike", kinds), m))
        return _table_makespans(tables, self.spec)

    @cached_property
    def _share_kinds(self) -> tuple[np.ndarray, tuple[int, ...]]:
        """The distinct per-virtual-stage forward shares (``stage_share * pp``) and each stage's index among them."""
        share, kinds = np.unique(np.asarray(self.stage_share) * self.spec.pp_size, return_inverse=True)
        return share, tuple(int(x) for x in kinds)

    def bubble(self, mb_costs: np.ndarray, span: float | None = None) -> float:
        """One replica's bubble fraction: ``1 - (the busiest rank's work) / makespan`` (``span``: its makespan,
        when known)."""
        f, b = self.stage_costs(np.atleast_2d(mb_costs))
        span = float(pipeline_makespan(f, b, self.spec)[0]) if span is None else float(span)
        work = (f + b)[0]
        if work.ndim == 2:  # per virtual stage: a rank's work is its chunks'
            work = work.sum(axis=1).reshape(-1, self.spec.pp_size).sum(axis=0).max()
        return 1.0 - float(np.sum(work)) / span if span > 0 else 0.0


#: the micro-batch uneven stages are weighed on: ``cap`` tokens in samples of ``cap * STAGE_SHARE_SAMPLE`` tokens
#: (a stage's share of a micro-batch depends a little on its mix of linear and attention cost)
STAGE_SHARE_SAMPLE = 0.25


def pipeline_pricing(parallel: ParallelConfig, cost_model: CostModel | CostProfile | None,
                     cap: int | None) -> PipelinePricing | None:
    """The pricing for this layout and cost model; ``None`` without pipeline parallelism (``pp_size == 1``).
    (A group size below ``pp_size`` under VPP, which megatron-core refuses, is refused by ``ParallelConfig``.)

    The stages' shares come from :class:`~slime_ext.schedule.stages.StageCosts` (the model dims and Megatron's
    layout flags); where they are uneven each virtual stage gets ``linear[k] T + quadratic[k] S`` over the whole
    model's, for a micro-batch of ``T = cap`` tokens in samples of ``STAGE_SHARE_SAMPLE * cap`` tokens (``S =
    sum L^2``; without a cap, 4096 tokens). Model dims whose layers Megatron could not split over this layout
    without the layout flags (approximate dims) are priced with every stage alike."""
    parallel.require_dp_size()
    pp = parallel.pp_size
    if pp == 1:
        return None
    vpp = parallel.vpp_size
    group = parallel.microbatch_group_size_per_vp_stage if vpp > 1 else None
    try:
        stages = StageCosts.from_model(cost_model, parallel)
    except ScheduleError:
        if any(getattr(parallel, flag) not in (None, False) for flag in LAYOUT_FLAGS):
            raise  # the user placed layers: a split Megatron refuses is an error
        stages = None  # dims that do not split evenly at this layout (approximate dims): every stage alike
    share = None
    if stages is not None and stages.uneven:
        tokens = float(cap if cap is not None else 4096)
        per = np.asarray(stages.virtual_linear) * tokens \
            + np.asarray(stages.virtual_quadratic) * tokens * tokens * STAGE_SHARE_SAMPLE
        share = tuple(float(x) for x in per / per.sum())
    if isinstance(cost_model, CostProfile):
        ratio = cost_model.backward_forward_ratio
        spec = PipelineSpec(pp, vpp, group, p2p_s=cost_model.p2p_s, overlap_p2p_comm=parallel.overlap_p2p_comm)
        return PipelinePricing(spec, ratio, 1.0 / ((1.0 + ratio) * pp), 0.0, "seconds", share)
    linear = cost_model.coefficients()[0] if cost_model is not None else 1.0
    overhead = FLOPS_MICROBATCH_OVERHEAD * linear * cap if cap is not None else 0.0
    spec = PipelineSpec(pp, vpp, group, p2p_s=0.0, overlap_p2p_comm=parallel.overlap_p2p_comm)
    units = "forward FLOPs per stage" if cost_model is not None else "tokens per stage"
    return PipelinePricing(spec, DEFAULT_BACKWARD_FORWARD_RATIO, 1.0 / pp, overhead, units, share)


def step_microbatch_costs(schedule: "DPSchedule", step: int) -> np.ndarray:
    """``(dp, M)``: each rank's micro-batch costs in ``step``, in the order the rank runs them, priced as the
    planner prices them (a profile's whole-micro-batch seconds, else summed FLOPs or tokens)."""
    lengths = np.asarray(schedule.total_lengths, dtype=np.int64)
    profile = schedule.cost_model if isinstance(schedule.cost_model, CostProfile) else None
    costs = sample_costs(lengths, schedule.cost_model)
    start = sum(schedule.num_microbatches[:step])
    m = schedule.num_microbatches[step]
    rows = np.zeros((schedule.dp_size, m))
    for r in range(schedule.dp_size):
        part = schedule.partitions[r]
        for k, mb in enumerate(schedule.micro_batch_indices[r][start:start + m]):
            members = [part[i] for i in mb]
            rows[r, k] = profile.microbatch_time(lengths[members]) if profile is not None else costs[members].sum()
    return rows


def predicted_makespans(schedule: "DPSchedule", step: int, pricing: PipelinePricing | None = None) -> np.ndarray:
    """``(dp,)`` each replica's predicted makespan of ``step`` as planned (``pricing``: the schedule's own by
    default; pass another to price the same plan for another layout, e.g. a pp-unaware plan for the real one)."""
    if pricing is None:
        pricing = pipeline_pricing(schedule.parallel, schedule.cost_model, schedule.cap)
        if pricing is None:
            raise ScheduleError("the schedule has pp_size = 1: pass the pricing of a pipelined layout "
                                "(pipeline_pricing(ParallelConfig(..., pp_size=N), cost_model, cap))")
    return pricing.makespans(step_microbatch_costs(schedule, step))


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


def _swap_pairs(k: int) -> np.ndarray:
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    if len(pairs) > MAX_ORDER_SWAPS:  # adjacent pairs, and every position with the first and last two
        ends = {0, 1, k - 2, k - 1}
        pairs = [(i, j) for i, j in pairs if j == i + 1 or i in ends or j in ends]
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)


def heuristic_best(pricing: PipelinePricing, costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``(R, K)`` costs, the best of :func:`heuristic_orders` and its makespan (ties: the earlier, so
    heaviest first wins a tie)."""
    r, k = costs.shape
    orders = heuristic_orders(costs)
    h = len(orders)
    spans = pricing.makespans(_take(np.broadcast_to(costs, (h, r, k)), orders).reshape(h * r, k)).reshape(h, r)
    pick = spans.argmin(axis=0)
    return orders[pick, np.arange(r)], spans[pick, np.arange(r)]


def improve_orders(pricing: PipelinePricing, costs: np.ndarray, order: np.ndarray,
                   span: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Swap pairs of positions in the given rows' orders while that lowers their makespans (every pair of a row at
    once, each row taking its best swap), for at most :data:`ORDER_ROUNDS` rounds."""
    order, span = order.copy(), span.copy()
    r, k = costs.shape
    pairs = _swap_pairs(k)
    p = len(pairs)
    if not p or not r:
        return order, span
    a, b = pairs[:, 0], pairs[:, 1]
    cols = np.arange(p)
    for _ in range(ORDER_ROUNDS):
        cand = np.repeat(order[:, None, :], p, axis=1)  # (R, P, K)
        cand[:, cols, a], cand[:, cols, b] = order[:, b], order[:, a]
        c = np.take_along_axis(np.broadcast_to(costs[:, None, :], cand.shape), cand, axis=2)
        useful = c[:, cols, a] != c[:, cols, b]  # swapping equal costs changes nothing
        if not useful.any():
            break
        got = np.full((r, p), np.inf)
        got[useful] = pricing.makespans(c[useful])
        best = got.argmin(axis=1)
        rows = np.flatnonzero(got[np.arange(r), best] < span * (1 - 1e-12))
        if not len(rows):
            break
        order[rows] = cand[rows, best[rows]]
        span[rows] = got[rows, best[rows]]
    return order, span


def best_orders(pricing: PipelinePricing, costs: np.ndarray, *,
                all_rows: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``(R, K)`` costs, the order the model predicts fastest and its makespan: the best of
    :func:`heuristic_orders`, improved by :func:`improve_orders` -- on every row, or (``all_rows=False``) only on
    the slowest rows, until the slowest row is one that was improved (the step time is the slowest replica's)."""
    order, span = heuristic_best(pricing, costs)
    if all_rows:
        return improve_orders(pricing, costs, order, span)
    done = np.zeros(len(span), dtype=bool)
    while True:
        s = int(np.argmax(span))
        if done[s]:
            return order, span
        rows = np.flatnonzero(~done & (span >= span[s] * (1 - POLISH_BAND)))
        order[rows], span[rows] = improve_orders(pricing, costs[rows], order[rows], span[rows])
        done[rows] = True


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
    span = heuristic_best(pricing, costs)[1]
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
        got = heuristic_best(pricing, np.asarray(rows))[1].reshape(-1, 2)
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
            count: int, dp: int, *, order: str = "heuristic", balance: bool = False, how: str = "",
            heaviest: np.ndarray | None = None) -> PipelineStep:
    """Order (and with ``balance`` first rebalance) one step's bins by the model. ``order``: "heaviest-first" (the
    pp-unaware plan's order: by ``heaviest``, default ``bin_costs``, ties by bin id), "heuristic" (the best of
    :func:`heuristic_orders` per rank) or "best" (improved by swaps on the slowest ranks, :func:`best_orders`)."""
    if balance:
        rank_of_bin = balance_makespans(pricing, bin_costs, rank_of_bin, dp)
    k = count // dp
    key = bin_costs if heaviest is None else heaviest
    by_rank = np.lexsort((np.arange(count), -key, rank_of_bin)).reshape(dp, k)
    costs = bin_costs[by_rank]
    if order == "heaviest-first":
        spans = pricing.makespans(costs)
    else:
        chosen, spans = heuristic_best(pricing, costs) if order == "heuristic" else \
            best_orders(pricing, costs, all_rows=False)
        by_rank = np.take_along_axis(by_rank, chosen, axis=1)
        costs = bin_costs[by_rank]
    slowest = int(np.argmax(spans))
    return PipelineStep(bin_of, rank_of_bin, count, by_rank.reshape(-1), spans,
                        pricing.bubble(costs[slowest], spans[slowest]), how)


def polish(pricing: PipelinePricing, step: PipelineStep, bin_costs: np.ndarray, dp: int) -> PipelineStep:
    """``step`` with its slowest replicas' orders improved by swaps (:func:`best_orders`)."""
    k = step.count // dp
    by_rank = step.emit.reshape(dp, k)
    costs = bin_costs[by_rank]
    order, spans = best_orders(pricing, costs, all_rows=False)
    improved = spans < step.makespans
    by_rank = np.where(improved[:, None], np.take_along_axis(by_rank, order, axis=1), by_rank)
    spans = np.minimum(spans, step.makespans)
    slowest = int(np.argmax(spans))
    how = step.how or "order"
    return PipelineStep(step.bin_of, step.rank_of_bin, step.count, by_rank.reshape(-1), spans,
                        pricing.bubble(bin_costs[by_rank[slowest]]), how)


@dataclass(frozen=True)
class ShapeSamples:
    """What shaping a step's micro-batches needs (dynamic batches only): the step's sample ``lengths`` and
    ``costs`` (the planner's), the token ``cap``, a measured ``profile`` (micro-batches priced whole) or ``None``
    (FLOPs: a micro-batch costs the sum of its samples), and ``step``: the per-replica count moves by multiples of
    it (``microbatch_group_size_per_vp_stage`` under VPP, else 1)."""

    lengths: np.ndarray
    costs: np.ndarray
    cap: int
    profile: CostProfile | None
    step: int
    #: per group of samples (an array of ids; the rebalancing replaces a replica's group, never changes one in
    #: place): its cost, its tokens and its ids cheapest first, each worked out once (:meth:`group_cost` ...)
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _once(self, what: str, ids: np.ndarray, make: Callable[[], object]):
        hit = self._memo.get((what, id(ids)))
        if hit is None or hit[0] is not ids:  # the memo holds the array, so its id is not reused meanwhile
            hit = (ids, make())
            self._memo[(what, id(ids))] = hit
        return hit[1]

    @property
    def order(self) -> np.ndarray:
        """The step's sample ids by decreasing cost, ties by id (:func:`.pipeline_shape.by_decreasing_cost`)."""
        return self._once("by cost", self.costs, lambda: by_decreasing_cost(self.costs))

    @property
    def rank(self) -> np.ndarray:
        """Each sample's place in :attr:`order`."""
        def make() -> np.ndarray:
            rank = np.empty(len(self.costs), dtype=np.int64)
            rank[self.order] = np.arange(len(self.costs))
            return rank
        return self._once("rank", self.costs, make)

    def group_cost(self, ids: np.ndarray) -> float:
        return self._once("cost", ids, lambda: float(self.costs[ids].sum()))

    def group_tokens(self, ids: np.ndarray) -> int:
        return self._once("tokens", ids, lambda: int(self.lengths[ids].sum()))

    def cheapest_first(self, ids: np.ndarray) -> np.ndarray:
        """The group's ids by increasing cost, ties by id."""
        return self._once("order", ids, lambda: ids[np.lexsort((ids, self.costs[ids]))])

    def bin_rows(self, members: np.ndarray, bin_of: np.ndarray, k: int) -> np.ndarray:
        """``(R, k)`` micro-batch costs of packed rows (:func:`shape_pack`'s ``bin_of`` over ``members``)."""
        rows = members.shape[0]
        valid = members >= 0
        flat = (np.arange(rows)[:, None] * k + bin_of)[valid]
        ids = members[valid]
        if self.profile is None:
            return np.bincount(flat, weights=self.costs[ids], minlength=rows * k).reshape(rows, k)
        return self.profile.bin_times(self.lengths[ids], flat, rows * k).reshape(rows, k)

    def in_run_order(self, shape: Shape, members: np.ndarray, bin_of: np.ndarray, k: int) -> np.ndarray:
        """``bin_of`` relabelled so that bin ``j`` is the ``j``-th to run in ``shape``'s order (unchanged for the
        shape's own target order)."""
        if shape.order == "target":
            return bin_of
        rank = np.argsort(shape.run_order(self.bin_rows(members, bin_of, k)), axis=1)  # bin -> its run position
        return np.where(bin_of >= 0, np.take_along_axis(rank, np.maximum(bin_of, 0), axis=1), -1)


#: replicas the count is chosen on (the heaviest by cost and by largest sample); all replicas choose their shape
SCAN_REPLICAS = 8
#: per-replica counts scanned: the pp-unaware count times these factors, rounded up to the step and at least one
#: step more than the previous (capped by the samples of the smallest replica)
COUNT_FACTORS = (1.0, 1.1, 1.2, 1.3, 1.45, 1.6, 1.8, 2.0, 2.3)
#: large steps (more than FULL_SEARCH_MICROBATCHES micro-batches in all) scan on this many replicas, no count
#: above LARGE_COUNT_REACH times the pp-unaware count once LARGE_MIN_COUNTS counts are in (under VPP the "one
#: step more" rule otherwise reaches 3.5x), and of the SHAPED_COMBOS best combinations the ones after the first
#: LARGE_LEAD_COMBOS only at the counts of those (a count of its own would be rebalanced too). This search costs
#: 15-35% less at dp 128 x 8,192 samples (pp 4 x VPP 2: 28 ms against 42 ms) and moves plans both ways, as any
#: change of a heuristic search does: on the 180 steps of ``python -m bench.plan_quality --large`` (dp 64-512,
#: pp 4-8, VPP 1-2, 4,096-8,192 samples) 11 faster (to -0.72%), 12 slower (to +1.15%), the mean +0.004% (against
#: the full search of commit 12628a7). Small steps (the digests) plan as before.
LARGE_SCAN_REPLICAS = 2
LARGE_MIN_COUNTS = 3
LARGE_COUNT_REACH = 2.0
LARGE_LEAD_COMBOS = 2
#: the shapes every count is scanned with (then every shape of SHAPES at the best counts)
SCAN_SHAPES = (Shape(0, 0, 1.0), Shape(3, 6, 0.3), Shape(0, 0, 1.0, "rising"))
#: the scan packs every shape at every count in one call where that is at most this many rows
ONE_SCAN_ROWS = 256
#: (count, shape) combinations, best by the scan first, priced on every replica; the first counts among them
#: are rebalanced, and the fastest after rebalancing wins
SHAPED_COMBOS = 3
REBALANCED_COUNTS = 3
#: sample moves off the slowest shaped replica; the shares of its cost a move tries
MAX_SHED_MOVES = 12
SHED_SHARES = (0.02, 0.06, 0.15, 0.35, 0.8)
#: rebalancing stops when the best move lowers the slowest replica's makespan by less than this share
MIN_SHED_GAIN = 1e-3
#: with more replicas than this, rebalancing starts with WATER_ROUNDS global rounds (:func:`water_fill`)
WATER_FILL_REPLICAS = 16
WATER_ROUNDS = 2
#: sample moves off the slowest replica after water_fill
SHED_MOVES_AFTER_WATER = 2
#: water_fill gives a replica samples only up to this share of its micro-batches' token room (k * cap)
TOKEN_FILL = 0.9
#: a sample holding this share of its replica's cost is "dominant": the replica may keep it with only tiny ones
STRIP_SHARE = 0.25


def _shape_counts(k0: int, step: int, most: int, spec: PipelineSpec, large: bool) -> list[int]:
    out = []
    for i, f in enumerate(COUNT_FACTORS):  # at least i steps more than k0: small counts reach far enough
        k = max(-(-int(round(k0 * f)) // step), -(-k0 // step) + i) * step
        if k > most or (large and len(out) >= LARGE_MIN_COUNTS and k > LARGE_COUNT_REACH * k0):
            break
        try:
            spec.check_microbatches(k)
        except ScheduleError:
            continue
        if k not in out:
            out.append(k)
    return out


def _pack_core(pricing: PipelinePricing, samples: ShapeSamples, members: np.ndarray, weights: np.ndarray,
               parts: list[tuple[int, Shape, np.ndarray | slice]]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``members`` (sample ids by decreasing cost, padded with -1) packed by :func:`shape_pack` to
    ``weights`` in one call, each part ``(count, shape, its rows)`` relabelled to its run order, and every row priced
    in one pass of the model (every count together): ``(spans (R,), bin_of (R, n))``; a row that does not fit is
    ``inf``."""
    bin_of, ok = shape_pack(samples.lengths, samples.costs, members, weights, samples.cap)
    count_of = np.zeros(len(members), dtype=np.int64)
    for k, shape, rows in parts:
        count_of[rows] = k
        if shape.order != "target":
            bin_of[rows] = samples.in_run_order(shape, members[rows], bin_of[rows], k)
    spans = np.full(len(members), np.inf)
    picks, costs = [], []
    for k in sorted({k for k, _, _ in parts}):
        sel = (count_of == k) & ok
        if sel.any():
            picks.append(sel)
            costs.append(samples.bin_rows(members[sel], bin_of[sel], k))
    for sel, got in zip(picks, pricing.makespans_many(costs)):
        spans[sel] = got
    return spans, bin_of


def _pack_many(pricing: PipelinePricing, samples: ShapeSamples, members: np.ndarray,
               combos: list[tuple[int, Shape]]) -> tuple[np.ndarray, np.ndarray]:
    """Every row of ``members`` packed for every ``(count, shape)`` of ``combos`` in one call: ``(spans (C, R),
    bin_of (C, R, n))``; a packing that does not fit is ``inf``."""
    # shapes whose targets coincide at a count (short ramps are cut, e.g. three VPP groups) pack alike: each
    # distinct (count, targets, run order) is packed once and its packing stands for the others
    first: dict[tuple, int] = {}
    of = [first.setdefault((k, shape.order, shape.weights(k, samples.step).tobytes()), i)
          for i, (k, shape) in enumerate(combos)]
    distinct = sorted(first.values())
    r, c = len(members), len(distinct)
    width = max(combos[i][0] for i in distinct)
    w = np.full((c, width), -1.0)
    for j, i in enumerate(distinct):
        k, shape = combos[i]
        w[j, :k] = shape.weights(k, samples.step)
    parts = [(combos[i][0], combos[i][1], slice(j * r, (j + 1) * r)) for j, i in enumerate(distinct)]
    spans, bin_of = _pack_core(pricing, samples, np.tile(members, (c, 1)), np.repeat(w, r, axis=0), parts)
    at = np.asarray([distinct.index(i) for i in of])
    return spans.reshape(c, r)[at], bin_of.reshape(c, r, -1)[at]


def _pad(groups: list[np.ndarray], samples: ShapeSamples) -> np.ndarray:
    """Rows of sample ids by decreasing cost (ties by id), padded with -1."""
    sizes = np.asarray([len(g) for g in groups], dtype=np.int64)
    out = np.full((len(groups), int(sizes.max())), -1, dtype=np.int64)
    ids = np.concatenate(groups).astype(np.int64, copy=False)
    row = np.repeat(np.arange(len(groups)), sizes)
    # every row at once: by row, then by the sample's place in the step's order (decreasing cost, ties by id)
    order = np.argsort(row * len(samples.costs) + samples.rank[ids])
    out[row, np.arange(len(ids)) - np.repeat(np.cumsum(sizes) - sizes, sizes)] = ids[order]
    return out


#: a replica's packing: its sample ids by decreasing cost (ties by id) and the micro-batch of each, in run order
Packed = tuple[np.ndarray, np.ndarray]
#: what a rebalancing run asks for: rows of sample ids to pack, their count, each row's shape; it is answered
#: with their makespans and packings (:func:`_lockstep`)
Repack = tuple[list[np.ndarray], int, list[Shape]]


def _lockstep(pricing: PipelinePricing, samples: ShapeSamples, runs: list) -> list:
    """Drive rebalancing runs (generators that yield :data:`Repack` requests and return their result) side by
    side: every round, all their requests in one packing call and one pass of the model. Each run gets exactly
    what it would alone (rows pack and price independently of each other); returns their results."""
    results: list = [None] * len(runs)
    asks: dict[int, Repack] = {}

    def advance(i: int, answer) -> None:
        try:
            asks[i] = runs[i].send(answer)
        except StopIteration as stop:
            results[i] = stop.value

    for i in range(len(runs)):
        advance(i, None)
    while asks:
        order = sorted(asks)
        batch = [asks.pop(i) for i in order]
        rows = [row for ask in batch for row in ask[0]]
        members = _pad(rows, samples)
        counts = [ask[1] for ask in batch for _ in ask[0]]
        shapes = [shape for ask in batch for shape in ask[2]]
        w = np.full((len(rows), max(counts)), -1.0)
        index: dict[tuple[int, Shape], list[int]] = {}
        for i, (k, shape) in enumerate(zip(counts, shapes)):
            index.setdefault((k, shape), []).append(i)
        for (k, shape), idx in index.items():
            w[idx, :k] = shape.weights(k, samples.step)
        spans, bin_of = _pack_core(pricing, samples, members, w,
                                   [(k, shape, np.asarray(idx)) for (k, shape), idx in index.items()])
        sizes = [len(row) for row in rows]  # a row's samples come first, then its padding
        start = 0
        for i, ask in zip(order, batch):
            part = range(start, start + len(ask[0]))
            start += len(ask[0])
            advance(i, (spans[part.start:part.stop], [(members[j, :sizes[j]], bin_of[j, :sizes[j]]) for j in part]))
    return results


def water_fill(pricing: PipelinePricing, samples: ShapeSamples, groups: list[np.ndarray], k: int,
               shapes: list[Shape], spans: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """:func:`_water_fill_run` alone: ``(groups, spans)``."""
    groups, spans, _ = _lockstep(pricing, samples, [_water_fill_run(pricing, samples, groups, k, shapes, spans,
                                                                    [None] * len(groups))])[0]
    return groups, spans


def _water_fill_run(pricing: PipelinePricing, samples: ShapeSamples, groups: list[np.ndarray], k: int,
                    shapes: list[Shape], spans: np.ndarray, packs: list[Packed | None]):
    """Level the replicas' makespans in a few global rounds (:data:`WATER_ROUNDS`), for many replicas at once.

    A replica's makespan moves by ``slope`` (:attr:`PipelinePricing.slope`) per unit of cost it gains or loses at
    its count and shape (its own bubble, ``span - slope * cost``, held fixed). Each round computes the level
    ``T`` at which the replicas' costs would sum to the step's, and every replica above it hands its cheapest
    samples (never its costliest, and keeping ``k``) to the replicas furthest below, up to its excess; a replica
    whose costliest sample is dominant (:data:`STRIP_SHARE` of its cost) and whose level lies below what it would
    keep gives away everything else and takes the step's cheapest samples from the replicas below the level. The
    changed replicas are re-packed once, and the round is kept only if the slowest makespan drops.

    A rebalancing run (:func:`_lockstep`): yields its re-packings, returns ``(groups, spans, packs)``, ``packs``
    each replica's packing as far as it was re-packed (the others as given)."""
    costs, lengths = samples.costs, samples.lengths
    slope = pricing.slope
    groups, packs = list(groups), list(packs)
    for _ in range(WATER_ROUNDS):
        work = np.asarray([samples.group_cost(g) for g in groups])
        own = spans - slope * work
        level = (slope * work.sum() + own.sum()) / len(groups)
        excess = work - (level - own) / slope
        deficit = [(float(e), t) for t, e in enumerate(excess) if e < 0]
        if not deficit:
            break
        heapq.heapify(deficit)  # most negative first: the replica furthest below the level
        add: dict[int, list[int]] = {}  # replica -> samples it takes
        drop: dict[int, list[int]] = {}  # replica -> samples it gives
        # the cheapest samples of the replicas below the level, for a replica stripped down to a dominant sample
        below = [t for _, t in deficit]
        pool = np.concatenate([groups[t] for t in below])
        owner = np.repeat(below, [len(groups[t]) for t in below])
        by_cost: list[np.ndarray] = []  # the pool cheapest first, sorted when a replica is first stripped
        taken = 0

        spill = itertools.cycle(below)  # where a stripped replica's samples go once no replica is below the level
        tokens = {t: samples.group_tokens(groups[t]) for t in below}
        room = TOKEN_FILL * k * samples.cap  # what a replica's k micro-batches hold, with slack for the packing

        def give(d: int, i: int) -> bool:
            length = int(lengths[i])
            t = None
            while deficit:
                need, u = heapq.heappop(deficit)
                if tokens[u] + length <= room:
                    t = u
                    if need + costs[i] < 0:
                        heapq.heappush(deficit, (need + float(costs[i]), u))
                    break
            if t is None:
                for u in itertools.islice(spill, len(below)):
                    if tokens[u] + length <= room:
                        t = u
                        break
                else:
                    return False  # no replica below the level has room: the sample stays
            tokens[t] += length
            add.setdefault(t, []).append(int(i))
            drop.setdefault(d, []).append(int(i))
            return True

        for d in np.argsort(-excess, kind="stable"):
            d = int(d)
            if excess[d] <= 0 or spans[d] <= level * (1 + MIN_SHED_GAIN) or not below:
                break
            mine = samples.cheapest_first(groups[d])
            top = float(costs[mine[-1]])
            if top >= STRIP_SHARE * work[d] and work[d] - excess[d] < top + costs[mine[:k - 1]].sum() \
                    and taken + k - 1 <= len(pool):
                # a dominant sample: keep it with the k - 1 cheapest samples of the step's light replicas, give
                # every other sample away
                for i in mine[:-1]:
                    give(d, i)
                if not by_cost:
                    by_cost.append(np.argsort(costs[pool], kind="stable"))
                for j in by_cost[0][taken:taken + k - 1]:
                    add.setdefault(d, []).append(int(pool[j]))
                    drop.setdefault(int(owner[j]), []).append(int(pool[j]))
                taken += k - 1
                continue
            left = float(excess[d])
            for i in mine[k - 1:-1] if deficit else ():  # the k - 1 cheapest and the costliest stay
                if costs[i] > left or not deficit:
                    break
                if give(d, i):
                    left -= float(costs[i])
        if not drop:
            break
        changed = sorted(set(add) | set(drop))
        # each changed replica: the samples it keeps by id (a sample is given by its own replica only), then those
        # it takes in the order taken
        gone = np.zeros(len(costs), dtype=bool)
        gone[np.concatenate([np.asarray(ids, dtype=np.int64) for ids in drop.values()])] = True
        ids = np.concatenate([groups[t] for t in changed])
        whose = np.repeat(np.arange(len(changed)), [len(groups[t]) for t in changed])
        stay = ~gone[ids]
        ids, whose = ids[stay], whose[stay]
        ids = ids[np.lexsort((ids, whose))]
        ends = np.cumsum(np.bincount(whose, minlength=len(changed))).tolist()
        kept = [ids[a:b] for a, b in zip([0] + ends[:-1], ends)]
        rows = [np.concatenate((mine, np.asarray(add.get(t, []), dtype=np.int64))) for mine, t in zip(kept, changed)]
        got, packed = yield rows, k, [shapes[t] for t in changed]
        trial = spans.copy()
        trial[changed] = got
        if not trial.max() < spans.max() * (1 - 1e-9):
            break
        for t, row, pack in zip(changed, rows, packed):
            groups[t], packs[t] = row, pack
        spans = trial
    return groups, spans, packs


def rebalance_shaped(pricing: PipelinePricing, samples: ShapeSamples, groups: list[np.ndarray], k: int,
                     shapes: list[Shape], spans: np.ndarray) -> tuple[list[np.ndarray], list[Shape], np.ndarray]:
    """:func:`_rebalance_run` alone: ``(groups, shapes, spans)``."""
    groups, shapes, spans, _ = _lockstep(pricing, samples, [_rebalance_run(pricing, samples, groups, k, shapes, spans,
                                                                           [None] * len(groups))])[0]
    return groups, shapes, spans


def _rebalance_run(pricing: PipelinePricing, samples: ShapeSamples, groups: list[np.ndarray], k: int,
                   shapes: list[Shape], spans: np.ndarray, packs: list[Packed | None]):
    """Move the cheapest samples of the slowest replica to the fastest ones while that lowers the slowest
    makespan: a share (:data:`SHED_SHARES`) of the cost of its samples but the ``k - 1`` cheapest and the
    costliest, cheapest first, dealt over the :data:`BALANCE_PARTNERS` fastest, each replica re-packed in its own
    shape; at most :data:`MAX_SHED_MOVES` moves, while a move gains :data:`MIN_SHED_GAIN`. A replica holding a
    sample much costlier than the rest (a long trip through the pipeline) so ends up with little else. Every
    replica keeps at least ``k`` samples.

    A rebalancing run (:func:`_lockstep`): yields its re-packings, returns ``(groups, shapes, spans, packs)``."""
    groups, shapes, spans, packs = list(groups), list(shapes), spans.copy(), list(packs)
    costs = samples.costs
    if len(groups) > WATER_FILL_REPLICAS:
        groups, spans, packs = yield from _water_fill_run(pricing, samples, groups, k, shapes, spans, packs)
    for _ in range(MAX_SHED_MOVES if len(groups) <= WATER_FILL_REPLICAS else SHED_MOVES_AFTER_WATER):
        s = int(np.argmax(spans))
        partners = [int(t) for t in np.argsort(spans, kind="stable") if t != s][:BALANCE_PARTNERS]
        mine = samples.cheapest_first(groups[s])  # cheapest first
        # the k - 1 cheapest stay (they fill the ramps cheaply), and so does the costliest; the next cheapest move
        keep, movable = mine[:k - 1], mine[k - 1:-1]
        if not partners or not len(movable):
            break
        cum = np.cumsum(costs[movable])
        moves = sorted(set(np.clip(np.searchsorted(cum, np.asarray(SHED_SHARES) * cum[-1], side="right"), 1,
                                   len(movable)).tolist()))
        cands = []
        for m in moves:
            stay = np.concatenate((keep, movable[m:], mine[-1:]))
            cands.append({s: stay, **{t: np.concatenate((groups[t], movable[:m][i::len(partners)]))
                                      for i, t in enumerate(partners)}})
        if costs[mine[-1]] >= STRIP_SHARE * costs[mine].sum():
            # a dominant sample: keep it alone with the k - 1 cheapest samples of the partners, give them the rest
            theirs = np.concatenate([groups[t] for t in partners])
            tiny = theirs[np.lexsort((theirs, costs[theirs]))[:k - 1]]
            rest = mine[:-1]
            cands.append({s: np.concatenate((tiny, mine[-1:])),
                          **{t: np.concatenate((np.setdiff1d(groups[t], tiny), rest[i::len(partners)]))
                             for i, t in enumerate(partners)}})
        rows, owners = [], []
        for c, change in enumerate(cands):
            for t, row in change.items():
                if len(row) < k:
                    break
            else:
                for t, row in change.items():
                    rows.append(row)
                    owners.append((c, t))
        if not rows:
            break
        moves = cands
        got, packed = yield rows, k, [shapes[t] for _, t in owners]  # each in its replica's shape
        worst = np.full(len(moves), -np.inf)
        np.maximum.at(worst, [c for c, _ in owners], got)
        worst[worst == -np.inf] = np.inf  # a move that leaves some replica fewer than k samples
        c = int(np.argmin(worst))
        if not worst[c] < spans[s] * (1 - MIN_SHED_GAIN):
            break  # the slowest replica gains (almost) nothing
        for (ci, t), v, row, pack in zip(owners, got, rows, packed):
            if ci == c:
                groups[t], spans[t], packs[t] = row, v, pack
    return groups, shapes, spans, packs


def shaped_step(pricing: PipelinePricing, samples: ShapeSamples, replica_of: np.ndarray, k0: int,
                dp: int) -> PipelineStep | None:
    """The best shaped plan (:mod:`.pipeline_shape`) of the step's samples, starting from each replica's samples
    (``replica_of``).

    1. Every count of :data:`COUNT_FACTORS` with :data:`SCAN_SHAPES`, then every shape of :data:`SHAPES` at the
       :data:`REBALANCED_COUNTS` best counts, on the :data:`SCAN_REPLICAS` replicas most likely to be slowest (the
       heaviest, those holding the costliest samples); on large steps (:data:`FULL_SEARCH_MICROBATCHES`) on
       :data:`LARGE_SCAN_REPLICAS`, counts up to :data:`LARGE_COUNT_REACH` times the pp-unaware count.
    2. Every replica in the :data:`SHAPED_COMBOS` best ``(count, shape)`` combinations (on large steps the ones
       after the first :data:`LARGE_LEAD_COMBOS` only at those's counts); per count each replica keeps its fastest
       shape.
    3. Samples moved off the slowest replica (:func:`rebalance_shaped`), the counts side by side
       (:func:`_lockstep`); the count with the fastest slowest replica wins.

    ``None`` when no count fits (too few samples, the cap)."""
    members = replica_members(replica_of, samples.costs, dp, samples.order)
    n_min = int((members >= 0).sum(axis=1).min())
    large = k0 * dp > FULL_SEARCH_MICROBATCHES
    counts = _shape_counts(k0, samples.step, n_min, pricing.spec, large)
    if not counts:
        return None
    total = np.bincount(replica_of, weights=samples.costs, minlength=dp)
    largest = samples.costs[np.maximum(members[:, 0], 0)]
    scanned = LARGE_SCAN_REPLICAS if large else SCAN_REPLICAS
    pick = list(dict.fromkeys(np.concatenate((np.argsort(-total, kind="stable")[:scanned // 2],
                                              np.argsort(-largest, kind="stable")[:scanned]))))
    sub = members[np.asarray(pick[:scanned])] if dp > scanned else members
    # the counts with a few shapes, then every shape at the best counts (the combinations scanned already kept);
    # where every shape at every count is a small packing, all in one call (the same prices, one call fewer)
    combos = [(k, shape) for k in counts for shape in SCAN_SHAPES]
    every = combos + [(k, shape) for k in counts for shape in SHAPES if shape not in SCAN_SHAPES]
    if len(every) * len(sub) <= ONE_SCAN_ROWS:
        seen = dict(zip(every, _pack_many(pricing, samples, sub, every)[0].max(axis=1)))
        scan = np.asarray([seen[combo] for combo in combos])
    else:
        scan = _pack_many(pricing, samples, sub, combos)[0].max(axis=1)
        seen = dict(zip(combos, scan))
    best_counts = list(dict.fromkeys(combos[i][0] for i in np.argsort(scan, kind="stable") if np.isfinite(scan[i])))
    combos = [(k, shape) for k in best_counts[:REBALANCED_COUNTS] for shape in SHAPES]
    fresh = [combo for combo in combos if combo not in seen]
    if fresh:
        seen.update(zip(fresh, _pack_many(pricing, samples, sub, fresh)[0].max(axis=1)))
    scan = np.asarray([seen[combo] for combo in combos])
    ranked = [combos[i] for i in np.argsort(scan, kind="stable")[:SHAPED_COMBOS] if np.isfinite(scan[i])]
    if large:  # the last combinations only in the counts of the first (a count of its own is rebalanced too)
        lead = {k for k, _ in ranked[:LARGE_LEAD_COMBOS]}
        ranked = ranked[:LARGE_LEAD_COMBOS] + [c for c in ranked[LARGE_LEAD_COMBOS:] if c[0] in lead]
    if not ranked:
        return None
    spans, bin_of = _pack_many(pricing, samples, members, ranked)
    valid = members >= 0
    start = [row[ok] for row, ok in zip(members, valid)]  # every count starts from these groups
    runs = []  # per count: (k, its rebalancing run), or (k, the result without one)
    for k in list(dict.fromkeys(k for k, _ in ranked))[:REBALANCED_COUNTS]:
        idx = [i for i, (kk, _) in enumerate(ranked) if kk == k]
        choice = np.asarray(idx)[spans[idx].argmin(axis=0)]
        got = spans[choice, np.arange(dp)]
        if not np.isfinite(got).all():
            continue
        groups, shapes = list(start), [ranked[i][1] for i in choice]
        packs = [(row[ok], labels[ok]) for row, ok, labels in zip(members, valid, bin_of[choice, np.arange(dp)])]
        runs.append((k, _rebalance_run(pricing, samples, groups, k, shapes, got, packs) if dp > 1
                     else (groups, shapes, got, packs)))
    # the counts' rebalancing side by side (one packing call and one pass of the model per round)
    moving = [i for i, (_, run) in enumerate(runs) if not isinstance(run, tuple)]
    done = dict(zip(moving, _lockstep(pricing, samples, [runs[i][1] for i in moving])))
    best = None
    for i, (k, run) in enumerate(runs):
        _, _, got, packs = done.get(i, run)
        if best is None or got.max() < best[1].max():
            best = (k, got, packs)
    if best is None:
        return None
    k, spans, packs = best  # each replica as last packed in its shape
    step_bin = np.full(len(replica_of), -1, dtype=np.int64)
    step_bin[np.concatenate([mem for mem, _ in packs])] = np.concatenate([t * k + labels
                                                                          for t, (_, labels) in enumerate(packs)])
    count = k * dp
    slowest = int(np.argmax(spans))
    mem, labels = packs[slowest]
    row = samples.bin_rows(mem[None, :], labels[None, :], k)[0]
    return PipelineStep(step_bin, np.arange(count) // k, count, np.arange(count), spans,
                        pricing.bubble(row, spans[slowest]), f"shape+{count - k0 * dp}")


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
    heaviest: np.ndarray | None = None,
    samples: "ShapeSamples | None" = None,
) -> PipelineStep:
    """The best arrangement of one step by the model, never slower than the pp-unaware plan of the step.

    ``bin_of``/``rank_of_bin``/``count``: the pp-unaware plan; ``bin_costs_of(bin_of, count)`` prices bins;
    ``balance``: rebalance the DP assignment by makespan; ``recount(count)``: a packing and assignment with that
    many micro-batches (``None`` when it cannot), or ``None`` when the count is fixed (static batches);
    ``heaviest``: the key the pp-unaware plan orders its bins by (default: their prices); ``samples``: the step's
    samples for :func:`shaped_step` (dynamic batches), ``None`` for static batches.

    Candidates: the pp-unaware bins in the best of :func:`heuristic_orders` per rank, and the shaped plan. On steps
    of at most :data:`FULL_SEARCH_MICROBATCHES` micro-batches (and with static batches) also the older ones: the
    same bins rebalanced, then more micro-batches, the best at the pp-unaware count and the :data:`FINALISTS` - 1
    best with more micro-batches improved by swaps (:func:`polish`). The fastest is returned, or the pp-unaware
    plan if none beats it.
    """
    costs = bin_costs_of(bin_of, count)
    # dynamic batches: the micro-batches composed for the pipeline (shaped_step); on large steps that is the whole
    # search (the reordered, rebalanced and recounted candidates below cost ~10x more there and gain little)
    shaped = None if samples is None else shaped_step(pricing, samples, rank_of_bin[bin_of], count // dp, dp)
    if shaped is not None and count > FULL_SEARCH_MICROBATCHES:
        # no order of the pp-unaware bins runs a replica faster than its lower bound: where the slowest bound lies
        # above the shaped plan, neither the pp-unaware plan nor its reorderings can win, and they are not priced
        by_rank = np.argsort(rank_of_bin, kind="stable").reshape(dp, count // dp)
        bound = pipeline_lower_bound(*pricing.stage_costs(costs[by_rank]), pricing.spec)
        if float(np.max(bound)) > shaped.slowest * (1 + 1e-9):
            return shaped
    unaware = arrange(pricing, costs, bin_of, rank_of_bin, count, dp, order="heaviest-first", heaviest=heaviest)
    same = arrange(pricing, costs, bin_of, rank_of_bin, count, dp, how="order")
    if shaped is not None and count > FULL_SEARCH_MICROBATCHES:
        return min((unaware, same, shaped), key=lambda c: c.slowest)  # ties: the earlier
    if balance and dp > 1:
        rebalanced = arrange(pricing, costs, bin_of, rank_of_bin, count, dp, balance=True, how="balance")
        if rebalanced.slowest < same.slowest * (1 - 1e-9):
            same = rebalanced
    counted = []
    if recount is not None:
        best, misses = same.slowest, 0
        for extra in range(1, MAX_EXTRA_COUNT_ROUNDS + 1):
            k_count = count + extra * align
            packed = recount(k_count)
            if packed is None:
                break
            b_of, r_of_b = packed
            k_costs = bin_costs_of(b_of, k_count)
            cand = arrange(pricing, k_costs, b_of, r_of_b, k_count, dp, balance=balance and dp > 1,
                           how=f"count+{k_count - count}")
            counted.append((cand, k_costs))
            if cand.slowest < best * (1 - 1e-9):
                best, misses = cand.slowest, 0
            else:
                misses += 1
                if misses >= EXTRA_COUNT_PATIENCE:
                    break
    counted.sort(key=lambda c: c[0].slowest)
    chosen = unaware
    for cand, cand_costs in [(same, costs)] + counted[:FINALISTS - 1]:
        cand = polish(pricing, cand, cand_costs, dp)
        if cand.slowest < chosen.slowest * (1 - 1e-9):
            chosen = cand
    if shaped is not None and shaped.slowest < chosen.slowest * (1 - 1e-9):
        chosen = shaped
    return chosen


__all__ = ["DEFAULT_BACKWARD_FORWARD_RATIO", "FLOPS_MICROBATCH_OVERHEAD", "PipelinePricing", "PipelineStep",
           "ShapeSamples", "arrange", "balance_makespans", "best_orders", "heuristic_best", "heuristic_orders",
           "improve_orders", "pipeline_pricing", "plan_pipeline_step", "polish", "predicted_makespans",
           "rebalance_shaped", "shaped_step", "step_microbatch_costs", "water_fill"]
