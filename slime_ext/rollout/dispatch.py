"""Train data -> one :class:`RankPayload` per DP rank: where the rollout side plans the schedule (or, legacy, splits).

``dp_schedule: rollout`` (the default): :func:`slime_ext.schedule.build_dp_schedule` plans the whole rollout with
the loss-token counts and ``schedule.rank_payload(r, samples)`` is rank ``r``'s payload; the training side runs it
unchanged.

``dp_schedule: legacy`` (the baseline, upstream slime's split, :func:`slime_ext.baselines.split_train_data_by_dp`):
``global_batch_size`` counts **samples**; the rollout is trimmed to a multiple of it (or, with
``use_dynamic_global_batch_size``, to a multiple of ``dp_size``) and split per sample, strided or balanced. No
micro-batch schedule travels; the training side plans micro-batches per rank and all-reduces the MAX count. Rollout
ids are ignored, so the samples of one rollout may land in different steps, as upstream.

Either way every sample is in exactly one payload or in :attr:`RolloutPlan.dropped`, and the plan says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from slime_ext.baselines import split_train_data_by_dp
from slime_ext.schedule import DPSchedule, RankPayload, SampleBatch, ScheduleError, build_dp_schedule
from slime_ext.schedule.payload import DP_SCHEDULES
from slime_ext.schedule.steps import compute_dynamic_global_batch_size


@dataclass
class RolloutPlan:
    """What one rollout turned into: per-DP-rank payloads, the steps, and what was dropped."""

    dp_schedule: str
    #: what each DP rank trains on
    payloads: list[RankPayload]
    #: global sample ids owned by each DP rank, in payload order
    partitions: list[list[int]]
    #: global sample ids of each training step (over all ranks, sorted)
    step_samples: list[list[int]]
    #: global sample ids that no step trains on (trimmed tail), and why
    dropped: list[int]
    dropped_reason: str
    num_samples: int
    #: the full schedule (rollout path only)
    schedule: DPSchedule | None = None

    @property
    def num_steps(self) -> int:
        return len(self.step_samples)

    def summary(self) -> dict:
        out = {"dp_schedule": self.dp_schedule, "num_samples": self.num_samples, "num_steps": self.num_steps,
               "samples_per_step": [len(s) for s in self.step_samples], "dropped": list(self.dropped),
               "dropped_reason": self.dropped_reason}
        if self.schedule is not None:
            out["num_microbatches"] = list(self.schedule.num_microbatches)
            out["flops_imbalance"] = [round(s.flops_imbalance, 4) for s in self.schedule.stats]
        return out


def plan_rollout(train_data: SampleBatch, args: Any, train_parallel_config: Mapping[str, int], *,
                 rollout_id: int = 0) -> RolloutPlan:
    """Plan one rollout's ``train_data`` (:func:`slime_ext.rollout.train_data.samples_to_train_data`) for training.

    ``args`` carries slime's batch flags, ``dp_schedule`` and the model dims (for the FLOPs model);
    ``train_parallel_config`` is slime's dict (``dp_size``, ``cp_size``, ``vpp_size``,
    ``microbatch_group_size_per_vp_stage``).
    """
    mode = getattr(args, "dp_schedule", "rollout") or "rollout"
    if mode not in DP_SCHEDULES:
        raise ScheduleError(f"dp_schedule={mode!r} must be one of {DP_SCHEDULES}")
    return ROLLOUT_PLANNERS[mode](train_data, args, train_parallel_config, rollout_id)


def _plan_rollout_side(train_data: SampleBatch, args: Any, train_parallel_config: Mapping[str, int],
                       rollout_id: int) -> RolloutPlan:
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
        reason = (f"{len(schedule.dropped)} samples of {len(rollouts)} trailing rollouts {rollouts} do not fill a "
                  f"step of {per_step} rollouts (global_batch_size); make the rollout a multiple of it to train "
                  f"on every sample, or set disable_rollout_trim_samples to make this an error")
    return RolloutPlan(dp_schedule="rollout", payloads=payloads, partitions=[list(p) for p in schedule.partitions],
                       step_samples=[sorted(s) for s in schedule.step_samples], dropped=list(schedule.dropped),
                       dropped_reason=reason, num_samples=schedule.num_samples, schedule=schedule)


def legacy_global_batch_size(num_samples: int, args: Any, dp_size: int) -> int:
    """Samples per step on the legacy path (upstream's meaning of ``global_batch_size``)."""
    if getattr(args, "use_dynamic_global_batch_size", False):
        if num_samples < dp_size:
            raise ScheduleError(f"the rollout has {num_samples} samples but dp_size={dp_size}: the legacy path needs "
                                f"at least one sample per DP rank; collect more samples")
        return compute_dynamic_global_batch_size(num_samples, dp_size)
    gbs = getattr(args, "global_batch_size", None)
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1 or gbs % dp_size:
        raise ScheduleError(f"global_batch_size={gbs!r} (samples per step on the legacy path) must be a positive "
                            f"multiple of dp_size={dp_size}")
    return gbs


def legacy_split(total_lengths: Sequence[int], args: Any, dp_size: int) -> tuple[int, int, list[list[int]]]:
    """The legacy rollout side: ``(samples per step, samples kept, each DP rank's sample ids)``: whole steps only,
    the tail trimmed (or refused), then upstream's split of the kept samples (strided, or balanced on lengths)."""
    n = len(total_lengths)
    gbs = legacy_global_batch_size(n, args, dp_size)
    keep = n // gbs * gbs
    if keep == 0:
        raise ScheduleError(f"the rollout has {n} samples but global_batch_size={gbs} samples per step (legacy "
                            f"path): not even one step; lower --global-batch-size or collect more samples")
    if keep < n and getattr(args, "disable_rollout_trim_samples", False):
        raise ScheduleError(f"the rollout has {n} samples, not a multiple of global_batch_size={gbs} (legacy path); "
                            f"make it a multiple or drop --disable-rollout-trim-samples to trim the tail")
    return gbs, keep, split_train_data_by_dp(total_lengths[:keep], dp_size, bool(getattr(args, "balance_data", False)))


def _plan_legacy(train_data: SampleBatch, args: Any, train_parallel_config: Mapping[str, int],
                 rollout_id: int) -> RolloutPlan:
    dp_size = int(train_parallel_config["dp_size"])
    n = len(train_data)
    gbs, keep, partitions = legacy_split(train_data.total_lengths, args, dp_size)
    payloads = [RankPayload(rollout_id=rollout_id, dp_rank=r, dp_size=dp_size, partition=list(p),
                            samples=train_data.take(p), global_batch_size=gbs) for r, p in enumerate(partitions)]
    local = gbs // dp_size  # the training side cuts each rank's samples into steps of gbs / dp_size
    step_samples = [sorted(i for p in partitions for i in p[s * local:(s + 1) * local]) for s in range(keep // gbs)]
    dropped = list(range(keep, n))
    reason = ""
    if dropped:
        reason = (f"{len(dropped)} trailing samples do not fill a step of global_batch_size={gbs} samples (legacy "
                  f"path trims by samples, as upstream)")
    return RolloutPlan(dp_schedule="legacy", payloads=payloads, partitions=partitions, step_samples=step_samples,
                       dropped=dropped, dropped_reason=reason, num_samples=n)


#: the rollout-side half of each ``dp_schedule`` (the training-side half is ``slime_ext.training.data.DATA_PATHS``)
ROLLOUT_PLANNERS = {"rollout": _plan_rollout_side, "legacy": _plan_legacy}
assert tuple(ROLLOUT_PLANNERS) == DP_SCHEDULES
