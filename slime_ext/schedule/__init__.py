"""Pure planning layer: standard library + numpy only (no torch, ray or megatron -- a test enforces it).

Rich API::

    from slime_ext.schedule import BatchConfig, ParallelConfig, CostModel, plan_schedule
    schedule = plan_schedule(lengths, ParallelConfig(dp_size=8), BatchConfig(global_batch_size=64,
                             use_dynamic_batch_size=True, max_tokens_per_gpu=16384, balance_data=True),
                             rollout_ids=ids, loss_tokens=loss_tokens, cost_model=CostModel(...))

slime-compatible API::

    partitions, micro_batch_indices, num_microbatches, global_batch_sizes = build_dp_schedule(
        args, train_parallel_config, total_lengths, global_batch_size=gbs, rollout_indices=ids)
"""

from .compat import build_dp_schedule
from .config import BatchConfig, ParallelConfig
from .cost import CostModel
from .dp_schedule import DPSchedule, StepStats
from .errors import ScheduleError
from .invariants import assert_valid_schedule, check_schedule
from .packing import best_fit_decreasing, expand_bins_by_splitting, first_fit_pack, lpt_rounds
from .partition import karmarkar_karp
from .payload import DP_SCHEDULES, RankPayload, SampleBatch
from .bounds import bin_lower_bound, microbatch_target
from .planner import plan_schedule
from .steps import compute_dynamic_global_batch_size

__all__ = [
    "BatchConfig",
    "DP_SCHEDULES",
    "RankPayload",
    "SampleBatch",
    "CostModel",
    "DPSchedule",
    "ParallelConfig",
    "ScheduleError",
    "StepStats",
    "assert_valid_schedule",
    "best_fit_decreasing",
    "bin_lower_bound",
    "build_dp_schedule",
    "check_schedule",
    "compute_dynamic_global_batch_size",
    "expand_bins_by_splitting",
    "first_fit_pack",
    "karmarkar_karp",
    "lpt_rounds",
    "microbatch_target",
    "plan_schedule",
]
