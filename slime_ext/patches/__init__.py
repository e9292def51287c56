"""The only place where slime-ext changes third-party code.

Every change is a :class:`Patch`: one attribute of one module (or class) replaced by a function of the original.
A patch

* names its target (``module``, ``attribute`` -- ``"Class.method"`` for methods),
* names the distribution it was written against, the version range it supports and the versions it was tested
  with, and refuses (``PatchError``) to apply outside that range or when the target is missing or not what it
  expected (``expect`` is a check on the original object, e.g. that its source still holds the call we work
  around),
* judges the code that is actually imported: the version comes from the imported module when it carries one
  (``version``, e.g. ``megatron.core.package_info``), so a source checkout on ``PYTHONPATH`` whose installed
  metadata says something else (or nothing) is judged by what it is; source checks (``expect``) and attribute
  presence do the rest,
* may be needed only by some versions of its target (``needed``, e.g. a call that appeared in megatron-core 0.19):
  where it is not needed it is *skipped* -- reported, not applied, not an error,
* applies idempotently (applying twice is a no-op) and undoes exactly (the original object is restored; undo
  refuses if someone else replaced the attribute in the meantime, since restoring would drop their change).

A :class:`PatchSet` groups patches that belong together; it applies all or nothing.

Modules:

* :mod:`slime_ext.patches.megatron_cpu` -- what megatron-core 0.16 to 0.19 needs to train on a CPU-only host with
  gloo;
* :mod:`slime_ext.patches.slime_host` -- where slime-ext's schedule enters slime (github.com/THUDM/slime), by
  revision; applied by :mod:`slime_ext.integrations.slime`;
* :mod:`slime_ext.patches.verl_host` -- where slime-ext enters verl's Megatron engine and V1 trainer
  (github.com/verl-project/verl), by version; applied by :mod:`slime_ext.integrations.verl`;
* :mod:`slime_ext.patches.megatron_rl` -- where slime-ext enters Megatron-LM's RL loop; applied by
  :mod:`slime_ext.integrations.megatron_rl`;
* :mod:`slime_ext.patches.nemo_rl_host` -- where slime-ext enters NeMo-RL's driver-side sharding (and, by
  default under pipeline parallelism, its Megatron worker's packing), by version; applied by
  :mod:`slime_ext.integrations.nemo_rl`;
* :mod:`slime_ext.patches.on_import` -- the one import hook that applies a host's patches the moment the target
  module is imported (slime's and verl's integrations use it).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["ImportedVersion", "Patch", "PatchError", "PatchSet", "imported_version", "in_context", "installed_version",
           "source_contains"]


class PatchError(RuntimeError):
    """A patch cannot be applied or undone; the message names the target, the versions and the fix."""


def installed_version(distribution: str) -> str:
    """Installed version of ``distribution`` (e.g. ``"megatron-core"``); ``PatchError`` if it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise PatchError(f"{distribution} is not installed; install it (see pyproject.toml extras)") from exc


@dataclass(frozen=True)
class ImportedVersion:
    """A version read from imported code, with where it was read (for error messages)."""

    version: str
    origin: str

    def __str__(self) -> str:
        return self.version


def imported_version(module: str, attribute: str, distribution: str) -> ImportedVersion:
    """The version the *imported* ``module`` declares in ``attribute`` (e.g. ``megatron.core.package_info``,
    ``__version__``), rather than what pip's metadata says: the two differ when a source checkout sits on
    ``PYTHONPATH`` in front of (or without) an installed ``distribution``. The origin names the module's file and,
    when they differ, the installed distribution's version. ``PatchError`` if the module cannot be imported or has
    no such attribute."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise PatchError(f"cannot import {module} to read the {distribution} version ({exc}); install "
                         f"{distribution} (see pyproject.toml extras) or put its source tree on PYTHONPATH") from exc
    version = getattr(mod, attribute, None)
    if not isinstance(version, str):
        raise PatchError(f"{module} ({getattr(mod, '__file__', '?')}) has no string {attribute}; it is not the "
                         f"{distribution} the patches were written for")
    origin = f"{module}.{attribute} in {getattr(mod, '__file__', '?')}"
    try:
        meta = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        meta = None
    if meta is None:
        origin += f"; no {distribution} distribution is installed (a source tree)"
    elif meta != version:
        origin += f"; the installed {distribution} distribution says {meta}, the imported code wins"
    return ImportedVersion(version, origin)


def source_contains(*needles: str) -> Callable[[Any], str | None]:
    """An ``expect`` check: the original's source code must contain every ``needle``.

    Guards patches that work around one specific call inside a function: if upstream rewrites the function, the
    patch fails loudly instead of silently wrapping code it was not written for.
    """

    def check(original: Any) -> str | None:
        try:
            src = inspect.getsource(original)
        except (OSError, TypeError) as exc:
            return f"cannot read its source ({exc})"
        missing = [n for n in needles if n not in src]
        return f"its source no longer contains {missing}" if missing else None

    return check


def parameters_are(expected: tuple[str, ...]) -> Callable[[Any], str | None]:
    """An ``expect`` check: the original's parameters must be ``expected``, in order (the replacement takes those).

    Compose with :func:`source_contains` as ``parameters_are(p)(original) or source_contains(...)(original)``.
    """

    def check(original: Any) -> str | None:
        try:
            params = tuple(inspect.signature(original).parameters)
        except (TypeError, ValueError) as exc:
            return f"cannot read its signature ({exc})"
        return None if params == tuple(expected) else f"its parameters are {params}, the replacement takes {expected}"

    return check


def in_context(var: contextvars.ContextVar, value_of: Callable[[Any], Any]) -> Callable[[Callable], Callable]:
    """``make`` of a method patch that sets ``var`` to ``value_of(self)`` while the original runs (and resets it
    after); where ``value_of`` gives ``None`` the original runs with ``var`` untouched."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def method(self, *args, **kwargs):
            value = value_of(self)
            if value is None:
                return original(self, *args, **kwargs)
            token = var.set(value)
            try:
                return original(self, *args, **kwargs)
            finally:
                var.reset(token)

        return method

    return make


def _resolve(module: str, attribute: str) -> tuple[Any, str]:
    """``(owner object, last attribute name)`` for ``module`` + dotted ``attribute``."""
    try:
        owner: Any = importlib.import_module(module)
    except ImportError as exc:
        raise PatchError(f"cannot import {module} ({exc})") from exc
    *path, name = attribute.split(".")
    for part in path:
        if not hasattr(owner, part):
            raise PatchError(f"{module} has no attribute {'.'.join(path)}")
        owner = getattr(owner, part)
    return owner, name


@dataclass(eq=False)
class Patch:
    """Replace ``module.attribute`` by ``make(original)``.

    ``distribution``/``supported``/``tested``: the package whose code is patched, the version range the patch
    accepts (a PEP 440 specifier such as ``">=0.16.0rc0,<0.20"``; write ``rc0`` in the lower bound to accept that
    release's dev builds) and the exact versions it was tested with. ``version`` reads the version to check when
    it is not the installed distribution's (e.g. :func:`imported_version`, or a marker attribute of the target
    module). ``expect(original)`` returns ``None`` when the original is what the patch was written for, else a
    reason. ``needed()`` returns ``None`` when the imported code needs the patch, else why not; a patch that is not
    needed is skipped (``skipped`` holds the reason). It is asked after the version check and before the target
    checks (a target that only newer versions have may be absent).
    """

    name: str
    module: str
    attribute: str
    make: Callable[[Any], Any]
    distribution: str
    supported: str
    tested: tuple[str, ...]
    doc: str = ""
    expect: Callable[[Any], str | None] | None = None
    version: Callable[[], str | ImportedVersion] | None = None
    needed: Callable[[], str | None] | None = None
    _original: Any = field(default=None, init=False, repr=False)
    _replacement: Any = field(default=None, init=False, repr=False)
    _applied: bool = field(default=False, init=False, repr=False)
    _skipped: str | None = field(default=None, init=False, repr=False)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"

    @property
    def applied(self) -> bool:
        return self._applied

    @property
    def skipped(self) -> str | None:
        """Why the last apply skipped this patch (not needed by the imported code); ``None`` if it did not."""
        return self._skipped

    @property
    def original(self) -> Any:
        """The object the patch replaced (``None`` while not applied)."""
        return self._original

    def check(self) -> str | None:
        """Raise ``PatchError`` unless the version is supported and the target is what we expect.

        Returns ``None`` when the patch is to be applied, or the reason it is not needed (then the target is not
        checked)."""
        found = self.version() if self.version is not None else installed_version(self.distribution)
        version = str(found)
        # "is imported (read from ...)" when the version was read from the imported code, else "is installed"
        where = f"imported ({found.origin})" if isinstance(found, ImportedVersion) else "installed"
        try:
            parsed = Version(version)
        except InvalidVersion:
            raise PatchError(f"patch {self.name!r} ({self.target}): {self.distribution} version {version!r} (as "
                             f"{where}) is not a version number; the patch supports "
                             f"{self.distribution}{self.supported}") from None
        # prereleases=True: a range written with an rc0 lower bound takes that release's dev builds, and one
        # without (">=1.0,<2") must still refuse 2.0.0rc1, which it does by its bounds alone
        if not SpecifierSet(self.supported).contains(parsed, prereleases=True):
            raise PatchError(
                f"patch {self.name!r} ({self.target}) supports {self.distribution}{self.supported} "
                f"(tested: {', '.join(self.tested)}) but {version} is {where}; install a supported "
                f"{self.distribution} or re-check the patch against {version} and widen its range"
            )
        if self.needed is not None and not self._applied:
            reason = self.needed()
            if reason:
                return reason
        owner, attr = _resolve(self.module, self.attribute)
        if not hasattr(owner, attr):
            raise PatchError(
                f"patch {self.name!r}: {self.target} does not exist in {self.distribution} {version}; "
                f"the patch was written for {', '.join(self.tested)}"
            )
        if self.expect is not None and not self._applied:
            reason = self.expect(getattr(owner, attr))
            if reason:
                raise PatchError(
                    f"patch {self.name!r}: {self.target} in {self.distribution} {version} is not what the patch "
                    f"was written for: {reason}; re-check the patch against {version}"
                )
        return None

    def apply(self) -> None:
        """Check, then replace the target. A second call is a no-op."""
        if self._applied:
            return
        self._skipped = self.check()
        if self._skipped:
            return
        owner, attr = _resolve(self.module, self.attribute)
        original = inspect.getattr_static(owner, attr) if inspect.isclass(owner) else getattr(owner, attr)
        bound = getattr(owner, attr)
        replacement = self.make(bound)
        if isinstance(original, staticmethod):
            replacement = staticmethod(replacement)
        elif isinstance(original, classmethod):
            replacement = classmethod(replacement)
        setattr(owner, attr, replacement)
        self._original, self._replacement, self._applied = original, replacement, True

    def undo(self) -> None:
        """Restore the original. A call while not applied is a no-op."""
        if not self._applied:
            self._skipped = None
            return
        owner, attr = _resolve(self.module, self.attribute)
        current = inspect.getattr_static(owner, attr) if inspect.isclass(owner) else getattr(owner, attr)
        if current is not self._replacement:
            raise PatchError(
                f"patch {self.name!r}: {self.target} was replaced by someone else after this patch was applied; "
                f"undo their change first (restoring now would drop it)"
            )
        setattr(owner, attr, self._original)
        self._original, self._replacement, self._applied = None, None, False


@dataclass(eq=False)
class PatchSet:
    """Patches applied and undone together: all or nothing, undone in reverse order."""

    name: str
    patches: list[Patch]

    @property
    def applied(self) -> bool:
        """Every patch is applied or was skipped as not needed (and at least one is applied)."""
        return any(p.applied for p in self.patches) and all(p.applied or p.skipped for p in self.patches)

    def check(self) -> None:
        for p in self.patches:
            p.check()

    def apply(self) -> None:
        self.check()  # fail before touching anything
        done: list[Patch] = []
        try:
            for p in self.patches:
                p.apply()
                done.append(p)
        except BaseException:
            for p in reversed(done):
                p.undo()
            raise

    def undo(self) -> None:
        for p in reversed(self.patches):
            p.undo()

    def __iter__(self) -> Iterable[Patch]:
        return iter(self.patches)

    def describe(self) -> str:
        """One line per patch: target, supported range, tested versions, first line of its doc; a skipped patch
        says why."""
        lines = []
        for p in self.patches:
            first = (p.doc.strip().splitlines() or [""])[0]
            skipped = f" -- skipped: {p.skipped}" if p.skipped else ""
            lines.append(f"{p.name}: {p.target} [{p.distribution}{p.supported}; tested {', '.join(p.tested)}] "
                         f"{first}{skipped}")
        return "\n".join(lines)
