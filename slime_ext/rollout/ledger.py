"""The ledger invariants of one trained rollout, written once: the driver checks them after every rollout
(``verify_ledger``) and the e2e tests assert them.

Input: the rollout's plan (:class:`~slime_ext.schemes.PlanInfo`, ``RolloutManager.generate(...)["plan"]``) and every
train rank's result (:class:`~slime_ext.schemes.RankResult`, ``TrainActor.train_rollout``: per step
``num_microbatches``, ``samples`` and ``ledger`` -- the global sample ids of each micro-batch the rank consumed, in
order). Invariants:

  - every rank (all DP ranks, all pipeline stages) ran the same steps with the same ``num_microbatches``;
  - the pipeline stages of a DP replica consumed identical micro-batches;
  - rollout path: DP rank ``d`` consumed, in step ``s``, exactly the micro-batches the schedule gave it --
    ``[partitions[d][i] for i in mb]`` for ``mb`` in its ``micro_batch_indices`` of step ``s``, in order;
    legacy path: DP rank ``d`` consumed in step ``s`` exactly its samples ``partition[s*k:(s+1)*k]``
    (``k = global_batch_size / dp_size``), micro-batched by the training side;
  - per step, the samples consumed over all DP ranks are ``step_samples[s]``, each exactly once, and every
    rank reports that many samples;
  - the steps plus ``dropped`` cover every sample of the rollout exactly once: nothing is lost silently.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate
from typing import Sequence

from slime_ext.schemes import PlanInfo, RankResult


def check_ledger(plan: PlanInfo, ranks: Sequence[RankResult], max_report: int = 20) -> list[str]:
    """Every violation as a readable line (empty = the ledger is exact)."""
    out: list[str] = []

    def bad(msg: str) -> None:
        if len(out) < max_report:
            out.append(msg)

    if not ranks:
        return ["no train rank returned a result"]
    num_steps = plan.num_steps
    per_rank_counts = {r.rank: [rec.num_microbatches for rec in r.records] for r in ranks}
    counts = next(iter(per_rank_counts.values()))
    for rank, c in per_rank_counts.items():
        if len(c) != num_steps:
            bad(f"rank {rank} ran {len(c)} steps, the plan has {num_steps}")
        elif c != counts:
            bad(f"rank {rank} ran num_microbatches={c}, rank {ranks[0].rank} ran {counts}")
    if out:
        return out

    # one ledger per DP rank; its pipeline stages must agree
    by_dp: dict[int, list[list[list[int]]]] = {}
    for r in ranks:
        ledger = [[list(mb) for mb in rec.ledger] for rec in r.records]
        for s, (rec, mbs) in enumerate(zip(r.records, ledger)):
            if len(mbs) != rec.num_microbatches:
                bad(f"rank {r.rank} step {s}: ledger has {len(mbs)} micro-batches, num_microbatches="
                    f"{rec.num_microbatches}")
        first = by_dp.setdefault(r.dp_rank, ledger)
        if first is not ledger and first != ledger:
            bad(f"rank {r.rank} (dp {r.dp_rank}, pp {r.pp_rank}) consumed other micro-batches than "
                f"pipeline stage 0 of its DP replica")
    dp_size = len(plan.partitions)
    if sorted(by_dp) != list(range(dp_size)):
        bad(f"results came from DP ranks {sorted(by_dp)}, the plan has {dp_size}")
        return out

    schedule = plan.schedule
    for d in range(dp_size):
        partition = plan.partitions[d]
        if schedule is not None:
            mbi = schedule.micro_batch_indices[d]
            ends = list(accumulate(schedule.num_microbatches))
            for s, end in enumerate(ends):
                start = end - schedule.num_microbatches[s]
                want = [[partition[i] for i in mb] for mb in mbi[start:end]]
                if by_dp[d][s] != want:
                    bad(f"dp rank {d} step {s}: consumed micro-batches {by_dp[d][s]}, the schedule says {want}")
        else:
            per_step = len(partition) // max(1, num_steps)
            for s in range(num_steps):
                want = Counter(partition[s * per_step:(s + 1) * per_step])
                got = Counter(i for mb in by_dp[d][s] for i in mb)
                if got != want:
                    bad(f"dp rank {d} step {s}: consumed samples {sorted(got.elements())}, its share is "
                        f"{sorted(want.elements())}")

    seen: Counter = Counter()
    for s in range(num_steps):
        consumed = Counter(i for d in range(dp_size) for mb in by_dp[d][s] for i in mb)
        dup = sorted(i for i, c in consumed.items() if c > 1)
        if dup:
            bad(f"step {s}: samples {dup} were consumed more than once")
        if sorted(consumed) != sorted(plan.step_samples[s]):
            missing = sorted(set(plan.step_samples[s]) - set(consumed))
            extra = sorted(set(consumed) - set(plan.step_samples[s]))
            bad(f"step {s}: samples {missing} of the step were not consumed, {extra} were consumed but belong "
                f"to another step")
        for r in ranks:
            reported = r.records[s].samples
            if reported != len(plan.step_samples[s]):
                bad(f"rank {r.rank} step {s}: reports {reported} samples, the step has "
                    f"{len(plan.step_samples[s])}")
        seen.update(consumed)
    dropped = Counter(plan.dropped)
    both = sorted(set(seen) & set(dropped))
    if both:
        bad(f"samples {both} are reported dropped but were trained on")
    lost = sorted(set(range(plan.num_samples)) - set(seen) - set(dropped))
    if lost:
        bad(f"samples {lost} were neither trained on nor reported dropped")
    return out
