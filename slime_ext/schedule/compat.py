"""slime-compatible entry point: a drop-in for upstream ``slime.utils.dp_schedule.build_dp_schedule``."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .config import BatchConfig, ParallelConfig
from .profile import cost_from_args
from .dp_schedule import DPSchedule
from .planner import plan_schedule


def build_dp_schedule(
    args: Any,
    train_parallel_config: Mapping[str, Any] | ParallelConfig,
    total_lengths: Sequence[int],
    *,
    global_batch_size: int | None = None,
    rollout_indices: Sequence[int] | None = None,
    loss_tokens: Sequence[int] | None = None,
) -> DPSchedule:
    """Plan with slime's flags read off ``args`` (any attribute object).

    ``global_batch_size`` counts rollouts per step and overrides ``args.global_batch_size``;
    ``rollout_indices[i]`` is sample ``i``'s rollout id (``samples[i].index``). Model dims on ``args``
    (``hidden_size``, ``num_layers``, ...) feed the FLOPs model; without them balancing is by tokens.
    ``args.cost_profile`` (a JSON file from ``slime-ext calibrate``) replaces the FLOPs model with measured seconds.

    The result unpacks as upstream's ``(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)``
    and is also the full :class:`DPSchedule`.
    """
    return plan_schedule(
        total_lengths,
        ParallelConfig.from_dict(train_parallel_config),
        BatchConfig.from_args(args, global_batch_size=global_batch_size),
        rollout_ids=rollout_indices,
        loss_tokens=loss_tokens,
        cost_model=cost_from_args(args),  # args.cost_profile (a measured profile), else FLOPs from the model dims
    )
