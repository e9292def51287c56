"""One NeMo-RL shard call -> slime-ext's plan, as the shard metadata NeMo-RL's Megatron workers read.

NeMo-RL's driver shards a batch for its DP workers in ``Policy._shard_for_train`` (``batch_size`` = the global
batch: one optimizer step per ``batch_size`` contiguous samples) and ``Policy._shard_for_logprob`` (``batch_size``
None: the whole batch is one forward-only pass), both through ``BatchedDataDict.shard_by_batch_size``. With sequence
packing each worker reads, per global batch ``g`` of its shard:

* ``micro_batch_indices[g]``: ``[start, end)`` of every micro-batch, local to global batch ``g``'s rows on the shard;
* ``micro_batch_lengths[g]``: the tokens each packed micro-batch holds (its rows' lengths, each rounded up to
  ``sequence_length_pad_multiple``);
* ``elem_counts_per_gb[g]``: how many rows global batch ``g`` holds on the shard (``get_batch`` slices by them),

and the driver undoes the order of a log-prob pass with ``reorder_data(sorted_indices)``, ``sorted_indices`` being
the rows of shard 0, then shard 1, ... in shard order.

:func:`plan_shards` fills exactly those from one :class:`~slime_ext.schedule.PlanRequest`:

1. **Rows.** Row ``i``'s planned length is ``input_lengths[i]`` rounded up to ``pad_multiple`` (what NeMo-RL's
   worker packs); every row is planned exactly once.
2. **Steps.** The request's explicit steps (``step_of``): row ``i`` is in global batch ``i // batch_size`` (all rows
   in one when ``batch_size`` is None), NeMo-RL's own chunking, so each optimizer step trains the same rows as
   NeMo-RL's path.
3. **Micro-batches.** The planner packs each step under the cap (``cap`` tokens per micro-batch before context
   parallelism splits it), the same count on every DP rank (a multiple of the VPP group), FLOPs balanced, and with
   pipeline parallelism the count and order its pipeline model predicts fastest for the pass asked for
   (``forward_only``: a log-prob pass). NeMo-RL's Megatron worker pads every packed micro-batch of a rank's global
   batch to the longest one under pipeline parallelism (megatron-core's p2p then sees one shape); with
   ``pad_to_longest`` the count is the one that predicts fastest with that padding priced in (:func:`_pad_aware`),
   and the plan keeps its predicted time (``ShardPlan.padded_time``).
4. **Metadata.** Each rank's rows in micro-batch order, and the three lists above.

The pad is priced one way everywhere (:func:`padded_micro_batch_costs`): a pad token costs the per-token (linear)
rate of the cost model: the pad runs through every linear layer (projections, MLP, output layer), while attention
over it is masked out of the real rows' (megatron-core's packed attention runs each row over its own sequence
length), so the quadratic term stays each row's own. Scaling a micro-batch's whole cost up to the longest one's
tokens would charge the pad the rows' attention as well. With that padding, :func:`choose_padded` prices another
plan of the same call (NeMo-RL's own, read off its metadata by :func:`micro_batch_rows`) the same way
(:func:`padded_pass_time`) against the plan's ``padded_time``, so the caller runs the faster one.

Pure: standard library, numpy and :mod:`slime_ext.schedule`'s public API.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from slime_ext.schedule import (BatchConfig, CostModel, CostProfile, DPSchedule, ParallelConfig, PlannerConfig,
                                PlanRequest, ScheduleError, microbatch_costs, pipeline_pricing, plan)

__all__ = ["MicroBatchRows", "PaddedChoice", "ShardPlan", "check_shard_plan", "choose_padded", "micro_batch_rows",
           "padded_micro_batch_costs", "padded_pass_time", "plan_shards", "round_up"]


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (>= 1)."""
    return -(-int(value) // multiple) * multiple


@dataclass(frozen=True)
class ShardPlan:
    """slime-ext's plan of one shard call, in NeMo-RL's terms (global row ids of the batch being sharded).

    * ``rows[r]``: the rows DP rank ``r``'s shard holds, in order (global batch by global batch, micro-batch by
      micro-batch);
    * ``micro_batch_indices[r][g]``, ``micro_batch_lengths[r][g]``, ``elem_counts_per_gb[r][g]``: what NeMo-RL's
      worker reads (the module docstring);
    * ``sorted_indices``: ``rows[0] + rows[1] + ...`` (``reorder_data`` undoes it);
    * ``padded_lengths``: every row's length as packed (rounded up to ``pad_multiple``);
    * ``schedule``: the planner's record (``stats[g].predicted_makespan`` etc.);
    * ``padded_time``: planned with ``pad_to_longest`` under pipeline parallelism, the pass's predicted time with
      that pad (:func:`padded_pass_time`), else ``None``.
    """

    rows: tuple[tuple[int, ...], ...]
    micro_batch_indices: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    micro_batch_lengths: tuple[tuple[tuple[int, ...], ...], ...]
    elem_counts_per_gb: tuple[tuple[int, ...], ...]
    padded_lengths: tuple[int, ...]
    cap: int
    forward_only: bool
    schedule: DPSchedule
    padded_time: float | None = None

    @property
    def dp_size(self) -> int:
        return len(self.rows)

    @property
    def num_global_batches(self) -> int:
        return len(self.schedule.num_microbatches)

    @property
    def sorted_indices(self) -> list[int]:
        return [i for rank in self.rows for i in rank]

    def micro_batch_rows(self) -> list[list[list[list[int]]]]:
        """The plan as :data:`MicroBatchRows`: ``[g][r]`` rank ``r``'s micro-batches of global batch ``g``, row ids."""
        return micro_batch_rows(self.rows, self.micro_batch_indices, self.elem_counts_per_gb)

    def computed_tokens(self) -> int:
        """Tokens the packed micro-batches hold over all ranks (rows padded to the multiple; no pad-to-max)."""
        return sum(t for rank in self.micro_batch_lengths for gb in rank for t in gb)


def _check_inputs(lengths: np.ndarray, dp: int, batch_size: int | None, cap: int, pad_multiple: int) -> int:
    """Refuse what NeMo-RL's shard call would refuse, naming the setting; returns the global batch size."""
    for name, value in (("shards", dp), ("max_tokens_per_microbatch", cap),
                        ("sequence_length_pad_multiple", pad_multiple)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ScheduleError(f"{name} = {value!r} must be a positive integer")
    if lengths.ndim != 1 or lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer):
        raise ScheduleError(f"input_lengths must be a non-empty 1-D sequence of token counts, got shape "
                            f"{lengths.shape} dtype {lengths.dtype}")
    if lengths.min() < 1:
        bad = int(np.flatnonzero(lengths < 1)[0])
        raise ScheduleError(f"input_lengths[{bad}] = {int(lengths[bad])}: every row needs at least one token; drop "
                            f"empty rows before training")
    size = lengths.size if batch_size is None else batch_size
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1 or lengths.size % size:
        raise ScheduleError(f"batch_size = {batch_size!r} does not divide the {lengths.size} rows into global "
                            f"batches; pass a global batch size that divides the batch (policy.train_global_batch_size)")
    if size % dp:
        raise ScheduleError(f"the global batch of {size} rows is not a multiple of the {dp} DP shards; make "
                            f"train_global_batch_size a multiple of the data-parallel size")
    return int(size)


def plan_shards(
    input_lengths: Sequence[int] | np.ndarray,
    *,
    parallel: ParallelConfig,
    batch_size: int | None,
    cap: int,
    pad_multiple: int = 1,
    forward_only: bool = False,
    cost_model: CostModel | CostProfile | None = None,
    config: PlannerConfig | None = None,
    pad_to_longest: bool = False,
) -> ShardPlan:
    """Plan one shard call (the module docstring): ``input_lengths[i]`` is row ``i``'s token count, ``parallel``
    the Megatron layout (its ``dp_size`` is the shard count), ``batch_size`` the rows per optimizer step (``None``:
    one pass over all rows), ``cap`` NeMo-RL's ``max_tokens_per_microbatch`` (``train_mb_tokens`` or
    ``logprob_mb_tokens``), ``pad_multiple`` its ``sequence_length_pad_multiple``, ``forward_only`` the pass.
    ``pad_to_longest``: the worker pads every packed micro-batch to the longest of its rank's global batch (NeMo-RL's
    Megatron worker does under pipeline parallelism), so the count is chosen with that padding priced in."""
    lengths = np.asarray(input_lengths)
    dp = parallel.require_dp_size()
    size = _check_inputs(lengths, dp, batch_size, cap, pad_multiple)
    padded = -(-lengths.astype(np.int64) // int(pad_multiple)) * int(pad_multiple)
    cp = parallel.cp_size
    # 1-2: rows and NeMo-RL's own global batches as the request's explicit steps
    step_of = np.arange(lengths.size, dtype=np.int64) // size
    num_steps = int(step_of[-1]) + 1
    if cap // cp < 1:
        raise ScheduleError(f"max_tokens_per_microbatch = {cap} is below the context-parallel size {cp}; raise "
                            f"train_mb_tokens / logprob_mb_tokens")
    batch = BatchConfig(global_batch_size=size, use_dynamic_batch_size=True, max_tokens_per_gpu=int(cap) // cp,
                        balance_data=True)
    # 3: one request to the planner (with the pad to the longest: the count it prices fastest, see _pad_aware)
    request = PlanRequest(lengths=padded, parallel=parallel, batch=batch, step_of=step_of,
                          forward_only=bool(forward_only), cost_model=cost_model, config=config)
    schedule, padded_time = (_pad_aware(request, num_steps) if pad_to_longest and parallel.pp_size > 1
                             else (plan(request), None))
    # 4: each rank's rows and metadata, global batch by global batch
    starts = np.cumsum([0, *schedule.num_microbatches])
    rows, indices, mb_lengths, counts = [], [], [], []
    for r in range(dp):
        partition = schedule.partitions[r]
        mbs = [[int(partition[i]) for i in local] for local in schedule.micro_batch_indices[r]]
        rank_rows, rank_indices, rank_lengths, rank_counts = [], [], [], []
        for s in range(num_steps):
            bounds, lens, pos = [], [], 0
            for mb in mbs[starts[s]:starts[s + 1]]:
                rank_rows += mb
                bounds.append((pos, pos + len(mb)))
                lens.append(int(padded[mb].sum()))
                pos += len(mb)
            rank_indices.append(tuple(bounds))
            rank_lengths.append(tuple(lens))
            rank_counts.append(pos)
        rows.append(tuple(rank_rows))
        indices.append(tuple(rank_indices))
        mb_lengths.append(tuple(rank_lengths))
        counts.append(tuple(rank_counts))
    result = ShardPlan(rows=tuple(rows), micro_batch_indices=tuple(indices), micro_batch_lengths=tuple(mb_lengths),
                       elem_counts_per_gb=tuple(counts), padded_lengths=tuple(int(x) for x in padded),
                       cap=int(cap) // cp * cp, forward_only=bool(forward_only), schedule=schedule,
                       padded_time=padded_time)
    check_shard_plan(result, batch_size=size)
    return result


#: how many fixed counts :func:`_pad_aware` prices beyond the smallest that holds every step under the cap
PAD_AWARE_COUNTS = 4


def _pad_aware(request: PlanRequest, num_steps: int) -> tuple[DPSchedule, float]:
    """The plan of ``request`` for a worker that pads every micro-batch of a rank's step to the longest (NeMo-RL's
    Megatron worker under pipeline parallelism, which gives megatron-core's p2p one shape per step), and its
    predicted time: the planner's own choice and the fixed counts from the smallest that holds every step
    (``microbatches_per_rank``, each with ``balance_by_flops`` so that a rank's micro-batches come out even), each
    priced as :func:`padded_pass_time` prices a pass; the fastest wins (the planner's own choice on a tie)."""
    pricing = _padded_pricing(request.parallel, request.cost_model, request.batch.cap(request.parallel.cp_size),
                              request.config, request.forward_only)
    even = dataclasses.replace(request.batch, balance_by_flops=True)
    candidates = [plan(request)]
    group = request.parallel.align // request.parallel.dp_size
    count = group
    while len(candidates) <= PAD_AWARE_COUNTS and count <= max(candidates[0].num_microbatches):
        try:
            candidates.append(plan(dataclasses.replace(request, batch=even, microbatches_per_rank=count)))
        except ScheduleError:  # too few micro-batches for some step's tokens under the cap: try more
            pass
        count += group
    lengths = np.asarray(request.lengths)
    priced = [(_priced_padded(_schedule_rows(schedule, num_steps), lengths, request.cost_model, pricing), k)
              for k, schedule in enumerate(candidates)]
    best_time, best = min(priced)
    return candidates[best], best_time


def _schedule_rows(schedule: DPSchedule, num_steps: int) -> list[list[list[list[int]]]]:
    """A planner's schedule as :data:`MicroBatchRows` (sample ids)."""
    starts = np.cumsum([0, *schedule.num_microbatches])
    return [[[[int(schedule.partitions[r][i]) for i in local]
              for local in schedule.micro_batch_indices[r][starts[s]:starts[s + 1]]]
             for r in range(schedule.dp_size)] for s in range(num_steps)]


#: ``micro_batches[g][r]``: DP rank ``r``'s micro-batches of global batch ``g`` in run order, each a list of row ids
MicroBatchRows = Sequence[Sequence[Sequence[Sequence[int]]]]


def micro_batch_rows(rows: Sequence[Sequence[int]], micro_batch_indices: Sequence[Sequence[Sequence[Sequence[int]]]],
                     elem_counts_per_gb: Sequence[Sequence[int]]) -> list[list[list[list[int]]]]:
    """Shard metadata in NeMo-RL's terms (``rows[r]``: the rows shard ``r`` holds in order; its
    ``micro_batch_indices[r][g]`` and ``elem_counts_per_gb[r][g]``) -> :data:`MicroBatchRows` (row ids)."""
    if not (len(rows) == len(micro_batch_indices) == len(elem_counts_per_gb)) or not rows:
        raise ScheduleError(f"shard metadata: {len(rows)} shards of rows, {len(micro_batch_indices)} of "
                            f"micro_batch_indices, {len(elem_counts_per_gb)} of elem_counts_per_gb; one each per shard")
    num_gb = len(elem_counts_per_gb[0])
    out: list[list[list[list[int]]]] = [[] for _ in range(num_gb)]
    for r, (held, bounds, counts) in enumerate(zip(rows, micro_batch_indices, elem_counts_per_gb)):
        if len(bounds) != num_gb or len(counts) != num_gb or sum(counts) != len(held):
            raise ScheduleError(f"shard metadata: shard {r} has {len(bounds)} global batches of micro_batch_indices "
                                f"and elem_counts_per_gb {list(counts)} for {len(held)} rows; shard 0 has {num_gb}")
        offset = 0
        for g in range(num_gb):
            gb = list(held[offset:offset + counts[g]])
            out[g].append([[int(i) for i in gb[start:end]] for start, end in bounds[g]])
            offset += counts[g]
    return out


#: relative difference below which two predicted times are a tie (float noise of summing the same costs in another
#: order; not a modelling tolerance)
TIE = 1e-9


@dataclass(frozen=True)
class PaddedChoice:
    """Which of two plans of one shard call is predicted faster when the worker pads every micro-batch of a rank's
    global batch to the longest (:func:`choose_padded`): ``ours`` and ``theirs`` their predicted times (``theirs``
    ``None`` when that plan is no candidate, ``why_not`` saying why)."""

    ours: float
    theirs: float | None
    why_not: str = ""

    @property
    def theirs_wins(self) -> bool:
        """The other plan is faster (ours wins a tie, up to float noise: :data:`TIE`)."""
        return self.theirs is not None and self.theirs < self.ours * (1.0 - TIE)


def padded_pass_time(micro_batches: MicroBatchRows, lengths: Sequence[int] | np.ndarray, *, parallel: ParallelConfig,
                     cap: int, forward_only: bool, cost_model: CostModel | CostProfile | None = None,
                     config: PlannerConfig | None = None) -> float:
    """The predicted time of a pass whose worker pads every micro-batch of a rank's global batch to the longest one
    (NeMo-RL's Megatron worker under pipeline parallelism): ``micro_batches`` (:data:`MicroBatchRows`) index
    ``lengths``, the rows' lengths as packed. Each rank's micro-batches are priced padded to its longest
    (:func:`padded_micro_batch_costs`), each global batch by the planner's pipeline model
    (:func:`~slime_ext.schedule.pipeline_pricing` for ``parallel``, ``cap`` and the pass) as its slowest rank's
    makespan, and the global batches are summed; the way :func:`plan_shards` prices its own candidates."""
    return _priced_padded(micro_batches, np.asarray(lengths), cost_model,
                          _padded_pricing(parallel, cost_model, cap, config, forward_only))


def choose_padded(ours_time: float, theirs: MicroBatchRows, lengths: Sequence[int] | np.ndarray, *,
                  parallel: ParallelConfig, cap: int, forward_only: bool,
                  cost_model: CostModel | CostProfile | None = None,
                  config: PlannerConfig | None = None) -> PaddedChoice:
    """``theirs``, another plan of the call that ``ours_time`` is the predicted time of (a plan's ``padded_time``,
    or :func:`padded_pass_time` with these arguments), priced by :func:`padded_pass_time`, only when it runs at
    all: every row of ``lengths`` exactly once, the same micro-batch count on every rank of each global batch, a
    multiple of the VPP group, and no micro-batch of several rows above ``cap``. Each plan is priced once."""
    lengths = np.asarray(lengths)
    why_not = _not_a_candidate(theirs, lengths, parallel, cap)
    if why_not:
        return PaddedChoice(float(ours_time), None, why_not)
    return PaddedChoice(float(ours_time), padded_pass_time(theirs, lengths, parallel=parallel, cap=cap,
                                                           forward_only=forward_only, cost_model=cost_model,
                                                           config=config))


def _padded_pricing(parallel: ParallelConfig, cost_model, cap: int, config, forward_only: bool):
    if parallel.pp_size == 1:
        raise ScheduleError("padded_pass_time: the pad to the longest micro-batch is priced under pipeline "
                            "parallelism only (pp_size > 1)")
    return pipeline_pricing(parallel, cost_model, cap, config, forward_only=forward_only)


def _not_a_candidate(micro_batches: MicroBatchRows, lengths: np.ndarray, parallel: ParallelConfig, cap: int) -> str:
    """Why a plan cannot run as it is, or ``""``."""
    held = sorted(int(i) for gb in micro_batches for rank in gb for mb in rank for i in mb)
    if held != list(range(lengths.size)):
        return f"it does not hold each of the {lengths.size} rows exactly once"
    group = parallel.align // parallel.dp_size
    for g, ranks in enumerate(micro_batches):
        counts = {len(mbs) for mbs in ranks}
        if len(ranks) != parallel.dp_size or len(counts) != 1 or next(iter(counts)) % group:
            return (f"global batch {g}: micro-batch counts {sorted(counts)} over {len(ranks)} ranks, not one count, "
                    f"a multiple of {group}, on each of the {parallel.dp_size}")
        if any(len(mb) > 1 and int(lengths[list(mb)].sum()) > cap for mbs in ranks for mb in mbs):
            return f"global batch {g}: a micro-batch of several rows is above the cap {cap}"
    return ""


def padded_micro_batch_costs(micro_batches: Sequence[Sequence[int]], lengths: Sequence[int] | np.ndarray,
                             cost_model: CostModel | CostProfile | None, width: int | None = None) -> np.ndarray:
    """``(M,)`` the cost of each micro-batch (row ids into ``lengths``, the rows' lengths as packed) padded to
    ``width`` tokens (default: the longest of them; a micro-batch already longer keeps its own): its rows' cost
    (:func:`~slime_ext.schedule.microbatch_costs`) plus every pad token at the cost model's per-token rate (the
    linear coefficient of FLOPs or measured seconds; 1 without a cost model, which prices tokens). The one pricing
    of the pad (the module docstring says why the linear rate)."""
    lengths = np.asarray(lengths)
    tokens = np.array([int(lengths[list(mb)].sum()) for mb in micro_batches], dtype=np.float64)
    target = tokens.max(initial=0.0) if width is None else float(width)
    rate = cost_model.coefficients()[0] if cost_model is not None else 1.0
    return microbatch_costs(lengths, micro_batches, cost_model) + rate * np.maximum(target - tokens, 0.0)


def _priced_padded(micro_batches: MicroBatchRows, lengths: np.ndarray, cost_model, pricing) -> float:
    total = 0.0
    for g, ranks in enumerate(micro_batches):
        if len({len(mbs) for mbs in ranks}) != 1:
            raise ScheduleError(f"padded_pass_time: global batch {g} has micro-batch counts "
                                f"{[len(mbs) for mbs in ranks]} on its ranks; the pipeline runs one count on all")
        costs = [padded_micro_batch_costs(mbs, lengths, cost_model) for mbs in ranks]
        total += float(pricing.makespans(np.array(costs)).max())
    return total


def check_shard_plan(shards: ShardPlan, *, batch_size: int) -> None:
    """The plan's invariants; ``ScheduleError`` naming the first one broken. Run on every plan (:func:`plan_shards`)
    and by the tests:

    * every row is on exactly one rank, and global batch ``g``'s rows on every rank are rows of global batch ``g``
      (``row // batch_size == g``), ``elem_counts_per_gb`` counting them;
    * every rank has the same number of micro-batches in each global batch, none empty, and the ``[start, end)``
      bounds tile the global batch's rows on the rank in order;
    * a micro-batch's length is the sum of its rows' padded lengths, at most ``cap`` when it holds more than one row.
    """
    n = len(shards.padded_lengths)
    if sorted(shards.sorted_indices) != list(range(n)):
        raise ScheduleError(f"plan: the shards do not hold each of the {n} rows exactly once")
    num_gb = shards.num_global_batches
    for r in range(shards.dp_size):
        rows = shards.rows[r]
        if len(shards.elem_counts_per_gb[r]) != num_gb or sum(shards.elem_counts_per_gb[r]) != len(rows):
            raise ScheduleError(f"plan: elem_counts_per_gb of DP rank {r} do not count its {len(rows)} rows in "
                                f"{num_gb} global batches")
        offset = 0
        for g in range(num_gb):
            count = shards.elem_counts_per_gb[r][g]
            gb_rows = rows[offset:offset + count]
            offset += count
            if any(i // batch_size != g for i in gb_rows):
                raise ScheduleError(f"plan: DP rank {r}'s global batch {g} holds rows of another global batch")
            _check_micro_batches(shards, r, g, gb_rows)


def _check_micro_batches(shards: ShardPlan, r: int, g: int, gb_rows: Sequence[int]) -> None:
    bounds, lengths = shards.micro_batch_indices[r][g], shards.micro_batch_lengths[r][g]
    want = shards.micro_batch_indices[0][g]
    if len(bounds) != len(want) or len(lengths) != len(bounds):
        raise ScheduleError(f"plan: DP rank {r} has {len(bounds)} micro-batches in global batch {g}, rank 0 has "
                            f"{len(want)}")
    pos = 0
    for (start, end), tokens in zip(bounds, lengths):
        if start != pos or end <= start:
            raise ScheduleError(f"plan: DP rank {r}'s micro-batches of global batch {g} do not tile its rows")
        pos = end
        held = [shards.padded_lengths[i] for i in gb_rows[start:end]]
        if tokens != sum(held):
            raise ScheduleError(f"plan: a micro-batch of global batch {g} on DP rank {r} says {tokens} tokens, its "
                                f"rows hold {sum(held)}")
        if len(held) > 1 and tokens > shards.cap:
            raise ScheduleError(f"plan: a micro-batch of global batch {g} on DP rank {r} holds {len(held)} rows and "
                                f"{tokens} tokens, above the cap {shards.cap}")
    if pos != len(gb_rows):
        raise ScheduleError(f"plan: DP rank {r}'s micro-batches of global batch {g} cover {pos} of its "
                            f"{len(gb_rows)} rows")
