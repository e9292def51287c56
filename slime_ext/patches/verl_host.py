"""Where slime-ext enters verl (github.com/verl-project/verl): two patches of the engine module (the engine depth,
``SLIME_EXT_VERL=1``) and one of the V1 trainer (the trainer depth, ``SLIME_EXT_VERL=trainer``), by version.

=================================================================  ==============================================
target (in ``verl.workers.engine.megatron.transformer_impl``)      change
=================================================================  ==============================================
``prepare_micro_batches`` (verl's ``engine.utils`` function, bound  slime-ext's engine-depth plan (the
here by name; the engine calls this name)                          integration's ``make_prepare_micro_batches``)
``MegatronEngine.forward_backward_batch``                          unchanged, but the running engine is kept in a
                                                                   context variable so that the plan can read its
                                                                   model dims (the cost model)
``verl.trainer.ppo.v1.trainer_base.PPOTrainer._balance_batch``   slime-ext's dispatch (the integration's
                                                                   ``make_balance_batch``), trainer depth only
=================================================================  ==============================================

Supported: verl ``>=0.9.0,<0.11`` (tested: 0.9.1 from PyPI and HEAD 1dda039 of 2026-08-22, version file
``0.10.0.dev``). The version is read off the imported ``verl.__version__``; the targets are checked as well: the
signature of ``prepare_micro_batches``, that ``forward_backward_batch`` still calls it with the arguments the
replacement takes, and that ``tensordict_utils`` has the helpers it uses. Anything else is refused with a
``PatchError`` that names what differs.

What enters verl is handed in by :mod:`slime_ext.integrations.verl` (its ``engine`` and ``trainer`` modules), which
applies these sets; this module imports nothing of slime-ext above the patches.
"""

from __future__ import annotations

from typing import Any

from . import Patch, PatchError, PatchSet, imported_version, in_context, parameters_are, source_contains

MODULE = "verl.workers.engine.megatron.transformer_impl"
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"
#: the parameters of verl's PPOTrainer._balance_batch the replacement takes, in order
BALANCE_PARAMETERS = ("self", "batch", "metrics", "logging_prefix", "keep_minibatch")
SUPPORTED = ">=0.9.0,<0.11"
TESTED = ("0.9.1", "0.10.0.dev (HEAD 1dda039, 2026-08-22)")
#: the parameters of verl's prepare_micro_batches the replacement takes, in order
PARAMETERS = ("data", "dp_group", "num_batches_divided_by", "same_micro_num_in_dp", "min_num_micro_batch",
              "use_dynamic_bsz_balance")
#: verl's tensordict helpers the replacement calls
TU_HELPERS = ("get_non_tensor_data", "index_select_tensor_dict")


def _verl_version():
    return imported_version("verl", "__version__", "verl")


def _expect_prepare(original: Any) -> str | None:
    wrong = parameters_are(PARAMETERS)(original)
    if wrong:
        return wrong
    from verl.utils import tensordict_utils as tu

    missing = [h for h in TU_HELPERS if not hasattr(tu, h)]
    return f"verl.utils.tensordict_utils lacks {missing}" if missing else None


def verl_patches(engine: Any) -> PatchSet:
    """The engine depth's patch set (a fresh one per call; :mod:`slime_ext.integrations.verl` keeps the applied
    one). ``engine``: the integration's engine module (``current_engine``, ``make_prepare_micro_batches``)."""
    common = dict(module=MODULE, distribution="verl", supported=SUPPORTED, tested=TESTED, version=_verl_version)
    return PatchSet("verl-engine", [
        Patch(name="verl-engine-context", attribute="MegatronEngine.forward_backward_batch",
              make=in_context(engine.current_engine, lambda running: running),
              doc="keeps the running engine in a context variable (the plan reads its model dims)",
              expect=source_contains("prepare_micro_batches(", "num_batches_divided_by=num_batches_divided_by",
                                     "same_micro_num_in_dp=True", "postprocess_batch_func("), **common),
        Patch(name="verl-prepare-micro-batches", attribute="prepare_micro_batches",
              make=engine.make_prepare_micro_batches,
              doc="slime-ext's engine-depth plan: lengths all-gathered over DP, one count, the cap held",
              expect=_expect_prepare, **common),
    ])


def _expect_balance(original: Any) -> str | None:
    return parameters_are(BALANCE_PARAMETERS)(original) or source_contains(
        "upsample_batch_to_divisible_size(", "_get_required_batch_multiple(", "batch.reorder(", "_dispatch_info",
        "log_seqlen_unbalance(")(original)


def trainer_patches(trainer: Any) -> PatchSet:
    """The trainer depth's patch (``SLIME_EXT_VERL=trainer``): verl's V1 ``PPOTrainer._balance_batch``.
    ``trainer``: the integration's trainer module (``make_balance_batch``)."""
    return PatchSet("verl-trainer", [
        Patch(name="verl-balance-batch", module=TRAINER_MODULE, attribute="PPOTrainer._balance_batch",
              make=trainer.make_balance_batch, distribution="verl", supported=SUPPORTED, tested=TESTED,
              version=_verl_version, expect=_expect_balance,
              doc="slime-ext's dispatch: each actor mini-batch planned across the DP ranks (equal counts, FLOPs "
                  "balanced)"),
    ])


__all__ = ["BALANCE_PARAMETERS", "MODULE", "PARAMETERS", "PatchError", "SUPPORTED", "TESTED", "TRAINER_MODULE",
           "trainer_patches", "verl_patches"]
