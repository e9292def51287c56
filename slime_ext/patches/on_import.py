"""Patch a host's module the moment it is imported: one import hook for every host integration.

A host binds names from its own modules when they are imported (``from slime.utils.arguments import parse_args``,
verl's engine calling ``prepare_micro_batches`` by its module-global name); a patch applied after that misses the
bound copies. :func:`arrange` therefore runs an action right after the target module's code executes and before
any importer sees the module, or at once when the module is already imported.

Each host integration arranges its actions under its own name (``owner``); :func:`remove` takes them away again.
The actions are the integration's own (apply a :class:`~slime_ext.patches.PatchSet`, raise a deferred error); they
must be idempotent, since a module reloaded is executed (and acted on) again.
"""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Any, Callable, MutableMapping

__all__ = ["Action", "OnImport", "arrange", "finder", "remove"]

#: what runs right after a module executes, with the module
Action = Callable[[ModuleType], None]


class OnImport(importlib.abc.MetaPathFinder):
    """Runs ``actions[name](module)`` right after module ``name`` executes, before any importer sees it.

    ``actions`` is read at each import, not copied: an integration may keep it as a module-level table."""

    def __init__(self, owner: str, actions: MutableMapping[str, Action]) -> None:
        self.owner, self.actions = owner, actions

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.actions:
            return None
        for other in sys.meta_path:
            if other is self or not hasattr(other, "find_spec"):
                continue
            spec = other.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenAct(spec.loader, self.actions, fullname)
                return spec
        return None

    def __repr__(self) -> str:
        return f"OnImport({self.owner!r}, {sorted(self.actions)})"


class _ThenAct(importlib.abc.Loader):
    """The host's own loader, with the owner's action run after the module executes."""

    def __init__(self, loader: Any, actions: MutableMapping[str, Action], name: str) -> None:
        self._loader, self._actions, self._name = loader, actions, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._actions[self._name](module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def finder(owner: str) -> OnImport | None:
    """The import hook ``owner`` arranged, if it is installed."""
    return next((f for f in sys.meta_path if isinstance(f, OnImport) and f.owner == owner), None)


def arrange(owner: str, actions: MutableMapping[str, Action]) -> OnImport:
    """Run each ``actions[module]`` now for the modules already imported, and right after the others are imported.

    A second call for the same ``owner`` adds ``actions`` to its hook (one hook per owner, first in
    ``sys.meta_path``). An action that raises stops here, before the hook is installed or extended."""
    for name, action in list(actions.items()):
        if name in sys.modules:
            action(sys.modules[name])
    hook = finder(owner)
    if hook is None:
        hook = OnImport(owner, actions)
        sys.meta_path.insert(0, hook)
    elif hook.actions is not actions:
        hook.actions.update(actions)
    return hook


def remove(owner: str) -> None:
    """Uninstall ``owner``'s import hook (a no-op when there is none); modules already patched stay patched."""
    sys.meta_path[:] = [f for f in sys.meta_path if not (isinstance(f, OnImport) and f.owner == owner)]
