"""Shared pieces of the Ray-level e2e tests: configs, one Ray session per module, fault-injecting workers.

The fault injectors are importable by dotted path (``rollout_harness.RaisingTrainWorker``) in the Ray worker
processes because :func:`ray_session` puts this directory on their ``PYTHONPATH``.

``SLIME_EXT_DEVICE=cuda`` runs the same tests on NCCL + CUDA (on a GPU machine that has Ray and pytest; the offline
``ci/gpu_all`` runs ``tests/e2e/gpu_e2e.py`` instead); a config that needs more GPUs than the machine has is skipped with
the reason.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from slime_ext.rollout.config import DEVICE_ENV, ConfigError, RunConfig, load_run_config
from slime_ext.training.worker import TrainWorker

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIGS = REPO / "configs"
DEVICE = os.environ.get(DEVICE_ENV, "cpu")


def config(name: str, **overrides) -> RunConfig:
    """``configs/<name>.yaml`` (``e2e/...`` for the e2e ones), validated; skips when the GPUs are too few."""
    try:
        return load_run_config(CONFIGS / f"{name}.yaml", **overrides)
    except ConfigError as exc:
        if DEVICE == "cuda" and any("needs one GPU per train process" in p for p in exc.problems):
            pytest.skip(f"{name}: {exc.problems[0]}")
        raise


@contextmanager
def ray_session(cfg: RunConfig):
    """One Ray for a test module, started the way the harness starts it, always shut down."""
    import ray

    from slime_ext.rollout.driver import start_ray

    started = start_ray(cfg, extra_pythonpath=[str(HERE)])
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def free_cpus() -> float:
    import ray

    return ray.available_resources().get("CPU", 0.0)


# ---------------------------------------------------------------------------------------------------- fault injection
class InjectedFault(RuntimeError):
    pass


def raising_rollout(args, rollout_id, data_source=None, evaluation=False):
    """A rollout function that fails on its first call."""
    raise InjectedFault(f"injected rollout failure at rollout {rollout_id}")


class RaisingTrainWorker(TrainWorker):
    """Rank 1 raises on rollout 1, before any collective: its peers are left waiting in one."""

    def train_rollout(self, rollout_data):
        if self.rank == 1 and rollout_data.rollout_id == 1:
            raise InjectedFault("injected train failure on rank 1 at rollout 1")
        return super().train_rollout(rollout_data)


class HangingTrainWorker(TrainWorker):
    """Rank 1 stops responding on rollout 1: only the process-group timeout of its peers ends the wait."""

    def train_rollout(self, rollout_data):
        if self.rank == 1 and rollout_data.rollout_id == 1:
            time.sleep(3600)
        return super().train_rollout(rollout_data)


class FaultyPeer:
    """A Ray actor (``ray.remote(num_cpus=0)(FaultyPeer)``) standing in for a train rank: ``run`` first waits until
    every call in ``after`` (a list of ObjectRefs, unresolved) has finished, so the test orders events without
    sleeping, then ``"raise"`` like a peer whose collective lost its partner, ``"die"`` like a crashed process,
    ``"ok"`` returns, ``"hang"`` never returns."""

    def run(self, mode: str, after: list = ()) -> str:
        import threading

        import ray

        if after:
            ray.wait(list(after), num_returns=len(after), timeout=None)
        if mode == "raise":
            raise RuntimeError("gloo: Connection reset by peer (injected)")
        if mode == "die":
            os._exit(17)
        if mode == "hang":
            threading.Event().wait()
        return mode


class NeverReadyTrainWorker(TrainWorker):
    """A train rank whose set-up never finishes: a run can only end by another failure (or its set-up timeout)."""

    def setup(self):
        import threading

        threading.Event().wait()


class DyingTrainWorker(TrainWorker):
    """Rank 1's process exits on rollout 1 (a crash: no exception, no clean-up)."""

    def train_rollout(self, rollout_data):
        if self.rank == 1 and rollout_data.rollout_id == 1:
            os._exit(17)
        return super().train_rollout(rollout_data)
