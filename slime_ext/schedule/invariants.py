"""The schedule's invariants, written once. Every test and ``slime-ext plan --from-json`` run them.

:func:`check_schedule` returns every violation as a readable line (empty list = valid);
:func:`assert_valid_schedule` raises :class:`ScheduleError` listing them.
"""

from __future__ import annotations

from itertools import chain
from typing import Sequence

from .dp_schedule import DPSchedule
from .errors import ScheduleError


def check_schedule(
    schedule: DPSchedule,
    *,
    total_lengths: Sequence[int] | None = None,
    rollout_ids: Sequence[int] | None = None,
    max_report: int = 50,
) -> list[str]:
    """All invariant violations of ``schedule``; ``total_lengths``/``rollout_ids`` re-check the recorded inputs."""
    out: list[str] = []

    def bad(msg: str) -> None:
        if len(out) < max_report:
            out.append(msg)

    sched = schedule
    dp = sched.parallel.dp_size
    align = sched.parallel.align
    lengths = sched.total_lengths
    n = len(lengths)
    if total_lengths is not None and list(map(int, total_lengths)) != list(lengths):
        bad("total_lengths recorded in the schedule differ from the input lengths")
    if rollout_ids is not None and (sched.rollout_ids is None or list(map(int, rollout_ids)) != sched.rollout_ids):
        bad("rollout_ids recorded in the schedule differ from the input rollout ids")
    rids = sched.rollout_ids if sched.rollout_ids is not None else list(range(n))
    if len(rids) != n:
        bad(f"rollout_ids has {len(rids)} entries for {n} samples")
        return out

    # same rank count; same number of micro-batches per rank
    if len(sched.partitions) != dp or len(sched.micro_batch_indices) != dp:
        bad(f"{len(sched.partitions)} partitions / {len(sched.micro_batch_indices)} micro-batch lists for dp_size={dp}")
        return out
    num_steps = len(sched.num_microbatches)
    if num_steps == 0:
        bad("the schedule has no steps")
    total_mbs = sum(sched.num_microbatches)
    for s, m in enumerate(sched.num_microbatches):
        if m < 1 or (m * dp) % align:
            bad(f"step {s}: num_microbatches={m} per rank; total {m * dp} is not a positive multiple of align={align}")
    for name in ("samples_per_step", "rollouts_per_step", "stats"):
        if len(getattr(sched, name)) != num_steps:
            bad(f"{name} has {len(getattr(sched, name))} entries for {num_steps} steps")
    if sched.loss_tokens_per_step is not None and len(sched.loss_tokens_per_step) != num_steps:
        bad(f"loss_tokens_per_step has {len(sched.loss_tokens_per_step)} entries for {num_steps} steps")

    cap = sched.cap
    mbs_limit = None if cap is not None else sched.batch.micro_batch_size
    step_of_sample: dict[int, int] = {}
    step_members: list[list[int]] = [[] for _ in range(num_steps)]
    for r in range(dp):
        part = sched.partitions[r]
        mbis = sched.micro_batch_indices[r]
        if len(mbis) != total_mbs:
            bad(f"rank {r} has {len(mbis)} micro-batches, expected sum(num_microbatches) = {total_mbs}")
            continue
        flat = list(chain.from_iterable(mbis))
        if flat != list(range(len(part))):
            bad(f"rank {r}: micro_batch_indices do not tile range({len(part)}) in order")
            continue
        k = 0
        for s, m in enumerate(sched.num_microbatches):
            for mb in mbis[k:k + m]:
                if not mb:
                    bad(f"rank {r} step {s}: empty micro-batch")
                    continue
                members = [part[i] for i in mb]
                if any(not 0 <= g < n for g in members):
                    bad(f"rank {r} step {s}: sample index outside [0, {n})")
                    continue
                tokens = sum(lengths[g] for g in members)
                if cap is not None and tokens > cap and len(members) > 1:
                    bad(f"rank {r} step {s}: micro-batch of {len(members)} samples has {tokens} tokens > cap {cap}")
                if mbs_limit is not None and len(members) > mbs_limit:
                    bad(f"rank {r} step {s}: static micro-batch of {len(members)} samples > micro_batch_size "
                        f"{mbs_limit}")
                for g in members:
                    if g in step_of_sample:
                        bad(f"sample {g} is scheduled twice")
                    step_of_sample[g] = s
                step_members[s].extend(members)
            k += m

    # disjoint union of partitions + dropped == every sample exactly once
    dropped = set(sched.dropped)
    if len(dropped) != len(sched.dropped):
        bad("dropped lists a sample twice")
    both = dropped & step_of_sample.keys()
    if both:
        bad(f"{len(both)} samples are both dropped and scheduled, e.g. {sorted(both)[:5]}")
    lost = set(range(n)) - dropped - step_of_sample.keys()
    if lost:
        bad(f"{len(lost)} samples are neither scheduled nor reported dropped, e.g. {sorted(lost)[:5]}")

    # rollout groups in one step; steps hold whole rollouts in first-occurrence order; dropped = trailing rollouts
    first_seen: dict[int, int] = {}
    for i, rid in enumerate(rids):
        first_seen.setdefault(rid, i)
    rollout_order = sorted(first_seen, key=first_seen.get)
    ordinal = {rid: o for o, rid in enumerate(rollout_order)}
    rollout_step: dict[int, int] = {}
    for g, s in step_of_sample.items():
        rid = rids[g]
        if rollout_step.setdefault(rid, s) != s:
            bad(f"rollout {rid} is split across steps {rollout_step[rid]} and {s}")
    for g in dropped:
        if rids[g] in rollout_step:
            bad(f"rollout {rids[g]} is partly dropped and partly scheduled")
    prev_max = -1
    for s in range(num_steps):
        ords = sorted({ordinal[rids[g]] for g in step_members[s]})
        if ords and (ords[0] != prev_max + 1 or ords[-1] - ords[0] + 1 != len(ords)):
            bad(f"step {s} does not hold consecutive whole rollouts (rollout ordinals {ords[0]}..{ords[-1]})")
        if ords:
            prev_max = ords[-1]
        if s < len(sched.samples_per_step) and sched.samples_per_step[s] != len(step_members[s]):
            bad(f"step {s}: samples_per_step={sched.samples_per_step[s]} but {len(step_members[s])} scheduled")
        if s < len(sched.rollouts_per_step) and sched.rollouts_per_step[s] != len(ords):
            bad(f"step {s}: rollouts_per_step={sched.rollouts_per_step[s]} but {len(ords)} rollouts scheduled")
        if sched.loss_tokens is not None and sched.loss_tokens_per_step is not None and s < len(
                sched.loss_tokens_per_step):
            got = sum(sched.loss_tokens[g] for g in step_members[s])
            if got != sched.loss_tokens_per_step[s]:
                bad(f"step {s}: loss_tokens_per_step={sched.loss_tokens_per_step[s]} but the samples hold {got}")
    if any(ordinal[rids[g]] <= prev_max for g in dropped):
        bad("dropped holds samples of a rollout before the last scheduled one (only trailing rollouts may drop)")
    if not sched.batch.use_dynamic_global_batch_size:
        gbs = sched.batch.global_batch_size
        if any(x != gbs for x in sched.rollouts_per_step):
            bad(f"rollouts_per_step={sched.rollouts_per_step} but global_batch_size={gbs}")
        if len({ordinal[rids[g]] for g in dropped}) >= (gbs or 1):
            bad("dropped holds a whole step's worth of rollouts")
    if sched.batch.disable_rollout_trim_samples and dropped:
        bad("disable_rollout_trim_samples is set but samples were dropped")
    return out


def assert_valid_schedule(schedule: DPSchedule, **kwargs) -> None:
    """Raise :class:`ScheduleError` listing every violation of :func:`check_schedule`."""
    problems = check_schedule(schedule, **kwargs)
    if problems:
        raise ScheduleError("invalid schedule:\n  " + "\n  ".join(problems))
