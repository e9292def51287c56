"""One step's plan, the record every stage of the planner passes on: stages 2-4 make one, and every candidate of
the pipeline search (:mod:`.pipeline_choice`) is one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

import numpy as np

__all__ = ["StepPlan", "search_counts"]

T = TypeVar("T")


@dataclass(frozen=True)
class StepPlan:
    """``bin_of[i]``: the micro-batch of the step's i-th sample; ``rank_of_bin[b]``: the DP rank of micro-batch
    ``b``; ``count`` micro-batches in all (``count / dp_size`` per rank); ``strategy``: how it was made (reported in
    ``StepStats.strategy``); ``target``: the count stages 2-3 aimed at. With pipeline parallelism also ``emit``: the
    bins in rank-major run order (``None``: each rank heaviest first), ``makespans``: each replica's predicted
    makespan, and ``bubble``: the slowest replica's bubble fraction."""

    bin_of: np.ndarray
    rank_of_bin: np.ndarray
    count: int
    strategy: str
    target: int
    emit: np.ndarray | None = None
    makespans: np.ndarray | None = None
    bubble: float | None = None

    @property
    def slowest(self) -> float:
        """The slowest replica's predicted makespan (pipeline candidates only)."""
        return float(self.makespans.max())


def search_counts(counts: Iterable[int], evaluate: Callable[[int], T | None], better: Callable[[T, T], bool],
                  patience: int, best: T | None = None, enough: Callable[[T, int], bool] | None = None) -> T | None:
    """The planner's one count search (stage 4's extra micro-batches, the pipeline search's re-packed counts):
    ``evaluate`` each count (``None``: skipped), keep the best by ``better``; stop after ``patience`` counts in a row
    that did not beat it (the first never counts as a miss), or once ``enough(best, count)``."""
    misses = 0
    for n, k in enumerate(counts):
        cand = evaluate(k)
        if cand is None:
            continue
        if best is None or better(cand, best):
            best, misses = cand, 0
        elif n:
            misses += 1
            if misses >= patience:
                break
        if enough is not None and enough(best, k):
            break
    return best
