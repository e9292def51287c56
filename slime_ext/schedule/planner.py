"""Rollout-side global micro-batch scheduling: which DP rank trains which sample in which micro-batch of which step.

Strategy (one call plans a whole rollout):

  1. **Steps.** Group samples by rollout id (first-occurrence order; all samples of a rollout stay in one step)
     and cut the rollouts into steps of ``global_batch_size`` rollouts (one step with
     ``use_dynamic_global_batch_size``). Trailing rollouts that do not fill a step are dropped and reported in
     ``DPSchedule.dropped``; with ``disable_rollout_trim_samples`` an incomplete step is an error instead.
  2. **Pack first.** Per step, group the samples into micro-batches: fixed ``micro_batch_size`` chunks (static), or
     bins of at most ``cap = max_tokens_per_gpu * cp_size`` tokens (dynamic). The dynamic target count is the
     aligned lower bound -- bins needed by tokens, rounded up to ``align`` -- reached by LPT (even bins) or, when
     that does not fit, best-fit decreasing; ``balance_by_flops`` packs by estimated FLOPs under the same cap.
  3. **Align.** The count is a multiple of ``align = dp_size * (mb_group if vpp_size > 1 else 1)``; a packing with
     fewer bins is grown by halving its largest multi-sample bins (halves never exceed their parent).
  4. **Distribute second.** Each rank gets ``count / dp_size`` micro-batches: round-robin over the bins in
     serpentine order of cost, or with ``balance_data`` balanced on estimated FLOPs -- Karmarkar-Karp over the
     packed bins plus swap refinement, or, better when it fits, bins built per rank: samples dealt in decreasing
     cost to the lightest rank that still has room in one of its own ``count / dp_size`` capped bins. The better
     of the two (fewest micro-batches, then lowest max rank FLOPs) wins.

Invariants (checked for every schedule the tests build, by :func:`slime_ext.schedule.invariants.check_schedule`):

  - every rank has the same number of micro-batches, ``sum(num_microbatches)``, and per step
    ``num_microbatches[s] * dp_size`` is a positive multiple of ``align``;
  - ``micro_batch_indices[r]`` tiles ``range(len(partitions[r]))`` in order, with no empty micro-batch;
  - the partitions are disjoint and their union plus ``dropped`` is every sample, each exactly once;
  - dynamic: every micro-batch holds ``<= cap`` tokens unless it is a single oversize sample -- in every mode;
    static: every micro-batch holds ``micro_batch_size`` samples (the last of a step may hold fewer);
  - all samples of a rollout are in one step; steps hold whole rollouts in order, ``dropped`` only trailing ones;
  - the same input gives the same schedule.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from itertools import chain
from typing import Sequence

import numpy as np

from .config import BatchConfig, ParallelConfig
from .cost import CostModel, sample_costs
from .dp_schedule import DPSchedule, StepStats
from .errors import ScheduleError
from .packing import best_fit_decreasing, expand_bins_by_splitting, lpt_pack
from .partition import karmarkar_karp, refine_equal_size


def compute_dynamic_global_batch_size(num_samples: int, dp_size: int) -> int:
    """``num_samples`` rounded down to a multiple of ``dp_size`` (at least ``dp_size``): one step per rollout."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 0:
        raise ScheduleError(f"num_samples must be a non-negative integer, got {num_samples!r}")
    if isinstance(dp_size, bool) or not isinstance(dp_size, (int, np.integer)) or dp_size < 1:
        raise ScheduleError(f"dp_size must be a positive integer, got {dp_size!r}")
    return max(int(dp_size), (int(num_samples) // int(dp_size)) * int(dp_size))


# ---------------------------------------------------------------------------------------------------- input checks
def _as_int_array(name: str, values: Sequence[int] | np.ndarray, n: int | None, minimum: int) -> np.ndarray:
    if values is None or isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ScheduleError(f"{name} must be a sequence of integers, got {type(values).__name__}")
    if n is not None and len(values) != n:
        raise ScheduleError(
            f"{name} has {len(values)} entries but total_lengths has {n}; give exactly one per sample"
        )
    if len(values) == 0:
        return np.zeros(0, dtype=np.int64)
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ScheduleError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu" or (not isinstance(values, np.ndarray) and any(type(v) is bool for v in values)):
        bad = next((i for i, v in enumerate(values)
                    if isinstance(v, bool) or not isinstance(v, (int, np.integer))), 0)
        raise ScheduleError(
            f"{name}[{bad}] = {values[bad]!r} is not an integer; {name} must hold integer token counts"
        )
    arr = arr.astype(np.int64)
    if len(arr) and arr.min() < minimum:
        bad = int(np.argmax(arr < minimum))
        raise ScheduleError(f"{name}[{bad}] = {int(arr[bad])} is below {minimum}; every entry must be >= {minimum}")
    return arr


def _rollout_ordinals(rollout_ids: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray:
    """Per sample, the rollout's rank in first-occurrence order (0, 1, 2, ...)."""
    if rollout_ids is None:
        return np.arange(n, dtype=np.int64)
    ids = _as_int_array("rollout_ids", rollout_ids, n, minimum=np.iinfo(np.int64).min)
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    rank_of_unique = np.empty(len(first), dtype=np.int64)
    rank_of_unique[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank_of_unique[inverse.reshape(-1)]


# ---------------------------------------------------------------------------------------------------- stage 1
def split_into_steps(
    ordinals: np.ndarray, parallel: ParallelConfig, batch: BatchConfig
) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    """Stage 1: ``(step sample indices in rollout order, rollouts per step, dropped sample indices)``."""
    num_rollouts = int(ordinals.max()) + 1
    if batch.use_dynamic_global_batch_size:
        gbs = (num_rollouts if batch.disable_rollout_trim_samples
               else compute_dynamic_global_batch_size(num_rollouts, parallel.dp_size))
    else:
        gbs = batch.global_batch_size
    num_steps, tail = divmod(num_rollouts, gbs)
    if tail and batch.disable_rollout_trim_samples:
        raise ScheduleError(
            f"the rollout has {num_rollouts} rollouts, not a multiple of global_batch_size={gbs}: the last step would "
            f"hold only {tail}; make the rollout size a multiple of --global-batch-size, or drop "
            f"--disable-rollout-trim-samples to trim the tail"
        )
    if num_steps == 0:
        raise ScheduleError(
            f"the rollout has {num_rollouts} rollouts but global_batch_size={gbs} (rollouts per step): not even one "
            f"step; lower --global-batch-size to at most {num_rollouts} or collect more rollouts"
        )
    order = np.argsort(ordinals, kind="stable")  # samples grouped by rollout, rollouts in first-occurrence order
    bounds = np.searchsorted(ordinals[order], np.arange(num_steps + 1) * gbs)
    steps = [order[bounds[s]:bounds[s + 1]] for s in range(num_steps)]
    dropped = np.sort(order[bounds[-1]:])
    return steps, [gbs] * num_steps, dropped


# ---------------------------------------------------------------------------------------------------- stage 2 + 3
def bin_lower_bound(lengths: np.ndarray, cap: int) -> int:
    """Fewest capped bins any packing needs: oversize samples alone, plus the rest by tokens and by halves."""
    over = lengths > cap
    fit = lengths[~over]
    by_tokens = -(-int(fit.sum()) // cap)
    by_halves = int(np.count_nonzero(2 * fit > cap))  # two samples above cap/2 never share a bin
    return int(np.count_nonzero(over)) + max(by_tokens, by_halves)


def _align_up(count: int, align: int) -> int:
    return max(align, -(-count // align) * align)


def microbatch_target(lengths: np.ndarray, cap: int, align: int) -> int:
    """The aligned bound a dynamic step is packed to: ``ceil(ceil(tokens / cap) / align) * align``.

    Raised, where packing needs more, to :func:`bin_lower_bound`. Oversize samples count with all their tokens:
    a packing could put each alone into one bin and use fewer, but the spare bins are what lets the ranks around
    an oversize sample stay balanced -- unless that would need more micro-batches than there are samples; then
    the largest aligned count the samples can fill (never below the true lower bound).
    """
    needed = _align_up(bin_lower_bound(lengths, cap), align)
    by_tokens = _align_up(-(-int(lengths.sum()) // cap), align)
    fillable = len(lengths) // align * align
    return max(needed, min(by_tokens, fillable))


def _cost_lpt_pack(lengths: np.ndarray, costs: np.ndarray, order: np.ndarray, num_bins: int, cap: int):
    """``num_bins`` capped bins, each sample (decreasing cost) into the cheapest bin that still has room.

    A bin too full for the current sample waits in a heap keyed by its room and rejoins the cost heap once the
    (decreasing) samples are small enough for it, so every sample costs ``O(log bins)`` amortised.
    """
    heap = [(0.0, b) for b in range(num_bins)]  # (cost, bin) of bins that fit the current sample
    waiting: list[tuple[int, float, int]] = []  # (-room, cost, bin) of bins that do not
    room = [cap] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    heappop, heappush = heapq.heappop, heapq.heappush
    smallest = int(lengths[order[-1]])
    for idx, length, cost in zip(order.tolist(), lengths[order].tolist(), costs[order].tolist()):
        while waiting and -waiting[0][0] >= length:
            _, bc, b = heappop(waiting)
            heappush(heap, (bc, b))
        while heap:
            bc, b = heappop(heap)
            if room[b] >= length or room[b] == cap:  # an empty bin takes even an oversize sample
                break
            heappush(waiting, (-room[b], bc, b))
        else:
            return None
        bins[b].append(idx)
        room[b] -= length
        if room[b] >= smallest:
            heappush(heap, (bc + cost, b))
    return bins


def pack_step(
    lengths: np.ndarray, costs: np.ndarray, order: np.ndarray, cap: int, target: int, align: int, by_cost: bool
) -> tuple[list[list[int]], str]:
    """Stages 2 and 3: a capped packing with a multiple of ``align`` bins, ``target`` when we can reach it."""
    bins = _cost_lpt_pack(lengths, costs, order, target, cap) if by_cost else lpt_pack(lengths, target, cap, order)
    if bins is not None:
        return bins, "cost-lpt" if by_cost else "lpt"
    bins = best_fit_decreasing(lengths, cap, order)
    count = max(target, _align_up(len(bins), align))
    if count > len(lengths):
        raise ScheduleError(
            f"the samples need {len(bins)} micro-batches under the cap {cap} (best fit decreasing); the next multiple "
            f"of dp_size*mb_group = {align} is {count}, but there are only {len(lengths)} samples to fill them"
        )
    expand_bins_by_splitting(bins, count, lengths)
    return bins, "bfd"


# ---------------------------------------------------------------------------------------------------- stage 4
def bin_sums(values: np.ndarray, bins: Sequence[Sequence[int]]) -> np.ndarray:
    """``values`` summed per bin, vectorised (bins must be non-empty)."""
    sizes = np.fromiter((len(b) for b in bins), dtype=np.int64, count=len(bins))
    flat = np.fromiter(chain.from_iterable(bins), dtype=np.int64, count=int(sizes.sum()))
    starts = np.zeros(len(bins), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    return np.add.reduceat(values[flat], starts)


def distribute_bins(bin_costs: np.ndarray, dp_size: int, balance: bool) -> list[list[int]]:
    """Stage 4 over packed bins: ``len(bin_costs) / dp_size`` bin ids per rank."""
    if balance and dp_size > 1:
        groups = karmarkar_karp(bin_costs, dp_size, equal_size=True)
        return refine_equal_size(bin_costs, groups)
    # round-robin over the bins sorted by decreasing cost, reversing direction every round (serpentine)
    by_cost = np.argsort(-bin_costs, kind="stable")
    per_rank = len(bin_costs) // dp_size
    snake = by_cost.reshape(per_rank, dp_size)
    snake[1::2] = snake[1::2, ::-1]
    return snake.T.tolist()


def build_rank_bins(
    lengths: np.ndarray, costs: np.ndarray, order: np.ndarray, cap: int, dp_size: int, per_rank: int, by_cost: bool
) -> list[list[list[int]]] | None:
    """Stage 4, bins chosen per rank: deal samples (decreasing cost) to the lightest rank with room.

    Each rank owns ``per_rank`` capped bins; inside it a sample goes to the fullest bin it fits (best fit), or with
    ``by_cost`` to the cheapest bin it fits. A rank left with fewer samples than bins (one holding a very costly
    sample) takes the cheapest samples of ranks that have more; bins still empty are filled by halving the rank's
    largest bins. Returns ``None`` when some sample fits no rank.
    """
    stride = per_rank + 1
    keys = [list(range(cap * stride, cap * stride + per_rank)) for _ in range(dp_size)]  # room*stride+bin, sorted
    bins = [[[] for _ in range(per_rank)] for _ in range(dp_size)]
    if by_cost:
        bin_heaps = [[(0.0, b) for b in range(per_rank)] for _ in range(dp_size)]
        bin_waiting: list[list[tuple[int, float, int]]] = [[] for _ in range(dp_size)]
        room = [[cap] * per_rank for _ in range(dp_size)]
    heap = [(0.0, r) for r in range(dp_size)]  # (cost, rank) of ranks with a bin that fits the current sample
    waiting: list[tuple[int, float, int]] = []  # (-largest room, cost, rank) of ranks without one
    heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for idx, length, cost in zip(order.tolist(), lengths[order].tolist(), costs[order].tolist()):
        need = length if length < cap else cap  # an oversize sample needs an empty bin
        while waiting and -waiting[0][0] >= need:
            _, rc, r = heappop(waiting)
            heappush(heap, (rc, r))
        while heap:
            rc, r = heap[0]
            rk = keys[r]
            if rk and rk[-1] // stride >= need:
                break
            heappop(heap)
            if rk:  # may still take a smaller sample later
                heappush(waiting, (-(rk[-1] // stride), rc, r))
        else:
            return None
        if by_cost:  # the cheapest bin of this rank that has room
            bh, bw, res = bin_heaps[r], bin_waiting[r], room[r]
            while bw and -bw[0][0] >= need:
                _, bc, b = heappop(bw)
                heappush(bh, (bc, b))
            while True:
                bc, b = heappop(bh)
                if res[b] >= need:
                    break
                heappush(bw, (-res[b], bc, b))
            pos = bisect_left(rk, res[b] * stride + b)
            res[b] -= length
            if res[b] > 0:
                heappush(bh, (bc + cost, b))
        else:  # best fit: the fullest bin that has room
            pos = bisect_left(rk, need * stride)
        key = rk.pop(pos)
        b = key % stride
        bins[r][b].append(idx)
        left = key // stride - length
        if left > 0:
            insort(rk, left * stride + b)
        heapreplace(heap, (rc + cost, r))
    _give_every_bin_a_sample(bins, costs, per_rank)
    for r in range(dp_size):
        filled = [b for b in bins[r] if b]
        if len(filled) < per_rank:
            expand_bins_by_splitting(filled, per_rank, lengths)
        bins[r] = filled
    return bins


def _give_every_bin_a_sample(bins: list[list[list[int]]], costs: np.ndarray, per_rank: int) -> None:
    """Move the cheapest samples of ranks holding more than ``per_rank`` samples to ranks holding fewer."""
    counts = [sum(len(b) for b in rb) for rb in bins]
    for r, rb in enumerate(bins):
        while counts[r] < per_rank:
            donor_items = [(float(costs[i]), i, d, k) for d, db in enumerate(bins) if counts[d] > per_rank
                           for k, b in enumerate(db) for i in b]
            _, i, d, k = min(donor_items)  # callers guarantee n >= dp_size * per_rank, so a donor exists
            bins[d][k].remove(i)
            counts[d] -= 1
            next(b for b in rb if not b).append(i)
            counts[r] += 1


def _plan_dynamic(
    lengths: np.ndarray, costs: np.ndarray, cap: int, parallel: ParallelConfig, batch: BatchConfig, step: int
) -> tuple[list[list[list[int]]], str, int]:
    n = len(lengths)
    align, dp = parallel.align, parallel.dp_size
    target = microbatch_target(lengths, cap, align)
    if n < target:
        raise ScheduleError(
            f"step {step} has {n} samples but needs at least {target} micro-batches (a multiple of "
            f"dp_size*mb_group = {align} covering its {int(lengths.sum())} tokens under the cap {cap}): too few "
            f"samples to give every micro-batch one; raise --max-tokens-per-gpu, lower the DP/VPP alignment or put "
            f"more rollouts per step (--global-batch-size)"
        )
    order = np.argsort(-lengths, kind="stable")  # decreasing length == decreasing cost (cost is increasing in L)
    if not (batch.balance_data and dp > 1):
        bins, strategy = _pack_checked(lengths, costs, order, cap, target, align, batch, step)
        return [[bins[b] for b in g] for g in distribute_bins(bin_sums(costs, bins), dp, False)], strategy, target

    # balance_data: no assignment beats the mean rank cost, nor the rank holding the costliest sample
    floor = max(float(costs.sum()) / dp, float(costs.max()))
    best, best_max, strategy, bins = None, np.inf, "", None
    per_rank_bins = build_rank_bins(lengths, costs, order, cap, dp, target // dp, by_cost=batch.balance_by_flops)
    if per_rank_bins is not None:
        best, best_max, strategy = per_rank_bins, _max_rank_cost(costs, per_rank_bins), "rank-greedy"
    if best_max > floor * (1 + BALANCE_TOLERANCE):
        try:
            bins, packed = _pack_checked(lengths, costs, order, cap, target, align, batch, step)
        except ScheduleError:
            if best is None:
                raise
            bins = None
    if best_max > floor * (1 + BALANCE_TOLERANCE) and bins is not None:
        bin_costs = bin_sums(costs, bins)
        groups = distribute_bins(bin_costs, dp, True)
        packed_max = max(float(bin_costs[g].sum()) for g in groups)
        if best is None or (len(bins) == target and packed_max < best_max):
            best, best_max, strategy = [[bins[b] for b in g] for g in groups], packed_max, packed
    # Capacity-bound steps (the ranks around a very costly sample cannot take their share of tokens): one more
    # micro-batch per rank is worth it when it cuts the slowest rank by more than EXTRA_MB_MIN_GAIN.
    count = len(best[0]) * dp
    for extra in range(1, MAX_EXTRA_ROUNDS + 1):
        if best_max <= floor * (1 + BALANCE_TOLERANCE) or count + align > n:
            break
        more = build_rank_bins(lengths, costs, order, cap, dp, (count + align) // dp, by_cost=batch.balance_by_flops)
        if more is None:
            break
        more_max = _max_rank_cost(costs, more)
        if more_max > best_max * (1 - EXTRA_MB_MIN_GAIN):
            break
        best, best_max, strategy, count = more, more_max, f"rank-greedy+{extra * align}", count + align
    return best, strategy, target


#: balance_data stops looking once the slowest rank is within this of the best any assignment can do
BALANCE_TOLERANCE = 2e-3
#: an extra micro-batch per rank must cut the slowest rank's FLOPs by at least this much
EXTRA_MB_MIN_GAIN = 0.01
MAX_EXTRA_ROUNDS = 3


def _max_rank_cost(costs: np.ndarray, rank_bins: list[list[list[int]]]) -> float:
    return max(float(bin_sums(costs, rb).sum()) for rb in rank_bins)


def _pack_checked(lengths, costs, order, cap, target, align, batch, step) -> tuple[list[list[int]], str]:
    try:
        return pack_step(lengths, costs, order, cap, target, align, by_cost=batch.balance_by_flops)
    except ScheduleError as e:
        raise ScheduleError(
            f"step {step}: {e}; raise --max-tokens-per-gpu, put more rollouts in a step (--global-batch-size) or "
            f"lower the DP/VPP alignment"
        ) from None


def _plan_static(
    n: int, costs: np.ndarray, parallel: ParallelConfig, batch: BatchConfig, step: int
) -> tuple[list[list[list[int]]], str, int]:
    mbs = batch.micro_batch_size
    align, dp = parallel.align, parallel.dp_size
    count = -(-n // mbs)
    if count % align:
        raise ScheduleError(
            f"step {step} has {n} samples = {count} micro-batches of micro_batch_size={mbs}, not a multiple of "
            f"dp_size*mb_group = {align}; make the samples per step a multiple of {align * mbs} "
            f"(--global-batch-size, --micro-batch-size) or use --use-dynamic-batch-size"
        )
    per_rank = count // dp
    if not batch.balance_data or dp == 1:
        chunks = [list(range(i, min(i + mbs, n))) for i in range(0, n, mbs)]
        return [[chunks[k] for k in range(r, count, dp)] for r in range(dp)], "static", count
    # balanced: rank r holds the samples of its per_rank chunks; the last rank takes the short chunk, as strided
    sizes = [per_rank * mbs] * dp
    sizes[(count - 1) % dp] -= count * mbs - n
    groups = refine_equal_size(costs, _lpt_with_sizes(costs, sizes))
    rank_bins = []
    for r, g in enumerate(groups):
        g = sorted(g, key=lambda i: (-costs[i], i))
        chunk_sizes = [mbs] * per_rank
        chunk_sizes[-1] -= per_rank * mbs - len(g)
        rank_bins.append(_lpt_with_sizes(costs[g], chunk_sizes, items=g))
    return rank_bins, "static-balanced", count


def _lpt_with_sizes(weights: np.ndarray, sizes: list[int], items: list[int] | None = None) -> list[list[int]]:
    """Deal items (decreasing weight) to the lightest group that still has a free slot; group g gets sizes[g]."""
    idx = np.argsort(-np.asarray(weights), kind="stable")
    items = list(range(len(weights))) if items is None else items
    groups: list[list[int]] = [[] for _ in sizes]
    heap = [(0.0, g) for g, s in enumerate(sizes) if s > 0]
    for i in idx.tolist():
        load, g = heapq.heappop(heap)
        groups[g].append(items[i])
        if len(groups[g]) < sizes[g]:
            heapq.heappush(heap, (load + float(weights[i]), g))
    return groups


def _append_step(
    rank_bins: list[list[list[int]]],
    step_idx: np.ndarray,
    step_len: np.ndarray,
    step_cost: np.ndarray,
    partitions: list[list[int]],
    micro_batch_indices: list[list[list[int]]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Append one step to every rank: micro-batches heaviest first, samples in a micro-batch by global index.

    Returns per micro-batch (rank-major, in the order appended) its sample count, cost and tokens.
    """
    dp, per_rank = len(rank_bins), len(rank_bins[0])
    all_bins = list(chain.from_iterable(rank_bins))
    sizes = np.fromiter((len(b) for b in all_bins), dtype=np.int64, count=len(all_bins))
    flat = np.fromiter(chain.from_iterable(all_bins), dtype=np.int64, count=int(sizes.sum()))
    bin_of = np.repeat(np.arange(len(all_bins)), sizes)
    flat = flat[np.lexsort((flat, bin_of))]  # each bin's samples ascending (local index order = global order)
    starts = np.zeros(len(all_bins), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    cost = np.add.reduceat(step_cost[flat], starts)
    tokens = np.add.reduceat(step_len[flat], starts)
    rank_of = np.arange(len(all_bins)) // per_rank
    new_order = np.lexsort((flat[starts], -cost, rank_of))  # per rank: heavy first, then first sample
    sizes_o = sizes[new_order]
    # samples re-laid out in the new micro-batch order
    take = np.repeat(starts[new_order] - np.concatenate(([0], np.cumsum(sizes_o)[:-1])), sizes_o)
    glob = step_idx[flat[take + np.arange(len(flat))]]
    rank_len = sizes_o.reshape(dp, per_rank).sum(axis=1)
    rank_start = np.concatenate(([0], np.cumsum(rank_len)))
    for r in range(dp):
        part, mbis = partitions[r], micro_batch_indices[r]
        base = len(part)
        part.extend(glob[rank_start[r]:rank_start[r + 1]].tolist())
        for size in sizes_o[r * per_rank:(r + 1) * per_rank].tolist():
            mbis.append(list(range(base, base + size)))
            base += size
    return sizes[new_order], cost[new_order], tokens[new_order]


# ---------------------------------------------------------------------------------------------------- the planner
def plan_schedule(
    total_lengths: Sequence[int] | np.ndarray,
    parallel: ParallelConfig,
    batch: BatchConfig,
    *,
    rollout_ids: Sequence[int] | np.ndarray | None = None,
    loss_tokens: Sequence[int] | np.ndarray | None = None,
    cost_model: CostModel | None = None,
) -> DPSchedule:
    """Plan one rollout: walk the four stages of the module docstring for every step.

    ``total_lengths[i]`` is sample ``i``'s token count, ``rollout_ids[i]`` its rollout (default: one rollout per
    sample), ``loss_tokens[i]`` its loss-mask token count (optional). ``cost_model`` gives FLOPs estimates for
    balancing (default: tokens).
    """
    if not isinstance(parallel, ParallelConfig):
        raise ScheduleError(f"parallel must be a ParallelConfig, got {type(parallel).__name__}; "
                            f"use ParallelConfig.from_dict(train_parallel_config)")
    if not isinstance(batch, BatchConfig):
        raise ScheduleError(f"batch must be a BatchConfig, got {type(batch).__name__}; use BatchConfig.from_args(args)")
    lengths = _as_int_array("total_lengths", total_lengths, None, minimum=1)
    n = len(lengths)
    if n == 0:
        raise ScheduleError("total_lengths is empty: the rollout produced no samples; check the rollout function")
    ordinals = _rollout_ordinals(rollout_ids, n)
    loss = None if loss_tokens is None else _as_int_array("loss_tokens", loss_tokens, n, minimum=0)
    if loss is not None and np.any(loss > lengths):
        bad = int(np.argmax(loss > lengths))
        raise ScheduleError(
            f"loss_tokens[{bad}] = {int(loss[bad])} exceeds total_lengths[{bad}] = {int(lengths[bad])}; "
            f"a sample cannot have more loss tokens than tokens"
        )
    costs = sample_costs(lengths, cost_model)
    cap = batch.cap(parallel.cp_size)
    dp = parallel.dp_size

    # 1. steps of whole rollouts; the trimmed tail is reported, never silent
    steps, rollouts_per_step, dropped = split_into_steps(ordinals, parallel, batch)

    partitions: list[list[int]] = [[] for _ in range(dp)]
    micro_batch_indices: list[list[list[int]]] = [[] for _ in range(dp)]
    num_microbatches: list[int] = []
    stats: list[StepStats] = []
    for s, step_idx in enumerate(steps):
        n_s = len(step_idx)
        if n_s < dp:
            raise ScheduleError(
                f"step {s} has {n_s} samples but dp_size = {dp}: every rank needs at least one micro-batch; "
                f"raise --global-batch-size or collect more samples per rollout"
            )
        step_len, step_cost = lengths[step_idx], costs[step_idx]
        # 2.-4. pack, align, distribute; rank_bins[r][k] = local indices into step_idx
        if cap is None:
            rank_bins, strategy, bound = _plan_static(n_s, step_cost, parallel, batch, s)
        else:
            rank_bins, strategy, bound = _plan_dynamic(step_len, step_cost, cap, parallel, batch, s)

        per_rank = len(rank_bins[0])
        num_microbatches.append(per_rank)
        mb_sizes, mb_cost, mb_tokens = _append_step(rank_bins, step_idx, step_len, step_cost,
                                                   partitions, micro_batch_indices)
        mb_cost_arr = mb_cost.reshape(dp, per_rank)
        rank_cost = mb_cost_arr.sum(axis=1)
        mean = float(rank_cost.mean())
        tokens = mb_tokens
        violations = 0 if cap is None else int(np.count_nonzero((tokens > cap) & (mb_sizes > 1)))
        stats.append(StepStats(
            step=s,
            num_samples=n_s,
            num_rollouts=int(len(np.unique(ordinals[step_idx]))),
            total_tokens=int(step_len.sum()),
            num_microbatches=per_rank,
            total_microbatches=per_rank * dp,
            aligned_lower_bound=bound,
            cap=cap,
            largest_bin_tokens=int(tokens.max()),
            cap_violations=violations,
            rank_flops_max=float(rank_cost.max()),
            rank_flops_mean=mean,
            balance_lower_bound=max(1.0, float(step_cost.max()) / mean) if mean > 0 else 1.0,
            microbatch_flops_max=float(mb_cost_arr.max()),
            microbatch_flops_mean=float(mb_cost_arr.mean()),
            strategy=strategy,
        ))

    samples_per_step = [len(x) for x in steps]
    return DPSchedule(
        partitions=partitions,
        micro_batch_indices=micro_batch_indices,
        num_microbatches=num_microbatches,
        samples_per_step=samples_per_step,
        rollouts_per_step=rollouts_per_step,
        dropped=dropped.tolist(),
        stats=stats,
        parallel=parallel,
        batch=batch,
        total_lengths=lengths.tolist(),
        rollout_ids=None if rollout_ids is None else np.asarray(rollout_ids).astype(np.int64).tolist(),
        loss_tokens=None if loss is None else loss.tolist(),
        loss_tokens_per_step=None if loss is None else [int(loss[x].sum()) for x in steps],
        cost_model=cost_model,
        step_samples=[x.tolist() for x in steps],
    )
