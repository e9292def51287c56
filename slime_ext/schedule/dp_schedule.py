"""``DPSchedule``: the plan the rollout side makes and the training side runs; frozen plain data that pickles through
Ray and round-trips through JSON."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from .config import BatchConfig, ParallelConfig
from .cost import CostModel
from .profile import PROFILE_KIND, CostProfile
from .errors import ScheduleError
from .validate import (INT64_MAX, INT64_MIN, MAX_SAMPLES, check_bool, check_int, check_mapping, check_number,
                       check_samples, is_int, nested_int_lists, show)
from .payload import RankPayload, SampleBatch
from .planner_config import ObjectiveConfig

SCHEMA_VERSION = 3
#: StepStats fields renamed in schema 3 (they hold the cost model's unit); a schema-2 schedule is read with them mapped
RENAMED_IN_3 = {"rank_flops_max": "rank_cost_max", "rank_flops_mean": "rank_cost_mean",
                "microbatch_flops_max": "microbatch_cost_max", "microbatch_flops_mean": "microbatch_cost_mean"}


@dataclass(frozen=True)
class StepStats:
    """What the scheduler achieved on one step, next to the bounds it is measured against."""

    step: int
    num_samples: int
    num_rollouts: int
    total_tokens: int
    #: micro-batches per rank (the same on every rank)
    num_microbatches: int
    #: micro-batches over all ranks (``num_microbatches * dp_size``)
    total_microbatches: int
    #: the count the packing aimed for (:func:`~.bounds.microbatch_target`; static: ``ceil(n / micro_batch_size)``)
    packing_target: int
    #: token cap per micro-batch (``max_tokens_per_gpu * cp_size``), ``None`` for static batches
    cap: int | None
    largest_bin_tokens: int
    #: micro-batches above the cap that hold more than one sample (must be 0)
    cap_violations: int
    #: estimated cost summed per rank, max and mean over ranks, in ``DPSchedule.cost_unit``
    rank_cost_max: float
    rank_cost_mean: float
    #: ``max(1, cost of the largest sample / rank_cost_mean)``: no assignment can do better
    balance_lower_bound: float
    #: estimated cost per micro-batch (same unit): max and mean over all micro-batches of the step
    microbatch_cost_max: float
    microbatch_cost_mean: float
    #: which packing produced the step (for diagnostics): e.g. ``"rank-greedy"``, ``"lpt"``, ``"bfd"``, ``"static"``
    strategy: str = ""
    #: with ``pp_size > 1``, the slowest replica's predicted makespan (:mod:`.pipeline_pricing`'s units); else ``None``
    predicted_makespan: float | None = None
    #: that replica's bubble fraction, ``1 - (one stage's work) / makespan``; ``None`` without pipeline parallelism
    bubble_fraction: float | None = None

    @property
    def flops_imbalance(self) -> float:
        """max/mean of per-rank cost (1.0 is perfect); a ratio, the same in every cost unit."""
        return self.rank_cost_max / self.rank_cost_mean if self.rank_cost_mean > 0 else 1.0

    @property
    def token_utilization(self) -> float | None:
        """Tokens over ``total_microbatches * cap`` (dynamic batches only)."""
        if self.cap is None:
            return None
        return self.total_tokens / (self.total_microbatches * self.cap)


@dataclass(frozen=True)
class DPSchedule:
    """One rollout's schedule for every DP rank, with the inputs it was planned from. It unpacks like upstream's
    ``build_dp_schedule``: ``partitions, micro_batch_indices, num_microbatches, global_batch_sizes``."""

    #: global sample indices owned by DP rank ``r``, in micro-batch order, all steps concatenated
    partitions: list[list[int]]
    #: ``[r][k]``: indices into ``partitions[r]`` of micro-batch ``k``, tiling ``range(len(partitions[r]))``
    micro_batch_indices: list[list[list[int]]]
    num_microbatches: list[int]  # per step, micro-batches per rank (the same on every rank: PP lockstep)
    samples_per_step: list[int]  # what each step trains on (the LR scheduler is stepped by it)
    rollouts_per_step: list[int]
    dropped: list[int]  # trimmed samples (trailing rollouts that do not fill a step): never silent
    stats: list[StepStats]
    parallel: ParallelConfig
    batch: BatchConfig
    total_lengths: list[int]
    rollout_ids: list[int] | None = None
    loss_tokens: list[int] | None = None
    #: loss-mask tokens per step over all ranks (when loss masks were given): a per-token loss normaliser
    loss_tokens_per_step: list[int] | None = None
    #: what the costs were estimated with (see :attr:`cost_unit`)
    cost_model: CostModel | CostProfile | None = None
    #: global sample indices of step ``s`` in rollout order (before distribution); handy for ledgers
    step_samples: list[list[int]] = field(default_factory=list)
    #: the explicit steps the request gave (``PlanRequest.step_of``), ``None`` where steps were derived
    step_of: list[int] | None = None
    #: the pass this plan is for: ``False`` training, ``True`` forward-only (``PlanRequest.forward_only``)
    forward_only: bool = False
    #: the count per DP rank the request fixed (``PlanRequest.microbatches_per_rank``), ``None`` where chosen
    microbatches_per_rank: int | None = None
    #: what the pipeline predictions in ``stats`` were priced with (``PlannerConfig.objective``; a schedule saved
    #: without it was planned with the default)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)

    @property
    def dp_size(self) -> int:
        return self.parallel.dp_size

    @property
    def num_steps(self) -> int:
        return len(self.num_microbatches)

    @property
    def cap(self) -> int | None:
        return self.batch.cap(self.parallel.cp_size)

    @property
    def cost_unit(self) -> str:
        """The stats' cost unit: ``"seconds"`` (a profile), ``"FLOPs"`` (a cost model) or ``"tokens"``."""
        if isinstance(self.cost_model, CostProfile):
            return "seconds"
        return "FLOPs" if self.cost_model is not None else "tokens"

    @property
    def num_samples(self) -> int:
        return len(self.total_lengths)

    @property
    def dropped_rollouts(self) -> list[int]:
        """Ids of the dropped rollouts (without rollout ids, a sample is a rollout)."""
        ids = self.rollout_ids
        return sorted({ids[i] for i in self.dropped}) if ids is not None else list(self.dropped)

    def __iter__(self) -> Iterator[Any]:
        """slime-compatible unpacking: ``(partitions, micro_batch_indices, num_microbatches, global_batch_sizes)``."""
        return iter((self.partitions, self.micro_batch_indices, self.num_microbatches, self.rollouts_per_step))

    def rank_payload(self, rank: int, samples: SampleBatch, rollout_id: int = 0) -> RankPayload:
        """What DP rank ``rank`` trains on: its samples (taken from the rollout's ``samples``) and schedule slice."""
        if not 0 <= rank < self.dp_size:
            raise ScheduleError(f"rank={rank} is outside [0, dp_size={self.dp_size})")
        if not isinstance(samples, SampleBatch):
            raise TypeError(f"samples is a {type(samples).__name__}, not a SampleBatch (one list per field: "
                            f"{', '.join(SampleBatch.KEYS)}); from per-sample dicts d: "
                            f"SampleBatch(**{{k: [d[k] for d in dicts] for k in SampleBatch.KEYS}})")
        if len(samples) != self.num_samples:
            raise ScheduleError(f"samples has {len(samples)} entries but the schedule was planned for "
                                f"{self.num_samples}; pass the whole rollout's SampleBatch")
        return RankPayload(
            rollout_id=rollout_id, dp_rank=rank, dp_size=self.dp_size, partition=list(self.partitions[rank]),
            samples=samples.take(self.partitions[rank]),
            micro_batch_indices=[list(mb) for mb in self.micro_batch_indices[rank]],
            num_microbatches=list(self.num_microbatches), samples_per_step=list(self.samples_per_step),
            rollouts_per_step=list(self.rollouts_per_step),
            loss_tokens_per_step=None if self.loss_tokens_per_step is None else list(self.loss_tokens_per_step),
        )

    def to_dict(self) -> dict:
        """Plain JSON-ready data; every list a fresh copy."""
        fields = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return {"schema_version": SCHEMA_VERSION, **fields}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DPSchedule":
        """Read back :meth:`to_dict`'s data, every field's type and range checked (else :class:`ScheduleError`);
        whether it is a valid schedule is :func:`~.invariants.check_schedule`'s job."""
        if not isinstance(d, Mapping):
            raise ScheduleError(f"a schedule must be a JSON object written by DPSchedule.to_dict, got "
                                f"{type(d).__name__}")
        version = d.get("schema_version")
        if not is_int(version) or version not in (2, SCHEMA_VERSION):  # not ==: an array compares elementwise
            raise ScheduleError(
                f"schema_version={show(version)} is not supported (expected {SCHEMA_VERSION}, or 2); "
                f"re-create the schedule with this version of slime-ext"
            )
        if version == 2 and isinstance(d.get("stats"), list):  # the stats' old names
            d = {**d, "stats": [{RENAMED_IN_3.get(k, k): v for k, v in s.items()} if isinstance(s, Mapping) else s
                                for s in d["stats"]]}
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in d
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ScheduleError(f"schedule dict is missing fields {missing}; it was not written by DPSchedule.to_dict")
        try:
            return cls(**fields_from_dict(d))
        except ScheduleError as e:
            raise ScheduleError(f"malformed schedule dict: {e}; it was not written by DPSchedule.to_dict or was "
                                f"edited") from None
        except (TypeError, KeyError, ValueError, AttributeError) as e:  # a backstop: every field is checked first
            raise ScheduleError(f"malformed schedule dict ({type(e).__name__}: {e}); it was not written by "
                                f"DPSchedule.to_dict or was edited") from None


def _plain(value: Any) -> Any:
    """A field as JSON-ready data: lists copied, records as dicts."""
    if isinstance(value, list):
        return [_plain(x) for x in value] if value and isinstance(value[0], (list, StepStats)) else list(value)
    if isinstance(value, (StepStats, ObjectiveConfig)):
        return dataclasses.asdict(value)
    return value.to_dict() if hasattr(value, "to_dict") else value


def _names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _step_stats(i: int, s: Any) -> StepStats:
    """One ``stats`` entry, each field checked against its declared type."""
    fields = {f.name: f for f in dataclasses.fields(StepStats)}
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
    check_mapping(f"stats[{i}]", s, fields)
    absent = [n for n in required if n not in s]
    if absent:
        raise ScheduleError(f"stats[{i}] is missing {absent}")
    out = {}
    for name, value in s.items():
        where, kind = f"stats[{i}].{name}", str(fields[name].type)
        if kind == "str" and not isinstance(value, str):
            raise ScheduleError(f"{where} must be a string, got {show(value)}")
        if kind != "str" and not (value is None and "None" in kind):  # an int or a float, or optional
            value = (check_number(where, value) if kind.startswith("float")
                     else check_int(where, value, minimum=INT64_MIN, maximum=INT64_MAX))
        out[name] = value
    return StepStats(**out)


def fields_from_dict(d: Mapping[str, Any]) -> dict:
    """The constructor's arguments from a saved schedule, every field checked."""
    def ints(name: str, depth: int = 0, optional: bool = False, **bounds: Any) -> list | None:
        if optional and d.get(name) is None:
            return None
        return nested_int_lists(name, d[name], depth, **{"minimum": INT64_MIN, "maximum": INT64_MAX, **bounds})

    lengths, ids, loss = check_samples(ints("total_lengths", what="integer token counts"),
                                       ints("rollout_ids", optional=True, what="integer ids"),
                                       ints("loss_tokens", optional=True, what="integer token counts"))
    stats = d["stats"]
    if not isinstance(stats, list):
        raise ScheduleError(f"stats must be a list, got {show(stats)}")
    cost_model = d.get("cost_model")
    parallel = ParallelConfig(**check_mapping("parallel", d["parallel"], _names(ParallelConfig)))
    parallel.require_dp_size()  # a schedule was planned for a data-parallel size
    return dict(
        partitions=ints("partitions", 1), micro_batch_indices=ints("micro_batch_indices", 2),
        **{name: ints(name) for name in ("num_microbatches", "samples_per_step", "rollouts_per_step", "dropped")},
        stats=[_step_stats(i, s) for i, s in enumerate(stats)],
        parallel=parallel,
        batch=BatchConfig(**check_mapping("batch", d["batch"], _names(BatchConfig))),
        total_lengths=lengths.tolist(),
        rollout_ids=None if ids is None else ids.tolist(),
        loss_tokens=None if loss is None else loss.tolist(),
        loss_tokens_per_step=ints("loss_tokens_per_step", optional=True), cost_model=_cost_from_dict(cost_model),
        step_samples=ints("step_samples", 1) if "step_samples" in d else [],
        step_of=ints("step_of", optional=True, minimum=0, maximum=len(lengths)),
        forward_only=check_bool("forward_only", d.get("forward_only", False)),
        microbatches_per_rank=None if d.get("microbatches_per_rank") is None
        else check_int("microbatches_per_rank", d["microbatches_per_rank"], maximum=MAX_SAMPLES),
        objective=ObjectiveConfig(**check_mapping("objective", d.get("objective", {}), _names(ObjectiveConfig))),
    )


def _cost_from_dict(d: Any) -> "CostModel | CostProfile | None":
    """A saved cost model: model dims (``CostModel``), or a measured profile (``slime-ext calibrate``)."""
    if d is None:
        return None
    if isinstance(d, Mapping) and d.get("kind") == PROFILE_KIND:
        return CostProfile.from_dict(d, source="the schedule's cost_model")
    return CostModel(**check_mapping("cost_model", d, _names(CostModel)))
