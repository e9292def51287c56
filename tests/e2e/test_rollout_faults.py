"""Faults fail the run with the original error within a bounded time -- never a hang.

* a rollout function that raises: the run fails with its exception while the train ranks are still starting
  (the driver waits on both at once);
* a train rank that raises while its peer waits in a collective: the run fails with that rank's exception, long
  before the process-group timeout (the driver fails fast on the first failed call and kills the group);
* a train rank that hangs: its peer's process group times out after ``dist_timeout_seconds`` and the run fails
  with that timeout;
* a train rank whose process dies: the run fails with Ray's actor-died error.

After each failure every actor is gone (all logical CPUs are free again).
"""

from __future__ import annotations

import time

import pytest
import ray

from rollout_harness import DEVICE, InjectedFault, config, free_cpus, ray_session, timer
from slime_ext.rollout.driver import run

pytestmark = [pytest.mark.e2e]

BASE = "e2e/dp2_dynamic_balanced"
#: a process-group timeout far above the bounds asserted below: a fast failure cannot come from it
SLOW_PG = 300


@pytest.fixture(scope="module")
def session():
    cfg = config(BASE)
    with ray_session(cfg):
        yield ray.cluster_resources()["CPU"]


def _assert_all_actors_gone(total_cpus: float) -> None:
    for _ in range(50):
        if free_cpus() == total_cpus:
            return
        time.sleep(0.1)
    assert free_cpus() == total_cpus, "actors of the failed run are still holding resources"


def test_rollout_function_raises(session):
    cfg = config(BASE, rollout_function_path="rollout_harness.raising_rollout", dist_timeout_seconds=SLOW_PG)
    with timer() as elapsed, pytest.raises(InjectedFault, match="injected rollout failure at rollout 0"):
        run(cfg, out=None)
    assert elapsed() < 30, f"the rollout failure took {elapsed():.1f}s to surface"
    _assert_all_actors_gone(session)


def test_train_rank_raises(session):
    cfg = config(BASE, train_worker_class="rollout_harness.RaisingTrainWorker", dist_timeout_seconds=SLOW_PG)
    lines: list[str] = []
    with timer() as elapsed, pytest.raises(InjectedFault, match="injected train failure on rank 1 at rollout 1"):
        run(cfg, out=lines.append)
    assert any(line.split()[:2] == ["0", "1"] for line in lines), "rollout 0 should have trained before the fault"
    assert elapsed() < 60 < SLOW_PG, f"the rank failure took {elapsed():.1f}s to surface"
    _assert_all_actors_gone(session)


def test_train_rank_hangs_and_peer_times_out(session):
    pg_timeout = 8
    cfg = config(BASE, train_worker_class="rollout_harness.HangingTrainWorker", dist_timeout_seconds=pg_timeout,
                 train_timeout_seconds=300)  # the driver's own timeout is not what ends this run
    if DEVICE == "cpu":  # gloo raises in the waiting rank
        expected = pytest.raises(RuntimeError, match=f"Timed out waiting {pg_timeout * 1000}ms")
    else:  # the NCCL watchdog aborts the waiting rank's process
        expected = pytest.raises((RuntimeError, ray.exceptions.RayActorError))
    with timer() as elapsed, expected:
        run(cfg, out=None)
    assert elapsed() < 60, f"the hang took {elapsed():.1f}s to fail the run"
    _assert_all_actors_gone(session)


def test_train_rank_process_dies(session):
    cfg = config(BASE, train_worker_class="rollout_harness.DyingTrainWorker", dist_timeout_seconds=SLOW_PG)
    with timer() as elapsed, pytest.raises(ray.exceptions.RayActorError):
        run(cfg, out=None)
    assert elapsed() < 60 < SLOW_PG, f"the dead rank took {elapsed():.1f}s to surface"
    _assert_all_actors_gone(session)
