"""How the pipeline benchmarks price one stage's forward and backward of a micro-batch: the backward/forward ratio
and :func:`stage_costs`. :mod:`bench.pipeline` (the replay) and :mod:`bench.pipeline_real` (real compute, which
``bench.pipeline --real`` runs) both use them, so they live here, below both.
"""

from __future__ import annotations

import numpy as np

#: backward / forward time of a micro-batch (the issue's cost assumption)
BACKWARD_FORWARD_RATIO = 2.0


def stage_costs(profile, micro_batches: list[list[int]], parallel) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage forward and backward of each micro-batch (lists of sample lengths), in run order, priced as the
    planner prices them (:func:`slime_ext.schedule.pipeline_plan.pipeline_pricing`: the profile's seconds split
    ``1 : backward_forward_ratio`` and over the ``pp`` stages)."""
    from slime_ext.schedule.pipeline_plan import pipeline_pricing

    pricing = pipeline_pricing(parallel, profile, None)
    return pricing.stage_costs(np.array([profile.microbatch_time(mb) for mb in micro_batches]))
