"""bench/verl.py on the installed verl (a small step): its invariants hold and its figures go the documented way."""

from __future__ import annotations


def test_bench_runs_verl_and_both_depths_on_a_small_step(capsys):
    from bench import verl as bench_verl

    baseline = bench_verl.load_baseline(bench_verl.BASELINE)  # that commit's engine depth, in a subprocess
    try:
        rows = bench_verl.run_case("bimodal", n=256, dp=4, mini_batches=2, pp_sizes=(1, 4),
                                   baseline=None if isinstance(baseline, str) else baseline)
    finally:
        if not isinstance(baseline, str):
            baseline.close()
    assert [r["pp"] for r in rows] == [1, 4]
    for row in rows:  # judge() has already checked equal counts and each sample once, for every plan
        assert row["ours"].over_cap == 0 and row["trainer"].over_cap == 0
        assert row["trainer_balance"] <= 1.05 < row["balance"], (row["trainer_balance"], row["balance"])
        if row["before"] is not None:  # the plan before issue 30 ran on the same steps and kept its contract
            assert row["before"].over_cap == 0 and len(row["before"].counts) == 2
    assert bench_verl.main(["--quick", "--no-collective", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "rl-like" in out and "step time / verl" in out
    assert "planning time per rank per mini-batch" in out and "pp 4 x vpp 2" in out


def test_planning_times_time_every_rank_and_verl_beside_it():
    from bench import verl as bench_verl
    from slime_ext.integrations.verl.plan import EngineLayout, EngineSearch

    cell = bench_verl.planning_times(8, 16, EngineLayout(pp_size=4), repeats=1, baseline=None,
                                     search=EngineSearch())
    assert cell["count"] >= 1 and 0 < cell["ours_median"] <= cell["ours_max"]
    assert 0 < cell["verl_median"] <= cell["verl_max"] and cell["verl_build"] > 0
