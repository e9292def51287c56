"""The harness without Ray (``launcher: processes``): the same run, and faults that fail it fast, never a hang.

* the demo-sized e2e config trains every rollout with a verified ledger, rank processes joined by gloo, Ray never
  imported by the run;
* a train rank that raises while its peer waits in a collective: the run fails with that rank's traceback
  (:class:`RankError`), long before the process-group timeout;
* a train rank whose process dies: the run fails with :class:`RankDied`.

After each run every rank process has exited.
"""

from __future__ import annotations

import multiprocessing
import sys
import time

import pytest

from rollout_harness import config
from slime_ext.rollout.processes import RankDied, RankError, run

pytestmark = [pytest.mark.e2e]

BASE = "e2e/dp2_dynamic_balanced"
SLOW_PG = 300  # a process-group timeout: a failure by it would name rank 0's timeout, not rank 1's fault


def _no_rank_processes_left() -> None:
    for _ in range(100):
        if not [p for p in multiprocessing.active_children() if p.name.startswith("slime-ext-train-rank")]:
            return
        time.sleep(0.1)
    raise AssertionError("rank processes of the run are still alive")


def test_processes_launcher_trains_with_a_verified_ledger():
    ray_was_imported = "ray" in sys.modules
    cfg = config(BASE, launcher="processes")
    lines: list[str] = []
    result = run(cfg, out=lines.append)
    assert len(result.rollouts) == cfg.options["num_rollout"]
    assert [lay["rank"] for lay in result.layouts] == [0, 1]
    assert {lay["backend"] for lay in result.layouts} == {"gloo" if cfg.options["device"] == "cpu" else "nccl"}
    assert len({lay["pid"] for lay in result.layouts}) == 2
    trained = sum(r["samples"] for r in result.rows)
    assert trained == sum(len(r.plan.total_lengths) - len(r.plan.dropped) for r in result.rollouts)
    assert any("launcher=processes" in line for line in lines)
    if not ray_was_imported:  # in a pytest worker that ran a Ray test first, ray is already there
        assert "ray" not in sys.modules
    _no_rank_processes_left()


@pytest.mark.parametrize("worker_class, error, message", [
    ("rollout_harness.RaisingTrainWorker", RankError, "injected train failure on rank 1 at rollout 1"),
    ("rollout_harness.DyingTrainWorker", RankDied, "train rank 1 .* exited with code 17"),
], ids=["rank_raises", "rank_process_dies"])
def test_processes_launcher_surfaces_a_failed_rank(worker_class, error, message):
    cfg = config(BASE, launcher="processes", train_worker_class=worker_class, dist_timeout_seconds=SLOW_PG)
    with pytest.raises(error, match=message):  # a peer's timeout (SLOW_PG) would raise rank 0's error instead
        run(cfg, out=None)
    _no_rank_processes_left()
