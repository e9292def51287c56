"""Stage 1: group samples by rollout and cut the rollouts into training steps."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .bounds import align_up, bin_lower_bound
from .config import BatchConfig, ParallelConfig
from .errors import ScheduleError
from .validate import MAX_PARALLEL_SIZE, MAX_SAMPLES, check_int, check_int_array


def compute_dynamic_global_batch_size(num_samples: int, dp_size: int) -> int:
    """slime v0.2.4's dynamic global batch size, in samples: ``num_samples`` rounded down to a multiple of
    ``dp_size`` (at least ``dp_size``)."""
    num_samples = check_int("num_samples", num_samples, minimum=0, maximum=MAX_SAMPLES)
    dp_size = check_int("dp_size", dp_size, maximum=MAX_PARALLEL_SIZE, fix="pass the data-parallel world size")
    return max(dp_size, (num_samples // dp_size) * dp_size)


def rollout_ordinals(rollout_ids: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray:
    """Per sample, the rollout's rank in first-occurrence order (0, 1, 2, ...)."""
    if rollout_ids is None:
        return np.arange(n, dtype=np.int64)
    ids = check_int_array("rollout_ids", rollout_ids, n=n)
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    rank_of_unique = np.empty(len(first), dtype=np.int64)
    rank_of_unique[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank_of_unique[inverse.reshape(-1)]


def dynamic_step_rollouts(ordinals: np.ndarray, lengths: np.ndarray, parallel: ParallelConfig,
                          batch: BatchConfig) -> int:
    """With ``use_dynamic_global_batch_size``: how many whole rollouts the one step keeps, the longest prefix whose
    samples fill the aligned micro-batches (v0.2.4's rule: inside :func:`compute_dynamic_global_batch_size`)."""
    n = len(ordinals)
    num_rollouts = int(ordinals.max()) + 1
    align = parallel.align
    slots = f"dp_size*mb_group = {align}" if align != parallel.dp_size else f"dp_size = {align}"
    if n < align:
        raise ScheduleError(
            f"use_dynamic_global_batch_size: the rollout has {n} samples ({num_rollouts} rollouts) but {slots} "
            f"micro-batch slots each need a sample; collect at least {align} samples (--global-batch-size is "
            f"not used with this flag)"
        )
    ends = np.cumsum(np.bincount(ordinals, minlength=num_rollouts))  # samples up to and including each rollout
    fits = ends >= align
    rule, fix = "", "collect more samples"
    if batch.dynamic_global_batch_rounds_samples and not batch.disable_rollout_trim_samples:
        budget = compute_dynamic_global_batch_size(n, parallel.dp_size)
        fits &= ends <= budget
        rule = f" inside slime v0.2.4's {budget} samples (the sample count rounded down to a multiple of dp_size)"
        fix += f", or pass --disable-rollout-trim-samples to train on all {n}"
    if not batch.use_dynamic_batch_size:
        fits &= (-(-ends // batch.micro_batch_size)) % align == 0
        rule += f" that make a multiple of {slots} micro-batches of micro_batch_size={batch.micro_batch_size}"
        fix += ", change --micro-batch-size or use --use-dynamic-batch-size"
    else:  # the longest prefix whose samples can fill the micro-batches its tokens need (usually all: one check)
        cap = batch.cap(parallel.cp_size)
        order = np.argsort(ordinals, kind="stable")
        for k in np.flatnonzero(fits)[::-1]:
            if align_up(bin_lower_bound(lengths[order[:ends[k]]], cap), align) <= ends[k]:
                return int(k) + 1
        fits[:] = False
        rule += f" whose samples fill the {slots}-aligned micro-batches their tokens need under the cap {cap}"
        fix += " or raise --max-tokens-per-gpu"
    if not fits.any():
        raise ScheduleError(
            f"use_dynamic_global_batch_size: no run of whole rollouts from the first{rule}: the {num_rollouts} "
            f"rollouts end at samples {_show_ends(ends)}; {fix}"
        )
    return int(np.flatnonzero(fits)[-1]) + 1


def _show_ends(ends: np.ndarray, most: int = 8) -> str:
    shown = ", ".join(str(int(e)) for e in ends[:most])
    return shown + (f", ... {int(ends[-1])}" if len(ends) > most else "")


def split_into_steps(
    ordinals: np.ndarray, lengths: np.ndarray, parallel: ParallelConfig, batch: BatchConfig
) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    """Stage 1: ``(sample indices of each step in rollout order, rollouts per step, dropped sample indices)``."""
    num_rollouts = int(ordinals.max()) + 1
    if batch.use_dynamic_global_batch_size:
        gbs, num_steps = dynamic_step_rollouts(ordinals, lengths, parallel, batch), 1  # later rollouts are dropped
        if gbs < num_rollouts and batch.disable_rollout_trim_samples:
            kept = int(np.count_nonzero(ordinals < gbs))
            raise ScheduleError(
                f"use_dynamic_global_batch_size: the layout trains only the first {gbs} of {num_rollouts} rollouts "
                f"({kept} of {len(ordinals)} samples) but --disable-rollout-trim-samples forbids dropping the rest; "
                f"drop that flag, or use --use-dynamic-batch-size / a --micro-batch-size the samples fill"
            )
    else:
        gbs = batch.global_batch_size
        num_steps, tail = divmod(num_rollouts, gbs)
        if tail and batch.disable_rollout_trim_samples:
            raise ScheduleError(
                f"the rollout has {num_rollouts} rollouts, not a multiple of global_batch_size={gbs}: the last step "
                f"would hold only {tail}; make the rollout size a multiple of --global-batch-size, or drop "
                f"--disable-rollout-trim-samples to trim the tail"
            )
        if num_steps == 0:
            raise ScheduleError(
                f"the rollout has {num_rollouts} rollouts but global_batch_size={gbs} (rollouts per step): not even "
                f"one step; lower --global-batch-size to at most {num_rollouts} or collect more rollouts"
            )
    steps, dropped = group_steps(ordinals // gbs, ordinals, num_steps)
    return steps, [gbs] * num_steps, dropped


def group_steps(step_of: np.ndarray, ordinals: np.ndarray, num_steps: int) -> tuple[list[np.ndarray], np.ndarray]:
    """``(sample indices of each step by rollout then index, the samples of later steps, sorted)``."""
    order = np.lexsort((np.arange(len(step_of)), ordinals, step_of))  # by step, then rollout, then index
    bounds = np.searchsorted(step_of[order], np.arange(num_steps + 1))
    return [order[bounds[s]:bounds[s + 1]] for s in range(num_steps)], np.sort(order[bounds[-1]:])
