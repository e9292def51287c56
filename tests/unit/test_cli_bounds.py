"""Every bound ``slime-ext plan`` prints is a bound in every row, the ``all`` row included, and under pipeline
parallelism every time and ratio of one run comes from the pipeline makespan (main table, --compare table, verdict).

Property test over random rollouts and layouts, read from the printed tables (what a user sees), not from the
objects that made them.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from slime_ext.cli.report import pooled_balance_bound

from test_cli import MODEL_FLAGS, parse_compare_table, parse_table, run_main


def _num(cell: str) -> float:
    return float(cell.rstrip("%*"))


@st.composite
def plans(draw):
    n = draw(st.integers(8, 160))
    lengths = draw(st.lists(st.integers(1, 40_000), min_size=n, max_size=n))
    dp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 1, 2, 4]))
    gbs = draw(st.integers(dp, max(dp, n // 2)))  # every rank gets a sample in every step
    flags = ["--dp-size", dp, "--pipeline-model-parallel-size", pp, "--use-dynamic-batch-size",
             "--max-tokens-per-gpu", draw(st.sampled_from([4096, 8192, 16384])), "--global-batch-size", gbs,
             "--compare", "legacy", "--no-legend", "-q"]
    if pp == 2 and draw(st.booleans()):  # interleaved: 4 layers over 2 stages x 2 chunks
        flags += ["--vpp-size", 2]
    flags += ["--cp-size", draw(st.sampled_from([1, 2]))]
    if draw(st.booleans()):
        flags.append("--balance-data")
    if draw(st.booleans()):
        flags += [*MODEL_FLAGS, "--tflops", "100"]
    return np.asarray(lengths, dtype=np.int64), flags


def _check_rows(rows: list[dict[str, str]], bound: str) -> None:
    for row in rows:
        assert _num(row["imbal_lb"]) <= _num(row["imbal"]), row
        if row[bound] == "-":  # --compare: a scheme that broke the cap, which the bound assumes
            assert int(row["over_cap"]) > 0, row
            continue
        assert int(row[bound]) <= int(row["mbs/rank"]), row


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_every_printed_bound_is_a_bound_and_pipelined_times_agree(plan):
    lengths, flags = plan
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lengths.npy"
        np.save(path, lengths)
        res = run_main("plan", path, *flags, expect=None)
    assume(not (res.returncode == 2 and "cannot plan" in res.stderr))  # a step the planner refuses, in one line
    assert res.returncode == 0, res.stderr
    out = res.stdout
    rows, total = parse_table(out)
    _check_rows([*rows, total], "target/rank")
    compare = parse_compare_table(out)
    _check_rows(list(compare.values()), "bound/rank")

    if "--pipeline-model-parallel-size" in flags and flags[flags.index("--pipeline-model-parallel-size") + 1] > 1:
        makespan = next(k for k in total if k.startswith("makespan_"))
        for row in [*rows, total]:  # ours in --compare is the main table's pipeline makespan, step by step
            assert compare[row["step"], "ours"][makespan] == row[makespan]
            assert compare[row["step"], "ours"]["time_s"] == row["time_s"]
        verdict = re.search(r"^legacy: .* x([0-9.]+) of ours", out, re.M)
        legacy = compare.get(("all", "legacy"), {}).get(makespan, "-")
        if verdict and legacy != "-":  # the ratio is the makespans' (to the printed digits)
            assert float(verdict[1]) == approx_ratio(_num(legacy), _num(total[makespan]))


def approx_ratio(a: float, b: float):
    import pytest
    return pytest.approx(a / b, rel=2e-2)


def test_the_all_rows_bound_is_pooled_not_the_largest_steps():
    """Two steps: one balanced with a large mean, one with a large bound and a small mean. The largest step bound
    (3.0) exceeds the pooled max/mean (1.18); the pooled bound does not."""
    steps = [(1.0, 10.0), (3.0, 1.0)]  # (bound, mean); slowest ranks at their bounds: 10 and 3
    pooled_ratio = (10.0 + 3.0) / 11.0
    assert max(b for b, _ in steps) > pooled_ratio
    assert pooled_balance_bound(steps) <= pooled_ratio + 1e-12
    assert pooled_balance_bound([]) == 1.0


def test_a_scheme_that_breaks_the_cap_gets_no_bound(tmp_path):
    """legacy deals a step into even-token micro-batches with no cap: the bound, which assumes the cap, does not
    bind it (it can train fewer micro-batches than the bound), so its cell is '-' beside its over_cap count."""
    path = tmp_path / "lengths.npy"
    np.save(path, np.random.default_rng(33).integers(1, 40_000, size=125))
    out = run_main("plan", path, "--dp-size", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
                   "--global-batch-size", "20", "--balance-data", "--compare", "legacy", "--no-legend", "-q").stdout
    rows = parse_compare_table(out)
    broke = [row for (_, scheme), row in rows.items() if scheme == "legacy" and int(row["over_cap"]) > 0]
    assert broke and all(row["bound/rank"] == "-" for row in broke), out
    assert all(row["bound/rank"] != "-" for (_, scheme), row in rows.items() if scheme == "ours")
