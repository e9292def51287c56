"""Faults fail the run with the original error within a bounded time -- never a hang.

* a rollout function that raises: the run fails with its exception while the train ranks are still starting
  (the driver waits on both at once);
* a train rank that raises while its peer waits in a collective: the run fails with that rank's exception, long
  before the process-group timeout (the driver fails fast on the first failed call and kills the group);
* a train rank that hangs: its peer's process group times out after ``dist_timeout_seconds`` and the run fails
  with that timeout;
* a train rank whose process dies: the run fails with Ray's actor-died error.

After each failure every actor is gone (all logical CPUs are free again). The train-side faults strike on rollout 1;
their bounds run from the moment rollout 0's last step row was printed, so the time the actors took to start (import
torch and megatron-core, slow on a loaded machine) is not counted against them.
"""

from __future__ import annotations

import time

import pytest
import ray

from rollout_harness import DEVICE, FaultyPeer, InjectedFault, config, free_cpus, ray_session, timer
from slime_ext.rollout.driver import DEAD_PEER_GRACE_S, gather, run

pytestmark = [pytest.mark.e2e]

BASE = "e2e/dp2_dynamic_balanced"
#: a process-group timeout far above the bounds asserted below: a fast failure cannot come from it
SLOW_PG = 300
#: seconds from the end of rollout 0 to the failed run: rollout 1 is generated, planned and sent, then fails
SURFACE_S = 30


class Rows:
    """The driver's printed lines, each with when it was printed; ``since_rollout0()`` is the seconds since rollout
    0's last step row (asserting that rollout 0 trained before the fault)."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def __call__(self, line: str) -> None:
        self.lines.append((time.monotonic(), line))

    def since_rollout0(self) -> float:
        stamps = [t for t, line in self.lines if line.split()[:1] == ["0"]]
        assert stamps, "rollout 0 should have trained before the fault"
        return time.monotonic() - max(stamps)


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
    rows = Rows()
    with pytest.raises(InjectedFault, match="injected train failure on rank 1 at rollout 1"):
        run(cfg, out=rows)
    assert any(line.split()[:2] == ["0", "1"] for _, line in rows.lines), "rollout 0's steps should have trained"
    took = rows.since_rollout0()
    assert took < SURFACE_S < SLOW_PG, f"the rank failure took {took:.1f}s after rollout 0 to surface"
    _assert_all_actors_gone(session)


def test_train_rank_hangs_and_peer_times_out(session):
    pg_timeout = 8
    cfg = config(BASE, train_worker_class="rollout_harness.HangingTrainWorker", dist_timeout_seconds=pg_timeout,
                 train_timeout_seconds=300)  # the driver's own timeout is not what ends this run
    if DEVICE == "cpu":  # gloo raises in the waiting rank
        expected = pytest.raises(RuntimeError, match=f"Timed out waiting {pg_timeout * 1000}ms")
    else:  # the NCCL watchdog aborts the waiting rank's process
        expected = pytest.raises((RuntimeError, ray.exceptions.RayActorError))
    rows = Rows()
    with expected:
        run(cfg, out=rows)
    took = rows.since_rollout0()
    assert took < pg_timeout + SURFACE_S, f"the hang took {took:.1f}s after rollout 0 to fail the run"
    _assert_all_actors_gone(session)


def test_train_rank_process_dies(session):
    cfg = config(BASE, train_worker_class="rollout_harness.DyingTrainWorker", dist_timeout_seconds=SLOW_PG)
    rows = Rows()
    with pytest.raises(ray.exceptions.RayActorError):
        run(cfg, out=rows)
    took = rows.since_rollout0()
    assert took < SURFACE_S < SLOW_PG, f"the dead rank took {took:.1f}s after rollout 0 to surface"
    _assert_all_actors_gone(session)


@pytest.mark.parametrize("second, raised", [("die", ray.exceptions.RayActorError), ("ok", RuntimeError),
                                            ("raise", RuntimeError)])
def test_a_dead_process_is_raised_over_its_peers_symptom(session, second, raised):
    """A peer's collective error that arrives first gives way to the process death behind it (``gather``'s grace);
    without a death, the first error is raised as it is, within the grace."""
    peers = [ray.remote(num_cpus=0)(FaultyPeer).remote() for _ in range(2)]
    calls = [("rank 0", peers[0].run.remote("raise", 0.0)), ("rank 1", peers[1].run.remote(second, 0.5))]
    with timer() as elapsed, pytest.raises(raised) as info:
        gather(calls, timeout=60, what="rollout 1")
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if second == "die":
        assert "raised by rank 1 during rollout 1; rank 0 failed too, as its peer died: " in notes
        assert notes.endswith("RuntimeError: gloo: Connection reset by peer (injected)")
    else:
        assert "Connection reset by peer" in str(info.value) and "raised by rank 0 during rollout 1" in notes
    assert elapsed() < DEAD_PEER_GRACE_S + 5
    for peer in peers:
        ray.kill(peer)
