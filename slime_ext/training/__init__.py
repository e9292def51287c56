"""Training adapter: runs the rollout-side schedule on megatron-core (torch + megatron.core; gloo on CPU).

One concern per module, in the order a step touches them:

* :mod:`slime_ext.train_config` -- ``TrainConfig`` (pure Python, shared with the rollout side): ``batch``,
  ``parallel``, ``model``, ``optim`` sections under flat slime names;
* :mod:`.parallel` -- torch.distributed + ``megatron.core.parallel_state`` (tp=1, pp, vpp, dp), bounded timeouts;
* :mod:`.model` -- tiny Megatron ``GPTModel`` (local spec, THD core attention, fp32), canonical init, DDP;
* :mod:`.thd_attention` -- core attention over THD packed sequences without TransformerEngine, its layer spec
  and slime's ``--spec`` callable;
* :mod:`.optimizer` -- Megatron optimizer;  :mod:`.lr` -- the LR scheduler and **where it is stepped**;
* the schedule is consumed by the ``dp_schedule`` scheme's ``iterators`` (:mod:`slime_ext.schemes`: ``rollout``
  runs the payload's schedule slice, ``legacy`` plans per rank as upstream), over :mod:`slime_ext.schemes.data`'s
  ``DataIterator``: it lives with the schemes, below this package, as both use it;
* :mod:`.batch` -- a micro-batch packed into tensors (THD);  :mod:`.loss` -- the per-token policy loss and its scaling;
* :mod:`.thd_attention` -- core attention over THD packed sequences without TransformerEngine, its layer spec and
  slime's ``--spec`` callable;
* :mod:`.train_step` -- the train loop over ``get_forward_backward_func()`` and the forward-only pass;
* :mod:`.worker` -- ``TrainWorker``, one training process, the unit the Ray side wraps.
"""

from slime_ext.train_config import TrainConfig, TrainConfigError, load_train_config

__all__ = ["TrainConfig", "TrainConfigError", "TrainWorker", "load_train_config"]


def __getattr__(name):  # TrainWorker pulls in megatron-core; import it on first use
    if name == "TrainWorker":
        from .worker import TrainWorker

        return TrainWorker
    raise AttributeError(name)
