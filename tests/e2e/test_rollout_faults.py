"""Faults fail the run with the original error -- never a hang, and never by the timeout that a slow path would hit.

* a rollout function that raises: the run fails with its exception while a train rank's set-up never finishes
  (the driver waits on both at once; waiting on the set-up first would end in its set-up timeout instead);
* a train rank that raises while its peer waits in a collective: the run fails with that rank's exception, not the
  peer's process-group timeout (the driver fails on the first failed call and kills the group);
* a train rank that hangs: its peer's process group times out after ``dist_timeout_seconds`` and the run fails
  with that timeout, not with the driver's own (much longer) ``train_timeout_seconds``;
* a train rank whose process dies: the run fails with Ray's actor-died error.

No test here measures time: each sets the deadline a slow path would run into (the code's own arguments) and
asserts which error ended the run, and in what order things happened (rollout 0 trained before the fault). After
each failure every actor is gone (all logical CPUs are free again).
"""

from __future__ import annotations

import time

import pytest
import ray

from rollout_harness import DEVICE, FaultyPeer, InjectedFault, config, free_cpus, ray_session
from slime_ext.rollout.driver import gather, run

pytestmark = [pytest.mark.e2e]

BASE = "e2e/dp2_dynamic_balanced"
#: the deadline of a slow path (a process-group or set-up timeout): if the run ended by it, the error would differ
SLOW = 300


def _rollout_rows(lines: list[str]) -> set[tuple[str, str]]:
    """``(rollout, step)`` of the printed step rows."""
    return {tuple(line.split()[:2]) for line in lines if line.split()[:1] and line.split()[0].isdigit()}


def _fault_came_after_rollout_0(lines: list[str]) -> None:
    rows = _rollout_rows(lines)
    assert ("0", "1") in rows, "rollout 0 should have trained before the fault"
    assert not any(rollout == "1" for rollout, _ in rows), "rollout 1 should not have trained"


@pytest.fixture(scope="module")
def session():
    cfg = config(BASE)
    with ray_session(cfg):
        yield ray.cluster_resources()["CPU"]


def _assert_all_actors_gone(total_cpus: float) -> None:
    """Ray frees a killed actor's CPUs asynchronously: wait for it (pytest's timeout guards a leak that never
    frees them; an actor still alive holds its CPU forever)."""
    while free_cpus() != total_cpus:
        time.sleep(0.1)


def test_rollout_function_raises(session):
    cfg = config(BASE, rollout_function_path="rollout_harness.raising_rollout",
                 train_worker_class="rollout_harness.NeverReadyTrainWorker", setup_timeout_seconds=SLOW,
                 dist_timeout_seconds=SLOW)
    with pytest.raises(InjectedFault, match="injected rollout failure at rollout 0"):
        run(cfg, out=None)
    _assert_all_actors_gone(session)


def test_train_rank_raises(session):
    cfg = config(BASE, train_worker_class="rollout_harness.RaisingTrainWorker", dist_timeout_seconds=SLOW)
    lines: list[str] = []
    with pytest.raises(InjectedFault, match="injected train failure on rank 1 at rollout 1"):
        run(cfg, out=lines.append)
    _fault_came_after_rollout_0(lines)
    _assert_all_actors_gone(session)


def test_train_rank_hangs_and_peer_times_out(session):
    pg_timeout = 8
    cfg = config(BASE, train_worker_class="rollout_harness.HangingTrainWorker", dist_timeout_seconds=pg_timeout,
                 train_timeout_seconds=SLOW)  # the driver's own timeout would raise StepTimeout instead
    if DEVICE == "cpu":  # gloo raises in the waiting rank
        expected = pytest.raises(RuntimeError, match=f"Timed out waiting {pg_timeout * 1000}ms")
    else:  # the NCCL watchdog aborts the waiting rank's process
        expected = pytest.raises((RuntimeError, ray.exceptions.RayActorError))
    lines: list[str] = []
    with expected:
        run(cfg, out=lines.append)
    _fault_came_after_rollout_0(lines)
    _assert_all_actors_gone(session)


def test_train_rank_process_dies(session):
    cfg = config(BASE, train_worker_class="rollout_harness.DyingTrainWorker", dist_timeout_seconds=SLOW)
    lines: list[str] = []
    with pytest.raises(ray.exceptions.RayActorError):
        run(cfg, out=lines.append)
    _fault_came_after_rollout_0(lines)
    _assert_all_actors_gone(session)


@pytest.mark.parametrize("second, grace, raised", [
    ("die", SLOW, ray.exceptions.RayActorError),  # the death comes within the grace: it is raised
    ("ok", SLOW, RuntimeError),  # no death among the peers: the first error, as it is
    ("raise", SLOW, RuntimeError),
    ("hang", 0.5, RuntimeError),  # the grace passes with the peer still running: the first error
])
def test_a_dead_process_is_raised_over_its_peers_symptom(session, second, grace, raised):
    """A peer's collective error that arrives first gives way to the process death behind it (``gather``'s grace);
    without a death, the first error is raised as it is. Rank 1 acts only once rank 0's error exists (events, not
    sleeps), so rank 0's symptom always comes first."""
    peers = [ray.remote(num_cpus=0)(FaultyPeer).remote() for _ in range(2)]
    first = peers[0].run.remote("raise")
    calls = [("rank 0", first), ("rank 1", peers[1].run.remote(second, [first]))]
    with pytest.raises(raised) as info:
        gather(calls, timeout=SLOW, what="rollout 1", grace=grace)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if second == "die":
        assert "raised by rank 1 during rollout 1; rank 0 failed too, as its peer died: " in notes
        assert notes.endswith("RuntimeError: gloo: Connection reset by peer (injected)")
    else:
        assert "Connection reset by peer" in str(info.value) and "raised by rank 0 during rollout 1" in notes
    for peer in peers:
        ray.kill(peer)
