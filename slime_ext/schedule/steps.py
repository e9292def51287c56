"""Input checks and stage 1: group samples by rollout and cut the rollouts into training steps."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .config import BatchConfig, ParallelConfig
from .errors import ScheduleError
from .validate import INT64_MIN, MAX_PARALLEL_SIZE, MAX_SAMPLES, check_int, check_int_array


def compute_dynamic_global_batch_size(num_samples: int, dp_size: int) -> int:
    """``num_samples`` rounded down to a multiple of ``dp_size`` (at least ``dp_size``): one step per rollout."""
    num_samples = check_int("num_samples", num_samples, minimum=0, maximum=MAX_SAMPLES)
    dp_size = check_int("dp_size", dp_size, maximum=MAX_PARALLEL_SIZE, fix="pass the data-parallel world size")
    return max(dp_size, (num_samples // dp_size) * dp_size)


def as_int_array(name: str, values: Sequence[int] | np.ndarray, n: int | None, minimum: int | None) -> np.ndarray:
    """``values`` as int64, or a :class:`ScheduleError` naming the first bad entry (see :mod:`.validate`)."""
    return check_int_array(name, values, n=n, minimum=INT64_MIN if minimum is None else minimum)


def rollout_ordinals(rollout_ids: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray:
    """Per sample, the rollout's rank in first-occurrence order (0, 1, 2, ...)."""
    if rollout_ids is None:
        return np.arange(n, dtype=np.int64)
    ids = as_int_array("rollout_ids", rollout_ids, n, minimum=None)
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    rank_of_unique = np.empty(len(first), dtype=np.int64)
    rank_of_unique[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank_of_unique[inverse.reshape(-1)]


def split_into_steps(
    ordinals: np.ndarray, parallel: ParallelConfig, batch: BatchConfig
) -> tuple[list[np.ndarray], list[int], np.ndarray]:
    """Stage 1: ``(sample indices of each step in rollout order, rollouts per step, dropped sample indices)``."""
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
    if num_rollouts == len(ordinals) and np.array_equal(ordinals, np.arange(len(ordinals))):
        order = ordinals  # one sample per rollout, already in order
    else:
        order = np.argsort(ordinals, kind="stable")  # grouped by rollout, rollouts in first-occurrence order
    bounds = np.searchsorted(ordinals[order], np.arange(num_steps + 1) * gbs)
    steps = [order[bounds[s]:bounds[s + 1]] for s in range(num_steps)]
    dropped = np.sort(order[bounds[-1]:])
    return steps, [gbs] * num_steps, dropped
