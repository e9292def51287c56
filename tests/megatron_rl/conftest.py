"""Host tests against Megatron-LM's own RL loop (``train_rl.py``, ``megatron/rl``), on CPU over gloo.

They need Megatron-LM source trees, which CI cannot fetch (Megatron-LM is not on PyPI; the megatron-core wheel has no
``megatron/rl``): ``ci/megatron_rl_test`` extracts them from a clone (``MEGATRON_LM_GIT``) and names them in
``MEGATRON_LM_TREES`` (``name=path:name=path``). Without it every test here is skipped with that reason. The trees'
code runs here; none of it is copied into this repository.

Worker runs are shared between tests: :func:`worker_run` runs each configuration once per session.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

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


def pytest_generate_tests(metafunc):
    if "tree" in metafunc.fixturenames:
        names = sorted(TREES) or ["no-megatron-lm-tree"]
        metafunc.parametrize("tree", names, indirect=True)


@pytest.fixture(scope="session")
def tree(request) -> str:
    """The name of the Megatron-LM tree a test runs against (its path: ``TREES[name]``)."""
    return request.param


def pytest_collection_modifyitems(config, items):
    if TREES:
        return
    skip = pytest.mark.skip(reason=f"no Megatron-LM source tree (MEGATRON_LM_TREES is unset): {HOW}")
    for item in items:
        if "tests/megatron_rl" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


_RUNS: dict[tuple, object] = {}


@pytest.fixture(scope="session")
def worker_run(tmp_path_factory):
    """``worker_run(tree, layout, path="megatron", steps_per_collection=1, iterations=2, seed=1)`` -> a
    :class:`launch.WorkerRun`, run once per session per configuration."""
    import launch

    base = tmp_path_factory.mktemp("megatron-rl-runs")

    def run(tree: str, layout: str, *, path: str = "megatron", steps_per_collection: int = 1, iterations: int = 2,
            seed: int = 1):
        key = (tree, layout, path, steps_per_collection, iterations, seed)
        if key not in _RUNS:
            out = str(base / ("-".join(str(k) for k in key) + ".pt"))
            _RUNS[key] = launch.run_worker(TREES[tree], layout, out, path=path,
                                           steps_per_collection=steps_per_collection, iterations=iterations,
                                           seed=seed)
        return _RUNS[key]

    return run
