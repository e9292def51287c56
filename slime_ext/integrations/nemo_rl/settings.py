"""NeMo-RL's policy config (plus slime-ext's own options) -> what :func:`.plan.plan_shards` needs, and every setting
slime-ext refuses, with the fix. Read once, when a ``Policy`` is built.

Refused (each a :class:`NemoRLSettingError` naming the setting and the fix):

* ``policy.megatron_cfg.enabled`` off: slime-ext plans NeMo-RL's Megatron backend; the DTensor backend is not
  planned (and would silently get NeMo-RL's own batching);
* neither ``policy.sequence_packing.enabled`` nor ``policy.dynamic_batching.enabled``: with fixed micro-batches of
  ``train_micro_batch_size`` rows there is nothing to plan;
* ``train_mb_tokens`` / ``logprob_mb_tokens`` missing or not a positive integer, or below the context-parallel size;
* ``variable_seq_lengths`` with ``batch_p2p_comm`` at pipeline-parallel size 4 or more (``megatron_cfg``): Megatron-LM
  issue 5100 reports that megatron-core's batched p2p deadlocks there when shapes travel per micro-batch;
* under pipeline parallelism without the ``pad_to_longest`` opt-out, where slime-ext's worker class runs packed
  micro-batches at their own length (:mod:`.worker`): ``batch_p2p_comm`` set at pipeline-parallel size 4 or more
  (the same deadlock), and ``policy.quant_cfg`` (NeMo-RL then runs its quantized worker class, which slime-ext's
  would replace); a ``worker_extension_cls_fqn`` of the caller's is refused when the ``Policy`` is built
  (:mod:`.runtime`).

Changed (behind the switch only):

* ``dynamic_batching.enabled``: slime-ext's micro-batches are packed, never padded to their longest row, so a policy
  asking for dynamic batching is run as sequence packing with the same caps (``train_mb_tokens``,
  ``logprob_mb_tokens``) and the row rounding ``make_sequence_length_divisible_by``. That is also what lifts
  NeMo-RL's "dynamic batching only with one pipeline stage" assert: packing runs under pipeline parallelism.
* ``sequence_packing.algorithm`` and ``microbatch_order``: slime-ext packs, distributes and orders; they are used
  only where NeMo-RL's worker pads every micro-batch to the longest (pipeline parallelism with the
  ``pad_to_longest`` opt-out), where NeMo-RL's own sharding with them is priced beside slime-ext's plan and runs
  when it is predicted faster (:mod:`.runtime`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

from slime_ext.schedule import CostModel, CostProfile, ParallelConfig

__all__ = ["NemoRLSettingError", "Options", "PolicyLayout", "layout_from_config", "run_as_packing"]

#: megatron-core's batched p2p with per-micro-batch shapes deadlocks from this pipeline size (Megatron-LM #5100)
P2P_DEADLOCK_PP = 4


class NemoRLSettingError(ValueError):
    """A NeMo-RL setting slime-ext cannot honour; the message names it and the fix."""


@dataclass(frozen=True)
class Options:
    """slime-ext's own settings for NeMo-RL (the launcher's flags, or :func:`..enable`'s keywords).

    ``cost_model``: the model's dims (:class:`~slime_ext.schedule.CostModel`), to balance and order by estimated
    FLOPs; ``cost_profile``: a JSON file from ``slime-ext calibrate``, to do it by measured seconds. Neither:
    tokens.
    """

    cost_model: CostModel | None = None
    cost_profile: str | None = None
    #: under pipeline parallelism, keep NeMo-RL's pad of every packed micro-batch to the longest of its global batch
    #: and NeMo-RL's own worker class. Off (the default): the Policy starts slime-ext's worker class (:mod:`.worker`),
    #: which runs each packed micro-batch at its own length (megatron-core's variable_seq_lengths) and needs
    #: slime-ext importable in the Megatron workers' environment. Turn it on where the workers cannot import
    #: slime-ext, or to keep a worker class of your own. No effect at one pipeline stage.
    pad_to_longest: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.pad_to_longest, bool):
            raise NemoRLSettingError(f"pad_to_longest = {self.pad_to_longest!r} must be True or False")
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise NemoRLSettingError(f"cost_model = {self.cost_model!r} must be a CostModel (the model's dims) or "
                                     f"None")
        if self.cost_profile is not None and not isinstance(self.cost_profile, str):
            raise NemoRLSettingError(f"cost_profile = {self.cost_profile!r} must be the path of a JSON file from "
                                     f"`slime-ext calibrate`, or None")
        if self.cost_model is not None and self.cost_profile is not None:
            raise NemoRLSettingError("pass cost_model or cost_profile, not both: a measured profile replaces the "
                                     "FLOPs estimate")

    def costs(self) -> CostModel | CostProfile | None:
        return CostProfile.load(self.cost_profile) if self.cost_profile else self.cost_model


@dataclass(frozen=True)
class PolicyLayout:
    """What the plan reads off one policy config: the Megatron layout (without DP, which is the shard count), the
    caps of the two passes and the row rounding."""

    pp_size: int
    vpp_size: int
    cp_size: int
    tp_size: int
    train_mb_tokens: int
    logprob_mb_tokens: int
    pad_multiple: int
    #: slime-ext's worker class runs packed micro-batches at their own length (pipeline parallelism without the
    #: ``pad_to_longest`` opt-out); else, under PP, NeMo-RL's worker pads them to the longest
    variable_seq_lengths: bool = False

    @property
    def padded_to_longest(self) -> bool:
        """Whether NeMo-RL's worker pads every packed micro-batch of a global batch to the longest one."""
        return self.pp_size > 1 and not self.variable_seq_lengths

    def parallel(self, dp_size: int) -> ParallelConfig:
        return ParallelConfig(dp_size=dp_size, pp_size=self.pp_size, vpp_size=self.vpp_size, cp_size=self.cp_size,
                              tp_size=self.tp_size)

    def cap(self, forward_only: bool) -> int:
        return self.logprob_mb_tokens if forward_only else self.train_mb_tokens


def _positive(value: Any, name: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NemoRLSettingError(f"{name} = {value!r} must be a positive integer; {fix}")
    return value


def _batching(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """``("sequence_packing" | "dynamic_batching", its section)``; refuses a policy with neither."""
    for key in ("sequence_packing", "dynamic_batching"):
        section = config.get(key) or {}
        if section.get("enabled"):
            return key, section
    raise NemoRLSettingError("policy.sequence_packing.enabled and policy.dynamic_batching.enabled are both off: "
                             "micro-batches of train_micro_batch_size rows leave slime-ext nothing to plan; set "
                             "policy.sequence_packing.enabled=true (with train_mb_tokens and logprob_mb_tokens), or "
                             "start NeMo-RL without slime-ext's launcher")


def layout_from_config(config: Mapping[str, Any], pad_to_longest: bool = False) -> PolicyLayout:
    """Read and check one policy config (the module docstring lists the refusals); ``pad_to_longest``: the opt-out
    of that name (:class:`Options`)."""
    mcfg = config.get("megatron_cfg") or {}
    if not mcfg.get("enabled"):
        raise NemoRLSettingError("policy.megatron_cfg.enabled is off: slime-ext plans NeMo-RL's Megatron backend "
                                 "only; enable policy.megatron_cfg, or start the DTensor backend "
                                 "without slime-ext's launcher")
    key, section = _batching(config)
    pp = _positive(mcfg.get("pipeline_model_parallel_size", 1), "policy.megatron_cfg.pipeline_model_parallel_size",
                   "set the pipeline-parallel size")
    vpp = _positive(mcfg.get("virtual_pipeline_model_parallel_size") or 1,
                    "policy.megatron_cfg.virtual_pipeline_model_parallel_size",
                    "set the virtual pipeline size (null or 1 for none)")
    cp = _positive(mcfg.get("context_parallel_size", 1), "policy.megatron_cfg.context_parallel_size",
                   "set the context-parallel size")
    tp = _positive(mcfg.get("tensor_model_parallel_size", 1), "policy.megatron_cfg.tensor_model_parallel_size",
                   "set the tensor-parallel size")
    if pp >= P2P_DEADLOCK_PP and mcfg.get("variable_seq_lengths") and mcfg.get("batch_p2p_comm"):
        raise NemoRLSettingError(
            f"policy.megatron_cfg sets variable_seq_lengths and batch_p2p_comm at pipeline_model_parallel_size = "
            f"{pp}: megatron-core's batched p2p deadlocks with per-micro-batch shapes from {P2P_DEADLOCK_PP} stages "
            f"(Megatron-LM issue 5100); set policy.megatron_cfg.batch_p2p_comm=false")
    unpadded = pp > 1 and not pad_to_longest
    if unpadded:
        _check_unpadded_workers(config, mcfg, pp)
    caps = {}
    for name in ("train_mb_tokens", "logprob_mb_tokens"):
        caps[name] = _positive(section.get(name), f"policy.{key}.{name}",
                               f"set policy.{key}.{name} (the most tokens of one micro-batch)")
        if caps[name] < cp:
            raise NemoRLSettingError(f"policy.{key}.{name} = {caps[name]} is below context_parallel_size = {cp}: a "
                                     f"micro-batch is split over the CP ranks; raise policy.{key}.{name}")
    pad = _positive(config.get("make_sequence_length_divisible_by", 1), "policy.make_sequence_length_divisible_by",
                    "set the row rounding (a multiple of 2*cp, and of tp with sequence parallelism)")
    return PolicyLayout(pp_size=pp, vpp_size=vpp, cp_size=cp, tp_size=tp, pad_multiple=pad,
                        variable_seq_lengths=unpadded, **caps)


#: the opt-out, as the launcher and :func:`..enable` spell it (named by every refusal it is the fix of)
PAD_TO_LONGEST_FIX = "start the launcher with --pad-to-longest (enable(pad_to_longest=True))"


def _check_unpadded_workers(config: Mapping[str, Any], mcfg: Mapping[str, Any], pp: int) -> None:
    """The refusals of slime-ext's worker class, which runs under PP unless ``pad_to_longest`` is set."""
    if pp >= P2P_DEADLOCK_PP and mcfg.get("batch_p2p_comm"):
        raise NemoRLSettingError(
            f"policy.megatron_cfg.batch_p2p_comm is set at pipeline_model_parallel_size = {pp}, and slime-ext runs "
            f"packed micro-batches at their own length under PP (megatron-core's variable_seq_lengths: a shape per "
            f"micro-batch): batched p2p deadlocks there (Megatron-LM issue 5100); set "
            f"policy.megatron_cfg.batch_p2p_comm=false, or {PAD_TO_LONGEST_FIX} to keep NeMo-RL's pad")
    if config.get("quant_cfg") is not None:
        raise NemoRLSettingError(
            "policy.quant_cfg is set: NeMo-RL runs its quantized Megatron worker class, and slime-ext's worker class "
            "(packed micro-batches at their own length under PP) would replace it; "
            f"{PAD_TO_LONGEST_FIX} to keep NeMo-RL's worker class and its pad to the longest")


def run_as_packing(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The policy config NeMo-RL is built with behind the switch: a copy in which dynamic batching is run as
    sequence packing with the same caps (the module docstring), or ``None`` when ``config`` already packs."""
    if (config.get("sequence_packing") or {}).get("enabled"):
        return None
    dynamic = config["dynamic_batching"]
    converted = copy.deepcopy(dict(config))
    converted["dynamic_batching"] = {**dynamic, "enabled": False}
    converted["sequence_packing"] = {
        **(config.get("sequence_packing") or {}), "enabled": True, "train_mb_tokens": dynamic["train_mb_tokens"],
        "logprob_mb_tokens": dynamic["logprob_mb_tokens"],
        "algorithm": (config.get("sequence_packing") or {}).get("algorithm", "modified_first_fit_decreasing")}
    return converted
