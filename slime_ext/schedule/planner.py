"""Rollout-side global micro-batch scheduling: which DP rank trains which sample in which micro-batch of which step.

Strategy (one call plans one :class:`~.request.PlanRequest`, e.g. a whole rollout):

  1. **Steps.** Explicit steps (``PlanRequest.step_of``) are taken as given, nothing dropped. Else: group samples
     by rollout id (first-occurrence order; all samples of a rollout stay in one step) and cut the rollouts into
     steps of ``global_batch_size`` rollouts (one step with ``use_dynamic_global_batch_size``). Trailing rollouts
     that do not fill a step are dropped and reported in ``DPSchedule.dropped``; with
     ``disable_rollout_trim_samples`` an incomplete step is an error instead. A request's
     ``microbatches_per_rank`` fixes every step's count below (stages 2-5 search shapes, ranks and order at that
     count only).
  2. **Pack first.** Per step, group the samples into micro-batches: fixed ``micro_batch_size`` chunks (static), or
     bins of at most ``cap = max_tokens_per_gpu * cp_size`` tokens (dynamic). The dynamic count is the aligned
     token bound ``ceil(ceil(tokens / cap) / align) * align`` (raised where packing provably needs more), reached
     by LPT -- evenly loaded bins, by tokens, or by estimated FLOPs with ``balance_by_flops`` -- dealt in whole
     rounds (bins of alike mixes), else in sequential LPT's order (which fits tighter), or, when LPT does not fit,
     by best-fit decreasing.
  3. **Align.** The count is a multiple of ``align = dp_size * (mb_group if vpp_size > 1 else 1)``; a packing with
     fewer bins is grown by halving its largest multi-sample bins (halves never exceed their parent).
  4. **Distribute second.** Each rank gets ``count / dp_size`` micro-batches: round-robin over the bins in
     serpentine order of cost, or with ``balance_data`` balanced on estimated FLOPs (LPT with equal counts, then
     swaps). When bins of even size cannot balance the ranks (a sample costing a large share of a rank's work),
     bins are chosen per rank instead: samples dealt in decreasing cost to the lightest rank that has room in one
     of its own capped bins; and when even that is capacity-bound, ``align`` more micro-batches are spent if
     they cut the slowest rank by more than 1%. With a measured :class:`CostProfile` (``slime-ext calibrate``)
     instead of FLOPs, micro-batches are priced whole (overhead, attention over the packed row) and the choices
     of this stage are made by the predicted time of the slowest rank: an extra micro-batch must lower it, balancing
     never predicts slower than the strided deal.
  5. **Pipeline** (``pp_size > 1`` only; with ``pp_size = 1`` stages 1-4 are the whole plan, unchanged). A
     pipelined replica's step time is the makespan of megatron-core's schedule (1F1B, or interleaved under VPP with
     the configured ``microbatch_group_size_per_vp_stage`` and p2p mode), so the objective becomes the slowest
     replica's makespan as :mod:`slime_ext.schedule.pipeline_model` predicts it: megatron-core's order of operations per
     stage, blocking p2p calls of ``p2p_s`` per stage boundary, one stage's forward = its share of the
     micro-batch's cost (``1 / pp`` where the stages are even; the embedding, the output layer and Megatron's
     layout flags make them uneven), backward = ``backward_forward_ratio`` x forward, nothing outside the pipeline
     (optimizer, DP reduction). Prices (:mod:`.pipeline_pricing`): a profile's
     seconds (its ratio and ``p2p_s``), else FLOPs (tokens without dims) with ratio 2, p2p 0 and every micro-batch
     charged 2% of a full one. The search over micro-batches, counts, replicas and orders is stated once, in
     :mod:`slime_ext.schedule.pipeline_choice`'s docstring; the pp-unaware plan of stages 1-4 is always a candidate,
     so a step is never predicted slower than it. Each step records its
     ``predicted_makespan`` and ``bubble_fraction``. A forward-only request (``PlanRequest.forward_only``) is
     priced with megatron-core's forward-only schedule instead of training's.

Invariants (checked for every schedule the tests build, by :func:`slime_ext.schedule.invariants.check_schedule`):

  - every rank has the same number of micro-batches, ``sum(num_microbatches)``, and per step
    ``num_microbatches[s] * dp_size`` is a positive multiple of ``align``;
  - ``micro_batch_indices[r]`` tiles ``range(len(partitions[r]))`` in order, with no empty micro-batch;
  - the partitions are disjoint and their union plus ``dropped`` is every sample, each exactly once;
  - dynamic: every micro-batch holds ``<= cap`` tokens unless it is a single oversize sample -- in every mode;
    static: every micro-batch holds ``micro_batch_size`` samples (the last of a step may hold fewer);
  - derived steps: all samples of a rollout are in one step; steps hold whole rollouts in order, ``dropped`` only
    trailing ones; explicit steps: every sample in the step it was given, nothing dropped;
  - a fixed ``microbatches_per_rank``: every step has exactly that many micro-batches per rank;
  - the same input gives the same schedule.
"""

from __future__ import annotations

import heapq

import numpy as np

from .bounds import align_up, bin_lower_bound, microbatch_target
from .config import BatchConfig, ParallelConfig
from .cost import bin_costs, sample_costs
from .distribute import build_rank_bins, lpt_equal_count, rank_bins_to_labels, refine_by_swaps, serpentine
from .dp_schedule import DPSchedule, StepStats
from .errors import ScheduleError
from .profile import CostProfile
from .packing import best_fit_decreasing, bins_to_labels, grow_to_count, lpt_pack
from .pipeline_choice import StepSearch, choose_pipeline_step
from .pipeline_pricing import Budget, PipelinePricing, pipeline_pricing
from .pipeline_shape import ShapeSamples
from .planner_config import DEFAULT_CONFIG, PlannerConfig
from .step_plan import StepPlan, search_counts
from .steps import rollout_ordinals, split_into_steps

__all__ = ["check_fixed_count", "plan_steps", "request_steps"]


# ---------------------------------------------------------------------------------------------------- stages 2-4
def pack_step(
    lengths: np.ndarray, weights: np.ndarray, order: np.ndarray, cap: int, target: int, align: int, step: int
) -> tuple[np.ndarray, int, str]:
    """Stages 2 and 3: ``(bin_of, count, strategy)``, a capped packing into a multiple of ``align`` bins.

    One path: LPT into exactly ``target`` bins, evenly loaded by ``weights``, in whole rounds; where those stall, in
    sequential LPT's order (same deal, uneven room: it fits steps whole rounds cannot). One exception: when LPT
    cannot fit at all (little slack: LPT spreads the free room), best fit decreasing packs tighter and is split up
    to the aligned count.
    """
    bin_of = lpt_pack(lengths, weights, order, target, cap)
    if bin_of is None:
        bin_of = lpt_pack(lengths, weights, order, target, cap, graham=True)
    if bin_of is not None:
        return bin_of, target, "lpt"
    bins = best_fit_decreasing(lengths, cap, order)
    count = max(target, align_up(len(bins), align))
    if count > len(lengths):
        raise ScheduleError(
            f"step {step}: the samples need {len(bins)} micro-batches under the cap {cap} (best fit decreasing); "
            f"the next multiple of dp_size*mb_group = {align} is {count}, but there are only {len(lengths)} "
            f"samples to fill them; raise --max-tokens-per-gpu, put more rollouts in a step (--global-batch-size) "
            f"or lower the DP/VPP alignment"
        )
    if len(bins) < count:
        loads = np.bincount(bins_to_labels(bins, len(lengths)), weights=lengths, minlength=len(bins))
        grow_to_count(bins, count, lengths, loads.astype(np.int64).tolist())
    return bins_to_labels(bins, len(lengths)), count, "bfd"


def _plan_dynamic(
    lengths: np.ndarray, costs: np.ndarray, cap: int, parallel: ParallelConfig, batch: BatchConfig, step: int,
    profile: CostProfile | None = None, config: PlannerConfig = DEFAULT_CONFIG, count: int | None = None,
) -> StepPlan | None:
    """One dynamic step: capped bins, aligned, on ranks.

    With a measured ``profile`` the candidates below are compared by predicted seconds of the slowest rank
    (:meth:`CostProfile.labelled_rank_times`: each micro-batch's overhead and packed attention included), so an
    extra micro-batch is spent only when it lowers the predicted step time. ``count``: plan exactly that many
    micro-batches (the pipeline search's re-packed counts, or a request's fixed count, with every guard of this
    path; a count below the aligned target is packed at that count as well), ``None`` where the packing cannot
    reach it.
    """
    n = len(lengths)
    align, dp = parallel.align, parallel.dp_size

    def slowest(b_of: np.ndarray, r_of_b: np.ndarray) -> float:
        if profile is not None:
            return float(profile.labelled_rank_times(lengths, b_of, r_of_b, dp).max())
        return float(np.bincount(r_of_b, weights=np.bincount(b_of, weights=costs, minlength=len(r_of_b)),
                                 minlength=dp).max())

    def floor_at(k_count: int) -> float:  # no assignment of k_count micro-batches beats this (cost or seconds)
        floor = max(float(costs.sum()) / dp, float(costs.max()))
        if profile is not None:
            floor += profile.step_overhead_s + profile.microbatch_overhead_s * (k_count // dp)
        return floor

    target = microbatch_target(lengths, cap, align)
    fixed = count is not None
    if fixed:
        if count > n or count < bin_lower_bound(lengths, cap):
            return None
        target = count
    if n < target:
        raise ScheduleError(
            f"step {step} has {n} samples but needs at least {target} micro-batches (a multiple of "
            f"dp_size*mb_group = {align} covering its {int(lengths.sum())} tokens under the cap {cap}): too few "
            f"samples to give every micro-batch one; raise --max-tokens-per-gpu, lower the DP/VPP alignment or put "
            f"more rollouts per step (--global-batch-size)"
        )
    order = np.argsort(-lengths, kind="stable")  # decreasing length == decreasing cost (cost is increasing in L)
    weights = costs if batch.balance_by_flops else lengths
    try:
        bin_of, got, strategy = pack_step(lengths, weights, order, cap, target, align, step)
    except ScheduleError:
        if not fixed:
            raise
        return None
    if fixed and got != count:
        return None
    count = got
    if batch.balance_by_flops:
        strategy = "cost-" + strategy
    # a profile prices each micro-batch as a whole (its overhead, attention over the packed row), not as a sum
    prices = bin_costs(lengths, costs, bin_of, count, profile)
    if not (batch.balance_data and dp > 1):
        return StepPlan(bin_of, serpentine(prices, dp), count, strategy, target)

    # balance_data: no assignment beats the mean rank cost, nor the rank holding the costliest sample
    good = floor_at(count) * (1 + config.packing.balance_tolerance)
    rank_of_bin = refine_by_swaps(prices, lpt_equal_count(prices, dp), dp, config.packing.refine_tolerance,
                                  config.packing.refine_rounds, config.packing.dense_swap_limit)
    best_max = slowest(bin_of, rank_of_bin)
    if profile is not None:  # balancing never predicts slower than the strided deal of the same micro-batches
        strided = serpentine(prices, dp)
        strided_max = slowest(bin_of, strided)
        if strided_max < best_max:
            rank_of_bin, best_max = strided, strided_max
    best = StepPlan(bin_of, rank_of_bin, count, strategy, target)
    if best_max <= good:
        return best

    # bins of even size cannot balance this step: choose bins per rank, spending `align` extra micro-batches at a
    # time when the ranks around a costly sample are capacity-bound and that cuts the slowest rank by > 1%
    def per_rank(k_count: int) -> tuple[StepPlan, float] | None:
        if k_count > n:
            return None
        rank_bins = build_rank_bins(lengths, costs, order, cap, dp, k_count // dp, by_cost=batch.balance_by_flops)
        if rank_bins is None:
            return None
        b_of, r_of_b = rank_bins_to_labels(rank_bins, n)
        name = "rank-greedy" if k_count == target else f"rank-greedy+{k_count - target}"
        return StepPlan(b_of, r_of_b, k_count, name, target), slowest(b_of, r_of_b)

    def better(cand: tuple[StepPlan, float], incumbent: tuple[StepPlan, float]) -> bool:
        # FLOPs price no micro-batch, so an extra one must win by a margin; a profile prices it exactly
        more = cand[0].count > incumbent[0].count and profile is None
        min_gain = config.packing.extra_microbatch_gain if more else 0.0
        return cand[1] < incumbent[1] * (1 - min_gain)

    extras = 0 if fixed else config.packing.max_extra_rounds
    found = search_counts([target + extra * align for extra in range(extras + 1)], per_rank, better, patience=1,
                          best=(best, best_max),  # no assignment could cut the slowest rank by the margin any more:
                          enough=lambda b, k: b[1] <= floor_at(k) * (1 + config.packing.extra_microbatch_gain))
    return found[0]


def _plan_static(
    n: int, costs: np.ndarray, parallel: ParallelConfig, batch: BatchConfig, step: int
) -> StepPlan:
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
    heap = [(0.0, g) for g, s in enumerate(sizes) if s > 0]
    for i, w in zip(np.argsort(-weights, kind="stable").tolist(), np.sort(weights)[::-1].tolist()):
        load, g = heap[0]
        groups[g].append(i)
        if len(groups[g]) < sizes[g]:
            heapq.heapreplace(heap, (load + w, g))
        else:
            heapq.heappop(heap)
    return groups


def _plan_for_pipeline(
    pricing: PipelinePricing, plan: StepPlan, lengths: np.ndarray, costs: np.ndarray, cap: int | None,
    parallel: ParallelConfig, batch: BatchConfig, step: int, profile: CostProfile | None, fixed_count: bool = False,
) -> StepPlan:
    """Stage 5 (``pp_size > 1``): the step's micro-batches, count, assignment and order chosen by the pipeline search
    (:func:`~slime_ext.schedule.pipeline_choice.choose_pipeline_step`), starting from the pp-unaware ``plan``.
    Static batches keep their micro-batches and ranks (only the order changes). ``fixed_count``: the search keeps
    ``plan.count`` (shapes, assignment and order only)."""
    dp = parallel.dp_size
    search = StepSearch(
        pricing=pricing, unaware=plan, bin_costs=bin_costs(lengths, costs, plan.bin_of, plan.count, profile),
        heaviest=np.bincount(plan.bin_of, weights=costs, minlength=plan.count),  # as emitted without a pipeline
        dp=dp, lengths=lengths, costs=costs, profile=profile, cap=cap,
        samples=None if cap is None else ShapeSamples(lengths, costs, cap, profile, parallel.align // dp),
        budget=Budget.for_step(pricing, len(lengths), dp), align=parallel.align, fixed_count=fixed_count)
    return choose_pipeline_step(search)


# ---------------------------------------------------------------------------------------------------- assembly
def _emit_step(
    bin_of: np.ndarray,
    rank_of_bin: np.ndarray,
    count: int,
    step_idx: np.ndarray,
    step_len: np.ndarray,
    step_cost: np.ndarray,
    partitions: list[list[int]],
    micro_batch_indices: list[list[list[int]]],
    emit: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Append one step to every rank: micro-batches heaviest first (or in the rank-major bin order ``emit``, which
    the pipeline objective chooses), samples in a micro-batch by global index.

    Returns, per micro-batch in rank-major emitted order: sample count, cost, tokens.
    """
    dp = len(partitions)
    per_rank = count // dp
    size = np.bincount(bin_of, minlength=count)
    cost = np.bincount(bin_of, weights=step_cost, minlength=count)
    tokens = np.bincount(bin_of, weights=step_len, minlength=count).astype(np.int64)
    if emit is None:
        emit = np.lexsort((np.arange(count), -cost, rank_of_bin))  # rank-major; per rank heaviest first
    slot = np.empty(count, dtype=np.int64)
    slot[emit] = np.arange(count)
    samples = step_idx[np.argsort(slot[bin_of], kind="stable")]  # stable: ascending index inside a micro-batch
    emitted_size = size[emit]
    bounds = np.zeros(dp + 1, dtype=np.int64)
    bounds[1:] = np.cumsum(emitted_size.reshape(dp, per_rank).sum(axis=1))
    sizes_by_rank = emitted_size.reshape(dp, per_rank).tolist()
    for r in range(dp):
        part, mbis = partitions[r], micro_batch_indices[r]
        base = len(part)
        part.extend(samples[bounds[r]:bounds[r + 1]].tolist())
        for k in sizes_by_rank[r]:
            mbis.append(list(range(base, base + k)))
            base += k
    return emitted_size, cost[emit], tokens[emit]


# ---------------------------------------------------------------------------------------------------- the planner
def request_steps(request, ordinals: np.ndarray) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    """Stage 1 for a :class:`~.request.PlanRequest`: ``(sample indices of each step, rollouts per step, dropped
    sample indices)``.

    Explicit steps (``request.step_of``): step ``s`` holds exactly the samples whose step is ``s``, grouped by rollout
    in first-occurrence order (as :func:`~.steps.split_into_steps` orders a step), nothing dropped; its rollout
    count is the number of distinct rollout ids in it. Else the steps of whole rollouts and ``global_batch_size``.
    """
    if request.step_of is None:
        return split_into_steps(ordinals, request.lengths, request.parallel, request.batch)
    step_of = request.step_of
    order = np.lexsort((np.arange(len(step_of)), ordinals, step_of))  # by step, then rollout, then index
    bounds = np.searchsorted(step_of[order], np.arange(int(step_of.max()) + 2))
    steps = [order[bounds[s]:bounds[s + 1]] for s in range(len(bounds) - 1)]
    return steps, [len(np.unique(ordinals[x])) for x in steps], np.zeros(0, dtype=np.int64)


def check_fixed_count(step: int, lengths: np.ndarray, per_rank: int, parallel: ParallelConfig,
                      batch: BatchConfig) -> None:
    """Refuse a step that cannot run ``per_rank`` micro-batches on every rank (``PlanRequest.microbatches_per_rank``):
    too few samples to give each micro-batch one, more tokens than that many capped micro-batches can hold, or a
    static batch whose ``micro_batch_size`` gives another count. The message names the field, the value and the
    fix."""
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


def plan_steps(request) -> DPSchedule:
    """Plan one validated :class:`~.request.PlanRequest` (``request``; :mod:`.request` sits above this module):
    walk the stages of the module docstring for every step
    (the public entry is :func:`slime_ext.schedule.request.plan`)."""
    lengths, ids, loss = request.lengths, request.rollout_ids, request.loss_tokens
    parallel, batch, cost_model, config = request.parallel, request.batch, request.cost_model, request.config
    fixed = request.microbatches_per_rank
    n = len(lengths)
    ordinals = rollout_ordinals(ids, n)
    costs = sample_costs(lengths, cost_model)  # a CostProfile gives seconds (its per-sample part)
    profile = cost_model if isinstance(cost_model, CostProfile) else None
    cap = batch.cap(parallel.cp_size)
    dp = parallel.dp_size
    # None without pipeline parallelism; with it, the pass's schedule (training, or forward-only) is priced
    pricing = pipeline_pricing(parallel, cost_model, cap, config, forward_only=request.forward_only)

    # 1. steps: given, or of whole rollouts (the trimmed tail is reported, never silent)
    steps, rollouts_per_step, dropped = request_steps(request, ordinals)
    if len(steps[0]) < dp:  # before any per-rank allocation: dp_size can be huge (the step loop repeats this)
        raise ScheduleError(
            f"step 0 has {len(steps[0])} samples but dp_size = {dp}: every rank needs at least one micro-batch; "
            f"raise --global-batch-size or collect more samples per rollout"
        )

    partitions: list[list[int]] = [[] for _ in range(dp)]
    micro_batch_indices: list[list[list[int]]] = [[] for _ in range(dp)]
    num_microbatches: list[int] = []
    stats: list[StepStats] = []
    for s, step_idx in enumerate(steps):
        n_s = len(step_idx)
        if n_s < dp:
            raise ScheduleError(
                f"step {s} has {n_s} samples but dp_size = {dp}: every rank needs at least one micro-batch; "
                f"raise --global-batch-size or collect more samples per rollout"
            )
        step_len, step_cost = lengths[step_idx], costs[step_idx]
        if fixed is not None:
            check_fixed_count(s, step_len, fixed, parallel, batch)
        # 2.-4. pack, align, distribute: bin_of[i] = micro-batch of the step's i-th sample, rank_of_bin[b] = rank
        if cap is None:
            plan = _plan_static(n_s, step_cost, parallel, batch, s)
        else:
            plan = _plan_dynamic(step_len, step_cost, cap, parallel, batch, s, profile=profile, config=config,
                                 count=None if fixed is None else fixed * dp)
            if plan is None:
                raise ScheduleError(
                    f"microbatches_per_rank = {fixed}: the packing found no {fixed * dp} micro-batches of at most "
                    f"{cap} tokens for step {s} ({n_s} samples, {int(step_len.sum())} tokens); raise "
                    f"microbatches_per_rank or max_tokens_per_gpu")
        # 5. with pipeline parallelism: micro-batches, count, assignment and order by the slowest replica's
        # predicted makespan (the pipeline search; a fixed count stays fixed)
        if pricing is not None:
            plan = _plan_for_pipeline(pricing, plan, step_len, step_cost, cap, parallel, batch, s, profile,
                                      fixed_count=fixed is not None)
        count = plan.count
        mb_sizes, mb_cost, mb_tokens = _emit_step(plan.bin_of, plan.rank_of_bin, count, step_idx, step_len,
                                                  step_cost, partitions, micro_batch_indices, plan.emit)
        per_rank = count // dp
        num_microbatches.append(per_rank)
        rank_cost = mb_cost.reshape(dp, per_rank).sum(axis=1)
        mean = float(rank_cost.mean())
        violations = 0 if cap is None else int(np.count_nonzero((mb_tokens > cap) & (mb_sizes > 1)))
        stats.append(StepStats(
            step=s,
            num_samples=n_s,
            num_rollouts=rollouts_per_step[s],
            total_tokens=int(step_len.sum()),
            num_microbatches=per_rank,
            total_microbatches=count,
            packing_target=plan.target,
            cap=cap,
            largest_bin_tokens=int(mb_tokens.max()),
            cap_violations=violations,
            rank_cost_max=float(rank_cost.max()),
            rank_cost_mean=mean,
            balance_lower_bound=max(1.0, float(step_cost.max()) / mean) if mean > 0 else 1.0,
            microbatch_cost_max=float(mb_cost.max()),
            microbatch_cost_mean=float(mb_cost.mean()),
            strategy=plan.strategy,
            predicted_makespan=None if plan.makespans is None else plan.slowest,
            bubble_fraction=plan.bubble,
        ))

    return DPSchedule(
        partitions=partitions,
        micro_batch_indices=micro_batch_indices,
        num_microbatches=num_microbatches,
        samples_per_step=[len(x) for x in steps],
        rollouts_per_step=rollouts_per_step,
        dropped=dropped.tolist(),
        stats=stats,
        parallel=parallel,
        batch=batch,
        total_lengths=lengths.tolist(),
        rollout_ids=None if ids is None else ids.tolist(),
        loss_tokens=None if loss is None else loss.tolist(),
        loss_tokens_per_step=None if loss is None else [int(loss[x].sum()) for x in steps],
        cost_model=cost_model,
        step_samples=[x.tolist() for x in steps],
        step_of=None if request.step_of is None else request.step_of.tolist(),
        forward_only=request.forward_only,
        microbatches_per_rank=fixed,
    )
