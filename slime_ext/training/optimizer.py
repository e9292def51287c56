"""The optimizer: Megatron-core's optimizer (fp32 params and grads; Adam or SGD) over the DDP-wrapped chunks."""

from __future__ import annotations

import torch

from slime_ext.train_config import OptimConfig


def build_optimizer(config: OptimConfig, model: list):
    """``get_megatron_optimizer`` for ``model`` (the DDP chunks of this rank); clipping by ``clip_grad``."""
    from megatron.core import optimizer as mopt

    opt_config = mopt.OptimizerConfig(
        optimizer=config.optimizer,
        lr=config.lr,
        min_lr=config.min_lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        sgd_momentum=config.sgd_momentum,
        clip_grad=config.clip_grad,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        use_distributed_optimizer=False,
    )
    return mopt.get_megatron_optimizer(opt_config, model)


def current_lr(optimizer) -> float:
    """The learning rate the next ``optimizer.step()`` applies (first parameter group)."""
    return float(optimizer.param_groups[0]["lr"])
