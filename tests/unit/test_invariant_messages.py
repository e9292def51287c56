"""The invariant checker's report, word for word: each broken schedule gets the violations it has (and no others:
a checker that reports a sample as lost when a rank's tiling broke would send a reader the wrong way), named with
the rank, the step and the values. What every other test relies on must itself fail on a wrong report."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from slime_ext.schedule import BatchConfig, ParallelConfig, check_schedule, plan_schedule
from tests.unit.test_invariant_checker import IDS, LENGTHS, tamper

DYNAMIC = BatchConfig(global_batch_size=6, use_dynamic_batch_size=True, max_tokens_per_gpu=100)
# the last lines of every report below: rank 0's samples count for no step, so the steps' accounts are off
STEPS_OFF = ["step 0 does not hold consecutive whole rollouts (rollout ordinals 0..4)",
             "step 0: samples_per_step=8 but 4 scheduled", "step 0: rollouts_per_step=6 but 4 rollouts scheduled",
             "step 0: loss_tokens_per_step=8 but the samples hold 4",
             "step 1 does not hold consecutive whole rollouts (rollout ordinals 8..10)",
             "step 1: samples_per_step=7 but 4 scheduled", "step 1: rollouts_per_step=6 but 3 rollouts scheduled",
             "step 1: loss_tokens_per_step=7 but the samples hold 4",
             "step 0: step_samples does not list the step's 4 scheduled samples",
             "step 1: step_samples does not list the step's 4 scheduled samples"]


@pytest.fixture
def schedule():
    s = plan_schedule(LENGTHS, ParallelConfig(dp_size=2), DYNAMIC, rollout_ids=IDS, loss_tokens=[1] * len(LENGTHS))
    assert s.num_microbatches == [2, 2] and s.dropped == [15] and s.partitions[0][0] == 0
    assert check_schedule(s) == []
    return s


def test_the_given_inputs_are_compared_and_checked(schedule):
    assert check_schedule(schedule, total_lengths=LENGTHS[:-1] + [1]) == [
        "total_lengths recorded in the schedule differ from the input lengths"]
    assert check_schedule(schedule, rollout_ids=IDS[:-1] + [99]) == [
        "rollout_ids recorded in the schedule differ from the input rollout ids"]
    assert check_schedule(schedule, total_lengths=[2.5] + LENGTHS[1:]) == [
        "the given total_lengths[0] = 2.5 is not an integer (float); total_lengths must hold integer counts"]
    assert check_schedule(schedule, rollout_ids=["a"] + IDS[1:]) == [
        "the given rollout_ids[0] = 'a' is not an integer (str); rollout_ids must hold integer counts"]
    without_ids = plan_schedule(LENGTHS, ParallelConfig(dp_size=2), DYNAMIC)
    assert without_ids.rollout_ids is None and check_schedule(without_ids) == []
    assert check_schedule(without_ids, rollout_ids=list(range(16))) == [
        "rollout_ids recorded in the schedule differ from the input rollout ids"]
    assert check_schedule(tamper(schedule, total_lengths=["x"] + LENGTHS[1:])) == [
        "recorded input: total_lengths[0] = 'x' is not an integer (str); total_lengths must hold integer token counts"]


def test_shape_problems_stop_the_check(schedule):
    assert check_schedule(tamper(schedule, partitions=schedule.partitions[:1])) == [
        "1 partitions / 2 micro-batch lists for dp_size=2"]
    assert check_schedule(tamper(schedule, num_microbatches=[20, 1])) == [
        "num_microbatches sums to 21 per rank, more than the 16 samples"]
    assert check_schedule(tamper(schedule, dropped=[16, 17, 18, 19, 20, 21])) == [
        "dropped lists sample indices outside [0, 16), e.g. [16, 17, 18, 19, 20]"]


def test_a_rank_that_does_not_tile_still_accounts_its_samples(schedule):
    mbis = copy.deepcopy(schedule.micro_batch_indices)
    mbis[0][0] = mbis[0][0][::-1]  # rank 0 holds sample 0: it is not lost, only its rank's tiling broke
    assert check_schedule(tamper(schedule, micro_batch_indices=mbis)) == [
        "rank 0: micro_batch_indices do not tile range(7) in order"] + STEPS_OFF
    both = copy.deepcopy(mbis)
    both[1][0] = both[1][0][::-1]
    report = check_schedule(tamper(schedule, micro_batch_indices=both))  # both ranks named, not only the first
    assert report[:2] == ["rank 0: micro_batch_indices do not tile range(7) in order",
                          "rank 1: micro_batch_indices do not tile range(8) in order"]
    parts = copy.deepcopy(schedule.partitions)
    parts[0][0] = 16  # a sample outside the rollout in a rank that does not tile: skipped, reported as lost
    assert check_schedule(tamper(schedule, partitions=parts, micro_batch_indices=mbis)) == [
        "rank 0: micro_batch_indices do not tile range(7) in order",
        "1 samples are neither scheduled nor reported dropped, e.g. [0]"] + STEPS_OFF


def test_micro_batch_problems_name_the_rank_and_the_step(schedule):
    mbis = copy.deepcopy(schedule.micro_batch_indices)
    mbis[0].append([])
    assert check_schedule(tamper(schedule, micro_batch_indices=mbis)) == [
        "rank 0 has 5 micro-batches, expected sum(num_microbatches) = 4", "rank 0: empty micro-batch"] + STEPS_OFF
    parts = copy.deepcopy(schedule.partitions)
    parts[0][0] = 16
    report = check_schedule(tamper(schedule, partitions=parts))
    assert report[:2] == ["rank 0 step 0: sample index outside [0, 16)",
                          "2 samples are neither scheduled nor reported dropped, e.g. [0, 7]"]
    many = copy.deepcopy(schedule.micro_batch_indices)
    many[0] += [[]] * 60
    assert len(check_schedule(tamper(schedule, micro_batch_indices=many))) == 50  # the default max_report
    assert len(check_schedule(tamper(schedule, micro_batch_indices=mbis), max_report=11)) == 11


def test_dropped_problems(schedule):
    assert check_schedule(tamper(schedule, dropped=[15, 15])) == ["dropped lists a sample twice"]
    scheduled = sorted(g for p in schedule.partitions for g in p)
    report = check_schedule(tamper(schedule, dropped=[15] + scheduled[:6]))
    assert report[0] == "6 samples are both dropped and scheduled, e.g. [0, 1, 2, 3, 4]"
    assert report[-1] == ("dropped holds samples of a rollout before the last scheduled one (only trailing rollouts "
                          "may drop)")


def test_valid_edges_are_not_reported():
    # one micro-batch per rank, static micro-batches exactly full, rollouts first seen out of id order
    one = plan_schedule(LENGTHS, ParallelConfig(dp_size=2),
                        BatchConfig(global_batch_size=12, use_dynamic_batch_size=True, max_tokens_per_gpu=10000))
    assert one.num_microbatches == [1] and check_schedule(one) == []
    full = plan_schedule(list(range(10, 22)), ParallelConfig(dp_size=2), BatchConfig(global_batch_size=12,
                                                                                     micro_batch_size=2))
    assert all(len(mb) == 2 for mbs in full.micro_batch_indices for mb in mbs) and check_schedule(full) == []
    partial = plan_schedule(list(range(10, 17)), ParallelConfig(dp_size=2), BatchConfig(global_batch_size=7,
                                                                                        micro_batch_size=2))
    assert [len(mb) for mbs in partial.micro_batch_indices for mb in mbs] == [2, 2, 2, 1]  # a last, partial one
    assert check_schedule(partial) == []
    ids = [5, 5, 3, 3, 9, 1, 1, 7, 0, 2, 4, 6, 8, 8, 10, 11]
    assert check_schedule(plan_schedule(LENGTHS, ParallelConfig(dp_size=2), DYNAMIC, rollout_ids=ids)) == []


def test_step_rules_of_the_batch_flags(schedule):
    batch = schedule.batch
    assert check_schedule(tamper(schedule, batch=dataclasses.replace(batch, global_batch_size=1))) == [
        "rollouts_per_step=[6, 6] but global_batch_size=1", "dropped holds a whole step's worth of rollouts"]
    assert check_schedule(tamper(schedule, batch=dataclasses.replace(batch, global_batch_size=2))) == [
        "rollouts_per_step=[6, 6] but global_batch_size=2"]  # one dropped rollout is less than a step of 2
    assert check_schedule(tamper(schedule, batch=dataclasses.replace(
        batch, use_dynamic_global_batch_size=True, global_batch_size=None))) == [
        "use_dynamic_global_batch_size plans one step, not 2"]
    assert check_schedule(tamper(schedule, batch=dataclasses.replace(batch, disable_rollout_trim_samples=True))) == [
        "disable_rollout_trim_samples is set but samples were dropped"]
    assert check_schedule(tamper(schedule, num_microbatches=[], samples_per_step=[], rollouts_per_step=[], stats=[],
                                 loss_tokens_per_step=[], step_samples=[]))[0] == "the schedule has no steps"


def test_the_v024_budget_of_a_dynamic_step():
    dynamic = BatchConfig(global_batch_size=None, use_dynamic_global_batch_size=True, use_dynamic_batch_size=True,
                          max_tokens_per_gpu=100)
    kept_all = plan_schedule(LENGTHS[:9], ParallelConfig(dp_size=2), dynamic)
    assert kept_all.num_steps == 1 and kept_all.dropped == [] and check_schedule(kept_all) == []
    rounds = dataclasses.replace(dynamic, dynamic_global_batch_rounds_samples=True)
    assert check_schedule(tamper(kept_all, batch=rounds)) == [
        "use_dynamic_global_batch_size (slime v0.2.4's rule) keeps at most 8 samples (the sample count rounded down "
        "to a multiple of dp_size), not 9"]
    at_budget = plan_schedule(LENGTHS[:9], ParallelConfig(dp_size=2), rounds)  # exactly 8 kept: valid
    assert len(at_budget.dropped) == 1 and check_schedule(at_budget) == []
    lifted = dataclasses.replace(rounds, disable_rollout_trim_samples=True)  # the rule is lifted: 9 is fine
    assert check_schedule(tamper(kept_all, batch=lifted)) == []


def test_pipeline_stats_are_checked_to_a_relative_millionth():
    pp = plan_schedule(LENGTHS, ParallelConfig(dp_size=2, pp_size=2), DYNAMIC, rollout_ids=IDS)
    st = pp.stats[0]
    nudged = st.bubble_fraction * (1 + 2e-6)  # 0.18 off by about 4e-7: above a millionth of itself
    assert check_schedule(tamper(pp, stats=[dataclasses.replace(st, bubble_fraction=nudged)] + pp.stats[1:])) == [
        f"stats[0].bubble_fraction = {nudged!r} but the schedule predicts {st.bubble_fraction!r}"]
    close = st.bubble_fraction * (1 + 5e-7)
    assert check_schedule(tamper(pp, stats=[dataclasses.replace(st, bubble_fraction=close)] + pp.stats[1:])) == []
    for missing in ("predicted_makespan", "bubble_fraction"):
        assert check_schedule(tamper(pp, stats=[dataclasses.replace(st, **{missing: None})] + pp.stats[1:])) == [
            "stats[0] has no predicted_makespan/bubble_fraction but pp_size = 2"]


def test_check_schedule_compares_the_given_inputs(schedule):
    assert check_schedule(schedule, total_lengths=LENGTHS) == []
    assert check_schedule(schedule, total_lengths=LENGTHS[:-1] + [1], rollout_ids=IDS[:-1] + [99]) == [
        "total_lengths recorded in the schedule differ from the input lengths",
        "rollout_ids recorded in the schedule differ from the input rollout ids"]


def test_equal_inputs_short_step_lists_and_the_alignment_report(schedule):
    assert check_schedule(schedule, total_lengths=LENGTHS, rollout_ids=IDS) == []
    assert check_schedule(tamper(schedule, loss_tokens=None)) == []  # no per-sample loss tokens to re-add
    assert check_schedule(tamper(schedule, parallel=ParallelConfig(dp_size=2, vpp_size=2,
                                                                   microbatch_group_size_per_vp_stage=3))) == [
        f"step {s}: num_microbatches=2 per rank; total 4 is not a positive multiple of align=6" for s in (0, 1)]
    assert check_schedule(tamper(schedule, samples_per_step=[8], rollouts_per_step=[6], loss_tokens_per_step=[8])) \
        == [f"{name} has 1 entries for 2 steps" for name in ("samples_per_step", "rollouts_per_step",
                                                             "loss_tokens_per_step")]


def test_a_static_micro_batch_beyond_micro_batch_size_is_reported():
    full = plan_schedule(list(range(10, 22)), ParallelConfig(dp_size=2), BatchConfig(global_batch_size=12,
                                                                                     micro_batch_size=2))
    assert full.micro_batch_indices[0] == [[0, 1], [2, 3], [4, 5]]
    three = copy.deepcopy(full.micro_batch_indices)
    three[0] = [[0, 1, 2], [3], [4, 5]]  # still tiles rank 0, with as many micro-batches
    assert check_schedule(tamper(full, micro_batch_indices=three)) == [
        "rank 0 step 0: static micro-batch of 3 samples > micro_batch_size 2"]


def test_more_than_five_lost_samples_show_five(schedule):
    parts = copy.deepcopy(schedule.partitions)
    parts[0] = [16 + i for i in range(len(parts[0]))]  # all 7 of rank 0's samples point outside: each is lost
    assert "7 samples are neither scheduled nor reported dropped, e.g. [0, 3, 5, 7, 8]" in check_schedule(
        tamper(schedule, partitions=parts))


def test_a_split_rollout_is_found_after_samples_of_no_step(schedule):
    mbis = copy.deepcopy(schedule.micro_batch_indices)
    mbis[0][0] = mbis[0][0][::-1]  # rank 0's samples are accounted first, for no step
    parts = copy.deepcopy(schedule.partitions)
    assert parts[1][1] == 6 and parts[1][5] == 13 and IDS[12] == IDS[13] == 10  # rollout 10: samples 12, 13
    parts[1][1], parts[1][5] = parts[1][5], parts[1][1]  # rank 1: sample 13 into step 0, its rollout's 12 in step 1
    assert "rollout 10 is split across steps 0 and 1" in check_schedule(
        tamper(schedule, partitions=parts, micro_batch_indices=mbis))


def test_part_of_the_last_scheduled_rollout_dropped(schedule):
    ids = list(IDS)
    ids[15] = 11  # the dropped sample 15 now belongs to rollout 11, the last one scheduled
    assert check_schedule(tamper(schedule, rollout_ids=ids)) == [
        "rollout 11 is partly dropped and partly scheduled",
        "dropped holds samples of a rollout before the last scheduled one (only trailing rollouts may drop)"]


def test_the_v024_budget_names_the_kept_count_while_dropping():
    rounds = BatchConfig(global_batch_size=None, use_dynamic_global_batch_size=True, use_dynamic_batch_size=True,
                         max_tokens_per_gpu=100, dynamic_global_batch_rounds_samples=True)
    s = plan_schedule(LENGTHS[:11], ParallelConfig(dp_size=3), rounds)  # 11 samples: 9 kept, 2 dropped
    assert len(s.dropped) == 2 and check_schedule(s) == []
    g = min(s.dropped)
    parts, mbis = copy.deepcopy(s.partitions), copy.deepcopy(s.micro_batch_indices)
    parts[0].append(g)  # one dropped sample scheduled: 10 kept, 1 still dropped
    mbis[0][-1].append(len(parts[0]) - 1)
    report = check_schedule(tamper(s, partitions=parts, micro_batch_indices=mbis, dropped=[max(s.dropped)]))
    assert ("use_dynamic_global_batch_size (slime v0.2.4's rule) keeps at most 9 samples (the sample count rounded "
            "down to a multiple of dp_size), not 10") in report


def test_step_samples_of_another_length(schedule):
    assert check_schedule(tamper(schedule, step_samples=schedule.step_samples[:1])) == [
        "step_samples has 1 entries for 2 steps"]


def test_recorded_rollout_ids_of_another_length_are_a_recorded_input_problem(schedule):
    # the recorded inputs are checked first (input_problem), so check_schedule's own count of rollout_ids per sample
    # is a backstop no schedule reaches
    assert check_schedule(tamper(schedule, rollout_ids=IDS[:-1])) == [
        "recorded input: rollout_ids has 15 entries but total_lengths has 16; give exactly one per sample"]


def test_fields_of_the_wrong_type_are_refused_by_name(schedule):
    assert check_schedule("a schedule") == ["not a DPSchedule: str"]
    wrong = ("parallel, batch, stats or cost_model is not a ParallelConfig, BatchConfig, list of StepStats, "
             "CostModel or CostProfile")
    for change in (dict(parallel=schedule.parallel.to_dict()), dict(batch=schedule.batch.to_dict()),
                   dict(stats=tuple(schedule.stats)), dict(stats=[dataclasses.asdict(schedule.stats[0])]),
                   dict(cost_model={"hidden_size": 64})):
        assert check_schedule(tamper(schedule, **change)) == [wrong], change


def test_a_cost_model_edited_in_memory_is_checked_as_recorded(schedule):
    from slime_ext.schedule import CostModel
    model = CostModel(hidden_size=64, num_layers=4, num_attention_heads=4)
    object.__setattr__(model, "hidden_size", -1)  # past the frozen dataclass's own check
    report = check_schedule(tamper(schedule, cost_model=model))
    assert len(report) == 1 and report[0].startswith("recorded input: ") and "hidden_size" in report[0]


def test_a_step_the_pipeline_model_refuses_is_reported():
    from slime_ext.schedule import CostModel
    parallel = ParallelConfig(dp_size=2, pp_size=2, decoder_first_pipeline_num_layers=1)
    pp = plan_schedule(LENGTHS, parallel, DYNAMIC, rollout_ids=IDS,
                       cost_model=CostModel(hidden_size=64, num_layers=4, num_attention_heads=4))
    assert check_schedule(pp) == []
    one_layer = CostModel(hidden_size=64, num_layers=1, num_attention_heads=4)  # no layer left for the last stage
    refusals = [p for p in check_schedule(tamper(pp, cost_model=one_layer)) if "refuses" in p]
    assert refusals == [f"step {s}: the pipeline model refuses the step: decoder_first/last_pipeline_num_layers = "
                        f"1/None with num_layers = 1 leave 0 layers for 1 middle pipeline ranks (Megatron refuses "
                        f"it); the first, last and middle layers must add up to num_layers" for s in (0, 1)]
