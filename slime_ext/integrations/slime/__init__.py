"""slime-ext inside slime (github.com/THUDM/slime): the rollout-side schedule in slime's own processes.

The switch is one line: start slime's driver through slime-ext::

    python -m slime_ext.integrations.slime train.py --balance-data --use-dynamic-batch-size ...
    # (was: python train.py ...)

That runs slime's ``train.py`` unchanged after :func:`enable`, which

1. adds slime-ext's options to slime's own parser (``--dp-schedule rollout|legacy``, and where this slime lacks
   them ``--use-dynamic-global-batch-size``, ``--disable-rollout-trim-samples``, ``--balance-by-flops``), so they
   are parsed like every slime flag;
2. patches slime's RolloutManager in the driver, before Ray ships it to its actor (see
   :mod:`slime_ext.patches.slime_host` for why it must be the driver): it plans each rollout with slime-ext;
3. sets ``--custom-megatron-init-path`` to :func:`megatron_init` (chaining a hook the user gave), which in each
   train actor switches slime v0.2.4's trainer (it plans on its own) to the sent schedule, and, where
   ``--log-probs-max-tokens-per-gpu`` is set apart from ``--max-tokens-per-gpu``, plans the log-prob passes under
   that cap (:mod:`.log_probs`);
4. on a machine without TransformerEngine, when the user gave no ``--spec``, sets slime's ``--spec`` to
   :data:`THD_LAYER_SPEC` (:func:`set_default_layer_spec`): slime packs micro-batches as THD, which megatron-core's
   local attention refuses.

A driver of your own calls :func:`enable` before slime creates the RolloutManager and parses its args with
slime's ``parse_args``. Supported slime: :data:`slime_ext.patches.slime_host.SUPPORTED_TAGS`; anything else is
refused with a ``PatchError`` that says what was expected.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from typing import Any

from slime_ext.patches import PatchError
from slime_ext.patches import on_import, slime_host
from slime_ext.schemes import DEFAULT, DP_SCHEDULES, get_dp_schedule

logger = logging.getLogger("slime_ext.integrations.slime")

__all__ = ["PatchError", "THD_LAYER_SPEC", "add_arguments", "enable", "enabled", "megatron_init",
           "set_default_layer_spec"]

#: the hook slime's train actors call (``--custom-megatron-init-path``)
MEGATRON_INIT_PATH = "slime_ext.integrations.slime.megatron_init"
#: where the user's own ``--custom-megatron-init-path`` is kept, to be chained
USER_INIT_ATTR = "slime_ext_user_megatron_init_path"
#: slime's ``--spec`` (module, callable) on a machine without TransformerEngine: ``(args, config, vp_stage) -> spec``
THD_LAYER_SPEC = ("slime_ext.training.thd_attention", "slime_layer_spec")


def enabled(args: Any) -> bool:
    """Whether slime-ext plans for this job: the default scheme (``--dp-schedule rollout``); ``legacy`` leaves slime's
    own path untouched."""
    return get_dp_schedule(getattr(args, "dp_schedule", None)) is get_dp_schedule()


def add_arguments(parser: Any) -> Any:
    """slime-ext's options, added to slime's argparse parser (each only if this slime does not have it)."""
    have = set(getattr(parser, "_option_string_actions", {}))
    group = parser.add_argument_group(title="slime-ext")
    if "--dp-schedule" not in have:
        group.add_argument("--dp-schedule", choices=DP_SCHEDULES, default=DEFAULT,
                           help="rollout: slime-ext plans micro-batches for every DP rank once per rollout "
                                "(default); legacy: slime's own path, untouched")
    if "--use-dynamic-global-batch-size" not in have:
        group.add_argument("--use-dynamic-global-batch-size", action="store_true", default=False,
                           help="slime-ext: one training step for the whole rollout batch, of whole rollouts; it "
                                "needs a sample per micro-batch slot (samples count, not rollouts) and ignores "
                                "--global-batch-size")
    if "--disable-rollout-trim-samples" not in have:
        group.add_argument("--disable-rollout-trim-samples", action="store_true", default=False,
                           help="slime-ext: never drop trailing rollouts that do not fill a step; an incomplete "
                                "step is an error instead")
    if "--balance-by-flops" not in have:
        group.add_argument("--balance-by-flops", action="store_true", default=False,
                           help="slime-ext: also balance estimated FLOPs across a step's micro-batches (dynamic "
                                "batches), under the same token cap")
    return parser


def transformer_engine_available() -> bool:
    """Whether TransformerEngine can be imported here (slime's train actors run on the driver's image)."""
    return importlib.util.find_spec("transformer_engine") is not None


def set_default_layer_spec(args: Any) -> None:
    """Without TransformerEngine and without a ``--spec`` of the user's, set slime's ``--spec`` (Megatron's
    ``[module, name]``) to :data:`THD_LAYER_SPEC`, a layer spec whose core attention takes slime's packed THD
    micro-batches; megatron-core's local attention refuses them (``assert packed_seq_params is None``)."""
    if getattr(args, "spec", None) is not None:
        logger.info(f"slime-ext: keeping the given --spec {' '.join(args.spec)}")
        return
    if transformer_engine_available():
        return
    args.spec = list(THD_LAYER_SPEC)
    logger.info(f"slime-ext: no TransformerEngine here: --spec {' '.join(THD_LAYER_SPEC)} (THD core attention)")


def _finish(args: Any) -> None:
    """After slime parsed: the layer spec without TE (:func:`set_default_layer_spec`, whatever ``--dp-schedule``);
    route slime's train-actor hook through slime-ext when slime-ext plans."""
    set_default_layer_spec(args)
    if not enabled(args):
        logger.info("slime-ext: --dp-schedule legacy, slime plans as usual")
        return
    user_hook = getattr(args, "custom_megatron_init_path", None)
    if user_hook != MEGATRON_INIT_PATH:
        setattr(args, USER_INIT_ATTR, user_hook)
        args.custom_megatron_init_path = MEGATRON_INIT_PATH
    logger.info("slime-ext: the rollout side plans every DP rank's micro-batches (--dp-schedule rollout)")


def megatron_init(args: Any) -> None:
    """slime's ``--custom-megatron-init-path`` hook, run in every train actor: switch v0.2.4's trainer to the
    sent schedule (later trainers consume it natively), plan the log-prob passes apart where
    ``--log-probs-max-tokens-per-gpu`` is set apart (:mod:`.log_probs`), then run the user's own hook, if any."""
    if enabled(args) and "train" not in _applied:
        from . import trainer

        patch_set = slime_host.train_patches(slime_host.train_revision(), enabled, trainer)
        patch_set.apply()
        _applied["train"] = patch_set
    if enabled(args) and "log_probs" not in _applied:
        from . import log_probs

        if log_probs.log_probs_cap(args) is not None:
            patch_set = slime_host.log_prob_patches(slime_host.train_revision(),
                                                    functools.partial(log_probs.wrap_compute_log_prob, enabled))
            patch_set.apply()
            _applied["log_probs"] = patch_set
            logger.info(f"slime-ext: the log-prob passes are planned apart, under --log-probs-max-tokens-per-gpu "
                        f"{args.log_probs_max_tokens_per_gpu}")
    user_hook = getattr(args, USER_INIT_ATTR, None)
    if user_hook:
        module, _, name = user_hook.rpartition(".")
        getattr(importlib.import_module(module), name)(args)


# ------------------------------------------------------------------------------------------------- driver side
_applied: dict[str, Any] = {}


def _patch_arguments(module: Any) -> None:
    if "args" not in _applied:
        patch_set = slime_host.args_patches(add_arguments, _finish)
        patch_set.apply()
        _applied["args"] = patch_set


def _patch_rollout(module: Any) -> None:
    if "rollout" not in _applied:
        from . import planner

        revision = slime_host.detect_revision()
        patch_set = slime_host.rollout_patches(revision, enabled, planner)
        patch_set.apply()
        _applied["rollout"] = patch_set
        logger.info(f"slime-ext: patched slime {revision.version} ({len(patch_set.patches)} patches)")


#: the name slime's import hook goes by (:mod:`slime_ext.patches.on_import`)
HOOK_OWNER = "slime"
#: module -> what to do right after it is imported (or at once, if it already is)
_ON_IMPORT: dict[str, on_import.Action] = {
    "slime.utils.arguments": _patch_arguments,
    "slime.ray.rollout": _patch_rollout,
}


def enable() -> None:
    """Switch slime-ext on in this (driver) process: patch slime's parser and RolloutManager now if they are
    imported, else the moment they are. Idempotent. Raises ``PatchError`` for a slime it does not know."""
    on_import.arrange(HOOK_OWNER, _ON_IMPORT)
