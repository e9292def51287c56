"""The LR scheduler: Megatron's ``OptimizerParamScheduler``, counting samples.

It is stepped in :func:`slime_ext.training.train_step.train_one_step` by the data path's ``lr_increment``: the
samples the step really trained on (``samples_per_step[s]``, rollout path), or the configured
``global_batch_size`` (legacy path, as upstream), which drifts from the samples seen whenever the step size varies.

A host's own train step (slime v0.2.4, Megatron-LM's ``train_step``) steps its scheduler itself, by a size of its
own; :class:`StepSizedScheduler` is handed to it instead, and replaces that one increment by the samples the step
trained, after checking it is the increment the host integration was written for.
"""

from __future__ import annotations

from typing import Any

from slime_ext.train_config import OptimConfig

__all__ = ["LRIncrementMismatch", "StepSizedScheduler", "build_scheduler"]


class LRIncrementMismatch(RuntimeError):
    """A host stepped its LR scheduler by another increment than the one slime-ext was written to replace."""


class StepSizedScheduler:
    """An ``OptimizerParamScheduler`` whose ``step(increment=...)`` advances by the step's real sample count.

    The host calls ``scheduler.step(increment=expected)`` once per optimizer step (slime v0.2.4:
    ``--global-batch-size``; Megatron-LM: micro-batches x micro-batch size x DP). The proxy checks that the host
    passed ``expected`` -- so it replaces only the call it was written for -- and forwards ``increment`` instead;
    any other value is refused with :class:`LRIncrementMismatch`, naming both and where ``expected`` comes from.
    Everything else is the wrapped scheduler's.
    """

    def __init__(self, scheduler: Any, *, expected: int, increment: int, expected_is: str) -> None:
        """``expected_is``: what the host's increment is, in the host's words (for the error message)."""
        self._scheduler = scheduler
        self._expected, self._increment, self._expected_is = int(expected), int(increment), expected_is

    def step(self, increment: int, *args, **kwargs):
        if increment != self._expected:
            raise LRIncrementMismatch(
                f"the host stepped the LR scheduler by increment={increment}, but slime-ext replaces only the "
                f"increment {self._expected} ({self._expected_is}) by the step's {self._increment} trained samples; "
                f"this host revision steps its LR differently: re-check slime-ext's integration against it (or use "
                f"a supported revision) before training, since the LR schedule would be wrong")
        return self._scheduler.step(self._increment, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def build_scheduler(config: OptimConfig, optimizer):
    """``OptimizerParamScheduler`` with warmup/decay lengths in samples (``lr_warmup_samples``, ``lr_decay_samples``)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=config.lr_warmup_init,
        max_lr=config.lr,
        min_lr=config.min_lr,
        lr_warmup_steps=config.lr_warmup_samples,
        lr_decay_steps=config.lr_decay_steps,
        lr_decay_style=config.lr_decay_style,
        start_wd=config.weight_decay,
        end_wd=config.weight_decay,
        wd_incr_steps=config.lr_decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
    )
