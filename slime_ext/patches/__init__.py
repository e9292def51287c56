"""The only place where slime-ext changes third-party code.

Every change is a :class:`Patch`: one attribute of one module (or class) replaced by a function of the original.
A patch

* names its target (``module``, ``attribute`` -- ``"Class.method"`` for methods),
* names the distribution it was written against, the version range it supports and the versions it was tested
  with, and refuses (``PatchError``) to apply outside that range or when the target is missing or not what it
  expected (``expect`` is a check on the original object, e.g. that its source still holds the call we work
  around),
* applies idempotently (applying twice is a no-op) and undoes exactly (the original object is restored; undo
  refuses if someone else replaced the attribute in the meantime, since restoring would drop their change).

A :class:`PatchSet` groups patches that belong together; it applies all or nothing.

Modules:

* :mod:`slime_ext.patches.megatron_cpu` -- what megatron-core 0.16 needs to train on a CPU-only host with gloo.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = ["Patch", "PatchError", "PatchSet", "installed_version", "source_contains"]


class PatchError(RuntimeError):
    """A patch cannot be applied or undone; the message names the target, the versions and the fix."""


def installed_version(distribution: str) -> str:
    """Installed version of ``distribution`` (e.g. ``"megatron-core"``); ``PatchError`` if it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise PatchError(f"{distribution} is not installed; install it (see pyproject.toml extras)") from exc


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
    accepts (a PEP 440 specifier such as ``">=0.16,<0.17"``) and the exact versions it was tested with.
    ``version`` reads the version to check when it is not an installed distribution's (e.g. a marker attribute
    of the target module). ``expect(original)`` returns ``None`` when the original is what the patch was written
    for, else a reason.
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
    version: Callable[[], str] | None = None
    _original: Any = field(default=None, init=False, repr=False)
    _replacement: Any = field(default=None, init=False, repr=False)
    _applied: bool = field(default=False, init=False, repr=False)

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attribute}"

    @property
    def applied(self) -> bool:
        return self._applied

    @property
    def original(self) -> Any:
        """The object the patch replaced (``None`` while not applied)."""
        return self._original

    def check(self) -> None:
        """Raise ``PatchError`` unless the installed version is supported and the target is what we expect."""
        version = str(self.version() if self.version is not None else installed_version(self.distribution))
        try:
            parsed = Version(version)
        except InvalidVersion:
            raise PatchError(f"patch {self.name!r} ({self.target}): {self.distribution} version {version!r} is not "
                             f"a version number; the patch supports {self.distribution}{self.supported}") from None
        if parsed not in SpecifierSet(self.supported):
            raise PatchError(
                f"patch {self.name!r} ({self.target}) supports {self.distribution}{self.supported} "
                f"(tested: {', '.join(self.tested)}) but {version} is installed; install a supported "
                f"{self.distribution} or re-check the patch against {version} and widen its range"
            )
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

    def apply(self) -> None:
        """Check, then replace the target. A second call is a no-op."""
        if self._applied:
            return
        self.check()
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
        return all(p.applied for p in self.patches)

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
        """One line per patch: target, supported range, tested versions, first line of its doc."""
        lines = []
        for p in self.patches:
            first = (p.doc.strip().splitlines() or [""])[0]
            lines.append(f"{p.name}: {p.target} [{p.distribution}{p.supported}; tested {', '.join(p.tested)}] {first}")
        return "\n".join(lines)
