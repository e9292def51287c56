"""Rollout-side global micro-batch scheduling: which DP rank trains which sample in which micro-batch of which step.

One call plans one :class:`~.request.PlanRequest`, in five stages:

  1. **Steps.** Explicit steps (``step_of``) as given; else whole rollouts, first-occurrence order, cut into steps
     of ``global_batch_size`` rollouts (one step with ``use_dynamic_global_batch_size``); trailing rollouts that do
     not fill a step go to ``DPSchedule.dropped``.
  2. **Pack.** Static: ``micro_batch_size`` chunks. Dynamic: bins of at most ``cap = max_tokens_per_gpu * cp_size``
     tokens, as many as :func:`~.bounds.microbatch_target`, by LPT (else best fit decreasing).
  3. **Align.** The count is a multiple of ``align = dp_size * (mb_group if vpp_size > 1 else 1)``; too few bins
     are grown by halving the largest.
  4. **Distribute.** ``count / dp_size`` micro-batches per rank, serpentine or (``balance_data``) balanced; where
     even bins cannot balance the ranks, bins are chosen per rank and ``align`` more micro-batches are spent while
     they pay ``extra_microbatch_gain``.
  5. **Pipeline** (``pp_size > 1``): the search of :mod:`.pipeline_choice`, whose docstring states it.

Invariants (:func:`~.invariants.check_schedule`): equal micro-batch counts on every rank, each step's total a
positive multiple of ``align``; ``micro_batch_indices[r]`` tiles ``partitions[r]`` in order, no micro-batch empty;
every sample scheduled or dropped exactly once; a micro-batch holds at most ``cap`` tokens unless it is one
oversize sample (static: at most ``micro_batch_size`` samples); steps hold whole rollouts in order (explicit: their
samples); a fixed ``microbatches_per_rank`` holds in every step; the same input gives the same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .bounds import align_up, bin_lower_bound, microbatch_target
from .config import BatchConfig, ParallelConfig
from .cost import bin_costs, sample_costs
from .distribute import (LightestWithRoom, build_rank_bins, lpt_equal_count, rank_bins_to_labels, refine_by_swaps,
                         serpentine)
from .dp_schedule import DPSchedule, StepStats
from .errors import ScheduleError
from .profile import CostProfile
from .packing import best_fit_decreasing, bins_to_labels, grow_to_count, lpt_pack
from .pipeline_choice import StepSearch, choose_pipeline_step
from .pipeline_pricing import Budget, PipelinePricing, pipeline_pricing
from .pipeline_shape import ShapeSamples
from .planner_config import PlannerConfig
from .step_plan import StepPlan, search_counts
from .steps import group_steps, rollout_ordinals, split_into_steps

__all__ = ["check_fixed_count", "plan_steps", "request_steps"]


# ---------------------------------------------------------------------------------------------------- stages 2-4
@dataclass(frozen=True)
class _DynamicStep:
    """One dynamic step's samples and what prices them (with a ``profile``: the slowest rank's predicted seconds)."""

    lengths: np.ndarray
    costs: np.ndarray
    cap: int
    parallel: ParallelConfig
    batch: BatchConfig
    step: int
    profile: CostProfile | None
    config: PlannerConfig

    def slowest(self, bin_of: np.ndarray, rank_of_bin: np.ndarray) -> float:
        per_bin = bin_costs(self.lengths, self.costs, bin_of, len(rank_of_bin), self.profile)
        busy = float(np.bincount(rank_of_bin, weights=per_bin, minlength=self.parallel.dp_size).max())
        return busy + (self.profile.step_overhead_s if self.profile is not None else 0.0)

    def floor(self, count: int) -> float:
        """No assignment of ``count`` micro-batches beats this: the mean rank, or the rank of the costliest sample."""
        dp = self.parallel.dp_size
        floor = max(float(self.costs.sum()) / dp, float(self.costs.max()))
        if self.profile is not None:
            floor += self.profile.step_overhead_s + self.profile.microbatch_overhead_s * (count // dp)
        return floor

    def pack(self, count: int | None) -> tuple[np.ndarray, int, int, str] | None:
        """Stages 2-3: ``(bin_of, count, target, strategy)``: LPT into ``target`` capped bins (whole rounds, else
        sequential LPT), else best fit decreasing grown to the aligned count. A fixed ``count``: ``None`` where
        the packing cannot reach it."""
        lengths, cap, align, n = self.lengths, self.cap, self.parallel.align, len(self.lengths)
        target = microbatch_target(lengths, cap, align)
        if count is not None:
            if count > n or count < bin_lower_bound(lengths, cap):
                return None
            target = count
        if n < target:
            raise ScheduleError(
                f"step {self.step} has {n} samples but needs at least {target} micro-batches (a multiple of "
                f"dp_size*mb_group = {align} covering its {int(lengths.sum())} tokens under the cap {cap}): too few "
                f"samples to give every micro-batch one; raise --max-tokens-per-gpu, lower the DP/VPP alignment or "
                f"put more rollouts per step (--global-batch-size)"
            )
        by_cost = self.batch.balance_by_flops
        weights, prefix = (self.costs, "cost-") if by_cost else (lengths, "")
        bin_of = lpt_pack(lengths, weights, self.order, target, cap)
        if bin_of is None:
            bin_of = lpt_pack(lengths, weights, self.order, target, cap, graham=True)
        if bin_of is not None:
            return bin_of, target, target, prefix + "lpt"
        bins = best_fit_decreasing(lengths, cap, self.order)
        got = max(target, align_up(len(bins), align))
        if count is not None and got != count:
            return None
        if got > n:
            raise ScheduleError(
                f"step {self.step}: the samples need {len(bins)} micro-batches under the cap {cap} (best fit "
                f"decreasing); the next multiple of dp_size*mb_group = {align} is {got}, but there are only {n} "
                f"samples to fill them; raise --max-tokens-per-gpu, put more rollouts in a step (--global-batch-size) "
                f"or lower the DP/VPP alignment"
            )
        if len(bins) < got:
            loads = np.bincount(bins_to_labels(bins, n), weights=lengths, minlength=len(bins))
            grow_to_count(bins, got, lengths, loads.astype(np.int64).tolist())
        return bins_to_labels(bins, n), got, target, prefix + "bfd"

    @cached_property
    def order(self) -> np.ndarray:
        return np.argsort(-self.lengths, kind="stable")  # decreasing length == decreasing cost

    def rank_greedy(self, count: int, target: int) -> tuple[StepPlan, float] | None:
        """Bins chosen per rank at ``count`` micro-batches, with the slowest rank's cost."""
        if count > len(self.lengths):
            return None
        rank_bins = build_rank_bins(self.lengths, self.costs, self.order, self.cap, self.parallel.dp_size,
                                    count // self.parallel.dp_size, by_cost=self.batch.balance_by_flops)
        if rank_bins is None:
            return None
        b_of, r_of_b = rank_bins_to_labels(rank_bins, len(self.lengths))
        name = "rank-greedy" if count == target else f"rank-greedy+{count - target}"
        return StepPlan(b_of, r_of_b, count, name, target), self.slowest(b_of, r_of_b)

    def better(self, cand: tuple[StepPlan, float], incumbent: tuple[StepPlan, float]) -> bool:
        """Without a profile an extra micro-batch must win by ``extra_microbatch_gain``."""
        extra = cand[0].count > incumbent[0].count and self.profile is None
        return cand[1] < incumbent[1] * (1 - (self.config.packing.extra_microbatch_gain if extra else 0.0))

    def plan(self, count: int | None = None) -> StepPlan | None:
        """Stages 2-4: capped bins, aligned, on ranks; ``count`` fixes the count (``None`` where unreachable)."""
        packed = self.pack(count)
        if packed is None:
            return None
        bin_of, got, target, strategy = packed
        dp, config = self.parallel.dp_size, self.config
        prices = bin_costs(self.lengths, self.costs, bin_of, got, self.profile)  # a profile prices them whole
        if not (self.batch.balance_data and dp > 1):
            return StepPlan(bin_of, serpentine(prices, dp), got, strategy, target)
        rank_of_bin = refine_by_swaps(prices, lpt_equal_count(prices, dp), dp, config.packing.refine_tolerance,
                                      config.packing.refine_rounds, config.packing.dense_swap_limit)
        best_max = self.slowest(bin_of, rank_of_bin)
        if self.profile is not None:  # balancing never predicts slower than the strided deal of the same bins
            strided = serpentine(prices, dp)
            strided_max = self.slowest(bin_of, strided)
            if strided_max < best_max:
                rank_of_bin, best_max = strided, strided_max
        best = StepPlan(bin_of, rank_of_bin, got, strategy, target)
        if best_max <= self.floor(got) * (1 + config.packing.balance_tolerance):
            return best
        # bins of even size cannot balance this step: bins per rank, `align` extra micro-batches at a time
        extras = 0 if count is not None else config.packing.max_extra_rounds
        found = search_counts([target + extra * self.parallel.align for extra in range(extras + 1)],
                              lambda k: self.rank_greedy(k, target), self.better, patience=1, best=(best, best_max),
                              enough=lambda b, k: b[1] <= self.floor(k) * (1 + config.packing.extra_microbatch_gain))
        return found[0]


def _plan_static(n: int, costs: np.ndarray, parallel: ParallelConfig, batch: BatchConfig, step: int) -> StepPlan:
    mbs = batch.micro_batch_size
    align, dp = parallel.align, parallel.dp_size
    count = -(-n // mbs)
    if count % align:
        raise ScheduleError(
            f"step {step} has {n} samples = {count} micro-batches of micro_batch_size={mbs}, not a multiple of "
            f"dp_size*mb_group = {align}; the rule: a step's micro-batch count, ceil(samples per step / "
            f"micro_batch_size), is a multiple of dp_size*mb_group (set --global-batch-size and --micro-batch-size "
            f"to meet it) or use --use-dynamic-batch-size"
        )
    if not batch.balance_data or dp == 1:  # upstream's chunks, strided over the ranks
        return StepPlan(np.arange(n) // mbs, np.arange(count) % dp, count, "static", count)
    # balanced: equal sample counts per rank (the rank that strided gives the short chunk keeps it), LPT on FLOPs
    per_rank = count // dp
    sizes = [per_rank * mbs] * dp
    sizes[(count - 1) % dp] -= count * mbs - n
    bin_of = np.empty(n, dtype=np.int64)
    for r, members in enumerate(_lpt_with_sizes(costs, sizes)):
        members = np.asarray(members)
        chunk_sizes = [mbs] * per_rank
        chunk_sizes[-1] -= per_rank * mbs - len(members)
        for k, chunk in enumerate(_lpt_with_sizes(costs[members], chunk_sizes)):
            bin_of[members[chunk]] = r * per_rank + k
    return StepPlan(bin_of, np.arange(count) // per_rank, count, "static-balanced", count)


def _lpt_with_sizes(weights: np.ndarray, sizes: list[int]) -> list[list[int]]:
    """Deal items (decreasing weight) to the lightest group that still has a free slot; group g gets sizes[g]."""
    groups: list[list[int]] = [[] for _ in sizes]
    free = LightestWithRoom((0.0, g, s) for g, s in enumerate(sizes) if s > 0)  # room: free slots
    for i in np.argsort(-weights, kind="stable").tolist():
        load, g = free.pop(1)
        groups[g].append(i)
        if len(groups[g]) < sizes[g]:
            free.push(load + float(weights[i]), g, sizes[g] - len(groups[g]))
    return groups


def _plan_for_pipeline(pricing: PipelinePricing, plan: StepPlan, lengths: np.ndarray, costs: np.ndarray,
                       cap: int | None, parallel: ParallelConfig, profile: CostProfile | None,
                       fixed_count: bool = False) -> StepPlan:
    """Stage 5 (``pp_size > 1``): :func:`~.pipeline_choice.choose_pipeline_step` from the pp-unaware ``plan``."""
    dp = parallel.dp_size
    search = StepSearch(
        pricing=pricing, unaware=plan, bin_costs=bin_costs(lengths, costs, plan.bin_of, plan.count, profile),
        heaviest=np.bincount(plan.bin_of, weights=costs, minlength=plan.count),  # as emitted without a pipeline
        dp=dp, lengths=lengths, costs=costs, profile=profile, cap=cap,
        samples=None if cap is None else ShapeSamples(lengths, costs, cap, profile, parallel.align // dp),
        budget=Budget.for_step(pricing, len(lengths), dp), align=parallel.align, fixed_count=fixed_count)
    return choose_pipeline_step(search)


# ---------------------------------------------------------------------------------------------------- assembly
def _emit_step(plan: StepPlan, step_idx: np.ndarray, step_len: np.ndarray, step_cost: np.ndarray,
               partitions: list[list[int]], micro_batch_indices: list[list[list[int]]]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Append one step to every rank (micro-batches heaviest first, or ``plan.emit``'s order); returns per emitted
    micro-batch its sample count, cost and tokens."""
    bin_of, count, emit, dp = plan.bin_of, plan.count, plan.emit, len(partitions)
    per_rank = count // dp
    size = np.bincount(bin_of, minlength=count)
    cost = np.bincount(bin_of, weights=step_cost, minlength=count)
    tokens = np.bincount(bin_of, weights=step_len, minlength=count).astype(np.int64)
    if emit is None:
        emit = np.lexsort((np.arange(count), -cost, plan.rank_of_bin))  # rank-major; per rank heaviest first
    slot = np.empty(count, dtype=np.int64)
    slot[emit] = np.arange(count)
    samples = step_idx[np.argsort(slot[bin_of], kind="stable")]  # stable: ascending index inside a micro-batch
    emitted_size = size[emit]
    bounds = np.zeros(dp + 1, dtype=np.int64)
    bounds[1:] = np.cumsum(emitted_size.reshape(dp, per_rank).sum(axis=1))
    for r, sizes in enumerate(emitted_size.reshape(dp, per_rank).tolist()):
        part, mbis = partitions[r], micro_batch_indices[r]
        base = len(part)
        part.extend(samples[bounds[r]:bounds[r + 1]].tolist())
        for k in sizes:
            mbis.append(list(range(base, base + k)))
            base += k
    return emitted_size, cost[emit], tokens[emit]


def _step_stats(s: int, plan: StepPlan, rollouts: int, step_len: np.ndarray, step_cost: np.ndarray,
                cap: int | None, dp: int, emitted: tuple[np.ndarray, np.ndarray, np.ndarray]) -> StepStats:
    """What step ``s``'s plan achieved, measured on its emitted micro-batches."""
    mb_sizes, mb_cost, mb_tokens = emitted
    rank_cost = mb_cost.reshape(dp, plan.count // dp).sum(axis=1)
    mean = float(rank_cost.mean())
    return StepStats(
        step=s, num_samples=len(step_len), num_rollouts=rollouts, total_tokens=int(step_len.sum()),
        num_microbatches=plan.count // dp, total_microbatches=plan.count, packing_target=plan.target, cap=cap,
        largest_bin_tokens=int(mb_tokens.max()),
        cap_violations=0 if cap is None else int(np.count_nonzero((mb_tokens > cap) & (mb_sizes > 1))),
        rank_cost_max=float(rank_cost.max()), rank_cost_mean=mean,
        balance_lower_bound=max(1.0, float(step_cost.max()) / mean) if mean > 0 else 1.0,
        microbatch_cost_max=float(mb_cost.max()), microbatch_cost_mean=float(mb_cost.mean()),
        strategy=plan.strategy, predicted_makespan=None if plan.makespans is None else plan.slowest,
        bubble_fraction=plan.bubble)


# ---------------------------------------------------------------------------------------------------- the planner
def request_steps(request, ordinals: np.ndarray) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    """Stage 1: ``(sample indices of each step, rollouts per step, dropped sample indices)``."""
    if request.step_of is None:
        return split_into_steps(ordinals, request.lengths, request.parallel, request.batch)
    steps, dropped = group_steps(request.step_of, ordinals, int(request.step_of.max()) + 1)
    return steps, [len(np.unique(ordinals[x])) for x in steps], dropped


def check_fixed_count(step: int, lengths: np.ndarray, per_rank: int, parallel: ParallelConfig,
                      batch: BatchConfig) -> None:
    """Refuse a step that cannot run ``per_rank`` micro-batches on every rank."""
    dp, n = parallel.dp_size, len(lengths)
    count = per_rank * dp
    field = f"microbatches_per_rank = {per_rank}"
    if n < count:
        raise ScheduleError(
            f"{field}: step {step} has {n} samples but {per_rank} x dp_size {dp} = {count} micro-batches each need "
            f"one; lower microbatches_per_rank to at most {n // dp} or put more samples in the step")
    cap = batch.cap(parallel.cp_size)
    if cap is None:
        got = -(-n // batch.micro_batch_size)
        if got != count:
            raise ScheduleError(
                f"{field}: step {step} has {n} samples = {got} micro-batches of micro_batch_size="
                f"{batch.micro_batch_size}, not {count} ({per_rank} per rank x dp_size {dp}); pass "
                f"microbatches_per_rank = {got / dp:g} where that is whole, a micro_batch_size that gives {count}, "
                f"or use dynamic batches (use_dynamic_batch_size with max_tokens_per_gpu)")
        return
    need = bin_lower_bound(lengths, cap)
    if need > count:
        least = -(-align_up(need, parallel.align) // dp)
        raise ScheduleError(
            f"{field}: step {step}'s {int(lengths.sum())} tokens need at least {need} micro-batches of at most "
            f"{cap} tokens (max_tokens_per_gpu x cp_size), more than {per_rank} x dp_size {dp} = {count}; raise "
            f"microbatches_per_rank to at least {least} or raise max_tokens_per_gpu")


def _plan_step(request, s: int, step_len: np.ndarray, step_cost: np.ndarray, pricing: PipelinePricing | None,
               profile: CostProfile | None) -> StepPlan:
    """Stages 2-5 of step ``s``."""
    parallel, batch, fixed = request.parallel, request.batch, request.microbatches_per_rank
    dp, cap = parallel.dp_size, batch.cap(parallel.cp_size)
    if fixed is not None:
        check_fixed_count(s, step_len, fixed, parallel, batch)
    if cap is None:
        plan = _plan_static(len(step_len), step_cost, parallel, batch, s)
    else:
        plan = _DynamicStep(step_len, step_cost, cap, parallel, batch, s, profile, request.config).plan(
            None if fixed is None else fixed * dp)
        if plan is None:
            raise ScheduleError(
                f"microbatches_per_rank = {fixed}: the packing found no {fixed * dp} micro-batches of at most "
                f"{cap} tokens for step {s} ({len(step_len)} samples, {int(step_len.sum())} tokens); raise "
                f"microbatches_per_rank or max_tokens_per_gpu")
    if pricing is not None:
        plan = _plan_for_pipeline(pricing, plan, step_len, step_cost, cap, parallel, profile,
                                  fixed_count=fixed is not None)
    return plan


def _check_fills_ranks(s: int, n: int, dp: int) -> None:
    if n < dp:
        raise ScheduleError(f"step {s} has {n} samples but dp_size = {dp}: every rank needs at least one "
                            f"micro-batch; raise --global-batch-size or collect more samples per rollout")


def plan_steps(request) -> DPSchedule:
    """Plan one validated :class:`~.request.PlanRequest` (public entry: :func:`~.request.plan`)."""
    lengths, ids, loss, parallel = request.lengths, request.rollout_ids, request.loss_tokens, request.parallel
    ordinals = rollout_ordinals(ids, len(lengths))
    costs = sample_costs(lengths, request.cost_model)  # a CostProfile gives seconds (its per-sample part)
    profile = request.cost_model if isinstance(request.cost_model, CostProfile) else None
    cap, dp = request.batch.cap(parallel.cp_size), parallel.dp_size
    # None without pipeline parallelism; with it, the pass's schedule (training, or forward-only) is priced
    pricing = pipeline_pricing(parallel, request.cost_model, cap, request.config, forward_only=request.forward_only)
    steps, rollouts_per_step, dropped = request_steps(request, ordinals)
    _check_fills_ranks(0, len(steps[0]), dp)  # before any per-rank allocation: dp_size can be huge
    partitions: list[list[int]] = [[] for _ in range(dp)]
    micro_batch_indices: list[list[list[int]]] = [[] for _ in range(dp)]
    stats: list[StepStats] = []
    for s, step_idx in enumerate(steps):
        _check_fills_ranks(s, len(step_idx), dp)
        step_len, step_cost = lengths[step_idx], costs[step_idx]
        plan = _plan_step(request, s, step_len, step_cost, pricing, profile)
        emitted = _emit_step(plan, step_idx, step_len, step_cost, partitions, micro_batch_indices)
        stats.append(_step_stats(s, plan, rollouts_per_step[s], step_len, step_cost, cap, dp, emitted))
    return DPSchedule(
        partitions=partitions, micro_batch_indices=micro_batch_indices,
        num_microbatches=[st.num_microbatches for st in stats], samples_per_step=[len(x) for x in steps],
        rollouts_per_step=rollouts_per_step, dropped=dropped.tolist(), stats=stats, parallel=parallel,
        batch=request.batch, total_lengths=lengths.tolist(), rollout_ids=None if ids is None else ids.tolist(),
        loss_tokens=None if loss is None else loss.tolist(),
        loss_tokens_per_step=None if loss is None else [int(loss[x].sum()) for x in steps],
        cost_model=request.cost_model, step_samples=[x.tolist() for x in steps],
        step_of=None if request.step_of is None else request.step_of.tolist(), forward_only=request.forward_only,
        microbatches_per_rank=request.microbatches_per_rank, objective=request.config.objective)
