"""The training keys of a run: one flat dataclass under slime's / Megatron's flag names, each field documented where
it is declared. Pure Python (no torch): the rollout side validates run configs with it without importing the
training layer, and the training layer (:mod:`slime_ext.training`) builds everything from it.

Build it with :meth:`TrainConfig.from_mapping` (a dict, e.g. a YAML file's content), :meth:`TrainConfig.from_args`
(an argparse ``Namespace`` / ``SimpleNamespace``) or :func:`load_train_config` (path, mapping or namespace). Unknown
keys are an error unless ``ignore_unknown=True`` (a shared YAML that also holds rollout-side keys).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

from slime_ext.schedule import DP_SCHEDULES

#: keys that ``TrainWorker.reset`` may change (everything else is fixed by the process groups and the model)
RESETTABLE_KEYS = frozenset({
    "use_dynamic_batch_size", "max_tokens_per_gpu", "micro_batch_size", "global_batch_size", "balance_data",
    "balance_by_flops", "use_dynamic_global_batch_size", "disable_rollout_trim_samples", "dp_schedule",
    "optimizer", "lr", "min_lr", "lr_warmup_init", "lr_decay_style", "lr_warmup_samples", "lr_decay_samples",
    "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum",
})
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


class TrainConfigError(ValueError):
    """A bad training config; the message names the key, the value and the fix."""


@dataclass(frozen=True)
class Layout:
    """Where one global rank sits (Megatron's default order ``tp-cp-ep-dp-pp`` with tp = cp = 1)."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


@dataclass(frozen=True)
class TrainConfig:
    # ---- batch (slime flags; meanings: slime_ext.schedule.BatchConfig)
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None
    micro_batch_size: int | None = 1
    global_batch_size: int | None = None  # rollouts per step (rollout path); samples per step (legacy, as upstream)
    balance_data: bool = False
    balance_by_flops: bool = False
    use_dynamic_global_batch_size: bool = False
    disable_rollout_trim_samples: bool = False
    dp_schedule: str = "rollout"  # who plans micro-batches: slime_ext.schedule.DP_SCHEDULES
    # ---- parallel (data parallel = world_size / (tp * cp * pp))
    tensor_model_parallel_size: int = 1  # must be 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    microbatch_group_size_per_vp_stage: int | None = None  # default: the pipeline size (Megatron's)
    context_parallel_size: int = 1  # must be 1
    # ---- model (a Megatron GPTModel with the local layer spec)
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # default: 4 * hidden_size
    vocab_size: int = 128
    seq_length: int = 256
    max_position_embeddings: int | None = None  # default: seq_length; every sample's total_length must fit
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # ---- optimizer / LR (Megatron names; the LR schedule counts samples)
    optimizer: str = "adam"  # or "sgd"
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0
    lr_decay_style: str = "constant"  # linear, cosine, inverse-square-root need lr_decay_samples
    lr_warmup_samples: int = 0
    lr_decay_samples: int | None = None
    weight_decay: float = 0.0
    clip_grad: float = 1.0  # 0 disables
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    seed: int = 1234
    # ---- runtime
    dist_backend: str | None = None  # default: nccl with a GPU, else gloo
    dist_timeout_seconds: float = 60.0  # every process group: a dead or stuck peer fails the job within this

    def __post_init__(self) -> None:
        def fail(key: str, fix: str) -> None:
            raise TrainConfigError(f"{key}={getattr(self, key)!r}: {fix}")

        def positive_int(key: str) -> None:
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                fail(key, "must be a positive integer")

        if self.dp_schedule not in DP_SCHEDULES:
            fail("dp_schedule", f"must be one of {DP_SCHEDULES} (--dp-schedule rollout|legacy)")
        for key in ("use_dynamic_batch_size", "balance_data", "balance_by_flops", "use_dynamic_global_batch_size",
                    "disable_rollout_trim_samples", "untie_embeddings_and_output_weights"):
            if not isinstance(getattr(self, key), bool):
                fail(key, "must be true or false")
        if self.use_dynamic_batch_size:
            if self.max_tokens_per_gpu is None:
                fail("max_tokens_per_gpu", "use_dynamic_batch_size needs --max-tokens-per-gpu N")
            positive_int("max_tokens_per_gpu")
        else:
            positive_int("micro_batch_size")
        if self.global_batch_size is not None:
            positive_int("global_batch_size")
        if self.tensor_model_parallel_size != 1:
            fail("tensor_model_parallel_size", "this adapter supports tensor parallelism 1 only")
        if self.context_parallel_size != 1:
            fail("context_parallel_size", "this adapter supports context parallelism 1 only")
        for key in ("pipeline_model_parallel_size", "num_layers", "hidden_size", "num_attention_heads",
                    "vocab_size", "seq_length"):
            positive_int(key)
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            positive_int("virtual_pipeline_model_parallel_size")
            if vpp > 1 and self.pipeline_model_parallel_size == 1:
                fail("virtual_pipeline_model_parallel_size", "needs pipeline_model_parallel_size > 1")
        if self.num_layers % (self.pipeline_model_parallel_size * self.vpp_size):
            fail("num_layers", f"must be a multiple of pipeline_model_parallel_size * vpp "
                               f"= {self.pipeline_model_parallel_size * self.vpp_size}")
        if self.microbatch_group_size_per_vp_stage is not None:
            positive_int("microbatch_group_size_per_vp_stage")
            if self.vpp_size > 1 and self.microbatch_group_size_per_vp_stage < self.pipeline_model_parallel_size:
                fail("microbatch_group_size_per_vp_stage",
                     f"Megatron's interleaved schedule needs it >= pipeline_model_parallel_size "
                     f"= {self.pipeline_model_parallel_size}")
        if self.hidden_size % self.num_attention_heads:
            fail("hidden_size", f"must be a multiple of num_attention_heads={self.num_attention_heads}")
        if self.ffn_hidden_size is not None:
            positive_int("ffn_hidden_size")
        if self.max_position_embeddings is not None:
            positive_int("max_position_embeddings")
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                fail(key, "must be in [0, 1)")
        if self.optimizer not in ("adam", "sgd"):
            fail("optimizer", "must be 'adam' or 'sgd'")
        if not self.lr >= 0 or not 0 <= self.min_lr <= self.lr:
            fail("min_lr", f"need 0 <= min_lr <= lr (lr={self.lr})")
        if not 0 <= self.lr_warmup_init <= self.lr:
            fail("lr_warmup_init", f"need 0 <= lr_warmup_init <= lr (lr={self.lr})")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            fail("lr_decay_style", f"must be one of {LR_DECAY_STYLES}")
        if isinstance(self.lr_warmup_samples, bool) or not isinstance(self.lr_warmup_samples, int) \
                or self.lr_warmup_samples < 0:
            fail("lr_warmup_samples", "must be a non-negative integer (samples)")
        if self.lr_decay_samples is None:
            if self.lr_decay_style != "constant":
                fail("lr_decay_samples", f"lr_decay_style={self.lr_decay_style!r} needs --lr-decay-samples N")
        else:
            positive_int("lr_decay_samples")
            if self.lr_decay_samples <= self.lr_warmup_samples:
                fail("lr_decay_samples", f"must exceed lr_warmup_samples={self.lr_warmup_samples}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            fail("weight_decay" if self.weight_decay < 0 else "clip_grad", "must be >= 0")
        if self.dist_backend not in (None, "gloo", "nccl"):
            fail("dist_backend", "must be 'gloo', 'nccl' or null (auto)")
        if not self.dist_timeout_seconds > 0:
            fail("dist_timeout_seconds", "must be > 0 (seconds)")

    # ------------------------------------------------------------------ derived values
    @property
    def vpp_size(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def mb_group_size(self) -> int:
        """``microbatch_group_size_per_vp_stage`` as Megatron resolves it (the pipeline size by default)."""
        return self.microbatch_group_size_per_vp_stage or self.pipeline_model_parallel_size

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def lr_decay_steps(self) -> int:
        """Samples of the LR decay; for a constant LR only needs to exceed the warmup."""
        return self.lr_decay_samples if self.lr_decay_samples is not None else self.lr_warmup_samples + 1

    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.context_parallel_size * self.pipeline_model_parallel_size

    def dp_size(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` processes; ``TrainConfigError`` if it does not divide."""
        mp = self.model_parallel_size()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1 or world_size % mp:
            raise TrainConfigError(
                f"world_size={world_size!r} is not a multiple of tp*cp*pp = {mp}; start dp * {mp} train "
                f"processes (one per rank of dp x pp)"
            )
        return world_size // mp

    def layout(self, rank: int, world_size: int) -> Layout:
        """Megatron's placement of ``rank`` (order ``tp-cp-ep-dp-pp``: DP ranks vary fastest)."""
        dp = self.dp_size(world_size)
        if not 0 <= rank < world_size:
            raise TrainConfigError(f"rank={rank} is outside [0, world_size={world_size})")
        return Layout(rank=rank, world_size=world_size, dp_rank=rank % dp, dp_size=dp,
                      pp_rank=rank // dp, pp_size=self.pipeline_model_parallel_size)

    def train_parallel_config(self, world_size: int) -> dict:
        """slime's ``train_parallel_config`` dict, the planner's input on the rollout side."""
        return {
            "dp_size": self.dp_size(world_size),
            "cp_size": self.context_parallel_size,
            "vpp_size": self.vpp_size,
            "microbatch_group_size_per_vp_stage": self.mb_group_size,
        }

    def to_args(self) -> SimpleNamespace:
        """An argparse-like namespace under slime's names (what the slime-shaped backend reads)."""
        return SimpleNamespace(**dataclasses.asdict(self))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "TrainConfig":
        unknown = sorted(set(changes) - _KEYS)
        if unknown:
            raise TrainConfigError(f"unknown training config keys {unknown}; known keys: {sorted(_KEYS)}")
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], *, ignore_unknown: bool = False) -> "TrainConfig":
        if isinstance(d, TrainConfig):
            return d
        if not isinstance(d, Mapping):
            raise TrainConfigError(f"a training config must be a mapping, got {type(d).__name__}")
        keys = {k.replace("-", "_"): v for k, v in d.items()}
        unknown = sorted(set(keys) - _KEYS)
        if unknown and not ignore_unknown:
            raise TrainConfigError(
                f"unknown training config keys {unknown}; fix the spelling, or pass ignore_unknown=True when the "
                f"mapping also holds rollout-side keys"
            )
        kwargs = {k: _coerce(k, v) for k, v in keys.items() if k in _KEYS}
        return cls(**kwargs)

    @classmethod
    def from_args(cls, args: Any) -> "TrainConfig":
        """Read the known keys off any attribute object (missing ones take the defaults)."""
        if isinstance(args, TrainConfig):
            return args
        return cls.from_mapping({k: getattr(args, k) for k in _KEYS if hasattr(args, k)})


_KEYS = frozenset(f.name for f in fields(TrainConfig))
_FLOATS = frozenset(f.name for f in fields(TrainConfig) if f.type in ("float",))


def _coerce(key: str, value: Any) -> Any:
    """YAML reads ``1e-4`` as a string and ``1`` as an int; float fields take either."""
    if key in _FLOATS and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            raise TrainConfigError(f"{key}={value!r} must be a number") from None
    if isinstance(value, float) and key not in _FLOATS and value.is_integer() and not math.isnan(value):
        return int(value)
    return value


def load_train_config(source: Any, *, ignore_unknown: bool = False, **overrides: Any) -> TrainConfig:
    """A :class:`TrainConfig` from a YAML path, a mapping, a namespace or a ``TrainConfig``; ``overrides`` win."""
    if isinstance(source, (str, Path)):
        import yaml

        with open(source) as fh:
            source = yaml.safe_load(fh) or {}
    if isinstance(source, TrainConfig):
        config = source
    elif isinstance(source, Mapping):
        config = TrainConfig.from_mapping(source, ignore_unknown=ignore_unknown)
    else:
        config = TrainConfig.from_args(source)
    return config.replace(**overrides) if overrides else config
