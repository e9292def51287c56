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
from .cost import CostModel, sample_costs
from .dp_schedule import DPSchedule
from .errors import ScheduleError
from .invariants import check_schedule
from .payload import RankPayload, SampleBatch
from .pipeline_plan import PipelinePricing, best_orders, pipeline_pricing
from .planner import plan_schedule
from .profile import CostProfile

# the public API; the rest (StepStats, fit_profile, ...) is imported from its module. The pipeline pieces are public
# for integrations that plan inside a host's engine (verl: one rank's micro-batches, ordered for the pipeline):
# the pricing of a layout (pipeline_pricing -> PipelinePricing), the order search (best_orders), the per-sample
# costs the planner balances (sample_costs)
__all__ = [
    "BatchConfig",
    "CostModel",
    "CostProfile",
    "DPSchedule",
    "ParallelConfig",
    "PipelinePricing",
    "RankPayload",
    "SampleBatch",
    "ScheduleError",
    "best_orders",
    "build_dp_schedule",
    "check_schedule",
    "pipeline_pricing",
    "plan_schedule",
    "sample_costs",
]
