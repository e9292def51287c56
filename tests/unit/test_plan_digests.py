"""A change detector, not a validity check: the planner still makes every pinned plan of
``bench/plan_digests.json`` (benchmark cases, seeded small rollouts, seeded pipeline rollouts; refusals included,
message and all). Whether a plan is *valid* is judged elsewhere (the invariant checker, the property tests); here a
moved plan fails with what moved -- which step, which rank, the micro-batches before and after.

A change meant to move plans shows with ``python -m bench.plan_quality`` that every moved plan is better, and
re-records the pinned plans in a commit of their own (``python -m bench.plan_digest --write bench/plan_digests.json``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from bench.plan_digest import all_records, changes, describe_change, digest, record
from bench.workloads import make_lengths
from slime_ext.schedule import BatchConfig, ParallelConfig, plan_schedule

PINNED = Path(__file__).resolve().parents[2] / "bench" / "plan_digests.json"


def test_change_detector_no_pinned_plan_moved():
    pinned = json.loads(PINNED.read_text())
    now = all_records()
    assert sorted(now) == sorted(pinned), "the pinned cases changed: re-record bench/plan_digests.json on purpose"
    moved = changes(pinned, now)
    shown = "\n".join(f"{k}:\n  " + "\n  ".join(lines) for k, lines in list(moved.items())[:3])
    assert not moved, (f"{len(moved)} of {len(now)} pinned plans moved; the first:\n{shown}\nif that is meant, show "
                       f"with `python -m bench.plan_quality` that each is better, then re-record them in their own "
                       f"commit (`python -m bench.plan_digest --write bench/plan_digests.json`)")
    assert sum(isinstance(v, str) for v in now.values()) < len(now) // 2  # mostly plans, not refusals


def test_plan_digests_hash_the_decisions_only():
    lengths = np.minimum(make_lengths("rl", 120, 3), 8192).tolist()
    s = plan_schedule(lengths, ParallelConfig(dp_size=2, pp_size=2),
                      BatchConfig(global_batch_size=120, use_dynamic_batch_size=True, max_tokens_per_gpu=8192))
    nudged = dataclasses.replace(s, stats=[dataclasses.replace(st, predicted_makespan=st.predicted_makespan * (1 + 1e-12),
                                                               rank_cost_max=st.rank_cost_max + 1e-6)
                                           for st in s.stats])
    assert digest(nudged) == digest(s)  # floats (sums in another order) do not move a digest
    moved = dataclasses.replace(s, micro_batch_indices=[mbs[::-1] for mbs in s.micro_batch_indices])
    assert digest(moved) != digest(s)  # a decision does
    assert json.loads(json.dumps(s.to_dict()))["partitions"] == s.partitions


def test_a_moved_plan_is_shown_by_step_and_rank():
    """Swap two samples between ranks in one step of a pinned plan: the report names that step, both ranks and the
    samples, not a hash."""
    from bench.plan_digest import random_case
    for seed in range(40):
        _, thunk = random_case(seed)
        try:
            schedule = thunk()
        except Exception:  # noqa: BLE001 -- a refused case: the next seed
            continue
        if schedule.dp_size >= 2 and schedule.num_steps >= 2:
            break
    else:
        raise AssertionError("no seeded case with two ranks and two steps")
    start = sum(schedule.num_microbatches[:1])
    a, b = schedule.micro_batch_indices[0][start][0], schedule.micro_batch_indices[1][start][0]
    parts = [list(p) for p in schedule.partitions]
    parts[0][a], parts[1][b] = parts[1][b], parts[0][a]
    moved = dataclasses.replace(schedule, partitions=parts)
    lines = describe_change(record(schedule), record(moved))
    text = "\n".join(lines)
    assert "step 1 rank 0" in text and "step 1 rank 1" in text, text
    assert f"samples left [{schedule.partitions[0][a]}]" in text and f"samples joined [{schedule.partitions[1][b]}]" in text
    assert "step 0" not in text
    assert changes({"case": record(schedule)}, {"case": record(moved)}) == {"case": lines}
    assert changes({"case": record(schedule)}, {"case": record(schedule)}) == {}


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
