"""Where the schedule is consumed: a :class:`RankPayload` -> one :class:`DataIterator` per virtual pipeline stage.

Who plans the micro-batches is a value, ``config.dp_schedule``, looked up in ``DATA_PATHS``
(:mod:`slime_ext.training.train_step`): :class:`RolloutPath` runs the schedule slice the rollout side sent, unchanged;
:class:`slime_ext.training.legacy_backend.LegacyPath` plans on the training side, as upstream slime does. Both
answer the same two questions: the iterators and micro-batch counts of a payload, and the LR increment of a step.
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


class RolloutPath:
    """``dp_schedule: rollout``: the rollout side planned; nothing is planned or all-reduced here."""

    name = "rollout"

    def get_data_iterator(self, args: Any, model: Any, payload: RankPayload, *, vpp: int | None = None
                          ) -> tuple[list[DataIterator], list[int]]:
        payload = check_payload(payload, planned=True)
        stages = vpp_size() if vpp is None else vpp
        return ([DataIterator(payload, payload.micro_batch_indices) for _ in range(stages)],
                list(payload.num_microbatches))

    def lr_increment(self, args: Any, payload: RankPayload, step_id: int) -> int:
        """The samples step ``step_id`` really trains on (varies with multi-sample rollouts and dynamic sizes)."""
        return payload.samples_per_step[step_id]
