"""Pure planning layer: standard library + numpy only (no torch, ray or megatron -- a test enforces it).

The one request (what a host means: the samples, the steps, the layout and cap, the pass, optionally a fixed
micro-batch count per rank)::

    from slime_ext.schedule import BatchConfig, CostModel, ParallelConfig, PlanRequest, plan
    schedule = plan(PlanRequest(lengths, ParallelConfig(dp_size=8, pp_size=4),
                                BatchConfig(global_batch_size=64, use_dynamic_batch_size=True,
                                            max_tokens_per_gpu=16384, balance_data=True),
                                step_of=steps,               # explicit steps (None: whole rollouts per step)
                                forward_only=False,          # True: a log-prob pass, priced forward-only
                                microbatches_per_rank=None,  # k: exactly k micro-batches per rank, every step
                                cost_model=CostModel(...)))

``plan_schedule(lengths, parallel, batch, rollout_ids=ids, ...)`` is the keyword form of the same request;
``build_dp_schedule(args, train_parallel_config, total_lengths, global_batch_size=gbs, rollout_indices=ids)`` is
slime's (it unpacks as ``partitions, micro_batch_indices, num_microbatches, global_batch_sizes``).

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

Hosts that plan inside their engine also use ``pipeline_pricing``, ``microbatch_costs``, ``sample_costs``,
``best_orders`` and ``pipeline_makespan`` (the model itself).
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
