"""``DPSchedule``'s record: ``to_dict`` / ``from_dict`` keep every field (with and without the optional ones) under
its own name, and ``rank_payload`` hands a rank exactly its slice."""

from __future__ import annotations

import json

import pytest

from slime_ext.schedule import (BatchConfig, CostModel, DPSchedule, ParallelConfig, SampleBatch, ScheduleError,
                                plan_schedule)

LENGTHS = [60, 50, 40, 40, 30, 30, 20, 10, 10, 10, 70, 80, 5, 5, 90, 15]
IDS = [0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 10, 11, 12]
BATCH = BatchConfig(global_batch_size=6, use_dynamic_batch_size=True, max_tokens_per_gpu=100)
MODEL = CostModel(hidden_size=64, num_layers=2, num_attention_heads=4, vocab_size=500)


@pytest.mark.parametrize("optional", [True, False])
def test_to_dict_names_every_field_and_from_dict_reads_it_back(optional):
    extra = dict(rollout_ids=IDS, loss_tokens=[1] * 16, cost_model=MODEL) if optional else {}
    s = plan_schedule(LENGTHS, ParallelConfig(dp_size=2), BATCH, **extra)
    d = json.loads(json.dumps(s.to_dict()))
    assert d["rollout_ids"] == (IDS if optional else None)
    assert d["loss_tokens"] == ([1] * 16 if optional else None)
    assert d["loss_tokens_per_step"] == ([8, 7] if optional else None)
    assert d["cost_model"] == (MODEL.to_dict() if optional else None)
    assert d["step_samples"] == [sorted(x) for x in s.step_samples] and d["total_lengths"] == LENGTHS
    assert d["partitions"] == s.partitions and d["micro_batch_indices"] == s.micro_batch_indices
    assert (d["num_microbatches"], d["samples_per_step"], d["rollouts_per_step"], d["dropped"]) == \
        (s.num_microbatches, s.samples_per_step, s.rollouts_per_step, s.dropped)
    back = DPSchedule.from_dict(d)
    assert back == s and back.to_dict() == d
    d["partitions"][0].append(99)  # a fresh copy: editing the dict leaves the schedule as it was
    assert s.partitions[0][-1] != 99


def test_rank_payload_is_the_ranks_slice():
    s = plan_schedule(LENGTHS, ParallelConfig(dp_size=2), BATCH, rollout_ids=IDS, loss_tokens=[1] * 16)
    samples = SampleBatch(tokens=[[1] * n for n in LENGTHS], total_lengths=LENGTHS, response_lengths=[1] * 16,
                          loss_masks=[[1]] * 16, rewards=[0.0] * 16, advantages=[0.0] * 16, rollout_ids=IDS)
    for rank in (0, 1):
        p = s.rank_payload(rank, samples)
        assert (p.rollout_id, p.dp_rank, p.dp_size, p.partition) == (0, rank, 2, s.partitions[rank])
        assert p.samples.total_lengths == [LENGTHS[g] for g in s.partitions[rank]]
        assert p.micro_batch_indices == s.micro_batch_indices[rank] and p.num_microbatches == s.num_microbatches
        assert (p.samples_per_step, p.rollouts_per_step, p.loss_tokens_per_step) == \
            (s.samples_per_step, s.rollouts_per_step, s.loss_tokens_per_step)
    assert s.rank_payload(1, samples, rollout_id=7).rollout_id == 7
    assert plan_schedule(LENGTHS, ParallelConfig(dp_size=2), BATCH).rank_payload(0, samples).loss_tokens_per_step \
        is None
    with pytest.raises(ScheduleError, match=r"^rank=2 is outside \[0, dp_size=2\)$"):
        s.rank_payload(2, samples)
    with pytest.raises(ScheduleError, match=r"^rank=-1 is outside"):
        s.rank_payload(-1, samples)
    with pytest.raises(ScheduleError, match=r"^samples has 15 entries but the schedule was planned for 16; pass the "
                                            r"whole rollout's SampleBatch$"):
        s.rank_payload(0, samples.take(range(15)))


BIG = 2**70
PATHS = [("total_lengths", 0), ("rollout_ids", 0), ("loss_tokens", 0), ("partitions", 0, 0),
         ("micro_batch_indices", 0, 0, 0), ("num_microbatches", 0), ("samples_per_step", 0), ("rollouts_per_step", 0),
         ("dropped", 0), ("loss_tokens_per_step", 0), ("step_samples", 0, 0), ("stats", 0, "total_microbatches")]


def _refusal(edit) -> str:
    s = plan_schedule(LENGTHS, ParallelConfig(dp_size=2), BATCH, rollout_ids=IDS, loss_tokens=[1] * 16,
                      cost_model=MODEL)
    d = json.loads(json.dumps(s.to_dict()))
    edit(d)
    with pytest.raises(ScheduleError) as e:
        DPSchedule.from_dict(d)
    return str(e.value)


def _set(path, value):
    def edit(d):
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
    return edit


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p[0])
def test_from_dict_names_the_entry_out_of_int64(path):
    where = path[0] + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path[1:])
    assert _refusal(_set(path, BIG)).startswith(f"malformed schedule dict: {where} = {BIG} is above the limit "
                                                f"2**63 - 1 (int64)")


@pytest.mark.parametrize("field, what", [("total_lengths", "integer token counts"), ("rollout_ids", "integer ids"),
                                         ("loss_tokens", "integer token counts")])
def test_from_dict_says_what_a_list_holds(field, what):
    assert f"{field}[0] = 2.5 is not an integer (float); {field} must hold {what}" in _refusal(_set((field, 0), 2.5))


def test_from_dict_names_the_mapping_and_the_stats():
    assert _refusal(_set(("batch", "nope"), 1)).startswith("malformed schedule dict: batch has unknown keys ['nope']")
    assert _refusal(_set(("cost_model", "nope"), 1)).startswith(
        "malformed schedule dict: cost_model has unknown keys ['nope']")
    assert _refusal(_set(("stats",), 3)).startswith("malformed schedule dict: stats must be a list, got 3")
    assert _refusal(_set(("stats", 0, "strategy"), 3)).startswith(
        "malformed schedule dict: stats[0].strategy must be a string, got 3")
    assert "CostModel.hidden_size" in _refusal(_set(("cost_model", "hidden_size"), BIG))


@pytest.mark.parametrize("path", [p for p in PATHS if p[0] not in ("total_lengths", "loss_tokens")],
                         ids=lambda p: p[0])
def test_from_dict_leaves_a_negative_index_to_the_checker(path):
    """Indices and counts are read as any int64 (negative too): whether they make a schedule is check_schedule's
    question, asked with the schedule in hand."""
    s = plan_schedule(LENGTHS, ParallelConfig(dp_size=2), BATCH, rollout_ids=IDS, loss_tokens=[1] * 16)
    d = json.loads(json.dumps(s.to_dict()))
    _set(path, -1)(d)
    DPSchedule.from_dict(d)


def test_from_dict_reads_old_records_and_profiles():
    from slime_ext.schedule import CostProfile
    profile = CostProfile(step_overhead_s=0.01, microbatch_overhead_s=0.004, per_token_s=2e-6,
                          per_sample_quadratic_s=1e-10)
    s = plan_schedule(LENGTHS, ParallelConfig(dp_size=2), BATCH, cost_model=profile)
    d = json.loads(json.dumps(s.to_dict()))
    assert DPSchedule.from_dict(d).cost_model == profile
    del d["step_samples"]  # written before step_samples existed
    assert DPSchedule.from_dict(d).step_samples == []
    del d["cost_model"]["per_token_s"]
    with pytest.raises(ScheduleError, match=r"the schedule's cost_model is missing \['per_token_s'\]"):
        DPSchedule.from_dict(d)


def test_from_dict_checks_each_stats_entry_by_its_declared_type():
    s = plan_schedule(LENGTHS, ParallelConfig(dp_size=2), BATCH)
    base = json.loads(json.dumps(s.to_dict()))

    def refusal(edit):
        d = json.loads(json.dumps(base))
        edit(d["stats"][0])
        with pytest.raises(ScheduleError) as e:
            DPSchedule.from_dict(d)
        return str(e.value)

    assert refusal(lambda st: st.pop("step")).startswith("malformed schedule dict: stats[0] is missing ['step']")
    assert "stats[0].rank_cost_max" in refusal(lambda st: st.update(rank_cost_max="x"))
    assert "stats[0].cap" in refusal(lambda st: st.update(cap="x"))
    optional = json.loads(json.dumps(base))
    del optional["stats"][0]["predicted_makespan"]  # written before the pipeline fields existed
    assert DPSchedule.from_dict(optional) == s
    with pytest.raises(ScheduleError, match=r"^a schedule must be a JSON object written by DPSchedule.to_dict, got "
                                            r"int$"):
        DPSchedule.from_dict(3)
    old = dict(json.loads(json.dumps(base)), schema_version=2, stats=[3, 4])
    with pytest.raises(ScheduleError, match="stats"):
        DPSchedule.from_dict(old)
