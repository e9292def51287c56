"""``reference`` -- upstream slime's own rollout-side ``build_dp_schedule``, run as it is.

Not a ``dp_schedule`` a job runs here (slime itself runs it): a baseline the benchmark (``python -m bench.run``)
and ``slime-ext plan --compare reference`` measure ours against. Upstream's code is imported at run time
(:mod:`slime_ext.schemes.upstream`: an installed slime, or ``SLIME_GIT``); without it :meth:`schedule` raises
:class:`~slime_ext.schemes.upstream.UpstreamUnavailable`, whose message says how to get it, and callers print that
in the scheme's row instead of a result.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

from slime_ext.schedule import BatchConfig, CostModel, DPSchedule, ParallelConfig

from . import upstream
from .base import Baseline, NotComparable, SameInput, SchemeSchedule


_NEEDS_DIMS = ("with balance_data/balance_by_flops upstream balances by calculate_fwd_flops, which needs the model "
               "dims (--hidden-size --num-layers --num-attention-heads ...)")


def upstream_args(batch: BatchConfig, cost_model: CostModel | None) -> SimpleNamespace:
    """The ``args`` upstream's ``build_dp_schedule`` reads: slime's batch flags and, for its FLOPs estimate, the model
    dims with Megatron's defaults filled in (upstream reads them as set)."""
    dims: dict = {}
    if cost_model is not None:
        cm, heads = cost_model, cost_model.num_attention_heads
        ffn = cm.ffn_hidden_size or 4 * cm.hidden_size
        freq = cm.moe_layer_freq
        dims = dict(hidden_size=cm.hidden_size, num_layers=cm.num_layers, num_attention_heads=heads,
                    num_query_groups=cm.num_query_groups or heads,
                    kv_channels=cm.kv_channels or cm.hidden_size // heads,
                    ffn_hidden_size=ffn, vocab_size=cm.vocab_size, num_experts=cm.num_experts or None,
                    moe_ffn_hidden_size=cm.moe_ffn_hidden_size or ffn, moe_router_topk=cm.moe_router_topk,
                    moe_shared_expert_intermediate_size=cm.moe_shared_expert_intermediate_size,
                    moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq)
    return SimpleNamespace(use_dynamic_batch_size=batch.use_dynamic_batch_size,
                           max_tokens_per_gpu=batch.max_tokens_per_gpu, micro_batch_size=batch.micro_batch_size,
                           balance_data=batch.balance_data, balance_by_flops=batch.balance_by_flops, **dims)


class ReferenceSchedule(Baseline):
    """Upstream's ``build_dp_schedule`` (module docstring): pack first (first fit, or with ``balance_by_flops`` a
    FLOPs-balanced partition into ``ceil(tokens / cap)`` micro-batches without the cap), split to align, then
    strided or FLOPs-balanced over the ranks."""

    name = "reference"
    batch_unit = "rollouts"

    @staticmethod
    def source() -> str:
        """Where upstream comes from (raises :class:`~slime_ext.schemes.upstream.UpstreamUnavailable`)."""
        return upstream.load().source

    def missing(self) -> str:
        """Why upstream cannot be loaded here, and how to get it; ``""`` when it can."""
        try:
            upstream.load()
        except upstream.UpstreamUnavailable as e:
            return str(e)
        return ""

    def note(self, batch: BatchConfig) -> str:
        return f"upstream from {self.source()}"

    def same_input(self, ours: DPSchedule, batch: BatchConfig, cost_model: CostModel | None) -> SameInput:
        """The whole rollout with its rollout ids, in steps of as many rollouts as ours."""
        if cost_model is None and (batch.balance_data or batch.balance_by_flops):
            raise NotComparable(_NEEDS_DIMS)
        n = ours.num_samples
        return SameInput(sample_ids=list(range(n)), global_batch_size=ours.rollouts_per_step[0],
                         rollout_ids=list(ours.rollout_ids) if ours.rollout_ids is not None else list(range(n)))

    def schedule(self, lengths: Sequence[int], parallel: ParallelConfig, batch: BatchConfig, *,
                 global_batch_size: int, rollout_ids: Sequence[int] | None = None,
                 cost_model: CostModel | None = None) -> SchemeSchedule:
        parallel.require_dp_size()
        build = upstream.load().dp_schedule.build_dp_schedule
        if cost_model is None and (batch.balance_data or batch.balance_by_flops):
            raise ValueError(_NEEDS_DIMS)
        lengths = [int(x) for x in lengths]
        ids = list(rollout_ids) if rollout_ids is not None else list(range(len(lengths)))
        out = build(upstream_args(batch, cost_model), parallel.to_dict(), lengths,
                    global_batch_size=global_batch_size, rollout_indices=ids)
        partitions, micro_batch_indices, num_microbatches = out[:3]  # HEAD adds the rollouts per step
        return SchemeSchedule(partitions, micro_batch_indices, num_microbatches)
