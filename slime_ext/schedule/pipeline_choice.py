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
2. ``ordered``: the same micro-batches, each rank in the best of the heuristic orders (:mod:`.pipeline_orders`:
   four, and under VPP a fifth with each of the interleaved schedule's groups rising to its peak in the middle);
3. ``shaped`` (dynamic batches): each replica's samples re-packed into a *shape* of micro-batch sizes
   (:mod:`.pipeline_shape`): the counts scanned with a few shapes on the replicas likely to be slowest, every
   replica packed at the best counts, samples moved off the slowest replicas (:mod:`.pipeline_rebalance`), under
   VPP each replica's groups peaked where that is faster; one candidate per count, best first
   (:func:`shaped_step`);
4. ``refined``: the best plans so far (the best of each of the ``finalists`` best counts), improved by order swaps
   on the slowest replica, each order found tried on every replica (:func:`~.pipeline_refine.polish_orders`), then
   by local moves on the slowest replica (:func:`~.pipeline_refine.refine`: order swaps; with dynamic batches also
   single samples moved or swapped, within the replica or with the fastest replicas).

**The comparison.** One rule, one tolerance (:func:`~.pipeline_pricing.beats`, which every part calls): a
candidate replaces the best so far only when its slowest makespan is lower by more than ``objective.tie``; so of
near-equal candidates the earliest in the registry wins (the pp-unaware plan first), and ``found`` stays best first
(a candidate goes before the first it beats). The loops that move samples stop by the same rule with
``objective.min_gain``.

**When it stops: the budget.** Every generator runs once. Each part estimates its work before it runs
(:class:`~.pipeline_pricing.Budget`, counted from the model and packing calls it makes, never timed: the same
input always plans alike), runs only where the step's budget still pays for it, and is charged; loops stop when a
round gains nothing, at their round limits, or when the next round does not fit. What acts on every replica
(packing them all in each leading count's best combinations, rebalancing) is reserved first; the refinement keeps
``budget.refine_share`` of the fixed part. The budget grows smoothly with the step
(:meth:`~.pipeline_pricing.Budget.for_step`: no threshold switches a part on or off), generous for a few replicas
and sized for many by ``bench.pipeline_speed``'s grid.

What each part earns (each turned off in turn): ``docs/pipeline.md``. ``bench/pipeline_search.py`` is the yardstick
(a long annealing search under the same model), ``bench/pipeline_speed.py`` what the search costs against pp = 1
planning. Pure: standard library and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from .errors import ScheduleError
from .cost import bin_costs
from .pipeline_orders import group_peaks, heuristic_spans
from .pipeline_pricing import Budget, PipelinePricing, beats
from .pipeline_rebalance import lockstep, rebalance_run
from .pipeline_refine import Arrangement, polish_orders, refine
from .pipeline_shape import Shape, ShapeSamples, pack_many, pack_rows, replica_members
from .planner_config import PlannerConfig
from .profile import CostProfile
from .step_plan import StepPlan

__all__ = ["CANDIDATES", "StepSearch", "beats", "choose_pipeline_step", "shaped_step"]


@dataclass
class StepSearch:
    """One step as every candidate generator sees it."""

    pricing: PipelinePricing
    unaware: StepPlan  # stages 2-4's plan
    bin_costs: np.ndarray  # its micro-batches' prices (the one bin pricing)
    heaviest: np.ndarray  # the key its ranks run their micro-batches by (heaviest first)
    dp: int
    lengths: np.ndarray
    costs: np.ndarray
    profile: CostProfile | None
    cap: int | None  # None for static batches (their micro-batches never change)
    samples: ShapeSamples | None  # what shaping needs (dynamic batches)
    budget: Budget
    #: the count moves by multiples of this (``dp_size * microbatch_group_size_per_vp_stage`` under VPP)
    align: int = 1
    #: the request fixed the count (``PlanRequest.microbatches_per_rank``): every candidate keeps ``unaware.count``
    #: (the shaped candidate is scanned at that count alone)
    fixed_count: bool = False
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


def _orders(search: StepSearch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(by_rank, orders, spans)``: the pp-unaware bins of each rank heaviest first, and every heuristic order of
    them with its makespans (``orders[0]`` is heaviest first), priced once for both candidates that need them."""
    if search.memo.get("orders") is None:
        plan = search.unaware
        by_rank = np.lexsort((np.arange(plan.count), -search.heaviest, plan.rank_of_bin)).reshape(search.dp, -1)
        search.memo["orders"] = (by_rank, *heuristic_spans(search.pricing, search.bin_costs[by_rank], search.budget))
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


def shaped(search: StepSearch, found: list[StepPlan]) -> list[StepPlan]:
    """Dynamic batches: :func:`shaped_step` from the pp-unaware plan's replicas."""
    if search.samples is None:
        return []
    plan = search.unaware
    return shaped_step(search.budget, search.samples, plan.rank_of_bin[plan.bin_of], plan.count // search.dp,
                       search.dp, plan.strategy, plan.target, fixed_count=search.fixed_count)


def refined(search: StepSearch, found: list[StepPlan]) -> list[StepPlan]:
    """The best plans so far (the best of each count, up to ``refinement.finalists`` counts, best first), each improved
    by order swaps (:func:`~.pipeline_refine.polish_orders`), then by :func:`~.pipeline_refine.refine`, within its
    share of what is left of the budget: ``refinement.lead_share`` for the best, the rest in equal shares (a share one
    leaves unspent passes on)."""
    cfg, budget = search.config, search.budget
    finalists: dict[int, StepPlan] = {}
    for plan in found:  # best first: the first of each count
        if len(finalists) < cfg.refinement.finalists:
            finalists.setdefault(plan.count, plan)
    out = []
    for n, best in enumerate(finalists.values()):
        left = len(finalists) - n
        share = budget.left() * (1.0 if left == 1 else cfg.refinement.lead_share if n == 0 else 1 / left)
        if not budget.allows(2 * budget.arrangement_cost(len(search.lengths), search.dp)):
            break
        budget.spent += 2 * budget.arrangement_cost(len(search.lengths), search.dp)  # taken apart, put together
        arr = Arrangement.from_plan(best, search.dp, search.lengths, search.costs, search.profile, search.cap,
                                    budget)
        with budget.capped(budget.spent + share):
            polish_orders(arr)
            refine(arr, np.random.default_rng(cfg.refinement.refine_seed), movable=search.cap is not None)
        if beats(float(arr.spans.max()), best.slowest, search.config):
            how = "" if "+pp-" in best.strategy else "+pp"
            out.append(arr.to_plan(f"{best.strategy}{how}-refined", best.target))
    return out


#: the registry, in the order the candidates are made and preferred on a tie
CANDIDATES: dict[str, Generator] = {"unaware": unaware, "ordered": ordered, "shaped": shaped, "refined": refined}


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
            # before the first it beats: the list stays best first, and of near-equal ones the earlier first
            at = next((i for i, old in enumerate(found) if beats(cand.slowest, old.slowest, cfg)), len(found))
            found.insert(at, cand)
    if not found:
        raise ScheduleError(f"PlannerConfig.candidates = {cfg.candidates} made no plan; keep 'unaware' in it")
    return found[0]


# ---------------------------------------------------------------------------------------------------- shaped
def _group_peaked(budget: Budget, samples: ShapeSamples, results: list, reserve: float) -> list:
    """Under VPP: every replica of each count's shaped plan (``(k, spans, packs)``) also priced with each of its
    interleaved groups rising to its peak in the middle (:func:`~.pipeline_orders.group_peaks`), in one call of the
    model; a replica takes that order where it runs faster. Skipped where the budget cannot pay for it."""
    group = budget.pricing.spec.microbatch_group_size_per_vp_stage
    rows_all, orders = [], []
    for k, spans, packs in results:
        dp = len(packs)
        ids = np.concatenate([mem for mem, _ in packs])
        flat = np.concatenate([t * k + labels for t, (_, labels) in enumerate(packs)])
        rows = bin_costs(samples.lengths[ids], samples.costs[ids], flat, dp * k, samples.profile).reshape(dp, k)
        order = group_peaks(rows, group)
        rows_all.append(np.take_along_axis(rows, order, axis=1))
        orders.append(order)
    if not rows_all or not budget.allows(budget.model_cost(sum(len(r) for r in rows_all),
                                                           max(r.shape[1] for r in rows_all)) + reserve):
        return results
    got_all = budget.price_many(rows_all)
    out = []
    for (k, spans, packs), order, got in zip(results, orders, got_all):
        spans, packs = spans.copy(), list(packs)
        for t in np.flatnonzero(beats(got, spans, budget.pricing.config)).tolist():
            where = np.empty(k, dtype=np.int64)
            where[order[t]] = np.arange(k)  # the bin at position p of the new order is the old bin order[t][p]
            packs[t] = (packs[t][0], where[packs[t][1]])
            spans[t] = got[t]
        out.append((k, spans, packs))
    return out


def _rank_counts(combos: list[tuple[int, Shape]], scan: np.ndarray, cfg: PlannerConfig, dp: int) -> list[int]:
    """The scanned counts, best first by their best combination's span (``scan``; ``inf``: did not pack), except
    that with several replicas the counts within ``count_search.count_tie`` of the best come first, the most
    micro-batches first: the scan prices each replica's own samples before the rebalancing moves any, and of counts
    it cannot tell apart the one with more micro-batches levels the slowest replicas further (more, smaller pieces
    to move). One replica has nothing to level: the scan's order stands."""
    best: dict[int, float] = {}
    for (k, _), span in zip(combos, scan.tolist()):
        if span < best.get(k, np.inf):
            best[k] = span
    ranked = sorted(best, key=best.__getitem__)  # (ties: the count scanned first)
    if not ranked:
        return []
    tie = cfg.count_search.count_tie if dp > 1 else 0.0
    near = sorted((k for k in ranked if best[k] <= best[ranked[0]] * (1 + tie)), reverse=True)
    return near + [k for k in ranked if k not in near]


def shape_counts(k0: int, step: int, most: int, pricing: PipelinePricing) -> list[int]:
    """The per-replica counts the shaped candidate scans: ``k0`` times each of ``count_search.count_factors``,
    rounded up to the step, at least ``i`` steps above ``k0``, at most ``most`` (the smallest replica's samples),
    those megatron-core accepts."""
    out = []
    factors = pricing.config.count_search.count_factors
    reach = max(-(-int(round(k0 * max(factors))) // step) * step, k0 + len(factors) - 1)
    for i, f in enumerate(factors):
        k = max(-(-int(round(k0 * f)) // step), -(-k0 // step) + i) * step
        if k > most or k > reach:
            break
        try:
            pricing.spec.check_microbatches(k)
        except ScheduleError:
            continue
        if k not in out:
            out.append(k)
    return out


def shaped_step(budget: Budget, samples: ShapeSamples, replica_of: np.ndarray, k0: int, dp: int,
                strategy: str, target: int, fixed_count: bool = False) -> list[StepPlan]:
    """The shaped plans of the step's samples (``replica_of``: each sample's replica), one per count rebalanced,
    fastest first, at most ``refinement.finalists``: the scan (:meth:`_Shaped.scan`), every replica packed
    (:meth:`_Shaped.packed`), rebalanced (:meth:`_Shaped.rebalanced`), under VPP its groups peaked
    (:func:`_group_peaked`). Empty where no count fits or the budget does not pay for the smallest scan.
    ``fixed_count``: ``k0`` is the only count (a request's ``microbatches_per_rank``)."""
    shaping = _Shaped.start(budget, samples, replica_of, k0, dp, fixed_count)
    if shaping is None:
        return []
    scanned = shaping.scan()
    if scanned is None:
        return []
    results = shaping.rebalanced(*shaping.packed(*scanned))
    if budget.pricing.spec.vpp_size > 1:
        results = _group_peaked(budget, samples, results, shaping.refine_keep)
    return shaping.plans(results, replica_of, k0, strategy, target)


@dataclass
class _Shaped:
    """What the stages of :func:`shaped_step` share: the step's samples, each replica's (``members``), the counts
    and shapes, and the budget the refinement (``refine_keep``) and the group peaks keep (``keep``: both)."""

    budget: Budget
    samples: ShapeSamples
    members: np.ndarray
    counts: list[int]
    shapes: list[Shape]
    scan_shapes: list[Shape]
    total: np.ndarray  # each replica's cost
    refine_keep: float
    keep: float

    @classmethod
    def start(cls, budget: Budget, samples: ShapeSamples, replica_of: np.ndarray, k0: int, dp: int,
              fixed_count: bool) -> "_Shaped | None":
        pricing = budget.pricing
        cfg = pricing.config
        pp = pricing.spec.pp_size
        # (per-stage ramps may meet fixed ones)
        shapes = list(dict.fromkeys(Shape.of(s, pp) for s in cfg.shaping.shapes))
        scan_shapes = list(dict.fromkeys(Shape.of(s, pp) for s in cfg.shaping.scan_shapes))  # the same objects (cached)
        members = replica_members(replica_of, samples.costs, dp, samples.order)
        counts = shape_counts(k0, samples.step, int((members >= 0).sum(axis=1).min()), pricing)
        if fixed_count:
            counts = counts[:1] if counts and counts[0] == k0 else []
        if not counts:
            return None
        total = np.bincount(replica_of, weights=samples.costs, minlength=dp)
        budget.spent += budget.arrangement_cost(len(replica_of), dp)  # each replica's samples sorted, totals
        refine_keep = cfg.budget.refine_share * budget.floor  # what the refinement keeps (a share of the fixed part)
        # ... and under VPP the group peaks of the counts' plans (one call of the model; see _group_peaked)
        peaks = budget.model_cost(dp * cfg.count_search.rebalanced_counts, max(counts)) \
            if pricing.spec.vpp_size > 1 else 0.0
        return cls(budget, samples, members, counts, shapes, scan_shapes, total, refine_keep, refine_keep + peaks)

    @property
    def cfg(self) -> PlannerConfig:
        return self.budget.pricing.config

    @property
    def dp(self) -> int:
        return len(self.members)

    def work(self, rows: int, k: int) -> float:
        """One packing call and one pass of the model."""
        return self.budget.pack_cost(rows, self.members.shape[1], k) + self.budget.model_cost(rows, k)

    def scan_work(self, r: int, c: int) -> float:
        """The scan of ``c`` of the counts (spread: the last among them) on ``r`` replicas."""
        rows = r * c * len(self.scan_shapes)
        more = r * min(self.cfg.count_search.rebalanced_counts, c) * (len(self.shapes) - len(self.scan_shapes))
        k = self.counts[-1] if c > 1 else self.counts[0]
        return self.work(rows, k) + self.work(more, k)

    def rebalancing(self, c: int, k: int) -> float:
        """The rebalancing of ``c`` counts side by side (one call a round): its water-filling rounds re-packing
        every replica at worst, then its single moves (a few rows per share tried)."""
        cfg, dp = self.cfg, self.dp
        if dp <= cfg.rebalancing.water_fill_replicas:
            return 0.0
        water = cfg.rebalancing.water_rounds * (c * self.budget.replica_cost(dp) + self.work(dp * c, k))
        # each share tried: the slowest, its partners
        rows = len(cfg.rebalancing.shed_shares) * (1 + cfg.rebalancing.balance_partners) * c
        moves = cfg.rebalancing.shed_moves_after_water * (c * self.budget.cfg.loop_round + self.work(rows, k))
        return water + moves

    def later(self, c: int, combos: int | None = None) -> float:
        """Every replica in ``c`` counts packed in ``combos`` combinations, and their rebalancing. The scan takes its
        share after this, sized with ``c * (1 + count_search.shaped_combos)`` combinations (the default: with few
        samples per replica a replica's best shape pays more than a wider scan of the counts; fitted to
        ``bench.pipeline_speed``'s grid); the shapes widened after the scan leave only :meth:`most_packed`."""
        k = self.counts[len(self.counts) // 2]
        combos = c * (1 + self.cfg.count_search.shaped_combos) if combos is None else combos
        return self.work(self.dp * combos, k) + self.rebalancing(c, k)

    def most_packed(self, c: int) -> int:
        """The most combinations :meth:`_full_packing` packs every replica in for ``c`` counts: per count, those of
        the ``count_search.shaped_combos`` best that are its own (else its best alone), and the flat shape; in all
        ``S + 2 c - 1`` at most, ``S = max(shaped_combos, 1)``."""
        return max(self.cfg.count_search.shaped_combos, 1) + 2 * c - 1

    def scan(self) -> tuple[list, list[int], int] | None:
        """Stage 1 of :func:`shaped_step`: the counts of :func:`shape_counts` with ``shaping.scan_shapes`` on the
        replicas likely to be slowest, then every shape at the best counts: ``(the combinations best first, the
        counts ranked, how many lead)``, or ``None``. What comes later (the full packing and rebalancing of as many
        counts as fit) is reserved first; the scan takes up to ``count_search.scan_share`` of the allowance."""
        cfg, dp, scan_shapes = self.cfg, self.dp, self.scan_shapes
        allowance = self.budget.left() - self.keep
        # the smallest shaped search: the first count with the scan shapes on the fewest replicas, every replica
        fewest = min(dp, cfg.count_search.min_scan_replicas)
        if self.work(fewest * len(scan_shapes), self.counts[0]) + self.work(dp, self.counts[0]) > allowance:
            return None
        n_leads = cfg.count_search.rebalanced_counts
        smallest = self.work(fewest * len(self.counts) * len(scan_shapes), self.counts[-1])
        while n_leads > 1 and smallest + self.later(n_leads) > allowance:
            n_leads -= 1
        scan_allowance = max(smallest, min(allowance * cfg.count_search.scan_share, allowance - self.later(n_leads)))
        scanned = max([fewest] + [r for r in range(1, min(dp, cfg.count_search.scan_replicas) + 1)
                                  if self.scan_work(r, len(self.counts)) <= scan_allowance])
        sub = self._likely_slowest(scanned)
        # the counts the scanned replicas can hold, as many as the scan pays for, spread over that range
        counts = [k for k in self.counts if k <= int((sub >= 0).sum(axis=1).min())] or self.counts[:1]
        fit = max([cfg.count_search.min_scan_counts] + [c for c in range(1, len(counts) + 1)  # (other shapes: cut)
                                           if self.work(scanned * c * len(scan_shapes), counts[-1]) <= scan_allowance])
        if fit < len(counts):
            counts = [counts[i] for i in sorted(set(np.linspace(0, len(counts) - 1, fit).round().astype(int).tolist()))]
        self.counts = counts
        combos, scan, seen = self._scan_counts(sub, scan_allowance)
        combos, scan = self._widen(sub, combos, scan, seen, n_leads)
        best_first = [combos[i] for i in np.argsort(scan, kind="stable") if np.isfinite(scan[i])]
        if not best_first:
            return None
        return best_first, _rank_counts(combos, scan, cfg, dp), n_leads

    def _likely_slowest(self, scanned: int) -> np.ndarray:
        """The members of up to ``scanned`` replicas likely to be slowest: those holding the costliest samples, and
        the heaviest or, with many replicas (the rebalancing levels them), typical ones (the middle of the range
        ``count_search.typical_replicas``)."""
        cfg, dp, total = self.cfg, self.dp, self.total
        largest = self.samples.costs[np.maximum(self.members[:, 0], 0)]
        if dp > cfg.rebalancing.water_fill_replicas:
            by_total = np.argsort(total, kind="stable")
            lo, hi = (int(share * dp) for share in cfg.count_search.typical_replicas)
            typical = by_total[np.linspace(lo, hi, max(1, scanned // 2)).round().astype(int)]
            pick = list(dict.fromkeys(np.concatenate((typical, np.argsort(-largest, kind="stable")[:scanned]))))
        else:
            pick = list(dict.fromkeys(np.concatenate((np.argsort(-total, kind="stable")[:scanned // 2],
                                                      np.argsort(-largest, kind="stable")[:scanned]))))
        return self.members[np.asarray(pick[:scanned])] if dp > scanned else self.members

    def _scan_counts(self, sub: np.ndarray, scan_allowance: float) -> tuple[list, np.ndarray, dict]:
        """Every count with the scan shapes on ``sub``; where every shape at every count is a small packing, all
        in one call (the same prices, one call fewer): ``(combinations, their spans, every span seen)``."""
        counts, budget, samples = self.counts, self.budget, self.samples
        combos = [(k, shape) for k in counts for shape in self.scan_shapes]
        rest = [shape for shape in self.shapes if not any(shape is t for t in self.scan_shapes)]
        every = combos + [(k, shape) for k in counts for shape in rest]
        if len(every) * len(sub) <= self.cfg.count_search.one_scan_rows \
                and self.work(len(every) * len(sub), counts[-1]) <= scan_allowance:
            seen = dict(zip(every, pack_many(budget, samples, sub, every)[0].max(axis=1)))
            return combos, np.asarray([seen[combo] for combo in combos]), seen
        scan = pack_many(budget, samples, sub, combos)[0].max(axis=1)
        return combos, scan, dict(zip(combos, scan))

    def _widen(self, sub: np.ndarray, combos: list, scan: np.ndarray, seen: dict, n_leads: int):
        """Every shape at the best counts (those scanned already kept), the last shapes cut first where the budget
        left after what comes later does not pay for them all: ``(combinations, their spans)``."""
        best_counts = _rank_counts(combos, scan, self.cfg, self.dp)
        combos = [(k, shape) for shape in self.shapes for k in best_counts[:n_leads]]  # (shape-major: see below)
        fresh = [combo for combo in combos if combo not in seen]
        room = self.budget.left() - self.keep - self.later(n_leads, self.most_packed(n_leads))
        while fresh and self.work(len(fresh) * len(sub), max(k for k, _ in fresh)) > room:
            fresh = fresh[:len(fresh) - n_leads]  # the last shapes first (at every count alike)
        if fresh:
            seen.update(zip(fresh, pack_many(self.budget, self.samples, sub, fresh)[0].max(axis=1)))
        combos = [combo for combo in combos if combo in seen]
        return combos, np.asarray([seen[combo] for combo in combos])

    def packed(self, best_first: list, ordered_counts: list[int], n_leads: int):
        """Stage 2 of :func:`shaped_step`: every replica in the leading counts (as many as the budget pays for);
        where a count fails on every replica, the next count scanned, as far as the budget pays for it."""
        budget, keep = self.budget, self.keep
        leads = ordered_counts[:n_leads]
        while len(leads) > 1 and not budget.allows(self.work(self.dp * len(leads), max(leads)) + keep):
            leads.pop()  # every replica in each count's best: as many counts as the budget pays for
        first, best_span, best_bin, choice = self._full_packing(leads, best_first)
        following = ordered_counts[len(leads):]
        while following and not np.isfinite(best_span).all(axis=1).any() \
                and budget.allows(self.work(self.dp, following[0]) + keep):
            f2, s2, b2, c2 = self._full_packing([following.pop(0)], best_first)
            first, best_span, best_bin, choice = first + f2, np.vstack((best_span, s2)), \
                np.vstack((best_bin, b2)), choice + c2
        return first, best_span, best_bin, choice

    def _full_packing(self, leads: list[int], best_first: list) -> tuple[list, np.ndarray, np.ndarray, list]:
        """Every replica in the counts ``leads``: ``(each count's best combination, spans (C, dp), bin_of, each
        replica's shape per count)``. Per count its best combination, then its other leading ones (of the
        ``count_search.shaped_combos`` best) and the first shape (flat: it packs wherever any does); each replica keeps
        its fastest. Every replica is packed in each count's best; in the others, every replica where the budget
        pays for it (less the rebalancing's reserve), else the slowest (and failed) replicas of the count as far as
        it pays."""
        cfg, budget, samples, members, dp = self.cfg, self.budget, self.samples, self.members, self.dp
        per_count = []
        for k in leads:
            mine = [c for c in best_first[:cfg.count_search.shaped_combos] if c[0] == k]
            mine = mine or [next(c for c in best_first if c[0] == k)]
            per_count.append(mine + ([(k, self.shapes[0])] if (k, self.shapes[0]) not in mine else []))
        first = [combos_k[0] for combos_k in per_count]
        extras = [(c, combo) for c, combos_k in enumerate(per_count) for combo in combos_k[1:]]
        k_max = max(leads)
        reserve = self.keep + self.rebalancing(len(leads), k_max)  # the rebalancing comes first
        if not extras or budget.allows(self.work(dp * (len(first) + len(extras)), k_max) + reserve):
            spans, bin_of = pack_many(budget, samples, members, first + [combo for _, combo in extras])
            best_span, best_bin = spans[:len(first)].copy(), bin_of[:len(first)].copy()
            tried = [(np.arange(dp), spans[len(first) + i], bin_of[len(first) + i]) for i in range(len(extras))]
        else:
            best_span, best_bin = pack_many(budget, samples, members, first)
            # as many of each count's slowest replicas as the budget pays for (the estimate is affine in the rows)
            fixed, per_row = self.work(0, k_max), self.work(1, k_max) - self.work(0, k_max)
            contenders = min(dp, max(0, int((budget.left() - reserve - fixed) / (per_row * len(extras)))))
            # ... and at least the replicas a count failed on (rare and few: without them the count is lost)
            contenders = max(contenders, int((~np.isfinite(best_span)).sum(axis=1).max()))
            tried = []
            if contenders:
                rows = [np.argsort(-best_span[c], kind="stable")[:contenders] for c, _ in extras]
                got_spans, got_bins = pack_rows(budget, samples, members, rows, [combo for _, combo in extras])
                tried = list(zip(rows, got_spans, got_bins))
        choice = [[combo[1]] * dp for combo in first]
        for (c, (_, shape)), (rows, sp, bo) in zip(extras, tried):  # in order: only a faster one replaces
            better = sp < best_span[c][rows]
            if better.any():
                hit = rows[better]
                best_span[c][hit], best_bin[c][hit] = sp[better], bo[better]
                for r in hit.tolist():
                    choice[c][r] = shape
        return first, best_span, best_bin, choice

    def rebalanced(self, first: list, best_span: np.ndarray, best_bin: np.ndarray, choice: list) -> list:
        """Stage 3 of :func:`shaped_step`: per count that packed on every replica, samples moved off the slowest
        replicas, the counts side by side: ``[(k, spans, packs)]``."""
        budget, members, dp = self.budget, self.members, self.dp
        valid = members >= 0
        start = [row[ok] for row, ok in zip(members, valid)]  # every count starts from these groups
        runs, fixed = [], {}  # per count: (k, its rebalancing run); the result of a single replica's
        for c, (k, _) in enumerate(first):
            got = best_span[c]
            if not np.isfinite(got).all():
                continue
            budget.spent += budget.arrangement_cost(0, dp)  # each replica's packing, as a run takes it
            packs = [(row[ok], labels[ok]) for row, ok, labels in zip(members, valid, best_bin[c])]
            if dp > 1:
                runs.append((k, rebalance_run(budget, self.samples, list(start), k, choice[c], got, packs,
                                              self.keep)))
            else:
                fixed[len(runs)] = (k, got, packs)
                runs.append((k, None))
        # (the rebalancing comes before the refinement's share: a run's own checks keep it for its single moves)
        moving = [i for i, (_, run) in enumerate(runs) if run is not None]
        done = dict(zip(moving, lockstep(budget, self.samples, [runs[i][1] for i in moving])))
        return [fixed[i] if i in fixed else (k, *done[i][2:]) for i, (k, _) in enumerate(runs)]

    def plans(self, results: list, replica_of: np.ndarray, k0: int, strategy: str, target: int) -> list[StepPlan]:
        """The counts' plans, fastest first (ties: the count scanned best first), as many as the refinement takes,
        each replica as last packed in its shape."""
        budget, pricing, dp = self.budget, self.budget.pricing, self.dp
        ranked = sorted(range(len(results)), key=lambda i: results[i][1].max())[:self.cfg.refinement.finalists]
        out = []
        for k, spans, packs in (results[i] for i in ranked):
            budget.spent += budget.arrangement_cost(len(replica_of), dp)
            step_bin = np.full(len(replica_of), -1, dtype=np.int64)
            step_bin[np.concatenate([mem for mem, _ in packs])] = np.concatenate(
                [t * k + labels for t, (_, labels) in enumerate(packs)])
            count = k * dp
            slowest = int(np.argmax(spans))
            mem, labels = packs[slowest]
            row = self.samples.bin_rows(mem[None, :], labels[None, :], k)[0]
            out.append(StepPlan(step_bin, np.arange(count) // k, count, f"{strategy}+pp-shape+{count - k0 * dp}",
                                target, np.arange(count), spans, pricing.bubble(row, spans[slowest])))
        return out
