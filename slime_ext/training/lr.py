"""Where the LR is stepped: Megatron's ``OptimizerParamScheduler``, counting samples.

The rollout-side schedule knows how many samples each step really trains on (``samples_per_step[s]``: with
``use_dynamic_global_batch_size`` or multi-sample rollouts it varies from step to step), so the scheduler is
advanced by exactly that. The legacy path advances by the configured ``global_batch_size`` instead (see
:func:`slime_ext.training.legacy_backend.step_lr_scheduler`), which drifts from the samples really seen whenever
the step size varies.
"""

from __future__ import annotations

from typing import Any, Mapping

from .config import TrainConfig
from .data import RolloutDataError


def build_scheduler(config: TrainConfig, optimizer):
    """``OptimizerParamScheduler`` with warmup/decay lengths in samples (``lr_warmup_samples``, ``lr_decay_samples``)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=config.lr_warmup_init,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_samples,
        lr_decay_steps=config.lr_decay_steps,
        lr_decay_style=config.lr_decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=config.lr_decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
    )


def samples_in_step(rollout_data: Mapping[str, Any], step_id: int) -> int:
    """``samples_per_step[step_id]`` from the schedule slice, validated."""
    per_step = rollout_data.get("samples_per_step")
    if per_step is None or not 0 <= step_id < len(per_step):
        raise RolloutDataError(
            f"rollout_data has no samples_per_step[{step_id}]; the rollout-side schedule must send samples_per_step "
            f"(DPSchedule.rank_payload) so the LR scheduler can count the samples each step trains on"
        )
    value = per_step[step_id]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RolloutDataError(f"samples_per_step[{step_id}]={value!r} must be a positive integer")
    return value


def step_lr_scheduler(args: Any, opt_param_scheduler, rollout_data: Mapping[str, Any], step_id: int) -> int:
    """Advance the scheduler by the samples step ``step_id`` really processed; returns the increment."""
    increment = samples_in_step(rollout_data, step_id)
    opt_param_scheduler.step(increment=increment)
    return increment
