"""``slime_ext.training.lr``: the scheduler ``build_scheduler`` makes from an ``OptimConfig`` (megatron-core's own
``OptimizerParamScheduler``, counting samples), and what :class:`StepSizedScheduler` hands on to the scheduler it
wraps. The LR values are computed here from the config's numbers, not read back from megatron-core."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("megatron.core")

from slime_ext.train_config import OptimConfig  # noqa: E402
from slime_ext.training.lr import LRIncrementMismatch, StepSizedScheduler, build_scheduler  # noqa: E402

# every number distinct, so a field passed in another's place shows: warmup 0.2 -> 1.0 over 10 samples, then a
# linear decay to 0.1 at sample 110; weight decay 0.05 throughout
WARMUP_THEN_LINEAR = OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_init=0.2, lr_decay_style="linear",
                                 lr_warmup_samples=10, lr_decay_samples=110, weight_decay=0.05)


class Optimizer:
    """What megatron-core's scheduler reads and writes on a ``MegatronOptimizer``: its ``param_groups``."""

    def __init__(self) -> None:
        self.param_groups = [{"lr": -1.0, "weight_decay": -1.0}]


def expected_lr(config: OptimConfig, samples: int) -> float:
    """Linear warmup from ``lr_warmup_init`` to ``lr``, then a linear decay to ``min_lr``, then ``min_lr``."""
    warmup, decay = config.lr_warmup_samples, config.lr_decay_samples
    if samples <= warmup:
        return config.lr_warmup_init + (config.lr - config.lr_warmup_init) * samples / warmup
    if samples > decay:
        return config.min_lr
    return config.min_lr + (config.lr - config.min_lr) * (1 - (samples - warmup) / (decay - warmup))


def test_the_schedule_warms_up_and_decays_by_samples_as_configured():
    optimizer = Optimizer()
    scheduler = build_scheduler(WARMUP_THEN_LINEAR, optimizer)
    seen = []
    for increment in (0, 5, 5, 25, 75, 1):  # sample 0, mid-warmup, its end, a quarter into the decay, its end, past
        scheduler.step(increment=increment)
        group = optimizer.param_groups[0]
        seen.append((scheduler.num_steps, group["lr"], group["weight_decay"]))
    assert [s for s, _, _ in seen] == [0, 5, 10, 35, 110, 111]
    assert [lr for _, lr, _ in seen] == pytest.approx([expected_lr(WARMUP_THEN_LINEAR, s) for s, _, _ in seen])
    assert [lr for _, lr, _ in seen] == pytest.approx([0.2, 0.6, 1.0, 0.775, 0.1, 0.1])
    assert [wd for _, _, wd in seen] == [0.05] * 6


def test_a_constant_lr_needs_no_decay_length():
    optimizer = Optimizer()
    scheduler = build_scheduler(OptimConfig(lr=0.3), optimizer)  # lr_decay_samples None: constant from sample 0
    assert optimizer.param_groups[0]["lr"] == 0.3
    scheduler.step(increment=10_000)
    assert optimizer.param_groups[0]["lr"] == 0.3 and optimizer.param_groups[0]["weight_decay"] == 0.0


def test_a_checkpointed_schedule_loads_only_into_the_same_schedule():
    """Neither the checkpoint's schedule nor the config's wins silently: another schedule's state is refused."""
    scheduler = build_scheduler(WARMUP_THEN_LINEAR, Optimizer())
    scheduler.step(increment=35)
    state = scheduler.state_dict()
    optimizer = Optimizer()
    resumed = build_scheduler(WARMUP_THEN_LINEAR, optimizer)
    resumed.load_state_dict(state)
    assert resumed.num_steps == 35 and optimizer.param_groups[0]["lr"] == pytest.approx(0.775)
    other = build_scheduler(dataclasses.replace(WARMUP_THEN_LINEAR, lr=0.5), Optimizer())
    with pytest.raises(AssertionError, match="for learning rate do not match"):
        other.load_state_dict(state)


def test_the_proxy_hands_the_hosts_other_arguments_on():
    class Recording:  # a scheduler whose step takes more than the increment
        def __init__(self) -> None:
            self.calls = []

        def step(self, increment, *args, **kwargs):
            self.calls.append((increment, args, kwargs))
            return "stepped"

    wrapped = Recording()
    proxy = StepSizedScheduler(wrapped, expected=4, increment=9, expected_is="the host's batch")
    assert proxy.step(4, "epoch", phase="train") == "stepped"
    assert wrapped.calls == [(9, ("epoch",), {"phase": "train"})]
    with pytest.raises(LRIncrementMismatch):
        proxy.step(5, "epoch")
    assert len(wrapped.calls) == 1
