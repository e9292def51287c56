"""Upstream slime's own code, loaded at run time: from an installed slime, or from a git clone of it (``SLIME_GIT``).

Nothing of upstream is kept in this repository. Where slime-ext compares itself with upstream (the ``reference``
scheme of ``slime-ext plan --compare`` and ``python -m bench.run``, the tests that check a building block against
upstream's), it imports upstream's modules here:

1. an installed slime (``import slime.utils.dp_schedule`` works): that one;
2. else ``SLIME_GIT`` names a slime git dir (bare or not): the few pure-Python files needed are extracted with
   ``git archive`` from ``SLIME_REV`` (default ``HEAD``) into a cache folder and imported without touching
   ``sys.modules['slime']`` for anyone else;
3. else :class:`UpstreamUnavailable`, whose message says how to get it (:data:`HOW`).

The host tests (``tests/hosts``) extract whole slime trees with :func:`extract` too.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

#: how to make upstream available, for every message that needs it
HOW = ("install slime (pip install -e a clone of github.com/THUDM/slime), or set SLIME_GIT to a git clone of "
       "github.com/THUDM/slime (e.g. SLIME_GIT=/path/to/slime/.git; SLIME_REV picks the revision, default HEAD)")
#: the upstream modules the reference scheme needs; all pure Python (stdlib only)
MODULES = ("slime.utils.dp_schedule", "slime.utils.seqlen_balancing", "slime.utils.flops_utils")
_FILES = ("slime/__init__.py", "slime/utils/__init__.py") + tuple(m.replace(".", "/") + ".py" for m in MODULES)
_loaded: dict[tuple, SimpleNamespace] = {}


class UpstreamUnavailable(RuntimeError):
    """Upstream slime is neither installed nor reachable through ``SLIME_GIT``; the message says how to get it."""


def git_dir(var: str = "SLIME_GIT") -> str | None:
    """The git dir named by the environment variable ``var`` (a work tree's ``.git`` is found), or ``None``."""
    path = os.environ.get(var)
    if not path:
        return None
    p = Path(path)
    return str(p / ".git") if (p / ".git").is_dir() else str(p)


def extract(git_dir: str, rev: str, dest: Path, *paths: str) -> Path:
    """``git archive rev [paths]`` unpacked into ``dest`` once (a ``.complete`` marker records it); returns ``dest``.

    Processes sharing ``dest`` (pytest-xdist workers, training ranks) take turns on a lock file beside it: one
    extracts, the others wait and find it complete; a tree a killed process left half-extracted is redone."""
    if (dest / ".complete").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (dest / ".complete").exists():
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", rev, *paths], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
            (dest / ".complete").write_text(rev)
    return dest


def _cache_root() -> Path:
    return Path(os.environ.get("SLIME_EXT_HOST_CACHE", Path(tempfile.gettempdir()) / "slime-ext-upstream"))


def _import_from(root: Path) -> dict[str, ModuleType]:
    """Import :data:`MODULES` from the tree at ``root`` and leave ``sys.modules`` / ``sys.path`` as they were."""
    saved = {k: v for k, v in sys.modules.items() if k == "slime" or k.startswith("slime.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    try:
        return {m: importlib.import_module(m) for m in MODULES}
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k == "slime" or k.startswith("slime.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def load() -> SimpleNamespace:
    """Upstream's modules as ``SimpleNamespace(dp_schedule, seqlen_balancing, flops_utils, source)``.

    ``source`` says where they came from (the installed package's path, or ``git-dir@commit``). Raises
    :class:`UpstreamUnavailable` when there is no slime to load, or the revision has no ``dp_schedule.py``
    (slime before v0.3.0).
    """
    try:
        installed = importlib.util.find_spec(MODULES[0]) is not None
    except (ImportError, ValueError):
        installed = False
    if installed:
        key: tuple = ("installed",)
        if key not in _loaded:
            mods = {m: importlib.import_module(m) for m in MODULES}
            _loaded[key] = _namespace(mods, str(Path(mods[MODULES[0]].__file__).parent.parent))
        return _loaded[key]
    repo = git_dir()
    if repo is None:
        raise UpstreamUnavailable(f"upstream slime is not available: {HOW}")
    rev = os.environ.get("SLIME_REV", "HEAD")
    try:
        commit = subprocess.run(["git", f"--git-dir={repo}", "rev-parse", f"{rev}^{{commit}}"], check=True,
                                capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        raise UpstreamUnavailable(f"SLIME_GIT={repo!r}, SLIME_REV={rev!r}: not a slime git dir with that revision "
                                  f"({str(detail).strip()}); {HOW}") from None
    key = ("git", repo, commit)
    if key not in _loaded:
        try:
            root = extract(repo, commit, _cache_root() / f"slime-{commit[:12]}", *_FILES)
        except subprocess.CalledProcessError as exc:
            raise UpstreamUnavailable(f"SLIME_GIT={repo!r} at {rev} ({commit[:10]}) lacks {', '.join(_FILES)} "
                                      f"({exc.stderr.decode(errors='replace').strip()}); the reference scheme needs "
                                      f"slime v0.3.0 or later: set SLIME_REV") from None
        _loaded[key] = _namespace(_import_from(root), f"{repo}@{commit[:10]}")
    return _loaded[key]


def _namespace(mods: dict[str, ModuleType], source: str) -> SimpleNamespace:
    return SimpleNamespace(**{m.rsplit(".", 1)[1]: mod for m, mod in mods.items()}, source=source)
