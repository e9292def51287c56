"""Where the schedule is consumed: ``rollout_data`` -> one :class:`DataIterator` per virtual pipeline stage.

``rollout_data`` is what the rollout side sends one DP rank (plain Python lists, samples in that rank's partition
order):

* per sample: ``tokens`` (list[int]), ``total_lengths``, ``response_lengths``, ``loss_masks`` (one 0/1 per
  response token, over the last ``response_length`` tokens), ``rewards``, ``advantages``, ``sample_indices``
  (global sample ids);
* the rank's slice of the :class:`slime_ext.schedule.DPSchedule` (``DPSchedule.rank_payload(r)``): ``dp_rank``,
  ``dp_size``, ``partition``, ``micro_batch_indices`` (local indices, tiling ``range(num_samples)`` in order),
  ``num_microbatches`` (per step, the same on every rank), ``samples_per_step``, ``rollouts_per_step``,
  ``loss_tokens_per_step``.

The training side does not re-plan: step ``s`` runs the next ``num_microbatches[s]`` entries of
``micro_batch_indices``.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Mapping, Sequence

#: per-sample fields (lists with one entry per local sample)
SAMPLE_KEYS = ("tokens", "total_lengths", "response_lengths", "loss_masks", "rewards", "advantages",
               "sample_indices")
#: the schedule slice the rollout-side path needs
SCHEDULE_KEYS = ("micro_batch_indices", "num_microbatches", "samples_per_step")


class RolloutDataError(ValueError):
    """``rollout_data`` does not match the schedule or the model; the message names the field and the fix."""


class DataIterator:
    """Micro-batches of ``rollout_data``: ``micro_batch_indices[k]`` are the local sample indices of micro-batch k.

    ``get_next(keys)`` returns ``{key: [values of the micro-batch's samples]}`` (``None`` for a key that
    ``rollout_data`` does not have) and advances; ``reset()`` rewinds. One iterator per VPP stage walks the same
    micro-batches (every model chunk sees every micro-batch).
    """

    def __init__(self, rollout_data: Mapping[str, Any], micro_batch_indices: Sequence[Sequence[int]]):
        if isinstance(micro_batch_indices, int) or micro_batch_indices is None:
            raise TypeError(
                f"DataIterator takes micro_batch_indices (a list of local index lists), got {micro_batch_indices!r}; "
                f"slime-ext's schedule replaces micro_batch_size-based iteration -- build the iterators with "
                f"get_data_iterator(rollout_data)"
            )
        self.rollout_data = rollout_data
        self.micro_batch_indices = [list(mb) for mb in micro_batch_indices]
        self.offset = 0

    def __len__(self) -> int:
        return len(self.micro_batch_indices)

    def get_next(self, keys: Sequence[str]) -> dict[str, list | None]:
        if self.offset >= len(self.micro_batch_indices):
            raise RolloutDataError(
                f"DataIterator exhausted: all {len(self.micro_batch_indices)} micro-batches were consumed and one "
                f"more was asked for; sum(num_microbatches) must equal len(micro_batch_indices)"
            )
        indices = self.micro_batch_indices[self.offset]
        batch: dict[str, list | None] = {}
        for key in keys:
            values = self.rollout_data.get(key)
            batch[key] = None if values is None else [values[i] for i in indices]
        self.offset += 1
        return batch

    def peek(self, num_microbatches: int) -> list[list[int]]:
        """Local indices of the next ``num_microbatches`` micro-batches, without advancing."""
        return self.micro_batch_indices[self.offset:self.offset + num_microbatches]

    def reset(self) -> "DataIterator":
        self.offset = 0
        return self


def _vpp_size() -> int:
    try:
        from megatron.core import parallel_state
    except ImportError:  # pragma: no cover - megatron is a dependency of the training extra
        return 1
    return parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1


def get_data_iterator(rollout_data: Mapping[str, Any], *, vpp_size: int | None = None) -> list[DataIterator]:
    """One :class:`DataIterator` per VPP stage over the schedule carried in ``rollout_data`` (validated first).

    ``vpp_size`` defaults to Megatron's ``virtual_pipeline_model_parallel_size`` (1 when unset).
    """
    validate_rollout_data(rollout_data)
    vpp = _vpp_size() if vpp_size is None else vpp_size
    if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1:
        raise RolloutDataError(f"vpp_size={vpp!r} must be a positive integer")
    return [DataIterator(rollout_data, rollout_data["micro_batch_indices"]) for _ in range(vpp)]


def step_bounds(num_microbatches: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first, end)]`` micro-batch positions of each step."""
    ends = list(accumulate(num_microbatches))
    return [(e - n, e) for e, n in zip(ends, num_microbatches)]


def sample_ids(rollout_data: Mapping[str, Any]) -> list[int]:
    """Global sample id of each local sample: ``sample_indices``, else ``partition``, else the local index."""
    for key in ("sample_indices", "partition"):
        ids = rollout_data.get(key)
        if ids is not None:
            return [int(i) for i in ids]
    return list(range(num_local_samples(rollout_data)))


def num_local_samples(rollout_data: Mapping[str, Any]) -> int:
    for key in ("total_lengths", "tokens"):
        if rollout_data.get(key) is not None:
            return len(rollout_data[key])
    raise RolloutDataError("rollout_data has neither 'tokens' nor 'total_lengths'; send the per-sample fields")


def validate_samples(rollout_data: Mapping[str, Any]) -> int:
    """Check the per-sample fields against each other; returns the number of local samples."""
    if not isinstance(rollout_data, Mapping):
        raise RolloutDataError(f"rollout_data must be a dict, got {type(rollout_data).__name__}")
    for key in ("tokens", "total_lengths", "response_lengths", "loss_masks", "advantages"):
        if rollout_data.get(key) is None:
            raise RolloutDataError(f"rollout_data is missing {key!r}; the rollout side must send {SAMPLE_KEYS}")
    n = len(rollout_data["tokens"])
    for key in SAMPLE_KEYS:
        values = rollout_data.get(key)
        if values is not None and len(values) != n:
            raise RolloutDataError(f"rollout_data[{key!r}] has {len(values)} entries but 'tokens' has {n}; "
                                   f"give one per local sample")
    tokens, totals = rollout_data["tokens"], rollout_data["total_lengths"]
    responses, masks = rollout_data["response_lengths"], rollout_data["loss_masks"]
    for i in range(n):
        if len(tokens[i]) != totals[i]:
            raise RolloutDataError(f"sample {i}: len(tokens)={len(tokens[i])} but total_lengths={totals[i]}")
        if not 0 < responses[i] < totals[i]:
            raise RolloutDataError(f"sample {i}: response_lengths={responses[i]} must be in [1, total_length-1="
                                   f"{totals[i] - 1}] (at least one prompt token predicts the first response token)")
        if len(masks[i]) != responses[i]:
            raise RolloutDataError(f"sample {i}: len(loss_masks)={len(masks[i])} but response_lengths="
                                   f"{responses[i]}; one mask entry per response token")
    return n


def validate_rollout_data(rollout_data: Mapping[str, Any]) -> None:
    """Check the per-sample fields and the schedule slice before any process group is used."""
    n = validate_samples(rollout_data)
    missing = [k for k in SCHEDULE_KEYS if rollout_data.get(k) is None]
    if missing:
        raise RolloutDataError(
            f"rollout_data is missing the schedule fields {missing}; the rollout-side path (dp_schedule=rollout) "
            f"needs DPSchedule.rank_payload(dp_rank) merged into each rank's rollout_data (or use "
            f"dp_schedule=legacy)"
        )
    nmb = list(rollout_data["num_microbatches"])
    mbi = rollout_data["micro_batch_indices"]
    if not nmb or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in nmb):
        raise RolloutDataError(f"num_microbatches={nmb!r} must be a non-empty list of positive integers")
    if sum(nmb) != len(mbi):
        raise RolloutDataError(f"sum(num_microbatches)={sum(nmb)} but micro_batch_indices has {len(mbi)} "
                               f"micro-batches; send the schedule slice of this rank unchanged")
    flat = [i for mb in mbi for i in mb]
    if any(len(mb) == 0 for mb in mbi) or flat != list(range(n)):
        raise RolloutDataError(f"micro_batch_indices must tile range({n}) in order with no empty micro-batch "
                               f"(samples in partition order); got {len(flat)} indices over {len(mbi)} micro-batches")
    for key in ("samples_per_step", "rollouts_per_step", "loss_tokens_per_step"):
        values = rollout_data.get(key)
        if values is not None and len(values) != len(nmb):
            raise RolloutDataError(f"{key} has {len(values)} entries but num_microbatches has {len(nmb)} steps")
