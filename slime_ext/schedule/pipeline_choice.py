"""The pipeline search: one step's micro-batches chosen for the pipeline (the planner's stage 5, ``pp_size > 1``).

**What is searched.** For one step: which samples share a micro-batch (dynamic batches; static batches keep
upstream's chunks), how many micro-batches each replica runs (the same on every replica; with VPP a multiple of
``microbatch_group_size_per_vp_stage``), which replica runs each micro-batch, and the order each replica runs its
micro-batches in (free: the gradient is a sum).

**The objective.** The slowest replica's predicted makespan: megatron-core's schedule as :mod:`.pipeline_model`
runs it, on the prices of :mod:`.pipeline_pricing` (the slowest replica is what the step waits for).

**The candidates.** :data:`CANDIDATES` is the registry: every generator has one signature, ``(search, found) ->
new candidates`` (:class:`StepSearch`: the step; ``found``: the candidates so far, best first), and runs in the
registry's order (``PlannerConfig.candidates`` may leave some out, e.g. for a bench's ablation):

1. ``unaware``: the plan of stages 2-4 as it is, each rank heaviest first -- the guard: no step is predicted
   slower than its pp-unaware plan;
2. ``ordered``: the same micro-batches, each rank in the best of four orders (:mod:`.pipeline_orders`);
3. ``shaped`` (dynamic batches): each replica's samples re-packed into a *shape* of micro-batch sizes
   (:mod:`.pipeline_shape`), the count and the shape scanned with the model, then samples moved off the slowest
   replicas (:mod:`.pipeline_rebalance`);
4. ``recounted`` (dynamic batches): more micro-batches, packed by stages 2-4 themselves (every guard of the
   planner's own path), each rank in its best order;
5. ``refined``: the best plans so far (the best of each of the ``finalists`` best counts), improved by local moves
   on their slowest replica (:mod:`.pipeline_refine`: order swaps; with dynamic batches also single samples moved
   or swapped, within the replica or with the fastest replicas).

**The comparison.** One rule, one tolerance (:func:`beats`): a candidate replaces the best so far only when its
slowest makespan is lower by more than ``PlannerConfig.tie``; so of near-equal candidates the earliest in the
registry wins (the pp-unaware plan first). The same rule stops every loop of the search ("while a step gains").

**When it stops.** Every generator runs once. The iterative parts (the rebalancing moves, the refinement rounds)
stop when a round gains nothing, at their round limits, or when the step's work budget
(:class:`~slime_ext.schedule.pipeline_pricing.Budget`: model cells, ``budget_floor + budget_per_sample * samples``)
cannot pay for another round. The budget grows smoothly with the step: no threshold switches a part of the search
on or off. Every model call of the search is charged to it.

``bench/pipeline_search.py`` is the yardstick (a long annealing search under the same model; the planner's gap to
it per case), ``bench/pipeline_speed.py`` what the search costs against pp = 1 planning. Pure: standard library
and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from .errors import ScheduleError
from .cost import bin_costs
from .pipeline_orders import heuristic_best, heuristic_orders
from .pipeline_pricing import Budget, PipelinePricing
from .pipeline_rebalance import lockstep, rebalance_run
from .pipeline_refine import Arrangement, polish_orders, refine
from .pipeline_shape import Shape, ShapeSamples, pack_many, replica_members
from .planner_config import PlannerConfig
from .profile import CostProfile
from .step_plan import StepPlan, search_counts

__all__ = ["CANDIDATES", "StepSearch", "beats", "choose_pipeline_step", "shaped_step"]


def beats(a: float, b: float, config: PlannerConfig) -> bool:
    """The search's one comparison: makespan ``a`` beats ``b`` when lower by more than ``config.tie`` of ``b``."""
    return a < b * (1 - config.tie)


@dataclass
class StepSearch:
    """One step as every candidate generator sees it.

    ``unaware``: stages 2-4's plan; ``bin_costs``: its micro-batches' prices (the one bin pricing);
    ``heaviest``: the key its ranks run their micro-batches by (heaviest first); ``lengths``/``costs``: the step's
    samples; ``profile``: a measured profile (micro-batches priced whole) or ``None``; ``cap``: the token cap,
    ``None`` for static batches (whose micro-batches never change); ``samples``: what shaping needs (dynamic
    batches); ``budget``: the step's work budget; ``recount``/``align``: see the fields."""

    pricing: PipelinePricing
    unaware: StepPlan
    bin_costs: np.ndarray
    heaviest: np.ndarray
    dp: int
    lengths: np.ndarray
    costs: np.ndarray
    profile: CostProfile | None
    cap: int | None
    samples: ShapeSamples | None
    budget: Budget
    #: dynamic batches: stages 2-4 at exactly that many micro-batches (the planner's own path, every guard
    #: included), ``None`` where they cannot reach it; ``None`` for static batches
    recount: Callable[[int], StepPlan | None] | None = None
    #: the count moves by multiples of this (``dp_size * microbatch_group_size_per_vp_stage`` under VPP)
    align: int = 1
    #: what several generators share (the heuristic orders' prices)
    memo: dict = field(default_factory=dict)

    @property
    def config(self) -> PlannerConfig:
        return self.pricing.config


#: a candidate generator: the step and the candidates found so far (best first) -> new candidates
Generator = Callable[[StepSearch, list[StepPlan]], Iterable[StepPlan]]


# ---------------------------------------------------------------------------------------------------- candidates
def _arranged(search: StepSearch, by_rank: np.ndarray, spans: np.ndarray, strategy: str) -> StepPlan:
    """The pp-unaware bins in the run order ``by_rank`` (``(dp, k)`` bin ids), with their makespans."""
    plan = search.unaware
    slowest = int(np.argmax(spans))
    return StepPlan(plan.bin_of, plan.rank_of_bin, plan.count, strategy, plan.target, by_rank.reshape(-1), spans,
                    search.pricing.bubble(search.bin_costs[by_rank[slowest]], spans[slowest]))


def _heaviest_first(search: StepSearch) -> np.ndarray:
    plan = search.unaware
    return np.lexsort((np.arange(plan.count), -search.heaviest, plan.rank_of_bin)).reshape(search.dp, -1)


def _orders(search: StepSearch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(by_rank, orders, spans)``: the pp-unaware bins of each rank heaviest first, and every heuristic order of
    them with its makespans (``orders[0]`` is heaviest first), priced once for both candidates that need them."""
    if search.memo.get("orders") is None:
        by_rank = _heaviest_first(search)
        costs = search.bin_costs[by_rank]
        orders = heuristic_orders(costs)
        h, r, k = orders.shape
        rows = np.take_along_axis(np.broadcast_to(costs, (h, r, k)), orders, axis=-1).reshape(h * r, k)
        search.memo["orders"] = (by_rank, orders, search.budget.price(rows).reshape(h, r))
    return search.memo["orders"]


def unaware(search: StepSearch, found: list[StepPlan]) -> list[StepPlan]:
    """Stages 2-4's plan, each rank heaviest first (as it is emitted without a pipeline)."""
    by_rank, _, spans = _orders(search)
    return [_arranged(search, by_rank, spans[0], search.unaware.strategy)]


def ordered(search: StepSearch, found: list[StepPlan]) -> list[StepPlan]:
    """The same micro-batches, each rank in the best of :func:`~.pipeline_orders.heuristic_orders` (ties: the
    earlier order, so heaviest first wins a tie)."""
    by_rank, orders, spans = _orders(search)
    pick = spans.argmin(axis=0)
    r = np.arange(search.dp)
    return [_arranged(search, np.take_along_axis(by_rank, orders[pick, r], axis=1), spans[pick, r],
                      f"{search.unaware.strategy}+pp-order")]


def recounted(search: StepSearch, found: list[StepPlan]) -> list[StepPlan]:
    """Dynamic batches: more micro-batches, packed by stages 2-4 themselves (``search.recount``), each rank in the
    best of the heuristic orders: ``align`` more at a time, up to ``config.max_extra_count_rounds`` times; the count
    search (:func:`~.step_plan.search_counts`) stops after ``config.extra_count_patience`` counts in a row that do
    not beat the best of them, or when the budget cannot pay for another (keeping the refinement's share). The
    best is the candidate."""
    if search.recount is None:
        return []
    cfg, budget = search.config, search.budget
    n = len(search.lengths)

    keep = cfg.refine_share * budget.total  # what the refinement keeps

    def cost(k: int) -> float:  # stages 2-4 and one call of the model
        return budget.sample_cost(n) + budget.model_cost(4 * search.dp, k // search.dp) + budget.charge_round_cost \
            + keep

    def evaluate(k: int) -> StepPlan | None:
        if not budget.allows(cost(k)):
            return None
        budget.spent += budget.sample_cost(n) + budget.charge_round_cost
        plan = search.recount(k)
        if plan is None:
            return None
        prices = bin_costs(search.lengths, search.costs, plan.bin_of, k, search.profile)
        by_rank = np.lexsort((np.arange(k), -prices, plan.rank_of_bin)).reshape(search.dp, -1)
        order, spans = heuristic_best(search.pricing, prices[by_rank], budget)
        by_rank = np.take_along_axis(by_rank, order, axis=1)
        slowest = int(np.argmax(spans))
        return StepPlan(plan.bin_of, plan.rank_of_bin, k, f"{plan.strategy}+pp-count+{k - search.unaware.count}",
                        search.unaware.target, by_rank.reshape(-1), spans,
                        search.pricing.bubble(prices[by_rank[slowest]], spans[slowest]))

    counts = [search.unaware.count + extra * search.align for extra in range(1, cfg.max_extra_count_rounds + 1)]
    best = search_counts(counts, evaluate, lambda a, b: beats(a.slowest, b.slowest, cfg), cfg.extra_count_patience,
                         enough=lambda _, k: not budget.allows(cost(k + search.align)))
    return [] if best is None else [best]


def shaped(search: StepSearch, found: list[StepPlan]) -> list[StepPlan]:
    """Dynamic batches: :func:`shaped_step` from the pp-unaware plan's replicas."""
    if search.samples is None:
        return []
    plan = search.unaware
    got = shaped_step(search.budget, search.samples, plan.rank_of_bin[plan.bin_of], plan.count // search.dp,
                      search.dp, plan.strategy, plan.target)
    return [] if got is None else [got]


def refined(search: StepSearch, found: list[StepPlan]) -> list[StepPlan]:
    """The best plans so far (the best of each count, up to ``config.finalists`` counts, best first), each improved
    by order swaps (:func:`~.pipeline_refine.polish_orders`), then by :func:`~.pipeline_refine.refine` with an
    equal share of what is left of the budget (a share one leaves unspent passes on)."""
    finalists: dict[int, StepPlan] = {}
    for plan in found:  # best first: the first of each count
        if len(finalists) < search.config.finalists:
            finalists.setdefault(plan.count, plan)
    out = []
    for n, best in enumerate(finalists.values()):
        share = search.budget.left() / (len(finalists) - n)
        arr = Arrangement.from_plan(best, search.dp, search.lengths, search.costs, search.profile, search.cap,
                                    search.budget)
        until = search.budget.spent + share
        polish_orders(arr)
        refine(arr, np.random.default_rng(search.config.refine_seed), movable=search.cap is not None, until=until)
        if beats(float(arr.spans.max()), best.slowest, search.config):
            how = "" if "+pp-" in best.strategy else "+pp"
            out.append(arr.to_plan(f"{best.strategy}{how}-refined", best.target))
    return out


#: the registry, in the order the candidates are made and preferred on a tie
CANDIDATES: dict[str, Generator] = {"unaware": unaware, "ordered": ordered, "shaped": shaped, "recounted": recounted,
                                    "refined": refined}


def choose_pipeline_step(search: StepSearch) -> StepPlan:
    """The search of the module docstring: every generator of ``config.candidates`` in registry order; the best
    candidate by :func:`beats` (ties: the earlier). The first generator must give a candidate (``unaware``)."""
    cfg = search.config
    unknown = [name for name in cfg.candidates if name not in CANDIDATES]
    if unknown:
        raise ScheduleError(f"PlannerConfig.candidates = {cfg.candidates} names {unknown}, which the registry lacks; "
                            f"pick from {list(CANDIDATES)}")
    found: list[StepPlan] = []  # best first
    for name in cfg.candidates:
        for cand in CANDIDATES[name](search, list(found)):
            if not found or beats(cand.slowest, found[0].slowest, cfg):
                found.insert(0, cand)
            else:
                found.append(cand)
    if not found:
        raise ScheduleError(f"PlannerConfig.candidates = {cfg.candidates} made no plan; keep 'unaware' in it")
    return found[0]


# ---------------------------------------------------------------------------------------------------- shaped
def shape_counts(k0: int, step: int, most: int, pricing: PipelinePricing) -> list[int]:
    """The per-replica counts the shaped candidate scans: ``k0`` times ``config.count_factors``, each rounded up to
    the step and at least ``i`` steps above ``k0`` (small counts reach far enough), at most ``most`` (the smallest
    replica's samples), those megatron-core accepts."""
    out = []
    for i, f in enumerate(pricing.config.count_factors):
        k = max(-(-int(round(k0 * f)) // step), -(-k0 // step) + i) * step
        if k > most:
            break
        try:
            pricing.spec.check_microbatches(k)
        except ScheduleError:
            continue
        if k not in out:
            out.append(k)
    return out


def shaped_step(budget: Budget, samples: ShapeSamples, replica_of: np.ndarray, k0: int, dp: int,
                strategy: str, target: int) -> StepPlan | None:
    """The best shaped plan of the step's samples, starting from each replica's samples (``replica_of``):

    1. every count of :func:`shape_counts` with ``config.scan_shapes``, then every shape at the
       ``config.rebalanced_counts`` best counts, on up to ``config.scan_replicas`` replicas most likely to be
       slowest (the heaviest, those holding the costliest samples);
    2. every replica in the ``config.shaped_combos`` best ``(count, shape)`` combinations, the best one of each of
       the ``config.rebalanced_counts`` best counts and the first shape (flat) at those counts; per count each
       replica keeps its fastest shape;
    3. samples moved off the slowest replicas (:func:`~.pipeline_rebalance.rebalance_run`), the counts side by side
       (:func:`~.pipeline_rebalance.lockstep`); the count with the fastest slowest replica wins.

    The work is sized to the budget, less the refinement's share (``config.refine_share``): the scan takes as many
    replicas (at least ``config.min_scan_replicas``), then as many counts (at least ``config.min_scan_counts``), as
    half of what is left pays for; every
    shape at the best counts where it still fits; the rebalancing's
    single moves stop when a re-packing no longer fits (its water-filling rounds always run). ``None`` when no count
    fits (too few samples, the cap), or where even the smallest such search does not fit the budget."""
    pricing = budget.pricing
    cfg = pricing.config
    shapes = [Shape.of(s) for s in cfg.shapes]
    scan_shapes = [Shape.of(s) for s in cfg.scan_shapes]
    members = replica_members(replica_of, samples.costs, dp, samples.order)
    n_min = int((members >= 0).sum(axis=1).min())
    counts = shape_counts(k0, samples.step, n_min, pricing)
    if not counts:
        return None
    total = np.bincount(replica_of, weights=samples.costs, minlength=dp)
    largest = samples.costs[np.maximum(members[:, 0], 0)]
    budget.spent += budget.replica_cost(dp)  # the replicas' samples sorted, their totals and largest
    keep = cfg.refine_share * budget.total  # what the refinement keeps
    allowance = budget.left() - keep
    n_all, k_top = members.shape[1], max(counts)

    def work(rows: int, k: int) -> float:  # one packing call and one pass of the model
        return budget.pack_cost(rows, n_all, k) + budget.model_cost(rows, k)

    # the smallest shaped search: the first count with the scan shapes on the fewest replicas, every replica in
    # one combination; where even that does not fit, no shaped candidate (many micro-batches per replica, where the
    # pipeline's fill and drain matter least)
    fewest = min(dp, cfg.min_scan_replicas)
    if work(fewest * len(scan_shapes), counts[0]) + work(dp, counts[0]) > allowance:
        return None

    def scan_work(r: int, c: int) -> float:  # the scan of the first c counts on r replicas
        rows = r * c * len(scan_shapes)
        more = r * min(cfg.rebalanced_counts, c) * (len(shapes) - len(scan_shapes))
        return work(rows, counts[c - 1]) + work(more, counts[c - 1])

    # the scan: every count on as many of the likely slowest replicas as half the allowance pays for (at least
    # min_scan_replicas), or, where even that does not fit, as many of the first counts (at least min_scan_counts)
    scanned = max([fewest] + [r for r in range(1, min(dp, cfg.scan_replicas) + 1)
                              if scan_work(r, len(counts)) <= allowance / 2])
    counts = counts[:max([cfg.min_scan_counts] + [c for c in range(1, len(counts) + 1)
                                                  if scan_work(scanned, c) <= allowance / 2])]
    pick = list(dict.fromkeys(np.concatenate((np.argsort(-total, kind="stable")[:scanned // 2],
                                              np.argsort(-largest, kind="stable")[:scanned]))))
    sub = members[np.asarray(pick[:scanned])] if dp > scanned else members
    # the counts with a few shapes, then every shape at the best counts (the combinations scanned already kept);
    # where every shape at every count is a small packing, all in one call (the same prices, one call fewer)
    combos = [(k, shape) for k in counts for shape in scan_shapes]
    every = combos + [(k, shape) for k in counts for shape in shapes if shape not in scan_shapes]
    if len(every) * len(sub) <= cfg.one_scan_rows and work(len(every) * len(sub), counts[-1]) <= allowance / 2:
        seen = dict(zip(every, pack_many(budget, samples, sub, every)[0].max(axis=1)))
        scan = np.asarray([seen[combo] for combo in combos])
    else:
        scan = pack_many(budget, samples, sub, combos)[0].max(axis=1)
        seen = dict(zip(combos, scan))
    best_counts = list(dict.fromkeys(combos[i][0] for i in np.argsort(scan, kind="stable") if np.isfinite(scan[i])))
    combos = [(k, shape) for k in best_counts[:cfg.rebalanced_counts] for shape in shapes]
    fresh = [combo for combo in combos if combo not in seen]
    if fresh and work(len(fresh) * len(sub), max(k for k, _ in fresh)) <= budget.left() - keep:
        seen.update(zip(fresh, pack_many(budget, samples, sub, fresh)[0].max(axis=1)))
    combos = [combo for combo in combos if combo in seen]
    scan = np.asarray([seen[combo] for combo in combos])
    best_first = [combos[i] for i in np.argsort(scan, kind="stable") if np.isfinite(scan[i])]
    if not best_first:
        return None
    # the best combinations, and the best of each of the best counts (a count can fail on a replica the scan did not
    # see); at each of their counts also the first shape (the flat one: it packs wherever any does)
    ranked = best_first[:cfg.shaped_combos]
    for k in list(dict.fromkeys(k for k, _ in best_first))[:cfg.rebalanced_counts]:
        ranked += [c for c in (next(c for c in best_first if c[0] == k), (k, shapes[0])) if c not in ranked]
    spans, bin_of = pack_many(budget, samples, members, ranked)
    valid = members >= 0
    start = [row[ok] for row, ok in zip(members, valid)]  # every count starts from these groups
    runs = []  # per count: (k, its rebalancing run), or (k, the result without one)
    for k in list(dict.fromkeys(k for k, _ in ranked))[:cfg.rebalanced_counts]:
        idx = [i for i, (kk, _) in enumerate(ranked) if kk == k]
        choice = np.asarray(idx)[spans[idx].argmin(axis=0)]
        got = spans[choice, np.arange(dp)]
        if not np.isfinite(got).all():
            continue
        groups, shapes_k = list(start), [ranked[i][1] for i in choice]
        packs = [(row[ok], labels[ok]) for row, ok, labels in zip(members, valid, bin_of[choice, np.arange(dp)])]
        runs.append((k, rebalance_run(budget, samples, groups, k, shapes_k, got, packs, keep) if dp > 1
                     else (groups, shapes_k, got, packs)))
    # the counts' rebalancing side by side (one packing call and one pass of the model per round)
    moving = [i for i, (_, run) in enumerate(runs) if not isinstance(run, tuple)]
    done = dict(zip(moving, lockstep(budget, samples, [runs[i][1] for i in moving])))
    best = None
    for i, (k, run) in enumerate(runs):
        _, _, got, packs = done.get(i, run)
        if best is None or beats(got.max(), best[1].max(), cfg):
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
    return StepPlan(step_bin, np.arange(count) // k, count, f"{strategy}+pp-shape+{count - k0 * dp}", target,
                    np.arange(count), spans, pricing.bubble(row, spans[slowest]))
