"""``dp_schedule: legacy`` -- upstream slime's training-side scheme, written here in our own code.

What upstream does, and so what this scheme does (upstream's code is not used or copied; the reference scheme
imports upstream where a comparison needs it, :mod:`slime_ext.schemes.reference`):

1. **Rollout side** (:meth:`LegacySchedule.plan`): ``global_batch_size`` counts *samples* (with
   ``use_dynamic_global_batch_size``: the rollout rounded down to a multiple of ``dp_size``). The rollout is cut
   to whole steps (the tail trimmed, or refused with ``disable_rollout_trim_samples``) and its samples are split
   over the DP ranks once, for all steps: strided, or with ``balance_data`` into groups of even tokens
   (:func:`balanced_groups`, equal counts where ``dp_size`` divides the samples). No micro-batch plan travels.
2. **Each training rank** (:class:`LegacyRank`, upstream's ``get_data_iterator``) cuts its samples into local steps
   of ``global_batch_size / dp_size`` samples. Static batches: ``micro_batch_size`` samples each. Dynamic batches:
   per step, the number of bins arrival-order first fit needs under the cap (:func:`first_fit_count`); then
   ``all_reduce(MAX)`` of those counts over the DP group, so every rank runs as many micro-batches as the fullest
   one needs; with VPP the count is rounded *down* to a whole ``microbatch_group_size_per_vp_stage`` (at least 1);
   then the step's samples are dealt into that many micro-batches of even tokens (:func:`balanced_groups`),
   *without* the cap -- a rank whose own first fit needed fewer bins gets fuller ones, and rounding down can
   overfill them too.
3. **LR**: the scheduler advances by ``global_batch_size`` per step, whatever the step held.

Where upstream would silently drop samples or hand Megatron's interleaved schedule a count that is not a whole
micro-batch group, :class:`LegacyPlanError` says so instead.

One implementation serves every caller: the running job (:meth:`LegacySchedule.iterators`, with a real
all-reduce), the run-config pre-check (:meth:`LegacySchedule.dry_run`) and the benchmark and ``plan --compare``
(:meth:`LegacySchedule.schedule`), the last two simulating every rank in one process.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from slime_ext.schedule import (BatchConfig, CostModel, DPSchedule, ParallelConfig, RankPayload, SampleBatch,
                                ScheduleError)
from slime_ext.schedule.steps import compute_dynamic_global_batch_size

from . import data
from .base import Baseline, NotComparable, RankSteps, RolloutPlan, SameInput, Scheme, SchemeSchedule
from .records import LegacyStepRecord


class LegacyPlanError(ScheduleError):
    """The legacy scheme cannot plan these samples; the message names the key, the value and the fix."""


# ---------------------------------------------------------------------------------------------------- building blocks
def first_fit_count(lengths: Sequence[int], cap: int) -> int:
    """How many bins arrival-order first fit opens: each sample joins the earliest bin with room for it, else opens
    a new one. A sample above ``cap`` opens a bin that takes nothing else."""
    room: list[int] = []  # free tokens per open bin, in opening order
    for length in lengths:
        j = next((j for j, free in enumerate(room) if free >= length), None)
        if j is None:
            room.append(cap - length)
        else:
            room[j] -= length
    return len(room)


def balanced_groups(weights: Sequence[int], k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Indices ``0..n-1`` dealt into ``k`` groups of even total weight, each group listed in increasing order.

    A greedy deal (longest processing time first): heaviest item first (ties: the lower index), each to the group
    with the smallest total so far (ties: fewer items, then the lower group number), skipping groups that already
    hold ``n / k`` items when ``equal_size``. With ``n >= k`` no group is empty: the first ``k`` items open one each.
    """
    n = len(weights)
    if not 1 <= k <= n:
        raise LegacyPlanError(f"{n} items cannot fill {k} groups; every micro-batch and every DP rank needs at least "
                              f"one sample")
    if equal_size and n % k:
        raise LegacyPlanError(f"{n} items cannot make {k} groups of equal size")
    limit = n // k if equal_size else n
    groups: list[list[int]] = [[] for _ in range(k)]
    open_groups = [(0, 0, g) for g in range(k)]  # (total weight, items, group): a min-heap, already ordered
    for i in sorted(range(n), key=lambda i: (-weights[i], i)):
        total, count, g = heapq.heappop(open_groups)
        groups[g].append(i)
        if count + 1 < limit:
            heapq.heappush(open_groups, (total + weights[i], count + 1, g))
    return [sorted(g) for g in groups]


def split_over_ranks(lengths: Sequence[int], dp_size: int, balance_data: bool) -> list[list[int]]:
    """The rollout side's split of the kept samples over the DP ranks: strided, or even by tokens with
    ``balance_data`` (equal sample counts where ``dp_size`` divides them, as upstream; otherwise uneven)."""
    if balance_data:
        return balanced_groups(lengths, dp_size, equal_size=len(lengths) % dp_size == 0)
    return [list(range(r, len(lengths), dp_size)) for r in range(dp_size)]


@dataclass(frozen=True)
class LegacyRank:
    """How one training rank plans its samples (upstream's ``get_data_iterator``; module docstring, stage 2)."""

    #: samples per step over all ranks (upstream's meaning of ``global_batch_size``)
    global_batch_size: int
    dp_size: int
    #: dynamic batches: the token cap, ``max_tokens_per_gpu * cp_size``; static batches: ``None``
    cap: int | None
    #: static batches: samples per micro-batch
    micro_batch_size: int | None
    vpp_size: int = 1
    #: ``microbatch_group_size_per_vp_stage`` (1 without VPP)
    group: int = 1

    def __post_init__(self) -> None:
        if self.global_batch_size % self.dp_size:
            raise LegacyPlanError(f"global_batch_size={self.global_batch_size} (samples per step on the legacy path) "
                                  f"must be a multiple of dp_size={self.dp_size}")

    @property
    def per_step(self) -> int:
        """Samples per local step."""
        return self.global_batch_size // self.dp_size

    def counts(self, lengths: Sequence[int]) -> list[int]:
        """This rank's micro-batches per step before the ranks agree: static, ``per_step / micro_batch_size``;
        dynamic, the first-fit bin count of each step."""
        local, n = self.per_step, len(lengths)
        num_steps, tail = divmod(n, local)
        if num_steps == 0 or tail:
            raise LegacyPlanError(
                f"this rank has {n} samples, not a positive multiple of global_batch_size/dp_size = {local}; the "
                f"legacy path would drop {tail if num_steps else n} samples. Send a multiple of {local} samples per "
                f"rank (or use --dp-schedule rollout)")
        if self.cap is not None:
            return [first_fit_count(lengths[s * local:(s + 1) * local], self.cap) for s in range(num_steps)]
        mbs = self.micro_batch_size
        if local % mbs:
            raise LegacyPlanError(f"global_batch_size/dp_size = {local} is not a multiple of micro_batch_size={mbs}; "
                                  f"make global_batch_size a multiple of {self.dp_size * mbs}")
        if self.vpp_size > 1 and (local // mbs) % self.group:
            raise LegacyPlanError(
                f"global_batch_size={self.global_batch_size}: {local // mbs} micro-batches per rank and step is not "
                f"a multiple of microbatch_group_size_per_vp_stage={self.group} (Megatron's interleaved schedule); "
                f"make global_batch_size a multiple of {self.dp_size * mbs * self.group}")
        return [local // mbs] * num_steps

    def agree(self, peak: Sequence[int]) -> list[int]:
        """The counts every rank runs, from the DP group's MAX: with VPP rounded down to a whole group (at least 1,
        as upstream), refused where that leaves less than one group."""
        if self.vpp_size <= 1:
            return list(peak)
        counts = [max(1, c // self.group * self.group) for c in peak]
        for s, (found, c) in enumerate(zip(peak, counts)):
            if c % self.group:
                raise LegacyPlanError(
                    f"step {s}: {found} micro-batches, below one microbatch_group_size_per_vp_stage={self.group}; "
                    f"upstream rounds that to {c}, which Megatron's interleaved schedule cannot run. Raise "
                    f"--global-batch-size, lower --max-tokens-per-gpu, or use --dp-schedule rollout")
        return counts

    def micro_batches(self, lengths: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
        """Local sample indices of each micro-batch, steps in order: static, consecutive ``micro_batch_size``
        samples; dynamic, each step dealt into ``counts[s]`` groups of even tokens, with no cap."""
        if self.cap is None:
            mbs = self.micro_batch_size
            return [list(range(i, i + mbs)) for i in range(0, len(lengths), mbs)]
        out: list[list[int]] = []
        for s, k in enumerate(counts):
            first = s * self.per_step
            step = lengths[first:first + self.per_step]
            out += [[first + i for i in g] for g in balanced_groups(step, k)]
        return out

    def plan(self, lengths: Sequence[int], reduce_max: Callable[[list[int]], list[int]]
             ) -> tuple[list[list[int]], list[int], list[int]]:
        """``(micro_batch_indices, num_microbatches, local counts)`` of one rank; ``reduce_max`` is the DP group's
        ``all_reduce(MAX)`` of the per-step counts (dynamic batches only: static counts are the same everywhere);
        the local counts are this rank's own (:meth:`counts`), before the ranks agree."""
        local = self.counts(lengths)
        counts = self.agree(reduce_max(local)) if self.cap is not None else list(local)
        return self.micro_batches(lengths, counts), counts, local


@dataclass
class LegacySteps(RankSteps):
    """:class:`RankSteps` of the legacy path, with each step's count before the DP group's ``all_reduce(MAX)``."""

    local_microbatches: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------- the scheme
class LegacySchedule(Scheme, Baseline):
    """``dp_schedule: legacy`` (module docstring)."""

    name = "legacy"
    batch_unit = "samples"
    title = "the legacy path"
    step_record = LegacyStepRecord
    time_note = "ranks in parallel: split + slowest rank's count + slowest rank's partition"

    # ------------------------------------------------------------------ rollout side
    @staticmethod
    def samples_per_step(num_samples: int, args: Any, dp_size: int) -> int:
        """``global_batch_size`` in samples: the flag, or with ``use_dynamic_global_batch_size`` the rollout
        rounded down to a multiple of ``dp_size``."""
        if getattr(args, "use_dynamic_global_batch_size", False):
            if num_samples < dp_size:
                raise LegacyPlanError(f"the rollout has {num_samples} samples but dp_size={dp_size}: the legacy path "
                                      f"needs at least one sample per DP rank; collect more samples")
            return compute_dynamic_global_batch_size(num_samples, dp_size)
        gbs = getattr(args, "global_batch_size", None)
        if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs < 1 or gbs % dp_size:
            raise LegacyPlanError(f"global_batch_size={gbs!r} (samples per step on the legacy path) must be a "
                                  f"positive multiple of dp_size={dp_size}")
        return gbs

    def split(self, total_lengths: Sequence[int], args: Any, dp_size: int) -> tuple[int, int, list[list[int]]]:
        """``(samples per step, samples kept, each DP rank's sample ids)``: whole steps only, the tail trimmed (or
        refused), then the kept samples split over the ranks."""
        n = len(total_lengths)
        gbs = self.samples_per_step(n, args, dp_size)
        keep = n // gbs * gbs
        if keep == 0:
            raise LegacyPlanError(f"the rollout has {n} samples but global_batch_size={gbs} samples per step (legacy "
                                  f"path): not even one step; lower --global-batch-size or collect more samples")
        if keep < n and getattr(args, "disable_rollout_trim_samples", False):
            raise LegacyPlanError(f"the rollout has {n} samples, not a multiple of global_batch_size={gbs} (legacy "
                                  f"path); make it a multiple or drop --disable-rollout-trim-samples to trim the tail")
        return gbs, keep, split_over_ranks(total_lengths[:keep], dp_size, bool(getattr(args, "balance_data", False)))

    def plan(self, train_data: SampleBatch, args: Any, train_parallel_config: Mapping[str, int], *,
             rollout_id: int = 0) -> RolloutPlan:
        dp_size = int(train_parallel_config["dp_size"])
        n = len(train_data)
        gbs, keep, partitions = self.split(train_data.total_lengths, args, dp_size)
        payloads = [RankPayload(rollout_id=rollout_id, dp_rank=r, dp_size=dp_size, partition=list(p),
                                samples=train_data.take(p), global_batch_size=gbs) for r, p in enumerate(partitions)]
        local = gbs // dp_size  # each rank cuts its samples into steps of gbs / dp_size
        step_samples = [sorted(i for p in partitions for i in p[s * local:(s + 1) * local])
                        for s in range(keep // gbs)]
        dropped = list(range(keep, n))
        reason = ""
        if dropped:
            reason = (f"{len(dropped)} trailing samples do not fill a step of global_batch_size={gbs} samples "
                      f"(legacy path trims by samples, as upstream)")
        return RolloutPlan(dp_schedule=self.name, payloads=payloads, partitions=partitions,
                           step_samples=step_samples, dropped=dropped, dropped_reason=reason, num_samples=n)

    def easiest_length(self, batch: BatchConfig, shortest: int, longest: int) -> int:
        """Dynamic batches: the longest, whose first-fit counts are the largest (a count below one VPP group is what
        this scheme refuses); static batches: lengths do not matter."""
        return longest if batch.use_dynamic_batch_size else shortest

    # ------------------------------------------------------------------ every rank, simulated in one process
    @staticmethod
    def _ranks(rank_lengths: list[list[int]], rank: LegacyRank) -> tuple[list[list[list[int]]], list[int], dict]:
        """Every rank's plan, the all-reduce simulated: ``(micro_batch_indices per rank, counts, timings)``."""
        t_count, t_part, found = [], [], []
        for lengths in rank_lengths:
            t0 = time.perf_counter()
            found.append(rank.counts(lengths))
            t_count.append(time.perf_counter() - t0)
        if len({len(c) for c in found}) != 1:  # upstream's all-reduce would hang here
            raise LegacyPlanError(f"the DP ranks have {sorted({len(c) for c in found})} steps; every rank needs the "
                                  f"same number of samples (global_batch_size / dp_size per step)")
        counts = [max(c) for c in zip(*found)]  # the all-reduce (MAX)
        if rank.cap is not None:
            counts = rank.agree(counts)
        per_rank = []
        for lengths in rank_lengths:
            t0 = time.perf_counter()
            per_rank.append(rank.micro_batches(lengths, counts))
            t_part.append(time.perf_counter() - t0)
        return per_rank, counts, {"count": t_count, "partition": t_part}

    def dry_run(self, lengths: Sequence[int], rollout_ids: Sequence[int], args: Any, parallel: ParallelConfig,
                batch: BatchConfig) -> None:
        gbs, _, partitions = self.split(list(lengths), args, parallel.require_dp_size())
        self._ranks([[lengths[i] for i in p] for p in partitions], self._rank(gbs, parallel, batch))

    def schedule(self, lengths: Sequence[int], parallel: ParallelConfig, batch: BatchConfig, *,
                 global_batch_size: int, rollout_ids: Sequence[int] | None = None,
                 cost_model: CostModel | None = None) -> SchemeSchedule:
        """The whole rollout, every rank simulated (``lengths`` a whole number of steps of ``global_batch_size``
        samples). ``timings``: the split, then per rank the count and partition phases; in production the ranks run
        in parallel, so ``wall`` is ``split + slowest count + slowest partition`` (the all-reduce sits between)."""
        lengths = [int(x) for x in lengths]
        t0 = time.perf_counter()
        rank_samples = split_over_ranks(lengths, parallel.require_dp_size(), batch.balance_data)
        t_split = time.perf_counter() - t0
        local_mbs, counts, timings = self._ranks([[lengths[i] for i in p] for p in rank_samples],
                                                 self._rank(global_batch_size, parallel, batch))
        partitions, micro_batch_indices = [], []
        for samples, mbs in zip(rank_samples, local_mbs):  # re-expressed in DPSchedule's shape
            part: list[int] = []
            mbis = []
            for mb in mbs:
                mbis.append(list(range(len(part), len(part) + len(mb))))
                part.extend(samples[i] for i in mb)
            partitions.append(part)
            micro_batch_indices.append(mbis)
        t_count, t_part = timings["count"], timings["partition"]
        timings.update(split=t_split, wall=t_split + max(t_count) + max(t_part),
                       cpu=t_split + sum(t_count) + sum(t_part))
        return SchemeSchedule(partitions, micro_batch_indices, counts, timings)

    def same_input(self, ours: DPSchedule, batch: BatchConfig, cost_model: CostModel | None) -> SameInput:
        """The samples ours trains, in step order, in steps of as many samples as ours' (which must all be equal
        and a multiple of ``dp_size``: ``global_batch_size`` counts samples here)."""
        sizes = sorted(set(ours.samples_per_step))
        if len(sizes) != 1:
            raise NotComparable(f"legacy counts global_batch_size in samples and needs the same number in every "
                                f"step (here {sizes[0]}..{sizes[-1]})")
        if sizes[0] % ours.dp_size:
            raise NotComparable(f"{sizes[0]} samples per step is not a multiple of dp_size={ours.dp_size}")
        kept = [i for step in ours.step_samples for i in step]
        return SameInput(sample_ids=kept, global_batch_size=sizes[0], rollout_ids=list(range(len(kept))))

    def note(self, batch: BatchConfig) -> str:
        return "legacy has no balance_by_flops (run without it)" if batch.balance_by_flops else ""

    @staticmethod
    def _rank(gbs: int, parallel: ParallelConfig, batch: BatchConfig) -> LegacyRank:
        return LegacyRank(global_batch_size=gbs, dp_size=parallel.dp_size, cap=batch.cap(parallel.cp_size),
                          micro_batch_size=batch.micro_batch_size, vpp_size=parallel.vpp_size,
                          group=parallel.microbatch_group_size_per_vp_stage or 1)

    # ------------------------------------------------------------------ training side
    def iterators(self, args: Any, model: Any, payload: RankPayload, *, vpp: int | None = None):
        """Plan this rank's payload here: Megatron's sizes, the real ``all_reduce(MAX)`` over the DP group."""
        payload = data.check_payload(payload, planned=False)
        dp_size, dp_group, vpp_size, group, cp_size = data.parallel_sizes(model)
        dynamic = bool(args.use_dynamic_batch_size)
        rank = LegacyRank(global_batch_size=payload.global_batch_size, dp_size=dp_size,
                          cap=args.max_tokens_per_gpu * cp_size if dynamic else None,
                          micro_batch_size=None if dynamic else args.micro_batch_size, vpp_size=vpp_size, group=group)
        micro_batch_indices, num_microbatches, local = rank.plan(payload.samples.total_lengths,
                                                                 lambda counts: data.all_reduce_max(counts, dp_group))
        stages = vpp_size if vpp is None else vpp
        return LegacySteps([data.DataIterator(payload, micro_batch_indices) for _ in range(stages)], num_microbatches,
                           local_microbatches=local)

    def lr_increment(self, args: Any, payload: RankPayload, step: int) -> int:
        """upstream: ``opt_param_scheduler.step(increment=args.global_batch_size)``, whatever the step held. The
        payload carries that figure: ``--global-batch-size``, or with ``use_dynamic_global_batch_size`` the step
        size the rollout side chose (``args.global_batch_size`` is then unset)."""
        return payload.global_batch_size

    def record(self, steps: RankSteps, payload: RankPayload, **measured: Any) -> LegacyStepRecord:
        """The measured step and the count this rank's samples needed before the DP group agreed."""
        if not isinstance(steps, LegacySteps):
            raise TypeError(f"dp_schedule=legacy records steps from its own iterators(), got {type(steps).__name__}")
        return LegacyStepRecord(**measured, local_microbatches=int(steps.local_microbatches[measured["step"]]))
