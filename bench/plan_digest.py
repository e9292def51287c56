"""A change detector for the schedules the planner makes on a fixed set of seeded valid workloads: it reports any plan
that moved, wanted or not. It says nothing about validity -- the contract is checked by the invariant checker and the
property tests; here a moved plan shows *what* moved, step by step and rank by rank.

    python -m bench.plan_digest --write before.json    # on the old code
    python -m bench.plan_digest --check before.json    # on the new code: exit 1 and show every plan that moved

``bench/plan_digests.json`` holds, per case, the SHA-256 of the schedule's decisions (``SCHEDULE_FIELDS`` of
``to_dict()``) and a compact record of them: per step, per DP rank, its micro-batches as global sample ids (cases of
at most :data:`FULL_RECORD_SAMPLES` samples), or ``"<micro-batches>/<samples>/<hash of the rank's step>"`` (the
large benchmark cases, to keep the file small); a refused case records the exception type and message. ``--check``
compares the hashes and, for each moved plan, prints the steps and ranks that differ, before and after
(:func:`describe_change`). It was recorded at commit cdc63be (before issue 9's input hardening) and re-recorded when
one LPT deal replaced two (4 cases with balance_by_flops moved, each to a lower slowest rank), when
use_dynamic_global_batch_size began counting samples (64 such cases moved) and when the pipeline cases were added;
``python -m bench.plan_quality`` says whether moved plans got better or worse; ``tests/unit/test_plan_digests.py``
runs the check in CI.

The workloads: every benchmark case (``bench/workloads.py``) with every flag set, planned through ``plan_schedule``;
and ``RANDOM_CASES`` small seeded rollouts over parallel layouts, static/dynamic batches, rollout groups, loss
tokens and cost models, half of them through ``build_dp_schedule`` (slime's entry); and ``PIPELINE_CASES`` seeded
rollouts under pipeline parallelism (pp 2 and 4, with and without VPP, priced by tokens, FLOPs or a profile), whose
order and count the pipeline model chooses.
"""

from __future__ import annotations

import hashlib
import json
import sys
from functools import partial
from types import SimpleNamespace

import numpy as np

from slime_ext.schedule import BatchConfig, CostModel, CostProfile, ParallelConfig, build_dp_schedule, plan_schedule

from .runner import parser
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


def digest(outcome) -> str:
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
#: a plan of at most this many samples is recorded in full (its micro-batches); a larger one by counts and hashes
FULL_RECORD_SAMPLES = 400


def rank_steps(schedule) -> list[list[list[list[int]]]]:
    """``[step][rank]`` -> that rank's micro-batches of that step, each as sorted global sample ids, in run order."""
    out, start = [], 0
    for m in schedule.num_microbatches:
        part, mbi = schedule.partitions, schedule.micro_batch_indices
        out.append([[sorted(part[r][i] for i in mb) for mb in mbi[r][start:start + m]]
                    for r in range(schedule.dp_size)])
        start += m
    return out


def _short(mbs: list[list[int]]) -> str:
    """A rank's step as ``"<micro-batches>/<samples>/<hash>"``."""
    text = json.dumps(mbs, separators=(",", ":"))
    return f"{len(mbs)}/{sum(map(len, mbs))}/{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def record(outcome) -> str | dict:
    """What ``--write`` stores for a case: a refusal as it is; a plan as its hash, dropped samples and steps."""
    if isinstance(outcome, str):
        return outcome
    steps = rank_steps(outcome)
    full = len(outcome.total_lengths) <= FULL_RECORD_SAMPLES
    return {"sha": digest(outcome), "dropped": sorted(outcome.dropped),
            "steps": [[mbs if full else _short(mbs) for mbs in step] for step in steps]}


def _key(rec) -> str:
    """The compared value of a stored record: the refusal, or the plan's hash (a bare digest: the older format)."""
    return rec["sha"] if isinstance(rec, dict) else rec


def describe_change(before, after, limit: int = 6) -> list[str]:
    """Lines saying what moved between two records of one case: a refusal, the steps, the dropped samples, and per
    step and rank the micro-batches before and after (the first ``limit`` differing ones)."""
    if isinstance(before, str) or isinstance(after, str):
        return [f"before: {before if isinstance(before, str) else 'planned'}",
                f"after:  {after if isinstance(after, str) else 'planned'}"]
    if "steps" not in before:
        return [f"(recorded as a digest only: {before['sha']} -> {after['sha']}; re-record to see the steps)"]
    lines = []
    if len(before["steps"]) != len(after["steps"]):
        lines.append(f"steps: {len(before['steps'])} -> {len(after['steps'])}")
    if before["dropped"] != after["dropped"]:
        lines.append(f"dropped: {before['dropped']} -> {after['dropped']}")
    shown = 0
    for s, (old, new) in enumerate(zip(before["steps"], after["steps"])):
        if len(old) != len(new):
            lines.append(f"step {s}: {len(old)} ranks -> {len(new)}")
            continue
        for r, (a, b) in enumerate(zip(old, new)):
            if a == b:
                continue
            shown += 1
            if shown > limit:
                continue
            if isinstance(a, str) or isinstance(b, str):
                lines.append(f"step {s} rank {r}: {a} -> {b}  (micro-batches/samples/hash)")
                continue
            gone, came = sorted(set().union(*a) - set().union(*b)), sorted(set().union(*b) - set().union(*a))
            lines.append(f"step {s} rank {r}: {len(a)} -> {len(b)} micro-batches"
                         + (f"; samples left {gone}" if gone else "") + (f"; samples joined {came}" if came else ""))
            lines.append(f"    before {a}")
            lines.append(f"    after  {b}")
    if shown > limit:
        lines.append(f"... {shown - limit} more (step, rank) pairs differ")
    if not lines:  # the decisions' hash moved, the micro-batches per step and rank did not
        lines.append("same micro-batches per step and rank; another decision field moved (see SCHEDULE_FIELDS)")
    return lines


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
    return {label: digest(outcome) for label, outcome in outcomes(quick)}


def all_records(quick: bool = False) -> dict[str, str | dict]:
    """``{label: record}`` of every case (:func:`record`)."""
    return {label: record(outcome) for label, outcome in outcomes(quick)}


def changes(before: dict, now: dict) -> dict[str, list[str]]:
    """``{label: lines}`` for every case whose plan or refusal moved (cases only in one of them are not compared)."""
    return {k: describe_change(before[k], now[k]) for k in now if k in before and _key(before[k]) != _key(now[k])}


def write_records(records: dict, path: str) -> None:
    """One case per line, sorted: a re-record's diff shows the cases that moved."""
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(records[k], separators=(',', ':'))}"
                                    for k in sorted(records)) + "\n}\n")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, quick="the random cases only (no benchmark cases)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="FILE", help="write the records (hashes and compact plans) as JSON")
    g.add_argument("--check", metavar="FILE", help="compare with records written before; exit 1 on any change")
    args = p.parse_args(argv)
    records = all_records(args.quick)
    refused = sum(1 for v in records.values() if isinstance(v, str))
    if args.write:
        write_records(records, args.write)
        print(f"wrote {len(records)} records ({refused} refusals) to {args.write}")
        return 0
    with open(args.check) as f:
        before = json.load(f)
    changed = changes(before, records)
    missing = [k for k in before if k not in records]
    for k, lines in changed.items():
        print(f"CHANGED {k}:\n  " + "\n  ".join(lines))
    compared = len(records) - sum(1 for k in records if k not in before)
    print(f"{compared} cases compared ({refused} refusals), {len(changed)} changed, {len(missing)} not run")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
