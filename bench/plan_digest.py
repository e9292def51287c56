"""Digest of the schedules the planner makes for a fixed set of seeded valid workloads (issue 9: "valid inputs plan
exactly as before").

    python -m bench.plan_digest --write before.json    # on the old code
    python -m bench.plan_digest --check before.json    # on the new code: exit 1 and list every schedule that moved

``bench/plan_digests.json`` holds the digests of commit cdc63be (before issue 9's input hardening), re-recorded
when one LPT deal replaced two (issue 10: 4 cases with balance_by_flops moved, each to a lower slowest rank), when
use_dynamic_global_batch_size began counting samples (issue 16: 64 such cases moved) and when the pipeline cases were
added (no other digest moved). ``python -m bench.plan_digest --check bench/plan_digests.json`` shows which schedules
a later change moved, and ``python -m bench.plan_quality`` whether the moved ones got better or worse;
``tests/unit/test_plan_digests.py`` runs the check in CI.

The workloads: every benchmark case (``bench/workloads.py``) with every flag set, planned through ``plan_schedule``;
and ``RANDOM_CASES`` small seeded rollouts over parallel layouts, static/dynamic batches, rollout groups, loss
tokens and cost models, half of them through ``build_dp_schedule`` (slime's entry); and ``PIPELINE_CASES`` seeded
rollouts under pipeline parallelism (pp 2 and 4, with and without VPP, priced by tokens, FLOPs or a profile), whose
order and count the pipeline model chooses. A case's digest is the SHA-256
of the schedule's decisions (``SCHEDULE_FIELDS`` of ``to_dict()``); a refused case records the exception type and
message, so a refusal that changes is reported too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from functools import partial
from types import SimpleNamespace

import numpy as np

from slime_ext.schedule import BatchConfig, CostModel, CostProfile, ParallelConfig, build_dp_schedule, plan_schedule

from .workloads import CASES, FLAG_SETS, MODEL_DIMS, make_lengths

RANDOM_CASES = 400
PIPELINE_CASES = 60
_MODELS = [
    None,
    dict(hidden_size=64, num_layers=2, num_attention_heads=4, vocab_size=500),
    dict(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2, num_experts=4,
         moe_ffn_hidden_size=128, moe_router_topk=2, vocab_size=1000),
    MODEL_DIMS,
]


def _digest(outcome) -> str:
    """A refusal as it is; a schedule as the hash of its decisions."""
    if isinstance(outcome, str):
        return outcome
    d = outcome.to_dict()
    # what training runs (the decisions), not the report around it: stats names and the schema may be renamed
    text = json.dumps({k: d.get(k) for k in SCHEDULE_FIELDS}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


#: the fields that decide what each rank trains, step by step
SCHEDULE_FIELDS = ("partitions", "micro_batch_indices", "num_microbatches", "samples_per_step", "rollouts_per_step",
                   "dropped", "loss_tokens_per_step", "step_samples")


def bench_cases():
    """``(label, thunk)`` of every benchmark case with every flag set, planned through ``plan_schedule``."""
    for case in CASES:
        lengths = make_lengths(case.dist, case.n, case.seed).tolist()
        ids = list(range(case.n))
        for label, balance_data, balance_by_flops in FLAG_SETS:
            parallel = ParallelConfig(dp_size=case.dp_size, cp_size=case.cp_size)
            batch = BatchConfig(global_batch_size=case.global_batch_size, use_dynamic_batch_size=True,
                                max_tokens_per_gpu=case.max_tokens_per_gpu, balance_data=balance_data,
                                balance_by_flops=balance_by_flops)
            yield f"bench/{case.name}/{label}", partial(plan_schedule, lengths, parallel, batch, rollout_ids=ids,
                                                        cost_model=CostModel(**MODEL_DIMS))


def random_case(seed: int):
    """``(label, thunk)`` of one seeded small workload."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    shape = seed % 3
    if shape == 0:
        lengths = rng.integers(1, int(rng.integers(2, 3000)), n)
    elif shape == 1:
        lengths = 1 + np.minimum(rng.lognormal(rng.uniform(2, 7), rng.uniform(0.1, 1.5), n), 20000).astype(int)
    else:
        lengths = np.where(rng.random(n) < 0.2, rng.integers(500, 4000, n), rng.integers(1, 100, n))
    lengths = [int(x) for x in lengths]
    grouping = int(rng.integers(3))
    ids = None if grouping == 0 else (rng.permutation(n).tolist() if grouping == 1
                                      else rng.integers(0, max(1, n // int(rng.integers(1, 5))), n).tolist())
    loss = [int(rng.integers(0, x + 1)) for x in lengths] if rng.random() < 0.5 else None
    dynamic = bool(rng.random() < 0.7)
    dp = int(rng.choice([1, 2, 3, 4, 8]))
    vpp = int(rng.choice([1, 1, 2]))
    cp = int(rng.choice([1, 1, 2]))
    mbg = int(rng.choice([1, 2, 3]))
    dyn_gbs = bool(rng.random() < 0.3)
    flags = dict(
        global_batch_size=None if dyn_gbs else int(rng.integers(1, 64)),
        use_dynamic_batch_size=dynamic,
        max_tokens_per_gpu=int(rng.choice([64, 500, 2048, 8192])) if dynamic else None,
        micro_batch_size=None if dynamic else int(rng.integers(1, 5)),
        balance_data=bool(rng.random() < 0.5),
        balance_by_flops=dynamic and bool(rng.random() < 0.5),
        use_dynamic_global_batch_size=dyn_gbs,
        disable_rollout_trim_samples=bool(rng.random() < 0.2),
    )
    model = _MODELS[int(rng.integers(len(_MODELS)))]
    tpc = dict(dp_size=dp, cp_size=cp, vpp_size=vpp, microbatch_group_size_per_vp_stage=mbg)
    label = f"random/{seed}/n={n},dp={dp},vpp={vpp},cp={cp},dyn={int(dynamic)}"
    if seed % 2:
        args = SimpleNamespace(**{k: v for k, v in flags.items() if v is not None}, **(model or {}))
        gbs = flags["global_batch_size"]
        return label + "/compat", lambda: build_dp_schedule(args, tpc, lengths, global_batch_size=gbs,
                                                            rollout_indices=ids, loss_tokens=loss)
    return label, lambda: plan_schedule(lengths, ParallelConfig(**tpc), BatchConfig(**flags), rollout_ids=ids,
                                        loss_tokens=loss, cost_model=None if model is None else CostModel(**model))


#: a measured-looking profile for the pipeline cases (seconds; the planner prices micro-batches with it)
_PROFILE = CostProfile(step_overhead_s=0.05, microbatch_overhead_s=0.004, per_token_s=2e-6,
                       per_sample_quadratic_s=1e-10, backward_forward_ratio=2.1, p2p_s=0.002)


def pipeline_case(seed: int, config=None):
    """``(label, thunk)`` of one seeded small workload under pipeline parallelism (the planner's stage 5: order,
    DP assignment and count chosen by the pipeline model), priced by tokens, a FLOPs model or a profile;
    ``config``: the planner's ``PlannerConfig`` (``None``: its defaults)."""
    rng = np.random.default_rng(10_000 + seed)
    n = int(rng.integers(8, 200))
    if seed % 2:
        lengths = 1 + np.minimum(rng.lognormal(rng.uniform(4, 7), rng.uniform(0.3, 1.2), n), 12000).astype(int)
    else:
        lengths = np.where(rng.random(n) < 0.2, rng.integers(2000, 6000, n), rng.integers(50, 600, n))
    lengths = [int(x) for x in lengths]
    dynamic = bool(rng.random() < 0.8)
    ids = rng.integers(0, max(1, n // 2), n).tolist() if dynamic and rng.random() < 0.5 else None
    rollouts = n if ids is None else len(set(ids))
    pp = int(rng.choice([2, 4]))
    vpp = int(rng.choice([1, 1, 2]))
    dp = int(rng.choice([1, 2, 4]))
    group = pp if vpp > 1 else None
    align = dp * (group or 1)
    mbs = None if dynamic else int(rng.integers(1, 3))
    if dynamic:  # whole steps of at least one sample per micro-batch slot, mostly
        gbs = int(rng.integers(max(1, rollouts // 4), rollouts + 1))
    else:  # samples per step a multiple of the micro-batch slots
        gbs = mbs * align * int(rng.integers(1, max(1, n // (mbs * align)) + 1))
    batch = BatchConfig(global_batch_size=gbs, use_dynamic_batch_size=dynamic,
                        max_tokens_per_gpu=int(rng.choice([4096, 8192])) if dynamic else None, micro_batch_size=mbs,
                        balance_data=bool(rng.random() < 0.6), balance_by_flops=dynamic and bool(rng.random() < 0.3))
    parallel = ParallelConfig(dp_size=dp, pp_size=pp, vpp_size=vpp, microbatch_group_size_per_vp_stage=group,
                              overlap_p2p_comm=bool(rng.random() < 0.5))
    cost = [None, CostModel(**_MODELS[1]), _PROFILE][seed % 3]
    label = f"pipeline/{seed}/n={n},dp={dp},pp={pp},vpp={vpp},dyn={int(dynamic)},cost={type(cost).__name__}"
    return label, lambda: plan_schedule(lengths, parallel, batch, rollout_ids=ids, cost_model=cost, config=config)


def all_cases(quick: bool = False, config=None):
    """``(label, thunk)`` of every pinned case: the benchmark cases (unless ``quick``), then the random ones, then
    the pipeline ones (planned with ``config``; the others have no pipeline, which is all the config tunes)."""
    if not quick:
        yield from bench_cases()
    for seed in range(RANDOM_CASES):
        yield random_case(seed)
    for seed in range(PIPELINE_CASES):
        yield pipeline_case(seed, config)


def outcomes(quick: bool = False, config=None):
    """``(label, schedule or refusal)`` of every case: a refusal (``"Error: message"``) is part of the behaviour.
    ``config``: the planner's ``PlannerConfig`` for the pipeline cases (``None``: its defaults)."""
    for label, thunk in all_cases(quick, config):
        try:
            yield label, thunk()
        except Exception as e:  # noqa: BLE001 -- a refusal is a result too
            yield label, f"{type(e).__name__}: {e}"


def all_digests(quick: bool = False) -> dict[str, str]:
    return {label: _digest(outcome) for label, outcome in outcomes(quick)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="FILE", help="write the digests as JSON")
    g.add_argument("--check", metavar="FILE", help="compare with digests written before; exit 1 on any change")
    p.add_argument("--quick", action="store_true", help="the random cases only (no benchmark cases)")
    args = p.parse_args(argv)
    digests = all_digests(args.quick)
    refused = sum(1 for v in digests.values() if ":" in v)
    if args.write:
        with open(args.write, "w") as f:
            json.dump(digests, f, indent=1, sort_keys=True)
        print(f"wrote {len(digests)} digests ({refused} refusals) to {args.write}")
        return 0
    with open(args.check) as f:
        before = json.load(f)
    changed = [k for k in digests if k in before and before[k] != digests[k]]
    missing = [k for k in before if k not in digests]
    for k in changed:
        print(f"CHANGED {k}:\n  before {before[k]}\n  after  {digests[k]}")
    compared = len(digests) - sum(1 for k in digests if k not in before)
    print(f"{compared} cases compared ({refused} refusals), {len(changed)} changed, {len(missing)} not run")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
