"""The return path, typed: what a train step records, what a train rank returns, what the rollout side planned.

The way out (rollout side -> training side) is :class:`slime_ext.schedule.RankPayload`; these are the way back:

* :class:`StepRecord` -- one optimizer step of one rank (``train_one_step``), as each scheme records it:
  :class:`RolloutStepRecord` adds the rollouts the planned step trains on, :class:`LegacyStepRecord` the
  micro-batches this rank's own samples needed before the DP group agreed on a count;
* :class:`ForwardResult` -- one rank's per-token log-probs of a rollout (``forward_only``);
* :class:`RankResult` -- one rank's steps of one rollout (``TrainActor.train_rollout``);
* :class:`PlanInfo` -- what the rollout side planned for one rollout (``RolloutManager.generate``), which the
  driver prints and the ledger checker (:mod:`slime_ext.rollout.ledger`) holds the ranks' results against.

Each is a frozen dataclass of plain Python data (so it pickles through Ray) that validates itself on
construction: a record that exists is consistent, and a malformed one fails where it is made, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime_ext.schedule import DPSchedule, ScheduleError


class RecordError(ScheduleError):
    """A return-path record is malformed; the message names the record, the field, the value and the fix."""


def _fail(record: str, name: str, value: Any, fix: str):
    shown = repr(value)
    raise RecordError(f"{record}.{name}={shown if len(shown) <= 80 else shown[:77] + '...'}: {fix}")


def _int(record: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(record, name, value, f"must be an integer >= {minimum}")


def _id_lists(record: str, name: str, value: Any, what: str) -> None:
    """A list of lists of non-negative integer sample ids."""
    if not isinstance(value, list) or not all(isinstance(x, list) for x in value) or \
            any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for x in value for i in x):
        _fail(record, name, value, f"must be a list of {what}, each a list of non-negative integer sample ids")


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step of one rank.

    ``loss`` is the step objective over all ranks (:mod:`slime_ext.training.loss`); ``lr`` the rate this step
    applied; ``samples`` the samples the step trained on over all DP ranks; ``lr_increment`` what the LR scheduler
    was advanced by after it (the scheme's :meth:`~slime_ext.schemes.Scheme.lr_increment`) and
    ``scheduler_samples`` the scheduler's sample counter afterwards; ``ledger`` the global sample ids of each
    micro-batch this rank consumed, in order.
    """

    step: int
    loss: float
    lr: float
    samples: int
    num_microbatches: int
    seconds: float
    ledger: list[list[int]]
    loss_tokens: int
    grad_norm: float | None
    lr_increment: int
    scheduler_samples: int
    update_successful: bool

    def __post_init__(self) -> None:
        name = type(self).__name__
        for key, minimum in (("step", 0), ("samples", 1), ("num_microbatches", 1), ("loss_tokens", 0),
                             ("lr_increment", 0), ("scheduler_samples", 0)):
            _int(name, key, getattr(self, key), minimum)
        for key in ("loss", "lr", "seconds") + (("grad_norm",) if self.grad_norm is not None else ()):
            if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), float):
                _fail(name, key, getattr(self, key), "must be a float (convert tensors with float(...))")
        if not self.lr >= 0 or not self.seconds >= 0:
            _fail(name, "lr" if not self.lr >= 0 else "seconds", self.lr if not self.lr >= 0 else self.seconds,
                  "must be >= 0")
        _id_lists(name, "ledger", self.ledger, "micro-batches")
        if not isinstance(self.update_successful, bool):
            _fail(name, "update_successful", self.update_successful, "must be True or False")


@dataclass(frozen=True)
class RolloutStepRecord(StepRecord):
    """A step of ``dp_schedule: rollout``: the planned step, run unchanged. ``rollouts`` is the number of whole
    rollouts it trains on over all ranks (the planner groups steps by rollout; ``samples`` may vary with it)."""

    rollouts: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _int(type(self).__name__, "rollouts", self.rollouts, 1)
        if self.rollouts > self.samples:
            _fail(type(self).__name__, "rollouts", self.rollouts,
                  f"must be at most samples={self.samples}: a rollout trains on at least one sample")


@dataclass(frozen=True)
class LegacyStepRecord(StepRecord):
    """A step of ``dp_schedule: legacy``, planned on the rank. ``local_microbatches`` is what this rank's own
    samples needed (first-fit bins under the cap, or samples / micro_batch_size) before the DP group's
    ``all_reduce(MAX)``. Without VPP, ``num_microbatches - local_microbatches`` micro-batches were split off to keep
    the ranks in lockstep; with VPP the agreed count is rounded down to a whole group, so it may also be lower."""

    local_microbatches: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _int(type(self).__name__, "local_microbatches", self.local_microbatches, 1)


@dataclass(frozen=True)
class ForwardResult:
    """One rank's ``forward_only`` over its payload: ``sample_indices`` the global sample ids in payload order;
    ``log_probs[k]`` the per-token log-probs of sample ``k``'s response tokens on the last pipeline stage (where the
    logits are), ``None`` on every other stage."""

    sample_indices: list[int]
    log_probs: list[list[float]] | None

    def __post_init__(self) -> None:
        _id_lists("ForwardResult", "sample_indices", [self.sample_indices], "ids")
        if self.log_probs is None:
            return
        if not isinstance(self.log_probs, list) or len(self.log_probs) != len(self.sample_indices):
            _fail("ForwardResult", "log_probs", self.log_probs,
                  f"give one list per sample ({len(self.sample_indices)}), or None off the last pipeline stage")
        for k, lp in enumerate(self.log_probs):
            if not isinstance(lp, list) or not all(isinstance(x, float) for x in lp):
                _fail("ForwardResult", f"log_probs[{k}]", lp, "must be a list of floats (tensor.tolist())")


@dataclass(frozen=True)
class RankResult:
    """One train rank's result for one rollout: who it is and one :class:`StepRecord` per step."""

    rank: int
    dp_rank: int
    pp_rank: int
    records: list[StepRecord]
    #: seconds the rank waited for its payload from the object store
    fetch_seconds: float

    def __post_init__(self) -> None:
        for key in ("rank", "dp_rank", "pp_rank"):
            _int("RankResult", key, getattr(self, key), 0)
        if not isinstance(self.records, list) or not all(isinstance(r, StepRecord) for r in self.records):
            _fail("RankResult", "records", self.records, "must be a list of StepRecord, one per step")
        if [r.step for r in self.records] != list(range(len(self.records))):
            _fail("RankResult", "records", [r.step for r in self.records], "must hold steps 0, 1, ... in order")
        if isinstance(self.fetch_seconds, bool) or not isinstance(self.fetch_seconds, (int, float)) or \
                not self.fetch_seconds >= 0:
            _fail("RankResult", "fetch_seconds", self.fetch_seconds, "must be a number >= 0")


@dataclass(frozen=True)
class PlanInfo:
    """What the rollout side planned for one rollout, as the driver and the ledger checker read it.

    ``partitions[d]`` are the global sample ids DP rank ``d`` received, in payload order; ``step_samples[s]`` the
    (sorted) ids step ``s`` trains on over all ranks; ``dropped`` the ids no step trains on, ``dropped_reason`` why
    (empty when nothing is dropped). ``total_lengths``, ``rollout_ids`` and ``loss_tokens`` are per sample.
    ``schedule`` is the rollout-side :class:`~slime_ext.schedule.DPSchedule` where the scheme planned one, else
    ``None`` (legacy: the training side micro-batches step ``s`` of rank ``d`` from its share
    ``partitions[d][s*k:(s+1)*k]``, ``k = len(partitions[d]) / num_steps``).
    """

    dp_schedule: str
    rollout_id: int
    num_samples: int
    partitions: list[list[int]]
    step_samples: list[list[int]]
    dropped: list[int]
    dropped_reason: str
    total_lengths: list[int]
    rollout_ids: list[int]
    loss_tokens: list[int]
    schedule: DPSchedule | None = None

    def __post_init__(self) -> None:
        _int("PlanInfo", "rollout_id", self.rollout_id, 0)
        _int("PlanInfo", "num_samples", self.num_samples, 0)
        _id_lists("PlanInfo", "partitions", self.partitions, "DP ranks")
        _id_lists("PlanInfo", "step_samples", self.step_samples, "steps")
        _id_lists("PlanInfo", "dropped", [self.dropped], "ids")
        n = self.num_samples
        for key in ("total_lengths", "rollout_ids", "loss_tokens"):
            values = getattr(self, key)
            if not isinstance(values, list) or len(values) != n:
                _fail("PlanInfo", key, values, f"give one entry per sample (num_samples={n})")
        if any(i >= n for ids in (*self.partitions, *self.step_samples, self.dropped) for i in ids):
            _fail("PlanInfo", "partitions/step_samples/dropped", n, "hold ids below num_samples")
        if bool(self.dropped) != bool(self.dropped_reason):
            _fail("PlanInfo", "dropped_reason", self.dropped_reason,
                  "say why exactly when samples are dropped" if self.dropped else "must be empty: nothing is dropped")
        if self.schedule is not None and not isinstance(self.schedule, DPSchedule):
            _fail("PlanInfo", "schedule", type(self.schedule).__name__, "must be a DPSchedule or None")

    @property
    def num_steps(self) -> int:
        return len(self.step_samples)

    @property
    def samples_per_step(self) -> list[int]:
        return [len(s) for s in self.step_samples]

    @property
    def num_microbatches(self) -> list[int] | None:
        """Micro-batches per rank and step, where the rollout side planned them (``None``: the ranks decide)."""
        return None if self.schedule is None else list(self.schedule.num_microbatches)
