"""The train side of the slime integration, for slime v0.2.4 (later slime consumes the schedule natively).

Inside each train actor (installed by :func:`megatron_init`, which slime calls through ``--custom-megatron-init-path``):

* :func:`get_data_iterator` replaces the actor's bound ``get_data_iterator(args, model, rollout_data)``. It plans
  nothing and all-reduces nothing: the iterators walk the ``micro_batch_indices`` the rollout side sent, with
  slime's own ``DataIterator``, one per virtual pipeline stage, and ``num_microbatches`` is the schedule's.
* :func:`wrap_train_one_step` makes step ``s`` count what it really trained on. The unit is **samples**, because
  v0.2.4's LR horizon is in samples (``train_iters * global_batch_size`` = the samples of all rollouts) and its
  loss reducer averages per sample:

  - the LR scheduler advances by ``samples_per_step[s]`` instead of ``--global-batch-size``;
  - the loss normaliser, which slime reads from ``rollout_data["dynamic_global_batch_size"]``, is the same
    ``samples_per_step[s]``, so every sample of the step weighs ``1 / samples_per_step[s]``.

  With one sample per rollout and no trimming both equal ``--global-batch-size``: nothing changes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from slime_ext.training.lr import StepSizedScheduler

from .planner import SCHEDULE_KEY

#: attribute on each DataIterator holding the per-step sample counts of its rollout
STEP_SAMPLES_ATTR = "slime_ext_samples_per_step"


class SlimeScheduleMissing(RuntimeError):
    """The rollout data carries no slime-ext schedule (the rollout side was not switched)."""


def get_data_iterator(args: Any, model: Any, rollout_data: dict, *, data_iterator_cls: type,
                      vpp_size: int) -> tuple[list, list[int]]:
    """``(iterators, num_microbatches)`` from the rollout side's schedule; removes :data:`SCHEDULE_KEY` from
    ``rollout_data`` so slime's logging sees only its own keys."""
    schedule = rollout_data.pop(SCHEDULE_KEY, None)
    if schedule is None:
        raise SlimeScheduleMissing(
            "rollout_data has no slime-ext schedule: the train actors run slime-ext's data path but the "
            "RolloutManager did not plan with slime-ext; start the job with `python -m slime_ext.integrations.slime "
            "train.py ...` (or call slime_ext.integrations.slime.enable() in the driver before slime creates the "
            "RolloutManager), or pass --dp-schedule legacy to use slime's own path everywhere")
    micro_batch_indices = schedule["micro_batch_indices"]
    num_microbatches = [int(n) for n in schedule["num_microbatches"]]
    if sum(num_microbatches) != len(micro_batch_indices):
        raise SlimeScheduleMissing(f"the schedule has {len(micro_batch_indices)} micro-batches for this rank but "
                                   f"num_microbatches sums to {sum(num_microbatches)}; the payload was altered")
    iterators = [data_iterator_cls(rollout_data, None, micro_batch_indices) for _ in range(max(1, vpp_size))]
    for it in iterators:
        setattr(it, STEP_SAMPLES_ATTR, list(schedule["samples_per_step"]))
    return iterators, num_microbatches


def wrap_train_one_step(original: Callable) -> Callable:
    """``train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler,
    num_microbatches)`` stepping LR and loss normaliser by the step's sample count (see the module doc)."""

    def train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler,
                       num_microbatches, *rest, **kwargs):
        sizes = step_sizes(data_iterator)
        if sizes is None:  # slime's own data path (--dp-schedule legacy): untouched
            return original(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler,
                            num_microbatches, *rest, **kwargs)
        samples = int(sizes[step_id])
        for it in data_iterator:
            it.rollout_data["dynamic_global_batch_size"] = samples
        scheduler = StepSizedScheduler(opt_param_scheduler, expected=args.global_batch_size, increment=samples,
                                       expected_is="slime v0.2.4's --global-batch-size")
        return original(args, rollout_id, step_id, data_iterator, model, optimizer, scheduler, num_microbatches,
                        *rest, **kwargs)

    return functools.wraps(original)(train_one_step)


def step_sizes(data_iterator: Sequence[Any]) -> list[int] | None:
    """The per-step sample counts a rank's iterators carry (``None`` on slime's own path)."""
    return getattr(data_iterator[0], STEP_SAMPLES_ATTR, None) if data_iterator else None
