"""The rollout side of the slime integration: slime's train data -> slime-ext's schedule -> slime's payloads.

Two shapes of slime, both served here:

* **v0.2.4** (before slime planned on the rollout side): ``RolloutManager._split_train_data_by_dp(data, dp_size)``
  splits samples over DP ranks and the train actors plan micro-batches themselves. :func:`rank_payloads`
  replaces that split: every rank's dict keeps slime's v0.2.4 layout (``partition``, per-sample lists in partition
  order, ``raw_reward``/``total_lengths`` whole) plus one extra entry, :data:`SCHEDULE_KEY`, that the train-side
  adapter (:mod:`.trainer`) consumes and removes before slime's own code sees the dict.
* **v0.3.0 and later** (slime's own rollout-side planner): :func:`slime_dp_schedule` replaces slime's
  ``build_dp_schedule``: slime's signature and return value, ``(partitions, micro_batch_indices, num_microbatches,
  global_batch_sizes)`` as plain lists; slime's trainer consumes it unchanged. The grouping keyword is
  ``group_indices`` at v0.3.0 and ``rollout_indices`` later.

Every plan is the library's: :func:`slime_ext.schedule.compat.request_from_args` reads slime's ``args`` into a
:class:`~slime_ext.schedule.PlanRequest` (as :func:`slime_ext.schedule.build_dp_schedule` does) and
:func:`slime_ext.schedule.plan` plans it.

Trailing rollouts that do not fill a step are dropped as slime drops them, but never silently: each plan is
logged (logger ``slime_ext.integrations.slime``) and its :class:`PlanReport` is kept for slime's metrics
(:func:`log_plan_metrics`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from slime_ext import schedule as library
from slime_ext.schedule import DPSchedule, ParallelConfig, ScheduleError
from slime_ext.schedule.compat import request_from_args
from slime_ext.schedule.config import LAYOUT_FLAGS

logger = logging.getLogger("slime_ext.integrations.slime")

#: the entry of a v0.2.4 rank payload that carries the rank's slice of the schedule to the train actor
SCHEDULE_KEY = "slime_ext_schedule"
#: v0.2.4 ships these whole to every rank (the train side slices ``total_lengths`` by ``partition`` and logs the
#: pass rate from the whole ``raw_reward``); every other per-sample list is sliced by partition on this side
WHOLE_KEYS = ("raw_reward", "total_lengths")
#: train data that v0.2.4's split does not forward to the trainer (its log functions cannot summarise them)
NOT_FORWARDED = ("metadata",)


class SlimePlanError(ScheduleError, AssertionError):
    """The rollout cannot be planned. Also an ``AssertionError``: slime's own planner signals these cases with
    ``assert``, and callers written against it may catch that."""


@dataclass(frozen=True)
class PlanReport:
    """What one rollout's plan kept and dropped, for slime's logs and metrics."""

    num_samples: int
    num_rollouts: int
    num_steps: int
    dropped_samples: int
    dropped_rollouts: int
    num_microbatches: tuple[int, ...]
    flops_imbalance: float
    #: with pipeline parallelism, each step's predicted makespan of its slowest replica (seconds with a calibrated
    #: profile, else per-stage forward FLOPs) and that replica's bubble fraction; empty without
    predicted_makespans: tuple[float, ...] = ()
    bubble_fractions: tuple[float, ...] = ()

    def metrics(self) -> dict[str, float]:
        """slime metric names (``rollout/`` prefix, as slime's rollout logging uses). With pipeline parallelism,
        each step ``s`` of the rollout also gets ``rollout/slime_ext/step_{s}/...``: its predicted makespan, bubble
        and micro-batches per rank, and the rollout its predicted total and makespan-weighted bubble."""
        out = {
            "rollout/slime_ext/dropped_samples": self.dropped_samples,
            "rollout/slime_ext/dropped_rollouts": self.dropped_rollouts,
            "rollout/slime_ext/train_steps": self.num_steps,
            "rollout/slime_ext/microbatches_per_rank": sum(self.num_microbatches),
            "rollout/slime_ext/flops_max_over_mean": self.flops_imbalance,
        }
        if self.predicted_makespans:
            total = sum(self.predicted_makespans)
            out["rollout/slime_ext/pipeline_makespan"] = total
            out["rollout/slime_ext/pipeline_bubble"] = (
                sum(m * b for m, b in zip(self.predicted_makespans, self.bubble_fractions)) / total if total else 0.0)
            for s, (span, bubble, count) in enumerate(zip(self.predicted_makespans, self.bubble_fractions,
                                                          self.num_microbatches)):
                out[f"rollout/slime_ext/step_{s}/predicted_makespan"] = span
                out[f"rollout/slime_ext/step_{s}/bubble"] = bubble
                out[f"rollout/slime_ext/step_{s}/microbatches_per_rank"] = count
        return out


#: the report of the last plan made in this process (the RolloutManager actor plans one rollout at a time)
last_report: PlanReport | None = None


def plan(args: Any, train_parallel_config: Mapping[str, Any], total_lengths: Sequence[int], *,
         global_batch_size: int | None, rollout_indices: Sequence[Any], loss_tokens: Sequence[int] | None = None,
         dynamic_rounds_samples: bool = False) -> DPSchedule:
    """slime-ext's schedule for one rollout, read off slime's ``args`` (``--balance-data``,
    ``--use-dynamic-batch-size``, ``--max-tokens-per-gpu``, ``--micro-batch-size``, the model dims, the pipeline
    size, ...) exactly as the library's :func:`slime_ext.schedule.build_dp_schedule` reads them: the request of
    :func:`slime_ext.schedule.compat.request_from_args`, planned by :func:`slime_ext.schedule.plan`.

    ``dynamic_rounds_samples``: ``--use-dynamic-global-batch-size`` follows slime v0.2.4's rule for it (the sample
    count rounded down to a multiple of dp_size, whole rollouts inside it; see
    :func:`slime_ext.schedule.steps.dynamic_step_rollouts`); without it the one step keeps every rollout."""
    global last_report
    gbs = global_batch_size if global_batch_size is not None else getattr(args, "global_batch_size", None)
    ids = _dense_ids(rollout_indices)
    try:
        request = request_from_args(args, train_parallel_config, list(total_lengths), global_batch_size=gbs,
                                    rollout_indices=ids, loss_tokens=loss_tokens)
        if dynamic_rounds_samples and request.batch.use_dynamic_global_batch_size:
            request = dataclasses.replace(request, batch=dataclasses.replace(
                request.batch, dynamic_global_batch_rounds_samples=True))
        schedule = library.plan(request)
    except ScheduleError as exc:
        raise SlimePlanError(str(exc)) from None
    last_report = _report(schedule, ids)
    _log(last_report, dynamic=schedule.batch.use_dynamic_global_batch_size)
    return schedule


def slime_dp_schedule(args: Any, train_parallel_config: Mapping[str, Any], total_lengths: Sequence[int], *,
                      global_batch_size: int, rollout_indices: Sequence[Any] | None = None,
                      group_indices: Sequence[Any] | None = None
                      ) -> tuple[list[list[int]], list[list[list[int]]], list[int], list[int]]:
    """What slime's rollout hook calls in place of ``slime.utils.dp_schedule.build_dp_schedule`` (v0.3.0:
    ``group_indices=``; later: ``rollout_indices=``): :func:`plan` as slime's plain 4-tuple.
    ``global_batch_sizes[s]`` is the number of rollouts in step ``s``: slime's trainer steps the LR scheduler by it
    and normalises the loss with it."""
    if (rollout_indices is None) == (group_indices is None):
        raise SlimePlanError("build_dp_schedule takes exactly one of rollout_indices= and group_indices=")
    ids = rollout_indices if rollout_indices is not None else group_indices
    schedule = plan(args, train_parallel_config, total_lengths, global_batch_size=global_batch_size,
                    rollout_indices=ids)
    return ([list(p) for p in schedule.partitions], [[list(mb) for mb in r] for r in schedule.micro_batch_indices],
            list(schedule.num_microbatches), list(schedule.rollouts_per_step))


def rank_payloads(args: Any, data: Mapping[str, Any], train_parallel_config: Mapping[str, Any]) -> list[dict]:
    """v0.2.4: one dict per DP rank in slime's layout, planned by slime-ext (the body of the replaced split).

    The rollout id of sample ``i`` is ``data["sample_indices"][i]`` (``Sample.index``); samples sharing it stay in
    one step, a sample whose index is ``None`` is a rollout of its own. ``global_batch_size`` counts rollouts per
    step, which is v0.2.4's count of samples when every rollout emits one sample. ``--use-dynamic-global-batch-size``
    follows v0.2.4's own rule for it: the step keeps the whole rollouts inside the sample count rounded down to a
    multiple of dp_size (slime cut that many samples, whole rollouts or not).
    """
    total_lengths = [len(t) for t in data["tokens"]]
    rollout_ids = data.get("sample_indices") or list(range(len(total_lengths)))
    loss_tokens = [int(sum(m)) for m in data["loss_masks"]] if "loss_masks" in data else None
    schedule = plan(args, train_parallel_config, total_lengths, global_batch_size=None,
                    rollout_indices=rollout_ids, loss_tokens=loss_tokens, dynamic_rounds_samples=True)
    n = len(total_lengths)
    payloads = []
    for r in range(schedule.dp_size):
        partition = list(schedule.partitions[r])
        payload: dict[str, Any] = {"partition": partition}
        for key, value in data.items():
            if key in NOT_FORWARDED or key == "total_lengths":
                continue
            if key in WHOLE_KEYS:
                payload[key] = value
            elif isinstance(value, (list, tuple)) and len(value) == n:
                payload[key] = [value[i] for i in partition]
        payload["total_lengths"] = total_lengths
        payload[SCHEDULE_KEY] = {
            "micro_batch_indices": [list(mb) for mb in schedule.micro_batch_indices[r]],
            "num_microbatches": list(schedule.num_microbatches),
            "samples_per_step": list(schedule.samples_per_step),
            "rollouts_per_step": list(schedule.rollouts_per_step),
        }
        payloads.append(payload)
    return payloads


def log_plan_metrics(args: Any, rollout_id: int, report: PlanReport | None = None) -> None:
    """Send the plan's figures to slime's tracking (wandb / tensorboard), under slime's ``rollout/step``."""
    report = report or last_report
    if report is None or not (getattr(args, "use_wandb", False) or getattr(args, "use_tensorboard", False)):
        return
    log, compute_rollout_step = _slime_tracking()
    metrics = report.metrics()
    metrics["rollout/step"] = compute_rollout_step(args, rollout_id)
    log(args, metrics, step_key="rollout/step")


def _slime_tracking():
    try:  # slime after 2026-08 moved tracking to slime.observability
        from slime.observability.logging_utils import log
        from slime.observability.metric_utils import compute_rollout_step
    except ImportError:
        from slime.utils.logging_utils import log
        from slime.utils.metric_utils import compute_rollout_step
    return log, compute_rollout_step


def _dense_ids(rollout_indices: Sequence[Any]) -> list[int]:
    """Rollout ids as 0..k-1 in first-seen order (slime's ids may be any hashable, e.g. str). A ``None`` id (a
    ``Sample`` without ``index``) is a rollout of its own, never merged with another ``None``: slime gives each such
    sample a fresh id of its own (v0.3.1's ``_convert_samples_to_train_data``) and v0.2.4 counts it as one sample."""
    dense: dict[Any, int] = {}
    out = []
    for rid in rollout_indices:
        if rid is None:
            rid = object()  # unique: equal to nothing else
        out.append(dense.setdefault(rid, len(dense)))
    return out


def _report(schedule: DPSchedule, ids: Sequence[int]) -> PlanReport:
    dropped_rollouts = len(schedule.dropped_rollouts)
    worst = max((s.flops_imbalance for s in schedule.stats), default=1.0)
    return PlanReport(num_samples=schedule.num_samples, num_rollouts=len(set(ids)), num_steps=schedule.num_steps,
                      dropped_samples=len(schedule.dropped), dropped_rollouts=dropped_rollouts,
                      num_microbatches=tuple(schedule.num_microbatches), flops_imbalance=round(worst, 4),
                      predicted_makespans=tuple(s.predicted_makespan for s in schedule.stats
                                                if s.predicted_makespan is not None),
                      bubble_fractions=tuple(s.bubble_fraction for s in schedule.stats
                                             if s.bubble_fraction is not None))


def _log(report: PlanReport, dynamic: bool = False) -> None:
    logger.info(f"slime-ext planned {report.num_samples} samples of {report.num_rollouts} rollouts into "
                f"{report.num_steps} steps, micro-batches per rank {list(report.num_microbatches)}, "
                f"FLOPs max/mean {report.flops_imbalance}"
                + (f", predicted pipeline makespan per step {[float(f'{m:.4g}') for m in report.predicted_makespans]}"
                   f" (bubble {[round(b, 3) for b in report.bubble_fractions]})" if report.predicted_makespans else ""))
    if report.dropped_samples and dynamic:
        logger.warning(f"slime-ext dropped {report.dropped_samples} samples of {report.dropped_rollouts} trailing "
                       f"rollouts outside --use-dynamic-global-batch-size's step (slime v0.2.4 rounds the sample "
                       f"count down to a multiple of dp_size; slime-ext keeps the whole rollouts inside it); pass "
                       f"--disable-rollout-trim-samples to train on every sample")
    elif report.dropped_samples:
        logger.warning(f"slime-ext dropped {report.dropped_samples} samples of {report.dropped_rollouts} trailing "
                       f"rollouts that do not fill a step of --global-batch-size rollouts; make the rollout a "
                       f"multiple of it to train on every sample, or pass --disable-rollout-trim-samples to make "
                       f"this an error")


def v024_parallel_config(args: Any, dp_size: int) -> dict[str, int]:
    """v0.2.4's RolloutManager knows only ``dp_size``; the rest of slime's parallel dict comes from Megatron's
    args, as the train actors see them."""
    return ParallelConfig.from_megatron(
        int(dp_size), context_parallel_size=getattr(args, "context_parallel_size", 1),
        pipeline_model_parallel_size=getattr(args, "pipeline_model_parallel_size", 1),
        virtual_pipeline_model_parallel_size=getattr(args, "virtual_pipeline_model_parallel_size", None),
        microbatch_group_size_per_vp_stage=getattr(args, "microbatch_group_size_per_vp_stage", None),
        overlap_p2p_comm=getattr(args, "overlap_p2p_comm", None),
        **{k: getattr(args, k) for k in LAYOUT_FLAGS if getattr(args, k, None) is not None}).to_dict()
