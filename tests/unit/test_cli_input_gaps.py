"""Input that used to be ignored, checked late or answered with a raw error: each now gets one line naming the
fix, before anything is planned or printed."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from slime_ext.cli import main
from slime_ext.schedule import BatchConfig, ParallelConfig, ScheduleError, SampleBatch, plan_schedule

REPO = Path(__file__).resolve().parents[2]
DYNAMIC = ["--synthetic", "lognormal:n=64,seed=1", "--dp-size", "2", "--use-dynamic-batch-size",
           "--max-tokens-per-gpu", "16384", "--global-batch-size", "32", "--no-legend", "-q"]


def run_merged(*args) -> SimpleNamespace:
    """``main`` with stdout and stderr in one stream, in the order written (a warning must precede the table)."""
    both = io.StringIO()
    with contextlib.redirect_stdout(both), contextlib.redirect_stderr(both):
        rc = main([str(a) for a in args])
    return SimpleNamespace(returncode=rc, out=both.getvalue())


def _before_table(out: str, text: str) -> None:
    assert text in out, out
    table = out.find("\nstep ")
    assert table == -1 or out.index(text) < table, out


def test_micro_batch_size_with_dynamic_batches_warns_before_the_table():
    res = run_merged("plan", *DYNAMIC, "--micro-batch-size", "3")
    assert res.returncode == 0
    _before_table(res.out, "warning: --micro-batch-size 3 has no effect with --use-dynamic-batch-size")
    assert "drop it, or drop --use-dynamic-batch-size" in res.out
    assert "--micro-batch-size" not in run_merged("plan", *DYNAMIC).out  # no warning without it


@pytest.mark.parametrize("flags, message", [
    (["--plot", "{tmp}/no/such/dir/x.png"], "the directory {tmp}/no/such/dir does not exist; create it"),
    (["--plot", "{tmp}"], "is a directory; give a file name in it"),
    (["--json", "{tmp}/missing/s.json"], "--json {tmp}/missing/s.json: the directory {tmp}/missing does not exist"),
    (["--plot", "{tmp}/x.png", "--plot-steps", "3-1"], "'3-1' is a reversed range; write it low-high: 1-3"),
    (["--plot", "{tmp}/x.png", "--plot-steps", "0,x"], "'x' is not a step number"),
])
def test_output_flags_are_checked_before_anything_prints(tmp_path, flags, message):
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    res = run_merged("plan", *DYNAMIC, *flags)
    assert res.returncode == 2
    assert message.replace("{tmp}", str(tmp_path)) in res.out
    assert res.out.count("\n") == 1 and "error:" in res.out  # one line, no table


def test_plot_steps_past_the_schedule_are_refused_before_the_table(tmp_path):
    pytest.importorskip("matplotlib")
    res = run_merged("plan", *DYNAMIC, "--plot", tmp_path / "x.png", "--plot-steps", "1,7")
    assert res.returncode == 2 and "step 7 is outside the schedule's steps 0..1" in res.out
    assert res.out.count("\n") == 1 and not (tmp_path / "x.png").exists()


def test_a_cap_below_most_samples_warns_with_the_share_and_the_fix():
    """docs/cli.md's own example: 30k-token samples against demo_cpu.yaml's 192-token cap."""
    res = run_merged("plan", "--synthetic", "pareto:n=256,prompt=50-600,cap=30000,seed=5", "--config",
                     REPO / "configs" / "demo_cpu.yaml", "--no-legend", "-q")
    assert res.returncode == 0
    _before_table(res.out, "warning: 100% of the samples (256 of 256) are longer than the cap of 192 tokens")
    assert "raise --max-tokens-per-gpu (the median sample has" in res.out
    assert "longer than the cap" not in run_merged("plan", *DYNAMIC).out  # a cap above the samples: quiet


def test_from_json_given_jsonl_says_what_it_is_and_how_to_plan_it(tmp_path):
    path = tmp_path / "rollout.jsonl"
    path.write_text("".join(json.dumps({"total_length": n}) + "\n" for n in (10, 20, 30)))
    res = run_merged("plan", "--from-json", path)
    assert res.returncode == 2
    assert f"{path}: JSONL (one JSON object per line" in res.out and f"slime-ext plan {path} ..." in res.out
    path.write_text('{"total_length": 10}\n{"total_length": 10\n')  # broken JSON is still reported as such
    assert "not valid JSON" in run_merged("plan", "--from-json", path).out


def test_rank_payload_names_the_type_it_takes():
    schedule = plan_schedule([10, 20, 30, 40], ParallelConfig(dp_size=2),
                             BatchConfig(global_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=64))
    dicts = [{"tokens": [1] * n, "total_length": n} for n in (10, 20, 30, 40)]
    with pytest.raises(TypeError, match=r"samples is a list, not a SampleBatch \(one list per field: tokens, "):
        schedule.rank_payload(0, dicts)
    with pytest.raises(ScheduleError, match="rank=2 is outside"):  # the rank is still checked first
        schedule.rank_payload(2, dicts)
    assert SampleBatch.KEYS[0] == "tokens"


# ---------------------------------------------------------------------------------------------------- launcher
def _launch(argv, capsys):
    from slime_ext.integrations.slime.__main__ import main as launch

    with pytest.raises(SystemExit) as exit_:
        launch(argv)
    return exit_.value.code, capsys.readouterr()


def test_the_slime_launcher_refuses_a_missing_script_in_one_line(tmp_path, capsys):
    code, out = _launch([str(tmp_path / "train.py"), "--balance-data"], capsys)
    assert code == 2 and out.out == ""
    assert out.err.count("\n") == 1 and "train.py: no such file; give the path of slime's driver" in out.err


def test_the_slime_launcher_refuses_a_python_without_slime(tmp_path, capsys, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    real_find_spec = __import__("importlib.util").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "slime" else
                        real_find_spec(name, *a))
    code, out = _launch([str(script)], capsys)
    assert code == 2 and out.err.count("\n") == 1 and "slime is not importable in this Python" in out.err


def test_the_slime_launcher_says_it_is_active_then_runs_the_script(tmp_path, capsys, monkeypatch):
    from slime_ext.integrations.slime import __main__ as launcher
    from slime_ext.patches.slime_host import SlimeRevision

    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('ran', sys.argv[1:])\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    monkeypatch.setattr(launcher, "enable", lambda: None)
    monkeypatch.setattr(launcher.slime_host, "detect_revision", lambda: SlimeRevision("0.3.1", "rollout_indices"))
    launcher.main([str(script), "--dp-schedule", "rollout", "--balance-data"])
    out = capsys.readouterr()
    assert out.err == "slime-ext: active: slime 0.3.1 patched, dp_schedule rollout (slime-ext plans the rollout)\n"
    assert out.out == "ran ['--dp-schedule', 'rollout', '--balance-data']\n"
    assert sys.path[0] == str(tmp_path)  # the script's folder first, as `python train.py` has it


def test_static_batches_refusal_states_the_rule():
    res = run_merged("plan", "--synthetic", "lognormal:n=12", "--micro-batch-size", "2", "--dp-size", "2",
                     "--global-batch-size", "6")
    assert res.returncode == 2
    assert ("the rule: a step's micro-batch count, ceil(samples per step / micro_batch_size), is a multiple of "
            "dp_size*mb_group") in res.out
    assert run_merged("plan", "--synthetic", "lognormal:n=12", "--micro-batch-size", "2", "--dp-size", "2",
                      "--global-batch-size", "3").returncode == 0  # 3 samples: 2 micro-batches, as the rule says
