"""slime-ext: rollout-side global micro-batch scheduling for Megatron training.

Three layers, each in its own subpackage:

* :mod:`slime_ext.schedule` -- pure planning (standard library + numpy only);
* :mod:`slime_ext.rollout`  -- the rollout adapter (Ray);
* :mod:`slime_ext.training` -- the training adapter (torch + megatron-core).

The :class:`slime_ext.schedule.DPSchedule` dataclass is the contract between them.
"""

__version__ = "0.1.0"
