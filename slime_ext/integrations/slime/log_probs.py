"""slime's log-prob passes (the actor's and the reference model's) under their own cap:
``--log-probs-max-tokens-per-gpu``.

slime declares the flag and sets it to ``--max-tokens-per-gpu`` when it is not given, but never reads it: its
``compute_log_prob(data_iterator, num_microbatches)`` runs the training plan's micro-batches, forward only. With
slime-ext planning (``--dp-schedule rollout``) and dynamic batches:

* **the cap unset, or equal to** ``--max-tokens-per-gpu``: nothing changes. The log-prob passes walk the training
  plan's micro-batches, bit for bit: slime's "true on-policy" modes (log-probs reused by the loss, routing replay)
  need the log-prob pass packed exactly as the training pass.
* **the cap set apart**: each DP rank's samples (its training partition: the log-prob results land where the
  sample trains) are planned anew as one forward-only step under that cap (:func:`plan_forward_only`, the
  planner's request with ``forward_only=True``), with the same micro-batch count on every DP rank (:func:`rank_plan`:
  the ranks agree on a count, and a rank off it is planned again at that count, the request's
  ``microbatches_per_rank``, the cap held). Where no such plan exists, every rank keeps the training plan, and says
  so.

:func:`wrap_compute_log_prob` is what replaces slime's ``MegatronTrainRayActor.compute_log_prob`` in each train actor
(:func:`slime_ext.patches.slime_host.log_prob_patches`); slime's ``forward_only`` puts each sample's result back in
the rank's sample order by the iterators' ``micro_batch_indices``, which is why only the iterators change.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from slime_ext.schedule import PlanRequest, ScheduleError, plan
from slime_ext.schedule.compat import PlannerInputs, planner_inputs

from .planner import v024_parallel_config

logger = logging.getLogger("slime_ext.integrations.slime")

#: ``agree(value, op) -> op ("max" or "min") of value over the DP ranks`` (an all-reduce over the DP group in a train
#: actor)
Agree = Callable[[int, str], int]


def log_probs_cap(args: Any) -> int | None:
    """The log-prob passes' own token cap, or ``None`` where they reuse the training plan: without dynamic batches,
    and where ``--log-probs-max-tokens-per-gpu`` is unset or equals ``--max-tokens-per-gpu``."""
    cap = getattr(args, "log_probs_max_tokens_per_gpu", None)
    if not getattr(args, "use_dynamic_batch_size", False) or cap is None:
        return None
    if int(cap) < 1:
        raise ScheduleError(f"--log-probs-max-tokens-per-gpu {cap} must be a positive token count (or unset, to run "
                            f"the log-prob passes on the training plan)")
    return None if int(cap) == getattr(args, "max_tokens_per_gpu", None) else int(cap)


@dataclass(frozen=True)
class LogProbPlan:
    """One DP rank's log-prob pass: ``micro_batch_indices`` index the rank's samples (its partition's order, as
    slime's ``DataIterator`` does), one forward-only step of ``num_microbatches[0]`` micro-batches."""

    micro_batch_indices: list[list[int]]
    num_microbatches: list[int]


def _replica(args: Any, cap: int) -> PlannerInputs:
    """What the log-prob pass of one replica is planned with: slime's flags (:func:`planner_inputs`) for one DP rank,
    ``cap`` tokens per micro-batch, every sample one rollout of one step (``--use-dynamic-global-batch-size``,
    nothing trimmed)."""
    inputs = planner_inputs(args, v024_parallel_config(args, 1), global_batch_size=None)
    batch = dataclasses.replace(inputs.batch, max_tokens_per_gpu=cap, use_dynamic_global_batch_size=True,
                                disable_rollout_trim_samples=True, global_batch_size=None)
    return dataclasses.replace(inputs, batch=batch)


def plan_forward_only(args: Any, lengths: Sequence[int], cap: int, count: int | None = None) -> list[list[int]]:
    """One DP rank's samples as one forward-only step under ``cap`` tokens per micro-batch, ordered for one replica's
    pipeline (``pp``/``vpp`` of ``args``); micro-batches as indices into ``lengths``. ``count``: exactly that many
    micro-batches (the request's ``microbatches_per_rank``); ``None``: the planner chooses. Raises
    :class:`ScheduleError` where the samples cannot be packed at ``count`` under ``cap``.

    The one planning call of the log-prob passes: the planner's request over one replica (:func:`_replica`)."""
    inputs = _replica(args, cap)
    schedule = plan(PlanRequest(lengths=list(lengths), parallel=inputs.parallel, batch=inputs.batch,
                                rollout_ids=list(range(len(lengths))), forward_only=True,
                                microbatches_per_rank=count, cost_model=inputs.cost_model))
    order = schedule.partitions[0]
    return [[int(order[i]) for i in mb] for mb in schedule.micro_batch_indices[0]]


def rank_plan(args: Any, lengths: Sequence[int], cap: int, agree: Agree) -> LogProbPlan | None:
    """This DP rank's log-prob plan at the count every rank agrees on, or ``None`` on every rank when one rank cannot
    reach it. The count: the largest any rank's plan chose, but no more than the fewest samples a rank holds (in
    whole rounds of the virtual-pipeline group); a rank whose own plan has another count is planned again at it.
    ``agree`` is asked three times, in the same order on every rank."""
    draft = plan_forward_only(args, lengths, cap)
    align = _replica(args, cap).parallel.align
    most, fewest = agree(len(draft), "max"), agree(len(lengths), "min")
    count = min(most, fewest // align * align)
    mine: list[list[int]] | None = draft if len(draft) == count else None
    if mine is None and count > 0:
        try:
            mine = plan_forward_only(args, lengths, cap, count)
        except ScheduleError as exc:  # this rank cannot reach the count: every rank keeps the training plan
            logger.info(f"slime-ext: log-prob plan at {count} micro-batches refused: {exc}")
    if agree(int(mine is None), "max") or mine is None:
        return None
    return LogProbPlan(micro_batch_indices=mine, num_microbatches=[count])


def agree_over_dp(value: int, op: str) -> int:
    """``op`` ("max" or "min") of ``value`` over this train actor's DP group (megatron-core's, without context
    parallelism: its ranks share one rank's samples); ``value`` itself outside a process group."""
    import torch
    import torch.distributed as dist
    from megatron.core import mpu

    if not dist.is_initialized():
        return int(value)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    tensor = torch.tensor([int(value)], dtype=torch.int64, device=device)
    reduce_op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(tensor, op=reduce_op, group=mpu.get_data_parallel_group(with_context_parallel=False))
    return int(tensor.item())


def wrap_compute_log_prob(enabled: Callable[[Any], bool], original: Callable, agree: Agree | None = None
                          ) -> Callable:
    """slime's ``compute_log_prob(self, data_iterator, num_microbatches, store_prefix="")`` on the log-prob plan
    (:func:`rank_plan`, made once per rollout and kept on the iterators) where the cap is set apart; slime's own
    call, untouched, everywhere else. ``agree``: :func:`agree_over_dp` (looked up at each call)."""

    def compute_log_prob(self, data_iterator, num_microbatches, store_prefix="", **kwargs):
        cap = log_probs_cap(self.args) if enabled(self.args) else None
        if cap is None:
            return original(self, data_iterator, num_microbatches, store_prefix, **kwargs)
        iterators, counts = log_prob_iterators(self.args, data_iterator, num_microbatches, cap,
                                               agree or agree_over_dp)
        return original(self, iterators, counts, store_prefix, **kwargs)

    return functools.wraps(original)(compute_log_prob)


#: where a rank's log-prob plan is kept on its first training iterator (one plan per rollout: the actor's, the
#: reference's and a teacher's pass share it)
PLAN_ATTR = "slime_ext_log_prob_plan"


def log_prob_iterators(args: Any, data_iterator: Sequence[Any], num_microbatches: Sequence[int], cap: int,
                       agree: Agree) -> tuple[list, list[int]]:
    """Copies of the training iterators walking the log-prob plan, and its counts; the training ones (and counts)
    where no plan at that count exists."""
    first = data_iterator[0]
    if not hasattr(first, PLAN_ATTR):
        lengths = [int(n) for n in first.rollout_data["total_lengths"]]
        plan = rank_plan(args, lengths, cap, agree)
        if plan is None:
            logger.warning(f"slime-ext: a DP rank cannot reach the log-prob micro-batch count the ranks agreed on "
                           f"under --log-probs-max-tokens-per-gpu {cap}; the log-prob passes run the training plan")
        setattr(first, PLAN_ATTR, plan)
    plan = getattr(first, PLAN_ATTR)
    if plan is None:
        return list(data_iterator), list(num_microbatches)
    iterators = []
    for it in data_iterator:
        walker = copy.copy(it)
        walker.micro_batch_indices, walker.offset = plan.micro_batch_indices, 0
        iterators.append(walker)
    return iterators, list(plan.num_microbatches)


__all__ = ["LogProbPlan", "agree_over_dp", "log_prob_iterators", "log_probs_cap", "plan_forward_only", "rank_plan",
           "wrap_compute_log_prob"]
