"""Host tests against NeMo-RL's own code (github.com/NVIDIA-NeMo/RL), on CPU.

They need a NeMo-RL source tree, which CI cannot fetch: ``ci/nemo_rl_test`` extracts one from a clone
(``NEMO_RL_GIT``) and names it in ``NEMO_RL_TREE``. Without it every test here is skipped with that reason. The
tree's code runs here; none of it is copied into this repository.

Stubbed, and why (:mod:`nemo_rl_stubs`): the experiment-logger backends ``mlflow``, ``wandb`` and ``swanlab`` (imported
by ``nemo_rl.utils.logger`` at import time, never called by sharding), and Megatron-Bridge's
``packed_seq_utils.get_packed_seq_cp_partition_indices`` (``nemo_rl.models.megatron.data`` imports it at import
time; Megatron-Bridge's package pulls in transformer-engine, which has no CPU wheel; the function is used only with
context parallelism, which these tests do not run: the stub raises if called), and the Megatron-Bridge config and
state classes ``nemo_rl.models.megatron.train`` imports for its type annotations (``ModelProviderMixin``,
``ConfigContainer``, ``GlobalState``: empty classes; the forward-backward path does not use them).
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.environ.get("NEMO_RL_TREE", "")
HOW = ("run NEMO_RL_GIT=/path/to/RL[.git] ci/nemo_rl_test, which extracts NeMo-RL's HEAD and runs these tests in "
       "their own Python 3.13 venv")


if HERE not in sys.path:  # the nemo_rl_* helpers (their names are prefixed: all test folders share one sys.path)
    sys.path.insert(0, HERE)


def pytest_configure(config):
    if TREE:
        if TREE not in sys.path:
            sys.path.insert(0, TREE)
        os.environ.setdefault("NO_VCS_VERSION", "1")
        import nemo_rl_stubs

        nemo_rl_stubs.install()


def pytest_collection_modifyitems(config, items):
    if TREE:
        return
    skip = pytest.mark.skip(reason=f"no NeMo-RL source tree (NEMO_RL_TREE is unset): {HOW}")
    for item in items:
        if "tests/nemo_rl" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
