"""NeMo-RL's Megatron worker with packed micro-batches of their own length under pipeline parallelism (the
``variable_seq_lengths`` option; off by default).

NeMo-RL's worker pads every packed micro-batch of a global batch to the longest one when the pipeline has more than
one stage (``_get_pack_sequence_parameters_for_megatron``: megatron-core's p2p is then given one shape). megatron-core
can instead send each micro-batch's shape ahead of it (``TransformerConfig.variable_seq_lengths``). With the option:

* :func:`unpadded_pack_parameters` replaces ``_get_pack_sequence_parameters_for_megatron`` in the worker process:
  NeMo-RL's own parameters, without the pad to the longest (each packed micro-batch still rounded up to NeMo-RL's
  multiple for FP8 / CP / sequence parallelism);
* :func:`use_variable_seq_lengths` sets ``variable_seq_lengths`` on the model's config, and ``batch_p2p_comm``
  off from 4 stages (Megatron-LM issue 5100: batched p2p with per-micro-batch shapes deadlocks there);
* :func:`worker_class` is the Ray actor the ``Policy`` starts instead of NeMo-RL's ``MegatronPolicyWorker``
  (through its ``worker_extension_cls_fqn``): NeMo-RL's implementation, with the two above applied in the worker
  process. slime-ext must be importable in the workers' environment.

The planner then plans the micro-batches as they run (no pad priced in).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = ["WORKER_CLASS_FQN", "apply_worker_patches", "undo_worker_patches", "unpadded_pack_parameters",
           "use_variable_seq_lengths", "worker_class"]

#: what the Policy is given as ``worker_extension_cls_fqn``
WORKER_CLASS_FQN = "slime_ext.integrations.nemo_rl.worker.MegatronPolicyWorker"


def unpadded_pack_parameters(original: Callable) -> Callable:
    """``make`` of the worker patch: NeMo-RL's pack parameters without ``pad_packed_seq_to``."""

    @functools.wraps(original)
    def _get_pack_sequence_parameters_for_megatron(*args, **kwargs):
        pad_individual, pad_packed_multiple, _pad_to_longest = original(*args, **kwargs)
        return pad_individual, pad_packed_multiple, None

    return _get_pack_sequence_parameters_for_megatron


_applied: Any = None


def apply_worker_patches() -> Any:
    """Apply the worker patch (:func:`unpadded_pack_parameters`) in this process; idempotent. Returns the patch set."""
    global _applied
    if _applied is None:
        import sys

        from slime_ext.patches.nemo_rl_host import worker_patches

        patches = worker_patches(sys.modules[__name__])
        patches.apply()
        _applied = patches
    return _applied


def undo_worker_patches() -> None:
    """Undo :func:`apply_worker_patches` (a no-op when not applied)."""
    global _applied
    if _applied is not None:
        _applied.undo()
        _applied = None


def use_variable_seq_lengths(model: Any) -> None:
    """Let megatron-core's p2p carry each micro-batch's shape (and batch its p2p only below 4 stages)."""
    from megatron.core.utils import get_model_config

    from .settings import P2P_DEADLOCK_PP

    config = get_model_config(model[0] if isinstance(model, list) else model)
    config.variable_seq_lengths = True
    if config.pipeline_model_parallel_size >= P2P_DEADLOCK_PP:
        config.batch_p2p_comm = False


def worker_class() -> Any:
    """NeMo-RL's Megatron policy worker (its implementation class) as a Ray actor, with the worker patch applied
    and variable sequence lengths set once its model is built."""
    import ray
    from nemo_rl.models.policy.utils import get_runtime_env_for_policy_worker
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl

    class SlimeExtMegatronPolicyWorker(MegatronPolicyWorkerImpl):
        def __init__(self, *args, **kwargs):
            apply_worker_patches()
            super().__init__(*args, **kwargs)
            use_variable_seq_lengths(self.model)

    return ray.remote(runtime_env=get_runtime_env_for_policy_worker("megatron_policy_worker"))(
        SlimeExtMegatronPolicyWorker)


def __getattr__(name: str) -> Any:  # the actor class is built on first use: importing it needs NeMo-RL and Ray
    if name == "MegatronPolicyWorker":
        value = worker_class()
        globals()[name] = value
        return value
    raise AttributeError(name)
