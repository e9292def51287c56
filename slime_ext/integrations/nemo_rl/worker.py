"""NeMo-RL's Megatron worker with packed micro-batches of their own length under pipeline parallelism (the
default with the switch on; the ``pad_to_longest`` opt-out keeps NeMo-RL's own worker).

NeMo-RL's worker pads every packed micro-batch of a global batch to the longest one when the pipeline has more than
one stage (``_get_pack_sequence_parameters_for_megatron``: megatron-core's p2p is then given one shape). megatron-core
can instead send each micro-batch's shape ahead of it (``TransformerConfig.variable_seq_lengths``). Under PP:

* :func:`unpadded_pack_parameters` replaces ``_get_pack_sequence_parameters_for_megatron`` in the worker process:
  NeMo-RL's own parameters, without the pad to the longest (each packed micro-batch still rounded up to NeMo-RL's
  multiple for FP8 / CP / sequence parallelism);
* :func:`use_variable_seq_lengths` sets ``variable_seq_lengths`` on the model's config, and ``batch_p2p_comm``
  off from 4 stages (Megatron-LM issue 5100: batched p2p with per-micro-batch shapes deadlocks there);
* :func:`worker_class` is the Ray actor the ``Policy`` starts instead of NeMo-RL's ``MegatronPolicyWorker``
  (through its ``worker_extension_cls_fqn``): NeMo-RL's implementation, with the two above applied in the worker
  process.

**The workers must import slime-ext.** NeMo-RL looks the actor class's FQN up in
``ray_actor_environment_registry.ACTOR_ENVIRONMENT_REGISTRY`` (slime-ext's entry is the Megatron worker's), and its
``RayWorkerBuilder`` imports the class by that FQN in the environment it names. With NeMo-RL's default ``uv run
... --extra mcore`` entry, NeMo-RL builds a venv for the class (named after its FQN, under ``NEMO_RL_VENV_DIR``)
from NeMo-RL's own lock, which does not hold slime-ext: slime-ext reaches the workers through ``PYTHONPATH`` (NeMo-RL
hands the driver's ``PYTHONPATH`` to its workers), or with ``NEMO_RL_PY_EXECUTABLES_SYSTEM=1`` (the workers run the
driver's Python). :func:`check_worker_environment` says so before the workers start (a refusal where the workers run
a Python of their own that cannot import slime-ext, a warning where NeMo-RL's venv is yet to be built and
``PYTHONPATH`` holds no slime-ext), and :func:`missing_slime_ext_named` turns the import error of a worker that
lacks it into one error naming the fixes.

The planner then plans the micro-batches as they run (no pad priced in).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import sys
from typing import Any, Callable, Iterator, Mapping

__all__ = ["WORKER_CLASS_FQN", "apply_worker_patches", "check_worker_environment", "missing_slime_ext_named",
           "undo_worker_patches", "unpadded_pack_parameters", "use_variable_seq_lengths", "worker_class"]

logger = logging.getLogger("slime_ext.integrations.nemo_rl")

#: what the Policy is given as ``worker_extension_cls_fqn``
WORKER_CLASS_FQN = "slime_ext.integrations.nemo_rl.worker.MegatronPolicyWorker"


def unpadded_pack_parameters(original: Callable) -> Callable:
    """``make`` of the worker patch: NeMo-RL's pack parameters without ``pad_packed_seq_to``."""

    @functools.wraps(original)
    def _get_pack_sequence_parameters_for_megatron(*args, **kwargs):
        pad_individual, pad_packed_multiple, _pad_to_longest = original(*args, **kwargs)
        return pad_individual, pad_packed_multiple, None

    return _get_pack_sequence_parameters_for_megatron


_applied: Any = None


def apply_worker_patches() -> Any:
    """Apply the worker patch (:func:`unpadded_pack_parameters`) in this process; idempotent. Returns the patch set."""
    global _applied
    if _applied is None:
        import sys

        from slime_ext.patches.nemo_rl_host import worker_patches

        patches = worker_patches(sys.modules[__name__])
        patches.apply()
        _applied = patches
    return _applied


def undo_worker_patches() -> None:
    """Undo :func:`apply_worker_patches` (a no-op when not applied)."""
    global _applied
    if _applied is not None:
        _applied.undo()
        _applied = None


def use_variable_seq_lengths(model: Any) -> None:
    """Let megatron-core's p2p carry each micro-batch's shape (and batch its p2p only below 4 stages)."""
    from megatron.core.utils import get_model_config

    from .settings import P2P_DEADLOCK_PP

    config = get_model_config(model[0] if isinstance(model, list) else model)
    config.variable_seq_lengths = True
    if config.pipeline_model_parallel_size >= P2P_DEADLOCK_PP:
        config.batch_p2p_comm = False


def worker_class() -> Any:
    """NeMo-RL's Megatron policy worker (its implementation class) as a Ray actor, with the worker patch applied
    and variable sequence lengths set once its model is built."""
    import ray
    from nemo_rl.models.policy.utils import get_runtime_env_for_policy_worker
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl

    class SlimeExtMegatronPolicyWorker(MegatronPolicyWorkerImpl):
        def __init__(self, *args, **kwargs):
            apply_worker_patches()
            super().__init__(*args, **kwargs)
            use_variable_seq_lengths(self.model)

    return ray.remote(runtime_env=get_runtime_env_for_policy_worker("megatron_policy_worker"))(
        SlimeExtMegatronPolicyWorker)


#: how slime-ext gets into NeMo-RL's Megatron workers, or how to do without it there
WORKER_ENVIRONMENT_FIX = ("put slime-ext's source on PYTHONPATH (NeMo-RL hands it to its workers), or set "
                          "NEMO_RL_PY_EXECUTABLES_SYSTEM=1 (the workers run the driver's Python, where slime-ext is "
                          "installed), or start the launcher with --pad-to-longest (enable(pad_to_longest=True)) to "
                          "keep NeMo-RL's worker class and its pad to the longest")


def _on_pythonpath(environ: Mapping[str, str]) -> bool:
    return any(os.path.isfile(os.path.join(entry, "slime_ext", "__init__.py"))
               for entry in environ.get("PYTHONPATH", "").split(os.pathsep) if entry)


def check_worker_environment(executable: str, environ: Mapping[str, str] = os.environ) -> None:
    """Before the workers start: ``executable``, the Python environment NeMo-RL's registry names for slime-ext's
    worker class (a ``uv run ...`` command, or an interpreter's path). An interpreter other than this one is asked
    to import slime-ext (with ``environ``): a :class:`~.settings.NemoRLSettingError` naming the fixes when it cannot.
    A ``uv`` command builds its venv later, from NeMo-RL's lock: a warning when ``PYTHONPATH`` holds no slime-ext
    (:func:`missing_slime_ext_named` names the error if the workers then cannot import it)."""
    from .settings import NemoRLSettingError

    if executable == sys.executable:
        return
    if executable.split()[:1] == ["uv"]:
        if not _on_pythonpath(environ):
            logger.warning("slime-ext: NeMo-RL builds the Megatron workers' venv for %s from its own lock (%s), "
                           "which has no slime-ext, and PYTHONPATH holds none; %s", WORKER_CLASS_FQN, executable,
                           WORKER_ENVIRONMENT_FIX)
        return
    probe = subprocess.run([executable, "-c", f"import {__name__}"], env=dict(environ), capture_output=True,
                           text=True, timeout=300)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise NemoRLSettingError(f"NeMo-RL's Megatron workers run {executable}, which cannot import slime-ext's "
                                 f"worker class {WORKER_CLASS_FQN} ({last}); {WORKER_ENVIRONMENT_FIX}")


@contextlib.contextmanager
def missing_slime_ext_named(active: bool) -> Iterator[None]:
    """While NeMo-RL builds its workers (``active``: with slime-ext's worker class), a worker's failure to import
    slime-ext (Ray re-raises it in the driver) becomes one :class:`~.settings.NemoRLSettingError` naming the fixes."""
    try:
        yield
    except Exception as exc:
        if active and "No module named 'slime_ext" in str(exc):
            from .settings import NemoRLSettingError

            raise NemoRLSettingError(f"NeMo-RL's Megatron workers cannot import slime-ext's worker class "
                                     f"{WORKER_CLASS_FQN}; {WORKER_ENVIRONMENT_FIX}") from exc
        raise


def __getattr__(name: str) -> Any:  # the actor class is built on first use: importing it needs NeMo-RL and Ray
    if name == "MegatronPolicyWorker":
        value = worker_class()
        globals()[name] = value
        return value
    raise AttributeError(name)
