"""Host tests against Megatron-LM's own RL loop (``train_rl.py``, ``megatron/rl``), on CPU over gloo.

They need Megatron-LM source trees, which CI cannot fetch (Megatron-LM is not on PyPI; the megatron-core wheel has no
``megatron/rl``): ``ci/megatron_rl_test`` extracts them from a clone (``MEGATRON_LM_GIT``) and names them in
``MEGATRON_LM_TREES`` (``name=path:name=path``). Without it every test here is skipped with that reason. The trees'
code runs here; none of it is copied into this repository.

Worker runs are shared between tests: :func:`worker_run` runs each configuration once per session. With
``SLIME_EXT_MRL_RESULTS=DIR`` the result files (``<tree>-<layout>-<path>-<steps per collection>-<iterations>-<seed>
.pt``) and the ranks' logs stay in ``DIR``; ``python tests/megatron_rl/mrl_results.py DIR/*.pt`` summarises them.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the mrl_* helpers (their names are prefixed: all test folders share one sys.path)
    sys.path.insert(0, HERE)

from mrl_trees import HOW, TREES  # noqa: E402


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
    :class:`mrl_launch.WorkerRun`, run once per session per configuration."""
    import mrl_launch

    keep = os.environ.get("SLIME_EXT_MRL_RESULTS")  # a folder to keep the result files in (else a tmp folder)
    base = os.path.abspath(keep) if keep else str(tmp_path_factory.mktemp("megatron-rl-runs"))
    os.makedirs(base, exist_ok=True)

    def run(tree: str, layout: str, *, path: str = "megatron", steps_per_collection: int = 1, iterations: int = 2,
            seed: int = 1, extra: tuple[str, ...] = ()):
        key = (tree, layout, path, steps_per_collection, iterations, seed, *extra)
        if key not in _RUNS:
            out = os.path.join(base, "-".join(str(k) for k in key) + ".pt")
            _RUNS[key] = mrl_launch.run_worker(TREES[tree], layout, out, path=path,
                                           steps_per_collection=steps_per_collection, iterations=iterations,
                                           seed=seed, extra=tuple(extra))
        return _RUNS[key]

    return run
