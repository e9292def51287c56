"""The planner's inputs besides the samples: the parallel layout and slime's batch flags, frozen and checked once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ScheduleError
from .pipeline_layout import StageLayers, check_layout_flags, layout_vpp_size, split_layers
from .validate import MAX_MODEL_DIM, MAX_PARALLEL_SIZE, MAX_SAMPLES, MAX_TOKENS, check_bool, check_int, is_int, show

#: Keys of slime's ``train_parallel_config`` dict that the scheduler reads (the dict may carry any field).
PARALLEL_KEYS = ("dp_size", "cp_size", "vpp_size", "microbatch_group_size_per_vp_stage")
#: Megatron's flags that place layers on pipeline stages (argparse dests); the per-stage costs follow them
LAYOUT_FLAGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split")
#: slime flag names (argparse dests) that the scheduler reads.
BATCH_FLAGS = ("global_batch_size", "use_dynamic_batch_size", "max_tokens_per_gpu", "micro_batch_size", "balance_data",
               "balance_by_flops", "use_dynamic_global_batch_size", "disable_rollout_trim_samples")

_BOOL_FLAGS = ("use_dynamic_batch_size", "balance_data", "balance_by_flops", "use_dynamic_global_batch_size",
               "disable_rollout_trim_samples", "dynamic_global_batch_rounds_samples")


def _positive_int(obj: Any, name: str, maximum: int, fix: str) -> int:
    """Check ``obj.name`` and store it back as a plain ``int`` (numpy integers are accepted)."""
    value = check_int(name, getattr(obj, name), maximum=maximum, fix=fix)
    object.__setattr__(obj, name, value)
    return value


@dataclass(frozen=True)
class ParallelConfig:
    """The training job's parallel layout (slime's ``train_parallel_config`` plus the pipeline and tensor sizes)."""

    #: data-parallel ranks, each with the same micro-batch count per step; ``None``: whatever the world size
    #: leaves (:meth:`for_world` resolves it; the planner refuses a layout without it)
    dp_size: int | None = 1
    cp_size: int = 1  # context-parallel size: a micro-batch may hold max_tokens_per_gpu * cp_size tokens
    vpp_size: int = 1  # virtual pipeline stages per rank (Megatron's interleaved schedule)
    #: with vpp_size > 1, every step's micro-batch count is a multiple of dp_size times this; ``None``: Megatron's
    #: default, the pipeline size (required when pp_size is 1); 1 without VPP
    microbatch_group_size_per_vp_stage: int | None = None
    #: pipeline stages; with pp_size > 1 the planner minimises the slowest replica's predicted makespan
    pp_size: int = 1
    #: Megatron's ``overlap_p2p_comm`` under VPP (p2p posted early, waited just before use); False without VPP
    overlap_p2p_comm: bool = False
    #: tensor-parallel size: only the world-size arithmetic (:meth:`for_world`) and the CLI's estimates read it
    tp_size: int = 1
    #: Megatron's layout flags (:mod:`.pipeline_layout`): decoder layers on the first / last pipeline rank (``None``:
    #: even), a layout string such as ``"Ett|(tt|)*6,tL"`` (it fixes vpp_size), and whether the embedding / loss
    #: counts as a layer in the even split
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    pipeline_model_parallel_layout: str | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    def __post_init__(self) -> None:
        if self.dp_size is not None:  # None: resolved later by for_world
            _positive_int(self, "dp_size", MAX_PARALLEL_SIZE, "pass the data-parallel world size (>= 1)")
        _positive_int(self, "cp_size", MAX_PARALLEL_SIZE, "pass the context-parallel size (>= 1)")
        _positive_int(self, "pp_size", MAX_PARALLEL_SIZE, "pass 1 without pipeline parallelism")
        _positive_int(self, "vpp_size", MAX_PARALLEL_SIZE, "pass 1 without virtual pipeline parallelism")
        _positive_int(self, "tp_size", MAX_PARALLEL_SIZE, "pass 1 without tensor parallelism")
        self._check_layout_flags()  # before the group size: a layout string is what sets vpp_size
        if self.microbatch_group_size_per_vp_stage is None:  # Megatron's default, the pipeline size
            if self.vpp_size > 1 and self.pp_size == 1:  # never a silent 1 where it matters
                raise ScheduleError(
                    f"microbatch_group_size_per_vp_stage is None but vpp_size = {self.vpp_size}; pass it (Megatron "
                    f"defaults it to the pipeline-parallel size, and pp_size is 1 here)"
                )
            object.__setattr__(self, "microbatch_group_size_per_vp_stage", self.pp_size)
        group = _positive_int(self, "microbatch_group_size_per_vp_stage", MAX_PARALLEL_SIZE,
                              "Megatron defaults it to the pipeline-parallel size: pass that")
        if self.vpp_size > 1 and self.pp_size > 1 and group < self.pp_size:
            raise ScheduleError(
                f"microbatch_group_size_per_vp_stage={group}: Megatron's interleaved schedule needs it >= pp_size "
                f"= {self.pp_size}; pass a group size >= {self.pp_size}, or leave it unset for Megatron's default "
                f"(the pipeline size)"
            )
        if self.vpp_size == 1:  # neither changes a plan without VPP: configs that plan alike compare equal
            object.__setattr__(self, "microbatch_group_size_per_vp_stage", 1)
        overlap = check_bool("overlap_p2p_comm", self.overlap_p2p_comm)
        object.__setattr__(self, "overlap_p2p_comm", overlap and self.vpp_size > 1)

    def _check_layout_flags(self) -> None:
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            if getattr(self, name) is not None:
                _positive_int(self, name, MAX_MODEL_DIM,
                              f"pass the decoder layers of that pipeline rank (>= 1), or omit it for the even split")
        for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
            # False with one stage: configs that plan alike compare equal
            object.__setattr__(self, name, check_bool(name, getattr(self, name)) and self.pp_size > 1)
        layout = self.pipeline_model_parallel_layout
        if layout is not None and not isinstance(layout, str):
            raise ScheduleError(f"pipeline_model_parallel_layout = {show(layout)} must be a string such as "
                                f"'Ett|(tt|)*6,tL', or None")
        check_layout_flags(pp_size=self.pp_size, vpp_size=self.vpp_size,
                           **{name: getattr(self, name) for name in LAYOUT_FLAGS})

    def stage_layers(self, num_layers: int) -> StageLayers:
        """Megatron's split of ``num_layers`` decoder layers over the virtual stages (:func:`.split_layers`)."""
        return split_layers(num_layers, pp_size=self.pp_size, vpp_size=self.vpp_size,
                            **{name: getattr(self, name) for name in LAYOUT_FLAGS})

    def require_dp_size(self) -> int:
        """``dp_size``, or a :class:`ScheduleError` where it is not resolved yet."""
        if self.dp_size is None:
            raise ScheduleError("parallel.dp_size is None: resolve it with ParallelConfig.for_world(world_size)")
        return self.dp_size

    @property
    def align(self) -> int:
        """Every step's total micro-batch count is a multiple of this."""
        group = self.microbatch_group_size_per_vp_stage if self.vpp_size > 1 else 1
        return self.require_dp_size() * group

    @property
    def model_parallel_size(self) -> int:
        """GPUs of one data-parallel replica: ``tp * cp * pp``."""
        return self.tp_size * self.cp_size * self.pp_size

    def for_world(self, world_size: int) -> "ParallelConfig":
        """A copy with ``dp_size = world_size / (tp * cp * pp)``."""
        mp = self.model_parallel_size
        if not is_int(world_size) or world_size < 1 or world_size % mp:
            raise ScheduleError(f"world_size={world_size!r} is not a multiple of tp*cp*pp = {mp}; start dp * {mp} "
                                f"train processes (one per rank of dp x pp)")
        return dataclasses.replace(self, dp_size=int(world_size) // mp)

    @classmethod
    def from_dict(cls, train_parallel_config: Mapping[str, Any]) -> "ParallelConfig":
        """From slime's ``train_parallel_config`` dict; a missing or ``None`` size is 1 (``dp_size`` is required,
        and the group size with ``vpp_size > 1``)."""
        if isinstance(train_parallel_config, ParallelConfig):
            return train_parallel_config
        if not isinstance(train_parallel_config, Mapping) or "dp_size" not in train_parallel_config:
            raise ScheduleError(
                f"train_parallel_config must be a mapping with at least 'dp_size', got {show(train_parallel_config)}; "
                f"pass {{'dp_size': ..., 'cp_size': ..., 'pp_size': ..., 'vpp_size': ..., "
                f"'microbatch_group_size_per_vp_stage': ...}}"
            )
        if train_parallel_config["dp_size"] is None:
            raise ScheduleError("train_parallel_config['dp_size'] is None; pass the data-parallel world size (>= 1)")
        kwargs = {f.name: train_parallel_config[f.name] for f in dataclasses.fields(cls)
                  if train_parallel_config.get(f.name) is not None}
        vpp = kwargs.get("vpp_size", 1)
        if "microbatch_group_size_per_vp_stage" not in kwargs and is_int(vpp) and vpp > 1:
            raise ScheduleError(
                f"train_parallel_config has vpp_size = {vpp} but no microbatch_group_size_per_vp_stage; pass it "
                f"(Megatron defaults it to the pipeline-parallel size)"
            )
        return cls(**kwargs)

    @classmethod
    def from_megatron(
        cls, dp_size: int | None, *, context_parallel_size: int | None = 1,
        pipeline_model_parallel_size: int | None = 1, virtual_pipeline_model_parallel_size: int | None = None,
        microbatch_group_size_per_vp_stage: int | None = None, overlap_p2p_comm: bool | None = None,
        tensor_model_parallel_size: int | None = 1, decoder_first_pipeline_num_layers: int | None = None,
        decoder_last_pipeline_num_layers: int | None = None, pipeline_model_parallel_layout: str | None = None,
        account_for_embedding_in_pipeline_split: bool | None = False,
        account_for_loss_in_pipeline_split: bool | None = False,
    ) -> "ParallelConfig":
        """From Megatron's sizes, resolved as Megatron does: ``None`` sizes are 1, the group size defaults to the
        pipeline size, ``overlap_p2p_comm=None`` is on with VPP, and a layout string gives a missing VPP size."""
        def given(size: int | None, default: int | None) -> int | None:
            return default if size is None else size

        vpp = virtual_pipeline_model_parallel_size
        if vpp is None and pipeline_model_parallel_layout is not None and is_int(pipeline_model_parallel_size) \
                and pipeline_model_parallel_size >= 1:
            vpp = layout_vpp_size(pipeline_model_parallel_layout, pipeline_model_parallel_size)
        vpp = given(vpp, 1)
        return cls(dp_size=dp_size, cp_size=given(context_parallel_size, 1), vpp_size=vpp,
                   microbatch_group_size_per_vp_stage=given(microbatch_group_size_per_vp_stage,
                                                            given(pipeline_model_parallel_size, 1)),
                   pp_size=given(pipeline_model_parallel_size, 1),
                   overlap_p2p_comm=given(overlap_p2p_comm, is_int(vpp) and vpp > 1),
                   tp_size=given(tensor_model_parallel_size, 1),
                   decoder_first_pipeline_num_layers=decoder_first_pipeline_num_layers,
                   decoder_last_pipeline_num_layers=decoder_last_pipeline_num_layers,
                   pipeline_model_parallel_layout=pipeline_model_parallel_layout,
                   account_for_embedding_in_pipeline_split=given(account_for_embedding_in_pipeline_split, False),
                   account_for_loss_in_pipeline_split=given(account_for_loss_in_pipeline_split, False))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BatchConfig:
    """slime's batch flags, under slime's names."""

    #: rollouts (not samples) per training step; required unless use_dynamic_global_batch_size
    global_batch_size: int | None = None
    #: pack micro-batches up to max_tokens_per_gpu * cp_size tokens (else micro_batch_size samples each)
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None  # required with use_dynamic_batch_size
    micro_batch_size: int | None = 1  # samples per micro-batch without use_dynamic_batch_size
    balance_data: bool = False  # balance estimated FLOPs across DP ranks (equal micro-batch counts either way)
    balance_by_flops: bool = False  # also balance FLOPs across a step's micro-batches (dynamic batches only)
    #: one step for the whole input: every whole rollout the layout can train (:func:`~.steps.dynamic_step_rollouts`)
    use_dynamic_global_batch_size: bool = False
    disable_rollout_trim_samples: bool = False  # an incomplete trailing step is an error instead of dropped
    #: slime v0.2.4's rule for use_dynamic_global_batch_size (samples rounded down to a multiple of dp_size); set
    #: by the v0.2.4 adapter, not a slime flag
    dynamic_global_batch_rounds_samples: bool = False

    def __post_init__(self) -> None:
        for flag in _BOOL_FLAGS:
            object.__setattr__(self, flag, check_bool(flag, getattr(self, flag)))
        dynamic, whole = self.use_dynamic_batch_size, self.use_dynamic_global_batch_size
        if self.global_batch_size is None and not whole:
            raise ScheduleError("global_batch_size is None; pass --global-batch-size N (rollouts per step) or "
                                "--use-dynamic-global-batch-size")
        if self.dynamic_global_batch_rounds_samples and not whole:
            raise ScheduleError("dynamic_global_batch_rounds_samples=True needs use_dynamic_global_batch_size=True "
                                "(it is how that flag rounds); set both or neither")
        if self.max_tokens_per_gpu is None and dynamic:
            raise ScheduleError("max_tokens_per_gpu is None but use_dynamic_batch_size is set; pass "
                                "--max-tokens-per-gpu N")
        if self.balance_by_flops and not dynamic:
            raise ScheduleError("balance_by_flops=True needs use_dynamic_batch_size=True (static micro-batches have a "
                                "fixed sample count, so there is nothing to balance inside a step); add "
                                "--use-dynamic-batch-size --max-tokens-per-gpu N or drop --balance-by-flops")
        # a size the flags use must be given; one they leave unused may be omitted, but is never garbage
        for name, maximum, used, fix in (
                ("global_batch_size", MAX_SAMPLES, not whole, "pass --global-batch-size N (rollouts per step)"),
                ("max_tokens_per_gpu", MAX_TOKENS, dynamic, "pass --max-tokens-per-gpu N"),
                ("micro_batch_size", MAX_SAMPLES, not dynamic,
                 "pass --micro-batch-size N or use --use-dynamic-batch-size --max-tokens-per-gpu N")):
            if used or getattr(self, name) is not None:
                _positive_int(self, name, maximum,
                              fix if used else f"pass a positive --{name.replace('_', '-')} or omit it")

    @classmethod
    def from_args(cls, args: Any, *, global_batch_size: int | None = None) -> "BatchConfig":
        """Read slime's flags off any attribute object (a ``None`` boolean is unset); ``global_batch_size``
        overrides ``args.global_batch_size``."""
        if isinstance(args, BatchConfig):
            return args if global_batch_size is None else dataclasses.replace(args, global_batch_size=global_batch_size)
        kwargs = {}
        for flag in BATCH_FLAGS:
            if hasattr(args, flag):
                value = getattr(args, flag)
                if flag in _BOOL_FLAGS and value is None:
                    value = False
                kwargs[flag] = value
        if global_batch_size is not None:
            kwargs["global_batch_size"] = global_batch_size
        return cls(**kwargs)

    def cap(self, cp_size: int) -> int | None:
        """Token cap per micro-batch (``max_tokens_per_gpu * cp_size``), or ``None`` for static batches."""
        return self.max_tokens_per_gpu * cp_size if self.use_dynamic_batch_size else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
