"""The ledger checker finds every kind of violation (so an empty report in the e2e tests means something)."""

from __future__ import annotations

import copy
import pickle
from dataclasses import replace
from itertools import accumulate
from types import SimpleNamespace

import pytest

from slime_ext.rollout.dispatch import plan_rollout
from slime_ext.rollout.ledger import check_ledger
from slime_ext.rollout.synthetic import SYNTHETIC_DEFAULTS, generate_rollout
from slime_ext.rollout.train_data import flatten_samples, samples_to_train_data
from slime_ext.schemes import PlanInfo, RankResult, RecordError, StepRecord


def _args(dp_schedule="rollout") -> SimpleNamespace:
    return SimpleNamespace(**SYNTHETIC_DEFAULTS, rollout_batch_size=6, n_samples_per_prompt=2, rollout_seed=1,
                           global_batch_size=6, use_dynamic_batch_size=True,
                           max_tokens_per_gpu=96, micro_batch_size=1, balance_data=True, dp_schedule=dp_schedule,
                           num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=128)


def _train_data():
    return samples_to_train_data(flatten_samples(generate_rollout(_args(), 0)))


def _plan(dp_schedule="rollout") -> PlanInfo:
    args = _args(dp_schedule)
    data = _train_data()
    plan = plan_rollout(data, args, {"dp_size": 2, "cp_size": 1, "vpp_size": 1,
                                     "microbatch_group_size_per_vp_stage": 1})
    return PlanInfo(dp_schedule=plan.dp_schedule, rollout_id=0, num_samples=plan.num_samples,
                    partitions=plan.partitions, step_samples=plan.step_samples, dropped=plan.dropped,
                    dropped_reason=plan.dropped_reason, total_lengths=data.total_lengths,
                    rollout_ids=data.rollout_ids, loss_tokens=data.loss_tokens, schedule=plan.schedule)


def _record(step: int, num_microbatches: int, ledger: list[list[int]], samples: int) -> StepRecord:
    return StepRecord(step=step, loss=0.5, lr=1e-3, samples=samples, num_microbatches=num_microbatches,
                      seconds=0.1, ledger=ledger, loss_tokens=10, grad_norm=1.0, lr_increment=samples,
                      scheduler_samples=samples * (step + 1), update_successful=True)


def _exact_ranks(plan: PlanInfo, pp=1) -> list[RankResult]:
    """What correct train ranks report: the schedule's micro-batches (legacy: two micro-batches per step)."""
    ranks = []
    dp = len(plan.partitions)
    for p in range(pp):
        for d, part in enumerate(plan.partitions):
            records = []
            if plan.schedule is not None:
                nmb = plan.schedule.num_microbatches
                mbi = plan.schedule.micro_batch_indices[d]
                for s, end in enumerate(accumulate(nmb)):
                    ledger = [[part[i] for i in mb] for mb in mbi[end - nmb[s]:end]]
                    records.append(_record(s, nmb[s], ledger, len(plan.step_samples[s])))
            else:
                k = len(part) // plan.num_steps
                for s in range(plan.num_steps):
                    mine = part[s * k:(s + 1) * k]
                    records.append(_record(s, 2, [mine[::2], mine[1::2]], len(plan.step_samples[s])))
            ranks.append(RankResult(rank=p * dp + d, dp_rank=d, pp_rank=p, records=records, fetch_seconds=0.0))
    return ranks


@pytest.mark.parametrize("mode", ["rollout", "legacy"])
def test_exact_ledger_passes(mode):
    plan = _plan(mode)
    assert check_ledger(plan, _exact_ranks(plan)) == []
    assert check_ledger(plan, _exact_ranks(plan, pp=2)) == []


def test_records_pickle_as_through_ray():
    plan = _plan("rollout")
    ranks = _exact_ranks(plan, pp=2)
    again = pickle.loads(pickle.dumps((plan, ranks)))
    assert again[0].schedule.micro_batch_indices == plan.schedule.micro_batch_indices
    assert again[1] == ranks and check_ledger(*again) == []


def _corrupt(plan: PlanInfo, how) -> tuple[PlanInfo, list[RankResult]]:
    ranks = _exact_ranks(plan, pp=2)
    r0 = ranks[0].records
    if how == "moved_between_micro_batches":
        rank, mbs, k = next((r, rec.ledger, k) for r in ranks if r.pp_rank == 0 for rec in r.records
                            if len(rec.ledger) > 1 for k, mb in enumerate(rec.ledger) if len(mb) > 1)
        mbs[k - 1].append(mbs[k].pop())
        for i, r in enumerate(ranks):  # on every stage, so only the comparison with the schedule can see it
            if r.dp_rank == rank.dp_rank:
                ranks[i] = replace(r, records=copy.deepcopy(rank.records))
    elif how == "sample_lost":
        r0[0].ledger[0].pop()
    elif how == "sample_twice":
        r0[0].ledger[0].append(ranks[1].records[0].ledger[0][0])
    elif how == "counts_disagree":
        r0[0] = replace(r0[0], num_microbatches=r0[0].num_microbatches + 1)
    elif how == "stage_disagrees":
        ranks[2].records[0] = replace(ranks[2].records[0], ledger=copy.deepcopy(ranks[3].records[0].ledger))
    elif how == "wrong_sample_count":
        ranks[1].records[0] = replace(ranks[1].records[0], samples=ranks[1].records[0].samples - 1)
    elif how == "dropped_trained":
        plan = replace(plan, dropped=[plan.step_samples[0][0]], dropped_reason="a test says so")
    elif how == "lost_and_unreported":
        plan = replace(plan, num_samples=plan.num_samples + 1, total_lengths=plan.total_lengths + [5],
                       rollout_ids=plan.rollout_ids + [99], loss_tokens=plan.loss_tokens + [1])
    return plan, ranks


@pytest.mark.parametrize("how, message", [
    ("moved_between_micro_batches", "the schedule says"),
    ("sample_lost", "were not consumed"),
    ("sample_twice", "consumed more than once"),
    ("counts_disagree", "ran num_microbatches="),
    ("stage_disagrees", "consumed other micro-batches than pipeline stage 0"),
    ("wrong_sample_count", "reports"),
    ("dropped_trained", "reported dropped but were trained on"),
    ("lost_and_unreported", "neither trained on nor reported dropped"),
])
def test_each_violation_is_found(how, message):
    plan, ranks = _corrupt(_plan("rollout"), how)
    problems = check_ledger(plan, ranks)
    assert any(message in p for p in problems), problems


def test_legacy_sample_on_the_wrong_rank():
    plan = _plan("legacy")
    ranks = _exact_ranks(plan)
    a, b = ranks[0].records[0].ledger[0], ranks[1].records[0].ledger[0]
    a[0], b[0] = b[0], a[0]
    assert any("its share is" in p for p in check_ledger(plan, ranks))


@pytest.mark.parametrize("changes, message", [
    (dict(num_microbatches=0), r"StepRecord.num_microbatches=0: must be an integer >= 1"),
    (dict(samples=True), r"StepRecord.samples=True: must be an integer >= 1"),
    (dict(loss=1), r"StepRecord.loss=1: must be a float"),
    (dict(lr=-1.0), r"StepRecord.lr=-1.0: must be >= 0"),
    (dict(ledger=[[0, -1]]), r"StepRecord.ledger=.*list of micro-batches, each a list of non-negative integer"),
    (dict(update_successful=1), r"StepRecord.update_successful=1: must be True or False"),
])
def test_a_malformed_step_record_fails_where_it_is_made(changes, message):
    with pytest.raises(RecordError, match=message):
        replace(_record(0, 1, [[0]], 1), **changes)


def test_malformed_rank_results_and_plans_fail_where_they_are_made():
    rec = _record(0, 1, [[0]], 1)
    with pytest.raises(RecordError, match=r"RankResult.records=\[1, 0\]: must hold steps 0, 1, ... in order"):
        RankResult(rank=0, dp_rank=0, pp_rank=0, records=[replace(rec, step=1), rec], fetch_seconds=0.0)
    with pytest.raises(RecordError, match="RankResult.records=.*must be a list of StepRecord"):
        RankResult(rank=0, dp_rank=0, pp_rank=0, records=[{"step": 0}], fetch_seconds=0.0)
    plan = _plan("legacy")
    with pytest.raises(RecordError, match=r"PlanInfo.loss_tokens=.*one entry per sample \(num_samples="):
        replace(plan, loss_tokens=plan.loss_tokens[:-1])
    with pytest.raises(RecordError, match="PlanInfo.dropped_reason='': say why exactly when samples are dropped"):
        replace(plan, dropped=[0])
    with pytest.raises(RecordError, match="PlanInfo.schedule='dict': must be a DPSchedule or None"):
        replace(plan, schedule={})


def test_the_rollout_scheme_records_the_rollouts_each_planned_step_trains_on():
    from slime_ext.schemes import SCHEMES, RolloutStepRecord, get_dp_schedule

    plan = _plan("rollout")
    scheme = get_dp_schedule("rollout")
    assert len({s.step_record for s in SCHEMES.values()}) == len(SCHEMES)  # one record class per scheme
    payload = plan.schedule.rank_payload(0, _train_data())
    steps = scheme.iterators(None, None, payload, vpp=1)
    for s, n in enumerate(steps.num_microbatches):
        base = _record(s, n, [[0]], payload.samples_per_step[s])
        rec = scheme.record(steps, payload, **{f: getattr(base, f) for f in base.__dataclass_fields__})
        assert type(rec) is RolloutStepRecord and rec.rollouts == plan.schedule.rollouts_per_step[s]
        assert isinstance(rec, StepRecord) and rec.samples == base.samples
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    with pytest.raises(RecordError, match="RolloutStepRecord.rollouts=0: must be an integer >= 1"):
        RolloutStepRecord(**fields, rollouts=0)
    with pytest.raises(RecordError, match=rf"RolloutStepRecord.rollouts={base.samples + 1}: must be at most samples"):
        RolloutStepRecord(**fields, rollouts=base.samples + 1)


def test_a_forward_result_is_one_list_of_floats_per_sample_or_none():
    from slime_ext.schemes import ForwardResult

    assert ForwardResult(sample_indices=[3, 1], log_probs=[[-0.5], [-1.0, -2.0]]).log_probs[1] == [-1.0, -2.0]
    assert ForwardResult(sample_indices=[3, 1], log_probs=None).log_probs is None  # not the last stage
    with pytest.raises(RecordError, match=r"ForwardResult.log_probs=\[\[-0.5\]\]: give one list per sample \(2\)"):
        ForwardResult(sample_indices=[3, 1], log_probs=[[-0.5]])
    with pytest.raises(RecordError, match=r"ForwardResult.log_probs\[1\]=.*must be a list of floats"):
        ForwardResult(sample_indices=[3, 1], log_probs=[[-0.5], [1]])
    with pytest.raises(RecordError, match="ForwardResult.sample_indices"):
        ForwardResult(sample_indices=[-1], log_probs=None)
