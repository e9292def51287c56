"""Local moves on the slowest replica of a step's plan, while they lower the slowest predicted makespan (the
pipeline search's ``refined`` candidate, :mod:`.pipeline_choice`).

A round draws ``config.refine_moves`` moves from a seeded random stream (``config.refine_seed``: the same input
gives the same plan) and prices them in one call of the model; the move whose result has the lowest slowest
makespan is made if it beats the current one (``config.tie``). The moves, all on the slowest replica ``s``:

* two of its micro-batches trade places in the run order (always: the gradient is a sum);
* with dynamic batches also: one of its samples moves to another of its micro-batches, or to a micro-batch of one
  of the ``config.balance_partners`` fastest replicas; or it trades places with a sample there.

Every move keeps the plan valid: no micro-batch empties, none holding two or more samples exceeds the cap, every
replica keeps its count (static batches keep their micro-batches: only the order moves). The search stops once
its last ``config.refine_patience`` rounds together lowered the slowest makespan by less than ``config.min_gain``
of it, or when the budget cannot pay for another round.

Pure: standard library and numpy.
"""

from __future__ import annotations

import numpy as np

from .cost import price_sums
from .pipeline_orders import improve_orders
from .pipeline_pricing import Budget
from .profile import CostProfile
from .step_plan import StepPlan

__all__ = ["Arrangement", "polish_orders", "refine"]


class Arrangement:
    """A step's plan as arrays for single-sample moves: sample ``x`` sits in run position ``slot[x]`` of replica
    ``rep[x]``; per micro-batch (``(dp, k)``) its tokens, squared lengths, summed sample costs, size and price;
    per replica its predicted makespan."""

    def __init__(self, rep: np.ndarray, slot: np.ndarray, dp: int, k: int, lengths: np.ndarray, costs: np.ndarray,
                 profile: CostProfile | None, cap: int | None, budget: Budget, spans: np.ndarray | None = None) -> None:
        self.rep, self.slot, self.dp, self.k = rep.astype(np.int64), slot.astype(np.int64), dp, k
        self.lengths, self.costs, self.profile, self.cap, self.budget = lengths, costs, profile, cap, budget
        flat = self.rep * k + self.slot
        n = dp * k
        length = lengths.astype(np.float64)
        self.tok = np.bincount(flat, weights=length, minlength=n).reshape(dp, k)
        self.sq = np.bincount(flat, weights=length * length, minlength=n).reshape(dp, k)
        self.sums = np.bincount(flat, weights=costs, minlength=n).reshape(dp, k)
        self.size = np.bincount(flat, minlength=n).reshape(dp, k)
        self.price = price_sums(self.tok, self.sq, self.sums, profile).reshape(dp, k)
        self.spans = budget.price(self.price) if spans is None else np.array(spans, dtype=np.float64)

    @classmethod
    def from_plan(cls, plan: StepPlan, dp: int, lengths: np.ndarray, costs: np.ndarray,
                  profile: CostProfile | None, cap: int | None, budget: Budget) -> "Arrangement":
        k = plan.count // dp
        emit = np.arange(plan.count) if plan.emit is None else plan.emit
        position = np.empty(plan.count, dtype=np.int64)
        position[emit] = np.arange(plan.count)  # bin -> rank-major run position
        where = position[plan.bin_of]
        return cls(where // k, where % k, dp, k, lengths, costs, profile, cap, budget, plan.makespans)

    def to_plan(self, strategy: str, target: int) -> StepPlan:
        count = self.dp * self.k
        s = int(np.argmax(self.spans))
        bubble = self.budget.pricing.bubble(self.price[s], self.spans[s])
        return StepPlan(self.rep * self.k + self.slot, np.arange(count) // self.k, count, strategy, target,
                        np.arange(count), self.spans.copy(), bubble)

    def _priced(self, tok: np.ndarray, sq: np.ndarray, sums: np.ndarray) -> np.ndarray:
        return price_sums(tok, sq, sums, self.profile)


def polish_orders(arr: Arrangement) -> Arrangement:
    """Improve ``arr`` in place by order swaps alone: the slowest replica's order by pair swaps
    (:func:`~slime_ext.schedule.pipeline_orders.improve_orders`), then the same permutation of positions tried on
    every replica (one call of the model; a replica takes it where it runs faster: the shaped replicas' micro-batches
    follow one shape, so an order that helps the slowest tends to help them all); again while the slowest is one
    it has not polished (the step waits for the slowest replica), as far as the budget pays."""
    budget = arr.budget
    cfg = budget.pricing.config
    done = np.zeros(arr.dp, dtype=bool)
    same = np.arange(arr.k)
    while True:
        s = int(np.argmax(arr.spans))
        if done[s]:
            return arr
        done[s] = True
        order, spans = improve_orders(budget.pricing, arr.price[s:s + 1], same[None, :].copy(), arr.spans[s:s + 1],
                                      budget)
        o = order[0]
        if (o == same).all():
            continue
        _permute(arr, s, o, float(spans[0]))
        others = np.flatnonzero(np.arange(arr.dp) != s)
        if not len(others) or not budget.allows(budget.model_cost(len(others), arr.k) + budget.charge_round_cost):
            continue
        budget.charge_round()
        got = budget.price(arr.price[others][:, o])
        for r in others[got < arr.spans[others] * (1 - cfg.tie)].tolist():
            _permute(arr, r, o, float(got[np.searchsorted(others, r)]))


def _permute(arr: Arrangement, r: int, o: np.ndarray, span: float) -> None:
    """Replica ``r`` runs its micro-batches in the order ``o`` (positions), with makespan ``span``."""
    where = np.empty(arr.k, dtype=np.int64)
    where[o] = np.arange(arr.k)
    mine = arr.rep == r
    arr.slot[mine] = where[arr.slot[mine]]
    for v in (arr.tok, arr.sq, arr.sums, arr.price, arr.size):
        v[r] = v[r][o]
    arr.spans[r] = span


def refine(arr: Arrangement, rng: np.random.Generator, movable: bool, until: float | None = None) -> Arrangement:
    """Improve ``arr`` in place by local moves on its slowest replica (module docstring); ``movable``: samples may
    move (dynamic batches), else only the order does; ``until``: stop once the budget has spent this much."""
    cfg = arr.budget.pricing.config
    budget = arr.budget
    lengths, costs = arr.lengths.astype(np.float64), arr.costs
    squares = lengths * lengths
    cap = np.inf if arr.cap is None else arr.cap
    k = arr.k
    draws = cfg.refine_moves
    history = [float(arr.spans.max())]  # the slowest makespan after each round
    limit = budget.total if until is None else min(until, budget.total)
    while budget.spent + budget.refine_round_cost(draws, k) <= limit:
        window = history[-cfg.refine_patience - 1:]
        if len(window) > cfg.refine_patience and window[0] - window[-1] < cfg.min_gain * window[0]:
            break
        budget.charge_round()
        history.append(history[-1])
        spans = arr.spans
        s = int(np.argmax(spans))
        top3 = np.argsort(-spans, kind="stable")[:3]
        fast = [int(t) for t in np.argsort(spans, kind="stable")[:cfg.balance_partners + 1] if t != s]
        fast = fast[:cfg.balance_partners]
        mine = np.flatnonzero(arr.rep == s)
        # kind 0: order swap (a, j); 1: move x to (s, j); 2: move x to (t, j); 3: swap x with y of (t, j)
        kind = rng.integers(0, 4, draws) if movable else np.zeros(draws, dtype=np.int64)
        x = mine[rng.integers(0, len(mine), draws)]
        i = arr.slot[x]
        a = rng.integers(0, k, draws)
        j = rng.integers(0, k, draws)
        t = np.full(draws, s)
        y = np.zeros(draws, dtype=np.int64)
        if movable:
            if fast:
                t = np.where(kind >= 2, np.asarray(fast)[rng.integers(0, len(fast), draws)], s)
            t = np.where(kind == 3, np.where(rng.random(draws) < 0.5, s, t), t)
            pick = rng.random(draws)
            for u in {s, *fast}:  # the sample y of a swap: a random sample of replica t
                theirs = mine if u == s else np.flatnonzero(arr.rep == u)
                on = t == u
                y[on] = theirs[(pick[on] * len(theirs)).astype(np.int64)]
            j = np.where(kind == 3, arr.slot[y], j)
        swap = kind == 3
        moved = kind >= 1
        # what leaves (s, i) and arrives at (t, j): x, less y for a swap
        d_tok = np.where(moved, lengths[x], 0.0) - np.where(swap, lengths[y], 0.0)
        d_sq = np.where(moved, squares[x], 0.0) - np.where(swap, squares[y], 0.0)
        d_sum = np.where(moved, costs[x], 0.0) - np.where(swap, costs[y], 0.0)
        same = (t == s) & (i == j)
        fits_j = arr.tok[t, j] + d_tok <= cap
        ok = np.select(
            [kind == 0, swap],
            [(a != j) & (arr.price[s, a] != arr.price[s, j]),  # an order swap of two different micro-batches
             # a swap: each side holds the cap, or one (oversize) sample
             ~same & (d_sum != 0) & ((arr.tok[s, i] - d_tok <= cap) | (arr.size[s, i] == 1))
             & (fits_j | (arr.size[t, j] == 1))],
            ~same & (arr.size[s, i] > 1) & fits_j)  # a move: its micro-batch keeps a sample, the other holds the cap
        idx = np.flatnonzero(ok)
        if not len(idx):
            continue
        kind, x, i, j, a, t = kind[idx], x[idx], i[idx], j[idx], a[idx], t[idx]
        d_tok, d_sq, d_sum = d_tok[idx], d_sq[idx], d_sum[idx]
        m = len(idx)
        r = np.arange(m)
        moved = kind >= 1
        here, there = moved & (t == s), moved & (t != s)
        # the new prices of the micro-batches a move changes (one bin pricing, from their sums)
        new_i = arr._priced(arr.tok[s, i] - d_tok, arr.sq[s, i] - d_sq, arr.sums[s, i] - d_sum)
        new_j = arr._priced(arr.tok[t, j] + d_tok, arr.sq[t, j] + d_sq, arr.sums[t, j] + d_sum)
        row_s = np.repeat(arr.price[s][None, :], m, axis=0)
        o = ~moved  # order swaps permute s's row
        row_s[r[o], a[o]], row_s[r[o], j[o]] = arr.price[s, j[o]], arr.price[s, a[o]]
        row_s[r[moved], i[moved]] = new_i[moved]
        row_s[r[here], j[here]] = new_j[here]
        row_t = arr.price[t[there]].copy()
        row_t[np.arange(int(there.sum())), j[there]] = new_j[there]
        got = budget.price(np.concatenate((row_s, row_t)))
        span_s = got[:m]
        span_t = np.full(m, -np.inf)
        span_t[there] = got[m:]
        value = np.maximum(np.maximum(span_s, span_t), _rest(spans, top3, s, t))
        c = int(np.argmin(value))
        if not value[c] < spans[s] * (1 - cfg.tie):
            continue
        kc, tc, ic, jc = int(kind[c]), int(t[c]), int(i[c]), int(j[c])
        if kc == 0:  # positions a and j of replica s trade places
            ac = int(a[c])
            on_a = mine[arr.slot[mine] == ac]
            on_j = mine[arr.slot[mine] == jc]
            arr.slot[on_a], arr.slot[on_j] = jc, ac
            for v in (arr.tok, arr.sq, arr.sums, arr.price, arr.size):
                v[s, ac], v[s, jc] = v[s, jc], v[s, ac]
        else:
            xc = int(x[c])
            arr.rep[xc], arr.slot[xc] = tc, jc
            if kc == 3:
                yc = int(y[idx[c]])
                arr.rep[yc], arr.slot[yc] = s, ic
            else:
                arr.size[s, ic] -= 1
                arr.size[tc, jc] += 1
            for v, d in ((arr.tok, d_tok[c]), (arr.sq, d_sq[c]), (arr.sums, d_sum[c])):
                v[s, ic] -= d
                v[tc, jc] += d
            arr.price[s, ic], arr.price[tc, jc] = new_i[c], new_j[c]
        arr.spans[s] = span_s[c]
        if there[c]:
            arr.spans[tc] = span_t[c]
        history[-1] = float(arr.spans.max())
    return arr


def _rest(spans: np.ndarray, top3: np.ndarray, s: int, t: np.ndarray) -> np.ndarray:
    """Per move, the slowest replica other than ``s`` and the move's ``t`` (``top3``: the three slowest)."""
    rest = np.full(len(t), -np.inf)
    for cand in top3[::-1]:  # the slowest last, so it wins where allowed
        cand = int(cand)
        if cand != s:
            rest = np.where(t != cand, spans[cand], rest)
    return rest
