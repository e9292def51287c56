"""The baseline: a slime-shaped training backend that plans micro-batches on the training side, as upstream does.

This module mirrors upstream slime's ``slime/backends/megatron_utils/data.py`` data path and stands in for it as
the **host** that :mod:`slime_ext.patches.host_slime` patches. The train loop (:mod:`slime_ext.training.train_step`) calls
its functions through the module (``legacy_backend.get_data_iterator(...)``), so the host patch can swap them:

* :class:`DataIterator` -- fixed ``micro_batch_size`` slices, or explicit ``micro_batch_indices``;
* :func:`get_minimum_num_micro_batch_size` -- first-fit bin count under ``max_tokens_per_gpu * cp_size``;
* :func:`get_data_iterator` -- per rank and step: first-fit count, ``all_reduce(MAX)`` over the DP group, VPP
  rounding, then Karmarkar-Karp of the step's samples into that many micro-batches (balanced by tokens, **no
  cap**: a micro-batch may exceed ``max_tokens_per_gpu``, as upstream);
* :func:`step_lr_scheduler` -- ``opt_param_scheduler.step(increment=args.global_batch_size)`` after every step.
  Upstream inlines this call in ``train_one_step``; this host keeps it in a function so it is a patchable seam.

Upstream semantics kept: ``global_batch_size`` counts **samples** per step (``rollout_data["dynamic_global_batch_size"]``
overrides it when present); each rank runs ``num_local_samples // (global_batch_size / dp_size)`` steps.
Deviations, each loud instead of silent: samples that do not fill a step are an error (upstream drops them); the
VPP rounding goes **up** to a multiple of ``microbatch_group_size_per_vp_stage`` (upstream rounds down, clamped at
1, which can leave fewer micro-batches than Megatron's interleaved schedule accepts and pushes more tokens into
each); a step with fewer samples than micro-batches is an error (upstream asserts).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from slime_ext.schedule import first_fit_pack, karmarkar_karp

#: marker the host patch checks (``slime_ext.patches.host_slime`` supports ``>=1.0,<2``)
HOST_API_VERSION = "1.0"


class LegacyScheduleError(ValueError):
    """The legacy path cannot plan this rollout; the message names the field and the fix."""


class DataIterator:
    """upstream ``DataIterator``: ``micro_batch_size`` contiguous samples per call, or ``micro_batch_indices``."""

    def __init__(self, rollout_data: Mapping[str, Any], micro_batch_size: int | None = None,
                 micro_batch_indices: Sequence[Sequence[int]] | None = None):
        if (micro_batch_size is None) == (micro_batch_indices is None):
            raise LegacyScheduleError("DataIterator takes exactly one of micro_batch_size and micro_batch_indices")
        self.rollout_data = rollout_data
        self.micro_batch_size = micro_batch_size
        self.micro_batch_indices = None if micro_batch_indices is None else [list(mb) for mb in micro_batch_indices]
        self.offset = 0

    def get_next(self, keys: Sequence[str]) -> dict[str, list | None]:
        batch: dict[str, list | None] = {}
        for key in keys:
            vals = self.rollout_data.get(key)
            if vals is None:
                batch[key] = None
            elif self.micro_batch_indices is not None:
                batch[key] = [vals[i] for i in self.micro_batch_indices[self.offset]]
            else:
                if self.offset + self.micro_batch_size > len(vals):
                    raise LegacyScheduleError(f"DataIterator: offset {self.offset} + micro_batch_size "
                                              f"{self.micro_batch_size} > {len(vals)} samples of {key!r}")
                batch[key] = vals[self.offset:self.offset + self.micro_batch_size]
        self.offset += 1 if self.micro_batch_indices is not None else self.micro_batch_size
        return batch

    def peek(self, num_microbatches: int) -> list[list[int]]:
        """Local indices of the next ``num_microbatches`` micro-batches, without advancing (not upstream)."""
        if self.micro_batch_indices is not None:
            return self.micro_batch_indices[self.offset:self.offset + num_microbatches]
        mbs = self.micro_batch_size
        return [list(range(self.offset + k * mbs, self.offset + (k + 1) * mbs)) for k in range(num_microbatches)]

    def reset(self) -> "DataIterator":
        self.offset = 0
        return self


def get_minimum_num_micro_batch_size(total_lengths: Sequence[int], max_tokens_per_gpu: int) -> int:
    """Number of bins arrival-order first fit needs under ``max_tokens_per_gpu`` tokens (upstream's count)."""
    return len(first_fit_pack(list(total_lengths), int(max_tokens_per_gpu)))


def _parallel_sizes(model: Any) -> tuple[int, Any, int, int, int]:
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_model_config

    dp_size = mpu.get_data_parallel_world_size(with_context_parallel=False)
    vpp_size = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    group = get_model_config(model[0]).microbatch_group_size_per_vp_stage if vpp_size > 1 else 1
    return dp_size, mpu.get_data_parallel_group(), vpp_size, group, mpu.get_context_parallel_world_size()


def get_data_iterator(args: Any, model: Sequence[torch.nn.Module], rollout_data: Mapping[str, Any]
                      ) -> tuple[list[DataIterator], list[int]]:
    """``(one DataIterator per VPP stage, num_microbatches per step)``, planned on the training side."""
    dp_size, dp_group, vpp_size, mb_group, cp_size = _parallel_sizes(model)
    num_local_samples = len(rollout_data["total_lengths"])
    global_batch_size = rollout_data.get("dynamic_global_batch_size") or args.global_batch_size
    if not global_batch_size or global_batch_size % dp_size:
        raise LegacyScheduleError(f"global_batch_size={global_batch_size!r} (samples per step on the legacy path) "
                                  f"must be a positive multiple of dp_size={dp_size}")
    num_local_gbs = global_batch_size // dp_size
    num_steps, tail = divmod(num_local_samples, num_local_gbs)
    if num_steps == 0 or tail:
        raise LegacyScheduleError(
            f"this rank has {num_local_samples} samples, not a positive multiple of global_batch_size/dp_size = "
            f"{num_local_gbs}; the legacy path would drop {tail if num_steps else num_local_samples} samples. "
            f"Send a multiple of {num_local_gbs} samples per rank (or use --dp-schedule rollout)"
        )

    if not args.use_dynamic_batch_size:
        if num_local_gbs % args.micro_batch_size:
            raise LegacyScheduleError(f"global_batch_size/dp_size = {num_local_gbs} is not a multiple of "
                                      f"micro_batch_size={args.micro_batch_size}")
        num_microbatches = [num_local_gbs // args.micro_batch_size] * num_steps
        return [DataIterator(rollout_data, args.micro_batch_size) for _ in range(vpp_size)], num_microbatches

    # per-rank first-fit counts, then the max over DP ranks: every rank runs the same number of micro-batches
    lengths = list(rollout_data["total_lengths"])
    cap = args.max_tokens_per_gpu * cp_size
    counts = [get_minimum_num_micro_batch_size(lengths[s * num_local_gbs:(s + 1) * num_local_gbs], cap)
              for s in range(num_steps)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    counts_t = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(counts_t, op=dist.ReduceOp.MAX, group=dp_group)
    num_microbatches = [int(c) for c in counts_t.tolist()]
    if vpp_size > 1:  # Megatron's interleaved schedule wants multiples of the micro-batch group
        num_microbatches = [-(-c // mb_group) * mb_group for c in num_microbatches]

    # Karmarkar-Karp on tokens into exactly that many micro-batches per step (no cap)
    micro_batch_indices: list[list[int]] = []
    for s, num_mbs in enumerate(num_microbatches):
        start = s * num_local_gbs
        step_lengths = lengths[start:start + num_local_gbs]
        if num_mbs > len(step_lengths):
            raise LegacyScheduleError(
                f"step {s}: {num_mbs} micro-batches (the DP max{', rounded up for VPP' if vpp_size > 1 else ''}) "
                f"but this rank has only {len(step_lengths)} samples in the step; raise --global-batch-size or "
                f"--max-tokens-per-gpu"
            )
        parts = karmarkar_karp(step_lengths, num_mbs, equal_size=False)
        if any(len(p) == 0 for p in parts):
            raise LegacyScheduleError(f"step {s}: Karmarkar-Karp left an empty micro-batch")
        micro_batch_indices.extend(sorted(start + i for i in p) for p in parts)
    return [DataIterator(rollout_data, micro_batch_indices=micro_batch_indices) for _ in range(vpp_size)], \
        num_microbatches


def step_lr_scheduler(args: Any, opt_param_scheduler, rollout_data: Mapping[str, Any], step_id: int) -> int:
    """upstream: ``opt_param_scheduler.step(increment=args.global_batch_size)``; returns the increment."""
    opt_param_scheduler.step(increment=args.global_batch_size)
    return args.global_batch_size
