"""One DP rank's micro-batches shaped for the pipeline, at counts the engine depth asks about (``pp_size > 1``).

Under megatron-core's pipeline schedules a replica's step is fastest when its micro-batches start small, rise to the
largest within a few micro-batches, step down slowly and end small (fill and drain then wait on cheap micro-batches),
and when it runs somewhat more micro-batches than the fewest the cap allows. slime-ext's planner builds such plans
for a whole step (its shaped micro-batches, ``docs/pipeline.md``); its public API does not offer "this replica's
samples in exactly ``k`` shaped micro-batches", which the engine depth needs at several counts per rank, so this
module does that one thing on top of the planner's public pricing (:class:`slime_ext.schedule.PipelinePricing`):

* a :class:`Ramp` gives each of ``k`` micro-batches a target share of the rank's cost: ``up`` micro-batches rising
  from ``low`` of the plateau, the plateau, ``down`` falling back to ``low`` (under VPP optionally in whole groups of
  ``microbatch_group_size_per_vp_stage``);
* :func:`pack_to_targets` deals the rank's samples, costliest first, each to the micro-batch with the most target
  left that still holds it under the token cap (a sample over the cap only into an empty one), and leaves no
  micro-batch empty; every row (a count and a ramp) in one vectorised pass;
* :func:`scan_shapes` packs every (count, ramp) pair, prices every packing in every run order of
  :data:`RUN_ORDERS` (:func:`run_orders`: as shaped, cheapest at both ends, rising, ...) with the pipeline model in
  one call, and keeps, per count, the fastest packing in its fastest order.

Pure: standard library, numpy and :mod:`slime_ext.schedule`'s public API.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from slime_ext.schedule import CostProfile, PipelinePricing

__all__ = ["KNOWN_ORDERS", "RAMPS", "RUN_ORDERS", "Ramp", "ShapeScan", "pack_to_targets", "ramp_weights", "run_orders",
           "scan_shapes"]


@dataclass(frozen=True)
class Ramp:
    """A target shape of one rank's micro-batch costs (see :func:`ramp_weights`)."""

    up: int  # micro-batches rising to the plateau (WHOLE: over the whole step, the peak near the end)
    down: int  # micro-batches falling from it at the end
    low: float  # the first (last) micro-batch's target, as a share of the plateau's
    #: under VPP the ramps count groups of ``microbatch_group_size_per_vp_stage`` micro-batches, alike within one
    #: (the interleaved schedule runs a group through every model chunk together); plain ramps without VPP
    grouped: bool = False

    def weights(self, k: int, group: int = 1) -> np.ndarray:
        """``(k,)`` target shares summing to 1 (read-only; made once per ramp, count and group)."""
        return _weights(self, k, group)


#: ``Ramp.up = WHOLE``: the ramp rises over the whole step
WHOLE = 1 << 20
#: the shapes a rank's counts are packed with: flat (evenly loaded), ramps at both ends, a rise over the whole step,
#: and under VPP ramps of whole groups (the planner's shapes, less four that never packed the slowest rank of
#: ``bench.verl``'s steps and of 16 and 64 samples per rank at pp 4 and 8, with and without VPP)
RAMPS = (Ramp(0, 0, 1.0), Ramp(3, 6, 0.3), Ramp(1, 4, 0.3), Ramp(2, 4, 0.3), Ramp(4, 8, 0.3), Ramp(5, 10, 0.5),
         Ramp(4, 12, 0.4), Ramp(WHOLE, 1, 0.5), Ramp(WHOLE, 2, 0.6),
         Ramp(1, 1, 0.3, grouped=True), Ramp(1, 2, 0.3, grouped=True), Ramp(2, 3, 0.3, grouped=True))
#: the orders every packing is priced in: as shaped (``target``); ``rising``: cheapest first up to the costliest,
#: which runs second to last (evenly loaded micro-batches under the interleaved schedule); ``valley``: the
#: cheapest at both ends, the costliest in the middle; ``ends``: the cheapest first and the second cheapest last,
#: the rest costliest first. (The planner's ``heaviest`` first never ordered the slowest rank best on
#: ``bench.verl``'s steps nor at 16 and 64 samples per rank; ``run_orders`` still knows it.)
RUN_ORDERS = ("target", "valley", "rising", "ends")
#: every order :func:`run_orders` knows
KNOWN_ORDERS = RUN_ORDERS + ("heaviest",)


def ramp_weights(k: int, up: int, down: int, low: float) -> np.ndarray:
    """``(k,)`` shares summing to 1: ``up`` rising linearly from ``low`` (of the plateau) towards 1, the plateau,
    ``down`` falling linearly towards ``low``; the ramps are shortened where ``k`` is small (one plateau micro-batch
    at least)."""
    w = np.ones(k)
    up, down = min(up, k - 1), min(down, k - 1)
    while up + down >= k and (up or down):
        if down >= up:
            down -= 1
        else:
            up -= 1
    if up:
        w[:up] = np.linspace(low, 1.0, up + 1)[:-1]
    if down:
        w[k - down:] = np.linspace(1.0, low, down + 1)[1:]
    return w / w.sum()


@lru_cache(maxsize=4096)
def _weights(ramp: Ramp, k: int, group: int) -> np.ndarray:
    if ramp.grouped and group > 1:
        w = np.repeat(ramp_weights(-(-k // group), ramp.up, ramp.down, ramp.low), group)[:k]
        w = w / w.sum()
    else:
        w = ramp_weights(k, ramp.up, ramp.down, ramp.low)
    w.flags.writeable = False
    return w


def pack_to_targets(lengths: np.ndarray, costs: np.ndarray, order: np.ndarray, shares: np.ndarray,
                    cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack one rank's samples once per row of ``shares``.

    ``shares``: ``(R, K)`` each row's target share of the rank's cost per micro-batch (a negative entry: the row has
    no such micro-batch, so rows of different counts share one call); ``order``: the samples costliest first.
    Each sample goes to the micro-batch with the most target left that holds it under ``cap`` (a sample longer
    than the cap only to an empty one); once the samples left are no more than a row's empty micro-batches, each
    goes to an empty one. Returns ``bin_of`` ``(R, n)`` (each sample's micro-batch, by sample index) and ``ok``
    ``(R,)``: the row holds the cap and leaves no micro-batch empty. One vectorised step per sample, every row at
    once.
    """
    rows, k = shares.shape
    n = len(order)
    lacking = shares < 0
    room = np.where(lacking, -np.inf, shares * float(costs.sum()))
    tokens = np.where(lacking, cap + 1, 0).astype(np.int64)  # a lacking micro-batch never takes a sample
    flat_room, flat_tokens = room.reshape(-1), tokens.reshape(-1)  # views
    # a row must open an empty micro-batch with every sample once its samples left are no more than its empty
    # micro-batches; that slack drops by at most one per sample, so it is only looked at when it may have run out
    check = n - int((~lacking).sum(axis=1).max())
    forced = None
    base = np.arange(rows) * k
    placed = []
    ord_lengths, ord_costs = lengths[order].tolist(), costs[order].tolist()
    neg = -np.inf
    for j in range(n):
        length = ord_lengths[j]
        limit = 0 if length > cap else cap - length  # the most tokens a micro-batch may hold before taking it
        if j >= check:
            slack = (n - j) - ((tokens == 0) & ~lacking).sum(axis=1)
            least = int(slack.min())
            forced = slack <= 0 if least <= 0 else None
            check = j + max(least, 1)
        # the micro-batch with the most target left among those that take the sample (a forced row: an empty one)
        allowed = limit if forced is None else np.where(forced, 0, limit)[:, None]
        pick = np.where(tokens <= allowed, room, neg).argmax(axis=1)
        flat = base + pick
        held = flat_tokens[flat]
        flat_room[flat] -= ord_costs[j]
        flat_tokens[flat] = held + length
        placed.append(pick)
    bin_of = np.empty((rows, n), dtype=np.int64)
    bin_of[:, order] = np.stack(placed, axis=1) if placed else np.zeros((rows, 0), dtype=np.int64)
    sizes = np.bincount((base[:, None] + bin_of).ravel(), minlength=rows * k).reshape(rows, k)
    over = (tokens > cap) & (sizes > 1) & ~lacking  # a micro-batch of several samples over the cap
    ok = ((sizes > 0) | lacking).all(axis=1) & ~over.any(axis=1)
    return bin_of, ok


@dataclass(frozen=True)
class ShapeScan:
    """The fastest shaped packing per count of one rank's samples."""

    #: count -> predicted makespan of the fastest packing (``inf`` where no ramp fits the cap)
    spans: dict[int, float]
    _best: dict[int, tuple[np.ndarray, np.ndarray]]  # count -> (bin_of, run order of its micro-batches)

    def micro_batches(self, count: int) -> list[tuple[int, ...]] | None:
        """The fastest packing at ``count`` as local index tuples in run order (``None`` if none fits)."""
        if count not in self._best:
            return None
        bin_of, run = self._best[count]
        members = np.argsort(bin_of, kind="stable")
        starts = np.searchsorted(bin_of[members], np.arange(count + 1))
        groups = [tuple(members[starts[b]:starts[b + 1]].tolist()) for b in range(count)]
        return [groups[b] for b in run.tolist()]


def run_orders(bin_costs: np.ndarray, name: str, asc: np.ndarray | None = None) -> np.ndarray:
    """``(R, K)``: each row's micro-batches (indices into it) in the run order ``name`` of :data:`KNOWN_ORDERS`
    (``asc``: the rows' stable ascending argsort, where the caller has it)."""
    rows, k = bin_costs.shape
    if name == "target" or k < 2:
        return np.broadcast_to(np.arange(k), (rows, k))
    if asc is None:
        asc = np.argsort(bin_costs, axis=1, kind="stable")
    if name == "rising":
        return np.concatenate([asc[:, :k - 2], asc[:, -1:], asc[:, k - 2:k - 1]], axis=1)
    if name == "valley":  # the i-th cheapest alternately to the front and the back
        return asc[:, _valley(k)]
    desc = asc[:, ::-1]
    if name == "heaviest":
        return desc
    if name == "ends":
        return np.concatenate([asc[:, :1], desc[:, :k - 2], asc[:, 1:2]], axis=1) if k >= 3 else desc
    raise ValueError(f"run order {name!r} is not one of {KNOWN_ORDERS}")


@lru_cache(maxsize=1024)
def _valley(k: int) -> np.ndarray:
    """Position ``p`` of the valley order runs the ``_valley(k)[p]``-th cheapest."""
    i = np.arange(k)
    where = np.where(i % 2 == 0, i // 2, k - 1 - i // 2)  # the i-th cheapest runs at ``where[i]``
    out = np.empty(k, dtype=np.int64)
    out[where] = i
    out.flags.writeable = False
    return out


@lru_cache(maxsize=1024)
def _block(ramps: tuple[Ramp, ...], k: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct target shares of the ramps at count ``k`` (``(U, k)``, read-only; short ramps cut at a small
    count often coincide) and each ramp's row among them."""
    block = np.stack([r.weights(k, group) for r in ramps])
    distinct, row_of = np.unique(block, axis=0, return_inverse=True)
    first = np.full(len(distinct), len(ramps))
    np.minimum.at(first, row_of.reshape(-1), np.arange(len(ramps)))
    keep = np.argsort(first, kind="stable")  # the distinct rows in the order of their first ramp
    where = np.empty(len(keep), dtype=np.int64)
    where[keep] = np.arange(len(keep))
    distinct, row_of = distinct[keep], where[row_of.reshape(-1)]
    distinct.flags.writeable = row_of.flags.writeable = False
    return distinct, row_of


def scan_shapes(lengths: np.ndarray, costs: np.ndarray, counts: Sequence[int], ramps: Sequence[Ramp],
                pricing: PipelinePricing, cap: int, group: int = 1, profile: CostProfile | None = None,
                orders: Sequence[str] = RUN_ORDERS) -> ShapeScan:
    """Every count of ``counts`` packed with every ramp (grouped ramps only with ``group > 1``; ramps with the same
    targets at a count packed once), every packing priced in every run order of ``orders`` by ``pricing`` in one
    call (a micro-batch costs the sum of its samples' ``costs``, or ``profile``'s time for it), the fastest kept
    per count (ties: the earlier ramp, then the earlier order)."""
    ramps = tuple(r for r in ramps if not r.grouped or group > 1)
    counts = [int(c) for c in counts if 0 < c <= len(lengths)]
    if not counts or not ramps or not orders:
        return ShapeScan({}, {})
    blocks = [_block(ramps, c, group)[0] for c in counts]
    starts = np.cumsum([0] + [len(b) for b in blocks])
    k, rows = max(counts), int(starts[-1])
    shares = np.full((rows, k), -1.0)
    for c, block, a in zip(counts, blocks, starts):
        shares[a:a + len(block), :c] = block
    order = np.argsort(-costs, kind="stable")  # costliest first, ties by index
    bin_of, ok = pack_to_targets(lengths, costs, order, shares, cap)
    flat = (np.arange(rows)[:, None] * k + bin_of).ravel()
    if profile is None:
        bin_costs = np.bincount(flat, weights=np.tile(costs, rows), minlength=rows * k).reshape(rows, k)
    else:
        bin_costs = profile.bin_times(np.tile(lengths, rows), flat, rows * k).reshape(rows, k)
    best_span, best, priced = {}, {}, []
    for c, block, a in zip(counts, blocks, starts):
        idx = a + np.flatnonzero(ok[a:a + len(block)])  # the packings that hold the cap
        if not len(idx):
            best_span[c] = float("inf")
            continue
        costs_c = bin_costs[idx, :c]
        asc = np.argsort(costs_c, axis=1, kind="stable")
        runs = np.concatenate([run_orders(costs_c, name, asc) for name in orders])  # order-major
        of = np.tile(np.arange(len(idx)), len(orders))
        priced.append((c, idx[of], runs, costs_c[of[:, None], runs]))
    got = pricing.makespans_many([ordered for _, _, _, ordered in priced]) if priced else []
    for (c, idx, runs, _), spans in zip(priced, got):
        j = int(np.argmin(spans))  # ties: the earlier order, then the earlier ramp
        best_span[c] = float(spans[j])
        best[c] = (bin_of[idx[j]], runs[j])
    return ShapeScan(best_span, best)
