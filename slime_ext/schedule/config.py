"""Frozen config dataclasses at the edge of the planning layer.

``ParallelConfig`` is what the training side advertises (slime calls it ``train_parallel_config``);
``BatchConfig`` carries slime's batch flags under their slime names. Both validate themselves on
construction and raise :class:`ScheduleError` naming the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ScheduleError
from .validate import MAX_PARALLEL_SIZE, MAX_SAMPLES, MAX_TOKENS, check_bool, check_int, is_int, show

#: Keys of slime's ``train_parallel_config`` dict that the scheduler reads.
PARALLEL_KEYS = ("dp_size", "cp_size", "vpp_size", "microbatch_group_size_per_vp_stage")
#: slime flag names (argparse dests) that the scheduler reads.
BATCH_FLAGS = (
    "global_batch_size",
    "use_dynamic_batch_size",
    "max_tokens_per_gpu",
    "micro_batch_size",
    "balance_data",
    "balance_by_flops",
    "use_dynamic_global_batch_size",
    "disable_rollout_trim_samples",
)


_BOOL_FLAGS = ("use_dynamic_batch_size", "balance_data", "balance_by_flops", "use_dynamic_global_batch_size",
               "disable_rollout_trim_samples")


def _positive_int(obj: Any, name: str, maximum: int, fix: str) -> int:
    """Check ``obj.name`` and store it back as a plain ``int`` (numpy integers are accepted)."""
    value = check_int(name, getattr(obj, name), maximum=maximum, fix=fix)
    object.__setattr__(obj, name, value)
    return value


@dataclass(frozen=True)
class ParallelConfig:
    """The training job's parallel layout, as far as scheduling cares.

    ``microbatch_group_size_per_vp_stage`` only matters with ``vpp_size > 1`` (Megatron defaults it to the pipeline
    size); the per-step micro-batch count is then aligned to ``dp_size * microbatch_group_size_per_vp_stage``. With
    ``vpp_size > 1`` it must be given (``None`` is refused, here, in ``from_dict`` and in ``slime-ext plan``, which
    takes the pipeline size for it when ``--pipeline-model-parallel-size`` is given); without VPP it is 1.
    """

    dp_size: int = 1
    cp_size: int = 1
    vpp_size: int = 1
    microbatch_group_size_per_vp_stage: int | None = None  # required with vpp_size > 1, else 1

    def __post_init__(self) -> None:
        _positive_int(self, "dp_size", MAX_PARALLEL_SIZE, "pass the data-parallel world size (>= 1)")
        _positive_int(self, "cp_size", MAX_PARALLEL_SIZE, "pass the context-parallel size (>= 1)")
        _positive_int(self, "vpp_size", MAX_PARALLEL_SIZE, "pass 1 without virtual pipeline parallelism")
        if self.microbatch_group_size_per_vp_stage is None:  # never a silent 1 where it matters: as the CLI does
            if self.vpp_size > 1:
                raise ScheduleError(
                    f"microbatch_group_size_per_vp_stage is None but vpp_size = {self.vpp_size}; pass it (Megatron "
                    f"defaults it to the pipeline-parallel size)"
                )
            object.__setattr__(self, "microbatch_group_size_per_vp_stage", 1)  # unused without VPP
        _positive_int(self, "microbatch_group_size_per_vp_stage", MAX_PARALLEL_SIZE,
                      "Megatron defaults it to the pipeline-parallel size: pass that")

    @property
    def align(self) -> int:
        """Every step's total micro-batch count is a multiple of this."""
        group = self.microbatch_group_size_per_vp_stage if self.vpp_size > 1 else 1
        return self.dp_size * group

    @classmethod
    def from_dict(cls, train_parallel_config: Mapping[str, Any]) -> "ParallelConfig":
        """Build from slime's ``train_parallel_config`` dict.

        ``dp_size`` is required (``None`` is refused, it never means 1). ``cp_size`` and ``vpp_size`` may be missing
        or ``None``: Megatron's "not used", i.e. 1. ``microbatch_group_size_per_vp_stage`` may be missing or ``None``
        only without virtual pipelining (it is then unused); with ``vpp_size > 1`` it is required, as in
        ``slime-ext plan`` (Megatron defaults it to the pipeline size, which this dict does not carry).
        """
        if isinstance(train_parallel_config, ParallelConfig):
            return train_parallel_config
        if not isinstance(train_parallel_config, Mapping) or "dp_size" not in train_parallel_config:
            raise ScheduleError(
                f"train_parallel_config must be a mapping with at least 'dp_size', got {show(train_parallel_config)}; "
                f"pass {{'dp_size': ..., 'cp_size': ..., 'vpp_size': ..., 'microbatch_group_size_per_vp_stage': ...}}"
            )
        if train_parallel_config["dp_size"] is None:
            raise ScheduleError("train_parallel_config['dp_size'] is None; pass the data-parallel world size (>= 1)")
        kwargs = {k: train_parallel_config[k] for k in PARALLEL_KEYS if train_parallel_config.get(k) is not None}
        vpp = kwargs.get("vpp_size", 1)
        if "microbatch_group_size_per_vp_stage" not in kwargs and is_int(vpp) and vpp > 1:
            raise ScheduleError(
                f"train_parallel_config has vpp_size = {vpp} but no microbatch_group_size_per_vp_stage; pass it "
                f"(Megatron defaults it to the pipeline-parallel size)"
            )
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BatchConfig:
    """slime's batch flags, under slime's names.

    * ``global_batch_size``: rollouts (not samples) per training step; one rollout may emit several samples.
    * ``use_dynamic_batch_size`` + ``max_tokens_per_gpu``: pack micro-batches up to ``max_tokens_per_gpu * cp_size``
      tokens; otherwise fixed ``micro_batch_size`` samples per micro-batch.
    * ``balance_data``: balance estimated FLOPs across DP ranks (equal micro-batch count per rank either way).
    * ``balance_by_flops``: also balance FLOPs across the micro-batches of a step (dynamic batch only).
    * ``use_dynamic_global_batch_size``: one step per rollout, whatever its size.
    * ``disable_rollout_trim_samples``: never drop trailing rollouts; an incomplete step is an error instead.
    """

    global_batch_size: int | None = None
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None
    micro_batch_size: int | None = 1
    balance_data: bool = False
    balance_by_flops: bool = False
    use_dynamic_global_batch_size: bool = False
    disable_rollout_trim_samples: bool = False

    def __post_init__(self) -> None:
        for flag in _BOOL_FLAGS:
            object.__setattr__(self, flag, check_bool(flag, getattr(self, flag)))
        if not self.use_dynamic_global_batch_size:
            if self.global_batch_size is None:
                raise ScheduleError(
                    "global_batch_size is None; pass --global-batch-size N (rollouts per step) "
                    "or --use-dynamic-global-batch-size"
                )
            _positive_int(self, "global_batch_size", MAX_SAMPLES, "pass --global-batch-size N (rollouts per step)")
        elif self.global_batch_size is not None:
            _positive_int(self, "global_batch_size", MAX_SAMPLES, "pass a positive --global-batch-size or omit it")
        if self.use_dynamic_batch_size:
            if self.max_tokens_per_gpu is None:
                raise ScheduleError(
                    "max_tokens_per_gpu is None but use_dynamic_batch_size is set; pass --max-tokens-per-gpu N"
                )
            _positive_int(self, "max_tokens_per_gpu", MAX_TOKENS, "pass --max-tokens-per-gpu N")
            if self.micro_batch_size is not None:  # unused with dynamic batches, but never garbage
                _positive_int(self, "micro_batch_size", MAX_SAMPLES, "pass a positive --micro-batch-size or omit it")
        else:
            _positive_int(
                self, "micro_batch_size", MAX_SAMPLES,
                "pass --micro-batch-size N or use --use-dynamic-batch-size --max-tokens-per-gpu N",
            )
            if self.max_tokens_per_gpu is not None:  # unused with static batches, but never garbage
                _positive_int(self, "max_tokens_per_gpu", MAX_TOKENS, "pass a positive --max-tokens-per-gpu or omit it")
            if self.balance_by_flops:
                raise ScheduleError(
                    "balance_by_flops=True needs use_dynamic_batch_size=True (static micro-batches have a fixed "
                    "sample count, so there is nothing to balance inside a step); add --use-dynamic-batch-size "
                    "--max-tokens-per-gpu N or drop --balance-by-flops"
                )

    @classmethod
    def from_args(cls, args: Any, *, global_batch_size: int | None = None) -> "BatchConfig":
        """Read slime's flags from any attribute object (argparse Namespace, SimpleNamespace, a dataclass).

        Missing attributes take the defaults above; ``global_batch_size`` overrides ``args.global_batch_size``.
        A boolean flag that is ``None`` is unset (``False``, argparse's default); any other non-bool value (e.g. the
        string ``"False"``) is refused, never read as truthy.
        """
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

    @property
    def dynamic(self) -> bool:
        return self.use_dynamic_batch_size

    def cap(self, cp_size: int) -> int | None:
        """Token cap per micro-batch (``max_tokens_per_gpu * cp_size``), or ``None`` for static batches."""
        return self.max_tokens_per_gpu * cp_size if self.use_dynamic_batch_size else None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BatchConfig":
        if not isinstance(d, Mapping):
            raise ScheduleError(f"batch must be a mapping of slime's batch flags, got {show(d)}")
        return cls(**{k: d[k] for k in BATCH_FLAGS if k in d})
