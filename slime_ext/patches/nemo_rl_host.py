"""Where slime-ext enters NeMo-RL (github.com/NVIDIA-NeMo/RL): four patches of its driver-side code, by version.

=====================================================================  ==============================================
target                                                                 change
=====================================================================  ==============================================
``nemo_rl.distributed.batched_data_dict.BatchedDataDict``              inside the two shard calls below, a call with
``.shard_by_batch_size``                                               ``sequence_packing_args`` is planned by
                                                                       slime-ext; every other call is NeMo-RL's own
``nemo_rl.models.policy.lm_policy.Policy._shard_for_train``            unchanged, run with the training pass and the
                                                                       policy's layout in a context variable
``nemo_rl.models.policy.lm_policy.Policy._shard_for_logprob``          the same, with the forward-only pass
``nemo_rl.models.policy.lm_policy.Policy.__init__``                    the policy config checked (refusals), dynamic
                                                                       batching run as sequence packing (which lifts
                                                                       the one-pipeline-stage assert)
=====================================================================  ==============================================

Supported: NeMo-RL ``>=0.6.0,<0.8`` (tested: HEAD 7ea279a of 2026-08-22, whose ``nemo_rl.package_info`` says
0.6.0). The version is read off the imported ``nemo_rl.package_info.__version__``; the targets are checked as well:
the parameters of ``shard_by_batch_size``, that the two shard methods still call it with the caps they read, and that
``Policy.__init__`` still holds the assert it lifts. Anything else is refused with a ``PatchError`` naming what
differs.

Unless the ``pad_to_longest`` opt-out is set, two more: on the driver, NeMo-RL's actor environment registry with
slime-ext's Megatron worker class in the Megatron worker's environment (:func:`worker_class_patches`); in that
worker class's processes (pipeline parallelism only), ``nemo_rl.models.megatron.data.
_get_pack_sequence_parameters_for_megatron`` without its pad to the longest packed micro-batch
(:func:`worker_patches`). ``Policy.__init__`` must take ``worker_extension_cls_fqn``, through which slime-ext's
worker class is started.

What enters NeMo-RL is handed in by :mod:`slime_ext.integrations.nemo_rl` (its ``runtime`` module), which applies
this set; this module imports nothing of slime-ext above the patches.
"""

from __future__ import annotations

import inspect
from typing import Any

from . import Patch, PatchError, PatchSet, imported_version, parameters_are, source_contains

DATA_MODULE = "nemo_rl.distributed.batched_data_dict"
WORKER_DATA_MODULE = "nemo_rl.models.megatron.data"
POLICY_MODULE = "nemo_rl.models.policy.lm_policy"
#: the parameter of ``Policy.__init__`` that names its workers' Ray actor class
WORKER_CLASS_PARAMETER = "worker_extension_cls_fqn"
SUPPORTED = ">=0.6.0,<0.8"
TESTED = ("0.6.0 (HEAD 7ea279a, 2026-08-22)",)
#: the parameters of NeMo-RL's shard_by_batch_size the replacement takes, in order
PARAMETERS = ("self", "shards", "batch_size", "allow_uneven_shards", "dynamic_batching_args",
              "sequence_packing_args")


def _nemo_rl_version():
    return imported_version("nemo_rl.package_info", "__version__", "nemo-rl")


def _expect_shard(original: Any) -> str | None:
    return parameters_are(PARAMETERS)(original) or source_contains(
        "micro_batch_indices", "micro_batch_lengths", "elem_counts_per_gb", "sequence_length_pad_multiple",
        "max_tokens_per_microbatch")(original)


def worker_class_position(init: Any) -> int:
    """Where ``worker_extension_cls_fqn`` sits among ``Policy.__init__``'s positional parameters after ``self,
    cluster, config``, read off its signature; ``PatchError`` when it has none."""
    try:
        names = list(inspect.signature(init).parameters)
    except (TypeError, ValueError) as exc:
        raise PatchError(f"cannot read the signature of {init!r} ({exc})") from exc
    if WORKER_CLASS_PARAMETER not in names[3:]:
        raise PatchError(f"it has no parameter {WORKER_CLASS_PARAMETER} after self, cluster, config (its "
                         f"parameters: {names})")
    return names.index(WORKER_CLASS_PARAMETER) - 3


def _expect_policy_init(original: Any) -> str | None:
    found = source_contains("Dynamic batching is only supported for single pipeline parallel stage",
                            'config["sequence_packing"]["enabled"]')(original)
    if found:
        return found
    try:
        worker_class_position(original)
    except PatchError as exc:
        return str(exc)
    return None


def nemo_rl_patches(runtime: Any) -> PatchSet:
    """The patch set (a fresh one per call; :mod:`slime_ext.integrations.nemo_rl` keeps the applied one).
    ``runtime``: the integration's runtime module (the replacements)."""
    common = dict(distribution="nemo-rl", supported=SUPPORTED, tested=TESTED, version=_nemo_rl_version)
    return PatchSet("nemo-rl", [
        Patch(name="nemo-rl-shard-by-batch-size", module=DATA_MODULE, attribute="BatchedDataDict.shard_by_batch_size",
              make=runtime.make_shard_by_batch_size, expect=_expect_shard,
              doc="slime-ext's plan of a packed shard call made by the two shard methods below", **common),
        Patch(name="nemo-rl-shard-for-train", module=POLICY_MODULE, attribute="Policy._shard_for_train",
              make=runtime.make_shard_for(forward_only=False),
              expect=source_contains("shard_by_batch_size(", '["train_mb_tokens"]', "sequence_packing_args="),
              doc="NeMo-RL's own, planned as a training pass", **common),
        Patch(name="nemo-rl-shard-for-logprob", module=POLICY_MODULE, attribute="Policy._shard_for_logprob",
              make=runtime.make_shard_for(forward_only=True),
              expect=source_contains("shard_by_batch_size(", '["logprob_mb_tokens"]', "sequence_packing_args="),
              doc="NeMo-RL's own, planned as a forward-only pass", **common),
        Patch(name="nemo-rl-policy-init", module=POLICY_MODULE, attribute="Policy.__init__",
              make=runtime.make_policy_init, expect=_expect_policy_init,
              doc="the policy config checked; dynamic batching run as sequence packing (PP allowed)", **common),
    ])


REGISTRY_MODULE = "nemo_rl.distributed.ray_actor_environment_registry"
#: NeMo-RL's Megatron policy worker, whose Python environment slime-ext's worker class runs in
NEMO_RL_WORKER_FQN = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker"


def worker_class_patches(worker_class_fqn: str) -> PatchSet:
    """The driver-side patch for slime-ext's worker class (unless ``pad_to_longest``): NeMo-RL's actor environment
    registry with slime-ext's worker class in the environment of NeMo-RL's Megatron worker (NeMo-RL refuses an
    actor class it has no environment for)."""

    def make(registry: dict) -> dict:
        return {**registry, worker_class_fqn: registry[NEMO_RL_WORKER_FQN]}

    def expect(registry: Any) -> str | None:
        return None if isinstance(registry, dict) and NEMO_RL_WORKER_FQN in registry else (
            f"it has no entry for {NEMO_RL_WORKER_FQN}")

    return PatchSet("nemo-rl-worker-class", [
        Patch(name="nemo-rl-worker-environment", module=REGISTRY_MODULE, attribute="ACTOR_ENVIRONMENT_REGISTRY",
              make=make, expect=expect, distribution="nemo-rl", supported=SUPPORTED, tested=TESTED,
              version=_nemo_rl_version, doc="slime-ext's worker class runs in the Megatron worker's environment"),
    ])


def worker_patches(worker: Any) -> PatchSet:
    """The worker-side patch of slime-ext's worker class, applied in its (Megatron worker) processes.
    ``worker``: the integration's worker module (:func:`unpadded_pack_parameters`)."""
    return PatchSet("nemo-rl-worker", [
        Patch(name="nemo-rl-unpadded-packs", module=WORKER_DATA_MODULE,
              attribute="_get_pack_sequence_parameters_for_megatron", make=worker.unpadded_pack_parameters,
              distribution="nemo-rl", supported=SUPPORTED, tested=TESTED, version=_nemo_rl_version,
              expect=source_contains("pad_packed_seq_to = max_seq_len_in_batch", "pad_packed_seq_to_multiple_of"),
              doc="packed micro-batches of their own length under PP (megatron-core's variable_seq_lengths)"),
    ])


__all__ = ["DATA_MODULE", "PARAMETERS", "POLICY_MODULE", "PatchError", "SUPPORTED", "TESTED", "WORKER_CLASS_PARAMETER",
           "WORKER_DATA_MODULE", "nemo_rl_patches", "worker_class_patches", "worker_class_position",
           "worker_patches"]
