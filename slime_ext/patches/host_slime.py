"""Host patch: run a slime-shaped training backend on the rollout-side schedule (``dp_schedule: rollout``).

Targets (in the host module, default :mod:`slime_ext.training.legacy_backend`, the slime-shaped backend of this
repo; checked against its ``HOST_API_VERSION`` marker, supported ``>=1.0,<2``, tested ``1.0``):

* ``get_data_iterator(args, model, rollout_data)`` -> :func:`get_data_iterator` below: the iterators come from the
  schedule the rollout side sent (``slime_ext.training.data.get_data_iterator``) and ``num_microbatches`` is the
  schedule's -- nothing is planned or all-reduced on the training side;
* ``DataIterator`` -> :class:`slime_ext.training.data.DataIterator` (takes ``micro_batch_indices``);
* ``step_lr_scheduler(args, opt_param_scheduler, rollout_data, step_id)`` ->
  :func:`slime_ext.training.lr.step_lr_scheduler`: the LR scheduler advances by ``samples_per_step[step_id]``
  instead of ``args.global_batch_size``.

:func:`configure` applies the patch when the flag selects the rollout-side schedule and undoes it for
``dp_schedule: legacy``; apply and undo are idempotent, and a host whose marker is missing or out of range, or
that lacks a target, is refused with a :class:`slime_ext.patches.PatchError` before anything is changed.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from . import Patch, PatchError, PatchSet

DEFAULT_HOST = "slime_ext.training.legacy_backend"
HOST_MARKER = "HOST_API_VERSION"
HOST_SUPPORTED = ">=1.0,<2"
HOST_TESTED = ("1.0",)


def get_data_iterator(args: Any, model: Any, rollout_data: Mapping[str, Any]):
    """The host's signature over slime-ext's schedule: ``(iterators per VPP stage, num_microbatches)``."""
    from slime_ext.training import data

    return data.get_data_iterator(rollout_data), list(rollout_data["num_microbatches"])


def _replace_with(new: Any):
    return lambda original: new


def _marker(host_module: str):
    def version() -> str:
        module = importlib.import_module(host_module)
        if not hasattr(module, HOST_MARKER):
            raise PatchError(f"host module {host_module} has no {HOST_MARKER} marker; patches.host_slime only "
                             f"patches hosts that declare the API it was written for ({HOST_SUPPORTED})")
        return str(getattr(module, HOST_MARKER))

    return version


def build_host_patches(host_module: str = DEFAULT_HOST) -> PatchSet:
    """A fresh, unapplied :class:`PatchSet` of the three host patches for ``host_module``."""
    from slime_ext.training import data, lr

    common = dict(module=host_module, distribution=f"{host_module}.{HOST_MARKER}", supported=HOST_SUPPORTED,
                  tested=HOST_TESTED, version=_marker(host_module))
    return PatchSet(f"host_slime[{host_module}]", [
        Patch(name="host_get_data_iterator", attribute="get_data_iterator", make=_replace_with(get_data_iterator),
              doc="iterators and num_microbatches from the rollout-side schedule", **common),
        Patch(name="host_data_iterator", attribute="DataIterator", make=_replace_with(data.DataIterator),
              doc="slime-ext's DataIterator(rollout_data, micro_batch_indices)", **common),
        Patch(name="host_lr_step", attribute="step_lr_scheduler", make=_replace_with(lr.step_lr_scheduler),
              doc="LR scheduler stepped by samples_per_step[s]", **common),
    ])


_PATCHES: dict[str, PatchSet] = {}


def patches_for(host_module: str = DEFAULT_HOST) -> PatchSet:
    """The process-wide patch set of ``host_module`` (one per host, so apply/undo pair up)."""
    if host_module not in _PATCHES:
        _PATCHES[host_module] = build_host_patches(host_module)
    return _PATCHES[host_module]


def configure(dp_schedule: str, host_module: str = DEFAULT_HOST) -> bool:
    """Apply the host patch for ``dp_schedule == "rollout"``, undo it for ``"legacy"``; returns whether applied."""
    patch_set = patches_for(host_module)
    if dp_schedule == "rollout":
        patch_set.apply()
        return True
    if dp_schedule == "legacy":
        patch_set.undo()
        return False
    raise PatchError(f"dp_schedule={dp_schedule!r} must be 'rollout' or 'legacy' (--dp-schedule)")


def undo(host_module: str = DEFAULT_HOST) -> None:
    patches_for(host_module).undo()
