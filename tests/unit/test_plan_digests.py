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


def test_plan_quality_set_reaches_the_planner_of_every_pipeline_case(tmp_path, capsys):
    """``bench.plan_quality --set NAME=VALUE`` plans the pipeline cases with that ``PlannerConfig``: with the
    pp-unaware candidate alone no pipeline plan is chosen for the pipeline, where the defaults choose many."""
    from bench import plan_quality
    from bench.plan_digest import outcomes

    def strategies(config=None):
        return {label: o.stats[0].strategy for label, o in outcomes(quick=True, config=config)
                if label.startswith("pipeline/") and not isinstance(o, str)}

    from slime_ext.schedule import PlannerConfig
    default, unaware = strategies(), strategies(PlannerConfig(candidates=("unaware",)))
    assert default.keys() == unaware.keys() and len(default) > 20
    assert not any("+pp" in s for s in unaware.values())
    assert sum("+pp" in s for s in default.values()) > len(default) // 2
    out = tmp_path / "unaware.json"
    assert plan_quality.main(["--quick", "--write", str(out), "--set", 'candidates=["unaware"]']) == 0
    assert "candidates" in capsys.readouterr().out
    assert default.keys() <= json.loads(out.read_text()).keys()
