"""slime-ext inside verl (github.com/verl-project/verl): slime-ext's micro-batch plans in verl's Megatron engine,
and optionally its dispatch in verl's V1 trainer.

The switch is one environment variable, read in every process that imports verl (the driver and each Ray
worker)::

    pip install "./slime-ext[verl]"   # from a clone of slime-ext (docs/install.md)
    SLIME_EXT_VERL=1 python -m verl.trainer.main_ppo ...         # the engine depth (see docs/verl.md for Ray)
    SLIME_EXT_VERL=trainer python -m verl.trainer.main_ppo ...   # the trainer depth too

``pip install`` registers :mod:`slime_ext.integrations.verl.plugin` in verl's ``verl.plugins`` entry-point group,
which ``import verl`` loads in every process. With ``SLIME_EXT_VERL`` unset or ``0`` the plugin does nothing and
verl is untouched. With ``1`` (or ``engine``) it patches ``verl.workers.engine.megatron.transformer_impl`` as soon as
that module is imported (the patches: :mod:`slime_ext.patches.verl_host`): verl's ``prepare_micro_batches`` is
replaced by slime-ext's engine-depth plan (:mod:`.engine`, :mod:`.plan`). With ``trainer`` it also patches the V1
trainer's ``_balance_batch`` when ``verl.trainer.ppo.v1.trainer_base`` is imported (:mod:`.trainer`). Any other
value, or a verl this integration does not recognise, fails that import with an error naming the fix (verl swallows
errors raised while it loads plugins, so the plugin defers them to the import that needs the patch).

A process of your own calls :func:`enable` (and :func:`disable` to undo).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from slime_ext.patches import PatchError, PatchSet, on_import

logger = logging.getLogger("slime_ext.integrations.verl")

#: the switch
ENV = "SLIME_EXT_VERL"
#: the depths, shallowest first: ``engine`` patches verl's Megatron engine, ``trainer`` the V1 trainer as well
DEPTHS = ("engine", "trainer")
_VALUES = {"1": "engine", "true": "engine", "on": "engine", "yes": "engine", "engine": "engine", "trainer": "trainer",
           "": None, "0": None, "false": None, "off": None, "no": None}

__all__ = ["DEPTHS", "ENV", "PatchError", "disable", "enable", "enabled", "switch_from_env"]

#: the name verl's import hook goes by (:mod:`slime_ext.patches.on_import`)
HOOK_OWNER = "verl"
#: the applied patch sets, by depth
_applied: dict[str, PatchSet] = {}


def switch_from_env(environ: Any = None) -> str | None:
    """The switch's value: ``"engine"`` for 1/true/on/yes/engine, ``"trainer"`` for trainer, ``None`` when unset or
    0/false/off/no; anything else is a ``ValueError`` naming the fix."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    if value in _VALUES:
        return _VALUES[value]
    raise ValueError(f"{ENV}={value!r} is not a switch value; set {ENV}=1 to let slime-ext plan verl's micro-batches "
                     f"({ENV}=trainer to plan its dispatch too) or {ENV}=0 (or unset it) for verl's own plan")


def enabled(depth: str = "engine") -> bool:
    """Whether the patches of ``depth`` are applied in this process."""
    return depth in _applied


def _check_depth(depth: str) -> None:
    if depth not in DEPTHS:
        raise ValueError(f"depth={depth!r} is not one of {DEPTHS}; pass 'engine' (verl's Megatron engine) or "
                         f"'trainer' (its V1 trainer's dispatch too)")


def _apply(part: str) -> PatchSet:
    if part not in _applied:
        from slime_ext.patches import verl_host

        from . import engine, trainer

        patches = verl_host.verl_patches(engine) if part == "engine" else verl_host.trainer_patches(trainer)
        patches.apply()
        _applied[part] = patches
        import verl

        logger.info("slime-ext plans in verl %s (%s):\n%s", verl.__version__, part, patches.describe())
    return _applied[part]


def enable(depth: str = "engine") -> PatchSet:
    """Patch verl now: its Megatron engine (imports it), and with ``depth="trainer"`` its V1 trainer's dispatch
    (imports it; needs verl's trainer dependencies, e.g. TransferQueue). Refuses with ``PatchError`` on a verl it
    does not recognise; a second call is a no-op. Returns the engine's patch set."""
    _check_depth(depth)
    engine = _apply("engine")
    if depth == "trainer":
        _apply("trainer")
    return engine


def disable() -> None:
    """Undo :func:`enable` (verl's own functions are restored) and stop patching on later imports."""
    for part in reversed(DEPTHS):
        if part in _applied:
            _applied[part].undo()
            del _applied[part]
    on_import.remove(HOOK_OWNER)


def enable_on_import(depth: str = "engine", error: Exception | None = None) -> None:
    """Apply the patches of ``depth`` right after the verl modules they target execute (now, for those already
    imported); with ``error``, raise it there instead (the plugin defers its errors to those imports, which verl does
    not swallow)."""
    from slime_ext.patches.verl_host import MODULE, TRAINER_MODULE

    _check_depth(depth)
    parts = {MODULE: "engine"}
    if depth == "trainer":
        parts[TRAINER_MODULE] = "trainer"
    on_import.arrange(HOOK_OWNER, {module: functools.partial(_after_import, part, error)
                                   for module, part in parts.items()})


def _after_import(part: str, error: Exception | None, module: Any) -> None:
    """What runs when a target module of ``part`` is imported: the deferred ``error`` if any, else the patches."""
    if error is not None:
        raise error
    _apply(part)
