"""Megatron-LM's parsed args (plus slime-ext's own options) -> what :func:`.plan.plan_collection` needs, and every
setting slime-ext refuses, with the fix. Read once per job, before the first rollout is collected.

Refused (each a :class:`MegatronRLSettingError` naming the setting and the fix):

* ``--rl-use-sequence-packing`` off: slime-ext plans Megatron-RL's packed micro-batches; without packing there is
  nothing for it to plan (and off, the user would silently get Megatron-RL's own unpacked path).
* ``--calculate-per-token-loss`` off: Megatron then weighs each micro-batch's token mean equally
  (``forward_step_calc_loss`` divides by the micro-batch's tokens and the micro-batch count), so the gradient depends
  on how samples are packed; slime-ext packs differently from Megatron-RL, so the same data would train differently.
  With per-token loss the gradient is the token mean over the step whatever the packing. (Every ``examples/rl``
  config of Megatron-LM sets it.)
* ``--rl-training-cuda-graphs`` and full-iteration CUDA graphs (``--cuda-graph-impl full_iteration``, or ``local``
  with the ``full_iteration`` scope in older releases): captured graphs need every micro-batch the same shape, and
  slime-ext's micro-batches hold only real tokens, so their lengths differ.
* ``--micro-batch-size`` other than 1 (Megatron-RL's packing itself asserts it).
* ``--gtp-weight-remat-size`` above 1 (Megatron-LM HEAD): its peers each consume their own micro-batches;
* a ``--seq-length`` that is not a multiple of the row multiple (``tp * cp`` with sequence parallelism, ``2 * cp``
  with context parallelism);
* ``max_tokens_per_gpu * cp_size`` above ``--seq-length``: Megatron-RL keeps its packed buffers ``seq_length``
  wide (``prepare_data_for_update`` packs the inference log-probs at that width).

Kept as they are, and what slime-ext does with them instead:

* ``--rl-sequence-packing-algo`` (fifo / round-robin): slime-ext distributes the micro-batches itself;
* ``--rl-sequence-packing-max-sequences-per-bin``: its purpose is a fixed ``cu_seqlens`` size for CUDA graphs (refused
  above) and a bound on imbalance, which slime-ext balances by FLOPs; slime-ext's ``cu_seqlens`` are exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime_ext.schedule import CostModel, CostProfile, ParallelConfig, ScheduleError

__all__ = ["MegatronRLSettingError", "Options", "PlanSettings"]


class MegatronRLSettingError(ValueError):
    """A Megatron-LM setting slime-ext cannot honour; the message names it and the fix."""


@dataclass(frozen=True)
class Options:
    """slime-ext's own settings for Megatron-RL (the launcher's flags, or :func:`..enable`'s keywords).

    ``max_tokens_per_gpu``: the most tokens of one micro-batch per GPU (slime's name); a micro-batch holds at most
    ``max_tokens_per_gpu * context_parallel_size`` tokens before context parallelism splits it. ``None``: Megatron-RL's
    own bin size, ``--seq-length`` (divided by the CP size). ``cost_profile``: a JSON file from ``slime-ext
    calibrate``: balance and order by measured seconds instead of FLOPs from the model dims.
    """

    max_tokens_per_gpu: int | None = None
    cost_profile: str | None = None

    def __post_init__(self) -> None:
        value = self.max_tokens_per_gpu
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise MegatronRLSettingError(f"max_tokens_per_gpu = {value!r} must be a positive integer (tokens of one "
                                         f"micro-batch per GPU), or None for --seq-length")
        if self.cost_profile is not None and not isinstance(self.cost_profile, str):
            raise MegatronRLSettingError(f"cost_profile = {self.cost_profile!r} must be the path of a JSON file "
                                         f"from `slime-ext calibrate`, or None")


def _get(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def _full_iteration_graphs(args: Any) -> str | None:
    """The flag that asks for full-iteration CUDA graphs, as this Megatron-LM spells it; ``None`` when off."""
    impl = _get(args, "cuda_graph_impl", "none")
    if str(impl) == "full_iteration":
        return "--cuda-graph-impl full_iteration"
    scope = _get(args, "cuda_graph_scope", []) or []
    scopes = scope if isinstance(scope, (list, tuple)) else [scope]
    if str(impl) == "local" and any(str(s).split(".")[-1] in ("full_iteration", "full") for s in scopes):
        return f"--cuda-graph-impl local --cuda-graph-scope {' '.join(str(s).split('.')[-1] for s in scopes)}"
    return None


@dataclass(frozen=True)
class PlanSettings:
    """What :func:`.plan.plan_collection` takes besides the row lengths, read off Megatron-LM's args."""

    parallel: ParallelConfig
    #: optimizer steps per pass over a collection: ``grpo_prompts_per_step * grpo_group_size // global_batch_size``,
    #: as Megatron-LM's ``train()`` counts them
    num_steps: int
    #: most tokens of one micro-batch (before context parallelism splits it)
    cap: int
    #: every sequence's slot is a multiple of this (``2 * cp`` under context parallelism, as Megatron-RL packs)
    seq_length_multiple: int
    #: a micro-batch's row length is a multiple of this (``tp * cp`` with sequence parallelism, else 1)
    token_multiple: int
    cost_model: CostModel | CostProfile | None
    seq_length: int

    @classmethod
    def from_args(cls, args: Any, options: Options | None = None) -> "PlanSettings":
        """Check Megatron-LM's parsed ``args`` (the module docstring's refusals) and read the plan's inputs."""
        options = options or Options()
        if not _get(args, "rl_use_sequence_packing", False):
            raise MegatronRLSettingError(
                "slime-ext is on but --rl-use-sequence-packing is off: slime-ext plans Megatron-RL's packed "
                "micro-batches; add --rl-use-sequence-packing, or run train_rl.py without slime-ext")
        if not _get(args, "calculate_per_token_loss", False):
            raise MegatronRLSettingError(
                "slime-ext is on but --calculate-per-token-loss is off: without it Megatron weighs each "
                "micro-batch's token mean equally, so the gradient would depend on how samples are packed, and "
                "slime-ext packs differently from Megatron-RL; add --calculate-per-token-loss (every examples/rl "
                "config sets it), or run without slime-ext")
        if _get(args, "rl_training_cuda_graphs", False):
            raise MegatronRLSettingError(
                "slime-ext is on but --rl-training-cuda-graphs is set: CUDA graphs need every micro-batch the same "
                "shape, and slime-ext's micro-batches hold only real tokens; drop --rl-training-cuda-graphs, or run "
                "without slime-ext")
        graphs = _full_iteration_graphs(args)
        if graphs:
            raise MegatronRLSettingError(
                f"slime-ext is on but full-iteration CUDA graphs are ({graphs}): they need fixed micro-batch shapes, "
                f"and slime-ext's micro-batches hold only real tokens; use another --cuda-graph-impl, or run without "
                f"slime-ext")
        if _get(args, "micro_batch_size", 1) != 1:
            raise MegatronRLSettingError(
                f"--micro-batch-size {args.micro_batch_size}: Megatron-RL's sequence packing trains one packed "
                f"micro-batch at a time; pass --micro-batch-size 1")
        gtp = int(_get(args, "gtp_weight_remat_size", 1))
        if gtp != 1:
            raise MegatronRLSettingError(
                f"--gtp-weight-remat-size {gtp}: slime-ext plans one micro-batch stream per data-parallel rank and "
                f"does not split it over weight-rematerialisation peers; run with --gtp-weight-remat-size 1, or "
                f"without slime-ext")
        seq_length = int(_get(args, "seq_length", 0))
        if seq_length < 1:
            raise MegatronRLSettingError(f"--seq-length {seq_length!r}: Megatron-RL needs a positive --seq-length")
        cp = int(_get(args, "context_parallel_size", 1))
        tp = int(_get(args, "tensor_model_parallel_size", 1))
        if options.max_tokens_per_gpu is None:
            cap = seq_length
        else:
            cap = options.max_tokens_per_gpu * cp
            if cap > seq_length:
                raise MegatronRLSettingError(
                    f"--max-tokens-per-gpu {options.max_tokens_per_gpu} x context parallel size {cp} = {cap} tokens "
                    f"per micro-batch is above --seq-length {seq_length}: Megatron-RL's packed buffers are "
                    f"seq_length wide; pass --max-tokens-per-gpu <= {seq_length // cp}, or raise --seq-length")
        prompts = int(_get(args, "grpo_prompts_per_step", 0))
        group = int(_get(args, "grpo_group_size", 0))
        gbs = int(_get(args, "global_batch_size", 0))
        if prompts < 1 or group < 1 or gbs < 1 or gbs > prompts * group:
            raise MegatronRLSettingError(
                f"--global-batch-size {gbs} with --grpo-prompts-per-step {prompts} x --grpo-group-size {group} = "
                f"{prompts * group} samples per collection: a collection must hold at least one global batch; lower "
                f"--global-batch-size or raise the collection size")
        dp = _get(args, "data_parallel_size")
        if dp is None:
            raise MegatronRLSettingError("args.data_parallel_size is unset: read the settings after Megatron-LM's "
                                         "validate_args (which computes it)")
        layout = _get(args, "pipeline_model_parallel_layout")
        try:
            parallel = ParallelConfig.from_megatron(
                int(dp), context_parallel_size=cp,
                pipeline_model_parallel_size=_get(args, "pipeline_model_parallel_size", 1),
                virtual_pipeline_model_parallel_size=_get(args, "virtual_pipeline_model_parallel_size"),
                microbatch_group_size_per_vp_stage=_get(args, "microbatch_group_size_per_vp_stage"),
                overlap_p2p_comm=_get(args, "overlap_p2p_comm"),
                tensor_model_parallel_size=tp,
                decoder_first_pipeline_num_layers=_get(args, "decoder_first_pipeline_num_layers"),
                decoder_last_pipeline_num_layers=_get(args, "decoder_last_pipeline_num_layers"),
                pipeline_model_parallel_layout=None if layout is None else str(layout),
                account_for_embedding_in_pipeline_split=_get(args, "account_for_embedding_in_pipeline_split", False),
                account_for_loss_in_pipeline_split=_get(args, "account_for_loss_in_pipeline_split", False))
            if options.cost_profile:
                cost_model: CostModel | CostProfile | None = CostProfile.load(options.cost_profile)
            else:
                cost_model = CostModel.from_args(args)
        except ScheduleError as exc:
            raise MegatronRLSettingError(f"slime-ext cannot plan this Megatron-LM layout: {exc}") from exc
        sequence_parallel = bool(_get(args, "sequence_parallel", False)) and tp > 1
        row_multiple = tp * cp if sequence_parallel else 1
        if seq_length % row_multiple or (cp > 1 and seq_length % (2 * cp)):
            need = row_multiple * 2 if cp > 1 and row_multiple % (2 * cp) else row_multiple
            raise MegatronRLSettingError(
                f"--seq-length {seq_length} is not a multiple of {max(need, 2 * cp if cp > 1 else 1)}: a packed "
                f"micro-batch's row is padded to a multiple of tp*cp = {row_multiple} (sequence parallelism) and "
                f"every sequence to 2*cp; make --seq-length a multiple of it")
        return cls(parallel=parallel, num_steps=(prompts * group) // gbs, cap=cap,
                   seq_length_multiple=2 * cp if cp > 1 else 1,
                   token_multiple=tp * cp if sequence_parallel else 1,
                   cost_model=cost_model, seq_length=seq_length)
