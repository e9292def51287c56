"""``slime-ext plan`` end to end, through real subprocesses (``python -m slime_ext.cli`` and, when the package is
installed, the ``slime-ext`` console script) on small inputs.

The table is checked against the schedule the same run saved with ``--json``, and that schedule against
``plan_schedule`` called in-process on the same input: the CLI passes the flags through and plans nothing itself.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from slime_ext.cli import main
from slime_ext.schedule import BatchConfig, CostModel, DPSchedule, ParallelConfig, check_schedule, plan_schedule
from slime_ext.schemes import BASELINES, UpstreamUnavailable

REPO = Path(__file__).resolve().parents[2]
MODULE = [sys.executable, "-m", "slime_ext.cli"]
ENTRY_POINT = Path(sys.executable).parent / "slime-ext"
RUNNERS = [
    pytest.param(MODULE, id="python-m"),
    pytest.param([str(ENTRY_POINT)], id="entry-point", marks=pytest.mark.skipif(
        not ENTRY_POINT.exists(), reason="slime-ext is not installed in this environment (pip install -e .)")),
]
MODEL_FLAGS = ["--hidden-size", "256", "--num-layers", "4", "--num-attention-heads", "8", "--num-query-groups", "2",
               "--ffn-hidden-size", "1024", "--vocab-size", "32000"]


def run(*args, runner=MODULE, cwd=None, env=None, expect=0) -> subprocess.CompletedProcess:
    """Run the CLI; the repository comes first on PYTHONPATH, so an installed entry point runs this checkout."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    out = subprocess.run([*runner, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=full_env,
                         timeout=120)
    assert out.returncode == expect, f"rc={out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return out


@contextlib.contextmanager
def _cwd(path):
    old = os.getcwd()
    os.chdir(path or old)
    try:
        yield
    finally:
        os.chdir(old)


def run_main(*args, cwd=None, expect=0) -> SimpleNamespace:
    """``slime_ext.cli.main`` (what the console script calls) in this process: for the many bad-input cases, which
    would otherwise pay a Python start each. :func:`test_bad_input_in_a_real_process` covers the process path."""
    out, err = io.StringIO(), io.StringIO()
    with _cwd(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    res = SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())
    assert expect is None or rc == expect, f"rc={rc}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    return res


def parse_table(stdout: str) -> tuple[list[dict[str, str]], dict[str, str]]:
    """``(step rows, total row)`` of the per-step table, cells keyed by header."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["step"])
    headers = lines[start].split()
    rows = []
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith("total:"):
            break
        if set(line.replace(" ", "")) == {"-"}:
            continue
        cells = line.split()
        assert len(cells) == len(headers), line
        rows.append(dict(zip(headers, cells)))
    assert rows[-1]["step"] == "all"
    return rows[:-1], rows[-1]


def approx(text: str, value: float, rel: float = 5e-3) -> bool:
    return float(text.rstrip("%*")) == pytest.approx(value, rel=rel)


@pytest.fixture(scope="module")
def rollout_jsonl(tmp_path_factory) -> tuple[Path, dict]:
    """18 rollouts of 1-3 samples (``rollout_id``, ``loss_tokens``; some lines give ``tokens`` as a list)."""
    rng = np.random.default_rng(7)
    lengths, rids, loss = [], [], []
    path = tmp_path_factory.mktemp("in") / "rollout.jsonl"
    with open(path, "w") as f:
        for rid in range(18):
            for _ in range(int(rng.integers(1, 4))):
                n = int(rng.integers(50, 3000)) if rid != 5 else 5000  # rollout 5: longer than the cap, alone
                lt = int(rng.integers(0, n))
                rec = {"rollout_id": rid, "loss_tokens": lt, "reward": 0.5}
                rec.update({"tokens": list(range(n))} if len(lengths) % 4 == 0 else {"total_length": n})
                f.write(json.dumps(rec) + "\n")
                lengths.append(n)
                rids.append(rid)
                loss.append(lt)
    return path, {"lengths": lengths, "rollout_ids": rids, "loss_tokens": loss}


DYNAMIC = ["--dp-size", 2, "--use-dynamic-batch-size", "--max-tokens-per-gpu", 4096, "--global-batch-size", 8,
           "--balance-data"]


# ---------------------------------------------------------------------------------------------------- the table
@pytest.mark.parametrize("runner", RUNNERS)
def test_table_matches_the_schedule_and_the_planner(runner, rollout_jsonl, tmp_path):
    path, data = rollout_jsonl
    out = run("plan", path, *DYNAMIC, "--json", tmp_path / "s.json", runner=runner)
    saved = json.loads((tmp_path / "s.json").read_text())
    schedule = DPSchedule.from_dict(saved)
    # the CLI plans nothing itself: the saved schedule is plan_schedule's on the same input
    expected = plan_schedule(data["lengths"], ParallelConfig(dp_size=2),
                             BatchConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=4096, global_batch_size=8,
                                         balance_data=True),
                             rollout_ids=data["rollout_ids"], loss_tokens=data["loss_tokens"])
    assert saved == expected.to_dict()
    assert check_schedule(schedule) == []

    rows, total = parse_table(out.stdout)
    assert len(rows) == schedule.num_steps == 2  # 18 rollouts, 8 per step: 2 trailing rollouts dropped
    for row, st in zip(rows, schedule.stats):
        assert int(row["step"]) == st.step
        assert int(row["rollouts"]) == st.num_rollouts == 8
        assert int(row["samples"]) == st.num_samples
        assert int(row["tokens"]) == st.total_tokens
        assert int(row["mbs/rank"]) == st.num_microbatches
        assert int(row["target/rank"]) == st.packing_target // 2
        assert approx(row["util"], 100 * st.token_utilization)
        assert int(row["largest"].rstrip("*")) == st.largest_bin_tokens
        assert row["largest"].endswith("*") == (st.largest_bin_tokens > 4096)
        assert int(row["cap"]) == st.cap == 4096
        assert int(row["rank_tokens_max"]) == round(st.rank_cost_max)  # no model dims: cost = tokens
        assert int(row["rank_tokens_mean"]) == round(st.rank_cost_mean)
        assert approx(row["imbal"], st.flops_imbalance)
        assert approx(row["imbal_lb"], st.balance_lower_bound)
        assert row["time_s"] == "-"
    assert int(total["samples"]) == sum(schedule.samples_per_step)
    assert int(total["mbs/rank"]) == sum(schedule.num_microbatches)
    assert int(total["tokens"]) == sum(st.total_tokens for st in schedule.stats)

    dropped = [ln for ln in out.stdout.splitlines() if ln.startswith("total:")]
    assert len(dropped) == 1 and f"{len(schedule.dropped)} dropped (2 trailing rollouts" in dropped[0]
    assert len(schedule.dropped) == sum(1 for r in data["rollout_ids"] if r >= 16) > 0
    assert f"{len(data['lengths'])} samples in 18 rollouts" in out.stdout


def test_flops_columns_and_step_time_follow_the_cost_model(rollout_jsonl, tmp_path):
    path, data = rollout_jsonl
    out = run("plan", path, *DYNAMIC, *MODEL_FLAGS, "--tflops", 50, "--tensor-model-parallel-size", 2,
              "--json", tmp_path / "s.json")
    schedule = DPSchedule.from_dict(json.loads((tmp_path / "s.json").read_text()))
    assert schedule.cost_model == CostModel(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2,
                                            ffn_hidden_size=1024, vocab_size=32000)
    rows, total = parse_table(out.stdout)
    assert len(rows) == len(schedule.stats) == schedule.num_steps > 0, (len(rows), len(schedule.stats))
    for row, st in zip(rows, schedule.stats):
        assert approx(row["rank_FLOPs_max"], st.rank_cost_max)
        assert approx(row["rank_FLOPs_mean"], st.rank_cost_mean)
        # fwd+bwd = 3 x forward, over 50 TFLOP/s x 2 GPUs per replica (tp=2)
        assert approx(row["time_s"], 3 * st.rank_cost_max / (50e12 * 2))
    assert approx(total["time_s"], sum(3 * st.rank_cost_max / 100e12 for st in schedule.stats))
    assert "50 TFLOP/s x 2 GPUs per replica" in out.stdout


def test_gzipped_jsonl_reads_like_the_plain_file(rollout_jsonl, tmp_path):
    path, data = rollout_jsonl
    (tmp_path / "r.jsonl.gz").write_bytes(gzip.compress(path.read_bytes()))
    run_main("plan", tmp_path / "r.jsonl.gz", *DYNAMIC, "--json", tmp_path / "s.json", "-q")
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["total_lengths"] == data["lengths"] and saved["rollout_ids"] == data["rollout_ids"]
    assert saved["loss_tokens"] == data["loss_tokens"]


def test_static_batches(tmp_path):
    np.save(tmp_path / "lengths.npy", np.arange(1, 33, dtype=np.int32) * 10)
    out = run("plan", tmp_path / "lengths.npy", "--dp-size", 4, "--micro-batch-size", 2, "--global-batch-size", 16,
              "--json", tmp_path / "s.json")
    schedule = DPSchedule.from_dict(json.loads((tmp_path / "s.json").read_text()))
    rows, _ = parse_table(out.stdout)
    assert [int(r["mbs/rank"]) for r in rows] == schedule.num_microbatches == [2, 2]
    assert all(r["util"] == "-" and r["cap"] == "-" for r in rows)
    assert "static batch: micro_batch_size=2" in out.stdout


# ---------------------------------------------------------------------------------------------------- --config
def test_config_yaml_with_training_keys_and_overrides(rollout_jsonl, tmp_path):
    path, _ = rollout_jsonl
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "# a run config: planning keys plus training-only keys the planner ignores\n"
        "num_gpus: 8\ntensor_model_parallel_size: 2\npipeline_model_parallel_size: 2\n"  # dp = 8 / 4 = 2
        "use-dynamic-batch-size: true\nmax_tokens_per_gpu: 8192\nglobal_batch_size: 4\nbalance_data: true\n"
        "lr: 1.0e-6\nseed: 1234\nadam_beta2: 0.98\n"
        "hidden_size: 256\nnum_layers: 4\nnum_attention_heads: 8\n"
    )
    out = run("plan", path, "--config", cfg, "--max-tokens-per-gpu", 4096, "--no-balance-data",
              "--json", tmp_path / "s.json")
    schedule = DPSchedule.from_dict(json.loads((tmp_path / "s.json").read_text()))
    # the planner minimises the pipeline makespan; tp is recorded for the step-time estimate only
    assert schedule.parallel == ParallelConfig(dp_size=2, pp_size=2, tp_size=2)
    assert schedule.batch == BatchConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=4096, global_batch_size=4,
                                         balance_data=False)
    assert schedule.cost_model == CostModel(hidden_size=256, num_layers=4, num_attention_heads=8)
    assert "x 2 GPUs per stage = tp*cp" in out.stdout  # pp = 2: the step time is the pipeline makespan, per stage
    # a replay reads tp and pp from the schedule (tp may be overridden for the estimate; pp was planned for)
    replay = run_main("plan", "--from-json", tmp_path / "s.json")
    assert "x 2 GPUs per stage = tp*cp" in replay.stdout
    assert "x 4 GPUs per stage = tp*cp" in run_main("plan", "--from-json", tmp_path / "s.json",
                                                    "--tensor-model-parallel-size", 4).stdout
    refused = run_main("plan", "--from-json", tmp_path / "s.json", "--pipeline-model-parallel-size", 2, expect=2)
    assert "--pipeline-model-parallel-size cannot change it" in refused.stderr


RUN_CONFIGS = sorted((REPO / "configs").rglob("*.yaml")) if (REPO / "configs").is_dir() else []


@pytest.mark.skipif(not RUN_CONFIGS, reason="no configs/*.yaml in this checkout")
def test_every_run_config_of_the_repository_plans(tmp_path):
    pytest.importorskip("yaml")
    for cfg in RUN_CONFIGS:
        run("plan", "--config", cfg, "--synthetic", "lognormal:n=96,mu=3,sigma=0.9,prompt=4-24,cap=60",
            "--json", tmp_path / "s.json", "-q")
        assert check_schedule(DPSchedule.from_dict(json.loads((tmp_path / "s.json").read_text()))) == []


def test_the_run_config_schema_is_accepted():
    """Every key the training and rollout sides read from a run config is known to the CLI (used or ignored)."""
    rollout_config = pytest.importorskip("slime_ext.rollout.config")
    from slime_ext.cli import options

    unknown = sorted(set(rollout_config.ALL_KEYS) - set(options.KEYS) - options.IGNORED_KEYS)
    assert unknown == [], f"add these keys to slime_ext.cli.options (KEYS or IGNORED_KEYS): {unknown}"


@pytest.mark.parametrize("text, message", [
    ("global_batch_size: 4\nmax_token_per_gpu: 10\n", "unknown key 'max_token_per_gpu' (did you mean "
                                                      "'max_tokens_per_gpu'?)"),
    ("global_batch_size: four\n", "bad.yaml: global_batch_size must be a positive integer, got 'four' (str); pass "
                                   "--global-batch-size N"),
    ("balance_data: 1\nglobal_batch_size: 4\n", "bad.yaml: balance_data must be a bool (True or False), got 1 (int)"),
    ("- global_batch_size\n", "must be a mapping"),
    ("global_batch_size: [4\n", "not valid YAML"),
    ("num_gpus: 6\ntensor_model_parallel_size: 4\nglobal_batch_size: 4\n", "6 GPUs do not divide"),
    ("num_gpus: 8\ndp_size: 2\nglobal_batch_size: 4\n", "dp_size is 2 but 8 GPUs / (tp*pp*cp = 1) give dp_size = 8"),
])
def test_bad_config_is_rejected_naming_the_key(text, message, rollout_jsonl, tmp_path):
    pytest.importorskip("yaml")
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    out = run_main("plan", rollout_jsonl[0], "--config", cfg, expect=2)
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------------- JSON replay
@pytest.mark.parametrize("runner", RUNNERS)
def test_json_round_trips_and_from_json_validates(runner, rollout_jsonl, tmp_path):
    path, _ = rollout_jsonl
    first = run("plan", path, *DYNAMIC, *MODEL_FLAGS, "--json", tmp_path / "s.json", runner=runner)
    saved = json.loads((tmp_path / "s.json").read_text())
    schedule = DPSchedule.from_dict(saved)
    assert DPSchedule.from_dict(schedule.to_dict()) == schedule
    assert schedule.to_dict() == saved
    replay = run("plan", "--from-json", tmp_path / "s.json", runner=runner)
    assert replay.stdout.startswith("valid:")
    assert parse_table(replay.stdout) == parse_table(first.stdout)


def test_tampered_json_is_rejected_listing_every_violation(rollout_jsonl, tmp_path):
    path, _ = rollout_jsonl
    run("plan", path, *DYNAMIC, "--json", tmp_path / "s.json")
    d = json.loads((tmp_path / "s.json").read_text())
    lost = d["partitions"][0][0]
    twice = d["partitions"][1][0]
    d["partitions"][0][0] = twice  # one sample lost, another scheduled twice
    d["dropped"].append(d["dropped"][0])  # and a duplicate in dropped
    (tmp_path / "bad.json").write_text(json.dumps(d))
    out = run("plan", "--from-json", tmp_path / "bad.json", expect=1)
    assert out.stdout.startswith("INVALID:")
    assert f"sample {twice} is scheduled twice" in out.stdout
    assert f"1 samples are neither scheduled nor reported dropped, e.g. [{lost}]" in out.stdout
    assert "dropped lists a sample twice" in out.stdout
    listed = [ln for ln in out.stdout.splitlines() if ln.startswith("  - ")]
    assert f"{len(listed)} violations" in out.stdout and len(listed) >= 3

    d = json.loads((tmp_path / "s.json").read_text())
    d["parallel"]["dp_size"] = 0
    (tmp_path / "bad2.json").write_text(json.dumps(d))
    out = run("plan", "--from-json", tmp_path / "bad2.json", expect=1)
    assert "not a readable schedule" in out.stdout and "dp_size must be a positive integer" in out.stdout

    (tmp_path / "cut.json").write_text((tmp_path / "s.json").read_text()[:50])
    out = run("plan", "--from-json", tmp_path / "cut.json", expect=2)
    assert "cut.json:1: not valid JSON" in out.stderr

    out = run("plan", "--from-json", tmp_path / "s.json", "--dp-size", 4, expect=2)
    assert "--dp-size cannot change it" in out.stderr


# ---------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("lines, message", [
    (['{"total_length": 10}', '{"total_length": "12"}'], "f.jsonl:2: field 'total_length' is \"12\", not an integer"),
    (['{"total_length": 10}', '{"total_length": 12.5}'], "f.jsonl:2: field 'total_length' is 12.5, not an integer"),
    (['{"total_length": 10}', '', '{"len": 3}'], "f.jsonl:3: no 'total_length' or 'tokens' field"),
    (['{"total_length": 10}', '{"total_length": 10'], "f.jsonl:2: not valid JSON (Expecting ',' delimiter at column 20)"),
    (['{"tokens": []}'], "f.jsonl:1: field 'tokens' is an empty list"),
    (['{"total_length": 0}'], "f.jsonl:1: field 'total_length' is 0; it must be >= 1"),
    (['{"total_length": 10, "tokens": [1, 2]}'], "f.jsonl:1: field 'total_length' is 10 but 'tokens' counts 2"),
    (['{"total_length": 10, "rollout_id": 0}', '{"total_length": 10}'],
     "f.jsonl:2: field 'rollout_id' is missing but it is present on line 1"),
    (['{"total_length": 10, "rollout_id": "a"}'], "f.jsonl:1: field 'rollout_id' is \"a\", not an integer"),
    (['{"total_length": 10, "loss_tokens": 11}'], "f.jsonl:1: field 'loss_tokens' is 11 but the sample has only 10"),
    (['[10]'], "f.jsonl:1: a JSON list, not an object"),
    ([], "f.jsonl: empty file, no samples"),
    (['', '  '], "f.jsonl: empty file, no samples"),
])
def test_bad_jsonl_is_rejected_with_line_and_field(lines, message, tmp_path):
    (tmp_path / "f.jsonl").write_text("".join(line + "\n" for line in lines))
    out = run_main("plan", "f.jsonl", "--global-batch-size", 1, cwd=tmp_path, expect=2)
    assert out.stderr.startswith("slime-ext plan: error: ")
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""


@pytest.mark.parametrize("runner", RUNNERS)
def test_bad_input_in_a_real_process(runner, tmp_path):
    """The process path of an error: exit code 2, one line on stderr, no traceback, nothing on stdout."""
    (tmp_path / "f.jsonl").write_text('{"total_length": 10}\n{"tokens": 3.5}\n')
    out = run("plan", "f.jsonl", "--global-batch-size", 1, cwd=tmp_path, runner=runner, expect=2)
    assert out.stderr == "slime-ext plan: error: f.jsonl:2: field 'tokens' is 3.5, not an integer; give the token " \
                         "count as a JSON integer\n"
    assert out.stdout == ""


@pytest.mark.parametrize("array, message", [
    (np.array([3.0, 4.0]), "f.npy: array of dtype float64, not integers"),
    (np.array([3, 0, 4]), "f.npy: entry 1 is 0; every length must be >= 1"),
    (np.ones((2, 2), dtype=np.int64), "f.npy: array of shape (2, 2)"),
    (np.array([], dtype=np.int64), "f.npy: empty array"),
])
def test_bad_npy_is_rejected(array, message, tmp_path):
    np.save(tmp_path / "f.npy", array)
    out = run_main("plan", "f.npy", "--global-batch-size", 1, cwd=tmp_path, expect=2)
    assert message in out.stderr and "Traceback" not in out.stderr


def test_bad_flags_and_infeasible_plans_exit_2_with_one_line(tmp_path):
    for args, message in [
        ((), "give exactly one input"),
        (("--synthetic", "lognormal:n=8", "--from-json", "x.json"), "give exactly one input"),
        (("--synthetic", "lognormal:n=8"), "pass --global-batch-size N"),
        (("--synthetic", "lognormal:n=8", "--global-batch-size", 8, "--dp-size", 16), "cannot plan synthetic"),
        (("--synthetic", "lognormal:n=8", "--global-batch-size", 8, "--hidden-size", 64), "needs --num-layers"),
        (("--synthetic", "lognormal:n=8", "--global-batch-size", 8, "--vpp-size", 2), "needs "
                                                                                       "--microbatch-group-size"),
        (("--synthetic", "lognormal:n=8", "--global-batch-size", 8, "--plot-metric", "flops"), "need --plot"),
        (("missing.jsonl", "--global-batch-size", 8), "cannot read missing.jsonl"),
    ]:
        out = run_main("plan", *args, cwd=tmp_path, expect=2)
        assert message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


# ---------------------------------------------------------------------------------------------------- synthetic
def test_synthetic_spec(tmp_path):
    spec = "lognormal:n=512,mu=6,sigma=1.5,prompt=100-200,cap=3000,seed=3,samples_per_rollout=4"
    flags = ["--dp-size", 2, "--use-dynamic-batch-size", "--max-tokens-per-gpu", 8192, "--global-batch-size", 32]
    run("plan", "--synthetic", spec, *flags, "--json", tmp_path / "a.json")
    run("plan", "--synthetic", spec, *flags, "--json", tmp_path / "b.json")
    a = json.loads((tmp_path / "a.json").read_text())
    assert a == json.loads((tmp_path / "b.json").read_text())  # seeded: the same spec gives the same input
    lengths, loss = np.array(a["total_lengths"]), np.array(a["loss_tokens"])
    assert len(lengths) == 512 and a["rollout_ids"] == [i // 4 for i in range(512)]
    prompt = lengths - loss  # loss_tokens is the response
    assert prompt.min() >= 100 and prompt.max() <= 200 and loss.min() >= 1 and loss.max() == 3000
    assert 300 < np.median(loss) < 500  # median exp(6) ~ 403
    assert a["samples_per_step"] == [128] * 4

    run("plan", "--synthetic", "pareto:n=256,alpha=1.1,scale=300,seed=1", "--global-batch-size", 256,
        "--json", tmp_path / "p.json")
    p = json.loads((tmp_path / "p.json").read_text())
    assert min(p["loss_tokens"]) >= 300 and max(p["loss_tokens"]) <= 16000

    for spec, message in [("weibull:n=3", "unknown distribution 'weibull'"), ("lognormal:n=3,alpha=1", "unknown key "
                          "'alpha' for lognormal"), ("pareto:alpha=x", "alpha='x' is not float"),
                          ("lognormal:prompt=9-3", "prompt=9-3 must be 0 <= LO <= HI"), ("lognormal:n", "not key=value")]:
        out = run_main("plan", "--synthetic", spec, "--global-batch-size", 1, expect=2)
        assert message in out.stderr, out.stderr


# ---------------------------------------------------------------------------------------------------- --compare
def parse_compare_table(stdout: str) -> dict[tuple[str, str], dict[str, str]]:
    """``{(step, scheme): row}`` of the --compare table."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "scheme"])
    headers = lines[start].split()
    rows = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        if set(line.replace(" ", "")) != {"-"}:
            cells = dict(zip(headers, line.split()))
            rows[cells["step"], cells["scheme"]] = cells
    return rows


def _have_upstream() -> bool:
    return not BASELINES["reference"].missing()


def test_compare_runs_the_baselines_on_the_same_input(tmp_path):
    spec = "pareto:n=512,prompt=50-600,cap=30000,seed=5"
    flags = ["--dp-size", 4, "--use-dynamic-batch-size", "--max-tokens-per-gpu", 16384, "--global-batch-size", 256,
             "--balance-data", "--vocab-size", 32000, "--hidden-size", 256, "--num-layers", 4,
             "--num-attention-heads", 8, "--num-query-groups", 2, "--kv-channels", 32, "--ffn-hidden-size", 1024]
    out = run("plan", "--synthetic", spec, *flags, "--compare", "legacy,reference", "--json", tmp_path / "s.json")
    schedule = DPSchedule.from_dict(json.loads((tmp_path / "s.json").read_text()))
    rows = parse_compare_table(out.stdout)
    assert {scheme for _, scheme in rows} == {"ours", "legacy"} | ({"reference"} if _have_upstream() else set())
    assert {step for step, _ in rows} == {"0", "1", "all"}

    # ours, measured by slime_ext.metrics, agrees with the planner's own stats
    for st in schedule.stats:
        row = rows[str(st.step), "ours"]
        assert int(row["mbs/rank"]) == st.num_microbatches
        assert approx(row["rank_FLOPs_max"], st.rank_cost_max) and approx(row["imbal"], st.flops_imbalance)
        assert int(row["over_cap"]) == 0

    # the baselines are slime_ext.schemes' on the same lengths and flags (reference: upstream's own, when at hand)
    lengths = schedule.total_lengths
    batch = BatchConfig(global_batch_size=256, use_dynamic_batch_size=True, max_tokens_per_gpu=16384,
                        balance_data=True)
    baselines = {"legacy": BASELINES["legacy"].schedule(lengths, ParallelConfig(dp_size=4), batch,
                                                        global_batch_size=256)}
    try:
        baselines["reference"] = BASELINES["reference"].schedule(
            lengths, ParallelConfig(dp_size=4), batch, global_batch_size=256, rollout_ids=list(range(512)),
            cost_model=CostModel(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2,
                                 kv_channels=32, ffn_hidden_size=1024, vocab_size=32000))
        assert "reference: planned in" in out.stdout and "est. step time x" in out.stdout
        assert "upstream from " in out.stdout
    except UpstreamUnavailable:
        assert "reference: not run: upstream slime is not available: install slime" in out.stdout
        assert ("0", "reference") not in rows
    for name, sched in baselines.items():
        assert [int(rows[str(s), name]["mbs/rank"]) for s in range(2)] == sched.num_microbatches
    flops = schedule.cost_model.flops(np.array(lengths))  # every scheme measured with our cost model
    for name, sched in baselines.items():
        m0 = sched.num_microbatches[0]
        rank_flops = [sum(flops[sched.partitions[r][i]] for mb in sched.micro_batch_indices[r][:m0] for i in mb)
                      for r in range(4)]
        assert approx(rows["0", name]["rank_FLOPs_max"], max(rank_flops))
        assert approx(rows["0", name]["imbal"], max(rank_flops) / np.mean(rank_flops))
    assert "legacy: planned in" in out.stdout


def test_compare_reports_what_a_baseline_cannot_do(rollout_jsonl, tmp_path):
    path, _ = rollout_jsonl  # rollouts of 1-3 samples: steps hold different sample counts
    out = run("plan", path, *DYNAMIC, "--compare", "legacy,reference", "-q")
    assert "legacy: not run: legacy counts global_batch_size in samples" in out.stdout
    assert "reference: not run: with balance_data/balance_by_flops upstream balances by calculate_fwd_flops" \
        in out.stdout
    out = run_main("plan", path, "--global-batch-size", 8, "--dp-size", 2, "--compare", "legacy", expect=2)
    assert "--compare needs --use-dynamic-batch-size" in out.stderr
    out = run_main("plan", path, *DYNAMIC, "--compare", "legacy,best", expect=2)
    assert "unknown scheme 'best'" in out.stderr


# ---------------------------------------------------------------------------------------------------- --plot
def test_plot_writes_a_png(rollout_jsonl, tmp_path):
    pytest.importorskip("matplotlib")
    path, _ = rollout_jsonl
    out = run("plan", path, *DYNAMIC, *MODEL_FLAGS, "--plot", tmp_path / "tok.png", "--plot-steps", "all")
    assert f"wrote {tmp_path / 'tok.png'}" in out.stdout
    run("plan", path, *DYNAMIC, *MODEL_FLAGS, "--plot", tmp_path / "flops.png", "--plot-metric", "flops",
        "--plot-steps", "1")
    for name in ("tok.png", "flops.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000

    out = run_main("plan", path, *DYNAMIC, "--plot", tmp_path / "x.png", "--plot-metric", "flops", expect=2)
    assert "--plot-metric flops needs the model dims" in out.stderr
    out = run_main("plan", path, *DYNAMIC, "--plot", tmp_path / "x.png", "--plot-steps", "5", expect=2)
    assert "outside the schedule's steps 0..1" in out.stderr
    assert not (tmp_path / "x.png").exists()


def test_plot_without_matplotlib_says_how_to_install(rollout_jsonl, tmp_path):
    blocker = tmp_path / "blocker"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(blocker)])}
    out = run("plan", rollout_jsonl[0], *DYNAMIC, "--plot", tmp_path / "x.png", env=env, expect=2)
    assert "--plot needs matplotlib" in out.stderr and "pip install matplotlib" in out.stderr
    assert out.stdout == ""  # rejected before planning
    run("plan", rollout_jsonl[0], *DYNAMIC, env=env)  # everything else works without it


# ---------------------------------------------------------------------------------------------------- misc
def test_progress_goes_to_stderr_on_long_inputs(tmp_path):
    with open(tmp_path / "big.jsonl", "w") as f:
        f.writelines(f'{{"total_length": {100 + i % 900}}}\n' for i in range(20_000))
    out = run("plan", tmp_path / "big.jsonl", "--global-batch-size", 20_000, "--no-legend",
              env={"SLIME_EXT_PROGRESS_INTERVAL": "0"})
    assert "reading" in out.stderr and "samples" in out.stderr and "done, 20,000 samples" in out.stderr
    assert "reading" not in out.stdout
    quiet = run("plan", tmp_path / "big.jsonl", "--global-batch-size", 20_000, "-q",
                env={"SLIME_EXT_PROGRESS_INTERVAL": "0"})
    assert quiet.stderr == ""


def test_cli_imports_nothing_heavy():
    code = ("import sys, slime_ext.cli, slime_ext.cli.plan, slime_ext.cli.plot, slime_ext.cli.compare\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'ray', 'megatron', 'matplotlib', 'yaml'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == ""
