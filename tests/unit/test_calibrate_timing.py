"""``time_steps``: how the k timings of a step become its observation (``statistic``), with a scripted worker."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from slime_ext.training.calibrate import STATISTICS, time_steps


class _ScriptedWorker:
    """Burns the scripted thread CPU time per call of each step (keyed by its token count), in call order."""

    def __init__(self, script: dict[int, list[float]]):
        self.config = SimpleNamespace(model=SimpleNamespace(vocab_size=16))
        self.script = {k: list(v) for k, v in script.items()}

    def train_rollout(self, payload):
        tokens = sum(payload.samples.total_lengths)
        seconds = self.script[tokens].pop(0)
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        return []


@pytest.mark.parametrize("statistic", sorted(STATISTICS))
def test_statistic_of_the_repeats(statistic):
    # warm-up runs the biggest step once first, then 3 interleaved repeats of each
    script = {40: [0.0, 0.06, 0.02, 0.04], 8: [0.03, 0.01, 0.05]}
    worker = _ScriptedWorker(script)
    obs = time_steps(worker, [[[40]], [[8]]], repeats=3, timer="thread", statistic=statistic)
    expected = {"min": (0.02, 0.01), "median": (0.04, 0.03)}[statistic]
    assert [o.micro_batches for o in obs] == [((40,),), ((8,),)]
    for o, want in zip(obs, expected):
        assert want <= o.seconds < want + 0.008, (statistic, o.seconds, want)
    assert all(not v for v in worker.script.values())  # every scripted call was made


def test_unknown_statistic_is_refused():
    with pytest.raises(ValueError, match="statistic='mean' must be one of"):
        time_steps(_ScriptedWorker({8: [0.0]}), [[[8]]], repeats=1, timer="thread", statistic="mean")
