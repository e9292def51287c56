"""verl's real ``prepare_micro_batches`` next to slime-ext's, over real gloo process groups (4 processes: DP 4, then
DP 2 x PP 2, then DP 2 x PP 2 x VPP 2 built by megatron-core's ``initialize_model_parallel``), and the switch."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections import defaultdict

import pytest

from verl_ranks import run_ranks

WORLD = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every (layout, case): the per-process records of both functions, switch on (SLIME_EXT_VERL=1)."""
    tmp = tmp_path_factory.mktemp("prepare")
    run_ranks("prepare_worker.py", WORLD, tmp, env={"SLIME_EXT_VERL": "1"})
    results = [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]
    import verl

    for r, res in enumerate(results):
        assert res["verl_file"] == verl.__file__, f"rank {r} imported another verl: {res['verl_file']}"
        assert "crash" not in res, f"rank {r}: {res['crash']}"
        assert res["patched"] and res["engine_wrapped"], f"rank {r}: the plugin did not patch verl with the switch on"
    grouped = defaultdict(list)
    for res in results:
        for run in res["runs"]:
            grouped[(run["layout"], run["case"])].append(run)
    return grouped


FAILING = "one-rank-fails"


def _dynamic(runs):
    return [(k, v) for k, v in runs.items() if v[0]["dynamic"] and k[1] != FAILING]


def test_every_layout_and_case_ran_on_every_process(runs):
    assert len(runs) == 3 * 6
    assert all(len(v) == WORLD for v in runs.values())


def test_each_rank_plans_with_one_all_reduce_and_no_all_gather(runs):
    # each rank plans its own samples; the DP group agrees through one all-reduce of the ballot, whatever its size
    for key, ranks in _dynamic(runs):
        for r in ranks:
            assert r["engine"]["collectives"] == {"all_reduce": 1}, (key, r["engine"]["collectives"])


def test_a_rank_that_cannot_plan_makes_every_rank_raise_after_the_collective(runs):
    for layout in ("dp", "dp-pp2", "dp-pp2-vpp2"):
        for r in runs[(layout, FAILING)]:  # every process got here and went on: nobody hung
            error = r["engine"].get("error", "")
            assert error.startswith("ScheduleError: ") and "DP rank 1" in error, (layout, r["dp_rank"], error)
            assert r["engine"]["collectives"] == {"all_reduce": 1}, (layout, r["engine"]["collectives"])
        failing = [r for r in runs[(layout, FAILING)] if r["dp_rank"] == 1]
        assert failing and all("3 samples, 70 tokens" in r["engine"]["error"] for r in failing)  # its own words


def test_engine_count_is_the_same_on_every_rank_and_aligned(runs):
    for key, ranks in _dynamic(runs):
        counts = {r["engine"]["count"] for r in ranks}
        assert len(counts) == 1, f"{key}: counts differ across ranks: {counts}"
        div = ranks[0]["divided_by"] or 1
        assert counts.pop() % div == 0, f"{key}: count not a multiple of num_batches_divided_by={div}"


def test_engine_holds_the_cap(runs):
    for key, ranks in _dynamic(runs):
        for r in ranks:
            e = r["engine"]
            over = [(t, s) for t, s in zip(e["tokens"], e["sizes"]) if t > r["cap"] and s > 1]
            assert not over, f"{key} dp rank {r['dp_rank']}: micro-batches over the cap {r['cap']}: {over}"


def test_engine_trains_each_sample_once_and_restores_input_order(runs):
    for key, ranks in _dynamic(runs):
        for r in ranks:
            e, n = r["engine"], len(r["lengths"])
            assert sorted(i for mb in e["ids"] for i in mb) == list(range(n)), f"{key}: not each sample once"
            assert e["ids"] == e["indices"], f"{key}: the index lists do not name the micro-batches' samples"
            assert e["restored"] == list(range(n)), f"{key}: verl's restore does not give the input order back"


def test_pipeline_ranks_of_a_replica_get_the_same_micro_batches(runs):
    for key, ranks in _dynamic(runs):
        by_dp = defaultdict(list)
        for r in ranks:
            by_dp[r["dp_rank"]].append(r["engine"]["indices"])
        for dp_rank, plans in by_dp.items():
            assert all(p == plans[0] for p in plans), f"{key}: pipeline ranks of dp rank {dp_rank} disagree"


def test_issue_over_cap_case_needs_one_micro_batch_per_sample(runs):
    # the issue's case: samples of 6 tokens under cap 10 (verl at v0.9.0 / HEAD 1dda039 packs ceil(24 / 10) = 3
    # bins, one with 12 tokens; PyPI's 0.9.1 re-partitions until the cap holds): each sample needs its own
    for key in (("dp", "verl-over-cap"), ("dp-pp2-vpp2", "verl-over-cap")):
        r0 = next(r for r in runs[key] if r["dp_rank"] == 0)
        assert r0["engine"]["count"] == 4 and r0["engine"]["tokens"] == [6, 6, 6, 6], key


def test_verl_own_function_agrees_across_ranks_too(runs):
    # the comparison is fair: verl's own function is run on the same groups and keeps its own count contract
    for key, ranks in _dynamic(runs):
        counts = {r["verl"].get("count", r["verl"].get("error")) for r in ranks}
        assert len(counts) == 1, f"{key}: verl's own counts differ: {counts}"


def test_static_batches_fall_back_to_verl_unchanged(runs):
    for layout in ("dp", "dp-pp2", "dp-pp2-vpp2"):
        for r in runs[(layout, "static")]:
            assert r["engine"] == r["verl"], f"{layout}: static micro-batches differ from verl's own"


# ---------------------------------------------------------------------------------------------- the switch itself
PROBE = """
import json, verl
import verl.workers.engine.megatron.transformer_impl as ti, verl.workers.engine.utils as eu
print(json.dumps({"same": ti.prepare_micro_batches is eu.prepare_micro_batches,
                  "wrapped": hasattr(ti.MegatronEngine.forward_backward_batch, "__wrapped__")}))
"""


def _probe(env_value):
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "SLIME_EXT_VERL"}
    if env_value is not None:
        env["SLIME_EXT_VERL"] = env_value
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    return p, (json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else None)


@pytest.mark.parametrize("value", [None, "0"])
def test_switch_off_leaves_verl_untouched(value):
    p, out = _probe(value)
    assert p.returncode == 0, p.stderr[-3000:]
    assert out == {"same": True, "wrapped": False}


def test_bad_switch_value_stops_the_import_with_the_fix():
    p, _ = _probe("maybe")
    assert p.returncode != 0
    assert "SLIME_EXT_VERL='maybe' is not a switch value; set SLIME_EXT_VERL=1" in p.stderr


def test_enable_then_disable_restores_verl_exactly(monkeypatch):
    import verl.workers.engine.megatron.transformer_impl as ti
    import verl.workers.engine.utils as eu

    import slime_ext.integrations.verl as sv

    original_fb = ti.MegatronEngine.__dict__["forward_backward_batch"]
    sv.enable()
    try:
        assert ti.prepare_micro_batches is not eu.prepare_micro_batches
        assert ti.prepare_micro_batches.__slime_ext__
        assert sv.enable() is sv.enable()  # idempotent
    finally:
        sv.disable()
    assert ti.prepare_micro_batches is eu.prepare_micro_batches
    assert ti.MegatronEngine.__dict__["forward_backward_batch"] is original_fb
    assert not sv.enabled()


def test_unknown_verl_version_is_refused_with_the_fix(monkeypatch):
    import verl

    import slime_ext.integrations.verl as sv
    from slime_ext.patches import PatchError

    monkeypatch.setattr(verl, "__version__", "0.8.0")
    with pytest.raises(PatchError, match=r"supports verl>=0.9.0,<0.11 .* but 0.8.0 is imported.*install a supported"):
        sv.enable()
    assert not sv.enabled()


def test_changed_signature_is_refused(monkeypatch):
    import verl.workers.engine.megatron.transformer_impl as ti

    import slime_ext.integrations.verl as sv
    from slime_ext.patches import PatchError

    monkeypatch.setattr(ti, "prepare_micro_batches", lambda data, dp_group=None, new_arg=0: None)
    with pytest.raises(PatchError, match="its parameters are"):
        sv.enable()
    assert not sv.enabled()
    assert not hasattr(ti.MegatronEngine.forward_backward_batch, "__wrapped__")  # all or nothing
