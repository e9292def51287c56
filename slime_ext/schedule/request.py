"""The planner's one public request, checked on construction, and :func:`plan`, its entry point."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .config import BatchConfig, ParallelConfig
from .cost import CostModel, check_cost_model
from .dp_schedule import DPSchedule
from .errors import ScheduleError
from .planner import check_fixed_count, plan_steps
from .planner_config import DEFAULT_CONFIG, PlannerConfig
from .profile import CostProfile
from .validate import MAX_SAMPLES, check_bool, check_instance, check_int, check_int_array, check_samples

__all__ = ["PlanRequest", "plan", "plan_schedule"]


@dataclass(frozen=True, eq=False)
class PlanRequest:
    """One planning request, checked on construction; sequences are stored as int64 arrays."""

    #: total tokens of every sample, each in ``[1, MAX_TOKENS]`` (refusals call it slime's ``total_lengths``)
    lengths: Sequence[int] | np.ndarray
    #: the layout: dp (resolved), cp, pp, vpp and its group, Megatron's layout flags, the p2p mode
    parallel: ParallelConfig
    #: the cap or ``micro_batch_size``, the balancing flags, ``global_batch_size`` (unused with ``step_of``)
    batch: BatchConfig
    #: the rollout of every sample (samples of one rollout stay in one derived step); ``None``: one per sample
    rollout_ids: Sequence[int] | np.ndarray | None = None
    #: loss-mask tokens of every sample (``0 <= loss_tokens[i] <= lengths[i]``): ``loss_tokens_per_step``
    loss_tokens: Sequence[int] | np.ndarray | None = None
    #: explicit steps: the optimizer step of every sample, ``0..S-1``, each step at least ``dp_size`` samples;
    #: ``None``: steps of whole rollouts and ``global_batch_size`` as slime derives them
    step_of: Sequence[int] | np.ndarray | None = None
    #: the pass: ``False`` training (forward and backward), ``True`` forward-only (a log-prob pass)
    forward_only: bool = False
    #: micro-batches per DP rank in every step (a multiple of the VPP group); ``None``: the planner chooses
    microbatches_per_rank: int | None = None
    #: FLOPs from model dims (``CostModel``), measured seconds (``CostProfile``), or ``None``: tokens
    cost_model: CostModel | CostProfile | None = None
    #: the planner's tunables; ``None``: ``PlannerConfig()``
    config: PlannerConfig | None = None

    def __post_init__(self) -> None:
        check_instance("parallel", self.parallel, ParallelConfig, "a ParallelConfig",
                       "use ParallelConfig.from_dict(train_parallel_config)").require_dp_size()
        check_instance("batch", self.batch, BatchConfig, "a BatchConfig", "use BatchConfig.from_args(args)")
        check_instance("config", self.config, (PlannerConfig, type(None)), "a PlannerConfig or None",
                       "use PlannerConfig() or PlannerConfig().replace_from(['SECTION.FIELD=VALUE'])")
        object.__setattr__(self, "config", self.config or DEFAULT_CONFIG)
        check_cost_model(self.cost_model)
        lengths, ids, loss = check_samples(self.lengths, self.rollout_ids, self.loss_tokens)  # types, ranges, once
        for name, value in (("lengths", lengths), ("rollout_ids", ids), ("loss_tokens", loss)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "forward_only", check_bool(
            "forward_only", self.forward_only, "pass True for a forward-only (log-prob) pass, False for training"))
        self._check_count()
        if self.step_of is not None:
            object.__setattr__(self, "step_of", self._checked_steps())

    def _check_count(self) -> None:
        k = self.microbatches_per_rank
        if k is None:
            return
        k = check_int("microbatches_per_rank", k, maximum=MAX_SAMPLES,
                      fix="pass the micro-batches every DP rank runs per step (>= 1), or None to let the planner "
                          "choose")
        object.__setattr__(self, "microbatches_per_rank", k)
        group = self.parallel.align // self.parallel.dp_size
        if k % group:
            raise ScheduleError(
                f"microbatches_per_rank = {k} is not a multiple of microbatch_group_size_per_vp_stage = {group}: "
                f"megatron-core's interleaved schedule runs whole groups; pass a multiple of {group} (e.g. "
                f"{-(-k // group) * group})")

    def _checked_steps(self) -> np.ndarray:
        n, dp = len(self.lengths), self.parallel.dp_size
        if self.batch.use_dynamic_global_batch_size:
            raise ScheduleError(
                "step_of gives the steps, but batch.use_dynamic_global_batch_size asks the planner to derive one "
                "step; pass one of them (leave use_dynamic_global_batch_size False with explicit steps)")
        step_of = check_int_array("step_of", self.step_of, n=n, minimum=0, maximum=n - 1,
                                  what="step indices (0..S-1, one per sample)")
        sizes = np.bincount(step_of)
        empty = np.flatnonzero(sizes == 0)
        if len(empty):
            raise ScheduleError(
                f"step_of has no sample in step {int(empty[0])} (steps 0..{len(sizes) - 1} are numbered, each must "
                f"hold samples); number the steps 0..S-1 without gaps")
        small = np.flatnonzero(sizes < dp)
        if len(small):
            s = int(small[0])
            raise ScheduleError(
                f"step_of: step {s} has {int(sizes[s])} samples but dp_size = {dp}: every rank needs at least one "
                f"micro-batch; give each step at least {dp} samples (merge step {s} with another) or lower dp_size")
        if self.microbatches_per_rank is not None:
            by_step = np.split(self.lengths[np.argsort(step_of, kind="stable")], np.cumsum(sizes)[:-1])
            for s, step_lengths in enumerate(by_step):
                check_fixed_count(s, step_lengths, self.microbatches_per_rank, self.parallel, self.batch)
        return step_of


def plan(request: PlanRequest) -> DPSchedule:
    """Which DP rank runs which sample in which micro-batch of which step (:mod:`.planner`)."""
    return plan_steps(check_instance("request", request, PlanRequest, "a PlanRequest", "build one: "
                                     "PlanRequest(lengths=..., parallel=ParallelConfig(...), batch=BatchConfig(...))"))


def plan_schedule(total_lengths: Sequence[int] | np.ndarray, parallel: ParallelConfig, batch: BatchConfig, *,
                  rollout_ids: Sequence[int] | np.ndarray | None = None,
                  loss_tokens: Sequence[int] | np.ndarray | None = None,
                  cost_model: CostModel | CostProfile | None = None, config: PlannerConfig | None = None
                  ) -> DPSchedule:
    """:func:`plan` of the :class:`PlanRequest` of these fields (``total_lengths``: its ``lengths``)."""
    return plan(PlanRequest(lengths=total_lengths, parallel=parallel, batch=batch, rollout_ids=rollout_ids,
                            loss_tokens=loss_tokens, cost_model=cost_model, config=config))
