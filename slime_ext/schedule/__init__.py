"""Pure planning layer: standard library + numpy only (no torch, ray or megatron -- a test enforces it).

The one request (the samples, the layout and cap, optionally the steps, the pass and a fixed count per rank)::

    from slime_ext.schedule import BatchConfig, ParallelConfig, PlanRequest, plan
    schedule = plan(PlanRequest(lengths, ParallelConfig(dp_size=8, pp_size=4),
                                BatchConfig(global_batch_size=64, use_dynamic_batch_size=True,
                                            max_tokens_per_gpu=16384, balance_data=True)))

``plan_schedule`` is its keyword form, ``build_dp_schedule(args, train_parallel_config, total_lengths, ...)``
slime's.

**Module map** (the planner walks its stages in this order; a module imports only from those above it):

========================  ===========================================================================================
inputs                    ``config`` (ParallelConfig, BatchConfig), ``planner_config`` (PlannerConfig: every tunable),
                          ``validate`` (the input checks), ``errors``
cost model                ``cost`` (CostModel: FLOPs per sample; ``bin_costs``: the one bin pricing), ``profile``
                          (CostProfile: measured seconds), ``stages`` + ``pipeline_layout`` (per-stage shares)
1. steps                  ``steps`` (whole rollouts per step)
2.-3. packing             ``packing`` (capped micro-batches, aligned to DP x VPP), ``bounds``
4. distribution           ``distribute`` (equal counts per DP rank, balanced)
5. the pipeline choice    ``pipeline_model`` (megatron-core's schedule), ``pipeline_pricing`` (costs -> per-stage
                          times), ``pipeline_orders``, ``pipeline_shape``, ``pipeline_rebalance``, ``pipeline_refine``
                          (the candidates' pieces), ``pipeline_choice`` (the search, stated once)
the planner               ``step_plan`` (StepPlan: one step's plan), ``planner`` (stages 1-5 of one request)
one replica               ``replica`` (shape_replica, scan_replica, pack_replica: one replica's samples in exactly
                          ``count`` micro-batches, for hosts that plan inside their engine)
its record                ``dp_schedule`` (DPSchedule, StepStats), ``payload``, ``invariants`` (check_schedule)
the request               ``request`` (PlanRequest, checked on construction; plan: the entry point; plan_schedule)
slime's entry             ``compat`` (slime's args -> a PlanRequest; build_dp_schedule)
========================  ===========================================================================================

"""

from .compat import build_dp_schedule
from .config import BatchConfig, ParallelConfig
from .cost import CostModel, microbatch_costs, sample_costs
from .dp_schedule import DPSchedule, StepStats
from .errors import ScheduleError
from .invariants import check_schedule
from .payload import RankPayload, SampleBatch
from .pipeline_model import PipelineSpec, pipeline_makespan
from .pipeline_orders import best_orders
from .pipeline_pricing import PipelinePricing, pipeline_pricing
from .planner_config import PlannerConfig
from .profile import CostProfile
from .replica import ReplicaPlan, ReplicaScan, pack_replica, scan_replica, shape_replica
from .request import PlanRequest, plan, plan_schedule

__all__ = [
    "BatchConfig", "CostModel", "CostProfile", "DPSchedule", "ParallelConfig", "PipelinePricing", "PipelineSpec",
    "PlanRequest", "PlannerConfig", "RankPayload", "ReplicaPlan", "ReplicaScan", "SampleBatch", "ScheduleError",
    "StepStats", "best_orders", "build_dp_schedule", "check_schedule", "microbatch_costs", "pack_replica",
    "pipeline_makespan", "pipeline_pricing", "plan", "plan_schedule", "sample_costs", "scan_replica", "shape_replica",
]
