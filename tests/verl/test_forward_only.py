"""verl's log-prob and reference passes reach slime-ext's plan as forward-only passes: verl runs them through
``BaseEngine.infer_batch`` under ``torch.no_grad()`` (``forward_backward_batch(..., forward_only=True)``), and the
engine depth reads that (``engine.forward_only_now``). Run on verl's own ``infer_batch``."""

import torch

from slime_ext.integrations.verl.engine import forward_only_now


class _Recorder:
    """Stands in for an engine: records what the plan would read when verl calls ``forward_backward_batch``."""

    def __init__(self):
        self.seen = []

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        self.seen.append((forward_only, forward_only_now()))
        return {"metrics": {}}


def test_verl_infer_batch_is_read_as_forward_only():
    from tensordict import TensorDict  # verl's dependency: this module is collected without verl too
    from verl.workers.engine.base import BaseEngine

    data = TensorDict({"input_ids": torch.ones(2, 4, dtype=torch.int64)}, batch_size=[2])
    engine = _Recorder()
    BaseEngine.infer_batch(engine, data)
    assert engine.seen == [(True, True)]  # verl's forward_only, and what slime-ext reads: the same
    assert forward_only_now() is False  # an update (gradients on) is a training pass
