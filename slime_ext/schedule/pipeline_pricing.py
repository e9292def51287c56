"""The pipeline objective's prices: the planner's micro-batch costs as per-stage forward and backward times for
the pipeline model (:mod:`.pipeline_model`), the predicted makespans of a schedule as planned, the search's one
comparison (:func:`beats`) and its work budget (:class:`Budget`).

A micro-batch's cost ``c`` is the planner's own (:func:`~slime_ext.schedule.cost.bin_costs`). Per stage, every
stage alike: with a ``CostProfile`` (seconds, the micro-batch priced whole) forward ``c / ((1 + r) pp)``, backward
``r`` times that (``r``: the profile's ``backward_forward_ratio``), p2p ``p2p_s``; with FLOPs or tokens forward
``(c + o) / pp``, backward ``objective.backward_forward_ratio`` times that, where ``o`` charges every micro-batch
``objective.microbatch_overhead`` of a full one (``cap`` tokens at the linear rate); makespans in per-stage forward
FLOPs (tokens without a model). A forward-only pass (log-prob and reference) prices the same forwards, no
backward, on the model's forward-only schedule. Uneven stages (:class:`~slime_ext.schedule.stages.StageCosts`)
give each virtual stage its share (:attr:`PipelinePricing.stage_share`). Pure: standard library and numpy.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from .config import ParallelConfig
from .cost import CostModel, bin_costs, sample_costs
from .errors import ScheduleError
from .pipeline_model import PipelineSpec, _table_makespans, bubble_fraction
from .planner_config import DEFAULT_CONFIG, PlannerConfig
from .profile import CostProfile
from .stages import StageCosts
from .validate import check_bool

if TYPE_CHECKING:
    from .dp_schedule import DPSchedule

__all__ = ["PipelinePricing", "beats", "pipeline_pricing", "predicted_makespans", "step_microbatch_costs"]


def beats(a, b, config: PlannerConfig, by: float | None = None):
    """The search's one comparison (every part of it calls this): makespan ``a`` beats ``b`` when lower by more
    than ``objective.tie`` of ``b`` (``by``: a loop's stop rule, ``objective.min_gain``). Elementwise on arrays."""
    return a < b * (1 - (config.objective.tie if by is None else by))


@dataclass(frozen=True)
class PipelinePricing:
    """How the planner's micro-batch costs become per-stage forward/backward times for the pipeline model.

    Every stage alike (``stage_share is None``): stage forward = ``(cost + overhead) * scale``. Uneven stages:
    virtual stage ``k``'s forward = ``(cost + overhead) * scale * pp * stage_share[k]``, one row per virtual stage
    (``pp * vpp`` shares summing to 1; an even split gives back the first form)."""

    spec: PipelineSpec
    backward_forward_ratio: float  # 0 on a forward-only pass (``spec.forward_only``)
    scale: float  # per-stage forward = (cost + overhead) * scale, every stage alike
    overhead: float  # added to every micro-batch's cost (FLOPs plans)
    units: str  # "seconds", "forward FLOPs per stage" or "tokens per stage"
    #: per virtual stage ``chunk * pp + rank``: its share of a micro-batch's cost; ``None`` when the stages are even
    stage_share: tuple[float, ...] | None = None
    #: the planner's tunables (the model's evaluation settings; the search reads the rest)
    config: PlannerConfig = field(default=DEFAULT_CONFIG, compare=False, repr=False)

    def stage_costs(self, mb_costs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward per stage: ``(..., M)`` every stage alike, or ``(..., pp * vpp, M)`` uneven."""
        f = (np.asarray(mb_costs, dtype=np.float64) + self.overhead) * self.scale
        if self.stage_share is not None:
            f = f[..., None, :] * (np.asarray(self.stage_share) * self.spec.pp_size)[:, None]
        return f, self.backward_forward_ratio * f

    @property
    def slope(self) -> float:
        """How much a replica's makespan grows per unit of cost it gains, at a fixed count and order: the busiest
        pipeline rank's forward and backward of it."""
        busiest = 1.0 if self.stage_share is None else \
            float(np.asarray(self.stage_share).reshape(-1, self.spec.pp_size).sum(axis=0).max() * self.spec.pp_size)
        return (1.0 + self.backward_forward_ratio) * self.scale * busiest

    def makespans(self, mb_costs: np.ndarray) -> np.ndarray:
        """``(R, M)`` micro-batch costs in run order -> ``(R,)`` predicted makespans."""
        return self.makespans_many([mb_costs])[0]

    def makespans_many(self, mb_costs: list[np.ndarray]) -> list[np.ndarray]:
        """Several groups of ``(R_i, M_i)`` micro-batch costs (each its own count) -> their ``(R_i,)`` makespans, in
        one pass of the model (:func:`~slime_ext.schedule.pipeline_model._table_makespans`; the per-stage costs
        are written straight into the model's cost tables, the same numbers :meth:`stage_costs` gives)."""
        v = self.spec.chunks
        tables = []
        for c in mb_costs:
            c = np.atleast_2d(np.asarray(c, dtype=np.float64))
            f = ((c + self.overhead) * self.scale).T  # (M, R)
            m = f.shape[0]
            if self.stage_share is None:  # every stage alike: forwards then backwards, a chunk's share each
                table = np.empty((2 * m, f.shape[1]))
                table[:m] = f / v
                table[m:] = (self.backward_forward_ratio * f) / v
                tables.append((table, (0,) * (self.spec.pp_size * v), m))
                continue
            share, kinds = self._share_kinds  # stages of equal share read one block of rows
            rows = len(share) * m  # (kind of stage, micro-batch) x replicas: forwards, then backwards
            table = np.empty((2 * rows, f.shape[1]))
            np.multiply(f[None, :, :], share[:, None, None], out=table[:rows].reshape(len(share), m, -1))
            np.multiply(self.backward_forward_ratio, table[:rows], out=table[rows:])
            tables.append((table, kinds, m))
        return _table_makespans(tables, self.spec, self.config)

    @cached_property
    def _share_kinds(self) -> tuple[np.ndarray, tuple[int, ...]]:
        """The distinct per-virtual-stage forward shares (``stage_share * pp``) and each stage's index among them."""
        share, kinds = np.unique(np.asarray(self.stage_share) * self.spec.pp_size, return_inverse=True)
        return share, tuple(int(x) for x in kinds)

    def bubble(self, mb_costs: np.ndarray, span: float | None = None) -> float:
        """One replica's :func:`~slime_ext.schedule.pipeline_model.bubble_fraction` (``span``: its makespan, when
        known)."""
        f, b = self.stage_costs(np.atleast_2d(mb_costs))
        return float(bubble_fraction(f, b, self.spec, None if span is None else [span])[0])


def pipeline_pricing(parallel: ParallelConfig, cost_model: CostModel | CostProfile | None, cap: int | None,
                     config: PlannerConfig | None = None, *, forward_only: bool = False) -> PipelinePricing | None:
    """The pricing for this layout and cost model; ``None`` without pipeline parallelism (``pp_size == 1``).
    ``forward_only``: a forward-only pass, ``cap`` its token cap.

    Uneven stages (:meth:`~slime_ext.schedule.stages.StageCosts.if_split`) give virtual stage ``k`` the share
    ``linear[k] T + quadratic[k] S`` of a micro-batch of ``T = cap`` tokens (without a cap
    ``objective.stage_share_tokens``) in samples of ``objective.stage_share_sample * T`` tokens (``S = sum L^2``)."""
    config = DEFAULT_CONFIG if config is None else config
    forward_only = check_bool("pipeline_pricing(forward_only)", forward_only)
    parallel.require_dp_size()
    pp = parallel.pp_size
    if pp == 1:
        return None
    vpp = parallel.vpp_size
    group = parallel.microbatch_group_size_per_vp_stage if vpp > 1 else None
    stages = StageCosts.if_split(cost_model, parallel)
    share = None
    if stages is not None and stages.uneven:
        tokens = float(cap if cap is not None else config.objective.stage_share_tokens)
        per = np.asarray(stages.virtual_linear) * tokens \
            + np.asarray(stages.virtual_quadratic) * tokens * tokens * config.objective.stage_share_sample
        share = tuple(float(x) for x in per / per.sum())
    if isinstance(cost_model, CostProfile):
        ratio = cost_model.backward_forward_ratio  # the measured split: a forward is 1 / (1 + ratio) of the seconds
        spec = PipelineSpec(pp, vpp, group, p2p_s=cost_model.p2p_s, overlap_p2p_comm=parallel.overlap_p2p_comm,
                            forward_only=forward_only)
        return PipelinePricing(spec, 0.0 if forward_only else ratio, 1.0 / ((1.0 + ratio) * pp), 0.0, "seconds",
                               share, config)
    linear = cost_model.coefficients()[0] if cost_model is not None else 1.0
    overhead = config.objective.microbatch_overhead * linear * cap if cap is not None else 0.0
    spec = PipelineSpec(pp, vpp, group, p2p_s=0.0, overlap_p2p_comm=parallel.overlap_p2p_comm,
                        forward_only=forward_only)
    units = "forward FLOPs per stage" if cost_model is not None else "tokens per stage"
    ratio = 0.0 if forward_only else config.objective.backward_forward_ratio
    return PipelinePricing(spec, ratio, 1.0 / pp, overhead, units,
                           share, config)


def step_microbatch_costs(schedule: "DPSchedule", step: int) -> np.ndarray:
    """``(dp, M)``: each rank's micro-batch costs in ``step``, in the order the rank runs them, priced as the
    planner prices them (:func:`~slime_ext.schedule.cost.bin_costs`)."""
    lengths = np.asarray(schedule.total_lengths, dtype=np.int64)
    profile = schedule.cost_model if isinstance(schedule.cost_model, CostProfile) else None
    costs = sample_costs(lengths, schedule.cost_model)
    start = sum(schedule.num_microbatches[:step])
    m = schedule.num_microbatches[step]
    members, labels = [], []
    for r in range(schedule.dp_size):
        part = schedule.partitions[r]
        for k, mb in enumerate(schedule.micro_batch_indices[r][start:start + m]):
            members += [part[i] for i in mb]
            labels += [r * m + k] * len(mb)
    members_a = np.asarray(members, dtype=np.int64)
    return bin_costs(lengths[members_a], costs[members_a], np.asarray(labels, dtype=np.int64),
                     schedule.dp_size * m, profile).reshape(schedule.dp_size, m)


def predicted_makespans(schedule: "DPSchedule", step: int, pricing: PipelinePricing | None = None) -> np.ndarray:
    """``(dp,)`` each replica's predicted makespan of ``step`` as planned (``pricing``: the schedule's own by
    default; pass another to price the same plan for another layout, e.g. a pp-unaware plan for the real one)."""
    if pricing is None:
        pricing = pipeline_pricing(schedule.parallel, schedule.cost_model, schedule.cap)
        if pricing is None:
            raise ScheduleError("the schedule has pp_size = 1: pass the pricing of a pipelined layout "
                                "(pipeline_pricing(ParallelConfig(..., pp_size=N), cost_model, cap))")
    return pricing.makespans(step_microbatch_costs(schedule, step))


class Budget:
    """The work one step's pipeline search may spend, in cells of the model (:class:`~.planner_config.BudgetConfig`:
    one row x micro-batch x virtual stage priced), counted from the model and packing calls it makes (each
    estimated by the ``budget`` section: :meth:`model_cost`, :meth:`pack_cost`, :meth:`arrangement_cost`,
    :meth:`replica_cost`), never timed: the same input always gets the same search. Every part asks
    :meth:`allows` before it runs and is charged for what it runs."""

    def __init__(self, pricing: PipelinePricing, total: float, floor: float | None = None) -> None:
        self.pricing, self.total, self.spent = pricing, float(total), 0.0
        #: the budget's fixed part (the search around the slowest replicas: the refinement keeps a share of it)
        self.floor = self.total if floor is None else float(floor)
        self.cfg = pricing.config.budget
        self._v = pricing.spec.pp_size * pricing.spec.chunks

    @classmethod
    def for_step(cls, pricing: PipelinePricing, samples: int, replicas: int) -> "Budget":
        """A fixed part (:attr:`floor`: the search around the slowest replicas, shrinking as more replicas share
        the step, down to a least part: the fixed costs of one count's calls, ``budget.floor_min`` at dp 128 x pp 4)
        and a part that grows with the samples and with the replicas times ``pp ** budget.pp_power`` (packing and
        rebalancing every replica)."""
        c = pricing.config.budget
        least = (c.floor_min * (replicas / 128) ** c.floor_min_dp_power
                 / (pricing.spec.pp_size / 4) ** c.floor_min_pp_power)
        floor = min(c.floor_max, max(least, c.floor / float(replicas) ** c.floor_power))
        per_replica = c.per_replica * pricing.spec.pp_size ** c.pp_power
        return cls(pricing, floor + c.per_sample * samples + per_replica * replicas, floor)

    def left(self) -> float:
        return self.total - self.spent

    @contextmanager
    def capped(self, until: float):
        """Within the block, the budget ends at ``until`` (a part of the search given a share of it)."""
        total, self.total = self.total, min(self.total, until)
        try:
            yield self
        finally:
            self.total = total

    def _levels(self, m: int) -> float:
        spec = self.pricing.spec
        passes = 1 if spec.forward_only else 2  # a forward-only DAG has about half the levels
        return self.cfg.model_call + self.cfg.model_level * passes * (m * spec.chunks + spec.pp_size)

    def model_cost(self, rows: int, m: int) -> float:
        """A call of the model on ``rows`` rows of ``m`` micro-batches."""
        return self._levels(m) + float(rows * m * self._v)

    def pack_cost(self, rows: int, n: int, k: int) -> float:
        """A packing call of ``rows`` rows of at most ``n`` samples into ``k`` micro-batches (its pricing apart)."""
        c = self.cfg
        return c.loop_round + n * (c.pack_pass + rows * (c.pack_pass_row + c.pack_cell * k))

    def allows(self, cost: float) -> bool:
        """Whether work of this estimated cost still fits."""
        return self.spent + cost <= self.total

    def price(self, mb_costs: np.ndarray) -> np.ndarray:
        """:meth:`PipelinePricing.makespans`, charged."""
        mb_costs = np.atleast_2d(mb_costs)
        self.spent += self.model_cost(*mb_costs.shape)
        return self.pricing.makespans(mb_costs)

    def price_many(self, groups: list[np.ndarray]) -> list[np.ndarray]:
        """:meth:`PipelinePricing.makespans_many`, charged (one call: the levels of its largest count)."""
        groups = [np.atleast_2d(g) for g in groups]
        if groups:
            m = max(g.shape[1] for g in groups)
            self.spent += self._levels(m) + self.cfg.model_call * (len(groups) - 1) \
                + float(self._v * sum(g.size for g in groups))
        return self.pricing.makespans_many(groups)

    def refine_round_cost(self, draws: int, k: int) -> float:
        """A round of the refinement: its model call (``draws`` rows and their partners') and its overhead."""
        return self.model_cost(draws + draws * self.cfg.refine_partner_rows // 2, k) + self.cfg.loop_round

    def arrangement_cost(self, samples: int, replicas: int) -> float:
        """Samples and replicas put into arrays or lists (a plan taken apart or put together)."""
        return self.cfg.pack_pass_row * (samples + self.cfg.replica_passes * replicas)

    def replica_cost(self, replicas: int) -> float:
        """The per-replica work of a round of moving samples between replicas (water-filling)."""
        return self.cfg.water_replica * replicas

    def charge_round(self) -> None:
        """The overhead of one round of a loop of the search (the model calls are charged by :meth:`price`)."""
        self.spent += self.cfg.loop_round
