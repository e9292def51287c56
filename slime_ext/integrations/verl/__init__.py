"""slime-ext inside verl (github.com/verl-project/verl): slime-ext's micro-batch plans in verl's Megatron engine.

The switch is one environment variable, read in every process that imports verl (the driver and each Ray
worker)::

    pip install 'slime-ext[verl]'
    SLIME_EXT_VERL=1 python -m verl.trainer.main_ppo ...   # plus, for the Ray workers, see docs/verl.md

``pip install`` registers :mod:`slime_ext.integrations.verl.plugin` in verl's ``verl.plugins`` entry-point group,
which ``import verl`` loads in every process. With ``SLIME_EXT_VERL`` unset or ``0`` the plugin does nothing and
verl is untouched. With ``1`` it patches ``verl.workers.engine.megatron.transformer_impl`` as soon as that module
is imported (:mod:`.patches`): verl's ``prepare_micro_batches`` is replaced by slime-ext's engine-depth plan
(:mod:`.engine`, :mod:`.plan`). Any other value, or a verl this integration does not recognise, fails that import
with an error naming the fix (verl swallows errors raised while it loads plugins, so the plugin defers them to the
import that needs the patch).

A process of your own calls :func:`enable` (and :func:`disable` to undo).
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys
from typing import Any

from slime_ext.patches import PatchError, PatchSet

logger = logging.getLogger("slime_ext.integrations.verl")

#: the switch
ENV = "SLIME_EXT_VERL"
_ON = ("1", "true", "on", "yes")
_OFF = ("", "0", "false", "off", "no")

__all__ = ["ENV", "PatchError", "disable", "enable", "enabled", "switch_from_env"]

_applied: PatchSet | None = None


def switch_from_env(environ: Any = None) -> bool:
    """The switch's value: ``True`` for 1/true/on/yes, ``False`` when unset or 0/false/off/no; anything else is a
    ``ValueError`` naming the fix."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{ENV}={value!r} is not a switch value; set {ENV}=1 to let slime-ext plan verl's micro-batches "
                     f"or {ENV}=0 (or unset it) for verl's own plan")


def enabled() -> bool:
    """Whether slime-ext's patches are applied in this process."""
    return _applied is not None


def enable() -> PatchSet:
    """Patch verl now (imports verl's Megatron engine module). Refuses with ``PatchError`` on a verl it does not
    recognise; a second call is a no-op."""
    global _applied
    if _applied is None:
        from .patches import verl_patches

        patches = verl_patches()
        patches.apply()
        _applied = patches
        import verl

        logger.info("slime-ext plans verl %s's Megatron micro-batches:\n%s", verl.__version__, patches.describe())
    return _applied


def disable() -> None:
    """Undo :func:`enable` (verl's own functions are restored) and stop patching on later imports."""
    global _applied
    if _applied is not None:
        _applied.undo()
        _applied = None
    for finder in [f for f in sys.meta_path if isinstance(f, _PatchOnImport)]:
        sys.meta_path.remove(finder)


def enable_on_import(error: Exception | None = None) -> None:
    """Apply :func:`enable` right after verl's Megatron engine module executes (now, if it already has); with
    ``error``, raise it there instead (the plugin defers its errors to that import, which verl does not swallow)."""
    from .patches import MODULE

    if MODULE in sys.modules:
        if error is not None:
            raise error
        enable()
        return
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(MODULE, error))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs :func:`enable` right after ``module`` executes, before its importer sees it."""

    def __init__(self, module: str, error: Exception | None) -> None:
        self.module, self.error = module, error

    def find_spec(self, fullname, path, target=None):
        if fullname != self.module:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenEnable(spec.loader, self.error)
                return spec
        return None


class _ThenEnable(importlib.abc.Loader):
    def __init__(self, loader: Any, error: Exception | None) -> None:
        self._loader, self._error = loader, error

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self._error is not None:
            raise self._error
        enable()

    def __getattr__(self, name):
        return getattr(self._loader, name)
