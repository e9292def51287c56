"""The two interfaces a scheme implements, and what its planning returns.

* :class:`Scheme` -- a ``dp_schedule`` a job can run. One signature for every scheme, as megatron-core's
  ``get_forward_backward_func()`` returns schedules that all take the same arguments: the rollout side calls
  :meth:`Scheme.plan`, the run-config check :meth:`Scheme.dry_run`, the training side :meth:`Scheme.iterators`
  (a :class:`RankSteps`), :meth:`Scheme.lr_increment` and :meth:`Scheme.record` (the scheme's own
  :class:`~slime_ext.schemes.StepRecord` subclass). Callers never branch on the scheme's name again.
* :class:`Baseline` -- a scheme the benchmark and ``slime-ext plan --compare`` measure ours against:
  :meth:`Baseline.schedule` plans one rollout's lengths in the shape of our ``DPSchedule``, and
  :meth:`Baseline.same_input` says what it plans when it is given the rollout one of our schedules planned.

Planning is pure (stdlib + numpy); the training-side methods import torch and Megatron when they are called (through
:mod:`.data`), so a scheme is importable in the rollout process, the CLI and the benchmark without them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

from slime_ext.schedule import BatchConfig, CostModel, DPSchedule, ParallelConfig, RankPayload, SampleBatch

from .data import DataIterator
from .records import StepRecord


@dataclass
class RolloutPlan:
    """What one rollout turned into on the rollout side: per-DP-rank payloads, the steps, and what was dropped."""

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
    #: the full schedule, where the rollout side planned one
    schedule: DPSchedule | None = None

    @property
    def num_steps(self) -> int:
        return len(self.step_samples)


@dataclass
class SchemeSchedule:
    """A baseline's plan of one rollout, in our ``DPSchedule``'s shape: ``partitions[r]`` in micro-batch order,
    ``micro_batch_indices[r]`` tiling it, ``num_microbatches[s]`` per rank; one metrics function measures all."""

    partitions: list[list[int]]
    micro_batch_indices: list[list[list[int]]]
    num_microbatches: list[int]
    #: seconds of each phase, where the scheme reports them (legacy: split, then per rank: count, partition)
    timings: dict[str, Any] = field(default_factory=dict)


@dataclass
class RankSteps:
    """One rank's steps of one rollout, as a scheme's training side hands them to megatron-core: one
    ``DataIterator`` per virtual pipeline stage (``get_forward_backward_func()``'s ``data_iterator``) and the
    micro-batches of each step (its ``num_microbatches``), the same on every rank. A scheme that decides more on the
    rank subclasses it to keep what its step records report (:class:`~slime_ext.schemes.legacy.LegacySteps`)."""

    iterators: list[DataIterator]
    num_microbatches: list[int]


class NotComparable(ValueError):
    """A baseline cannot plan the input ours planned (its flags mean something else there); the message says why."""


@dataclass(frozen=True)
class SameInput:
    """Our rollout as a baseline takes it: the samples (ids into ours, in the order it plans them), its step size in
    its own :attr:`Baseline.batch_unit`, and each sample's rollout id."""

    sample_ids: list[int]
    global_batch_size: int
    rollout_ids: list[int]


class Scheme(ABC):
    """A ``dp_schedule`` a job can run (module docstring); one instance per scheme, looked up by name."""

    #: the ``dp_schedule`` value that selects it
    name: ClassVar[str]
    #: what ``global_batch_size`` counts on this scheme: ``"rollouts"`` or ``"samples"``
    batch_unit: ClassVar[str]
    #: how messages name what plans on this scheme ("refused by the planner")
    title: ClassVar[str]
    #: the record :func:`slime_ext.training.train_step.train_one_step` returns per step (:meth:`record`)
    step_record: ClassVar[type[StepRecord]]

    # ------------------------------------------------------------------ rollout side (pure)
    @abstractmethod
    def plan(self, train_data: SampleBatch, args: Any, train_parallel_config: Mapping[str, int], *,
             rollout_id: int = 0) -> RolloutPlan:
        """One rollout's train data -> one :class:`RankPayload` per DP rank (and the steps, and what is dropped).

        ``args`` carries slime's batch flags and the model dims; ``train_parallel_config`` is slime's dict.
        Raises :class:`slime_ext.schedule.ScheduleError` naming the flag and the fix.
        """

    @abstractmethod
    def dry_run(self, lengths: Sequence[int], rollout_ids: Sequence[int], args: Any, parallel: ParallelConfig,
                batch: BatchConfig) -> None:
        """Plan one rollout exactly as a running job would, every rank included, and discard it: raises
        :class:`slime_ext.schedule.ScheduleError` where the job would refuse it (the run config's pre-check)."""

    def easiest_length(self, batch: BatchConfig, shortest: int, longest: int) -> int:
        """The sample length, of ``shortest`` and ``longest``, that this scheme refuses least: the pre-check plans
        rollouts of it, so what it refuses there any rollout of that many samples could make it refuse."""
        return shortest

    # ------------------------------------------------------------------ training side (imports torch when called)
    @abstractmethod
    def iterators(self, args: Any, model: Any, payload: RankPayload, *, vpp: int | None = None) -> RankSteps:
        """This rank's payload as ``get_forward_backward_func()`` takes it (:class:`RankSteps`). ``vpp`` overrides
        Megatron's VPP size (tests without Megatron)."""

    @abstractmethod
    def lr_increment(self, args: Any, payload: RankPayload, step: int) -> int:
        """What the LR scheduler is advanced by after step ``step`` (``scheduler.step(increment=...)``)."""

    @abstractmethod
    def record(self, steps: RankSteps, payload: RankPayload, **measured: Any) -> StepRecord:
        """One step's :attr:`step_record`: the ``measured`` fields every scheme records (``StepRecord``'s, the step
        index ``step`` among them), and what this scheme adds for that step from its ``steps`` and ``payload``."""


class Baseline(ABC):
    """A scheme measured against ours by the benchmark and ``plan --compare`` (module docstring)."""

    name: ClassVar[str]
    batch_unit: ClassVar[str]
    #: how :meth:`schedule`'s time is reported when it is not one plain call (``timings["wall"]``), or ``""``
    time_note: ClassVar[str] = ""

    def missing(self) -> str:
        """What this machine lacks for the scheme to run, with how to get it; ``""`` when nothing."""
        return ""

    def note(self, batch: BatchConfig) -> str:
        """A caveat to print beside the scheme's result for these flags, or ``""``."""
        return ""

    @abstractmethod
    def same_input(self, ours: DPSchedule, batch: BatchConfig, cost_model: CostModel | None) -> SameInput:
        """What this scheme plans when compared with ``ours`` on the same rollout and flags; raises
        :class:`NotComparable` where it cannot plan it (e.g. its ``global_batch_size`` means something else)."""

    @abstractmethod
    def schedule(self, lengths: Sequence[int], parallel: ParallelConfig, batch: BatchConfig, *,
                 global_batch_size: int, rollout_ids: Sequence[int] | None = None,
                 cost_model: CostModel | None = None) -> SchemeSchedule:
        """Plan one rollout of ``lengths`` with the batch flags of ``batch``; ``global_batch_size`` is the step size
        in :attr:`batch_unit` (it replaces ``batch.global_batch_size``); ``cost_model`` the dense model dims where
        the scheme balances by FLOPs. Raises ``ValueError`` / ``AssertionError`` where the scheme cannot plan."""
