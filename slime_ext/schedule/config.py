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


def _positive_int(name: str, value: Any, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"{name} must be a positive integer, got {value!r}; {fix}")
    return value


@dataclass(frozen=True)
class ParallelConfig:
    """The training job's parallel layout, as far as scheduling cares.

    ``microbatch_group_size_per_vp_stage`` only matters with ``vpp_size > 1`` (Megatron defaults it to the pipeline
    size); the per-step micro-batch count is then aligned to ``dp_size * microbatch_group_size_per_vp_stage``.
    """

    dp_size: int = 1
    cp_size: int = 1
    vpp_size: int = 1
    microbatch_group_size_per_vp_stage: int = 1

    def __post_init__(self) -> None:
        _positive_int("dp_size", self.dp_size, "pass the data-parallel world size (>= 1)")
        _positive_int("cp_size", self.cp_size, "pass the context-parallel size (>= 1)")
        _positive_int("vpp_size", self.vpp_size, "pass 1 without virtual pipeline parallelism")
        _positive_int(
            "microbatch_group_size_per_vp_stage",
            self.microbatch_group_size_per_vp_stage,
            "Megatron defaults it to the pipeline-parallel size",
        )

    @property
    def align(self) -> int:
        """Every step's total micro-batch count is a multiple of this."""
        group = self.microbatch_group_size_per_vp_stage if self.vpp_size > 1 else 1
        return self.dp_size * group

    @classmethod
    def from_dict(cls, train_parallel_config: Mapping[str, Any]) -> "ParallelConfig":
        """Build from slime's ``train_parallel_config`` dict (``dp_size`` required, the rest default)."""
        if isinstance(train_parallel_config, ParallelConfig):
            return train_parallel_config
        if not isinstance(train_parallel_config, Mapping) or "dp_size" not in train_parallel_config:
            raise ScheduleError(
                f"train_parallel_config must be a mapping with at least 'dp_size', got {train_parallel_config!r}; "
                f"pass {{'dp_size': ..., 'cp_size': ..., 'vpp_size': ..., 'microbatch_group_size_per_vp_stage': ...}}"
            )
        kwargs = {k: train_parallel_config[k] for k in PARALLEL_KEYS if train_parallel_config.get(k) is not None}
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
        for flag in ("use_dynamic_batch_size", "balance_data", "balance_by_flops", "use_dynamic_global_batch_size",
                     "disable_rollout_trim_samples"):
            if not isinstance(getattr(self, flag), bool):
                raise ScheduleError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if not self.use_dynamic_global_batch_size:
            if self.global_batch_size is None:
                raise ScheduleError(
                    "global_batch_size is None; pass --global-batch-size N (rollouts per step) "
                    "or --use-dynamic-global-batch-size"
                )
            _positive_int("global_batch_size", self.global_batch_size, "pass --global-batch-size N (rollouts per step)")
        elif self.global_batch_size is not None:
            _positive_int("global_batch_size", self.global_batch_size, "pass a positive --global-batch-size or omit it")
        if self.use_dynamic_batch_size:
            if self.max_tokens_per_gpu is None:
                raise ScheduleError(
                    "max_tokens_per_gpu is None but use_dynamic_batch_size is set; pass --max-tokens-per-gpu N"
                )
            _positive_int("max_tokens_per_gpu", self.max_tokens_per_gpu, "pass --max-tokens-per-gpu N")
        else:
            _positive_int(
                "micro_batch_size", self.micro_batch_size,
                "pass --micro-batch-size N or use --use-dynamic-batch-size --max-tokens-per-gpu N",
            )
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
        """
        if isinstance(args, BatchConfig):
            return args if global_batch_size is None else dataclasses.replace(args, global_batch_size=global_batch_size)
        kwargs = {}
        for flag in BATCH_FLAGS:
            if hasattr(args, flag):
                value = getattr(args, flag)
                if flag in ("use_dynamic_batch_size", "balance_data", "balance_by_flops",
                            "use_dynamic_global_batch_size", "disable_rollout_trim_samples"):
                    value = bool(value) if value is not None else False
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
        return cls(**{k: d[k] for k in BATCH_FLAGS if k in d})
