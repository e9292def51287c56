"""Train data -> one :class:`RankPayload` per DP rank: where the rollout side hands a rollout to its scheme.

The ``dp_schedule`` scheme (:func:`slime_ext.schemes.get_dp_schedule`) decides what a payload holds: ``rollout``
(the default) plans the whole rollout and sends each rank its schedule slice; ``legacy`` splits the samples over
the ranks, as upstream slime does, and leaves micro-batching to the training side. Either way every sample is in
exactly one payload or in :attr:`RolloutPlan.dropped`, and the plan says why.
"""

from __future__ import annotations

from typing import Any, Mapping

from slime_ext.schedule import SampleBatch
from slime_ext.schemes import RolloutPlan, get_dp_schedule


def plan_rollout(train_data: SampleBatch, args: Any, train_parallel_config: Mapping[str, int], *,
                 rollout_id: int = 0) -> RolloutPlan:
    """Plan one rollout's ``train_data`` (:func:`slime_ext.rollout.train_data.samples_to_train_data`) for training.

    ``args`` carries slime's batch flags, ``dp_schedule`` and the model dims (for the FLOPs model);
    ``train_parallel_config`` is slime's dict (``dp_size``, ``cp_size``, ``vpp_size``,
    ``microbatch_group_size_per_vp_stage``).
    """
    scheme = get_dp_schedule(getattr(args, "dp_schedule", None) or None)  # unset or empty: the default
    return scheme.plan(train_data, args, train_parallel_config, rollout_id=rollout_id)
