"""How the pipeline benchmarks price one stage's forward and backward of a micro-batch: the backward/forward ratio
and :func:`stage_costs`. :mod:`bench.pipeline` (the replay) and :mod:`bench.pipeline_real` (real compute, which
``bench.pipeline --real`` runs) both use them, so they live here, below both.
"""

from __future__ import annotations

import numpy as np

#: backward / forward time of a micro-batch (the issue's cost assumption)
BACKWARD_FORWARD_RATIO = 2.0


def stage_costs(profile, micro_batches: list[list[int]], parallel, *,
                per_stage: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage forward and backward of each micro-batch (lists of sample lengths), in run order, priced as the
    planner prices them (:func:`slime_ext.schedule.pipeline_pricing.pipeline_pricing`: the profile's seconds split
    ``1 : backward_forward_ratio`` and over the ``pp`` stages).

    Every stage alike by default: ``(M,)``, the issue-15 assumption the sleep replay runs (``bench.pipeline_stages``
    replays uneven stages). ``per_stage``: the planner's stage shares where it has them (a profile that records
    its model dims), ``(1, pp * vpp, M)``, ready for ``pipeline_makespan``; ``(M,)`` where the stages are even."""
    import dataclasses

    from slime_ext.schedule.pipeline_pricing import pipeline_pricing

    pricing = pipeline_pricing(parallel, profile, None)
    if not per_stage:
        pricing = dataclasses.replace(pricing, stage_share=None)
    costs = np.array([profile.microbatch_time(mb) for mb in micro_batches])
    return pricing.stage_costs(costs[None, :] if pricing.stage_share is not None else costs)
