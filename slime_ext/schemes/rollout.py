"""``dp_schedule: rollout`` (the default) -- the rollout side plans every rank's micro-batches once per rollout.

:func:`slime_ext.schedule.build_dp_schedule` (our planner, with slime's signature) plans the whole rollout from the
sample lengths, rollout ids and loss-token counts; ``schedule.rank_payload(r, samples)`` is rank ``r``'s payload,
with its slice of the schedule. The training side runs that slice unchanged: nothing is planned or all-reduced
there, and the LR scheduler advances by the samples each step really trains on.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from slime_ext.schedule import BatchConfig, ParallelConfig, RankPayload, SampleBatch, build_dp_schedule, plan_schedule

from . import data
from .base import RankSteps, RolloutPlan, Scheme
from .records import RolloutStepRecord


class RolloutSchedule(Scheme):
    """``dp_schedule: rollout`` (module docstring)."""

    name = "rollout"
    batch_unit = "rollouts"
    title = "the planner"
    step_record = RolloutStepRecord

    def plan(self, train_data: SampleBatch, args: Any, train_parallel_config: Mapping[str, int], *,
             rollout_id: int = 0) -> RolloutPlan:
        schedule = build_dp_schedule(
            args, train_parallel_config, train_data.total_lengths,
            global_batch_size=getattr(args, "global_batch_size", None),
            rollout_indices=train_data.rollout_ids, loss_tokens=train_data.loss_tokens,
        )
        payloads = [schedule.rank_payload(r, train_data, rollout_id) for r in range(schedule.dp_size)]
        reason = ""
        if schedule.dropped:
            rollouts = schedule.dropped_rollouts
            per_step = schedule.rollouts_per_step[0] if schedule.rollouts_per_step else None
            reason = (f"{len(schedule.dropped)} samples of {len(rollouts)} trailing rollouts {rollouts} do not fill "
                      f"a step of {per_step} rollouts (global_batch_size); make the rollout a multiple of it to "
                      f"train on every sample, or set disable_rollout_trim_samples to make this an error")
        return RolloutPlan(dp_schedule=self.name, payloads=payloads, partitions=[list(p) for p in schedule.partitions],
                           step_samples=[sorted(s) for s in schedule.step_samples], dropped=list(schedule.dropped),
                           dropped_reason=reason, num_samples=schedule.num_samples, schedule=schedule)

    def dry_run(self, lengths: Sequence[int], rollout_ids: Sequence[int], args: Any, parallel: ParallelConfig,
                batch: BatchConfig) -> None:
        plan_schedule(lengths, parallel, batch, rollout_ids=rollout_ids)

    def iterators(self, args: Any, model: Any, payload: RankPayload, *, vpp: int | None = None) -> RankSteps:
        """The payload's schedule slice, one iterator per VPP stage over the same micro-batches."""
        payload = data.check_payload(payload, planned=True)
        stages = data.vpp_size() if vpp is None else vpp
        return RankSteps([data.DataIterator(payload, payload.micro_batch_indices) for _ in range(stages)],
                         list(payload.num_microbatches))

    def lr_increment(self, args: Any, payload: RankPayload, step: int) -> int:
        """The samples step ``step`` really trains on (varies with multi-sample rollouts and dynamic sizes)."""
        return payload.samples_per_step[step]

    def record(self, steps: RankSteps, payload: RankPayload, **measured: Any) -> RolloutStepRecord:
        """The measured step and the rollouts the planner gave it."""
        return RolloutStepRecord(**measured, rollouts=int(payload.rollouts_per_step[measured["step"]]))
