"""One Megatron-RL rollout collection -> slime-ext's plan: which rows each DP rank trains, in which micro-batch of
which optimizer step.

Megatron-RL (``train_rl.py``, ``megatron/rl``) turns one rollout collection into training rows (one row per usable
rollout, or one per turn of a multi-turn rollout that cannot be collapsed), pads the row count with all-pad rows to a
multiple of ``dp * micro_batch_size``, and trains the collection in ``1 / ratio`` optimizer steps
(``ratio = global_batch_size / (grpo_prompts_per_step * grpo_group_size)``), ``grpo_iterations`` times over.
:func:`plan_collection` plans all of it at once with slime-ext's planner (one
:class:`~slime_ext.schedule.PlanRequest`, planned by :func:`slime_ext.schedule.plan`):

1. **Rows.** The rows of length 0 are Megatron-RL's padding rows: they are not samples and are not planned (they
   carry no token and no loss). Every other row is planned exactly once. A row's length is its token count rounded
   up to ``seq_length_multiple`` (``2 * cp`` under context parallelism, as Megatron-RL aligns every sequence).
2. **Steps.** The rows, in collection order (group-major: a GRPO group's samples are adjacent), are cut into
   ``num_steps`` contiguous steps, as even as possible: exactly ``global_batch_size`` rows each when the collection
   holds ``num_steps * global_batch_size`` rows (the normal case); otherwise (failed episodes dropped, turns
   expanded) the first ``rows % num_steps`` steps hold one row more. No row is left out and none is repeated, so a
   pass over the collection trains every sample exactly once.
3. **Micro-batches.** The steps are the request's explicit steps (``PlanRequest.step_of``: the step of every row):
   micro-batches of real tokens under the cap (``cap``, rounded down to a multiple of
   ``token_multiple`` and of ``cp``, so that the tail padding a micro-batch may need -- sequence parallelism needs a
   row length divisible by ``tp`` -- never takes it over the cap), the same count on every DP rank (a multiple of
   the VPP group), balanced by estimated FLOPs, and with pipeline parallelism the count and order the planner's
   pipeline model predicts fastest.
4. **The log-prob pass.** Megatron-RL's old-policy and reference log-prob passes run every micro-batch of the
   collection through one forward-only call of megatron-core's schedule, and its loss reads their results in the
   training micro-batches' layout; so the pass runs those micro-batches (every sample once, under the same cap),
   each rank in the order the pipeline model predicts fastest for the **forward-only** schedule
   (:func:`logprob_order`; with one pipeline stage the plan order).

The result, :class:`CollectionPlan`, is a pure description (row ids); :mod:`.runtime` turns it into Megatron-RL's
packed tensors. Pure: standard library, numpy and :mod:`slime_ext.schedule`'s public API.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Sequence

import numpy as np

from slime_ext.schedule import (BatchConfig, CostModel, CostProfile, DPSchedule, ParallelConfig, PlanRequest,
                                ScheduleError, best_orders, microbatch_costs, pipeline_pricing, plan)

__all__ = ["CollectionPlan", "check_collection_plan", "logprob_order", "plan_collection", "round_up",
           "split_rows_into_steps"]


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (>= 1)."""
    return -(-int(value) // multiple) * multiple


def _lcm(a: int, b: int) -> int:
    return a * b // gcd(a, b)


def split_rows_into_steps(num_rows: int, num_steps: int) -> list[range]:
    """``num_steps`` contiguous ranges over ``range(num_rows)``, as even as possible (the first ``num_rows %
    num_steps`` one longer): every row in exactly one step, in order."""
    if num_steps < 1:
        raise ScheduleError(f"num_steps = {num_steps}: a collection trains in at least one optimizer step; check "
                            f"--global-batch-size against --grpo-prompts-per-step * --grpo-group-size")
    base, extra = divmod(num_rows, num_steps)
    bounds = np.cumsum([0] + [base + (s < extra) for s in range(num_steps)])
    return [range(int(bounds[s]), int(bounds[s + 1])) for s in range(num_steps)]


@dataclass(frozen=True)
class CollectionPlan:
    """slime-ext's plan of one rollout collection (global row ids, as Megatron-RL numbers its rows after padding).

    * ``micro_batches[r][s][k]``: the rows of DP rank ``r``'s ``k``-th micro-batch of step ``s``, in the order they
      sit in the packed micro-batch; ``num_microbatches[s]`` micro-batches per rank, the same on every rank.
    * ``step_rows[s]``: the rows step ``s`` trains (collection order); ``samples_per_step[s] = len(step_rows[s])``.
    * ``micro_batch_tokens[r][s][k]``: the tokens that micro-batch computes: its rows' aligned lengths, plus the
      tail padding up to a multiple of ``row_multiple``.
    * ``padding_rows``: rows of length 0 (Megatron-RL's padding), planned nowhere, trained nowhere.
    * ``schedule``: the planner's record (``stats[s].predicted_makespan`` etc.).
    * ``logprob_order[r]``: the order DP rank ``r`` runs its micro-batches (indices into
      :meth:`rank_micro_batches`) in the one forward-only log-prob call; ``logprob_makespan``: the slowest rank's
      predicted forward-only makespan of that call (``None`` with one pipeline stage).
    """

    micro_batches: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]
    micro_batch_tokens: tuple[tuple[tuple[int, ...], ...], ...]
    step_rows: tuple[tuple[int, ...], ...]
    num_microbatches: tuple[int, ...]
    samples_per_step: tuple[int, ...]
    padding_rows: tuple[int, ...]
    slot_lengths: tuple[int, ...]
    cap: int
    seq_length_multiple: int
    token_multiple: int
    #: a micro-batch's row length is a multiple of this: ``lcm(token_multiple, cp, seq_length_multiple)``
    row_multiple: int
    schedule: DPSchedule
    logprob_order: tuple[tuple[int, ...], ...] = ()
    logprob_makespan: float | None = None

    @property
    def dp_size(self) -> int:
        return len(self.micro_batches)

    @property
    def num_steps(self) -> int:
        return len(self.num_microbatches)

    def rank_micro_batches(self, rank: int) -> list[tuple[int, ...]]:
        """Rank ``rank``'s micro-batches, all steps concatenated in step order."""
        return [mb for step in self.micro_batches[rank] for mb in step]

    def rank_micro_batch_tokens(self, rank: int) -> list[int]:
        return [t for step in self.micro_batch_tokens[rank] for t in step]

    def step_starts(self) -> list[int]:
        """Position of each step's first micro-batch in a rank's concatenated list (plus the end)."""
        return [int(x) for x in np.cumsum([0, *self.num_microbatches])]

    def computed_tokens(self) -> int:
        """Tokens computed by all ranks over the collection (real tokens, alignment and tail padding)."""
        return sum(t for rank in self.micro_batch_tokens for step in rank for t in step)

    def real_tokens(self, lengths: Sequence[int]) -> int:
        return sum(int(lengths[i]) for step in self.step_rows for i in step)


def plan_collection(
    lengths: Sequence[int] | np.ndarray,
    *,
    parallel: ParallelConfig,
    num_steps: int,
    cap: int,
    cost_model: CostModel | CostProfile | None = None,
    seq_length_multiple: int = 1,
    token_multiple: int = 1,
) -> CollectionPlan:
    """Plan one collection (the module docstring): ``lengths[i]`` is row ``i``'s token count (0 for a padding row),
    ``parallel`` the training layout (its ``dp_size``, ``cp_size``, ``pp_size``, VPP), ``num_steps`` the optimizer
    steps per pass, ``cap`` the most tokens of one micro-batch (before context parallelism splits it)."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
        raise ScheduleError(f"lengths must be a 1-D sequence of token counts, got shape {lengths.shape} "
                            f"dtype {lengths.dtype}")
    lengths = lengths.astype(np.int64)
    if lengths.size and lengths.min() < 0:
        bad = int(np.flatnonzero(lengths < 0)[0])
        raise ScheduleError(f"row {bad} has length {int(lengths[bad])}; token counts are >= 0 (0: a padding row)")
    for name, value in (("seq_length_multiple", seq_length_multiple), ("token_multiple", token_multiple),
                        ("cap", cap)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ScheduleError(f"{name} = {value!r} must be a positive integer")
    cp = parallel.cp_size
    unit = _lcm(_lcm(int(token_multiple), cp), int(seq_length_multiple))
    planner_cap = (int(cap) // unit) * unit
    if planner_cap < unit:
        raise ScheduleError(f"the token cap {cap} is below one aligned unit of {unit} tokens (the multiple of "
                            f"context parallelism {cp}, 2*cp per sequence and the tensor-parallel row multiple); "
                            f"raise --max-tokens-per-gpu or --seq-length")
    real = np.flatnonzero(lengths > 0)
    padding = np.flatnonzero(lengths == 0)
    if real.size == 0:
        raise ScheduleError(f"the collection has {lengths.size} rows and none holds a token (all are padding "
                            f"rows); nothing to train: check the rollout source")
    slots = np.where(lengths > 0, -(-lengths // seq_length_multiple) * seq_length_multiple, 0)
    steps = split_rows_into_steps(real.size, num_steps)
    step_of = np.empty(real.size, dtype=np.int64)
    for s, rows in enumerate(steps):
        step_of[rows.start:rows.stop] = s
    align = parallel.align
    short = [s for s, rows in enumerate(steps) if len(rows) < align]
    if short:
        s = short[0]
        raise ScheduleError(
            f"optimizer step {s} of the collection has {len(steps[s])} samples but every one of the dp_size*mb_group "
            f"= {align} micro-batch slots needs a sample (slime-ext computes no empty micro-batch); raise "
            f"--global-batch-size to at least {align} samples per step (it is {num_steps} steps of the "
            f"{real.size} samples collected), or lower the data-parallel size"
        )
    # the steps are given (step_of), so global_batch_size is not used to cut them: the largest step's rows
    batch = BatchConfig(global_batch_size=len(steps[0]), use_dynamic_batch_size=True,
                        max_tokens_per_gpu=planner_cap // cp, balance_data=True)
    schedule = plan(PlanRequest(lengths=slots[real], parallel=parallel, batch=batch, step_of=step_of,
                                cost_model=cost_model))
    dp = parallel.dp_size
    starts = np.cumsum([0, *schedule.num_microbatches])
    micro_batches, tokens = [], []
    for r in range(dp):
        partition = schedule.partitions[r]
        mbs = [tuple(int(real[partition[i]]) for i in local) for local in schedule.micro_batch_indices[r]]
        micro_batches.append(tuple(tuple(mbs[starts[s]:starts[s + 1]]) for s in range(num_steps)))
        tokens.append(tuple(tuple(round_up(int(slots[list(mb)].sum()), unit)
                                  for mb in mbs[starts[s]:starts[s + 1]]) for s in range(num_steps)))
    order, makespan = logprob_order([[mb for step in rank for mb in step] for rank in micro_batches], slots, parallel,
                                    cost_model, planner_cap)
    collection = CollectionPlan(
        micro_batches=tuple(micro_batches), micro_batch_tokens=tuple(tokens),
        step_rows=tuple(tuple(int(real[i]) for i in rows) for rows in steps),
        num_microbatches=tuple(int(n) for n in schedule.num_microbatches),
        samples_per_step=tuple(len(rows) for rows in steps), padding_rows=tuple(int(i) for i in padding),
        slot_lengths=tuple(int(x) for x in slots), cap=planner_cap, seq_length_multiple=int(seq_length_multiple),
        token_multiple=int(token_multiple), row_multiple=unit, schedule=schedule, logprob_order=order,
        logprob_makespan=makespan)
    check_collection_plan(collection, lengths, align=align)
    return collection


def logprob_order(rank_micro_batches: Sequence[Sequence[Sequence[int]]], slots: Sequence[int] | np.ndarray,
                  parallel: ParallelConfig, cost_model: CostModel | CostProfile | None,
                  cap: int) -> tuple[tuple[tuple[int, ...], ...], float | None]:
    """``(order per rank, slowest predicted makespan)`` of the one forward-only log-prob call: each rank's
    micro-batches (``rank_micro_batches[r]``: rows, every step's in plan order; ``slots``: each row's aligned
    length) priced as the planner prices them and ordered by :func:`slime_ext.schedule.best_orders` under the
    **forward-only** pipeline pricing (:func:`slime_ext.schedule.pipeline_pricing` with ``forward_only=True``).
    With one pipeline stage no order is faster than another: the plan order, makespan ``None``."""
    pricing = pipeline_pricing(parallel, cost_model, cap, forward_only=True)
    if pricing is None:
        return tuple(tuple(range(len(mbs))) for mbs in rank_micro_batches), None
    costs = np.stack([microbatch_costs(slots, mbs, cost_model) for mbs in rank_micro_batches])
    order, spans = best_orders(pricing, costs)
    return tuple(tuple(int(k) for k in row) for row in order), float(np.max(spans))


def check_collection_plan(plan: CollectionPlan, lengths: Sequence[int], *, align: int) -> None:
    """The plan's invariants; ``ScheduleError`` naming the first one broken. Run on every plan
    (:func:`plan_collection`) and by the tests:

    * every row with tokens is in exactly one step, the steps are contiguous runs of such rows in order, and
      ``samples_per_step`` counts them; padding rows (length 0) are in none;
    * per step, every DP rank has ``num_microbatches[s]`` micro-batches (a positive multiple of ``align / dp``),
      none empty, and the step's micro-batches over all ranks hold exactly the step's rows;
    * a micro-batch of more than one row computes at most ``cap`` tokens; every micro-batch computes its rows'
      aligned lengths rounded up to ``row_multiple`` (the tail padding), nothing more;
    * the log-prob call runs every micro-batch of a rank exactly once (``logprob_order[r]`` is a permutation).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    real = [int(i) for i in np.flatnonzero(lengths > 0)]
    flat = [i for step in plan.step_rows for i in step]
    if flat != real:
        raise ScheduleError("plan: the steps do not hold every row with tokens exactly once, in order")
    if sorted(plan.padding_rows) != [int(i) for i in np.flatnonzero(lengths == 0)]:
        raise ScheduleError("plan: the padding rows are not exactly the rows of length 0")
    if list(plan.samples_per_step) != [len(step) for step in plan.step_rows]:
        raise ScheduleError("plan: samples_per_step does not count the steps' rows")
    dp = plan.dp_size
    per_rank = max(1, align // dp)
    for s, step in enumerate(plan.step_rows):
        count = plan.num_microbatches[s]
        if count < 1 or count % per_rank:
            raise ScheduleError(f"plan: step {s} has {count} micro-batches per rank, not a positive multiple of "
                                f"{per_rank}")
        held = []
        for r in range(dp):
            mbs = plan.micro_batches[r][s]
            if len(mbs) != count or any(len(mb) == 0 for mb in mbs):
                raise ScheduleError(f"plan: DP rank {r} has {len(mbs)} micro-batches in step {s} (want {count}, "
                                    f"none empty)")
            for mb, tokens in zip(mbs, plan.micro_batch_tokens[r][s]):
                slots = sum(round_up(int(lengths[i]), plan.seq_length_multiple) for i in mb)
                if tokens != round_up(slots, plan.row_multiple):
                    raise ScheduleError(f"plan: a micro-batch of step {s} computes {tokens} tokens for {slots} "
                                        f"tokens of slots (row multiple {plan.row_multiple})")
                if len(mb) > 1 and tokens > plan.cap:
                    raise ScheduleError(f"plan: a micro-batch of step {s} on DP rank {r} holds {len(mb)} rows and "
                                        f"{tokens} tokens, above the cap {plan.cap}")
            held += [i for mb in mbs for i in mb]
        if sorted(held) != sorted(step):
            raise ScheduleError(f"plan: step {s}'s micro-batches do not hold exactly the step's rows")
    for r in range(dp):
        total = sum(plan.num_microbatches)
        if len(plan.logprob_order) != dp or sorted(plan.logprob_order[r]) != list(range(total)):
            raise ScheduleError(f"plan: the log-prob order of DP rank {r} does not run each of its {total} "
                                f"micro-batches exactly once")
