"""Were the schedules a change moved made better or worse? The evidence a re-recording of ``plan_digests.json``
needs (issue 10).

    python -m bench.plan_quality --write before.json    # on the old code
    python -m bench.plan_quality --compare before.json  # on the new code: exit 1 if any case got worse

    # when the change also changes the pipeline model (its prices), compare both plans under the new one:
    python -m bench.plan_quality --write before.json --write-plans before_plans.json   # old code
    python -m bench.plan_quality --compare before.json --reprice before_plans.json     # new code

    # a sweep: the new code with a PlannerConfig field set (the pipeline cases; repeatable)
    python -m bench.plan_quality --compare before.json --set count_tie=0.003

    # large pipelined steps (not in the digests: 180 steps of 4,096-8,192 samples at dp 64-512, pp 4-8, VPP 1-2)
    python -m bench.plan_quality --large --write before_large.json    # old code (minutes where planning is slow)
    python -m bench.plan_quality --large --compare before_large.json  # new code

For every case of :mod:`bench.plan_digest`, step by step: the micro-batch count (fewer is better), then at an equal
count the slowest rank's cost (``StepStats.rank_cost_max``: FLOPs, or tokens without a cost model; lower is
better). Under pipeline parallelism the planner's objective is the slowest replica's predicted makespan
(``StepStats.predicted_makespan``), for which it may choose more micro-batches: those steps compare by it alone. A
case is ``better`` or ``worse`` when its steps only moved that way, ``mixed`` when both, and a refusal must stay the
same refusal.

``--reprice``: the old plans of the pipeline cases (``--write-plans``: each schedule's ``to_dict``) are priced by
the current pipeline model (:func:`slime_ext.schedule.pipeline_pricing.predicted_makespans` with the current
``pipeline_pricing``), so that a change of the model's prices (e.g. per-stage costs) compares both plans under the
same model rather than each under its own.
"""

from __future__ import annotations

import json
import statistics
import sys
from types import SimpleNamespace

from slime_ext.schedule import DPSchedule
from slime_ext.schedule.pipeline_pricing import predicted_makespans

from .plan_digest import outcomes
from .pipeline_search import SEARCH_DIMS
from .runner import add_planner_fields, parser, planner_config
from .workloads import MAX_TOKENS_PER_GPU, make_lengths

#: the large steps of ``--large``: one rl-like, bimodal or long-tail rollout of ``n`` samples as one step,
#: ``--max-tokens-per-gpu 16384``, ``--balance-data``, Qwen3-8B-like dims (32 layers), planned through
#: ``build_dp_schedule`` with slime-shaped args (as ``bench.pipeline_speed``)
LARGE_DISTS = ("rl", "bimodal", "heavy")
LARGE_SEEDS = (9, 10, 11)
LARGE_SIZES = ((64, 4096), (128, 4096), (128, 8192), (256, 8192), (512, 8192))
LARGE_LAYOUTS = ((4, 1), (4, 2), (8, 1), (8, 2))


def large_outcomes(config=None):
    """``(label, schedule)`` of every large step (``config``: the planner's ``PlannerConfig``, ``None``: its
    defaults)."""
    from slime_ext.schedule import build_dp_schedule
    for dist in LARGE_DISTS:
        for seed in LARGE_SEEDS:
            for dp, n in LARGE_SIZES:
                lengths = make_lengths(dist, n, seed).tolist()
                for pp, vpp in LARGE_LAYOUTS:
                    args = SimpleNamespace(global_batch_size=n, use_dynamic_batch_size=True,
                                           max_tokens_per_gpu=MAX_TOKENS_PER_GPU, micro_batch_size=1,
                                           balance_data=True, balance_by_flops=False,
                                           use_dynamic_global_batch_size=False, disable_rollout_trim_samples=False,
                                           pipeline_model_parallel_size=pp,
                                           virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                           microbatch_group_size_per_vp_stage=None, overlap_p2p_comm=False,
                                           **SEARCH_DIMS)
                    parallel = {"dp_size": dp, "cp_size": 1, "vpp_size": vpp,
                                "microbatch_group_size_per_vp_stage": pp if vpp > 1 else None}
                    yield (f"large/{dist}/seed={seed}/dp={dp},n={n},pp={pp},vpp={vpp}",
                           build_dp_schedule(args, parallel, lengths, global_batch_size=n,
                                             rollout_indices=list(range(n)), config=config))

#: relative change of the slowest rank's cost below which two steps count as equal (float summation order)
REL_TOL = 1e-9


def summary(outcome) -> dict:
    """A case's outcome (:func:`bench.plan_digest.outcomes`): its refusal, or per step count, max and mean cost."""
    if isinstance(outcome, str):
        return {"refused": outcome}
    return {"steps": [[s.total_microbatches, s.rank_cost_max, s.rank_cost_mean, s.predicted_makespan]
                      for s in outcome.stats]}


def _span(step: list) -> float | None:
    """A summary step's predicted makespan (pp > 1), or ``None`` (pp = 1, or a file written before it was kept)."""
    return step[3] if len(step) > 3 else None


def _moved(before: float, after: float) -> str | None:
    return None if abs(after - before) <= REL_TOL * abs(before) else "better" if after < before else "worse"


def verdict(before: dict, after: dict) -> str:
    if "refused" in before or "refused" in after:
        return "equal" if before == after else "worse"
    if len(before["steps"]) != len(after["steps"]):
        return "worse"  # steps come from rollouts alone; a packer change must not move them
    moves = set()
    for (count_b, max_b, *_), (count_a, max_a, *_), span_b, span_a in zip(
            before["steps"], after["steps"], map(_span, before["steps"]), map(_span, after["steps"])):
        if span_b is not None and span_a is not None:  # pp > 1: the predicted makespan is the objective
            move = _moved(span_b, span_a)
        elif count_a != count_b:
            move = "better" if count_a < count_b else "worse"
        else:
            move = _moved(max_b, max_a)
        if move:
            moves.add(move)
    return "equal" if not moves else moves.pop() if len(moves) == 1 else "mixed"


def _worst(steps: list) -> float:
    return max(m / mean if mean > 0 else 1.0 for _, m, mean, *_ in steps)


def _spans(steps: list) -> float | None:
    spans = [_span(s) for s in steps]
    return None if None in spans else sum(spans)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, quick="the random cases only (no benchmark cases)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="FILE", help="write every case's per-step counts and slowest-rank costs")
    g.add_argument("--compare", metavar="FILE", help="compare with a file written before; exit 1 if any got worse")
    p.add_argument("--write-plans", metavar="FILE", help="with --write: also write the pipeline cases' schedules")
    p.add_argument("--reprice", metavar="FILE", help="with --compare: price the old pipeline plans of FILE "
                                                     "(--write-plans) by the current pipeline model")
    p.add_argument("--large", action="store_true", help="the large pipelined steps instead (LARGE_*)")
    add_planner_fields(p, "this run's planner (the pipeline cases)")
    args = p.parse_args(argv)
    if args.write_plans and not args.write or args.reprice and not args.compare:
        p.error("--write-plans goes with --write, --reprice with --compare")
    config = planner_config(args.overrides)
    if config is not None:
        print(f"planner config: {config.describe()}")
    results = list(large_outcomes(config) if args.large else outcomes(args.quick, config))
    now = {label: summary(outcome) for label, outcome in results}
    if args.write:
        with open(args.write, "w") as f:
            json.dump(now, f)
        print(f"wrote {len(now)} cases to {args.write}")
        if args.write_plans:
            plans = {label: o.to_dict() for label, o in results if not isinstance(o, str) and o.parallel.pp_size > 1}
            with open(args.write_plans, "w") as f:
                json.dump(plans, f)
            print(f"wrote {len(plans)} pipeline plans to {args.write_plans}")
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    if args.reprice:
        with open(args.reprice) as f:
            old_plans = json.load(f)
        for label, d in old_plans.items():
            if label in before and "steps" in before[label]:
                old = DPSchedule.from_dict(d)
                for s, step in enumerate(before[label]["steps"]):
                    step[3] = float(predicted_makespans(old, s).max())
        print(f"repriced {len(old_plans)} old pipeline plans by the current pipeline model")
    counts = {"better": 0, "equal": 0, "worse": 0, "mixed": 0}
    for label in sorted(before.keys() & now.keys()):
        v = verdict(before[label], now[label])
        counts[v] += 1
        if v != "equal":
            b, a = before[label], now[label]
            detail = (f"refused {b.get('refused')!r} -> {a.get('refused')!r}" if "refused" in b or "refused" in a else
                      f"micro-batches {sum(s[0] for s in b['steps'])} -> {sum(s[0] for s in a['steps'])}, "
                      f"worst step max/mean {_worst(b['steps']):.5f} -> {_worst(a['steps']):.5f}"
                      + (f", predicted makespans (sum) {_spans(b['steps']):.6g} -> {_spans(a['steps']):.6g}"
                         if _spans(b["steps"]) is not None and _spans(a["steps"]) is not None else ""))
            print(f"{v.upper():6s} {label}: {detail}")
    print(", ".join(f"{n} {k}" for k, n in counts.items()) + f" ({len(before.keys() & now.keys())} cases compared)")
    moved = [_spans(now[label]["steps"]) / _spans(before[label]["steps"]) - 1 for label in before.keys() & now.keys()
             if "steps" in before[label] and "steps" in now[label] and _spans(before[label]["steps"])
             and _spans(now[label]["steps"]) is not None]
    if moved:
        print(f"predicted makespan of the pipelined cases, new / old - 1: mean {statistics.mean(moved):+.4%}, "
              f"best {min(moved):+.3%}, worst {max(moved):+.3%}")
    return 1 if counts["worse"] or counts["mixed"] else 0


if __name__ == "__main__":
    sys.exit(main())
