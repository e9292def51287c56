"""The ledger checker finds every kind of violation (so an empty report in the e2e tests means something)."""

from __future__ import annotations

import copy
from itertools import accumulate
from types import SimpleNamespace

import pytest

from slime_ext.rollout.dispatch import plan_rollout
from slime_ext.rollout.ledger import check_ledger
from slime_ext.rollout.synthetic import SYNTHETIC_DEFAULTS, generate_rollout
from slime_ext.rollout.train_data import flatten_samples, samples_to_train_data


def _plan(dp_schedule="rollout"):
    args = SimpleNamespace(**SYNTHETIC_DEFAULTS, rollout_batch_size=6, n_samples_per_prompt=2, rollout_seed=1,
                           global_batch_size=6, use_dynamic_batch_size=True,
                           max_tokens_per_gpu=96, micro_batch_size=1, balance_data=True, dp_schedule=dp_schedule,
                           num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=128)
    data = samples_to_train_data(flatten_samples(generate_rollout(args, 0)))
    plan = plan_rollout(data, args, {"dp_size": 2, "cp_size": 1, "vpp_size": 1,
                                     "microbatch_group_size_per_vp_stage": 1})
    return {**plan.summary(), "partitions": plan.partitions, "step_samples": plan.step_samples,
            "schedule": None if plan.schedule is None else plan.schedule.to_dict()}


def _exact_ranks(plan, pp=1):
    """What correct train ranks report: the schedule's micro-batches (legacy: two micro-batches per step)."""
    ranks = []
    dp = len(plan["partitions"])
    for p in range(pp):
        for d, part in enumerate(plan["partitions"]):
            records = []
            if plan["schedule"] is not None:
                nmb = plan["schedule"]["num_microbatches"]
                mbi = plan["schedule"]["micro_batch_indices"][d]
                for s, end in enumerate(accumulate(nmb)):
                    ledger = [[part[i] for i in mb] for mb in mbi[end - nmb[s]:end]]
                    records.append({"num_microbatches": nmb[s], "ledger": ledger,
                                    "samples": len(plan["step_samples"][s])})
            else:
                k = len(part) // len(plan["step_samples"])
                for s in range(len(plan["step_samples"])):
                    mine = part[s * k:(s + 1) * k]
                    records.append({"num_microbatches": 2, "ledger": [mine[::2], mine[1::2]],
                                    "samples": len(plan["step_samples"][s])})
            ranks.append({"rank": p * dp + d, "dp_rank": d, "pp_rank": p, "records": records})
    return ranks


@pytest.mark.parametrize("mode", ["rollout", "legacy"])
def test_exact_ledger_passes(mode):
    plan = _plan(mode)
    assert check_ledger(plan, _exact_ranks(plan)) == []
    assert check_ledger(plan, _exact_ranks(plan, pp=2)) == []


def _corrupt(plan, how):
    ranks = _exact_ranks(plan, pp=2)
    r0 = ranks[0]["records"]
    if how == "moved_between_micro_batches":
        rank, mbs, k = next((r, rec["ledger"], k) for r in ranks if r["pp_rank"] == 0 for rec in r["records"]
                            if len(rec["ledger"]) > 1 for k, mb in enumerate(rec["ledger"]) if len(mb) > 1)
        mbs[k - 1].append(mbs[k].pop())
        for r in ranks:  # on every stage, so only the comparison with the schedule can see it
            if r["dp_rank"] == rank["dp_rank"]:
                r["records"] = copy.deepcopy(rank["records"])
    elif how == "sample_lost":
        r0[0]["ledger"][0].pop()
    elif how == "sample_twice":
        r0[0]["ledger"][0].append(ranks[1]["records"][0]["ledger"][0][0])
    elif how == "counts_disagree":
        r0[0]["num_microbatches"] += 1
    elif how == "stage_disagrees":
        ranks[2]["records"][0]["ledger"] = copy.deepcopy(ranks[3]["records"][0]["ledger"])
    elif how == "wrong_sample_count":
        ranks[1]["records"][0]["samples"] -= 1
    elif how == "dropped_trained":
        plan["dropped"] = [plan["step_samples"][0][0]]
    elif how == "lost_and_unreported":
        plan["num_samples"] += 1
    return ranks


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
    plan = _plan("rollout")
    ranks = _corrupt(plan, how)
    problems = check_ledger(plan, ranks)
    assert any(message in p for p in problems), problems


def test_legacy_sample_on_the_wrong_rank():
    plan = _plan("legacy")
    ranks = _exact_ranks(plan)
    a, b = ranks[0]["records"][0]["ledger"][0], ranks[1]["records"][0]["ledger"][0]
    a[0], b[0] = b[0], a[0]
    assert any("its share is" in p for p in check_ledger(plan, ranks))
