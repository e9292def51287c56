"""Faults on the training side fail the job with the error that caused them (no hang): a stuck peer by the
collective timeout (``dist_timeout_seconds``), which is what a failed step must run into, not the harness's own."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
from train_harness import MODEL, OPTIM, join, launch, make_samples, plan, rendezvous, rollout_payloads

pytestmark = pytest.mark.e2e

TIMEOUT_S = 5.0
CONFIG = {**MODEL, **OPTIM, "use_dynamic_batch_size": True, "max_tokens_per_gpu": 48,
          "use_dynamic_global_batch_size": True, "dist_timeout_seconds": TIMEOUT_S}


def _payloads():
    samples = make_samples(10, seed=1)
    return rollout_payloads(samples, plan(samples, CONFIG, 2))


def _fault_job(rank: int, port: int, payloads: list, fault: str) -> dict:
    """Rank 1 misbehaves after setup (``hang``: stops participating; ``die``: exits); rank 0 trains."""
    worker = join(CONFIG, rank, 2, port)
    worker.setup()
    if rank == 1:
        if fault == "die":
            os._exit(3)
        time.sleep(600)
    try:
        worker.train_rollout(payloads[0])
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


@pytest.mark.parametrize("fault", ["hang", "die"])
def test_a_stuck_or_dead_peer_fails_the_step_within_the_timeout(fault):
    payloads = _payloads()
    # the harness's own deadline (120 s) would raise in launch(): rank 0 failing by itself is the outcome
    with rendezvous() as port:
        result, _ = launch([(_fault_job, (rank, port, payloads, fault)) for rank in range(2)], timeout=120,
                           wait_for=[0])
    assert result["error"] is not None, "training went on without its peer"
    if fault == "hang":
        assert "Timed out" in result["error"] or "timeout" in result["error"].lower(), result["error"]


def _late_join_job(rank: int, port: int, payloads: list, late_s: float) -> int:
    """Rank 1 starts ``late_s`` after rank 0 (longer than the collective timeout); both train the rollout and
    return its step count."""
    if rank == 1:
        time.sleep(late_s)
    worker = join(CONFIG, rank, 2, port)
    worker.setup()
    return len(worker.train_rollout(payloads[worker.layout.dp_rank]))


def test_a_rank_starting_later_than_the_collective_timeout_still_joins():
    """Joining is bounded by the rendezvous timeout, not by ``dist_timeout_seconds`` (which bounds collectives
    only): ranks of a real job start seconds apart, and that must not fail a job with a short collective timeout."""
    payloads = _payloads()
    with rendezvous() as port:
        results = launch([(_late_join_job, (rank, port, payloads, 2 * TIMEOUT_S)) for rank in range(2)],
                         timeout=120)
    steps = len(payloads[0].num_microbatches)
    assert steps > 0 and results == [steps, steps], results


def _disagree_job(rank: int, port: int, payloads: list) -> str:
    worker = join(CONFIG, rank, 2, port)
    worker.setup()
    try:
        worker.train_rollout(payloads[worker.layout.dp_rank])
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    finally:
        worker.shutdown()
    return "no error"


def test_ranks_with_different_micro_batch_counts_are_stopped_before_the_schedule_runs():
    payloads = _payloads()
    good = payloads[1]  # rank 1 splits its first micro-batch in two: one micro-batch more than rank 0
    first, rest = good.micro_batch_indices[0], good.micro_batch_indices[1:]
    assert len(first) > 1
    bad = dataclasses.replace(good, micro_batch_indices=[first[:1], first[1:], *rest],
                              num_microbatches=[good.num_microbatches[0] + 1, *good.num_microbatches[1:]])
    with rendezvous() as port:
        errors = launch([(_disagree_job, (rank, port, [payloads[0], bad])) for rank in range(2)], timeout=60)
    for err in errors:
        assert "RolloutDataError: ranks disagree on num_microbatches" in err, err
