"""``dp_schedule: legacy``: micro-batches planned on each training rank, as upstream slime's training side does.

The algorithms are :mod:`slime_ext.baselines` (the same code the benchmark and ``plan --compare`` measure); this
module adds only what a running job needs: Megatron's parallel sizes and the real ``all_reduce(MAX)`` of the
per-rank counts. Per rollout, each rank cuts its samples into steps of ``global_batch_size / dp_size`` samples
(upstream's meaning: samples, not rollouts) and then

* static batches: ``micro_batch_size`` contiguous samples per micro-batch;
* dynamic batches: first-fit count per step, MAX over the DP group, upstream's VPP rounding (down), then
  Karmarkar-Karp of the step's samples into that many micro-batches -- **no cap**: a micro-batch may exceed
  ``max_tokens_per_gpu``, as upstream.

The LR scheduler advances by ``args.global_batch_size`` per step, as upstream. Deviations, each loud instead of
silent: samples that do not fill a step are an error (upstream drops them); a step whose rounded count is not a
whole micro-batch group (upstream clamps to 1 below one group) is refused, since Megatron's interleaved schedule
cannot run it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from slime_ext.baselines import legacy_micro_batches, legacy_step_counts, round_for_vpp
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
        n = len(payload.samples)
        gbs = payload.global_batch_size
        if gbs % dp_size:
            raise LegacyScheduleError(f"global_batch_size={gbs} (samples per step on the legacy path) must be a "
                                      f"multiple of dp_size={dp_size}")
        local = gbs // dp_size
        num_steps, tail = divmod(n, local)
        if num_steps == 0 or tail:
            raise LegacyScheduleError(
                f"this rank has {n} samples, not a positive multiple of global_batch_size/dp_size = {local}; the "
                f"legacy path would drop {tail if num_steps else n} samples. Send a multiple of {local} samples per "
                f"rank (or use --dp-schedule rollout)")
        if not args.use_dynamic_batch_size:
            mbs = args.micro_batch_size
            if local % mbs:
                raise LegacyScheduleError(f"global_batch_size/dp_size = {local} is not a multiple of "
                                          f"micro_batch_size={mbs}")
            micro_batch_indices = [list(range(i, i + mbs)) for i in range(0, n, mbs)]
            num_microbatches = [local // mbs] * num_steps
        else:
            lengths = payload.samples.total_lengths
            counts = _all_reduce_max(legacy_step_counts(lengths, local, args.max_tokens_per_gpu * cp_size), dp_group)
            num_microbatches = round_for_vpp(counts, vpp_size, mb_group)
            for s, c in enumerate(num_microbatches):
                if c % mb_group:
                    raise LegacyScheduleError(
                        f"step {s}: {counts[s]} micro-batches, below one microbatch_group_size_per_vp_stage="
                        f"{mb_group}; upstream rounds that to {c}, which Megatron's interleaved schedule cannot "
                        f"run. Raise --global-batch-size, lower --max-tokens-per-gpu, or use --dp-schedule rollout")
            micro_batch_indices = legacy_micro_batches(lengths, local, num_microbatches)
        return [DataIterator(payload, micro_batch_indices) for _ in range(vpp_size)], num_microbatches

    def lr_increment(self, args: Any, payload: RankPayload, step_id: int) -> int:
        """upstream: ``opt_param_scheduler.step(increment=args.global_batch_size)``, whatever the step held."""
        return args.global_batch_size
