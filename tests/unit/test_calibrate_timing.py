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


def test_piece_shares_time_each_module_of_the_model():
    """``time_piece_shares``: forward hooks on the model's embedding, decoder layers and head give each piece's
    share of the forward time (a scripted model burns known thread CPU time per piece)."""
    torch = pytest.importorskip("torch")
    from slime_ext.training.calibrate import time_piece_shares

    class Burn(torch.nn.Module):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds

        def forward(self, x):
            end = time.thread_time() + self.seconds
            while time.thread_time() < end:
                pass
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
            time.sleep(0)  # time outside the model is not a piece's

    worker = Worker()
    shares = time_piece_shares(worker, [[[8]], [[4, 4]]], repeats=2, timer="thread")
    assert worker.calls == 1 + 2 * 2  # a warm-up, then every step per repeat
    assert shares["embedding"] + 3 * shares["layer"] + shares["head"] == pytest.approx(1.0)
    assert shares["embedding"] == pytest.approx(2 / 26, rel=0.25)
    assert shares["layer"] == pytest.approx(6 / 26, rel=0.15)
    assert shares["head"] == pytest.approx(6 / 26, rel=0.25)
    assert not worker.state.model[0].module.embedding._forward_hooks  # the hooks are removed
