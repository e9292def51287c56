"""Plans are guarded: the planner still makes every pinned plan of ``bench/plan_digests.json`` (benchmark cases,
seeded small rollouts, seeded pipeline rollouts; refusals included, message and all).

A change meant to move plans shows with ``python -m bench.plan_quality`` that every moved plan is better, and
re-records the digests in a commit of their own (``python -m bench.plan_digest --write bench/plan_digests.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.plan_digest import all_digests

PINNED = Path(__file__).resolve().parents[2] / "bench" / "plan_digests.json"


def test_the_planner_makes_every_pinned_plan():
    pinned = json.loads(PINNED.read_text())
    now = all_digests()
    assert sorted(now) == sorted(pinned), "the pinned cases changed: re-record bench/plan_digests.json on purpose"
    moved = sorted(k for k in now if now[k] != pinned[k])
    assert not moved, (f"{len(moved)} of {len(now)} pinned plans moved, e.g. {moved[:5]}; if that is meant, show "
                       f"with `python -m bench.plan_quality` that each is better, then re-record the digests in "
                       f"their own commit (`python -m bench.plan_digest --write bench/plan_digests.json`)")
    assert sum(":" in v for v in now.values()) < len(now) // 2  # mostly plans, not refusals
