"""Exact answers on small inputs, by exhaustive search: what the heuristics are measured against in the tests."""

from __future__ import annotations

from functools import lru_cache
from itertools import product
from typing import Sequence


def min_bins(lengths: Sequence[int], cap: int) -> int:
    """Fewest bins of at most ``cap`` tokens (an oversize sample alone) -- DP over subsets, ``O(3^n)``."""
    n = len(lengths)
    full = (1 << n) - 1
    fits = [False] * (1 << n)
    for mask in range(1, 1 << n):
        members = [i for i in range(n) if mask >> i & 1]
        fits[mask] = len(members) == 1 or sum(lengths[i] for i in members) <= cap

    @lru_cache(maxsize=None)
    def best(mask: int) -> int:
        if mask == 0:
            return 0
        low = mask & -mask
        rest = mask ^ low
        result, sub = n + 1, rest
        while True:  # every bin that holds the lowest item
            if fits[sub | low]:
                result = min(result, 1 + best(rest ^ sub))
            if sub == 0:
                break
            sub = (sub - 1) & rest
        return result

    return best(full)


def min_max_load(weights: Sequence[float], k: int) -> float:
    """The smallest possible maximum group sum over all assignments of the items to ``k`` groups."""
    best = float("inf")
    for assignment in product(range(k), repeat=len(weights)):
        if assignment and assignment[0] != 0:  # groups are interchangeable: item 0 goes to group 0
            continue
        loads = [0.0] * k
        for w, g in zip(weights, assignment):
            loads[g] += w
        best = min(best, max(loads))
    return best
