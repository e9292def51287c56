"""Shared test helpers. ``plan_checked`` is THE way tests build schedules: every schedule goes through the
invariant checker (written once, in ``slime_ext.schedule.invariants``).

Hypothesis profiles, chosen with ``HYPOTHESIS_PROFILE`` (default ``ci``):

* ``ci``: the fast default (what ``ci/test`` runs): each property test runs the example count it names
  (``@settings(max_examples=examples(N))``), or :data:`CI_EXAMPLES` when it names none. Derandomized: the examples
  are drawn from a seed fixed per test, so a commit passes or fails CI by what it changed, not by the draw.
* ``thorough``: :data:`THOROUGH_SCALE` times as many of each, randomly drawn on every run (the ~300,000-case fuzz
  of the planner and the input boundary; hours on 2 cores). This is where new counterexamples are found; each one
  found becomes a plain regression test::

      HYPOTHESIS_PROFILE=thorough ci/test tests/unit -k "propert or hardening" --timeout 0

Tests that fix their own ``max_examples`` should wrap the number in :func:`examples` so the profile scales it.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from slime_ext.schedule import BatchConfig, ParallelConfig, check_schedule, plan_schedule

CI_EXAMPLES = 100
THOROUGH_SCALE = 100
_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=CI_EXAMPLES, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=CI_EXAMPLES * THOROUGH_SCALE, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "thorough"):
    raise pytest.UsageError(f"HYPOTHESIS_PROFILE={PROFILE!r}: use ci (default) or thorough")
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """``n`` examples under the ``ci`` profile, ``THOROUGH_SCALE * n`` under ``thorough``."""
    return n * THOROUGH_SCALE if PROFILE == "thorough" else n


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


def json_paths(obj, *, list_items=(0, -1), prefix=()):
    """Every path into a JSON-like value (keys and list indices), visiting only ``list_items`` of each list
    (negative counts from the end), so a saved schedule yields a few hundred paths, not one per sample."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from json_paths(v, list_items=list_items, prefix=(*prefix, k))
    elif isinstance(obj, list):
        for i in sorted({i % len(obj) for i in list_items if -len(obj) <= i < len(obj)}):
            yield from json_paths(obj[i], list_items=list_items, prefix=(*prefix, i))
