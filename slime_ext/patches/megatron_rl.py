"""Megatron-LM's own RL loop (``train_rl.py``, ``megatron/rl``; github.com/NVIDIA/Megatron-LM) as a host: where
slime-ext's plan enters Megatron-LM's code.

Megatron-LM is a source checkout, not a release: its version is read from the imported
``megatron.core.package_info`` (a tree at tag ``core_v0.19.0`` reports 0.19.1; HEAD d98e8a6 of 2026-08-22 reports
0.20.0). Each patch also checks that the code around it is still the code it was written for (``expect``): the
functions it replaces and, where the replacement relies on how they are called, their callers.

=================================================  ==================================================================
target                                              why
=================================================  ==================================================================
``megatron.rl.rl_utils.pack_all_trajectories``      plan the collection, pack this rank's micro-batches
``megatron.rl.rl_utils.load_packed_data_by_index``  a micro-batch cut to its own length (``train_rl`` binds this name
                                                    when it is imported: enable slime-ext first)
``megatron.rl.rl_utils.compute_logprobs_batch``     the log-prob passes, one schedule call per collection
(``_compute_logprobs_batch`` in 0.16)
``megatron.rl.rl_utils.update_microbatch_calculator``  step 0's count instead of ``ceil(ratio * bins)``
``megatron.rl.rl_utils.get_grpo_data_iterator``     settings checked, model chunks kept, one iterator per VPP chunk
``megatron.rl.rl_utils.get_iteration_sequence_count``  ``consumed_train_samples`` by the samples trained
``megatron.training.training.train_step``           each step's count; the LR stepped by the step's samples
``megatron.core.parallel_state.is_pipeline_last_stage``  VPP: answered for the chunk that runs (``train_rl`` binds
                                                    this name when it is imported)
``megatron.rl.rl_utils.is_pp_last_stage``           VPP: the same, as ``get_logprobs`` asks it
``megatron.rl.rl_utils.get_packing_compute_tokens``  throughput logs count the tokens really computed (0.19+)
``megatron.rl.rl_utils.get_packing_efficiency``     and real over computed tokens (0.19+)
=================================================  ==================================================================

What each replacement does is :mod:`slime_ext.integrations.megatron_rl.runtime`'s (handed to
:func:`megatron_rl_patches`); every one of them leaves data that is not slime-ext's to Megatron-LM's original.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from . import ImportedVersion, Patch, PatchError, PatchSet, imported_version

DISTRIBUTION = "Megatron-LM"
#: what the imported megatron.core.package_info may say
SUPPORTED = ">=0.16.1,<0.21"
#: the trees the host tests ran (ci/megatron_rl_test): tags core_v0.16.1, core_v0.19.0 (0.19.1), HEAD d98e8a6 (0.20.0)
TESTED = ("0.16.1 (core_v0.16.1)", "0.19.1 (core_v0.19.0)", "0.20.0 (HEAD d98e8a6)")


def megatron_lm_version() -> ImportedVersion:
    """The Megatron-LM tree's version: its ``megatron.core.package_info.__version__``."""
    return imported_version("megatron.core.package_info", "__version__", "megatron-core")


def _source(module: str, attribute: str) -> str:
    obj: Any = importlib.import_module(module)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise PatchError(f"cannot read the source of {module}.{attribute} ({exc})") from exc


def calls(*checks: tuple[str, str, tuple[str, ...]]) -> Callable[[Any], str | None]:
    """An ``expect``: each ``(module, function, needles)`` -- the function's source holds every needle (the code that
    calls the patched target, or the target itself, is still the code the patch was written for)."""

    def check(original: Any) -> str | None:
        for module, attribute, needles in checks:
            source = _source(module, attribute)
            missing = [n for n in needles if n not in source]
            if missing:
                return f"{module}.{attribute} no longer contains {missing}"
        return None

    return check


def _has(module: str, attribute: str) -> Callable[[], str | None]:
    def needed() -> str | None:
        if hasattr(importlib.import_module(module), attribute):
            return None
        return f"this Megatron-LM has no {module}.{attribute}"

    return needed


RL = "megatron.rl.rl_utils"
TRAINING = "megatron.training.training"


def megatron_rl_patches(runtime: Any) -> PatchSet:
    """The patch set; ``runtime`` provides the replacements (``make_<name>(original) -> replacement``)."""

    def patch(name: str, module: str, attribute: str, make: Callable, doc: str, expect=None, needed=None) -> Patch:
        return Patch(name=name, module=module, attribute=attribute, make=make, distribution=DISTRIBUTION,
                     supported=SUPPORTED, tested=TESTED, doc=doc, expect=expect, version=megatron_lm_version,
                     needed=needed)

    def logprobs(name: str, attribute: str, note: str, *callers: tuple[str, str, tuple[str, ...]]) -> Patch:
        """The log-prob pass, under the name this Megatron-LM gives it (the other name's patch is not needed)."""
        return patch(name, RL, attribute, runtime.make_compute_logprobs_batch,
                     f"the log-prob passes run every micro-batch of the collection in one schedule call{note}",
                     calls((RL, attribute, ("num_microbatches=1", "forward_only=True")), *callers),
                     needed=_has(RL, attribute))

    prepare = (RL, "prepare_data_for_update", ("pack_all_trajectories(", "update_microbatch_calculator(",
                                               "get_microbatch_dataloader(", "load_state_dict(ref_state_dict)",
                                               "itertools.cycle(loader)"))
    patches = [
        patch("pack", RL, "pack_all_trajectories", runtime.make_pack_all_trajectories,
              "slime-ext plans the collection and packs this rank's micro-batches of real tokens",
              calls(prepare, (RL, "pack_all_trajectories", ("bin_seq_indices", "PackingContext(")))),
        patch("load", RL, "load_packed_data_by_index", runtime.make_load_packed_data_by_index,
              "a micro-batch is cut to its own length, with its exact PackedSeqParams",
              calls((RL, "load_packed_data_by_index", ("cached_packed_seq_params[bin_idx]", "packed_trajs[idx]")),
                    (RL, "logprobs_forward_step", ("load_packed_data_by_index(",)))),
        logprobs("logprobs", "compute_logprobs_batch", "",
                 (RL, "prepare_data_for_update", ("compute_logprobs_batch(",))),
        logprobs("logprobs-0.16", "_compute_logprobs_batch", " (0.16's name)"),
        patch("calculator", RL, "update_microbatch_calculator", runtime.make_update_microbatch_calculator,
              "the micro-batch calculator starts at the plan's step-0 count"),
        patch("iterator", RL, "get_grpo_data_iterator", runtime.make_get_grpo_data_iterator,
              "settings checked, model chunks kept, one data iterator per VPP chunk",
              calls((RL, "get_grpo_data_iterator", ("prepare_data_for_update(", "buffered_rollouts")),
                    (TRAINING, "train", ("rl_utils.get_grpo_data_iterator(",)))),
        patch("sequences", RL, "get_iteration_sequence_count", runtime.make_get_iteration_sequence_count,
              "consumed_train_samples advances by the samples each step trained",
              calls((TRAINING, "train", ("rl_utils.get_iteration_sequence_count(args)",
                                         "consumed_train_samples += iteration_sequences")))),
        patch("train-step", TRAINING, "train_step", runtime.make_train_step,
              "each optimizer step runs its planned count; the LR scheduler steps by the step's samples",
              calls((TRAINING, "train_step", ("opt_param_scheduler.step(increment=increment)",
                                              "num_microbatches=get_num_microbatches()")),
                    (TRAINING, "train", ("train_step(",)))),
        patch("last-stage", "megatron.core.parallel_state", "is_pipeline_last_stage",
              runtime.make_is_pipeline_last_stage,
              "VPP: is_pipeline_last_stage() inside a chunk's forward step answers for that chunk",
              calls(("megatron.core.parallel_state", "is_pipeline_last_stage", ("ignore_virtual", "vp_stage")))),
        patch("last-stage-rl", RL, "is_pp_last_stage", runtime.make_is_pp_last_stage,
              "VPP: get_logprobs' is_pp_last_stage(pp_group) answers for the chunk that runs",
              calls((RL, "get_logprobs", ("is_pp_last_stage(pp_group)",)))),
        patch("compute-tokens", RL, "get_packing_compute_tokens", runtime.make_packing_compute_tokens,
              "throughput logs count the tokens slime-ext's micro-batches compute",
              needed=_has(RL, "get_packing_compute_tokens")),
        patch("efficiency", RL, "get_packing_efficiency", runtime.make_packing_efficiency,
              "throughput logs: real over computed tokens",
              needed=_has(RL, "get_packing_efficiency")),
    ]
    return PatchSet("megatron-rl", patches)


def check_logprob_patch(patches: PatchSet) -> None:
    """One of the two log-prob pass patches must apply: a Megatron-LM with neither name is not one we know."""
    names = {p.name: p for p in patches}
    if not (names["logprobs"].applied or names["logprobs-0.16"].applied):
        raise PatchError(f"{RL} has neither compute_logprobs_batch nor _compute_logprobs_batch: this Megatron-LM "
                         f"({megatron_lm_version()}) computes its log-prob passes elsewhere; slime-ext supports "
                         f"Megatron-LM {SUPPORTED} (tested: {', '.join(TESTED)})")
