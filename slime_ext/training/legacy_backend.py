"""``dp_schedule: legacy``: micro-batches planned on each training rank, as upstream slime's training side does.

The planning is :func:`slime_ext.baselines.legacy_rank_plan` (the one legacy implementation: the benchmark,
``plan --compare`` and the run-config pre-check use the same code); this module adds only what a running job needs:
Megatron's parallel sizes and the real ``all_reduce(MAX)`` of the per-rank counts. ``global_batch_size`` counts
samples, as upstream, and the LR scheduler advances by it per step. Where upstream would drop samples or hand
Megatron's interleaved schedule a count that is not a whole micro-batch group, the step is refused instead.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from slime_ext.baselines import LegacyPlanError, legacy_rank_plan
from slime_ext.schedule import RankPayload

from .data import DataIterator, RolloutDataError, check_payload


class LegacyScheduleError(RolloutDataError):
    """The legacy path cannot plan this rollout; the message names the field and the fix."""


def _parallel_sizes(model: Any) -> tuple[int, Any, int, int, int]:
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_model_config

    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=False)
    vpp_size = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    group = get_model_config(model[0]).microbatch_group_size_per_vp_stage if vpp_size > 1 else 1
    return dp_size, mpu.get_data_parallel_group(), vpp_size, group, mpu.get_context_parallel_world_size()


def _all_reduce_max(counts: list[int], group: Any) -> list[int]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(c) for c in t.tolist()]


class LegacyPath:
    """Training-side planning per rank (module docstring)."""

    name = "legacy"

    def get_data_iterator(self, args: Any, model: Sequence[torch.nn.Module], payload: RankPayload
                          ) -> tuple[list[DataIterator], list[int]]:
        """``(one DataIterator per VPP stage, num_microbatches per step)``, planned here."""
        payload = check_payload(payload, planned=False)
        dp_size, dp_group, vpp_size, mb_group, cp_size = _parallel_sizes(model)
        cap = args.max_tokens_per_gpu * cp_size if args.use_dynamic_batch_size else None
        try:
            micro_batch_indices, num_microbatches = legacy_rank_plan(
                payload.samples.total_lengths, global_batch_size=payload.global_batch_size, dp_size=dp_size,
                use_dynamic_batch_size=args.use_dynamic_batch_size, micro_batch_size=args.micro_batch_size, cap=cap,
                vpp_size=vpp_size, group=mb_group, reduce_max=lambda counts: _all_reduce_max(counts, dp_group))
        except LegacyPlanError as exc:
            raise LegacyScheduleError(str(exc)) from None
        return [DataIterator(payload, micro_batch_indices) for _ in range(vpp_size)], num_microbatches

    def lr_increment(self, args: Any, payload: RankPayload, step_id: int) -> int:
        """upstream: ``opt_param_scheduler.step(increment=args.global_batch_size)``, whatever the step held. The
        payload carries that figure: ``--global-batch-size``, or with ``use_dynamic_global_batch_size`` the step
        size the rollout side chose (``args.global_batch_size`` is then unset)."""
        return payload.global_batch_size
