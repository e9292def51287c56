"""slime-ext inside NeMo-RL's Megatron backend (github.com/NVIDIA-NeMo/RL): slime-ext plans the micro-batches of
both shard paths, training and log-prob.

The switch is the launcher: start NeMo-RL's entry script through slime-ext, with its arguments unchanged::

    python -m slime_ext.integrations.nemo_rl [--cost-profile JSON] [--pad-to-longest] examples/run_grpo.py ...
    # (was: python examples/run_grpo.py --config ...)

The launcher arranges slime-ext's patches (:mod:`slime_ext.patches.nemo_rl_host`) to be applied the moment NeMo-RL's
``batched_data_dict`` and ``lm_policy`` modules are imported, then runs the script as ``__main__``. Without it,
NeMo-RL is untouched. With it, every Megatron ``Policy``'s packed shard calls are planned by slime-ext (:mod:`.plan`):
``_shard_for_train`` under ``train_mb_tokens`` as a training pass, ``_shard_for_logprob`` under
``logprob_mb_tokens`` as a forward-only pass; the same micro-batch count on every DP rank, FLOPs balanced, and with
pipeline parallelism the count and order the planner predicts fastest for that pass. The result is the shard
metadata NeMo-RL's workers already read, so the worker code runs unchanged. A setting slime-ext cannot honour is
refused when the ``Policy`` is built (:mod:`.settings`); a NeMo-RL it does not recognise is refused when the patches
are applied (``PatchError``).

The plan is made on the driver: NeMo-RL shards there, and its Ray workers read what the driver sends. Under
pipeline parallelism the Megatron workers also run each packed micro-batch at its own length instead of NeMo-RL's
pad to the longest (:mod:`.worker`: slime-ext's worker class, which the workers must be able to import); the
``pad_to_longest`` opt-out (``--pad-to-longest``) keeps NeMo-RL's workers and pad, and then runs NeMo-RL's own
sharding of a call where it is predicted faster under that pad. At one pipeline stage the workers are NeMo-RL's.

A process of your own calls :func:`enable` (imports NeMo-RL's two modules and patches them now) and :func:`disable`
to undo.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from slime_ext.patches import PatchError, PatchSet, on_import

from .settings import NemoRLSettingError, Options

logger = logging.getLogger("slime_ext.integrations.nemo_rl")

__all__ = ["NemoRLSettingError", "Options", "PatchError", "disable", "enable", "enable_on_import", "enable_worker",
           "enabled"]

#: the name NeMo-RL's import hook goes by (:mod:`slime_ext.patches.on_import`)
HOOK_OWNER = "nemo_rl"
_applied: PatchSet | None = None


def enabled() -> bool:
    """Whether slime-ext's patches are applied in this process."""
    return _applied is not None


def _set_options(options: Options) -> None:
    from . import runtime

    if _applied is not None and runtime.STATE.options != options:
        raise ValueError(f"slime-ext is already enabled with {runtime.STATE.options}; disable() first to change to "
                         f"{options}")
    runtime.STATE.options, runtime.STATE.costs = options, options.costs()


def _apply(module: Any = None) -> PatchSet:
    """Apply the patch set (importing both target modules); a second call is a no-op."""
    global _applied
    if _applied is None:
        from slime_ext.patches.nemo_rl_host import nemo_rl_patches

        from . import runtime

        patches = nemo_rl_patches(runtime)
        if not runtime.STATE.options.pad_to_longest:
            from slime_ext.patches.nemo_rl_host import worker_class_patches

            from .worker import WORKER_CLASS_FQN

            patches = PatchSet(patches.name, [*patches.patches, *worker_class_patches(WORKER_CLASS_FQN).patches])
        patches.apply()
        _applied = patches
        logger.info("slime-ext plans NeMo-RL's Megatron shards (%s):\n%s", patches.patches[0].version(),
                    patches.describe())
    return _applied


def enable(cost_model: Any = None, cost_profile: str | None = None, pad_to_longest: bool = False) -> PatchSet:
    """Patch the importable NeMo-RL now. ``cost_model`` (a :class:`~slime_ext.schedule.CostModel`) or
    ``cost_profile`` (a ``slime-ext calibrate`` JSON) price the plan; neither: tokens. ``pad_to_longest``: under PP,
    keep NeMo-RL's worker class and its pad of every packed micro-batch to the longest (default: slime-ext's worker
    class runs them at their own length, :mod:`.worker`). Idempotent for the same options; raises ``PatchError``
    for a NeMo-RL it does not recognise."""
    _set_options(Options(cost_model=cost_model, cost_profile=cost_profile, pad_to_longest=pad_to_longest))
    return _apply()


def enable_worker() -> PatchSet:
    """Apply the worker-side patch in this (Megatron worker) process: NeMo-RL's packed micro-batches keep their own
    length under PP (what slime-ext's worker class does when it starts). Idempotent; :func:`disable` undoes it
    too."""
    from .worker import apply_worker_patches

    return apply_worker_patches()


def enable_on_import(cost_model: Any = None, cost_profile: str | None = None, pad_to_longest: bool = False) -> None:
    """Apply the patches right after NeMo-RL's ``lm_policy`` module executes (now, if it already did); what the
    launcher does, so that importing NeMo-RL stays the script's own business."""
    from slime_ext.patches.nemo_rl_host import POLICY_MODULE

    _set_options(Options(cost_model=cost_model, cost_profile=cost_profile, pad_to_longest=pad_to_longest))
    on_import.arrange(HOOK_OWNER, {POLICY_MODULE: functools.partial(_after_import)})


def _after_import(module: Any) -> None:
    _apply()


def disable() -> None:
    """Undo :func:`enable` (NeMo-RL's own functions are restored) and stop patching on later imports."""
    global _applied
    from .worker import undo_worker_patches

    on_import.remove(HOOK_OWNER)
    undo_worker_patches()
    if _applied is None:
        return
    from . import runtime

    _applied.undo()
    _applied = None
    runtime.STATE.__init__()
