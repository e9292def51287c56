"""The demo says what it is doing: a line as each phase starts and ends, where the time went, and its columns."""

from __future__ import annotations

from types import SimpleNamespace

from slime_ext.rollout.harness import LEGEND, Phases, time_summary


def test_each_phase_is_announced_before_its_work_and_closed_after():
    lines: list[str] = []
    phases = Phases(lines.append)
    with phases.phase("Ray start", "starting Ray ..."):
        lines.append("(the work)")
    with phases.phase("steps", "3 rollouts", done=None):
        lines.append("(a row)")
    assert lines[:2] == ["Ray start: starting Ray ...", "(the work)"]
    assert lines[2].startswith("Ray start: ready in ") and lines[2].endswith(" s")
    assert lines[3:] == ["steps: 3 rollouts", "(a row)"]
    assert list(phases.seconds) == ["Ray start", "steps"]


def test_where_the_time_went_names_every_phase_and_the_training_share():
    result = SimpleNamespace(phases={"Ray start": 5.04, "process start-up": 11.6, "steps": 0.31},
                             rows=[{"seconds": 0.05}, {"seconds": 0.04}, {"seconds": 0.11}])
    line = time_summary(result)
    assert line.startswith("where the time went: Ray start 5.0 s, process start-up 11.6 s, steps 0.3 s;")
    assert "training took 0.2 s (the time s column)" in line


def test_the_legend_explains_the_loss_sign_and_the_warm_up_lr():
    text = " ".join(LEGEND)
    assert "-advantage x log p" in text and "a negative loss is expected" in text
    assert "warm-up starts at 0" in text and "0.00e+00" in text
