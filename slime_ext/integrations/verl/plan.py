"""slime-ext's plans for verl, at two depths: the engine depth (:func:`plan_engine_step`: one mini-batch's
micro-batches on every DP rank of verl's Megatron engine) and the trainer depth (:func:`plan_dispatch`: which
samples each DP rank trains in each mini-batch, before verl dispatches them).

**The engine depth.**
Inside ``MegatronEngine.forward_backward_batch`` each DP rank already holds its samples (verl dispatched them), so
the plan cannot move samples between ranks; it decides how each rank cuts its own samples into micro-batches and
how many micro-batches every rank runs. Every rank computes the same plan from the lengths of **all** ranks
(all-gathered by :mod:`slime_ext.integrations.verl.engine`), so the count agrees without a MAX all-reduce.

Strategy, per mini-batch:

1. **Each rank's own plan.** slime-ext's planner (``slime_ext.schedule.plan_schedule``) plans the rank's samples
   as one step of a one-replica layout with the job's pipeline (``pp_size``, ``vpp_size`` and the VPP group):
   micro-batches under the cap, FLOP-balanced, and with ``pp_size > 1`` the count and order the pipeline model
   predicts fastest.
2. **One count.** ``count`` is at least what the cap needs on the fullest rank (the largest count of the ranks'
   plans without the pipeline objective, a multiple of the VPP group) and verl's ``min_num_micro_batch`` rounded up
   to the group. Without a pipeline it is the largest of the ranks' own counts. With one, the candidates are that
   largest own count, the cap's need and own counts between (at most :data:`MAX_COUNT_CANDIDATES`), and the one
   whose slowest rank the pipeline model predicts fastest wins (the step waits for the slowest replica). No
   candidate exceeds the fewest samples a rank holds; if the cap alone needs more micro-batches than that, it is an
   error naming the fix.
3. **Every rank reaches that count.** A rank whose own plan has another count is re-planned by the planner into
   exactly ``count`` capped, FLOP-balanced micro-batches (a layout of ``count`` replicas with one micro-batch each);
   with ``pp_size > 1`` they are then put in the order the pipeline model predicts fastest.

Invariants (:func:`check_engine_plan`, run on every plan and by the tests):

* every rank has exactly ``count`` micro-batches, the same number on every rank, a multiple of the VPP group;
* each rank's micro-batches hold each of its local indices ``0 .. n_r - 1`` exactly once, none is empty;
* no micro-batch holding more than one sample exceeds the cap (a sample longer than the cap sits alone).

Pure: standard library, numpy and :mod:`slime_ext.schedule`'s public API (the planner, and the pipeline model's
pricing and order search, to order re-planned ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from slime_ext.schedule import (BatchConfig, CostModel, CostProfile, ParallelConfig, PipelinePricing, ScheduleError,
                                best_orders, pipeline_pricing, plan_schedule, sample_costs)

#: counts tried with a pipeline (the largest own count, what the cap needs, and own counts between)
MAX_COUNT_CANDIDATES = 3

__all__ = ["EngineLayout", "EnginePlan", "check_engine_plan", "plan_dispatch", "plan_engine_step"]


@dataclass(frozen=True)
class EngineLayout:
    """What the engine plan needs of the job's layout: megatron-core's parallel state and verl's
    ``num_batches_divided_by``."""

    pp_size: int = 1
    vpp_size: int = 1
    #: verl's ``num_batches_divided_by`` (megatron's ``microbatch_group_size_per_vp_stage``, which verl passes under
    #: VPP only): every count is a multiple of it
    vpp_group: int | None = None

    @property
    def align(self) -> int:
        """Every count is a multiple of this: the VPP group when verl gives one, else 1."""
        return int(self.vpp_group) if self.vpp_group else 1

    def parallel(self, dp_size: int = 1, *, pipeline: bool = True) -> ParallelConfig:
        """The planner's layout (``pipeline=False``: the alignment alone, without the pipeline objective)."""
        if pipeline and self.pp_size > 1 and (self.vpp_size > 1 or self.align == 1):
            return ParallelConfig(dp_size=dp_size, pp_size=self.pp_size, vpp_size=self.vpp_size,
                                  microbatch_group_size_per_vp_stage=self.align if self.vpp_size > 1 else None)
        if self.align > 1:  # a group without the pipeline objective: a one-stage layout with that alignment
            return ParallelConfig(dp_size=dp_size, pp_size=1, vpp_size=max(2, self.vpp_size),
                                  microbatch_group_size_per_vp_stage=self.align)
        return ParallelConfig(dp_size=dp_size)


@dataclass(frozen=True)
class EnginePlan:
    """One mini-batch's plan over the DP group."""

    #: micro-batches per rank, the same on every rank
    count: int
    #: ``micro_batches[r][j]``: rank ``r``'s local sample indices in its ``j``-th micro-batch, in run order
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    #: the count each rank's own plan chose (step 1), before the ranks agreed on ``count``
    own_counts: tuple[int, ...]
    #: the token cap per micro-batch
    cap: int
    #: per rank: ``"own"`` (its own plan had ``count`` micro-batches) or ``"recount"`` (re-planned to ``count``)
    how: tuple[str, ...]


def _batch(n: int, cap: int) -> BatchConfig:
    # one step holding the rank's whole mini-batch: each sample is its own rollout, global_batch_size = n
    return BatchConfig(global_batch_size=n, use_dynamic_batch_size=True, max_tokens_per_gpu=cap, balance_data=True,
                       balance_by_flops=True, disable_rollout_trim_samples=True)


def _own_plan(lengths: np.ndarray, cap: int, parallel: ParallelConfig,
              cost_model: CostModel | CostProfile | None) -> list[tuple[int, ...]]:
    """The planner's micro-batches of one rank's samples (local indices, run order)."""
    schedule = plan_schedule(lengths, parallel, _batch(len(lengths), cap), cost_model=cost_model)
    part = schedule.partitions[0]
    return [tuple(part[i] for i in mb) for mb in schedule.micro_batch_indices[0]]


def _recount(lengths: np.ndarray, cap: int, count: int,
             cost_model: CostModel | CostProfile | None) -> list[tuple[int, ...]] | None:
    """Exactly ``count`` capped micro-batches of one rank's samples, FLOP-balanced: the planner's layout of ``count``
    replicas, each with one micro-batch (``None`` if the planner needed more than one each)."""
    batch = BatchConfig(global_batch_size=len(lengths), use_dynamic_batch_size=True, max_tokens_per_gpu=cap,
                        balance_data=False, balance_by_flops=True, disable_rollout_trim_samples=True)
    schedule = plan_schedule(lengths, ParallelConfig(dp_size=count), batch, cost_model=cost_model)
    if schedule.num_microbatches[0] != 1:
        return None
    return [tuple(p) for p in schedule.partitions]


def _split_to(micro_batches: list[tuple[int, ...]], count: int, costs: np.ndarray) -> list[tuple[int, ...]]:
    """Split the costliest micro-batches holding several samples in two (heaviest samples dealt alternately) until
    there are ``count``: subsets of capped micro-batches stay under the cap. Used only if :func:`_recount` fails."""
    mbs = [list(mb) for mb in micro_batches]
    while len(mbs) < count:
        splittable = [j for j, mb in enumerate(mbs) if len(mb) > 1]
        if not splittable:
            raise ScheduleError(f"cannot make {count} micro-batches of {sum(map(len, mbs))} samples")
        j = max(splittable, key=lambda i: float(costs[mbs[i]].sum()))
        mb = sorted(mbs[j], key=lambda i: -costs[i])
        halves: tuple[list[int], list[int]] = ([], [])
        for i in mb:  # the next sample goes to the lighter half
            min(halves, key=lambda h: float(costs[h].sum()) if h else 0.0).append(i)
        mbs[j:j + 1] = [sorted(halves[0]), sorted(halves[1])]
    return [tuple(mb) for mb in mbs]


def _mb_costs(lengths: np.ndarray, micro_batches: Sequence[Sequence[int]],
              cost_model: CostModel | CostProfile | None) -> np.ndarray:
    if isinstance(cost_model, CostProfile):
        return np.array([cost_model.microbatch_time(lengths[list(mb)]) for mb in micro_batches])
    costs = sample_costs(lengths, cost_model)
    return np.array([float(costs[list(mb)].sum()) for mb in micro_batches])


def _reach(lengths: list[np.ndarray], own: list[list[tuple[int, ...]]], count: int, cap: int,
           pricing: PipelinePricing | None, cost_model: CostModel | CostProfile | None
           ) -> tuple[tuple[tuple[tuple[int, ...], ...], ...], tuple[str, ...]] | None:
    """Every rank's micro-batches at ``count``: its own plan where that has ``count``, else re-planned to it (and
    ordered by the pipeline model); ``None`` if a rank cannot be brought down to ``count``."""
    plans, how = [], []
    for x, mine in zip(lengths, own):
        if len(mine) == count:
            plans.append(tuple(mine))
            how.append("own")
            continue
        mbs = _recount(x, cap, count, cost_model)
        if mbs is None and len(mine) > count:
            return None
        if mbs is None:
            per_sample = cost_model.sample_costs(x) if isinstance(cost_model, CostProfile) \
                else sample_costs(x, cost_model)
            mbs = _split_to(mine, count, per_sample)
        if pricing is not None:
            order, _ = best_orders(pricing, _mb_costs(x, mbs, cost_model)[None, :])
            mbs = [mbs[j] for j in order[0]]
        plans.append(tuple(mbs))
        how.append("recount")
    return tuple(plans), tuple(how)


def plan_engine_step(lengths_per_rank: Sequence[Sequence[int]], cap: int, layout: EngineLayout = EngineLayout(), *,
                     min_count: int | None = None,
                     cost_model: CostModel | CostProfile | None = None) -> EnginePlan:
    """Plan one mini-batch: ``lengths_per_rank[r]`` are rank ``r``'s sample lengths (tokens), in its local order.

    Deterministic: every rank passing the same all-gathered lengths gets the same plan. Raises
    :class:`ScheduleError` when the cap cannot be held with one count on every rank.
    """
    lengths = [np.asarray(x, dtype=np.int64) for x in lengths_per_rank]
    if not lengths or any(len(x) == 0 for x in lengths):
        raise ScheduleError(f"every DP rank needs at least one sample; got {[len(x) for x in lengths]} samples per "
                            f"rank")
    if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 1:
        raise ScheduleError(f"cap={cap!r} must be a positive token count (verl's max_token_len_per_gpu * "
                            f"context-parallel size)")
    cap, align = int(cap), layout.align
    floor = 0 if min_count is None else -(-int(min_count) // align) * align
    fewest = min(len(x) for x in lengths)

    # 1. each rank's own plan (with the pipeline objective when pp_size > 1)
    parallel = layout.parallel()
    own = []
    for r, x in enumerate(lengths):
        try:
            own.append(_own_plan(x, cap, parallel, cost_model))
        except ScheduleError as exc:
            raise ScheduleError(
                f"DP rank {r} ({len(x)} samples, {int(x.sum())} tokens, cap {cap}, VPP group {align}) cannot be "
                f"planned: {exc}. In verl: raise max_token_len_per_gpu (or *_log_prob_max_token_len_per_gpu), or "
                f"give each rank more samples per mini-batch (ppo_mini_batch_size)") from exc
    own_counts = tuple(len(p) for p in own)
    pricing = pipeline_pricing(layout.parallel(), cost_model, cap)
    # 2. one count for every rank: the counts the ranks' own plans chose, and what the cap alone needs
    need = None
    if pricing is not None or max(max(own_counts), floor) > fewest:
        need = max(max(len(_own_plan(x, cap, layout.parallel(pipeline=False), cost_model)) for x in lengths), floor)
        if need > fewest:
            raise ScheduleError(
                f"the DP ranks need {need} micro-batches each to hold the cap {cap} (a multiple of the VPP group "
                f"{align}), but a rank holds only {fewest} samples; raise max_token_len_per_gpu (or "
                f"*_log_prob_max_token_len_per_gpu), or give each rank more samples per mini-batch "
                f"(ppo_mini_batch_size)")
    top = max(max(own_counts), floor)
    if top > fewest:  # give up the pipeline's extra micro-batches before the cap
        top = max(need, (fewest // align) * align)
    candidates = [top]
    if pricing is not None:  # with a pipeline, the count whose slowest replica the model predicts fastest
        others = sorted({c for c in own_counts if need <= c < top} | {need}, reverse=True)
        candidates += others[:MAX_COUNT_CANDIDATES - 1]
    # 3. every rank reaches that count, in the pipeline's order
    best = None
    for count in candidates:
        reached = _reach(lengths, own, count, cap, pricing, cost_model)
        if reached is None:
            continue
        plans, how = reached
        span = 0.0 if pricing is None else max(
            float(pricing.makespans(_mb_costs(x, mbs, cost_model)[None, :])[0]) for x, mbs in zip(lengths, plans))
        if best is None or span < best[0] * (1 - 1e-9):
            best = (span, count, plans, how)
    if best is None:
        raise ScheduleError(f"no count in {candidates} could be planned on every DP rank under the cap {cap}; raise "
                            f"max_token_len_per_gpu (or *_log_prob_max_token_len_per_gpu)")
    _, count, plans, how = best
    plan = EnginePlan(count=count, micro_batches=plans, own_counts=own_counts, cap=cap, how=tuple(how))
    check_engine_plan(plan, [len(x) for x in lengths], lengths, align)
    return plan


def check_engine_plan(plan: EnginePlan, sizes: Sequence[int], lengths: Sequence[Sequence[int]] | None = None,
                      align: int = 1) -> None:
    """Raise ``AssertionError`` naming the broken invariant (see the module docstring)."""
    assert len(plan.micro_batches) == len(sizes), f"{len(plan.micro_batches)} ranks planned, {len(sizes)} given"
    assert plan.count % align == 0, f"count {plan.count} is not a multiple of the VPP group {align}"
    for r, (mbs, n) in enumerate(zip(plan.micro_batches, sizes)):
        assert len(mbs) == plan.count, f"rank {r} has {len(mbs)} micro-batches, the agreed count is {plan.count}"
        flat = sorted(i for mb in mbs for i in mb)
        assert flat == list(range(n)), f"rank {r}'s micro-batches do not hold each of its {n} samples exactly once"
        assert all(len(mb) > 0 for mb in mbs), f"rank {r} has an empty micro-batch"
        if lengths is not None:
            ln = np.asarray(lengths[r], dtype=np.int64)
            for j, mb in enumerate(mbs):
                tokens = int(ln[list(mb)].sum())
                assert len(mb) == 1 or tokens <= plan.cap, (
                    f"rank {r} micro-batch {j} holds {len(mb)} samples, {tokens} tokens > cap {plan.cap}")


# ---------------------------------------------------------------------------------------------------- trainer depth
def plan_dispatch(lengths: Sequence[int], dp_size: int, mini_batch_size: int, *,
                  cost_model: CostModel | CostProfile | None = None) -> list[int]:
    """The trainer depth: the order of a trainer step's samples that verl's dispatch then cuts into DP ranks.

    verl gives DP rank ``r`` the ``r``-th of ``dp_size`` equal contiguous chunks of the batch, and each rank cuts
    its chunk into contiguous mini-batches of ``mini_batch_size // dp_size`` samples (one optimizer step each). Here
    mini-batch ``m`` holds samples ``m * mini_batch_size ..`` of the step, in the step's own order, and the planner
    decides which of them each rank trains: equal counts per rank (verl asserts equal chunks) with the estimated
    FLOPs balanced per mini-batch -- the planner's static layout with one sample per micro-batch and
    ``balance_data``. Each rank's micro-batches are then the engine depth's. Returns the permutation of
    ``range(len(lengths))`` to hand to verl's ``reorder``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if dp_size < 1 or mini_batch_size < 1 or mini_batch_size % dp_size or n % mini_batch_size:
        raise ScheduleError(
            f"{n} samples, mini_batch_size={mini_batch_size}, dp_size={dp_size}: the step must be whole mini-batches "
            f"and a mini-batch a multiple of dp_size (verl pads the batch to lcm(dp, mini-batch sizes) first)")
    per_rank = mini_batch_size // dp_size
    batch = BatchConfig(global_batch_size=mini_batch_size, micro_batch_size=1, balance_data=True,
                        disable_rollout_trim_samples=True)
    chunks: list[list[int]] = [[] for _ in range(dp_size)]
    for start in range(0, n, mini_batch_size):
        members = np.arange(start, start + mini_batch_size)
        schedule = plan_schedule(lengths[members], ParallelConfig(dp_size=dp_size), batch, cost_model=cost_model)
        for r in range(dp_size):
            part = schedule.partitions[r]
            assert len(part) == per_rank, f"the planner gave rank {r} {len(part)} samples, not {per_rank}"
            chunks[r].extend(int(members[i]) for i in part)
    order = [i for chunk in chunks for i in chunk]
    assert sorted(order) == list(range(n))
    return order
