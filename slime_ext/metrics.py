"""One metrics function for every scheme: it reads only the schedule's shape and the sample lengths.

It never trusts a scheduler's own statistics. Input is anything with ``partitions[r]`` (global sample indices in
micro-batch order), ``micro_batch_indices[r][k]`` (local indices into ``partitions[r]``) and
``num_microbatches[s]`` (per rank) -- our ``DPSchedule`` and the baselines' ``SchemeSchedule`` alike. Step ``s``
is what every rank trains in its micro-batches ``[sum(num_microbatches[:s]), ... + num_microbatches[s])``.

FLOPs come from the one formula, :class:`slime_ext.schedule.CostModel` (``formula="upstream"`` is upstream slime's
variant, so a reader can check that the choice does not move the balance numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Sequence

import numpy as np

from slime_ext.schedule import CostModel
from slime_ext.schedule.bounds import align_up, bin_lower_bound


def fwd_flops(lengths: Sequence[int] | np.ndarray, dims: dict, formula: str = "exact") -> np.ndarray:
    """Forward FLOPs per sample of a dense decoder with a gated MLP: :meth:`slime_ext.schedule.CostModel.flops`."""
    return CostModel(**{"swiglu": True, **dims}).flops(lengths, formula)


def issue_bound(tokens: int, cap: int, align: int) -> int:
    """The issue's aligned bound ``ceil(ceil(tokens / cap) / align) * align``.

    Not a true lower bound once a sample is longer than the cap: such a sample takes a whole micro-batch however
    far it overshoots, and the rest of that micro-batch cannot be used. :func:`valid_bound` accounts for that.
    """
    return align_up(-(-tokens // cap), align)


def valid_bound(lengths: Sequence[int], cap: int, align: int) -> int:
    """A true lower bound on the step's aligned micro-batch count: the planner's own
    :func:`~slime_ext.schedule.bounds.bin_lower_bound`, aligned."""
    return align_up(bin_lower_bound(np.asarray(lengths, dtype=np.int64), cap), align)


@dataclass
class StepMetrics:
    total_microbatches: int
    valid_bound: int
    issue_bound: int
    cap_violations: int  # micro-batches of more than one sample above the cap
    largest_microbatch_tokens: int
    rank_cost_max: float
    rank_cost_mean: float
    balance_bound: float  # max(1, FLOPs of the largest sample / mean rank FLOPs)

    @property
    def imbalance(self) -> float:
        return self.rank_cost_max / self.rank_cost_mean if self.rank_cost_mean > 0 else 1.0


@dataclass
class Metrics:
    steps: list[StepMetrics]
    samples_scheduled: int
    problems: list[str] = field(default_factory=list)

    @property
    def total_microbatches(self) -> int:
        return sum(s.total_microbatches for s in self.steps)

    @property
    def total_valid_bound(self) -> int:
        return sum(s.valid_bound for s in self.steps)

    @property
    def total_issue_bound(self) -> int:
        return sum(s.issue_bound for s in self.steps)

    @property
    def steps_above_bound(self) -> int:
        return sum(1 for s in self.steps if s.total_microbatches > s.valid_bound)

    @property
    def cap_violations(self) -> int:
        return sum(s.cap_violations for s in self.steps)

    @property
    def largest_microbatch_tokens(self) -> int:
        return max(s.largest_microbatch_tokens for s in self.steps)

    @property
    def worst(self) -> StepMetrics:
        """The step with the largest FLOPs max/mean."""
        return max(self.steps, key=lambda s: s.imbalance)

    @property
    def worst_gap(self) -> float:
        """``max over steps of imbalance / balance_bound`` (1.0: every step at its bound)."""
        return max(s.imbalance / s.balance_bound for s in self.steps)


def measure(schedule: Any, lengths: Sequence[int], *, dp_size: int, cap: int, align: int, flops: np.ndarray,
            expected_samples: int | None = None) -> Metrics:
    """Per-step #micro-batches vs bounds, cap violations and per-rank FLOPs balance, from the schedule's shape."""
    lengths = np.asarray(lengths, dtype=np.int64)
    problems: list[str] = []
    parts, mbis, counts = schedule.partitions, schedule.micro_batch_indices, list(schedule.num_microbatches)
    if len(parts) != dp_size or len(mbis) != dp_size:
        return Metrics([], 0, [f"{len(parts)} partitions for dp_size={dp_size}"])
    total = sum(counts)
    seen: set[int] = set()
    for r in range(dp_size):
        if len(mbis[r]) != total:
            problems.append(f"rank {r}: {len(mbis[r])} micro-batches, expected {total}")
        if list(chain.from_iterable(mbis[r])) != list(range(len(parts[r]))):
            problems.append(f"rank {r}: micro_batch_indices do not tile its partition")
        if seen.intersection(parts[r]):
            problems.append(f"rank {r}: samples scheduled twice")
        seen.update(parts[r])
    if expected_samples is not None and len(seen) != expected_samples:
        problems.append(f"{len(seen)} distinct samples scheduled, expected {expected_samples}")
    if problems:
        return Metrics([], len(seen), problems)

    steps: list[StepMetrics] = []
    first = 0
    for m in counts:
        rank_flops, members, violations, largest, n_mbs = [], [], 0, 0, 0
        for r in range(dp_size):
            part = parts[r]
            rank_total = 0.0
            for mb in mbis[r][first:first + m]:
                idx = [part[i] for i in mb]
                tokens = int(lengths[idx].sum())
                largest = max(largest, tokens)
                if tokens > cap and len(idx) > 1:
                    violations += 1
                rank_total += float(flops[idx].sum())
                members.extend(idx)
                n_mbs += 1
            rank_flops.append(rank_total)
        step_lengths = lengths[members]
        mean = sum(rank_flops) / dp_size
        steps.append(StepMetrics(
            total_microbatches=n_mbs,
            valid_bound=valid_bound(step_lengths, cap, align),
            issue_bound=issue_bound(int(step_lengths.sum()), cap, align),
            cap_violations=violations,
            largest_microbatch_tokens=largest,
            rank_cost_max=max(rank_flops),
            rank_cost_mean=mean,
            balance_bound=max(1.0, float(flops[members].max()) / mean) if mean > 0 else 1.0,
        ))
        first += m
    return Metrics(steps, len(seen), problems)
