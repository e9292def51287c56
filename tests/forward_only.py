"""Whether this tree prices forward-only pipelines yet (``pipeline_pricing(..., forward_only=True)``).

The request (:class:`slime_ext.schedule.PlanRequest`, ``forward_only``) and Megatron-RL's log-prob order ask for it;
the forward-only pipeline model lands separately. Tests that need it are marked :data:`needs_forward_only_pricing`:
they skip, with that reason, only while the pricing says it is not available, and run by themselves once it is.
"""

from __future__ import annotations

import pytest

from slime_ext.schedule import ParallelConfig, ScheduleError, pipeline_pricing


def forward_only_pricing_available() -> bool:
    try:
        pipeline_pricing(ParallelConfig(dp_size=1, pp_size=2), None, 1024, forward_only=True)
    except ScheduleError as exc:
        if "forward-only pricing is not available" in str(exc):
            return False
        raise
    return True


needs_forward_only_pricing = pytest.mark.skipif(
    not forward_only_pricing_available(),
    reason="this tree has no forward-only pipeline pricing yet (pipeline_pricing(..., forward_only=True))")
