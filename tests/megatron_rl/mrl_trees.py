"""The Megatron-LM source trees the host tests run against: ``MEGATRON_LM_TREES`` (``name=path:name=path``), which
``ci/megatron_rl_test`` sets after extracting them from ``MEGATRON_LM_GIT``."""

from __future__ import annotations

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
HOW = ("run ci/megatron_rl_test with MEGATRON_LM_GIT=/path/to/Megatron-LM[.git] (it extracts core_v0.19.0, HEAD and "
       "core_v0.16.1 and sets MEGATRON_LM_TREES)")


def megatron_lm_trees() -> dict[str, str]:
    """``{name: path}`` from ``MEGATRON_LM_TREES``; a path that is not a Megatron-LM tree is an error, not a skip."""
    spec = os.environ.get("MEGATRON_LM_TREES", "").strip()
    trees = {}
    for entry in filter(None, spec.split(os.pathsep)):
        name, sep, path = entry.partition("=")
        if not sep or not os.path.isfile(os.path.join(path, "train_rl.py")):
            raise pytest.UsageError(f"MEGATRON_LM_TREES entry {entry!r}: expected name=path to a Megatron-LM tree "
                                    f"with train_rl.py ({HOW})")
        trees[name] = path
    return trees


def tree_version(path: str) -> str:
    """``MAJOR.MINOR.PATCH`` of the tree's ``megatron/core/package_info.py``, read without importing it."""
    import re

    with open(os.path.join(path, "megatron", "core", "package_info.py")) as f:
        text = f.read()
    return ".".join(re.search(rf"^{k}\s*=\s*(\d+)", text, re.M).group(1) for k in ("MAJOR", "MINOR", "PATCH"))


TREES = megatron_lm_trees()
