"""Shared test helpers. ``plan_checked`` is THE way tests build schedules: every schedule goes through the
invariant checker (written once, in ``slime_ext.schedule.invariants``)."""

from __future__ import annotations

import pytest

from slime_ext.schedule import BatchConfig, ParallelConfig, check_schedule, plan_schedule


def plan_checked(lengths, parallel: ParallelConfig, batch: BatchConfig, **kwargs):
    """Plan, then assert every invariant holds and the recorded inputs are the given ones."""
    schedule = plan_schedule(lengths, parallel, batch, **kwargs)
    problems = check_schedule(
        schedule, total_lengths=lengths, rollout_ids=kwargs.get("rollout_ids"),
    )
    assert problems == [], "schedule violates its invariants:\n" + "\n".join(problems)
    return schedule


@pytest.fixture
def checked():
    return plan_checked
