"""The LR scheduler: Megatron's ``OptimizerParamScheduler``, counting samples.

It is stepped in :func:`slime_ext.training.train_step.train_one_step` by the data path's ``lr_increment``: the
samples the step really trained on (``samples_per_step[s]``, rollout path), or the configured
``global_batch_size`` (legacy path, as upstream), which drifts from the samples seen whenever the step size varies.
"""

from __future__ import annotations

from slime_ext.train_config import OptimConfig


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
