"""The few modules NeMo-RL imports that the host tests stub (the conftest's docstring says why)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

#: experiment-logger backends: imported by nemo_rl.utils.logger, never called while sharding
LOGGER_BACKENDS = ("mlflow", "wandb", "swanlab")
PACKED_SEQ_UTILS = "megatron.bridge.training.utils.packed_seq_utils"
#: Megatron-Bridge modules nemo_rl.models.megatron.train imports only for type names (config and state classes)
BRIDGE_TYPE_MODULES = ("megatron.bridge.models", "megatron.bridge.models.model_provider", "megatron.bridge.training.config",
                       "megatron.bridge.training.state")


class _TypeNames(types.ModuleType):
    """A module whose every attribute is a fresh empty class (names used in annotations and isinstance checks)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Anything(types.ModuleType):
    """A module whose every attribute is another such module (a decorator, a class, a call: all inert)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return _Anything(f"{self.__name__}()")


class _InertModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``names`` and everything under them as :class:`_Anything` modules."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if any(fullname == name or fullname.startswith(name + ".") for name in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Anything(spec.name)

    def exec_module(self, module):
        pass


def _insert_inert(names: tuple[str, ...], first: bool) -> None:
    if not any(isinstance(f, _InertModules) and f.names == names for f in sys.meta_path):
        sys.meta_path.insert(0 if first else len(sys.meta_path), _InertModules(names))


def _cp_partition_indices(*args, **kwargs):
    raise NotImplementedError("Megatron-Bridge's get_packed_seq_cp_partition_indices is stubbed in slime-ext's host "
                              "tests (context parallelism is not run on CPU)")


#: what importing NeMo-RL's Megatron policy worker module (``nemo_rl.models.policy.workers.megatron_policy_worker``)
#: needs beyond :func:`install`: all of Megatron-Bridge (its package needs transformer-engine, which has no CPU
#: wheel), the names NeMo-RL's pinned megatron-core has in ``mcore_fsdp_adapter`` and PyPI's 0.19.2 has not, and
#: ``tensordict`` and ``datasets`` (not in this venv). Inert modules: the tests that import the worker module only
#: resolve its classes, they never build a worker.
WORKER_MODULE_STUBS = ("megatron.bridge", "megatron.core.distributed.fsdp.mcore_fsdp_adapter", "tensordict", "datasets")


def install_for_worker_module() -> None:
    """:func:`install`, with :data:`WORKER_MODULE_STUBS` inert (call it first, in a fresh interpreter)."""
    _insert_inert(WORKER_MODULE_STUBS, first=True)
    install()


def install() -> None:
    missing = [name for name in LOGGER_BACKENDS if importlib.util.find_spec(name) is None]
    if missing:
        _insert_inert(LOGGER_BACKENDS, first=False)
    if importlib.util.find_spec("megatron.bridge") is None:
        for name in ("megatron.bridge", "megatron.bridge.training", "megatron.bridge.training.utils"):
            module = types.ModuleType(name)
            module.__path__ = []
            sys.modules.setdefault(name, module)
        utils = types.ModuleType(PACKED_SEQ_UTILS)
        utils.get_packed_seq_cp_partition_indices = _cp_partition_indices
        sys.modules.setdefault(PACKED_SEQ_UTILS, utils)
        for name in BRIDGE_TYPE_MODULES:
            module = _TypeNames(name)
            module.__path__ = []
            sys.modules.setdefault(name, module)
