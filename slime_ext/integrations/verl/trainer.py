"""slime-ext's ``_balance_batch`` for verl's V1 trainer (the trainer depth, ``SLIME_EXT_VERL=trainer``).

verl's V1 trainer (``verl/trainer/ppo/v1/trainer_base.py``) calls ``self._balance_batch(batch, metrics)`` once per
trainer step, in the driver, where every sample's length is known before dispatch. verl's own pads the batch with
no-op samples to a multiple of lcm(dp, mini-batch sizes) (``upsample_batch_to_divisible_size``), balances the whole
step's workload into dp equal-count groups and reorders the batch so that contiguous chunks are the DP ranks. Each
rank then cuts its chunk into contiguous mini-batches, so each mini-batch (one optimizer step) is only as balanced
as the whole-step partition happens to make it.

The replacement keeps verl's first two steps (the actor's DP size from the worker group's dispatch info, verl's own
padding) and replaces the partition: :func:`slime_ext.integrations.verl.plan.plan_dispatch` plans each actor
mini-batch across the DP ranks (equal counts, estimated FLOPs balanced), and the batch is reordered so that verl's
contiguous chunks and mini-batch slices are that plan. verl's ``log_seqlen_unbalance`` metrics are reported on the
resulting partition as before. The engine depth then cuts each rank's mini-batch into micro-batches.

It falls back to verl's own, saying so once per reason, where the plan would not survive to the worker: the actor
shuffles its mini-batches (``actor_rollout_ref.actor.shuffle``), or there is no actor update this step
(``trainer.critic_warmup``). The cost is FLOPs from the model's HF config (read from
``actor_rollout_ref.model.path``), a profile from ``SLIME_EXT_VERL_PROFILE``, else tokens.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

from slime_ext.schedule import CostModel, CostProfile

from .engine import PROFILE_ENV, _profile, _say_once
from .plan import plan_dispatch

logger = logging.getLogger("slime_ext.integrations.verl")


def trainer_fallback_reason(trainer: Any) -> str | None:
    config = trainer.config
    if config.actor_rollout_ref.actor.get("shuffle", False):
        return "actor_rollout_ref.actor.shuffle=True: the worker shuffles mini-batches, so a per-mini-batch plan " \
               "would not survive to it"
    if config.trainer.get("critic_warmup", 0) > getattr(trainer, "global_steps", 0):
        return "no actor update this step (trainer.critic_warmup)"
    return None


@functools.lru_cache(maxsize=4)
def _hf_cost_model(path: str) -> CostModel | None:
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path, trust_remote_code=False)
        hf = getattr(hf, "text_config", hf)
        return CostModel(hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
                         num_attention_heads=hf.num_attention_heads,
                         num_query_groups=getattr(hf, "num_key_value_heads", None),
                         kv_channels=getattr(hf, "head_dim", None),
                         ffn_hidden_size=getattr(hf, "intermediate_size", None), vocab_size=hf.vocab_size,
                         swiglu=getattr(hf, "hidden_act", "") in ("silu", "swiglu"))
    except Exception as exc:  # a model whose config we cannot read: balance by tokens rather than fail the step
        _say_once(f"no FLOPs model from {path!r} ({type(exc).__name__}: {exc}); the trainer depth balances tokens")
        return None


def trainer_cost_model(trainer: Any) -> CostModel | CostProfile | None:
    path = os.environ.get(PROFILE_ENV)
    if path:
        return _profile(path)
    model_path = trainer.config.actor_rollout_ref.model.get("path", None)
    return _hf_cost_model(str(model_path)) if model_path else None


def actor_dp_size(trainer: Any) -> int:
    """The actor's DP size, as verl's ``_balance_batch`` reads it (and caches it) from the worker group."""
    role, worker_group = "actor", trainer.actor_rollout_wg
    if role not in worker_group._dispatch_info:
        worker_group._dispatch_info[role] = worker_group._query_dispatch_info(role)
    return max(worker_group._dispatch_info[role]) + 1


def make_balance_batch(original: Callable) -> Callable:
    """The replacement for ``PPOTrainer._balance_batch`` (same signature; falls back to ``original``)."""

    @functools.wraps(original)
    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        reason = trainer_fallback_reason(self)
        if reason is not None:
            _say_once(f"verl's own _balance_batch dispatches this step: {reason}")
            return original(self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        from verl.trainer.ppo.v1 import trainer_base as tb

        dp_size = actor_dp_size(self)
        batch = tb.upsample_batch_to_divisible_size(batch, self._get_required_batch_multiple(dp_size),
                                                    self.tokenizer.eos_token_id)
        seqlens = [int(tag["seq_len"]) for tag in batch.tags]
        config = self.config.actor_rollout_ref
        mini_batch_size = config.actor.ppo_mini_batch_size * config.rollout.n
        order = plan_dispatch(seqlens, dp_size, mini_batch_size, cost_model=trainer_cost_model(self))
        batch.reorder(order)
        chunk = len(order) // dp_size
        partitions = [order[r * chunk:(r + 1) * chunk] for r in range(dp_size)]
        metrics.update(tb.log_seqlen_unbalance(seqlen_list=seqlens, partitions=partitions, prefix=logging_prefix))
        return batch

    _balance_batch.__slime_ext__ = True
    return _balance_batch
