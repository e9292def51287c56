"""slime-ext: rollout-side global micro-batch scheduling for Megatron training.

Three layers, each in its own subpackage:

* :mod:`slime_ext.schedule` -- pure planning (standard library + numpy only);
* :mod:`slime_ext.rollout`  -- the rollout adapter (Ray);
* :mod:`slime_ext.training` -- the training adapter (torch + megatron-core).

The :class:`slime_ext.schedule.DPSchedule` dataclass is the contract between them. Beside them:
:mod:`slime_ext.schemes` (one class per ``dp_schedule``, looked up once, and the typed records on the way back;
also the baselines: legacy in our own code, upstream's reference imported at run time), :mod:`slime_ext.cli`
(``slime-ext plan``, planning layer only), :mod:`slime_ext.metrics` (the one measure used to compare schemes), and
``slime_ext/patches/`` (the only code that changes third-party modules).
"""

__version__ = "0.1.0"
