"""The ``dp_schedule`` schemes: one class per scheme, looked up once by name.

Who plans the micro-batches is a value, ``dp_schedule``, and :func:`get_dp_schedule` turns it into the one object
that owns everything that differs between schemes -- as megatron-core's ``get_forward_backward_func()`` looks at
the parallel config once and returns one schedule with one signature. Callers never branch on the name again::

    scheme = get_dp_schedule(args.dp_schedule)
    plan = scheme.plan(train_data, args, train_parallel_config, rollout_id=r)     # rollout side: payloads
    scheme.dry_run(lengths, rollout_ids, args, parallel, batch)                    # run-config pre-check
    steps = scheme.iterators(args, model, payload)          # training side: RankSteps (iterators, counts)
    scheduler.step(increment=scheme.lr_increment(args, payload, step))
    record = scheme.record(steps, payload, **measured)      # what a step returns: the scheme's StepRecord

Layout (one concern per module):

* :mod:`.base` -- the interfaces: :class:`Scheme` (a scheme a job runs) and :class:`Baseline` (a scheme the
  benchmark and ``plan --compare`` measure ours against: :meth:`Baseline.schedule`), and what planning returns
  (:class:`RolloutPlan`, :class:`SchemeSchedule`), and what the training side runs (:class:`RankSteps`);
* :mod:`.data` -- **where the schedule is consumed**: :class:`~.data.DataIterator` over a ``RankPayload`` (one per
  VPP stage), the payload check, and the Megatron sizes and all-reduce a scheme's training half uses; the training
  adapter uses it too;
* :mod:`.records` -- the typed return path: :class:`StepRecord` (:class:`RolloutStepRecord`,
  :class:`LegacyStepRecord`), :class:`RankResult`, :class:`PlanInfo`, :class:`ForwardResult`;
* :mod:`.rollout` -- :class:`RolloutSchedule`, ``dp_schedule: rollout`` (ours, the default);
* :mod:`.legacy` -- :class:`LegacySchedule`, ``dp_schedule: legacy``: upstream's training-side scheme in our own
  code (also a baseline);
* :mod:`.reference` -- :class:`ReferenceSchedule`, upstream's rollout-side planner, imported from upstream at run
  time by :mod:`.upstream` (a baseline only).

Each scheme is one module, planning half and training half together. The planning half is pure (stdlib + numpy,
like :mod:`slime_ext.schedule`); the training half imports torch and Megatron inside its methods (:mod:`.data`) and never imports
:mod:`slime_ext.training`, which sits above it (the training adapter imports the schemes and their records), so the
rollout process, the CLI and the benchmark import every scheme without torch, Ray or Megatron. Adding a
scheme is adding one class and naming it in :data:`SCHEMES` (or :data:`BASELINES`).
"""

from __future__ import annotations

from typing import Any

from slime_ext.schedule import ScheduleError

from .base import Baseline, NotComparable, RankSteps, RolloutPlan, SameInput, Scheme, SchemeSchedule
from .legacy import LegacyPlanError, LegacySchedule, LegacySteps
from .records import (ForwardResult, LegacyStepRecord, PlanInfo, RankResult, RecordError, RolloutStepRecord,
                      StepRecord)
from .reference import ReferenceSchedule
from .rollout import RolloutSchedule
from .upstream import UpstreamUnavailable

#: the schemes a job can run, by ``dp_schedule`` name; the first is the default
SCHEMES: dict[str, Scheme] = {s.name: s for s in (RolloutSchedule(), LegacySchedule())}
#: the schemes ours is measured against (``plan --compare``, ``bench.run``), by name
BASELINES: dict[str, Baseline] = {b.name: b for b in (SCHEMES["legacy"], ReferenceSchedule())}
#: the ``dp_schedule`` values, for argparse ``choices`` and messages
DP_SCHEDULES = tuple(SCHEMES)
DEFAULT = DP_SCHEDULES[0]


def get_dp_schedule(name: Any = None) -> Scheme:
    """The scheme named ``name`` (``None``: the default, ``rollout``); the one place a ``dp_schedule`` is looked up."""
    if name is None:
        name = DEFAULT
    scheme = SCHEMES.get(name) if isinstance(name, str) else None
    if scheme is None:
        raise ScheduleError(f"dp_schedule={name!r}: must be one of {', '.join(DP_SCHEDULES)}; pass --dp-schedule "
                            f"{' or --dp-schedule '.join(DP_SCHEDULES)}")
    return scheme


__all__ = ["BASELINES", "Baseline", "DEFAULT", "DP_SCHEDULES", "ForwardResult", "LegacyPlanError", "LegacySchedule",
           "LegacyStepRecord", "LegacySteps", "NotComparable", "PlanInfo", "RankResult", "RankSteps", "RecordError",
           "ReferenceSchedule", "RolloutPlan", "RolloutSchedule", "RolloutStepRecord", "SCHEMES", "SameInput",
           "Scheme", "SchemeSchedule", "StepRecord", "UpstreamUnavailable", "get_dp_schedule"]
