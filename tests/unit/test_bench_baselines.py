"""The benchmark's baselines and metrics on tiny inputs, against results worked out by hand; and a one-case run.

legacy is our own code (:mod:`slime_ext.schemes.legacy`); reference is upstream slime's own ``build_dp_schedule``
loaded at run time (:mod:`slime_ext.schemes.upstream`): its tests need an installed slime or ``SLIME_GIT`` and skip
without, saying how to get it.
"""

import contextlib
import io
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.run import run
from slime_ext.metrics import fwd_flops, issue_bound, measure, valid_bound
from slime_ext.schedule import BatchConfig, CostModel, ParallelConfig
from slime_ext.schemes import BASELINES, LegacyPlanError, UpstreamUnavailable, upstream
from slime_ext.schemes.legacy import balanced_groups, first_fit_count, split_over_ranks
from tests.brute_force import min_max_load

TINY = dict(hidden_size=2, num_layers=1, num_attention_heads=2, num_query_groups=1, kv_channels=1,
            ffn_hidden_size=2, vocab_size=3)
DP2 = ParallelConfig(dp_size=2)
LEGACY, REFERENCE = BASELINES["legacy"], BASELINES["reference"]


def _batch(**kw):
    return BatchConfig(**{"global_batch_size": 4, "use_dynamic_batch_size": True, "max_tokens_per_gpu": 10, **kw})


@pytest.fixture
def reference():
    why = REFERENCE.missing()
    if why:
        pytest.skip(why)
    return REFERENCE


# ---------------------------------------------------------------------------------------------------- legacy parts
def test_first_fit_count_is_arrival_order_first_fit():
    # 5 -> b0; 4 -> b1 (9 > 6); 3 -> b2; 2 -> b1 (6); 1 -> b0 (6)
    assert first_fit_count([5, 4, 3, 2, 1], 6) == 3
    # an oversize sample opens a bin and never takes a partner
    assert first_fit_count([10, 2, 3], 6) == 2
    assert first_fit_count([], 6) == 0


def test_balanced_groups_by_hand():
    # heaviest first to the lightest group: 8 | 7, 6 -> 7+6 | 5 -> 8+5 | 4 -> the tie (13, 2 items each): group 0
    assert balanced_groups([8, 7, 6, 5, 4], 2) == [[0, 3, 4], [1, 2]]
    # equal sizes: 4 | 3, 2 -> group 1 is full at 2 items | 1 -> group 0
    assert balanced_groups([1, 2, 3, 4], 2, equal_size=True) == [[0, 3], [1, 2]]
    # zero weights still give every group an item (ties go to the group with fewer items)
    assert balanced_groups([0, 0, 0], 3) == [[0], [1], [2]]
    with pytest.raises(LegacyPlanError, match="2 items cannot fill 3 groups"):
        balanced_groups([1, 2], 3)
    with pytest.raises(LegacyPlanError, match="5 items cannot make 2 groups of equal size"):
        balanced_groups([1, 2, 3, 4, 5], 2, equal_size=True)


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=8), st.integers(1, 3), st.booleans())
def test_balanced_groups_against_brute_force(weights, k, equal):
    """Every index once, no empty group, equal sizes when asked; without sizes, the greedy deal is within Graham's
    4/3 - 1/(3k) of the optimal heaviest group (brute force)."""
    if equal:
        weights = weights[: len(weights) // k * k]
    if len(weights) < k:
        with pytest.raises(LegacyPlanError):
            balanced_groups(weights, k, equal_size=equal)
        return
    groups = balanced_groups(weights, k, equal_size=equal)
    assert len(groups) == k and all(groups) and sorted(i for g in groups for i in g) == list(range(len(weights)))
    assert all(g == sorted(g) for g in groups)
    if equal:
        assert {len(g) for g in groups} == {len(weights) // k}
    else:
        worst = max(sum(weights[i] for i in g) for g in groups)
        assert worst <= (4 / 3 - 1 / (3 * k)) * min_max_load(weights, k) + 1e-9


def test_split_over_ranks_strided_or_balanced():
    assert split_over_ranks([1, 2, 3, 4, 5], 2, balance_data=False) == [[0, 2, 4], [1, 3]]
    assert split_over_ranks([1, 2, 3, 4], 2, balance_data=True) == [[0, 3], [1, 2]]
    # not divisible by dp: uneven counts, as upstream falls back to
    assert sorted(map(len, split_over_ranks([9, 1, 1, 1, 1], 2, balance_data=True))) == [1, 4]


# ---------------------------------------------------------------------------------------------------- (a) legacy
def test_legacy_takes_the_max_count_over_ranks():
    # strided: rank 0 gets [6, 4] (1 bin), rank 1 [6, 6] (2 bins); MAX = 2, so rank 0 runs two micro-batches
    sched = LEGACY.schedule([6, 6, 4, 6], DP2, _batch(), global_batch_size=4)
    assert sched.num_microbatches == [2]
    assert sorted(map(sorted, sched.partitions)) == [[0, 2], [1, 3]]
    assert [len(m) for m in sched.micro_batch_indices] == [2, 2]
    assert set(sched.timings) == {"split", "count", "partition", "wall", "cpu"}


def test_legacy_vpp_rounds_down_and_split_balances_tokens():
    # counts per rank 3; vpp with group 2 rounds DOWN to 2 (upstream), dealing 3 bins' worth into 2, over the cap
    lengths = [10, 10, 10, 10, 10, 10]
    vpp = ParallelConfig(dp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2)
    sched = LEGACY.schedule(lengths, vpp, _batch(global_batch_size=6), global_batch_size=6)
    assert sched.num_microbatches == [2]
    m = measure(sched, lengths, dp_size=2, cap=10, align=2, flops=fwd_flops(lengths, TINY))
    assert m.cap_violations == 2 and not m.problems
    # where rounding down leaves less than one group, the scheme refuses instead of handing Megatron a bad count
    with pytest.raises(LegacyPlanError, match="below one microbatch_group_size_per_vp_stage=2"):
        LEGACY.schedule([1] * 4, vpp, _batch(), global_batch_size=4)


def test_legacy_dry_run_trims_then_plans_every_rank():
    args = SimpleNamespace(global_batch_size=4, balance_data=False)
    LEGACY.dry_run([6, 6, 4, 6, 1], [0, 1, 2, 3, 4], args, DP2, _batch())  # the tail sample is trimmed
    with pytest.raises(LegacyPlanError, match="not even one step"):
        LEGACY.dry_run([6, 6, 4], [0, 1, 2], args, DP2, _batch())
    with pytest.raises(LegacyPlanError, match="must be a positive multiple of dp_size=2"):
        LEGACY.dry_run([6, 6, 4], [0, 1, 2], SimpleNamespace(global_batch_size=3), DP2, _batch())


# ---------------------------------------------------------------------------------------------------- (b) reference
def test_reference_strided_by_hand(reference):
    # first fit cap 10: [6,4] and [6,4]; K = 2 = dp; strided
    sched = reference.schedule([6, 6, 4, 4], DP2, _batch(), global_batch_size=4, rollout_ids=[0, 1, 2, 3])
    assert sched.partitions == [[0, 2], [1, 3]]
    assert sched.micro_batch_indices == [[[0, 1]], [[0, 1]]]
    assert sched.num_microbatches == [1]


def test_reference_splits_to_align_and_flops_mode_breaks_the_cap(reference):
    # first fit gives [8], [6], [6]: 3 bins, aligned to 4 by splitting... a single-sample bin cannot split
    with pytest.raises(AssertionError):
        reference.schedule([8, 6, 6], DP2, _batch(), global_batch_size=3, rollout_ids=[0, 1, 2])
    # FLOPs mode: ceil(20 / 10) = 2 bins balanced on FLOPs, no cap: {8} and {6, 6} = 12 tokens > 10
    sched = reference.schedule([8, 6, 6], DP2, _batch(balance_by_flops=True), global_batch_size=3,
                               rollout_ids=[0, 1, 2], cost_model=CostModel(**TINY))
    tokens = sorted(sum([8, 6, 6][i] for i in p) for p in sched.partitions)
    assert tokens == [8, 12]
    m = measure(sched, [8, 6, 6], dp_size=2, cap=10, align=2, flops=fwd_flops([8, 6, 6], TINY))
    assert m.cap_violations == 1 and not m.problems
    with pytest.raises(ValueError, match="needs the model dims"):
        reference.schedule([8, 6, 6], DP2, _batch(balance_data=True), global_batch_size=3)


def test_reference_groups_rollouts_and_trims_the_tail(reference):
    # rollouts 7 (samples 0, 2) and 9 (1, 3), then 5 (sample 4) trimmed with gbs=2 rollouts
    sched = reference.schedule([3, 3, 3, 3, 3], DP2, _batch(), global_batch_size=2, rollout_ids=[7, 9, 7, 9, 5])
    assert sorted(i for p in sched.partitions for i in p) == [0, 1, 2, 3]


def test_upstream_is_loaded_without_leaving_slime_in_sys_modules(reference):
    code = ("import sys\nfrom slime_ext.schemes import upstream\nup = upstream.load()\n"
            "print(up.dp_schedule.__name__, sorted(m for m in sys.modules if m.split('.')[0] == 'slime'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert out[0] == "slime.utils.dp_schedule"
    if "@" in upstream.load().source:  # extracted from SLIME_GIT (an installed slime stays importable, of course)
        assert out[1].strip() == "[]"


def test_without_upstream_the_reference_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(upstream.importlib.util, "find_spec", lambda name: None)  # no installed slime
    monkeypatch.delenv("SLIME_GIT", raising=False)
    with pytest.raises(UpstreamUnavailable, match="set SLIME_GIT to a git clone of github.com/THUDM/slime"):
        REFERENCE.schedule([1, 1], DP2, _batch(), global_batch_size=2)
    assert REFERENCE.missing().startswith("upstream slime is not available: install slime")
    monkeypatch.setenv("SLIME_GIT", str(tmp_path))
    with pytest.raises(UpstreamUnavailable, match=f"SLIME_GIT='{tmp_path}'.*not a slime git dir"):
        REFERENCE.source()


# ---------------------------------------------------------------------------------------------------- metrics
def test_metric_formulas_differ_by_the_kv_and_output_terms():
    # upstream K/V: 2h*(heads//groups)*kv, exact: 2h*2*groups*kv; upstream output: 2h*h, exact: 2*heads*kv*h
    gqa = dict(TINY, num_attention_heads=4, num_query_groups=2)
    diff = fwd_flops([1], gqa, "exact")[0] - fwd_flops([1], gqa, "upstream")[0]
    assert diff == 2 * 2 * (2 * 2 - 4 // 2) * 1 + (2 * 4 * 1 * 2 - 2 * 2 * 2)


def test_bounds_by_hand():
    # three 16400-token samples: three micro-batches suffice, the token-only bound says 4
    assert valid_bound([16400] * 3, 16384, 1) == 3
    assert issue_bound(3 * 16400, 16384, 1) == 4
    # five 6000-token samples: 2 by tokens, but at most 2 fit a bin -> 3; aligned to 4
    assert valid_bound([6000] * 5, 16384, 1) == 3
    assert valid_bound([6000] * 5, 16384, 4) == 4


def test_measure_flags_a_broken_schedule():
    bad = SimpleNamespace(partitions=[[0, 1], [1]], micro_batch_indices=[[[0, 1]], [[0]]], num_microbatches=[1])
    m = measure(bad, [1, 1], dp_size=2, cap=10, align=2, flops=np.ones(2))
    assert any("twice" in p for p in m.problems)


def test_one_case_runs_every_scheme():
    """One small benchmark case end to end (its speed is the benchmark's business, not a test's)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = run(["--cases", "rl-1k-dp8", "--repeats", "1"])
    text = out.getvalue()
    assert rc == 0
    have_reference = not REFERENCE.missing()
    for flags in ("strided", "balance_data", "balance_by_flops", "both"):
        for scheme in ("ours", "legacy", "reference"):
            row = [line.split() for line in text.splitlines() if line.split()[:2] == [flags, scheme]]
            assert row, (flags, scheme)
            assert (row[0][2] != "skipped") if scheme != "reference" or have_reference else row[0][2] == "skipped"
    if not have_reference:
        assert "reference: skipped: upstream slime is not available: install slime" in text
    assert "targets (issue 2)" in text and "zero cap violations (ours): 0" in text
    assert " bad" not in text  # every scheme's schedule passed the shape checks
