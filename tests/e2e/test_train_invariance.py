"""Training through the schedule equals single-process training on the same samples (real megatron-core, gloo).

One launch per parallel layout runs every scenario of that layout in the same processes (``TrainWorker.reset``
between scenarios) next to one single-process reference job; each test then checks, per scenario:

* invariance -- parameters after the step(s) equal the reference's within 1e-5 relative, and the update itself
  (params - initial params) matches; DP replicas and tied-embedding copies agree exactly;
* ledger -- each rank consumed exactly the micro-batches its schedule slice names, in order, and the ranks
  together consumed every kept sample of the step once; all ranks ran the same ``num_microbatches``;
* forward-only -- the log-probs equal the reference's per-sample log-probs of the initial model;
* LR -- the scheduler's sample counter and LR follow the true sample counts (``samples_per_step``), which differ
  from the configured ``global_batch_size`` here; the legacy path steps by ``global_batch_size``.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from train_harness import (CAP, MODEL, OPTIM, assert_params_match, group_job, launch, legacy_payloads,
                           legacy_step_samples, make_samples, merged_params, plan, reference_job, rendezvous,
                           rollout_payloads)

from slime_ext.schemes import ForwardResult, LegacyStepRecord, RolloutStepRecord

pytestmark = pytest.mark.e2e

REFERENCE_CONFIG = {**MODEL, **OPTIM}
DYNAMIC = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=CAP)
# the LR scenario: warmup then linear decay, counted in samples
LR_SCHEDULE = dict(lr_decay_style="linear", lr_warmup_samples=8, lr_decay_samples=64, lr=0.4, min_lr=0.01)


# ---------------------------------------------------------------------------------------------------- scenarios
class Scenario:
    """What the group runs (``job``), what the reference runs (``reference``) and what the checks need."""

    def __init__(self, name, samples_list, changes, job_rollouts, reference_steps, schedules=None,
                 forward_only=False):
        self.name, self.schedules = name, schedules
        self.job = {"name": name, "changes": changes, "rollouts": job_rollouts, "forward_only": forward_only}
        self.reference = {"name": name, "changes": {k: v for k, v in changes.items() if k in OPTIM or "lr" in k},
                          "samples": samples_list, "reference_steps": reference_steps,
                          "forward_only": list(range(len(samples_list[0]))) if forward_only else None}


def rollout_scenario(name, samples_list, batch, parallel, world_size, forward_only=False, pipeline_aware=True):
    changes = {"dp_schedule": "rollout", **batch}
    schedules = [plan(samples, {**REFERENCE_CONFIG, **parallel, **changes}, world_size, pipeline_aware=pipeline_aware)
                 for samples in samples_list]
    steps = [(r, sch.step_samples[s], sch.samples_per_step[s])
             for r, sch in enumerate(schedules) for s in range(sch.num_steps)]
    return Scenario(name, samples_list, changes, [rollout_payloads(sm, sch) for sm, sch in zip(samples_list, schedules)],
                    steps, schedules=schedules, forward_only=forward_only)


def legacy_scenario(name, samples_list, batch, dp_size):
    changes = {"dp_schedule": "legacy", **batch}
    payloads = [legacy_payloads(samples, dp_size, batch["global_batch_size"]) for samples in samples_list]
    steps = [(r, ids, batch["global_batch_size"])
             for r, p in enumerate(payloads) for ids in legacy_step_samples(p, batch["global_batch_size"])]
    return Scenario(name, samples_list, changes, payloads, steps)


def run_layout(parallel: dict, world_size: int, scenarios: list[Scenario], timeout: float = 240.0):
    config = {**REFERENCE_CONFIG, **parallel, "dist_timeout_seconds": 30}
    start = time.perf_counter()
    with rendezvous() as port:
        jobs = [(group_job, (rank, world_size, port, config, [s.job for s in scenarios]))
                for rank in range(world_size)]
        jobs.append((reference_job, (REFERENCE_CONFIG, [s.reference for s in scenarios])))
        *group, reference = launch(jobs, timeout=timeout)
    print(f"\n{parallel} x{world_size}: {len(scenarios)} scenarios in {time.perf_counter() - start:.1f}s")
    return group, reference


# ---------------------------------------------------------------------------------------------------- checks
def check_invariance(group, reference, sc: Scenario) -> None:
    errors = assert_params_match(merged_params(group, sc.name), reference["scenarios"][sc.name]["params"],
                                 reference["initial"], label=sc.name)
    print(f"  {sc.name}: param rel err {errors['param_rel']:.1e}, update rel err {errors['update_rel']:.1e}")


def check_ledger(group, sc: Scenario) -> None:
    """Each rank ran its schedule slice exactly; together the ranks ran every kept sample once per step."""
    for r_idx, schedule in enumerate(sc.schedules):
        per_rank = {}
        for rank_result in group:
            dp_rank = rank_result["layout"]["dp_rank"]
            records = rank_result["scenarios"][sc.name]["records"][r_idx]
            assert [rec.num_microbatches for rec in records] == schedule.num_microbatches, sc.name
            assert all(type(rec) is RolloutStepRecord for rec in records), sc.name
            assert [rec.rollouts for rec in records] == schedule.rollouts_per_step, sc.name
            per_rank.setdefault(dp_rank, [rec.ledger for rec in records])
            assert per_rank[dp_rank] == [rec.ledger for rec in records], f"{sc.name}: PP stages disagree"
        for dp_rank, ledgers in per_rank.items():
            part, mbi = schedule.partitions[dp_rank], schedule.micro_batch_indices[dp_rank]
            expected = [[part[i] for i in mb] for mb in mbi]
            assert [mb for step in ledgers for mb in step] == expected, f"{sc.name}: rank {dp_rank} ledger"
        for s, step_samples in enumerate(schedule.step_samples):
            consumed = sorted(i for ledgers in per_rank.values() for mb in ledgers[s] for i in mb)
            assert consumed == sorted(step_samples), f"{sc.name}: step {s} did not consume its samples exactly once"
        kept = sorted(i for st in schedule.step_samples for i in st)
        assert sorted(kept + list(schedule.dropped)) == list(range(len(schedule.total_lengths)))


def check_forward_only(group, reference, sc: Scenario) -> None:
    ref = reference["scenarios"][sc.name]["log_probs"]
    seen = 0
    for rank_result in group:
        out = rank_result["scenarios"][sc.name]["forward_only"]
        assert type(out) is ForwardResult, type(out)
        if out.log_probs is None:
            continue
        for sid, lp in zip(out.sample_indices, out.log_probs):
            np.testing.assert_allclose(lp, ref[sid], rtol=1e-5, atol=1e-5, err_msg=f"{sc.name}: sample {sid}")
            seen += 1
    assert seen == len(ref), f"{sc.name}: forward-only returned {seen} of {len(ref)} samples"


def check_scenarios(group, reference, scenarios: list[Scenario], parallel: dict) -> None:
    """Invariance and the ledger for every scenario; forward-only for the first (the one that runs it)."""
    for sc in scenarios:
        check_invariance(group, reference, sc)
        if sc.schedules is not None:
            check_ledger(group, sc)
        else:
            check_legacy_ledger(group, sc, parallel)
    check_forward_only(group, reference, scenarios[0])


def expected_lr(samples_seen: int) -> float:
    """Megatron's linear warmup + linear decay, written out (LR_SCHEDULE)."""
    lr, min_lr = LR_SCHEDULE["lr"], LR_SCHEDULE["min_lr"]
    warmup, decay = LR_SCHEDULE["lr_warmup_samples"], LR_SCHEDULE["lr_decay_samples"]
    if samples_seen <= warmup:
        return lr * samples_seen / warmup
    if samples_seen > decay:
        return min_lr
    return min_lr + (lr - min_lr) * (1 - (samples_seen - warmup) / (decay - warmup))


# ---------------------------------------------------------------------------------------------------- layouts
def test_dp2_invariance_ledger_lr_forward_only():
    dp = 2
    parallel: dict = {}
    mixed = [make_samples(10, seed=1)]  # 10 rollouts, some with several samples
    single = [make_samples(8, seed=2, multi_every=0)]  # 8 one-sample rollouts: static batches align
    lr_rollouts = [make_samples(8, seed=3), make_samples(12, seed=4)]  # gbs=4 rollouts: 2 + 3 steps, uneven
    lr_batch = dict(DYNAMIC, global_batch_size=4, balance_data=True, **LR_SCHEDULE)
    scenarios = [
        rollout_scenario("dynamic_strided", mixed, dict(DYNAMIC, use_dynamic_global_batch_size=True), parallel, dp,
                         forward_only=True),
        rollout_scenario("dynamic_balanced", mixed,
                         dict(DYNAMIC, use_dynamic_global_batch_size=True, balance_data=True), parallel, dp),
        rollout_scenario("dynamic_balanced_by_flops", mixed, dict(DYNAMIC, use_dynamic_global_batch_size=True,
                                                                  balance_data=True, balance_by_flops=True),
                         parallel, dp),
        rollout_scenario("static_strided", single, dict(micro_batch_size=2, global_batch_size=8), parallel, dp),
        rollout_scenario("static_balanced", single, dict(micro_batch_size=2, global_batch_size=8, balance_data=True),
                         parallel, dp),
        legacy_scenario("legacy_dynamic", single, dict(DYNAMIC, global_batch_size=8), dp),
        legacy_scenario("legacy_static", single, dict(micro_batch_size=2, global_batch_size=8), dp),
        rollout_scenario("lr_uneven_steps", lr_rollouts, lr_batch, parallel, dp),
        legacy_scenario("lr_legacy", [make_samples(12, seed=5, multi_every=0)],
                        dict(DYNAMIC, global_batch_size=4, **LR_SCHEDULE), dp),
    ]
    group, reference = run_layout(parallel, dp, scenarios)
    check_scenarios(group, reference, scenarios, parallel)

    # LR: stepped by the samples each step really trained on
    lr_sc = scenarios[-2]
    true_samples = [n for sch in lr_sc.schedules for n in sch.samples_per_step]
    assert len(set(true_samples)) > 1 and true_samples != [4] * len(true_samples), true_samples
    records = [rec for recs in group[0]["scenarios"][lr_sc.name]["records"] for rec in recs]
    assert [rec.lr_increment for rec in records] == true_samples
    seen_before = [sum(true_samples[:k]) for k in range(len(true_samples))]
    assert [rec.lr for rec in records] == pytest.approx([expected_lr(n) for n in seen_before], rel=1e-12)
    state = group[0]["scenarios"][lr_sc.name]["scheduler"]
    assert state["samples"] == sum(true_samples)
    assert state["lr"] == pytest.approx(expected_lr(sum(true_samples)), rel=1e-12)
    assert state == reference["scenarios"][lr_sc.name]["scheduler"]
    # stepping by the configured global_batch_size (4 per step) would have counted other samples and another LR
    by_gbs = 4 * len(true_samples)
    assert by_gbs != sum(true_samples) and not math.isclose(expected_lr(by_gbs), state["lr"])
    # the legacy baseline does step by global_batch_size
    legacy = group[0]["scenarios"]["lr_legacy"]
    legacy_steps = [rec for recs in legacy["records"] for rec in recs]
    assert [rec.lr_increment for rec in legacy_steps] == [4] * len(legacy_steps)
    assert legacy["scheduler"]["samples"] == 4 * len(legacy_steps)


def agreed_legacy_count(local_counts: list[int], parallel: dict) -> int:
    """The count every legacy rank runs: the DP group's MAX of the local ones; under VPP rounded down to a whole
    ``microbatch_group_size_per_vp_stage`` (default: the pipeline size), at least 1."""
    peak = max(local_counts)
    if (parallel.get("virtual_pipeline_model_parallel_size") or 1) <= 1:
        return peak
    vp_group = parallel.get("microbatch_group_size_per_vp_stage") or parallel.get("pipeline_model_parallel_size", 1)
    return max(1, peak // vp_group * vp_group)


def check_legacy_ledger(group, sc: Scenario, parallel: dict) -> None:
    """The legacy path also trains every sample of a step exactly once (its micro-batches are its own)."""
    steps = [ids for _, ids, _ in sc.reference["reference_steps"]]
    by_dp: dict = {}
    for rank_result in group:
        records = [rec for recs in rank_result["scenarios"][sc.name]["records"] for rec in recs]
        by_dp.setdefault(rank_result["layout"]["dp_rank"], records)
    for s, ids in enumerate(steps):
        consumed = sorted(i for records in by_dp.values() for mb in records[s].ledger for i in mb)
        assert consumed == sorted(ids), f"{sc.name}: legacy step {s}"
        counts = {records[s].num_microbatches for records in by_dp.values()}
        assert len(counts) == 1, f"{sc.name}: legacy ranks disagree on num_microbatches {counts}"
        assert all(type(records[s]) is LegacyStepRecord for records in by_dp.values()), sc.name
        local = [records[s].local_microbatches for records in by_dp.values()]
        assert counts.pop() == agreed_legacy_count(local, parallel), f"{sc.name}: step {s}, local counts {local}"


def _pipeline_scenarios(parallel: dict, world_size: int, dp: int) -> list[Scenario]:
    mixed = [make_samples(10, seed=6)]
    single = [make_samples(8, seed=7, multi_every=0)]
    varied = [make_samples(16, seed=8, multi_every=0)]
    return [
        rollout_scenario("dynamic_balanced", mixed,
                         dict(DYNAMIC, use_dynamic_global_batch_size=True, balance_data=True), parallel, world_size,
                         forward_only=True),
        rollout_scenario("dynamic_strided", mixed, dict(DYNAMIC, use_dynamic_global_batch_size=True), parallel,
                         world_size),
        rollout_scenario("static_balanced", single, dict(micro_batch_size=1, global_batch_size=8, balance_data=True),
                         parallel, world_size),
        # few micro-batches: with PP=2 x VPP=2, stage 0 runs them all as warmup while stage 1 already runs 1F1B
        # (the case that needs asynchronous p2p sends on gloo, patches.megatron_cpu)
        rollout_scenario("static_few_microbatches", single, dict(micro_batch_size=8 // (2 * dp), global_batch_size=8),
                         parallel, world_size),
        legacy_scenario("legacy_dynamic", single, dict(DYNAMIC, global_batch_size=8), dp),
        legacy_scenario("legacy_static", single, dict(micro_batch_size=1, global_batch_size=8), dp),
        # the same samples planned for the pipeline (order and count by the pipeline model) and without it
        rollout_scenario("pipeline_aware", varied, dict(DYNAMIC, global_batch_size=16, balance_data=True), parallel,
                         world_size),
        rollout_scenario("unordered", varied, dict(DYNAMIC, global_batch_size=16, balance_data=True), parallel,
                         world_size, pipeline_aware=False),
    ]


@pytest.mark.parametrize("parallel, world_size, dp", [
    pytest.param(dict(pipeline_model_parallel_size=2), 4, 2, id="dp2_pp2"),
    pytest.param(dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 2, 1,
                 id="pp2_vpp2"),
])
def test_pipeline_invariance_ledger_forward_only(parallel, world_size, dp):
    scenarios = _pipeline_scenarios(parallel, world_size, dp)
    group, reference = run_layout(parallel, world_size, scenarios)
    assert sorted((r["layout"]["dp_rank"], r["layout"]["pp_rank"]) for r in group) == \
        sorted((d, p) for d in range(dp) for p in range(2))
    check_scenarios(group, reference, scenarios, parallel)
    check_pipeline_aware_matches_unordered(group, reference, scenarios)
    # the gloo p2p regression case: as many micro-batches as stages (static batches keep their count)
    few = next(sc for sc in scenarios if sc.name == "static_few_microbatches")
    assert few.schedules[0].num_microbatches == [2], few.schedules[0].num_microbatches


def check_pipeline_aware_matches_unordered(group, reference, scenarios: list[Scenario]) -> None:
    """The pipeline-aware plan runs other micro-batches, or the same in another order, than the unordered plan of
    the same samples, and trains to the same parameters (1e-5): the step's gradient is a sum over its samples."""
    by_name = {sc.name: sc for sc in scenarios}
    aware, unordered = by_name["pipeline_aware"].schedules, by_name["unordered"].schedules
    def runs(sch):  # per DP rank, its micro-batches (global sample ids) in run order
        return [[[sch.partitions[r][i] for i in mb] for mb in sch.micro_batch_indices[r]] for r in range(sch.dp_size)]

    assert runs(aware[0]) != runs(unordered[0]), \
        "the pipeline-aware plan equals the unordered one: the scenario tests nothing"
    errors = assert_params_match(merged_params(group, "pipeline_aware"), merged_params(group, "unordered"),
                                 reference["initial"], label="pipeline_aware vs unordered")
    print(f"  pipeline_aware vs unordered: param rel err {errors['param_rel']:.1e}")
