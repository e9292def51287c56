"""slime-ext inside Megatron-LM's own RL loop (``train_rl.py``, ``megatron/rl``; github.com/NVIDIA/Megatron-LM).

The switch is the launcher: start ``train_rl.py`` through slime-ext, with Megatron-LM's arguments unchanged::

    torchrun --nproc-per-node 8 -m slime_ext.integrations.megatron_rl [--max-tokens-per-gpu N] \\
        train_rl.py --rl-use-sequence-packing --calculate-per-token-loss ...
    # (was: torchrun --nproc-per-node 8 train_rl.py ...)

That applies :func:`enable` in every process, then runs ``train_rl.py`` as ``__main__``. Without the launcher,
Megatron-LM is untouched. With it, slime-ext plans each rollout collection (:mod:`.plan`): micro-batches of real
tokens only under the token cap, the same count on every DP rank, FLOP-balanced and pipeline-ordered (PP and VPP),
``1 / ratio`` optimizer steps that train every sample once per pass, the LR scheduler and ``consumed_train_samples``
advanced by the samples each step trained, and the log-prob passes pipelined (:mod:`.runtime`). A setting it cannot
honour is refused at the first collection, before any rollout (:mod:`.settings`); a Megatron-LM it does not
recognise is refused by :func:`enable` (:mod:`slime_ext.patches.megatron_rl`).

A process of your own calls :func:`enable` **before importing** ``train_rl`` (which binds two of the patched names
when it is imported; :func:`enable` refuses if it already was), and :func:`disable` to undo.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from slime_ext.patches import PatchError, PatchSet

from .settings import MegatronRLSettingError, Options

logger = logging.getLogger("slime_ext.integrations.megatron_rl")

__all__ = ["MegatronRLSettingError", "Options", "PatchError", "disable", "enable", "enabled"]

_applied: PatchSet | None = None


def enabled() -> bool:
    """Whether slime-ext's patches are applied in this process."""
    return _applied is not None


def _bound_too_early(patches: PatchSet) -> list[str]:
    """Modules that imported one of the patched functions by name before the patches were applied (they would keep
    Megatron-LM's original): ``train_rl`` most of all."""
    originals = {id(p.original): p for p in patches if p.applied}
    late = []
    for name, module in list(sys.modules.items()):
        if name.startswith(("megatron.", "torch", "slime_ext")) or module is None:
            continue
        for attr in ("load_packed_data_by_index", "is_pipeline_last_stage"):
            value = getattr(module, attr, None)
            if value is not None and id(value) in originals:
                late.append(f"{name}.{attr}")
    return late


def enable(max_tokens_per_gpu: int | None = None, cost_profile: str | None = None) -> PatchSet:
    """Apply slime-ext's patches to the importable Megatron-LM (its root on ``sys.path``). ``max_tokens_per_gpu``
    (tokens of one micro-batch per GPU; default ``--seq-length / cp``) and ``cost_profile`` (a ``slime-ext
    calibrate`` JSON) are slime-ext's own settings (:class:`.settings.Options`). Idempotent for the same options;
    raises ``PatchError`` for a Megatron-LM it does not know, or when ``train_rl`` was imported first."""
    global _applied
    from . import runtime
    from slime_ext.patches.megatron_rl import check_logprob_patch, megatron_rl_patches

    options = Options(max_tokens_per_gpu=max_tokens_per_gpu, cost_profile=cost_profile)
    if _applied is not None:
        if runtime.STATE.options != options:
            raise ValueError(f"slime-ext is already enabled with {runtime.STATE.options}; disable() first to "
                             f"change to {options}")
        return _applied
    patches = megatron_rl_patches(runtime)
    patches.apply()
    try:
        check_logprob_patch(patches)
        late = _bound_too_early(patches)
        if late:
            raise PatchError(f"{', '.join(late)} still hold Megatron-LM's originals: train_rl was imported before "
                             f"slime-ext was enabled; call slime_ext.integrations.megatron_rl.enable() before "
                             f"importing train_rl (or start it through `python -m slime_ext.integrations.megatron_rl`)")
    except BaseException:
        patches.undo()
        raise
    runtime.STATE.options = options
    runtime.STATE.settings = None
    _applied = patches
    logger.info("slime-ext plans Megatron-RL (%s):\n%s", patches.patches[0].version(), patches.describe())
    return patches


def disable() -> None:
    """Undo :func:`enable` (Megatron-LM's originals back); a no-op when not enabled."""
    global _applied
    if _applied is None:
        return
    from . import runtime

    _applied.undo()
    _applied = None
    runtime.STATE.__init__()


def _state() -> Any:  # for tests and benchmarks: the process state of the runtime
    from . import runtime

    return runtime.STATE
