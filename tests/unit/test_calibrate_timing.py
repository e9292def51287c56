"""Calibration timings without a clock on the wall: how the k timings of a step become its observation
(``statistic``), each model piece's share of the forward time, and the fit staying physical on a noisy machine.

A fake worker says how long each run "took" and a fake clock reads it back, so the tests assert on outcomes (the
observation a statistic picks, the ratio a profile carries, the warning given), never on seconds elapsed."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from slime_ext.schedule.profile import TERM_NAMES
from slime_ext.training.calibrate import (MIN_BACKWARD_FORWARD_RATIO, STATISTICS, CalibrationError,
                                          calibration_design, fit_backward_forward_ratio, fit_calibration, observe,
                                          step_repeats, time_forward_only, time_steps)


class _FakeWorker:
    """Each run "takes" ``seconds(kind, micro_batches)``; :meth:`clock` reports the last run's seconds as busy time."""

    def __init__(self, seconds):
        self.config = SimpleNamespace(model=SimpleNamespace(vocab_size=16))
        self.seconds, self.last, self.runs = seconds, None, []

    def _run(self, kind, payload):
        lengths = payload.samples.total_lengths
        micro_batches = [[lengths[i] for i in mb] for mb in payload.micro_batch_indices]
        self.runs.append((kind, micro_batches))
        self.last = self.seconds(kind, micro_batches)
        return []

    def train_rollout(self, payload):
        return self._run("train", payload)

    def forward_only(self, payload):
        return self._run("forward", payload)

    def clock(self, fn):
        out = fn()
        return out, self.last, self.last


@pytest.mark.parametrize("statistic", sorted(STATISTICS))
def test_statistic_of_the_repeats(statistic):
    # warm-up runs the biggest step once first, then 3 interleaved repeats of each (forward, then backward order)
    script = {40: [0.0, 0.06, 0.02, 0.04], 8: [0.03, 0.01, 0.05]}
    worker = _FakeWorker(lambda kind, mbs: script[sum(map(sum, mbs))].pop(0))
    obs = time_steps(worker, [[[40]], [[8]]], repeats=3, statistic=statistic, clock=worker.clock)
    assert [o.micro_batches for o in obs] == [((40,),), ((8,),)]
    assert [o.seconds for o in obs] == {"min": [0.02, 0.01], "median": [0.04, 0.03]}[statistic]
    assert [sum(map(sum, mbs)) for _, mbs in worker.runs] == [40, 40, 8, 8, 40, 40, 8]  # warm-up, then interleaved
    assert all(not v for v in script.values())  # every scripted call was made


def test_unknown_statistic_is_refused_before_anything_runs():
    worker = _FakeWorker(lambda kind, mbs: 0.0)
    with pytest.raises(ValueError, match="statistic='mean' must be one of"):
        time_steps(worker, [[[8]]], repeats=1, statistic="mean", clock=worker.clock)
    assert not worker.runs


def test_piece_shares_time_each_module_of_the_model():
    """``time_piece_shares``: forward hooks on the model's embedding, decoder layers and head give each piece's
    share of the forward time (each piece of a scripted model advances a fake clock by its cost)."""
    torch = pytest.importorskip("torch")
    from slime_ext.training.calibrate import time_piece_shares

    clock = [0.0]

    class Burn(torch.nn.Module):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds

        def forward(self, x):
            clock[0] += self.seconds
            return x

    class Model(torch.nn.Module):  # the GPTModel's attribute names
        def __init__(self):
            super().__init__()
            self.embedding = Burn(0.002)
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList([Burn(0.006) for _ in range(3)])
            self.decoder.final_layernorm = Burn(0.001)
            self.output_layer = Burn(0.005)

        def forward(self, x):
            x = self.embedding(x)
            for layer in self.decoder.layers:
                x = layer(x)
            return self.output_layer(self.decoder.final_layernorm(x))

    class Worker:
        def __init__(self):
            self.config = SimpleNamespace(model=SimpleNamespace(vocab_size=16))
            self.state = SimpleNamespace(model=[SimpleNamespace(module=Model())])  # DDP-wrapped
            self.calls = 0

        def forward_only(self, payload):
            self.calls += 1
            self.state.model[0].module(torch.zeros(1))
            clock[0] += 1.0  # time outside the model is not a piece's

    worker = Worker()
    shares = time_piece_shares(worker, [[[8]], [[4, 4]]], repeats=2, now=lambda: clock[0])
    assert worker.calls == 1 + 2 * 2  # a warm-up, then every step per repeat
    assert shares["embedding"] + 3 * shares["layer"] + shares["head"] == pytest.approx(1.0)
    assert shares == pytest.approx({"embedding": 2 / 26, "layer": 6 / 26, "head": 6 / 26})
    assert not worker.state.model[0].module.embedding._forward_hooks  # the hooks are removed


# ------------------------------------------------------------------------------------------- a noisy machine
#: the machine's true costs: a forward pass of a micro-batch, and training = step overhead + (1 + 2) x forward
RATIO, STEP_OVERHEAD = 2.0, 2e-3


def _forward(micro_batches):
    return sum(2e-4 + 1e-5 * sum(mb) + 2e-9 * sum(L * L for L in mb) for mb in micro_batches)


def _machine(load):
    """True costs times ``load(kind)``: what another job running beside the calibration adds."""
    def seconds(kind, micro_batches):
        cost = _forward(micro_batches) if kind == "forward" else STEP_OVERHEAD + (1 + RATIO) * _forward(micro_batches)
        return cost * load(kind)

    return _FakeWorker(seconds)


def _calibrate(worker, repeats, statistic="median"):
    """What :func:`slime_ext.training.calibrate.measure` then :func:`fit_calibration` do, on the fake worker."""
    steps = calibration_design(1024, min_length=32)
    train = step_repeats(worker, steps, repeats=repeats, clock=worker.clock)
    forward = time_forward_only(worker, steps, repeats=repeats, clock=worker.clock)
    meta = {"repeat_spread": {"training": train.spread, "forward-only": forward.spread},
            "forward_only_seconds": forward.of(statistic)}
    return fit_calibration(observe(steps, train.of(statistic)), meta)


def test_a_quiet_machine_fits_the_true_ratio_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="slime_ext.calibrate"):
        profile, report = _calibrate(_machine(lambda kind: 1.0), repeats=3)
    assert profile.backward_forward_ratio == pytest.approx(RATIO, rel=1e-6)
    assert "warnings" not in profile.meta and not caplog.records
    assert profile.meta["repeat_spread"] == {"training": 0.0, "forward-only": 0.0}


def test_on_a_loaded_machine_the_fit_stays_physical_and_says_why(caplog):
    """Another job loads the machine while the forward-only passes are timed (bursty: some runs 1.5-4x slower):
    least squares would say backward is cheaper than forward (as a loaded CI machine once fitted 0.488)."""
    rng = np.random.default_rng(0)
    load = lambda kind: (1.0 if kind == "train" else 2.5) * (1 + 3 * rng.random() * (rng.random() < 0.5))  # noqa
    with caplog.at_level(logging.WARNING, logger="slime_ext.calibrate"):
        profile, _ = _calibrate(_machine(load), repeats=5)
    fitted = float(profile.meta["pipeline"]["backward_forward_ratio"].split("fitted ")[1].split()[0])
    assert fitted < MIN_BACKWARD_FORWARD_RATIO  # the noise did push the fit below the floor
    assert profile.backward_forward_ratio == MIN_BACKWARD_FORWARD_RATIO  # ... and the profile holds it there
    assert all(getattr(profile, t) >= 0 for t in TERM_NAMES)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "forward-only timings vary by" in warned and "backward/forward = " in warned
    assert "--repeats" in warned and "idle node" in warned
    assert profile.meta["warnings"] and all("--repeats" in w for w in profile.meta["warnings"])


def test_one_repeat_cannot_tell_noise_from_cost_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="slime_ext.calibrate"):
        profile, _ = _calibrate(_machine(lambda kind: 1.0), repeats=1)
    assert profile.meta["repeat_spread"] == {"training": None, "forward-only": None}
    assert any("one repeat per step" in r.getMessage() for r in caplog.records)
    assert profile.backward_forward_ratio == pytest.approx(RATIO, rel=1e-6)  # the data still support the fit


def test_an_unphysical_ratio_from_repeats_that_agree_is_held_at_the_floor_naming_the_timer(caplog):
    """Forward-only passes as slow as training, every repeat alike: not noise in the repeats, so the warning names the
    timer first (it may miss the backward); the profile still holds the physical floor (a loaded node measured 0.95
    with repeats 8% apart: a refusal there would fail a user's calibration for load)."""
    worker = _FakeWorker(lambda kind, mbs: STEP_OVERHEAD * (kind == "train") + _forward(mbs))
    with caplog.at_level(logging.WARNING, logger="slime_ext.calibrate"):
        profile, _ = _calibrate(worker, repeats=3)
    assert profile.backward_forward_ratio == MIN_BACKWARD_FORWARD_RATIO
    warned = [w for w in profile.meta["warnings"] if "backward/forward = " in w]
    assert len(warned) == 1 and "although the repeats agree" in warned[0] and "--timer cuda" in warned[0], warned


def test_a_ratio_that_cannot_be_fitted_is_refused():
    with pytest.raises(CalibrationError, match="no ratio can be fitted"):
        fit_backward_forward_ratio([np.inf, 1.0], [0.5, 0.5], 0.0)


def test_ratio_fit_from_train_and_forward_times():
    forward = [0.01, 0.02, 0.05, 0.1]
    train = [0.003 + 3.0 * f for f in forward]  # step overhead 3 ms, backward = 2 x forward
    fit = fit_backward_forward_ratio(train, forward, 0.003)
    assert (fit.ratio, fit.warning) == (pytest.approx(2.0), None)
    noisy = fit_backward_forward_ratio([0.003 + 1.5 * f for f in forward], forward, 0.003, spread=0.5)
    assert noisy.ratio == MIN_BACKWARD_FORWARD_RATIO and noisy.fitted == pytest.approx(0.5)
    assert "50% between repeats" in noisy.warning
    with pytest.raises(CalibrationError, match="needs one non-negative forward time per timed step"):
        fit_backward_forward_ratio(train, forward[:3], 0.003)
