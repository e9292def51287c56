"""verl's own micro-batch planning next to slime-ext's engine-depth plan, on the same trainer steps (issue 23).

    .venv-verl/bin/python -m bench.verl                          # the installed verl (ci/verl_test's venv)
    PYTHONPATH=.verl-trees/<commit> .venv-verl/bin/python -m bench.verl   # verl HEAD (ci/verl_test extracts it)
    .venv-verl/bin/python -m bench.verl --quick                  # one workload, one layout (smoke run)

**One trainer step, as verl runs it** (everything named "verl" below is verl's code, imported from the installed
verl or a tree on ``PYTHONPATH``; nothing of it is copied here):

1. dispatch: the V1 trainer's ``_balance_batch``: ``get_seqlen_balanced_partitions(calculate_workload(lengths), dp,
   equal_size=True)``, the partitions concatenated in order, and equal contiguous chunks per DP rank;
2. mini-batches: each rank's chunk sliced into ``--mini-batches`` contiguous mini-batches (``shuffle`` off);
3. micro-batches, per mini-batch, by either
   * **verl**: ``rearrange_micro_batches`` (what ``prepare_micro_batches`` calls) on each rank's samples, with the
     DP group's agreement emulated without processes: every rank is re-run with ``min_num_micro_batch`` = the
     largest count any rank returned until all return the same count (verl's MAX all-reduce; its cap loop, where
     the version has one, re-partitions in lockstep the same way);
   * **engine**: :func:`slime_ext.integrations.verl.plan.plan_engine_step` on the same ranks' samples (what
     ``SLIME_EXT_VERL=1`` runs inside the engine), told the pipeline size;
   * **trainer**: the trainer depth: :func:`slime_ext.integrations.verl.plan.plan_dispatch` instead of step 1 (per
     mini-batch, equal counts per rank, FLOPs balanced; ``SLIME_EXT_VERL=trainer``), then the engine depth.

**Columns**, summed or taken over the step's mini-batches: micro-batches holding more than one sample above the cap
(``over cap``); micro-batches per rank (per mini-batch, the same on every rank); the per-mini-batch FLOPs max/mean over
DP ranks (the worst mini-batch; it is the dispatch's: verl's for verl and the engine depth, slime-ext's for the
trainer depth); the predicted step time at pp 1, 4 and 8
(each mini-batch: its slowest replica's makespan in the micro-batch order the plan runs, priced the same way for
every plan by slime-ext's pipeline model, :func:`slime_ext.schedule.pipeline_pricing.pipeline_pricing`: forward FLOPs of
Qwen3-8B-like dims plus 2% of a full micro-batch, backward twice forward; pp 1 is the same model with one stage),
relative to verl's; ``plan s``: the engine depth's planning time over the step (every rank plans all ranks).

Workloads (:mod:`bench.workloads`, ``bench.pipeline_model_table``): ``rl-like``, ``bimodal``, ``long tail``; 1024
samples per trainer step, dp 8, 4 mini-batches (32 samples per rank per mini-batch), cap 16384; lengths are clipped to
the cap, since verl refuses a longer sample (its config makes the longest prompt + response fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from slime_ext.integrations.verl.plan import EngineLayout, plan_dispatch, plan_engine_step
from slime_ext.schedule import CostModel, ParallelConfig
from slime_ext.schedule.cost import sample_costs
from slime_ext.schedule.pipeline_model import PipelineSpec
from slime_ext.schedule.pipeline_pricing import PipelinePricing, pipeline_pricing

from .pipeline_model_table import bimodal_lengths
from .workloads import MAX_TOKENS_PER_GPU, MODEL_DIMS, make_lengths

N, DP, MINI_BATCHES, SEED = 1024, 8, 4, 1
PP_SIZES = (1, 4, 8)
WORKLOADS = {
    "rl-like": lambda n: make_lengths("rl", n, SEED),
    "bimodal": lambda n: bimodal_lengths(n, SEED),
    "long tail": lambda n: make_lengths("heavy", n, SEED),
}


def dispatch(lengths: np.ndarray, dp: int) -> list[np.ndarray]:
    """verl's V1 ``_balance_batch``: equal-count, workload-balanced partitions, concatenated; rank r's chunk."""
    import torch
    import verl.utils.seqlen_balancing as verl_balancing  # verl's module, used by attribute (nothing copied here)

    workload = verl_balancing.calculate_workload(torch.as_tensor(lengths)).tolist()
    parts = verl_balancing.get_seqlen_balanced_partitions(workload, k_partitions=dp, equal_size=True)
    order = np.array([j for p in parts for j in p])
    return list(order.reshape(dp, -1))


def _verl_batch(lengths):
    import torch
    from tensordict import TensorDict

    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.int8)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1
    return TensorDict({"input_ids": mask, "attention_mask": mask}, batch_size=[len(lengths)])


def verl_plan(ranks: list[list[int]], cap: int, divided_by: int | None) -> list[list[list[int]]]:
    """verl's ``rearrange_micro_batches`` on every rank, agreeing on one count as its DP all-reduce does."""
    import verl.utils.seqlen_balancing as verl_balancing

    batches = [_verl_batch(x) for x in ranks]
    count = None
    for _ in range(64):
        plans = [verl_balancing.rearrange_micro_batches(b, max_token_len=cap, dp_group=None,
                                                        num_batches_divided_by=divided_by,
                                                        min_num_micro_batch=count)[1] for b in batches]
        counts = {len(p) for p in plans}
        if len(counts) == 1:
            return plans
        count = max(counts)
    raise AssertionError("verl's emulated DP agreement did not settle")


def pricing_for(pp: int, cost_model: CostModel, cap: int) -> PipelinePricing:
    if pp > 1:
        return pipeline_pricing(ParallelConfig(dp_size=DP, pp_size=pp), cost_model, cap)
    two = pipeline_pricing(ParallelConfig(dp_size=DP, pp_size=2), cost_model, cap)
    return dataclasses.replace(two, spec=PipelineSpec(pp_size=1), scale=1.0, stage_share=None)  # one stage


@dataclasses.dataclass
class Tally:
    over_cap: int = 0
    counts: list[int] = dataclasses.field(default_factory=list)
    makespan: float = 0.0
    plan_s: float = 0.0


def judge(tally: Tally, plans, ranks, costs, lengths, cap, pricing) -> None:
    """Add one mini-batch's plan (``plans[r]`` = rank r's micro-batches as positions into ``ranks[r]``)."""
    counts = {len(p) for p in plans}
    assert len(counts) == 1, f"counts differ across ranks: {counts}"
    tally.counts.append(counts.pop())
    rows = []
    for idx, mbs in zip(ranks, plans):
        seen = sorted(i for mb in mbs for i in mb)
        assert seen == list(range(len(idx))), "a plan does not train each sample once"
        for mb in mbs:
            members = idx[list(mb)]
            if len(mb) > 1 and int(lengths[members].sum()) > cap:
                tally.over_cap += 1
        rows.append([float(costs[idx[list(mb)]].sum()) for mb in mbs])
    tally.makespan += float(pricing.makespans(np.array(rows)).max())


def _minis(chunks: list[np.ndarray], mini_batches: int) -> list[list[np.ndarray]]:
    per = len(chunks[0]) // mini_batches
    return [[c[m * per:(m + 1) * per] for c in chunks] for m in range(mini_batches)]


def _balance(minis, costs) -> float:
    """The worst mini-batch's FLOPs max/mean over DP ranks."""
    return max(float(max(costs[x].sum() for x in ranks) / np.mean([costs[x].sum() for x in ranks]))
               for ranks in minis)


def run_case(name: str, n: int, dp: int, mini_batches: int, pp_sizes=PP_SIZES) -> list[dict]:
    cost_model = CostModel(**MODEL_DIMS)
    cap = MAX_TOKENS_PER_GPU
    # verl refuses a sample longer than the cap (its config makes max prompt + response fit): clip to it
    lengths = np.minimum(np.asarray(WORKLOADS[name](n), dtype=np.int64), cap)
    costs = sample_costs(lengths, cost_model)
    minis = _minis(dispatch(lengths, dp), mini_batches)
    # the trainer depth: slime-ext's dispatch (per mini-batch, equal counts), then the engine depth
    order = np.asarray(plan_dispatch(lengths, dp, n // mini_batches, cost_model=cost_model))
    trainer_minis = _minis(list(order.reshape(dp, -1)), mini_batches)
    t = time.perf_counter()
    verl_plans = [verl_plan([lengths[x].tolist() for x in ranks], cap, None) for ranks in minis]
    verl_s = time.perf_counter() - t
    out = []
    for pp in pp_sizes:
        pricing = pricing_for(pp, cost_model, cap)
        verl, ours, trainer = Tally(plan_s=verl_s), Tally(), Tally()
        for ranks, vplans in zip(minis, verl_plans):
            judge(verl, vplans, ranks, costs, lengths, cap, pricing)
            t = time.perf_counter()
            plan = plan_engine_step([lengths[x] for x in ranks], cap, EngineLayout(pp_size=pp), cost_model=cost_model)
            ours.plan_s += time.perf_counter() - t
            judge(ours, [list(map(list, p)) for p in plan.micro_batches], ranks, costs, lengths, cap, pricing)
        for ranks in trainer_minis:
            plan = plan_engine_step([lengths[x] for x in ranks], cap, EngineLayout(pp_size=pp), cost_model=cost_model)
            judge(trainer, [list(map(list, p)) for p in plan.micro_batches], ranks, costs, lengths, cap, pricing)
        out.append(dict(name=name, pp=pp, balance=_balance(minis, costs),
                        trainer_balance=_balance(trainer_minis, costs),
                        verl=verl, ours=ours, trainer=trainer, units=pricing.units))
    return out


def _counts(t: Tally) -> str:
    return ",".join(map(str, t.counts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="rl-like only, pp 1 and 4, 256 samples")
    ap.add_argument("--dp", type=int, default=DP)
    ap.add_argument("--samples", type=int, default=N, help="samples per trainer step")
    ap.add_argument("--mini-batches", type=int, default=MINI_BATCHES)
    args = ap.parse_args(argv)
    import verl

    names = ["rl-like"] if args.quick else list(WORKLOADS)
    pps = (1, 4) if args.quick else PP_SIZES
    n = 256 if args.quick else args.samples
    print(f"verl {verl.__version__} ({verl.__path__[0]}); {n} samples per step, dp {args.dp}, {args.mini_batches} "
          f"mini-batches, cap {MAX_TOKENS_PER_GPU}; Qwen3-8B-like FLOPs")
    print(f"{'':<10} {'':>2} | {'over cap':^17} | {'micro-batches per rank':^41} | {'FLOPs max/mean':^15} | "
          f"{'step time / verl':^17} |")
    print(f"{'workload':<10} {'pp':>2} | {'verl':>8} {'ours':>8} | {'verl':>13} {'engine':>13} {'trainer':>13} | "
          f"{'verl':>7} {'trainer':>7} | {'engine':>8} {'trainer':>8} | {'plan s':>6}")
    for name in names:
        for row in run_case(name, n, args.dp, args.mini_batches, pps):
            v, o, t = row["verl"], row["ours"], row["trainer"]
            print(f"{name:<10} {row['pp']:>2} | {v.over_cap:>8} {o.over_cap + t.over_cap:>8} | {_counts(v):>13} "
                  f"{_counts(o):>13} {_counts(t):>13} | {row['balance']:>7.3f} {row['trainer_balance']:>7.3f} | "
                  f"{o.makespan / v.makespan:>8.3f} {t.makespan / v.makespan:>8.3f} | {o.plan_s:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
