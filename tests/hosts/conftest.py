"""Host tests: slime-ext inside real slime revisions, extracted from a git clone of github.com/THUDM/slime.

    SLIME_GIT=/path/to/slime/.git MEGATRON_LM_GIT=/path/to/Megatron-LM/.git ci/host_test

``SLIME_GIT`` is a slime git dir (bare or not); each supported tag is extracted with ``git archive``
(:func:`slime_ext.schemes.upstream.extract`, as the reference scheme extracts upstream's planner).
``MEGATRON_LM_GIT`` (optional) is a Megatron-LM git dir: the commit each slime tag pins (``MEGATRON_COMMIT`` in its
``docker/Dockerfile``) is extracted and put first on the path, as slime's image does; without it the tests that
need ``megatron.training`` skip. Nothing is stubbed but the GPU-serving modules in ``gpu_stubs.STUBBED``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from slime_ext.schemes import upstream  # the one git-archive extraction (the reference scheme uses it too)

#: the slime revisions slime-ext supports, by tag (HEAD: the newest commit of the clone)
TAGS = ("v0.2.4", "v0.3.0", "v0.3.1", "HEAD")
HOW = ("set SLIME_GIT to a git clone of github.com/THUDM/slime (and MEGATRON_LM_GIT to one of "
       "github.com/NVIDIA/Megatron-LM), then run ci/host_test")
CACHE = Path(os.environ.get("SLIME_EXT_HOST_CACHE", Path(__file__).resolve().parents[2] / ".host-trees"))


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture(scope="session")
def slime_git() -> str:
    git_dir = upstream.git_dir("SLIME_GIT")
    if git_dir is None:
        pytest.skip(f"no slime checkout: {HOW}")
    return git_dir


def slime_tree(git_dir: str, tag: str) -> Path:
    commit = _git(git_dir, "rev-parse", f"{tag}^{{commit}}").strip()
    return upstream.extract(git_dir, commit, CACHE / f"slime-{tag}-{commit[:10]}")


def megatron_tree(slime_root: Path) -> Path | None:
    """The Megatron-LM source slime's image pins for this tag, or ``None`` without ``MEGATRON_LM_GIT``."""
    git_dir = upstream.git_dir("MEGATRON_LM_GIT")
    if git_dir is None:
        return None
    dockerfile = (slime_root / "docker" / "Dockerfile").read_text()
    found = re.search(r"MEGATRON_COMMIT=([0-9a-f]{7,40})", dockerfile)
    if not found:
        pytest.fail(f"{slime_root}/docker/Dockerfile pins no MEGATRON_COMMIT")
    commit = found.group(1)
    return upstream.extract(git_dir, commit, CACHE / f"megatron-{commit[:10]}", "megatron")


@pytest.fixture(scope="session", params=TAGS)
def slime_env(request, slime_git) -> dict:
    """``{"tag", "root", "megatron", "env"}``: a slime tag's tree and the environment to run it with."""
    root = slime_tree(slime_git, request.param)
    megatron = megatron_tree(root)
    repo = Path(__file__).resolve().parents[2]
    path = [str(root)] + ([str(megatron)] if megatron else []) + [str(repo)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    return {"tag": request.param, "root": root, "megatron": megatron, "env": env}
