"""Ray-level ledger under pipeline parallelism: every stage of a DP replica fetches that replica's payload and
consumes the same micro-batches, the ones the schedule gave the replica (PP=2 x DP=2, and PP=2 with VPP=2). The
plans are pipeline-aware (issue 15): the planner knows the pipeline size and predicts each step's makespan."""

from __future__ import annotations

import pytest

from rollout_harness import config, ray_session
from slime_ext.rollout.driver import run
from slime_ext.rollout.ledger import check_ledger

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def session():
    with ray_session(config("e2e/pp2")):
        yield


def _assert_pipeline_ledger(result, dp: int, pp: int) -> None:
    assert sorted((l["dp_rank"], l["pp_rank"]) for l in result.layouts) == \
        sorted((d, p) for d in range(dp) for p in range(pp))
    assert {l["backend"] for l in result.layouts} == {"nccl" if result.config.options["device"] == "cuda" else "gloo"}
    assert result.rollouts, "no rollout was trained"
    for rollout in result.rollouts:
        assert check_ledger(rollout.plan, rollout.ranks) == []
        schedule = rollout.plan.schedule  # planned for the pipeline: the model's prediction for every step
        assert schedule.parallel.pp_size == pp
        assert len(schedule.stats) == schedule.num_steps > 0
        assert all(st.predicted_makespan > 0 and 0 <= st.bubble_fraction < 1 for st in schedule.stats)
        by_dp: dict = {}
        for rank in rollout.ranks:  # the stages of a replica really consumed the same micro-batches
            assert len(rank.records) == schedule.num_steps, (rank.dp_rank, len(rank.records))
            by_dp.setdefault(rank.dp_rank, []).append([rec.ledger for rec in rank.records])
        assert sorted(by_dp) == list(range(dp)), sorted(by_dp)
        assert all(len(stages) == pp and all(s == stages[0] for s in stages) for stages in by_dp.values())


def test_ledger_dp2_pp2(session):
    result = run(config("e2e/pp2", verify_ledger=False), out=None)
    _assert_pipeline_ledger(result, dp=2, pp=2)


def test_ledger_pp2_vpp2(session):
    cfg = config("e2e/pp2_vpp2", verify_ledger=False, dist_timeout_seconds=20, train_timeout_seconds=120)
    result = run(cfg, out=None)
    _assert_pipeline_ledger(result, dp=1, pp=2)
    counts = [n for r in result.rollouts for n in r.plan.num_microbatches]
    assert counts, "no step was planned"
    assert all(n % cfg.train.parallel.microbatch_group_size_per_vp_stage == 0 for n in counts)
    # a step with as many micro-batches as stages (all in warmup on stage 0) once deadlocked gloo p2p; the
    # pipeline-aware planner gives this config's steps more micro-batches than that, so the case is now covered by
    # tests/e2e/test_train_invariance.py (static_few_microbatches, pp2_vpp2)
