"""One replica's samples in exactly ``count`` micro-batches, for a host that plans each DP rank inside its engine.

:func:`shape_replica`: without a pipeline, one balanced packing; with one, every shape of
``PlannerConfig.shaping.shapes`` packed at ``count`` and priced in one pass, the fastest kept in the best run order
:func:`.pipeline_orders.best_orders` finds. Where no shape holds the cap, :func:`pack_replica` split up to ``count``.
:func:`scan_replica`: the same shaping at many counts (``PlannerConfig.shaping.scan_shapes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np

from .config import BatchConfig, ParallelConfig
from .cost import CostModel, bin_costs, check_cost_model, sample_costs
from .errors import ScheduleError
from .packing import bins_to_labels
from .pipeline_orders import best_orders, heuristic_best
from .pipeline_pricing import Budget, PipelinePricing, beats, pipeline_pricing
from .pipeline_shape import Shape, ShapeSamples, pack_many, shape_pack
from .request import PlanRequest, plan
from .planner_config import DEFAULT_CONFIG, PlannerConfig
from .profile import CostProfile
from .validate import check_bool, check_int, check_int_array

__all__ = ["ReplicaPlan", "ReplicaScan", "pack_replica", "scan_replica", "shape_replica"]

#: balanced packing (no pipeline): every micro-batch the same target share
FLAT = Shape(0, 0, 1.0)


@dataclass(frozen=True)
class ReplicaPlan:
    """One replica's samples in exactly ``len(micro_batches)`` micro-batches, in run order."""

    #: indices into the samples given, per micro-batch, in the order the replica runs them; each index once
    micro_batches: tuple[tuple[int, ...], ...]
    #: the pipeline model's makespan of this run order (the pricing's units); ``None`` without a pipeline
    predicted_makespan: float | None


@dataclass(frozen=True)
class ReplicaScan:
    """:func:`scan_replica`'s answer: per count that packed, its predicted makespan (``None`` without a pipeline)."""

    spans: dict[int, float | None]
    #: per count: each sample's micro-batch, numbered in run order
    labels: dict[int, np.ndarray] = field(repr=False, compare=False)
    #: the pricing and samples the scan packed (``None`` without a pipeline)
    pricing: PipelinePricing | None = field(default=None, repr=False, compare=False)
    samples: ShapeSamples | None = field(default=None, repr=False, compare=False)

    def __contains__(self, count: object) -> bool:
        return count in self.spans

    def plan(self, count: int, *, reorder: bool = True) -> ReplicaPlan | None:
        """The packing at ``count`` (``None`` where it did not pack), with ``reorder`` in the fastest run order
        :func:`~.pipeline_orders.heuristic_best` finds."""
        if count not in self.spans:
            return None
        labels, span = self.labels[count], self.spans[count]
        if self.pricing is not None and reorder:
            return _in_best_order(self.pricing, self.samples, labels, count, span, heuristic_best)
        return ReplicaPlan(_groups(labels, count), span)


# ---------------------------------------------------------------------------------------------------- inputs
def _lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    x = check_int_array("lengths", lengths, minimum=1, what="token counts (at least one token per sample)")
    if not len(x):
        raise ScheduleError("lengths is empty: a replica's plan needs at least one sample")
    return x


def _cap(cap: object) -> int:
    return check_int("cap", cap, maximum=1 << 40, fix="pass the token cap per micro-batch (max_tokens_per_gpu)")


_cached_pricing = lru_cache(maxsize=64)(pipeline_pricing)


def _pricing(parallel: ParallelConfig, cost_model, cap: int, config: PlannerConfig,
             forward_only: bool) -> PipelinePricing | None:
    """The layout's pipeline pricing (``None`` without a pipeline), cached: a host asks for the same few."""
    check_cost_model(cost_model)
    forward_only = check_bool("forward_only", forward_only)
    if parallel.pp_size == 1:
        return None
    return _cached_pricing(parallel, cost_model, cap, config, forward_only=forward_only)


def _samples(x: np.ndarray, cap: int, cost_model, pricing: PipelinePricing | None) -> ShapeSamples:
    spec = None if pricing is None else pricing.spec
    step = spec.group if spec is not None and spec.vpp_size > 1 else 1
    profile = cost_model if isinstance(cost_model, CostProfile) else None
    return ShapeSamples(x, sample_costs(x, cost_model), cap, profile, step)


def _groups(bin_of: np.ndarray, count: int) -> tuple[tuple[int, ...], ...]:
    """Labels (sample ``i`` in micro-batch ``bin_of[i]``, run position) -> index tuples in run order."""
    members = np.argsort(bin_of, kind="stable")
    starts = np.searchsorted(bin_of[members], np.arange(count + 1))
    return tuple(tuple(members[starts[b]:starts[b + 1]].tolist()) for b in range(count))


# ---------------------------------------------------------------------------------------------------- the fallback
def pack_replica(lengths: Sequence[int] | np.ndarray, cap: int, *,
                 cost_model: CostModel | CostProfile | None = None) -> tuple[tuple[int, ...], ...]:
    """The planner's capped, FLOP-balanced micro-batches of one replica's samples (no pipeline) at the count it
    chooses, as index tuples in run order."""
    x, cap = _lengths(lengths), _cap(cap)
    batch = BatchConfig(global_batch_size=len(x), use_dynamic_batch_size=True, max_tokens_per_gpu=cap,
                        balance_data=True, balance_by_flops=True, disable_rollout_trim_samples=True)
    schedule = plan(PlanRequest(lengths=x, parallel=ParallelConfig(dp_size=1), batch=batch, cost_model=cost_model))
    part = schedule.partitions[0]
    return tuple(tuple(part[i] for i in mb) for mb in schedule.micro_batch_indices[0])


def _split_to(micro_batches: list[list[int]], count: int, costs: np.ndarray) -> list[list[int]]:
    """Split the costliest micro-batch of several samples in two (by cost) until there are ``count``."""
    mbs = [list(mb) for mb in micro_batches]
    while len(mbs) < count:
        j = max((j for j, mb in enumerate(mbs) if len(mb) > 1), key=lambda i: float(costs[mbs[i]].sum()))
        halves: tuple[list[int], list[int]] = ([], [])
        for i in sorted(mbs[j], key=lambda i: -costs[i]):
            min(halves, key=lambda h: float(costs[h].sum())).append(i)
        mbs[j:j + 1] = [sorted(halves[0]), sorted(halves[1])]
    return mbs


def _refuse(x: np.ndarray, count: int, cap: int, spec, fewest: int) -> ScheduleError:
    step = spec.group if spec is not None and spec.vpp_size > 1 else 1
    fewest = -(-fewest // step) * step
    aligned = f" (a multiple of microbatch_group_size_per_vp_stage={step})" if step > 1 else ""
    return ScheduleError(f"count={count} micro-batches cannot hold these {len(x)} samples ({int(x.sum())} tokens) "
                         f"under cap={cap}: the smallest count that holds them is {fewest}{aligned}; ask for "
                         f"count >= {fewest} or raise the cap")


# ---------------------------------------------------------------------------------------------------- the API
def scan_replica(lengths: Sequence[int] | np.ndarray, counts: Sequence[int], parallel: ParallelConfig,
                 cap: int, *, cost_model: CostModel | CostProfile | None = None, forward_only: bool = False,
                 config: PlannerConfig | None = None) -> ReplicaScan:
    """The samples shaped at each of ``counts`` (module docstring); counts that cannot run are left out."""
    config = DEFAULT_CONFIG if config is None else config
    x, cap = _lengths(lengths), _cap(cap)
    pricing = _pricing(parallel, cost_model, cap, config, forward_only)
    samples = _samples(x, cap, cost_model, pricing)
    counts = [int(k) for k in dict.fromkeys(counts) if 1 <= int(k) <= len(x) and _runs(pricing, int(k))]
    if pricing is None:
        packed = {k: labels for k in counts if (labels := _balanced(samples, k)) is not None}
        return ReplicaScan(dict.fromkeys(packed), packed)
    shapes = list(dict.fromkeys(Shape.of(s, parallel.pp_size) for s in config.shaping.scan_shapes))
    return _shaped(pricing, samples, counts, shapes)


def shape_replica(lengths: Sequence[int] | np.ndarray, count: int, parallel: ParallelConfig, cap: int | None, *,
                  cost_model: CostModel | CostProfile | None = None, forward_only: bool = False,
                  config: PlannerConfig | None = None) -> ReplicaPlan:
    """One replica's samples in exactly ``count`` micro-batches of at most ``cap`` tokens (a longer sample alone),
    shaped for ``parallel``'s pipeline (module docstring)."""
    config = DEFAULT_CONFIG if config is None else config
    x = _lengths(lengths)
    if cap is None:
        raise ScheduleError("cap=None: shape_replica packs dynamic micro-batches; pass the token cap per "
                            "micro-batch (max_tokens_per_gpu)")
    cap = _cap(cap)
    count = check_int("count", count, maximum=1 << 31, fix="pass the number of micro-batches wanted")
    pricing = _pricing(parallel, cost_model, cap, config, forward_only)
    spec = None if pricing is None else pricing.spec
    if count > len(x):
        raise ScheduleError(f"count={count} micro-batches but only {len(x)} samples (every micro-batch needs one); "
                            f"ask for count <= {len(x)}")
    if spec is not None:
        spec.check_microbatches(count)  # megatron-core's own rule for the layout (VPP groups)
    samples, span = _samples(x, cap, cost_model, pricing), None
    if pricing is None:
        labels = _balanced(samples, count)
    else:
        shapes = list(dict.fromkeys(Shape.of(s, parallel.pp_size) for s in config.shaping.shapes))
        scan = _shaped(pricing, samples, [count], shapes)  # then the order search below (not ReplicaScan.plan's)
        labels, span = scan.labels.get(count), scan.spans.get(count)
    if labels is None:  # no shape holds the cap at this count: the planner's packing, split up to it
        own = [list(mb) for mb in pack_replica(x, cap, cost_model=cost_model)]
        if len(own) > count:
            raise _refuse(x, count, cap, spec, len(own))
        labels = bins_to_labels(_split_to(own, count, samples.costs), len(x))
    if pricing is None:
        return ReplicaPlan(_groups(labels, count), None)
    return _in_best_order(pricing, samples, labels, count, span, best_orders)


# ---------------------------------------------------------------------------------------------------- the work
def _runs(pricing: PipelinePricing | None, k: int) -> bool:
    """Whether megatron-core runs ``k`` micro-batches on this layout."""
    try:
        if pricing is not None:
            pricing.spec.check_microbatches(k)
    except ScheduleError:
        return False
    return True


def _balanced(samples: ShapeSamples, k: int) -> np.ndarray | None:
    """Each sample's micro-batch in the balanced packing at ``k`` (``None`` where it misses the cap)."""
    members = samples.order[None, :]  # one replica: its samples by decreasing cost
    bin_of, ok = shape_pack(samples.lengths, samples.costs, members, FLAT.weights(k)[None, :], samples.cap)
    if not ok[0]:
        return None
    labels = np.empty(len(samples.lengths), dtype=np.int64)
    labels[members[0]] = bin_of[0]
    return labels


def _shaped(pricing: PipelinePricing, samples: ShapeSamples, counts: list[int], shapes: list[Shape]) -> ReplicaScan:
    """Every shape at every count packed and priced; the fastest per count kept (ties: the earlier shape)."""
    members = samples.order[None, :]  # one replica: its samples by decreasing cost
    combos = [(k, shape) for k in counts for shape in shapes]
    spans, bin_of = pack_many(Budget(pricing, math.inf), samples, members, combos) if combos else ([], [])
    found, labels = {}, {}
    for k in sorted(set(counts)):
        j = min((i for i, (c, _) in enumerate(combos) if c == k), key=lambda i: spans[i][0])
        if np.isfinite(spans[j][0]):
            labels[k] = np.empty(len(samples.lengths), dtype=np.int64)
            labels[k][members[0]] = bin_of[j][0]
            found[k] = float(spans[j][0])
    return ReplicaScan(found, labels, pricing, samples)


def _in_best_order(pricing: PipelinePricing, samples: ShapeSamples, labels: np.ndarray, count: int,
                   span: float | None, search) -> ReplicaPlan:
    """The micro-batches (``labels``, numbered in run order; ``span``: its makespan or ``None``) reordered where
    ``search`` finds a faster order."""
    row = bin_costs(samples.lengths, samples.costs, labels, count, samples.profile)[None, :]
    order, got = search(pricing, row)
    span = float(pricing.makespans(row)[0]) if span is None else span
    if beats(float(got[0]), span, pricing.config):  # relabel: the bin at run position p is order[0][p]
        where = np.empty(count, dtype=np.int64)
        where[order[0]] = np.arange(count)
        labels, span = where[labels], float(got[0])
    return ReplicaPlan(_groups(labels, count), span)
