"""Samples moved between a step's replicas after shaping, so that the slowest replica gets faster (dynamic batches).

The shaped candidate (:mod:`.pipeline_choice`) packs every replica's samples in a shape; these runs then move
samples off the slowest replicas and re-pack the replicas they change, each in its own shape:

* :func:`water_fill_run`: a few global rounds for many replicas: every replica above the level at which the
  replicas' costs would balance hands its cheapest samples to those furthest below;
* :func:`rebalance_run`: single moves off the slowest replica to the fastest ones;
* :func:`dominant`: the one rule for a replica whose costliest sample is most of its work: it keeps that sample
  with only the step's cheapest ones (its long trip through the pipeline is paid for with less else).

The runs are generators that ask for re-packings (:data:`Repack`); :func:`lockstep` answers the runs of several
counts side by side, one packing call and one pass of the model per round. Pure: standard library and numpy.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np

from .pipeline_pricing import Budget
from .pipeline_shape import Shape, ShapeSamples, pack_core
from .planner_config import PlannerConfig

__all__ = ["Packed", "Repack", "dominant", "lockstep", "rebalance_run", "water_fill_run"]


def dominant(top: float, total: float, cfg: PlannerConfig) -> bool:
    """Whether a replica's costliest sample (cost ``top``) holds ``cfg.strip_share`` of the replica's cost
    (``total``): the replica may keep it with only the step's cheapest samples."""
    return bool(top >= cfg.strip_share * total)


#: a replica's packing: its sample ids by decreasing cost (ties by id) and the micro-batch of each, in run order
Packed = tuple[np.ndarray, np.ndarray]
#: what a rebalancing run asks for: rows of sample ids to pack, their count, each row's shape; it is answered
#: with their makespans and packings (:func:`lockstep`)
Repack = tuple[list[np.ndarray], int, list[Shape]]


def lockstep(budget: Budget, samples: ShapeSamples, runs: list, reserve: float = 0.0) -> list:
    """Drive rebalancing runs (generators that yield :data:`Repack` requests and return their result) side by
    side: every round, all their requests in one packing call and one pass of the model. Each run gets exactly
    what it would alone (rows pack and price independently of each other), as far as the budget pays for the
    round's call and leaves ``reserve``: where it cannot, the last runs are answered ``None`` (they stop) until it
    can. Returns their results."""
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
        # the round's call must fit the budget: the runs of the later counts stop first (answered ``None``)
        while order and not budget.allows(_repack_cost(budget, [asks[i] for i in order]) + reserve):
            i = order.pop()
            asks.pop(i)
            advance(i, None)
        if not order:
            continue
        batch = [asks.pop(i) for i in order]
        rows = [row for ask in batch for row in ask[0]]
        members = samples.pad(rows)
        counts = [ask[1] for ask in batch for _ in ask[0]]
        shapes = [shape for ask in batch for shape in ask[2]]
        w = np.full((len(rows), max(counts)), -1.0)
        index: dict[tuple[int, Shape], list[int]] = {}
        for i, (k, shape) in enumerate(zip(counts, shapes)):
            index.setdefault((k, shape), []).append(i)
        for (k, shape), idx in index.items():
            w[idx, :k] = shape.weights(k, samples.step)
        spans, bin_of = pack_core(budget, samples, members, w,
                                  [(k, shape, np.asarray(idx)) for (k, shape), idx in index.items()])
        sizes = [len(row) for row in rows]  # a row's samples come first, then its padding
        start = 0
        for i, ask in zip(order, batch):
            part = range(start, start + len(ask[0]))
            start += len(ask[0])
            advance(i, (spans[part.start:part.stop], [(members[j, :sizes[j]], bin_of[j, :sizes[j]]) for j in part]))
    return results


def _repack_cost(budget: Budget, asks: list[Repack]) -> float:
    """What answering ``asks`` in one call costs: their packing and one pass of the model."""
    rows = sum(len(ask[0]) for ask in asks)
    n = max(len(row) for ask in asks for row in ask[0])
    k = max(ask[1] for ask in asks)
    return budget.pack_cost(rows, n, k) + budget.model_cost(rows, k)


def _fits(budget: Budget, rows: list[np.ndarray], k: int, reserve: float) -> bool:
    """Whether re-packing and pricing ``rows`` fits the budget with ``reserve`` left over."""
    n = max(len(r) for r in rows)
    return budget.allows(budget.pack_cost(len(rows), n, k) + budget.model_cost(len(rows), k) + reserve)


def water_fill_run(budget: Budget, samples: ShapeSamples, groups: list[np.ndarray], k: int,
                   shapes: list[Shape], spans: np.ndarray, packs: list[Packed | None], reserve: float = 0.0):
    """Level the replicas' makespans in a few global rounds (``config.water_rounds``), for many replicas at once.

    A replica's makespan moves by ``slope`` (:attr:`PipelinePricing.slope`) per unit of cost it gains or loses at
    its count and shape (its own bubble, ``span - slope * cost``, held fixed). Each round computes the level
    ``T`` at which the replicas' costs would sum to the step's, and every replica above it hands its cheapest
    samples (never its costliest, and keeping ``k``) to the replicas furthest below, up to its excess; a replica
    whose costliest sample is dominant (:func:`dominant`) and whose level lies below what it would
    keep gives away everything else and takes the step's cheapest samples from the replicas below the level. The
    changed replicas are re-packed once, and the round is kept only if the slowest makespan drops. A round is
    charged (``work_replica_us`` per replica) and runs only where the budget pays for it and a small re-packing, and
    leaves ``reserve``; its re-packing is :func:`lockstep`'s (answered ``None`` where the budget cannot pay for it:
    the run stops).

    A rebalancing run (:func:`lockstep`): yields its re-packings, returns ``(groups, spans, packs)``, ``packs``
    each replica's packing as far as it was re-packed (the others as given)."""
    cfg = budget.pricing.config
    costs, lengths = samples.costs, samples.lengths
    slope = budget.pricing.slope
    groups, packs = list(groups), list(packs)
    n_all = len(costs)
    asc_order, asc_rank = samples.ascending
    n_max = max(len(g) for g in groups)
    for _ in range(cfg.water_rounds):
        # the round's own work, and a re-packing of a few replicas, must fit (lockstep checks the re-packing)
        if not budget.allows(budget.replica_cost(len(groups)) + reserve + budget.pack_cost(1, n_max, k)
                             + budget.model_cost(1, k)):
            break
        budget.spent += budget.replica_cost(len(groups))
        # every replica's cost and tokens, and its samples cheapest first (ties by id), in one pass each
        sizes = np.fromiter(map(len, groups), dtype=np.int64, count=len(groups))
        every = np.concatenate(groups).astype(np.int64, copy=False)
        whose = np.repeat(np.arange(len(groups)), sizes)
        work = np.bincount(whose, weights=costs[every], minlength=len(groups))
        held = np.bincount(whose, weights=lengths[every], minlength=len(groups))
        by_cost_all = asc_order[np.sort(whose * n_all + asc_rank[every]) % n_all]  # by replica, cheapest first
        starts = np.concatenate(([0], np.cumsum(sizes)))
        own = spans - slope * work
        level = (slope * work.sum() + own.sum()) / len(groups)
        excess = work - (level - own) / slope
        below_level = np.flatnonzero(excess < 0)
        if not len(below_level):
            break
        deficit = list(zip(excess[below_level].tolist(), below_level.tolist()))
        heapq.heapify(deficit)  # most negative first: the replica furthest below the level
        add: dict[int, list[int]] = {}  # replica -> samples it takes
        drop: dict[int, list[int]] = {}  # replica -> samples it gives
        # the cheapest samples of the replicas below the level, for a replica stripped down to a dominant sample
        # (made when one is first stripped)
        below = [t for _, t in deficit]
        pooled = int(sizes[below].sum())
        pool: list[np.ndarray] = []  # [the pool, each one's owner, the pool cheapest first]
        taken = 0

        spill = itertools.cycle(below)  # where a stripped replica's samples go once no replica is below the level
        tokens = dict(zip(below, held[below].astype(np.int64).tolist()))
        room = cfg.token_fill * k * samples.cap  # what a replica's k micro-batches hold, with slack for the packing

        def give(d: int, i: int) -> bool:
            length = int(lengths[i])
            t = None
            while deficit:
                need, u = heapq.heappop(deficit)
                if tokens[u] + length <= room:
                    t = u
                    if need + costs[i] < 0:
                        heapq.heappush(deficit, (need + float(costs[i]), u))
                    break
            if t is None:
                for u in itertools.islice(spill, len(below)):
                    if tokens[u] + length <= room:
                        t = u
                        break
                else:
                    return False  # no replica below the level has room: the sample stays
            tokens[t] += length
            add.setdefault(t, []).append(int(i))
            drop.setdefault(d, []).append(int(i))
            return True

        # the replicas above the level, by decreasing excess, up to the first within min_gain of the level; of
        # those, the ones that act: a dominant costliest sample, or a first movable sample (after the k - 1
        # cheapest) within the excess (the others give nothing)
        order = np.argsort(-excess, kind="stable")
        on = (excess[order] > 0) & (spans[order] > level * (1 + cfg.min_gain))
        order = order[:len(order) if on.all() else int(np.argmin(on))]
        cum = np.concatenate(([0.0], np.cumsum(costs[by_cost_all])))
        head, top = starts[order], costs[by_cost_all[starts[order + 1] - 1]]
        # dominant(top, work[d], cfg), and what it would keep (its k - 1 cheapest and the top) above its level:
        # the test below, with a margin for the summation order (it decides exactly)
        keeps = top + cum[np.minimum(head + k - 1, starts[order + 1])] - cum[head]
        strong = (top >= cfg.strip_share * work[order]) & (work[order] - excess[order] < keeps * (1 + 1e-9))
        first = np.where(sizes[order] > k, costs[by_cost_all[np.minimum(head + k - 1, len(every) - 1)]], np.inf)
        for d in order[strong | (first <= excess[order])].tolist():
            mine = by_cost_all[starts[d]:starts[d + 1]]
            top = float(costs[mine[-1]])
            if dominant(top, work[d], cfg) and work[d] - excess[d] < top + costs[mine[:k - 1]].sum() \
                    and taken + k - 1 <= pooled:
                # a dominant sample: keep it with the k - 1 cheapest samples of the step's light replicas, give
                # every other sample away
                for i in mine[:-1]:
                    give(d, i)
                if not pool:
                    pool += [np.concatenate([groups[t] for t in below]),
                             np.repeat(below, [len(groups[t]) for t in below])]
                    pool.append(np.argsort(costs[pool[0]], kind="stable"))
                for j in pool[2][taken:taken + k - 1]:
                    add.setdefault(d, []).append(int(pool[0][j]))
                    drop.setdefault(int(pool[1][j]), []).append(int(pool[0][j]))
                taken += k - 1
                continue
            left = float(excess[d])
            for i in mine[k - 1:-1] if deficit else ():  # the k - 1 cheapest and the costliest stay
                if costs[i] > left or not deficit:
                    break
                if give(d, i):
                    left -= float(costs[i])
        if not drop:
            break
        changed = sorted(set(add) | set(drop))
        # each changed replica: the samples it keeps by id (a sample is given by its own replica only), then those
        # it takes in the order taken
        gone = np.zeros(n_all, dtype=bool)
        gone[list(itertools.chain.from_iterable(drop.values()))] = True
        ids = np.concatenate([groups[t] for t in changed])
        whose = np.repeat(np.arange(len(changed)), sizes[changed])
        stay = ~gone[ids]
        ids = np.sort(whose[stay] * n_all + ids[stay]) % n_all  # by replica, then by id
        ends = np.cumsum(np.bincount(whose[stay], minlength=len(changed))).tolist()
        rows = [ids[a:b] if t not in add else np.concatenate((ids[a:b], np.asarray(add[t], dtype=np.int64)))
                for a, b, t in zip([0] + ends[:-1], ends, changed)]
        answer = yield rows, k, [shapes[t] for t in changed]
        if answer is None:  # the budget cannot pay for the re-packing
            break
        got, packed = answer
        trial = spans.copy()
        trial[changed] = got
        if not trial.max() < spans.max() * (1 - cfg.tie):
            break
        for t, row, pack in zip(changed, rows, packed):
            groups[t], packs[t] = row, pack
        spans = trial
    return groups, spans, packs


def rebalance_run(budget: Budget, samples: ShapeSamples, groups: list[np.ndarray], k: int,
                  shapes: list[Shape], spans: np.ndarray, packs: list[Packed | None], reserve: float = 0.0):
    """Move the cheapest samples of the slowest replica to the fastest ones while that lowers the slowest
    makespan: a share (``config.shed_shares``) of the cost of its samples but the ``k - 1`` cheapest and the
    costliest, cheapest first, dealt over the ``config.balance_partners`` fastest, each replica re-packed in its
    own shape; at most ``config.max_shed_moves`` moves, while a move gains ``config.min_gain``. A replica holding a
    sample much costlier than the rest (a long trip through the pipeline) so ends up with little else. Every
    replica keeps at least ``k`` samples.

    A rebalancing run (:func:`lockstep`): yields its re-packings, returns ``(groups, shapes, spans, packs)``; it
    stops early where the budget cannot pay for a re-packing and leave ``reserve``."""
    cfg = budget.pricing.config
    groups, shapes, spans, packs = list(groups), list(shapes), spans.copy(), list(packs)
    costs = samples.costs
    many = len(groups) > cfg.water_fill_replicas
    if many:
        # the water-filling rounds before any share kept for later: they level the replicas, most of the gain
        groups, spans, packs = yield from water_fill_run(budget, samples, groups, k, shapes, spans, packs)
    for _ in range(cfg.shed_moves_after_water if many else cfg.max_shed_moves):
        if not budget.allows(budget.charge_round_cost + reserve):
            break
        budget.charge_round()  # the move's candidates (its re-packing is lockstep's)
        s = int(np.argmax(spans))
        partners = [int(t) for t in np.argsort(spans, kind="stable") if t != s][:cfg.balance_partners]
        mine = samples.cheapest_first(groups[s])  # cheapest first
        # the k - 1 cheapest stay (they fill the ramps cheaply), and so does the costliest; the next cheapest move
        keep, movable = mine[:k - 1], mine[k - 1:-1]
        if not partners or not len(movable):
            break
        cum = np.cumsum(costs[movable])
        moves = sorted(set(np.clip(np.searchsorted(cum, np.asarray(cfg.shed_shares) * cum[-1], side="right"), 1,
                                   len(movable)).tolist()))
        cands = []
        for m in moves:
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
        rows, owners = [], []
        for c, change in enumerate(cands):
            for t, row in change.items():
                if len(row) < k:
                    break
            else:
                for t, row in change.items():
                    rows.append(row)
                    owners.append((c, t))
        if not rows:
            break
        moves = cands
        if not _fits(budget, rows, k, reserve):
            break
        answer = yield rows, k, [shapes[t] for _, t in owners]  # each in its replica's shape
        if answer is None:  # the budget cannot pay for it
            break
        got, packed = answer
        worst = np.full(len(moves), -np.inf)
        np.maximum.at(worst, [c for c, _ in owners], got)
        worst[worst == -np.inf] = np.inf  # a move that leaves some replica fewer than k samples
        c = int(np.argmin(worst))
        if not worst[c] < spans[s] * (1 - cfg.min_gain):
            break  # the slowest replica gains (almost) nothing
        for (ci, t), v, row, pack in zip(owners, got, rows, packed):
            if ci == c:
                groups[t], spans[t], packs[t] = row, v, pack
    return groups, shapes, spans, packs
