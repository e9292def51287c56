"""The invariant checker must catch every kind of broken schedule (it is what every other test relies on)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from slime_ext.schedule import (
    BatchConfig,
    ParallelConfig,
    ScheduleError,
    check_schedule,
    plan_schedule,
)

LENGTHS = [60, 50, 40, 40, 30, 30, 20, 10, 10, 10, 70, 80, 5, 5, 90, 15]
IDS = [0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 10, 11, 12]


@pytest.fixture
def schedule():
    s = plan_schedule(LENGTHS, ParallelConfig(dp_size=2),
                      BatchConfig(global_batch_size=6, use_dynamic_batch_size=True, max_tokens_per_gpu=100),
                      rollout_ids=IDS, loss_tokens=[1] * len(LENGTHS))
    assert check_schedule(s) == []
    assert s.dropped and s.num_steps == 2
    return s


def tamper(s, **changes):
    return dataclasses.replace(s, **{k: copy.deepcopy(v) for k, v in changes.items()})


def first_problem_matching(problems, text):
    assert any(text in p for p in problems), f"expected a violation containing {text!r}, got {problems}"


def test_lost_sample(schedule):
    parts = copy.deepcopy(schedule.partitions)
    mbis = copy.deepcopy(schedule.micro_batch_indices)
    mb = next(m for m in mbis[0] if len(m) > 1)
    mb.pop()
    # re-tile so only the loss remains
    flat = [i for m in mbis[0] for i in m]
    parts[0] = [parts[0][i] for i in flat]
    k = 0
    for m in mbis[0]:
        m[:] = list(range(k, k + len(m)))
        k += len(m)
    problems = check_schedule(tamper(schedule, partitions=parts, micro_batch_indices=mbis))
    first_problem_matching(problems, "neither scheduled nor reported dropped")


def test_duplicated_sample(schedule):
    parts = copy.deepcopy(schedule.partitions)
    parts[1][0] = parts[0][0]
    first_problem_matching(check_schedule(tamper(schedule, partitions=parts)), "scheduled twice")


def test_unequal_micro_batch_counts(schedule):
    mbis = copy.deepcopy(schedule.micro_batch_indices)
    a = mbis[0].pop()
    mbis[0][-1].extend(a)
    first_problem_matching(check_schedule(tamper(schedule, micro_batch_indices=mbis)), "rank 0 has")


def test_not_tiling(schedule):
    mbis = copy.deepcopy(schedule.micro_batch_indices)
    mbis[1][0], mbis[1][1] = mbis[1][1], mbis[1][0]
    first_problem_matching(check_schedule(tamper(schedule, micro_batch_indices=mbis)), "do not tile")


def test_cap_violation(schedule):
    # make the samples of one multi-sample micro-batch long enough that together they exceed the cap
    r, mb = next((r, mb) for r in range(2) for mb in schedule.micro_batch_indices[r] if len(mb) > 1)
    lengths = list(schedule.total_lengths)
    for i in mb:
        lengths[schedule.partitions[r][i]] = 99
    first_problem_matching(check_schedule(tamper(schedule, total_lengths=lengths)), "> cap 100")


def test_misaligned_step(schedule):
    s = tamper(schedule, parallel=ParallelConfig(dp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=3))
    first_problem_matching(check_schedule(s), "not a positive multiple of align=6")


def test_rollout_split_across_steps(schedule):
    ids = list(schedule.rollout_ids)
    first_step, second_step = schedule.step_samples[0][0], schedule.step_samples[1][0]
    ids[second_step] = ids[first_step]
    first_problem_matching(check_schedule(tamper(schedule, rollout_ids=ids)), "split across steps")


def test_dropped_must_be_trailing(schedule):
    dropped = list(schedule.dropped)
    parts = copy.deepcopy(schedule.partitions)
    # pretend a scheduled sample of step 0 was dropped too: it is then both dropped and scheduled
    dropped.append(schedule.step_samples[0][0])
    first_problem_matching(check_schedule(tamper(schedule, dropped=dropped, partitions=parts)),
                           "both dropped and scheduled")


def test_step_accounting(schedule):
    first_problem_matching(check_schedule(tamper(schedule, samples_per_step=[1, 1])), "samples_per_step=1")
    first_problem_matching(check_schedule(tamper(schedule, loss_tokens_per_step=[0, 0])), "loss_tokens_per_step=0")
    first_problem_matching(check_schedule(tamper(schedule, rollouts_per_step=[6, 5])), "rollouts_per_step=5")


def test_recorded_inputs_are_compared(schedule):
    problems = check_schedule(schedule, total_lengths=[1] * len(LENGTHS))
    first_problem_matching(problems, "total_lengths recorded in the schedule differ")
    problems = check_schedule(schedule, rollout_ids=list(range(len(LENGTHS))))
    first_problem_matching(problems, "rollout_ids recorded in the schedule differ")


def test_check_schedule_lists_every_violation(schedule):
    parts = copy.deepcopy(schedule.partitions)
    parts[1][0] = parts[0][0]
    problems = check_schedule(tamper(schedule, partitions=parts, samples_per_step=[0, 0]))
    assert any("scheduled twice" in p for p in problems) and any("samples_per_step=0" in p for p in problems)


def test_edited_stats_are_caught(schedule):
    stats = list(schedule.stats)
    stats[0] = dataclasses.replace(stats[0], rank_cost_max=stats[0].rank_cost_max * 0.5, cap_violations=3)
    problems = check_schedule(tamper(schedule, stats=stats))
    first_problem_matching(problems, "stats[0].cap_violations = 3 but the schedule has 0")
    first_problem_matching(problems, "stats[0].rank_cost_max")


def test_one_broken_rank_does_not_cascade(schedule):
    # one rank claims an extra micro-batch count: exactly that is reported, not every sample of the rank as lost
    mbis = copy.deepcopy(schedule.micro_batch_indices)
    first = mbis[0][0]
    mbis[0][0:1] = [first[:1], first[1:]] if len(first) > 1 else [first, []]
    problems = check_schedule(tamper(schedule, micro_batch_indices=mbis))
    first_problem_matching(problems, "rank 0 has")
    assert not any("neither scheduled nor reported" in p for p in problems), problems


def test_malformed_dict_is_a_schedule_error(schedule):
    from slime_ext.schedule import DPSchedule

    d = schedule.to_dict()
    d["stats"] = [{"bogus": 1}]
    with pytest.raises(ScheduleError, match="malformed schedule dict"):
        DPSchedule.from_dict(d)
    d = schedule.to_dict()
    del d["partitions"]
    with pytest.raises(ScheduleError, match=r"missing fields \['partitions'\]"):
        DPSchedule.from_dict(d)


def test_a_replica_tied_with_the_slowest_may_give_the_recorded_bubble_and_a_wrong_one_is_caught():
    """Token costs tie often: here both replicas' makespans are 173.68 but their work differs (bubbles 0.241 and
    0.224). Either tied replica is "the slowest", so either bubble is right; any other value is flagged."""
    from dataclasses import replace as _replace

    from slime_ext.schedule.invariants import replica_makespans
    from slime_ext.schedule.pipeline_model import bubble_fraction

    s = plan_schedule([37, 14, 33, 28, 5, 18, 35], ParallelConfig(dp_size=2, pp_size=2),
                      BatchConfig(global_batch_size=None, use_dynamic_batch_size=True, max_tokens_per_gpu=64,
                                  use_dynamic_global_batch_size=True))
    spans, forward, ratio, spec = replica_makespans(s, 0)
    assert spans[0] == pytest.approx(spans[1], rel=1e-12)
    bubbles = [float(bubble_fraction(forward[r:r + 1], ratio * forward[r:r + 1], spec)[0]) for r in range(2)]
    assert abs(bubbles[0] - bubbles[1]) > 0.01
    for bubble, ok in ((bubbles[0], True), (bubbles[1], True), ((bubbles[0] + bubbles[1]) / 2, False)):
        sched = _replace(s, stats=[_replace(s.stats[0], bubble_fraction=bubble)])
        problems = check_schedule(sched)
        assert (problems == []) == ok, problems
        if not ok:
            assert any("bubble_fraction" in p and "tied" in p for p in problems), problems


def test_a_pipelined_plan_is_checked_under_the_objective_it_was_planned_with():
    """A plan made with a non-default objective records it: re-priced under it, the saved schedule checks clean;
    the same predictions read under another objective are flagged (the check does read the recorded one)."""
    from slime_ext.schedule import DPSchedule, PlannerConfig
    from slime_ext.schedule.planner_config import ObjectiveConfig

    config = PlannerConfig().replace_from(["objective.microbatch_overhead=0.5"])
    s = plan_schedule([900, 120, 640, 80, 300, 510, 45, 700, 260, 33, 410, 150], ParallelConfig(dp_size=2, pp_size=2),
                      BatchConfig(global_batch_size=None, use_dynamic_batch_size=True, max_tokens_per_gpu=1024,
                                  use_dynamic_global_batch_size=True), config=config)
    assert s.objective.microbatch_overhead == 0.5
    saved = s.to_dict()
    assert saved["objective"]["microbatch_overhead"] == 0.5
    assert check_schedule(DPSchedule.from_dict(saved)) == []
    default = DPSchedule.from_dict({k: v for k, v in saved.items() if k != "objective"})  # an older file's reading
    assert default.objective == ObjectiveConfig()
    first_problem_matching(check_schedule(default), "predicted_makespan")
