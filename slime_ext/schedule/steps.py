"""Input checks and stage 1: group samples by rollout and cut the rollouts into training steps."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .config import BatchConfig, ParallelConfig
from .errors import ScheduleError

_INT_TYPES = (int, np.integer)


def compute_dynamic_global_batch_size(num_samples: int, dp_size: int) -> int:
    """``num_samples`` rounded down to a multiple of ``dp_size`` (at least ``dp_size``): one step per rollout."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, _INT_TYPES) or num_samples < 0:
        raise ScheduleError(f"num_samples must be a non-negative integer, got {num_samples!r}")
    if isinstance(dp_size, bool) or not isinstance(dp_size, _INT_TYPES) or dp_size < 1:
        raise ScheduleError(f"dp_size must be a positive integer, got {dp_size!r}")
    return max(int(dp_size), (int(num_samples) // int(dp_size)) * int(dp_size))


def as_int_array(name: str, values: Sequence[int] | np.ndarray, n: int | None, minimum: int | None) -> np.ndarray:
    """``values`` as int64, or a :class:`ScheduleError` naming the first bad entry."""
    if values is None or isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ScheduleError(f"{name} must be a sequence of integers, got {type(values).__name__}")
    if n is not None and len(values) != n:
        raise ScheduleError(f"{name} has {len(values)} entries but total_lengths has {n}; give exactly one per sample")
    if len(values) == 0:
        return np.zeros(0, dtype=np.int64)
    if isinstance(values, np.ndarray):
        ok = values.ndim == 1 and values.dtype.kind in "iu"
    else:
        types = set(map(type, values))
        ok = bool not in types and all(issubclass(t, _INT_TYPES) for t in types)
    if not ok:
        arr = np.asarray(values, dtype=object)
        if arr.ndim != 1:
            raise ScheduleError(f"{name} must be one-dimensional, got shape {arr.shape}")
        bad = next(i for i, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, _INT_TYPES))
        raise ScheduleError(f"{name}[{bad}] = {values[bad]!r} is not an integer; {name} must hold integer counts")
    arr = np.asarray(values, dtype=np.int64)
    if minimum is not None:
        low = arr < minimum
        if low.any():
            bad = int(np.argmax(low))
            raise ScheduleError(
                f"{name}[{bad}] = {int(arr[bad])} is below {minimum}; every entry must be >= {minimum}"
            )
    return arr


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
