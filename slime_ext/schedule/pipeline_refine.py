"""Local moves on the slowest replica of a step's plan while they lower the slowest predicted makespan (the
``refined`` candidate of :mod:`.pipeline_choice`): order swaps tried on every replica (:func:`polish_orders`), then
rounds of seeded random moves, each priced in one call of the model (:func:`refine`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum

import numpy as np

from .cost import price_sums
from .pipeline_orders import improve_orders
from .pipeline_pricing import Budget, beats
from .profile import CostProfile
from .step_plan import StepPlan

__all__ = ["Arrangement", "Move", "polish_orders", "refine"]


class Arrangement:
    """A step's plan as arrays for single-sample moves: sample ``x`` sits in run position ``slot[x]`` of replica
    ``rep[x]``; per micro-batch ``(dp, k)`` its tokens, squared lengths, summed costs, size and price; per replica
    its predicted makespan."""

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


def polish_orders(arr: Arrangement) -> Arrangement:
    """Improve ``arr`` in place by order swaps alone: the slowest replica's order by
    :func:`~.pipeline_orders.improve_orders`, then the same permutation tried on every other replica (each takes it
    where it runs faster); again while the slowest is one not polished yet and the budget pays."""
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
        if not len(others) or not budget.allows(budget.model_cost(len(others), arr.k) + budget.cfg.loop_round):
            continue
        budget.charge_round()
        got = budget.price(arr.price[others][:, o])
        for r in others[beats(got, arr.spans[others], cfg)].tolist():
            _permute(arr, r, o, float(got[np.searchsorted(others, r)]))


def _permute(arr: Arrangement, r: int, o: np.ndarray, span: float) -> None:
    """Replica ``r`` runs its micro-batches in the order ``o`` (positions), with makespan ``span``."""
    where = np.argsort(o)  # position -> its new position
    mine = arr.rep == r
    arr.slot[mine] = where[arr.slot[mine]]
    for v in (arr.tok, arr.sq, arr.sums, arr.price, arr.size):
        v[r] = v[r][o]
    arr.spans[r] = span


class Move(IntEnum):
    """The refinement's move kinds, all from the slowest replica ``s``."""

    ORDER_SWAP = 0  # positions ``a`` and ``j`` of ``s`` trade places
    MOVE_WITHIN = 1  # sample ``x`` moves to micro-batch ``j`` of ``s``
    MOVE_OUT = 2  # sample ``x`` moves to micro-batch ``j`` of a fast replica ``t``
    SWAP = 3  # sample ``x`` trades places with sample ``y`` of micro-batch ``j`` of ``t`` (``s`` or a fast one)


@dataclass
class Moves:
    """A round's moves, one entry each: the sample ``x`` of ``s``'s micro-batch ``i`` going to micro-batch ``j`` of
    replica ``t`` (``y`` coming back for a swap), an order swap's other position ``a``, and what leaves ``(s, i)``
    for ``(t, j)``: tokens, squared lengths, summed costs."""

    kind: np.ndarray
    x: np.ndarray
    y: np.ndarray
    i: np.ndarray
    j: np.ndarray
    a: np.ndarray
    t: np.ndarray
    d_tok: np.ndarray
    d_sq: np.ndarray
    d_sum: np.ndarray

    def __getitem__(self, idx) -> "Moves":
        return Moves(*(getattr(self, f.name)[idx] for f in fields(self)))


def refine(arr: Arrangement, rng: np.random.Generator, movable: bool) -> Arrangement:
    """Improve ``arr`` in place by rounds of ``refinement.refine_moves`` random moves on its slowest replica, each
    round making the best that beats the plan, until the last ``refinement.refine_patience`` rounds gained less than
    ``objective.min_gain`` or the budget ends; ``movable``: samples may move (dynamic batches), else only the order."""
    cfg = arr.budget.pricing.config
    budget, patience = arr.budget, cfg.refinement.refine_patience
    history = [float(arr.spans.max())]  # the slowest makespan after each round
    while budget.allows(budget.refine_round_cost(cfg.refinement.refine_moves, arr.k)):
        if len(history) > patience and not beats(history[-1], history[-patience - 1], cfg, by=cfg.objective.min_gain):
            break
        budget.charge_round()
        s = int(np.argmax(arr.spans))
        fast = [int(t) for t in np.argsort(arr.spans, kind="stable")[:cfg.rebalancing.balance_partners + 1] if t != s]
        moves = _draw(arr, rng, s, fast[:cfg.rebalancing.balance_partners], movable)
        if len(moves.kind):
            _make_best(arr, moves, s)
        history.append(float(arr.spans.max()))
    return arr


def _draw(arr: Arrangement, rng: np.random.Generator, s: int, fast: list[int], movable: bool) -> Moves:
    """``refinement.refine_moves`` moves drawn from replica ``s`` (to the ``fast`` replicas), less those that would
    leave a micro-batch empty or put two or more samples over the cap."""
    cfg = arr.budget.pricing.config
    draws, k = cfg.refinement.refine_moves, arr.k
    lengths, costs = arr.lengths.astype(np.float64), arr.costs
    cap = np.inf if arr.cap is None else arr.cap
    mine = np.flatnonzero(arr.rep == s)
    kind = rng.integers(0, len(Move), draws) if movable else np.full(draws, Move.ORDER_SWAP, dtype=np.int64)
    x = mine[rng.integers(0, len(mine), draws)]
    i = arr.slot[x]
    a = rng.integers(0, k, draws)
    j = rng.integers(0, k, draws)
    t = np.full(draws, s)
    y = np.zeros(draws, dtype=np.int64)
    swap = kind == Move.SWAP
    if movable:
        if fast:
            t = np.where(kind >= Move.MOVE_OUT, np.asarray(fast)[rng.integers(0, len(fast), draws)], s)
        t = np.where(swap, np.where(rng.random(draws) < cfg.refinement.swap_within_share, s, t), t)
        pick = rng.random(draws)
        for u in {s, *fast}:  # the sample y of a swap: a random sample of replica t
            theirs = mine if u == s else np.flatnonzero(arr.rep == u)
            on = t == u
            y[on] = theirs[(pick[on] * len(theirs)).astype(np.int64)]
        j = np.where(swap, arr.slot[y], j)
    moved = kind != Move.ORDER_SWAP
    # what leaves (s, i) and arrives at (t, j): x, less y for a swap
    delta = [np.where(moved, v[x], 0.0) - np.where(swap, v[y], 0.0) for v in (lengths, lengths * lengths, costs)]
    same = (t == s) & (i == j)
    fits_j = arr.tok[t, j] + delta[0] <= cap
    ok = np.select(
        [kind == Move.ORDER_SWAP, swap],
        [(a != j) & (arr.price[s, a] != arr.price[s, j]),  # an order swap of two different micro-batches
         # a swap: each side holds the cap, or one (oversize) sample
         ~same & (delta[2] != 0) & ((arr.tok[s, i] - delta[0] <= cap) | (arr.size[s, i] == 1))
         & (fits_j | (arr.size[t, j] == 1))],
        ~same & (arr.size[s, i] > 1) & fits_j)  # a move: its micro-batch keeps a sample, the other holds the cap
    return Moves(kind, x, y, i, j, a, t, *delta)[np.flatnonzero(ok)]


def _make_best(arr: Arrangement, mv: Moves, s: int) -> None:
    """Price every move in one call of the model and make the one with the lowest slowest makespan where it beats
    the plan."""
    spans = arr.spans
    m = len(mv.kind)
    r = np.arange(m)
    moved = mv.kind != Move.ORDER_SWAP
    here, there = moved & (mv.t == s), moved & (mv.t != s)
    # the new prices of the micro-batches a move changes
    new_i = price_sums(arr.tok[s, mv.i] - mv.d_tok, arr.sq[s, mv.i] - mv.d_sq, arr.sums[s, mv.i] - mv.d_sum,
                       arr.profile)
    new_j = price_sums(arr.tok[mv.t, mv.j] + mv.d_tok, arr.sq[mv.t, mv.j] + mv.d_sq,
                        arr.sums[mv.t, mv.j] + mv.d_sum, arr.profile)
    row_s = np.repeat(arr.price[s][None, :], m, axis=0)
    o = ~moved  # order swaps permute s's row
    row_s[r[o], mv.a[o]], row_s[r[o], mv.j[o]] = arr.price[s, mv.j[o]], arr.price[s, mv.a[o]]
    row_s[r[moved], mv.i[moved]] = new_i[moved]
    row_s[r[here], mv.j[here]] = new_j[here]
    row_t = arr.price[mv.t[there]].copy()
    row_t[np.arange(int(there.sum())), mv.j[there]] = new_j[there]
    got = arr.budget.price(np.concatenate((row_s, row_t)))
    span_s = got[:m]
    span_t = np.full(m, -np.inf)
    span_t[there] = got[m:]
    value = np.maximum(np.maximum(span_s, span_t), _rest(spans, s, mv.t))
    c = int(np.argmin(value))
    if not beats(value[c], spans[s], arr.budget.pricing.config):
        return
    _apply(arr, mv[c:c + 1], s, new_i[c], new_j[c])
    arr.spans[s] = span_s[c]
    if there[c]:
        arr.spans[int(mv.t[c])] = span_t[c]


def _apply(arr: Arrangement, mv: Moves, s: int, new_i: float, new_j: float) -> None:
    """Make the one move ``mv`` (``new_i``, ``new_j``: the changed micro-batches' prices)."""
    kind, t, i, j = int(mv.kind[0]), int(mv.t[0]), int(mv.i[0]), int(mv.j[0])
    if kind == Move.ORDER_SWAP:
        o = np.arange(arr.k)
        o[[int(mv.a[0]), j]] = o[[j, int(mv.a[0])]]
        return _permute(arr, s, o, float(arr.spans[s]))
    x = int(mv.x[0])
    arr.rep[x], arr.slot[x] = t, j
    if kind == Move.SWAP:
        y = int(mv.y[0])
        arr.rep[y], arr.slot[y] = s, i
    else:
        arr.size[s, i] -= 1
        arr.size[t, j] += 1
    for v, d in ((arr.tok, mv.d_tok[0]), (arr.sq, mv.d_sq[0]), (arr.sums, mv.d_sum[0])):
        v[s, i] -= d
        v[t, j] += d
    arr.price[s, i], arr.price[t, j] = new_i, new_j


def _rest(spans: np.ndarray, s: int, t: np.ndarray) -> np.ndarray:
    """Per move, the slowest makespan of the replicas other than ``s`` and the move's ``t``."""
    rest = np.full(len(t), -np.inf)
    for cand in np.argsort(-spans, kind="stable")[:3][::-1]:  # the slowest last, so it wins where allowed
        cand = int(cand)
        if cand != s:
            rest = np.where(t != cand, spans[cand], rest)
    return rest
