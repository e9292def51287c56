"""The training job's config, nested as torchtitan nests its ``JobConfig``::

    TrainConfig(batch=BatchConfig(...), parallel=ParallelConfig(dp_size=None, ...), model=ModelConfig(...),
                optim=OptimConfig(...), dp_schedule="rollout", seed=1234, ...)

Users keep slime's / Megatron's flat names (``lr:``, ``max_tokens_per_gpu:``, ``--pipeline-model-parallel-size``):
:meth:`TrainConfig.from_mapping` / :meth:`TrainConfig.from_args` route each flat key to its section, and
:meth:`TrainConfig.to_args` flattens back for slime-shaped code. ``batch`` and ``parallel`` are the planning layer's
own :class:`~slime_ext.schedule.BatchConfig` and :class:`~slime_ext.schedule.ParallelConfig`, validated there; the
parallel layout's data-parallel size is left to the world size (:meth:`TrainConfig.dp_size`), and only the limits of
this trainer are checked here. Pure Python (no torch): the rollout side validates run configs with it without
importing the training layer.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

from slime_ext.schedule import BatchConfig, ParallelConfig, ScheduleError
from slime_ext.schemes import DP_SCHEDULES
from slime_ext.schedule.config import BATCH_FLAGS

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


class TrainConfigError(ValueError):
    """A bad training config; the message names the key, the value and the fix."""


def _fail(key: str, value: Any, fix: str) -> None:
    raise TrainConfigError(f"{key}={value!r}: {fix}")


def _check_positive_int(obj: Any, *keys: str) -> None:
    for key in keys:
        v = getattr(obj, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            _fail(key, v, "must be a positive integer")


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
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


#: the training config's flat (Megatron) name of each :class:`ParallelConfig` field it sets (``dp_size`` is the
#: world size's business, ``overlap_p2p_comm`` stays False: this trainer keeps megatron-core's batched p2p)
PARALLEL_FLAT_KEYS = {
    "tensor_model_parallel_size": "tp_size",  # must be 1: this adapter has no tensor parallelism
    "pipeline_model_parallel_size": "pp_size",
    #: model chunks per pipeline rank (Megatron's interleaved schedule); None or 1: no interleaving
    "virtual_pipeline_model_parallel_size": "vpp_size",
    #: micro-batches a stage runs per model chunk before switching chunk; None: the pipeline size (Megatron's)
    "microbatch_group_size_per_vp_stage": "microbatch_group_size_per_vp_stage",
    "context_parallel_size": "cp_size",  # must be 1: this adapter has no context parallelism
}
#: ParallelConfig's field names that are not the flat keys: its messages are reworded with the flat ones
_FLAT_NAME = {field: key for key, field in PARALLEL_FLAT_KEYS.items() if field != key}
_FIELD_NAME = re.compile(r"\b(" + "|".join(_FLAT_NAME) + r")\b")


def _parallel_from_flat(values: Mapping[str, Any]) -> ParallelConfig:
    """The ``parallel`` section from the flat keys; ParallelConfig's refusals as :class:`TrainConfigError`, under the
    keys' flat names."""
    # this trainer's limits first: vpp > 1 without pp is refused as such, not as a missing group size
    _check_parallel_limits(**{k: values[k] for k in PARALLEL_FLAT_KEYS if k in values})
    kwargs = {field: values[key] for key, field in PARALLEL_FLAT_KEYS.items() if key in values}
    if kwargs.get("vpp_size", 1) is None:  # Megatron's "off"
        del kwargs["vpp_size"]
    try:
        return ParallelConfig(dp_size=None, **kwargs)
    except ScheduleError as exc:  # one error type for callers, naming the keys as the user wrote them
        raise TrainConfigError(_FIELD_NAME.sub(lambda m: _FLAT_NAME[m.group(1)], str(exc))) from None


def _flat_parallel(parallel: ParallelConfig) -> dict:
    """``parallel`` under the flat keys: the resolved group size, and no virtual pipeline size (None) at 1."""
    flat = {key: getattr(parallel, field) for key, field in PARALLEL_FLAT_KEYS.items()}
    if parallel.vpp_size == 1:
        flat["virtual_pipeline_model_parallel_size"] = None
    return flat


def _check_parallel_limits(tensor_model_parallel_size: Any = 1, context_parallel_size: Any = 1,
                           pipeline_model_parallel_size: Any = 1, virtual_pipeline_model_parallel_size: Any = None,
                           **_: Any) -> None:
    """What this trainer supports of the layouts ParallelConfig accepts (values that are not integers are left to
    ParallelConfig's checks)."""
    def size(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    if size(tensor_model_parallel_size) not in (None, 1):
        _fail("tensor_model_parallel_size", tensor_model_parallel_size,
              "this adapter supports tensor parallelism 1 only")
    if size(context_parallel_size) not in (None, 1):
        _fail("context_parallel_size", context_parallel_size, "this adapter supports context parallelism 1 only")
    vpp, pp = size(virtual_pipeline_model_parallel_size), size(pipeline_model_parallel_size)
    if vpp is not None and vpp > 1 and pp == 1:
        _fail("virtual_pipeline_model_parallel_size", vpp, "needs pipeline_model_parallel_size > 1")


@dataclass(frozen=True)
class ModelConfig:
    """A Megatron ``GPTModel`` with the local layer spec, fp32."""

    num_layers: int = 2  # a multiple of pipeline_model_parallel_size * vpp
    hidden_size: int = 64  # a multiple of num_attention_heads
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    vocab_size: int = 128
    seq_length: int = 256  # the longest sample (prompt + response) the rollout may produce
    max_position_embeddings: int | None = None  # None: seq_length; every sample's total_length must fit
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    def __post_init__(self) -> None:
        _check_positive_int(self, "num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length")
        for key in ("ffn_hidden_size", "max_position_embeddings"):
            if getattr(self, key) is not None:
                _check_positive_int(self, key)
        if not isinstance(self.untie_embeddings_and_output_weights, bool):
            _fail("untie_embeddings_and_output_weights", self.untie_embeddings_and_output_weights,
                  "must be true or false")
        if self.hidden_size % self.num_attention_heads:
            _fail("hidden_size", self.hidden_size,
                  f"must be a multiple of num_attention_heads={self.num_attention_heads}")
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                _fail(key, getattr(self, key), "must be in [0, 1)")

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length


@dataclass(frozen=True)
class OptimConfig:
    """Megatron's optimizer and LR-schedule keys; the LR schedule counts samples, not steps."""

    optimizer: str = "adam"  # "adam" or "sgd"
    lr: float = 1e-4
    min_lr: float = 0.0  # the floor of the decay; in [0, lr]
    lr_warmup_init: float = 0.0  # the LR at sample 0; in [0, lr]
    lr_decay_style: str = "constant"  # one of LR_DECAY_STYLES; all but constant need lr_decay_samples
    lr_warmup_samples: int = 0
    lr_decay_samples: int | None = None  # > lr_warmup_samples
    weight_decay: float = 0.0
    clip_grad: float = 1.0  # global grad-norm clip; 0 disables
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            _fail("optimizer", self.optimizer, "must be 'adam' or 'sgd'")
        if not self.lr >= 0 or not 0 <= self.min_lr <= self.lr:
            _fail("min_lr", self.min_lr, f"need 0 <= min_lr <= lr (lr={self.lr})")
        if not 0 <= self.lr_warmup_init <= self.lr:
            _fail("lr_warmup_init", self.lr_warmup_init, f"need 0 <= lr_warmup_init <= lr (lr={self.lr})")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            _fail("lr_decay_style", self.lr_decay_style, f"must be one of {LR_DECAY_STYLES}")
        warmup = self.lr_warmup_samples
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            _fail("lr_warmup_samples", warmup, "must be a non-negative integer (samples)")
        if self.lr_decay_samples is None:
            if self.lr_decay_style != "constant":
                _fail("lr_decay_samples", None, f"lr_decay_style={self.lr_decay_style!r} needs --lr-decay-samples N")
        else:
            _check_positive_int(self, "lr_decay_samples")
            if self.lr_decay_samples <= warmup:
                _fail("lr_decay_samples", self.lr_decay_samples, f"must exceed lr_warmup_samples={warmup}")
        for key in ("weight_decay", "clip_grad"):
            if getattr(self, key) < 0:
                _fail(key, getattr(self, key), "must be >= 0")

    @property
    def lr_decay_steps(self) -> int:
        """Samples of the LR decay; for a constant LR only needs to exceed the warmup."""
        return self.lr_decay_samples if self.lr_decay_samples is not None else self.lr_warmup_samples + 1


@dataclass(frozen=True)
class TrainConfig:
    """One training job: the four sections plus the keys of the job as a whole."""

    #: slime's batch flags; None when none is set: such a process trains the plans it is sent and plans nothing
    batch: BatchConfig | None = None
    #: the parallel layout; its dp_size is None: whatever the world size leaves (:meth:`dp_size`)
    parallel: ParallelConfig = field(default_factory=lambda: ParallelConfig(dp_size=None))
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    #: who plans the micro-batches: "rollout" (our planner, before Ray) or "legacy" (upstream's, on each rank)
    dp_schedule: str = "rollout"
    seed: int = 1234  # parameters and Megatron's RNG trackers
    dist_backend: str | None = None  # "gloo", "nccl", or None: nccl with a GPU, else gloo
    #: every collective: a dead or stuck peer fails the job within this (joining has its own 600 s bound)
    dist_timeout_seconds: float = 60.0

    def __post_init__(self) -> None:
        for name, kind in (("batch", BatchConfig), ("parallel", ParallelConfig), ("model", ModelConfig),
                           ("optim", OptimConfig)):
            value = getattr(self, name)
            if not isinstance(value, kind) and not (name == "batch" and value is None):
                raise TrainConfigError(f"{name} must be a {kind.__name__}, got {type(value).__name__}; build flat "
                                       f"keys with TrainConfig.from_mapping")
        if self.dp_schedule not in DP_SCHEDULES:
            _fail("dp_schedule", self.dp_schedule, f"must be one of {DP_SCHEDULES} (--dp-schedule "
                                                   f"{'|'.join(DP_SCHEDULES)})")
        par = self.parallel
        if par.dp_size is not None:
            _fail("parallel.dp_size", par.dp_size, "the training config leaves the data-parallel size to the world "
                                                   "size (TrainConfig.dp_size(world_size)); pass "
                                                   "ParallelConfig(dp_size=None, ...)")
        if par.overlap_p2p_comm:
            _fail("parallel.overlap_p2p_comm", True, "this trainer keeps megatron-core's default, batched p2p (not a "
                                                     "training key); pass False")
        _check_parallel_limits(**_flat_parallel(par))
        chunks = par.pp_size * par.vpp_size
        if self.model.num_layers % chunks:
            _fail("num_layers", self.model.num_layers,
                  f"must be a multiple of pipeline_model_parallel_size * vpp = {chunks}")
        if self.dist_backend not in (None, "gloo", "nccl"):
            _fail("dist_backend", self.dist_backend, "must be 'gloo', 'nccl' or null (auto)")
        if not self.dist_timeout_seconds > 0:
            _fail("dist_timeout_seconds", self.dist_timeout_seconds, "must be > 0 (seconds)")

    # ------------------------------------------------------------------ shortcuts used by every layer
    def parallel_for_world(self, world_size: int) -> ParallelConfig:
        """The planner's :class:`~slime_ext.schedule.ParallelConfig` for ``world_size`` processes (dp resolved)."""
        try:
            return self.parallel.for_world(world_size)
        except ScheduleError as exc:
            raise TrainConfigError(str(exc)) from None

    def dp_size(self, world_size: int) -> int:
        return self.parallel_for_world(world_size).dp_size

    def layout(self, rank: int, world_size: int) -> Layout:
        """Megatron's placement of ``rank`` (order ``tp-cp-ep-dp-pp``: DP ranks vary fastest)."""
        dp = self.dp_size(world_size)
        if not 0 <= rank < world_size:
            raise TrainConfigError(f"rank={rank} is outside [0, world_size={world_size})")
        return Layout(rank=rank, world_size=world_size, dp_rank=rank % dp, dp_size=dp,
                      pp_rank=rank // dp, pp_size=self.parallel.pp_size)

    def train_parallel_config(self, world_size: int) -> dict:
        """slime's ``train_parallel_config`` dict, the planner's input on the rollout side."""
        return self.parallel_for_world(world_size).to_dict()

    # ------------------------------------------------------------------ flat (slime / Megatron) names
    def to_dict(self) -> dict:
        """Every key under its flat name; a ``None`` batch gives the batch flags' defaults (argparse's)."""
        flat = dict(_BATCH_DEFAULTS)
        if self.batch is not None:
            flat.update((k, v) for k, v in self.batch.to_dict().items() if k in _BATCH_DEFAULTS)
        flat.update(_flat_parallel(self.parallel))
        for section in _SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, section)))
        flat.update({k: getattr(self, k) for k in _TOP})
        return flat

    def to_args(self) -> SimpleNamespace:
        """An argparse-like namespace under slime's names (what the slime-shaped code reads)."""
        return SimpleNamespace(**self.to_dict())

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with flat keys changed (``replace(lr=1e-3, global_batch_size=8)``)."""
        unknown = sorted(set(changes) - KEYS)
        if unknown:
            raise TrainConfigError(f"unknown training config keys {unknown}; known keys: {sorted(KEYS)}")
        return TrainConfig.from_mapping({**self.to_dict(), **changes})

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], *, ignore_unknown: bool = False) -> "TrainConfig":
        """Route each flat key (``-`` or ``_``) to its section; unknown keys are an error unless ``ignore_unknown``
        (a shared YAML that also holds rollout-side keys)."""
        if isinstance(d, TrainConfig):
            return d
        if not isinstance(d, Mapping):
            raise TrainConfigError(f"a training config must be a mapping, got {type(d).__name__}")
        keys = {str(k).replace("-", "_"): v for k, v in d.items()}
        unknown = sorted(set(keys) - KEYS)
        if unknown and not ignore_unknown:
            raise TrainConfigError(
                f"unknown training config keys {unknown}; fix the spelling, or pass ignore_unknown=True when the "
                f"mapping also holds rollout-side keys"
            )
        values = {k: _coerce(k, v) for k, v in keys.items() if k in KEYS}
        batch_keys = {k: values[k] for k in BATCH_FLAGS if k in values}
        batch = None
        if any(not _is_default(v, _BATCH_DEFAULTS[k]) for k, v in batch_keys.items()):
            try:
                batch = BatchConfig(**batch_keys)
            except ScheduleError as exc:  # BatchConfig validates the batch flags; one error type for callers
                raise TrainConfigError(str(exc)) from None
        parallel = _parallel_from_flat(values)
        sections = {name: kind(**{k: values[k] for k in _SECTIONS[name][1] if k in values})
                    for name, kind in ((n, s[0]) for n, s in _SECTIONS.items())}
        return cls(batch=batch, parallel=parallel, **sections, **{k: values[k] for k in _TOP if k in values})

    @classmethod
    def from_args(cls, args: Any) -> "TrainConfig":
        """Read the known keys off any attribute object (missing ones take the defaults)."""
        if isinstance(args, TrainConfig):
            return args
        return cls.from_mapping({k: getattr(args, k) for k in KEYS if hasattr(args, k)})


def _names(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(kind))


#: section name -> (its dataclass, its flat keys); ``batch`` and ``parallel`` are the planning layer's, routed apart
_SECTIONS = {"model": (ModelConfig, _names(ModelConfig)), "optim": (OptimConfig, _names(OptimConfig))}
_TOP = ("dp_schedule", "seed", "dist_backend", "dist_timeout_seconds")
#: slime's batch flags (BatchConfig's other fields, set by host adapters, are not training-config keys)
_BATCH_DEFAULTS = {f.name: f.default for f in fields(BatchConfig) if f.name in BATCH_FLAGS}
#: every flat key a training config accepts
KEYS = frozenset(BATCH_FLAGS) | frozenset(PARALLEL_FLAT_KEYS) | frozenset(_TOP) | \
    frozenset(k for _, names in _SECTIONS.values() for k in names)
#: keys that ``TrainWorker.reset`` may change (the rest are fixed by the process groups and the model)
RESETTABLE_KEYS = frozenset(BATCH_FLAGS) | {"dp_schedule"} | frozenset(_names(OptimConfig))
_FLOATS = frozenset(f.name for kind in (ModelConfig, OptimConfig, TrainConfig) for f in fields(kind)
                    if f.type == "float")
assert set(_BATCH_DEFAULTS) == set(BATCH_FLAGS)


def _is_default(value: Any, default: Any) -> bool:
    return value is default if default is None or isinstance(default, bool) else \
        type(value) is type(default) and value == default


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
