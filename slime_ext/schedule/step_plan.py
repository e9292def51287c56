"""One step's plan: what stages 2-4 make and every candidate of the pipeline search is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

import numpy as np

__all__ = ["StepPlan", "search_counts"]

T = TypeVar("T")


@dataclass(frozen=True)
class StepPlan:
    """One step's micro-batches, their ranks and (with a pipeline) their run order and predicted makespans."""

    bin_of: np.ndarray  # the micro-batch of the step's i-th sample
    rank_of_bin: np.ndarray  # the DP rank of each micro-batch
    count: int  # micro-batches in all (count / dp_size per rank)
    strategy: str  # how it was made (StepStats.strategy)
    target: int  # the count stages 2-3 aimed at
    emit: np.ndarray | None = None  # the bins in rank-major run order (None: each rank heaviest first)
    makespans: np.ndarray | None = None  # each replica's predicted makespan (pipeline only)
    bubble: float | None = None  # the slowest replica's bubble fraction (pipeline only)

    @property
    def slowest(self) -> float:
        """The slowest replica's predicted makespan (pipeline candidates only)."""
        return float(self.makespans.max())


def search_counts(counts: Iterable[int], evaluate: Callable[[int], T | None], better: Callable[[T, T], bool],
                  patience: int, best: T | None = None, enough: Callable[[T, int], bool] | None = None) -> T | None:
    """``evaluate`` each count (``None``: skipped), keep the best by ``better``; stop after ``patience`` counts in a
    row that did not beat it (the first never counts as a miss), or once ``enough(best, count)``."""
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
