"""The only modules the host tests replace: the GPU-serving stack that cannot be installed on a CPU machine.

Everything else slime imports (ray, torch, megatron, transformers, ...) is real. A stubbed module hands out an
inert placeholder for any attribute, so importing slime succeeds; calling into a stub raises, so a test that
reached GPU-serving code by accident fails loudly instead of passing on a fake.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types

#: top-level packages that are stubbed, and why
STUBBED = {
    "sglang": "the SGLang inference server (CUDA kernels)",
    "sglang_router": "SGLang's router (serving only)",
    "torch_memory_saver": "CUDA memory offloading (a CUDA extension)",
}


_inert_calls: list[bool] = []


@contextlib.contextmanager
def inert_calls():
    """Within this block a call into a stub returns another stub instead of raising. For building slime's argument
    parser, which registers SGLang's router flags (``RouterArgs.add_cli_args``) at every start."""
    _inert_calls.append(True)
    try:
        yield
    finally:
        _inert_calls.pop()


class _Placeholder:
    """Stands in for any class, constant or function of a stubbed module."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item: str) -> "_Placeholder":
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        if _inert_calls:
            return _Placeholder(f"{self._name}()")
        raise RuntimeError(f"{self._name} is a stub of a GPU-serving module ({STUBBED[self._name.split('.')[0]]}); "
                           f"the host tests must not call it")

    def __mro_entries__(self, bases):  # `class X(stubbed.Base)` works
        return (object,)

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    """Make every ``STUBBED`` package importable as a stub (idempotent)."""
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
