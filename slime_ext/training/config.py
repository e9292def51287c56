"""The training config, as the training layer names it: declared once in :mod:`slime_ext.train_config`."""

from slime_ext.train_config import (LR_DECAY_STYLES, RESETTABLE_KEYS, Layout, ModelConfig, OptimConfig, Parallelism,
                                    TrainConfig, TrainConfigError, load_train_config)

__all__ = ["LR_DECAY_STYLES", "RESETTABLE_KEYS", "Layout", "ModelConfig", "OptimConfig", "Parallelism", "TrainConfig",
           "TrainConfigError", "load_train_config"]
