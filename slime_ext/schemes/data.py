"""Where the schedule is consumed: a :class:`RankPayload` -> one :class:`DataIterator` per virtual pipeline stage.

Who plans the micro-batches is a value, ``config.dp_schedule``: its scheme builds the iterators with
:meth:`~slime_ext.schemes.Scheme.iterators` from what is here -- the iterator, the payload check, and the few
Megatron facts and collectives a training-side scheme needs (:func:`vpp_size`, :func:`parallel_sizes`,
:func:`all_reduce_max`). The schemes and the training adapter (:mod:`slime_ext.training`) both use it, so it lives
here, below the training layer; importing it imports no torch or Megatron (those functions import them when
called).
"""

from __future__ import annotations

from typing import Any, Sequence

from slime_ext.schedule import RankPayload


class RolloutDataError(ValueError):
    """A payload does not match the schedule, the model or its peers; the message names the field and the fix."""


class DataIterator:
    """Micro-batches of a payload: ``micro_batch_indices[k]`` are the local sample indices of micro-batch k.

    ``get_next(keys)`` returns ``{key: [values of the micro-batch's samples]}`` and advances: a key is a
    :class:`slime_ext.schedule.SampleBatch` field, ``sample_indices`` (global ids) or ``local_index`` (positions in
    the payload). One iterator per VPP stage walks the same micro-batches (every model chunk sees every one).
    """

    def __init__(self, payload: RankPayload, micro_batch_indices: Sequence[Sequence[int]]):
        self.payload = payload
        self.micro_batch_indices = [list(mb) for mb in micro_batch_indices]
        self.offset = 0

    def __len__(self) -> int:
        return len(self.micro_batch_indices)

    def get_next(self, keys: Sequence[str]) -> dict[str, list]:
        if self.offset >= len(self.micro_batch_indices):
            raise RolloutDataError(
                f"DataIterator exhausted: all {len(self.micro_batch_indices)} micro-batches were consumed and one "
                f"more was asked for; sum(num_microbatches) must equal len(micro_batch_indices)"
            )
        indices = self.micro_batch_indices[self.offset]
        self.offset += 1
        return {key: list(indices) if key == "local_index" else [self.payload.column(key)[i] for i in indices]
                for key in keys}

    def peek(self, num_microbatches: int) -> list[list[int]]:
        """Local indices of the next ``num_microbatches`` micro-batches, without advancing."""
        return self.micro_batch_indices[self.offset:self.offset + num_microbatches]

    def reset(self) -> "DataIterator":
        self.offset = 0
        return self


def vpp_size() -> int:
    """Megatron's ``virtual_pipeline_model_parallel_size`` (1 when unset)."""
    from megatron.core import parallel_state

    return parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1


def check_payload(payload: Any, planned: bool) -> RankPayload:
    """``payload`` is a :class:`RankPayload` of the path the trainer runs (with or without a schedule slice)."""
    if not isinstance(payload, RankPayload):
        raise RolloutDataError(f"the trainer takes a slime_ext.schedule.RankPayload, got {type(payload).__name__}; "
                               f"build it with DPSchedule.rank_payload or slime_ext.rollout.dispatch.plan_rollout")
    if payload.planned != planned:
        sent, runs = ("rollout", "legacy") if payload.planned else ("legacy", "rollout")
        raise RolloutDataError(f"the payload was planned for dp_schedule={sent} but this trainer runs "
                               f"dp_schedule={runs}; give the rollout side and the trainer the same --dp-schedule")
    return payload


def parallel_sizes(model: Any) -> tuple[int, Any, int, int, int]:
    """``(dp_size, dp_group, vpp_size, microbatch_group_size_per_vp_stage, cp_size)`` of this rank, from Megatron
    (the group is 1 without VPP)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_model_config

    vpp = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    group = get_model_config(model[0]).microbatch_group_size_per_vp_stage if vpp > 1 else 1
    return (mpu.get_data_parallel_world_size(with_context_parallel=False), mpu.get_data_parallel_group(), vpp, group,
            mpu.get_context_parallel_world_size())


def all_reduce_max(counts: list[int], group: Any) -> list[int]:
    """The element-wise MAX of ``counts`` over the ranks of ``group``."""
    import torch
    import torch.distributed as dist

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(c) for c in t.tolist()]
