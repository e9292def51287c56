"""Samples moved off a step's slowest replicas after shaping, each changed replica re-packed in its own shape
(:func:`water_fill_run`, :func:`rebalance_run`). The runs are generators that ask for re-packings (:data:`Repack`);
:func:`lockstep` answers several side by side, one packing call and one pass of the model per round.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from .pipeline_pricing import Budget, beats
from .pipeline_shape import Shape, ShapeSamples, pack_each
from .planner_config import PlannerConfig

__all__ = ["Packed", "Repack", "dominant", "lockstep", "rebalance_run", "water_fill_run"]


def dominant(top, total, cfg: PlannerConfig):
    """Whether a costliest sample ``top`` holds ``rebalancing.strip_share`` of its replica's cost ``total`` (then it
    may keep that sample with only the step's cheapest ones); elementwise on arrays."""
    return top >= cfg.rebalancing.strip_share * total


#: a replica's packing: its sample ids by decreasing cost (ties by id) and the micro-batch of each, in run order
Packed = tuple[np.ndarray, np.ndarray]
#: what a rebalancing run asks for: rows of sample ids to pack, their count, each row's shape (answered with their
#: makespans and packings)
Repack = tuple[list[np.ndarray], int, list[Shape]]


def lockstep(budget: Budget, samples: ShapeSamples, runs: list) -> list:
    """Drive rebalancing runs side by side, each round all their :data:`Repack` requests in one call, as far as the
    budget pays (the last runs are answered ``None`` and stop). Returns their results."""
    results: list = [None] * len(runs)
    asks: dict[int, Repack] = {}

    def advance(i: int, answer) -> None:
        try:
            asks[i] = runs[i].send(answer)
        except StopIteration as stop:
            results[i] = stop.value

    for i in range(len(runs)):
        advance(i, None)
    while asks:
        order = sorted(asks)
        while order and not budget.allows(_repack_cost(budget, [asks[i] for i in order])):
            i = order.pop()
            asks.pop(i)
            advance(i, None)
        if not order:
            continue
        batch = [asks.pop(i) for i in order]
        rows = [row for ask in batch for row in ask[0]]
        members = samples.pad(rows)
        combos = [(ask[1], shape) for ask in batch for shape in ask[2]]
        spans, bin_of = pack_each(budget, samples, members, combos)
        packs = [(members[j, :len(row)], bin_of[j, :len(row)]) for j, row in enumerate(rows)]
        start = 0
        for i, ask in zip(order, batch):  # each run its own rows' answers
            stop = start + len(ask[0])
            advance(i, (spans[start:stop], packs[start:stop]))
            start = stop
    return results


def _repack_cost(budget: Budget, asks: list[Repack]) -> float:
    """What answering ``asks`` in one call costs: their packing and one pass of the model."""
    rows = sum(len(ask[0]) for ask in asks)
    n = max(len(row) for ask in asks for row in ask[0])
    k = max(ask[1] for ask in asks)
    return budget.pack_cost(rows, n, k) + budget.model_cost(rows, k)


def water_fill_run(budget: Budget, samples: ShapeSamples, groups: list[np.ndarray], k: int,
                   shapes: list[Shape], spans: np.ndarray, packs: list[Packed | None]):
    """A rebalancing run: up to ``rebalancing.water_rounds`` rounds that find the level at which the replicas' costs
    would balance (a makespan moves by :attr:`PipelinePricing.slope` per unit of cost) and move samples from the
    replicas above it to those furthest below, kept where the slowest makespan drops. Returns ``(groups, spans,
    packs)``."""
    cfg = budget.pricing.config
    groups, packs = list(groups), list(packs)
    n_max = max(len(g) for g in groups)
    for _ in range(cfg.rebalancing.water_rounds):
        if not budget.allows(budget.replica_cost(len(groups)) + budget.pack_cost(1, n_max, k)
                             + budget.model_cost(1, k)):
            break
        budget.spent += budget.replica_cost(len(groups))
        moved = _water_round(samples, groups, k, spans, budget.pricing.slope, cfg)
        if moved is None:
            break
        changed, rows = moved
        answer = yield rows, k, [shapes[t] for t in changed]
        if answer is None:  # the budget cannot pay for the re-packing
            break
        got, packed = answer
        trial = spans.copy()
        trial[changed] = got
        if not beats(trial.max(), spans.max(), cfg):
            break
        for t, row, pack in zip(changed, rows, packed):
            groups[t], packs[t] = row, pack
        spans = trial
    return groups, spans, packs


@dataclass
class _Level:
    """One water-filling round's view of the replicas: their sample counts, costs and tokens, their samples cheapest
    first (``by_cost``, replica ``t``'s from ``starts[t]``), and each one's cost above the ``level`` (``excess``)."""

    sizes: np.ndarray
    work: np.ndarray
    held: np.ndarray
    by_cost: np.ndarray
    starts: np.ndarray
    level: float
    excess: np.ndarray

    @classmethod
    def of(cls, samples: ShapeSamples, groups: list[np.ndarray], spans: np.ndarray, slope: float) -> "_Level":
        costs, n_all = samples.costs, len(samples.costs)
        asc_order, asc_rank = samples.ascending
        sizes = np.fromiter(map(len, groups), dtype=np.int64, count=len(groups))
        every = np.concatenate(groups).astype(np.int64, copy=False)
        whose = np.repeat(np.arange(len(groups)), sizes)
        work = np.bincount(whose, weights=costs[every], minlength=len(groups))
        held = np.bincount(whose, weights=samples.lengths[every], minlength=len(groups))
        by_cost = asc_order[np.sort(whose * n_all + asc_rank[every]) % n_all]  # by replica, cheapest first
        own = spans - slope * work
        level = (slope * work.sum() + own.sum()) / len(groups)
        return cls(sizes, work, held, by_cost, np.concatenate(([0], np.cumsum(sizes))), level,
                   work - (level - own) / slope)

    def mine(self, d: int) -> np.ndarray:
        return self.by_cost[self.starts[d]:self.starts[d + 1]]


class _Receivers:
    """The replicas below the level, taking samples furthest below first while they have token room
    (``rebalancing.token_fill`` of ``k * cap``), then in turn; records who gives and takes what."""

    def __init__(self, samples: ShapeSamples, groups: list[np.ndarray], lv: _Level, k: int, cfg: PlannerConfig):
        self.samples, self.groups = samples, groups
        below_level = np.flatnonzero(lv.excess < 0)
        self.deficit = list(zip(lv.excess[below_level].tolist(), below_level.tolist()))
        heapq.heapify(self.deficit)  # most negative first: the replica furthest below the level
        self.below = [t for _, t in self.deficit]
        self.pooled = int(lv.sizes[self.below].sum())
        self.pool: list[np.ndarray] = []  # [the pool, each one's owner, the pool cheapest first], made when needed
        self.taken = 0
        self.spill = itertools.cycle(self.below)  # where samples go once no replica is below the level
        self.tokens = dict(zip(self.below, lv.held[self.below].astype(np.int64).tolist()))
        self.room = cfg.rebalancing.token_fill * k * samples.cap
        self.add: dict[int, list[int]] = {}  # replica -> samples it takes
        self.drop: dict[int, list[int]] = {}  # replica -> samples it gives

    def give(self, d: int, i: int) -> bool:
        """Give sample ``i`` of replica ``d`` to a replica below the level with room; ``False``: none has room."""
        costs, length = self.samples.costs, int(self.samples.lengths[i])
        t = None
        while self.deficit:
            need, u = heapq.heappop(self.deficit)
            if self.tokens[u] + length <= self.room:
                t = u
                if need + costs[i] < 0:
                    heapq.heappush(self.deficit, (need + float(costs[i]), u))
                break
        if t is None:
            for u in itertools.islice(self.spill, len(self.below)):
                if self.tokens[u] + length <= self.room:
                    t = u
                    break
            else:
                return False  # no replica below the level has room: the sample stays
        self.tokens[t] += length
        self.add.setdefault(t, []).append(int(i))
        self.drop.setdefault(d, []).append(int(i))
        return True

    def strip(self, d: int, mine: np.ndarray, k: int) -> None:
        """Replica ``d`` keeps its dominant costliest sample with the ``k - 1`` cheapest of the replicas below the
        level, and gives every other sample away."""
        for i in mine[:-1]:
            self.give(d, i)
        if not self.pool:
            self.pool += [np.concatenate([self.groups[t] for t in self.below]),
                          np.repeat(self.below, [len(self.groups[t]) for t in self.below])]
            self.pool.append(np.argsort(self.samples.costs[self.pool[0]], kind="stable"))
        for j in self.pool[2][self.taken:self.taken + k - 1]:
            self.add.setdefault(d, []).append(int(self.pool[0][j]))
            self.drop.setdefault(int(self.pool[1][j]), []).append(int(self.pool[0][j]))
        self.taken += k - 1


def _water_round(samples: ShapeSamples, groups: list[np.ndarray], k: int, spans: np.ndarray, slope: float,
                 cfg: PlannerConfig):
    """One round's moves (:func:`water_fill_run`): ``(changed replicas, their new groups)``, or ``None``."""
    costs = samples.costs
    lv = _Level.of(samples, groups, spans, slope)
    if not (lv.excess < 0).any():
        return None
    to = _Receivers(samples, groups, lv, k, cfg)
    for d in _givers(lv, spans, k, costs, cfg):
        mine = lv.mine(d)
        top = float(costs[mine[-1]])
        if dominant(top, lv.work[d], cfg) and lv.work[d] - lv.excess[d] < top + costs[mine[:k - 1]].sum() \
                and to.taken + k - 1 <= to.pooled:
            to.strip(d, mine, k)
            continue
        left = float(lv.excess[d])
        for i in _movable(mine, k):
            if costs[i] > left or not to.deficit:
                break
            if to.give(d, i):
                left -= float(costs[i])
    if not to.drop:
        return None
    changed = sorted(set(to.add) | set(to.drop))
    return changed, _regrouped(groups, changed, lv.sizes, to, len(costs))


def _givers(lv: _Level, spans: np.ndarray, k: int, costs: np.ndarray, cfg: PlannerConfig) -> list[int]:
    """The replicas above the level (by decreasing excess, down to ``min_gain`` of it) that act: a dominant costliest
    sample, or a first movable sample within the excess."""
    order = np.argsort(-lv.excess, kind="stable")
    on = (lv.excess[order] > 0) & (spans[order] > lv.level * (1 + cfg.objective.min_gain))
    order = order[:len(order) if on.all() else int(np.argmin(on))]
    cum = np.concatenate(([0.0], np.cumsum(costs[lv.by_cost])))
    head, top = lv.starts[order], costs[lv.by_cost[lv.starts[order + 1] - 1]]
    # dominant, and what it would keep (its k - 1 cheapest and the top) above its level (_water_round decides exactly)
    keeps = top + cum[np.minimum(head + k - 1, lv.starts[order + 1])] - cum[head]
    strong = dominant(top, lv.work[order], cfg) & ~beats(keeps, lv.work[order] - lv.excess[order], cfg)
    first = np.where(lv.sizes[order] > k, costs[lv.by_cost[np.minimum(head + k - 1, len(lv.by_cost) - 1)]], np.inf)
    return order[strong | (first <= lv.excess[order])].tolist()


def _regrouped(groups: list[np.ndarray], changed: list[int], sizes: np.ndarray, to: _Receivers,
               n_all: int) -> list[np.ndarray]:
    """Each changed replica's new group: the samples it keeps by id, then those it takes in the order taken."""
    gone = np.zeros(n_all, dtype=bool)
    gone[list(itertools.chain.from_iterable(to.drop.values()))] = True
    ids = np.concatenate([groups[t] for t in changed])
    whose = np.repeat(np.arange(len(changed)), sizes[changed])
    stay = ~gone[ids]
    ids = np.sort(whose[stay] * n_all + ids[stay]) % n_all  # by replica, then by id
    ends = np.cumsum(np.bincount(whose[stay], minlength=len(changed))).tolist()
    return [ids[a:b] if t not in to.add else np.concatenate((ids[a:b], np.asarray(to.add[t], dtype=np.int64)))
            for a, b, t in zip([0] + ends[:-1], ends, changed)]


def _movable(mine: np.ndarray, k: int) -> np.ndarray:
    """A replica's samples (cheapest first) that a move may take: all but the ``k - 1`` cheapest and the costliest."""
    return mine[k - 1:-1]


def rebalance_run(budget: Budget, samples: ShapeSamples, groups: list[np.ndarray], k: int,
                  shapes: list[Shape], spans: np.ndarray, packs: list[Packed | None], reserve: float = 0.0):
    """A rebalancing run: move shares (``rebalancing.shed_shares``) of the slowest replica's movable samples to the
    ``rebalancing.balance_partners`` fastest while a move gains ``objective.min_gain`` (many replicas: after
    :func:`water_fill_run`), every replica keeping ``k`` samples. Returns ``(groups, shapes, spans, packs)``."""
    cfg = budget.pricing.config
    groups, shapes, spans, packs = list(groups), list(shapes), spans.copy(), list(packs)
    costs = samples.costs
    many = len(groups) > cfg.rebalancing.water_fill_replicas
    if many:  # the water-filling rounds come before the ``reserve`` is kept: they level the replicas, most of the gain
        groups, spans, packs = yield from water_fill_run(budget, samples, groups, k, shapes, spans, packs)
    for _ in range(cfg.rebalancing.shed_moves_after_water if many else cfg.rebalancing.max_shed_moves):
        if not budget.allows(budget.cfg.loop_round + reserve):
            break
        budget.charge_round()
        s = int(np.argmax(spans))
        partners = [int(t) for t in np.argsort(spans, kind="stable") if t != s][:cfg.rebalancing.balance_partners]
        mine = samples.cheapest_first(groups[s])
        keep, movable = mine[:k - 1], _movable(mine, k)
        if not partners or not len(movable):
            break
        cum = np.cumsum(costs[movable])
        shares = np.asarray(cfg.rebalancing.shed_shares)
        cuts = sorted(set(np.clip(np.searchsorted(cum, shares * cum[-1], side="right"), 1, len(movable)).tolist()))
        cands = []  # per candidate move: the replicas it changes and their new groups
        for m in cuts:
            stay = np.concatenate((keep, movable[m:], mine[-1:]))
            cands.append({s: stay, **{t: np.concatenate((groups[t], movable[:m][i::len(partners)]))
                                      for i, t in enumerate(partners)}})
        if dominant(float(costs[mine[-1]]), samples.group_cost(groups[s]), cfg):
            # a dominant sample: keep it alone with the k - 1 cheapest samples of the partners, give them the rest
            theirs = np.concatenate([groups[t] for t in partners])
            tiny = theirs[np.lexsort((theirs, costs[theirs]))[:k - 1]]
            rest = mine[:-1]
            cands.append({s: np.concatenate((tiny, mine[-1:])),
                          **{t: np.concatenate((np.setdiff1d(groups[t], tiny), rest[i::len(partners)]))
                             for i, t in enumerate(partners)}})
        cands = [change for change in cands if all(len(row) >= k for row in change.values())]
        rows = [row for change in cands for row in change.values()]
        owners = [(c, t) for c, change in enumerate(cands) for t in change]
        if not rows or not budget.allows(_repack_cost(budget, [(rows, k, [])]) + reserve):
            break
        answer = yield rows, k, [shapes[t] for _, t in owners]  # each in its replica's shape
        if answer is None:  # the budget cannot pay for it
            break
        got, packed = answer
        worst = np.full(len(cands), -np.inf)
        np.maximum.at(worst, [c for c, _ in owners], got)
        c = int(np.argmin(worst))
        if not beats(worst[c], spans[s], cfg, by=cfg.objective.min_gain):
            break  # the slowest replica gains (almost) nothing
        for (ci, t), v, row, pack in zip(owners, got, rows, packed):
            if ci == c:
                groups[t], spans[t], packs[t] = row, v, pack
    return groups, shapes, spans, packs
