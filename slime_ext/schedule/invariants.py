"""The schedule's invariants (:mod:`.planner`'s docstring lists them), written once: :func:`check_schedule` returns
every violation as a readable line (empty: valid). Every test and ``slime-ext plan --from-json`` run them."""

from __future__ import annotations

from itertools import chain
from typing import Sequence

import numpy as np

from .bounds import bin_lower_bound, microbatch_target
from .config import BatchConfig, ParallelConfig
from .cost import CostModel, sample_costs
from .profile import CostProfile
from .dp_schedule import DPSchedule, StepStats, fields_from_dict
from .errors import ScheduleError
from .pipeline_model import PipelineSpec, bubble_fraction, pipeline_makespan
from .planner_config import DEFAULT_CONFIG, ObjectiveConfig
from .stages import StageCosts
from .validate import check_int_array

def check_schedule(schedule: DPSchedule, *, total_lengths: Sequence[int] | None = None,
                   rollout_ids: Sequence[int] | None = None, max_report: int = 50) -> list[str]:
    """All invariant violations of ``schedule``; ``total_lengths``/``rollout_ids`` re-check the recorded inputs."""
    out: list[str] = []

    def bad(msg: str) -> None:
        if len(out) < max_report:
            out.append(msg)

    sched = schedule
    problem = input_problem(sched)  # the recorded inputs and every field's type, by the planner's own rules
    if problem:
        bad(problem)
        return out
    rids = _check_given_inputs(sched, total_lengths, rollout_ids, bad)
    if rids is None or not _check_counts(sched, bad):
        return out
    step_of_sample, step_members, measured = _walk_ranks(sched, bad)
    # disjoint union of partitions + dropped == every sample exactly once
    dropped = set(sched.dropped)
    if len(dropped) != len(sched.dropped):
        bad("dropped lists a sample twice")
    both = dropped & step_of_sample.keys()
    if both:
        bad(f"{len(both)} samples are both dropped and scheduled, e.g. {sorted(both)[:5]}")
    lost = set(range(len(sched.total_lengths))) - dropped - step_of_sample.keys()
    if lost:
        bad(f"{len(lost)} samples are neither scheduled nor reported dropped, e.g. {sorted(lost)[:5]}")
    fixed = sched.microbatches_per_rank
    if fixed is not None and any(m != fixed for m in sched.num_microbatches):
        bad(f"num_microbatches={sched.num_microbatches} but the request fixed microbatches_per_rank={fixed}")
    if sched.step_of is not None:
        _check_explicit_steps(sched, rids, step_members, dropped, bad)
    else:
        _check_rollout_steps(sched, rids, step_of_sample, step_members, dropped, bad)
    if sched.step_samples:  # optional (a diagnostic for ledgers), but when recorded it must be the steps' samples
        if len(sched.step_samples) != len(step_members):
            bad(f"step_samples has {len(sched.step_samples)} entries for {len(step_members)} steps")
        for s, (recorded, members) in enumerate(zip(sched.step_samples, step_members)):
            if sorted(recorded) != sorted(members):
                bad(f"step {s}: step_samples does not list the step's {len(members)} scheduled samples")
    if not out:
        _check_stats(sched, measured, bad)
    return out


def _check_given_inputs(sched: DPSchedule, total_lengths, rollout_ids, bad) -> list[int] | None:
    """The caller's inputs against the recorded ones; the rollout id of every sample, ``None`` where checking stops."""
    n = len(sched.total_lengths)
    try:
        given_lengths = None if total_lengths is None else check_int_array("total_lengths", total_lengths).tolist()
        given_ids = None if rollout_ids is None else check_int_array("rollout_ids", rollout_ids).tolist()
    except ScheduleError as e:
        bad(f"the given {e}")
        return None
    if given_lengths is not None and given_lengths != list(sched.total_lengths):
        bad("total_lengths recorded in the schedule differ from the input lengths")
    if given_ids is not None and (sched.rollout_ids is None or given_ids != sched.rollout_ids):
        bad("rollout_ids recorded in the schedule differ from the input rollout ids")
    rids = sched.rollout_ids if sched.rollout_ids is not None else list(range(n))
    if len(rids) != n:
        bad(f"rollout_ids has {len(rids)} entries for {n} samples")
        return None
    return rids


def _check_counts(sched: DPSchedule, bad) -> bool:
    """Ranks, steps and per-step list lengths; ``False`` where the structure cannot be walked."""
    dp, align, n = sched.parallel.dp_size, sched.parallel.align, len(sched.total_lengths)
    if len(sched.partitions) != dp or len(sched.micro_batch_indices) != dp:
        bad(f"{len(sched.partitions)} partitions / {len(sched.micro_batch_indices)} micro-batch lists for dp_size={dp}")
        return False
    num_steps = len(sched.num_microbatches)
    if num_steps == 0:
        bad("the schedule has no steps")
    total_mbs = sum(sched.num_microbatches)
    if total_mbs > n:  # every micro-batch holds a sample: no rank can have more micro-batches than samples
        bad(f"num_microbatches sums to {total_mbs} per rank, more than the {n} samples")
        return False
    outside = [g for g in sched.dropped if not 0 <= g < n]
    if outside:
        bad(f"dropped lists sample indices outside [0, {n}), e.g. {outside[:5]}")
        return False
    for s, m in enumerate(sched.num_microbatches):
        if m < 1 or (m * dp) % align:
            bad(f"step {s}: num_microbatches={m} per rank; total {m * dp} is not a positive multiple of align={align}")
    for name in ("samples_per_step", "rollouts_per_step", "stats", "loss_tokens_per_step"):  # the last may be None
        per_step = getattr(sched, name)
        if per_step is not None and len(per_step) != num_steps:
            bad(f"{name} has {len(per_step)} entries for {num_steps} steps")
    return True


def _walk_ranks(sched: DPSchedule, bad):
    """Every rank's micro-batches: tiling, cap, size, each sample once. Returns each sample's step (``None``: on a
    broken rank), each step's samples and per step ``(rank, tokens, members)``."""
    lengths, n, num_steps = sched.total_lengths, len(sched.total_lengths), len(sched.num_microbatches)
    cap, total_mbs = sched.cap, sum(sched.num_microbatches)
    mbs_limit = None if cap is not None else sched.batch.micro_batch_size
    step_of_mb = [s for s, m in enumerate(sched.num_microbatches) for _ in range(m)]
    step_of_sample: dict[int, int | None] = {}
    step_members: list[list[int]] = [[] for _ in range(num_steps)]
    measured: list[list[tuple[int, int, list[int]]]] = [[] for _ in range(num_steps)]  # (rank, tokens, members)

    def account(g: int, s: int | None) -> None:
        if g in step_of_sample:
            bad(f"sample {g} is scheduled twice")
        step_of_sample[g] = s
        if s is not None:
            step_members[s].append(g)

    for r in range(sched.parallel.dp_size):
        part = sched.partitions[r]
        mbis = sched.micro_batch_indices[r]
        steps_here: list[int | None] = step_of_mb
        if len(mbis) != total_mbs:
            bad(f"rank {r} has {len(mbis)} micro-batches, expected sum(num_microbatches) = {total_mbs}")
            steps_here = [None] * len(mbis)
        if list(chain.from_iterable(mbis)) != list(range(len(part))):
            bad(f"rank {r}: micro_batch_indices do not tile range({len(part)}) in order")
            for g in part:  # still account for its samples, so one broken rank does not read as lost samples
                if 0 <= g < n:
                    account(g, None)
            continue
        for mb, s in zip(mbis, steps_here):
            where = f"rank {r} step {s}" if s is not None else f"rank {r}"
            if not mb:
                bad(f"{where}: empty micro-batch")
                continue
            members = [part[i] for i in mb]
            if any(not 0 <= g < n for g in members):
                bad(f"{where}: sample index outside [0, {n})")
                continue
            tokens = sum(lengths[g] for g in members)
            if cap is not None and tokens > cap and len(members) > 1:
                bad(f"{where}: micro-batch of {len(members)} samples has {tokens} tokens > cap {cap}")
            if mbs_limit is not None and len(members) > mbs_limit:
                bad(f"{where}: static micro-batch of {len(members)} samples > micro_batch_size {mbs_limit}")
            for g in members:
                account(g, s)
            if s is not None:
                measured[s].append((r, tokens, members))
    return step_of_sample, step_members, measured


def _check_rollout_steps(sched: DPSchedule, rids: list[int], step_of_sample: dict[int, int | None],
                         step_members: list[list[int]], dropped: set[int], bad) -> None:
    """Derived steps: whole rollouts in first-occurrence order, ``global_batch_size`` each, only trailing ones
    dropped."""
    num_steps, dp, n = len(sched.num_microbatches), sched.parallel.dp_size, len(sched.total_lengths)
    ordinal = {rid: o for o, rid in enumerate(dict.fromkeys(rids))}  # rollouts in first-occurrence order
    rollout_step: dict[int, int] = {}
    for g, s in step_of_sample.items():
        if s is None:
            continue
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
        _check_step_counts(sched, s, step_members[s], len(ords), bad)
    if any(ordinal[rids[g]] <= prev_max for g in dropped):
        bad("dropped holds samples of a rollout before the last scheduled one (only trailing rollouts may drop)")
    if not sched.batch.use_dynamic_global_batch_size:
        gbs = sched.batch.global_batch_size
        if any(x != gbs for x in sched.rollouts_per_step):
            bad(f"rollouts_per_step={sched.rollouts_per_step} but global_batch_size={gbs}")
        if len({ordinal[rids[g]] for g in dropped}) >= (gbs or 1):
            bad("dropped holds a whole step's worth of rollouts")
    else:  # one step of whole rollouts (the trailing ones the layout cannot train are dropped)
        if num_steps > 1:
            bad(f"use_dynamic_global_batch_size plans one step, not {num_steps}")
        rounds = sched.batch.dynamic_global_batch_rounds_samples and not sched.batch.disable_rollout_trim_samples
        budget = max(dp, (n // dp) * dp)
        if rounds and n - len(dropped) > budget:
            bad(f"use_dynamic_global_batch_size (slime v0.2.4's rule) keeps at most {budget} samples (the sample "
                f"count rounded down to a multiple of dp_size), not {n - len(dropped)}")
    if sched.batch.disable_rollout_trim_samples and dropped:
        bad("disable_rollout_trim_samples is set but samples were dropped")


def _check_explicit_steps(sched: DPSchedule, rids: list[int], step_members: list[list[int]], dropped: set[int],
                          bad) -> None:
    """Explicit steps (``step_of``): each holds exactly its given samples, nothing dropped."""
    step_of, n = sched.step_of, len(sched.total_lengths)
    if len(step_of) != n:
        bad(f"step_of has {len(step_of)} entries for {n} samples")
        return
    if dropped:
        bad(f"explicit steps drop nothing, but {len(dropped)} samples are dropped")
    for s, members in enumerate(step_members):
        wrong = [g for g in members if step_of[g] != s]
        if wrong:
            bad(f"step {s} holds sample {wrong[0]}, whose step_of is {step_of[wrong[0]]}")
        _check_step_counts(sched, s, members, len({rids[g] for g in members}), bad)
    if max(step_of, default=-1) >= len(step_members):
        bad(f"step_of names step {max(step_of)} but the schedule has {len(step_members)} steps")


def _check_step_counts(sched: DPSchedule, s: int, members: list[int], rollouts: int, bad) -> None:
    """Step ``s``'s recorded sample, rollout and loss-token counts against its samples."""
    if s < len(sched.samples_per_step) and sched.samples_per_step[s] != len(members):
        bad(f"step {s}: samples_per_step={sched.samples_per_step[s]} but {len(members)} scheduled")
    if s < len(sched.rollouts_per_step) and sched.rollouts_per_step[s] != rollouts:
        bad(f"step {s}: rollouts_per_step={sched.rollouts_per_step[s]} but {rollouts} rollouts scheduled")
    if sched.loss_tokens is not None and sched.loss_tokens_per_step is not None and s < len(
            sched.loss_tokens_per_step):
        got = sum(sched.loss_tokens[g] for g in members)
        if got != sched.loss_tokens_per_step[s]:
            bad(f"step {s}: loss_tokens_per_step={sched.loss_tokens_per_step[s]} but the samples hold {got}")


def input_problem(sched: DPSchedule) -> str | None:
    """Why ``sched``'s fields or recorded inputs are not what :meth:`DPSchedule.from_dict` accepts, or ``None``."""
    if not isinstance(sched, DPSchedule):
        return f"not a DPSchedule: {type(sched).__name__}"
    kinds = ((sched.parallel, ParallelConfig), (sched.batch, BatchConfig))
    if any(not isinstance(value, kind) for value, kind in kinds) or not isinstance(sched.stats, list) \
            or not all(isinstance(s, StepStats) for s in sched.stats) \
            or not (sched.cost_model is None or isinstance(sched.cost_model, (CostModel, CostProfile))):
        return ("parallel, batch, stats or cost_model is not a ParallelConfig, BatchConfig, list of StepStats, "
                "CostModel or CostProfile")
    try:
        fields_from_dict(sched.to_dict())
    except ScheduleError as e:
        return f"recorded input: {e}"
    return None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1e-300)


def _check_stats(sched: DPSchedule, measured, bad) -> None:
    """``stats`` against the schedule, re-measured from its structure."""
    lengths = np.asarray(sched.total_lengths, dtype=np.int64)
    costs = sample_costs(lengths, sched.cost_model)
    dp, cap, align = sched.parallel.dp_size, sched.cap, sched.parallel.align
    for s, (st, mbs) in enumerate(zip(sched.stats, measured)):
        members = [g for _, _, m in mbs for g in m]
        mb_cost = [float(costs[m].sum()) for _, _, m in mbs]
        rank_cost = np.bincount([r for r, _, _ in mbs], weights=mb_cost, minlength=dp)
        expect = dict(
            step=s, num_samples=len(members), total_tokens=int(lengths[members].sum()),
            num_microbatches=sched.num_microbatches[s], total_microbatches=sched.num_microbatches[s] * dp, cap=cap,
            num_rollouts=sched.rollouts_per_step[s],
            packing_target=(sched.microbatches_per_rank * dp if sched.microbatches_per_rank is not None
                            else microbatch_target(lengths[members], cap, align) if cap is not None
                            else -(-len(members) // sched.batch.micro_batch_size)),
            largest_bin_tokens=max(t for _, t, _ in mbs),
            cap_violations=sum(1 for _, t, m in mbs if cap is not None and t > cap and len(m) > 1))
        for name, value in expect.items():
            if getattr(st, name) != value:
                bad(f"stats[{s}].{name} = {getattr(st, name)!r} but the schedule has {value!r}")
        floats = dict(rank_cost_max=float(rank_cost.max()), rank_cost_mean=float(rank_cost.mean()),
                      microbatch_cost_max=max(mb_cost), microbatch_cost_mean=float(np.mean(mb_cost)),
                      balance_lower_bound=max(1.0, float(costs[members].max()) / float(rank_cost.mean())))
        for name, value in floats.items():
            if not _close(getattr(st, name), value):
                bad(f"stats[{s}].{name} = {getattr(st, name)!r} but the schedule measures {value!r}")
        _check_pipeline_stats(sched, s, st, bad)
        if cap is not None:  # no packing beats the true lower bound
            floor = -(-bin_lower_bound(lengths[members], cap) // align) * align
            if expect["total_microbatches"] < floor:
                bad(f"step {s}: {expect['total_microbatches']} micro-batches is below the lower bound {floor}")


def _stage_shares(parallel: ParallelConfig, cost_model, cap: int | None, objective: ObjectiveConfig
                  ) -> np.ndarray | None:
    """Each virtual stage's share of a micro-batch by :mod:`.pipeline_pricing`'s rule (``None``: all alike)."""
    stages = StageCosts.if_split(cost_model, parallel)
    if stages is None or not stages.uneven:
        return None
    tokens = float(cap if cap is not None else objective.stage_share_tokens)
    weight = [lin * tokens + quad * tokens * tokens * objective.stage_share_sample
              for lin, quad in zip(stages.virtual_linear, stages.virtual_quadratic)]
    return np.asarray(weight) / sum(weight)


def replica_makespans(sched: DPSchedule, step: int, *, forward_only: bool = False) -> np.ndarray:
    """:func:`micro_batch_makespans` of ``step``'s micro-batches, replica by replica."""
    lengths = np.asarray(sched.total_lengths, dtype=np.int64)
    start, m = sum(sched.num_microbatches[:step]), sched.num_microbatches[step]
    replicas = [[lengths[[sched.partitions[r][i] for i in mb]] for mb in sched.micro_batch_indices[r][start:start + m]]
                for r in range(sched.dp_size)]
    return micro_batch_makespans(sched.parallel, sched.cost_model, sched.cap, replicas, forward_only=forward_only,
                                 objective=sched.objective)


def micro_batch_makespans(parallel: ParallelConfig, cost_model, cap: int | None,
                          replicas: Sequence[Sequence[Sequence[int]]], *, forward_only: bool = False,
                          objective: ObjectiveConfig = DEFAULT_CONFIG.objective):
    """Each replica's makespan (``replicas[r][k]``: the lengths of replica ``r``'s ``k``-th micro-batch), priced by
    :mod:`.pipeline_pricing`'s documented rule under ``objective``, not its code, so a pricing bug shows.
    Returns ``(spans (R,), forward (R, pp * vpp, M), backward/forward ratio, spec)``."""
    pp, vpp = parallel.pp_size, parallel.vpp_size
    m = len(replicas[0]) if len(replicas) else 0
    if any(len(mbs) != m for mbs in replicas):
        raise ScheduleError(f"replicas have {sorted({len(mbs) for mbs in replicas})} micro-batches: the pipeline "
                            f"runs the same count on every replica")
    profile = cost_model if isinstance(cost_model, CostProfile) else None
    ratio = objective.backward_forward_ratio if profile is None else profile.backward_forward_ratio
    linear, quadratic = cost_model.coefficients() if cost_model is not None else (1.0, 0.0)
    overhead = objective.microbatch_overhead * linear * cap if cap is not None else 0.0
    whole = np.zeros((len(replicas), m))  # each micro-batch's forward + backward, whole model
    for r, mbs in enumerate(replicas):
        for k, mb in enumerate(mbs):
            ls = np.asarray(mb, dtype=np.int64)
            if profile is not None:
                whole[r, k] = profile.microbatch_time(ls)
            else:
                forward = float(np.sum(linear * ls + quadratic * ls.astype(np.float64) ** 2)) + overhead
                whole[r, k] = forward * (1 + ratio)
    share = _stage_shares(parallel, cost_model, cap, objective)
    if share is None:
        share = np.full(pp * vpp, 1.0 / (pp * vpp))
    forward = whole[:, None, :] / (1 + ratio) * share[None, :, None]  # (R, pp * vpp, M): one chunk each
    spec = PipelineSpec(pp, vpp, parallel.microbatch_group_size_per_vp_stage if vpp > 1 else None,
                        p2p_s=0.0 if profile is None else profile.p2p_s,
                        overlap_p2p_comm=parallel.overlap_p2p_comm, forward_only=forward_only)
    ratio = 0.0 if forward_only else ratio
    return np.atleast_1d(pipeline_makespan(forward, ratio * forward, spec)), forward, ratio, spec


def _check_pipeline_stats(sched: DPSchedule, s: int, st: StepStats, bad) -> None:
    """``predicted_makespan`` / ``bubble_fraction``: ``None`` without a pipeline, else the slowest replica's."""
    if sched.parallel.pp_size == 1:
        for name in ("predicted_makespan", "bubble_fraction"):
            if getattr(st, name) is not None:
                bad(f"stats[{s}].{name} = {getattr(st, name)!r} but pp_size = 1 (expected None)")
        return
    if st.predicted_makespan is None or st.bubble_fraction is None:
        bad(f"stats[{s}] has no predicted_makespan/bubble_fraction but pp_size = {sched.parallel.pp_size}")
        return
    try:
        spans, forward, ratio, spec = replica_makespans(sched, s, forward_only=sched.forward_only)
    except ScheduleError as e:
        bad(f"step {s}: the pipeline model refuses the step: {e}")
        return
    slowest = int(np.argmax(spans))
    if not _close(st.predicted_makespan, float(spans[slowest])):
        bad(f"stats[{s}].predicted_makespan = {st.predicted_makespan!r} but the schedule predicts "
            f"{float(spans[slowest])!r}")
    # the slowest replica's bubble; replicas tied with it (to the makespan's tolerance: integer token costs tie
    # often, and rounding may rank them either way) are each the slowest
    tied = [r for r in range(len(spans)) if _close(float(spans[r]), float(spans[slowest]))]
    bubbles = [float(bubble_fraction(forward[r:r + 1], ratio * forward[r:r + 1], spec)[0]) for r in tied]
    if not any(_close(st.bubble_fraction, b) for b in bubbles):
        predicted = f"{bubbles[0]!r}" if len(bubbles) == 1 else f"one of {bubbles!r} ({len(bubbles)} replicas tied)"
        bad(f"stats[{s}].bubble_fraction = {st.bubble_fraction!r} but the schedule predicts {predicted}")
