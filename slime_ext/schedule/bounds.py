"""Micro-batch count bounds of a dynamic step, shared by the planner and the invariant checker."""

from __future__ import annotations

import numpy as np


def bin_lower_bound(lengths: np.ndarray, cap: int) -> int:
    """Fewest capped bins any packing needs: oversize samples alone, plus the largest of the bounds by tokens, by
    samples above cap/2 and by count."""
    lengths = np.asarray(lengths, dtype=np.int64)
    over = lengths > cap
    fit = np.sort(lengths[~over])
    if not len(fit):
        return int(np.count_nonzero(over))
    by_tokens = -(-int(fit.sum()) // cap)
    by_halves = int(np.count_nonzero(2 * fit > cap))
    most_per_bin = int(np.searchsorted(np.cumsum(fit), cap, side="right"))
    by_count = -(-len(fit) // most_per_bin)
    return int(np.count_nonzero(over)) + max(by_tokens, by_halves, by_count)


def align_up(count: int, align: int) -> int:
    """The smallest positive multiple of ``align`` that is ``>= count``."""
    return max(align, -(-count // align) * align)


def microbatch_target(lengths: np.ndarray, cap: int, align: int) -> int:
    """The aligned count a dynamic step is packed to: by tokens (oversize samples with all theirs), at most what the
    samples can fill, never below :func:`bin_lower_bound`."""
    needed = align_up(bin_lower_bound(lengths, cap), align)
    by_tokens = align_up(-(-int(lengths.sum()) // cap), align)
    fillable = len(lengths) // align * align
    return max(needed, min(by_tokens, fillable))
