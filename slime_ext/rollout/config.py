"""The run config: one YAML file with the training keys and the rollout/harness keys, validated before any process.

Training keys are :class:`slime_ext.train_config.TrainConfig`'s fields; the rollout/harness keys are
:data:`RUN_DEFAULTS`, each documented where it is declared. :func:`load_run_config` raises :class:`ConfigError`
listing every problem, each naming the key and the fix.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

from slime_ext.schedule import BatchConfig, ParallelConfig, ScheduleError
from slime_ext.train_config import TrainConfig, TrainConfigError

from .synthetic import SYNTHETIC_DEFAULTS, synthetic_bounds

DEFAULT_ROLLOUT_FUNCTION = "slime_ext.rollout.synthetic.generate_rollout"
DEVICE_ENV = "SLIME_EXT_DEVICE"
DEVICES = ("cpu", "cuda")

#: rollout-side and harness keys with their defaults (training keys are TrainConfig's fields)
RUN_DEFAULTS: dict[str, Any] = {
    # rollout (slime names)
    "rollout_function_path": DEFAULT_ROLLOUT_FUNCTION,  # fn(args, rollout_id, data_source, evaluation) -> samples
    "num_rollout": 3,  # rollout -> train iterations
    "rollout_batch_size": 8,  # prompts per rollout
    "n_samples_per_prompt": 2,  # rollouts per prompt
    "rollout_seed": 42,
    **SYNTHETIC_DEFAULTS,  # read by the default rollout function only (slime_ext.rollout.synthetic)
    # cluster (slime names): world size = nodes x processes per node = dp * pp * tp * cp
    "actor_num_nodes": 1,  # this harness runs a single-node Ray on loopback
    "actor_num_gpus_per_node": 2,  # train processes per node (one per GPU with device: cuda)
    "data_parallel_size": None,  # optional; checked against the world size
    # harness
    "device": "cpu",  # cpu: gloo; cuda: NCCL, one GPU per train process (SLIME_EXT_DEVICE overrides)
    "train_worker_class": "slime_ext.training.worker.TrainWorker",
    "ray_num_cpus": None,  # logical CPUs Ray advertises (default: the machine's)
    "ray_object_store_memory_mb": 128,
    "setup_timeout_seconds": 300.0,
    "rollout_timeout_seconds": 300.0,
    "train_timeout_seconds": 600.0,  # per rollout; a train call that outruns it fails the run
    "verify_ledger": True,  # check after every rollout that each kept sample trained exactly once, where planned
    "cost_profile": None,  # a measured cost profile (slime-ext calibrate) for the planner instead of FLOPs
}
TRAIN_KEYS = frozenset(TrainConfig.__dataclass_fields__)
ALL_KEYS = TRAIN_KEYS | frozenset(RUN_DEFAULTS)
_POSITIVE_INTS = ("num_rollout", "rollout_batch_size", "n_samples_per_prompt", "actor_num_nodes",
                  "actor_num_gpus_per_node", "synthetic_prompt_length_min", "synthetic_prompt_length_max",
                  "synthetic_max_samples_per_rollout", "ray_object_store_memory_mb")
_POSITIVE_FLOATS = ("setup_timeout_seconds", "rollout_timeout_seconds", "train_timeout_seconds",
                    "synthetic_response_length_median")
_PROBABILITIES = ("synthetic_multi_sample_prob", "synthetic_masked_span_prob")


class ConfigError(ValueError):
    """A run config that cannot run; the message lists each problem with the key and the fix."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        where = f"config {source}" if source else "config"
        super().__init__(f"{where} is invalid:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass(frozen=True)
class RunConfig:
    """A validated run config: the training part, the rollout/harness options, and derived sizes."""

    train: TrainConfig
    options: Mapping[str, Any]
    source: str | None = None
    #: the keys the file set (for printing)
    given: Mapping[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return _world_size(self.options)

    @property
    def dp_size(self) -> int:
        return self.train.dp_size(self.world_size)

    def train_parallel_config(self) -> dict:
        """slime's ``train_parallel_config`` dict (the planner's input)."""
        return self.train.train_parallel_config(self.world_size)

    def args(self) -> SimpleNamespace:
        """Everything as one slime-style namespace (what rollout functions and ``build_dp_schedule`` read)."""
        return SimpleNamespace(**self.train.to_dict(), **self.options)

    def to_dict(self) -> dict:
        return {**self.train.to_dict(), **self.options}


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, sorted(ALL_KEYS), n=1, cutoff=0.75)
    return f"did you mean {close[0]!r}?" if close else "remove it (see slime_ext/rollout/config.py for the keys)"


def _world_size(options: Mapping[str, Any]) -> int:
    """Train processes: ``actor_num_nodes x actor_num_gpus_per_node`` (the one place it is computed)."""
    return int(options["actor_num_nodes"]) * int(options["actor_num_gpus_per_node"])


def _check_types(options: Mapping[str, Any], problems: list[str]) -> None:
    for key in _POSITIVE_INTS:
        v = options[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.append(f"{key}={v!r}: must be a positive integer")
    for key in _POSITIVE_FLOATS:
        v = options[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            problems.append(f"{key}={v!r}: must be a positive number")
    for key in _PROBABILITIES:
        v = options[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            problems.append(f"{key}={v!r}: must be a probability in [0, 1]")
    sigma = options["synthetic_response_length_sigma"]
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or sigma < 0:
        problems.append(f"synthetic_response_length_sigma={sigma!r}: must be a number >= 0")
    if not isinstance(options["verify_ledger"], bool):
        problems.append(f"verify_ledger={options['verify_ledger']!r}: must be true or false")
    if options["cost_profile"] is not None:
        from slime_ext.schedule import CostProfile, ScheduleError

        try:
            CostProfile.load(str(options["cost_profile"]))
        except ScheduleError as e:
            problems.append(f"cost_profile={options['cost_profile']!r}: {e}")
    ncpu = options["ray_num_cpus"]
    if ncpu is not None and (isinstance(ncpu, bool) or not isinstance(ncpu, (int, float)) or not ncpu > 0):
        problems.append(f"ray_num_cpus={ncpu!r}: must be a positive number or null (the machine's CPU count)")
    if options["device"] not in DEVICES:
        problems.append(f"device={options['device']!r}: must be one of {DEVICES} (or set {DEVICE_ENV})")
    if options["actor_num_nodes"] != 1:
        problems.append(f"actor_num_nodes={options['actor_num_nodes']!r}: this harness starts a single-node Ray on "
                        f"loopback; set actor_num_nodes: 1 and put every train process in actor_num_gpus_per_node")
    for key in ("rollout_function_path", "train_worker_class"):
        v = options[key]
        if not isinstance(v, str) or "." not in v:
            problems.append(f"{key}={v!r}: must be a dotted path 'package.module.name'")
            continue
        module = v.rsplit(".", 1)[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            problems.append(f"{key}={v!r}: module {module!r} is not importable; check the spelling and PYTHONPATH")


def _check_layout(train: TrainConfig, options: Mapping[str, Any], problems: list[str]) -> None:
    world = _world_size(options)
    mp = train.model_parallel_size()
    sizes = (f"pipeline_model_parallel_size={train.pipeline_model_parallel_size} x tensor_model_parallel_size="
             f"{train.tensor_model_parallel_size} x context_parallel_size={train.context_parallel_size}")
    if world % mp:
        problems.append(f"actor_num_nodes x actor_num_gpus_per_node = {world} train processes is not a multiple of "
                        f"{sizes} = {mp}: data_parallel_size would not be whole; set actor_num_gpus_per_node to a "
                        f"multiple of {mp}")
        return
    dp = options["data_parallel_size"]
    if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or dp * mp != world):
        problems.append(f"data_parallel_size={dp!r} x {sizes} = {dp * mp if isinstance(dp, int) else '?'} but "
                        f"actor_num_nodes x actor_num_gpus_per_node = {world} train processes; set "
                        f"actor_num_gpus_per_node: {dp * mp if isinstance(dp, int) else '?'} or data_parallel_size: "
                        f"{world // mp}")


def _check_gpus(train: TrainConfig, options: Mapping[str, Any], problems: list[str]) -> None:
    import torch  # only for device: cuda

    world = _world_size(options)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < world:
        problems.append(f"device='cuda' (or {DEVICE_ENV}=cuda) needs one GPU per train process: {world}, but this "
                        f"machine has {have}; lower actor_num_gpus_per_node or use device: cpu")


def _check_schedule(train: TrainConfig, options: Mapping[str, Any], problems: list[str]) -> None:
    """What the planner (or the legacy path) would reject on the first rollout, found before any process starts."""
    args = SimpleNamespace(**train.to_dict(), **options)
    world = _world_size(options)
    dp = train.dp_size(world)
    parallel = ParallelConfig.from_dict(train.train_parallel_config(world))
    synthetic = options["rollout_function_path"] == DEFAULT_ROLLOUT_FUNCTION
    rollouts = int(options["rollout_batch_size"]) * int(options["n_samples_per_prompt"])
    gbs, mbs = train.global_batch_size, train.micro_batch_size
    dyn_gbs = train.use_dynamic_global_batch_size
    bounds = synthetic_bounds(args) if synthetic else None
    if synthetic:
        p_min, p_max = options["synthetic_prompt_length_min"], options["synthetic_prompt_length_max"]
        if not p_min <= p_max < train.seq_length:
            problems.append(f"synthetic_prompt_length_min={p_min}, synthetic_prompt_length_max={p_max}: need min <= "
                            f"max < seq_length={train.seq_length} (every sample needs a response token)")
        if train.max_tokens_per_gpu is not None and train.max_tokens_per_gpu * train.context_parallel_size \
                < bounds["min_total_length"]:
            problems.append(
                f"max_tokens_per_gpu={train.max_tokens_per_gpu} is below every sample: the shortest sample the "
                f"generator emits has synthetic_prompt_length_min + 1 = {bounds['min_total_length']} tokens, so every "
                f"micro-batch would exceed the cap; raise max_tokens_per_gpu to at least seq_length="
                f"{train.seq_length}")

    if train.dp_schedule == "legacy":
        if not dyn_gbs:
            if gbs is None or gbs % dp:
                problems.append(f"global_batch_size={gbs!r}: the legacy path (dp_schedule: legacy) counts samples per "
                                f"step and needs a multiple of data_parallel_size={dp}")
                return
            if not train.use_dynamic_batch_size:
                local = gbs // dp
                if local % mbs:
                    problems.append(f"global_batch_size={gbs} / data_parallel_size={dp} = {local} samples per rank "
                                    f"and step is not a multiple of micro_batch_size={mbs} (legacy static batch); "
                                    f"make global_batch_size a multiple of {dp * mbs}")
                elif train.vpp_size > 1 and (local // mbs) % train.mb_group_size:
                    problems.append(f"global_batch_size={gbs}: {local // mbs} micro-batches per rank and step is not a "
                                    f"multiple of microbatch_group_size_per_vp_stage={train.mb_group_size} (needed by "
                                    f"the interleaved VPP schedule); make global_batch_size a multiple of "
                                    f"{dp * mbs * train.mb_group_size}")
            if synthetic and rollouts < gbs:
                problems.append(f"global_batch_size={gbs} samples per step (legacy path) but a rollout may have only "
                                f"rollout_batch_size x n_samples_per_prompt = {rollouts} samples; lower "
                                f"global_batch_size or raise rollout_batch_size")
        return

    try:
        batch = BatchConfig.from_args(args)
    except ScheduleError as exc:
        problems.append(str(exc))
        return
    if not synthetic:
        return  # the samples per step depend on the rollout function: the planner checks every rollout
    steps_rollouts = rollouts if dyn_gbs else gbs
    if not dyn_gbs and rollouts < gbs:
        problems.append(f"global_batch_size={gbs} rollouts per step but a rollout iteration has only "
                        f"rollout_batch_size x n_samples_per_prompt = {rollouts} rollouts: no step could be formed; "
                        f"lower global_batch_size or raise rollout_batch_size")
        return
    if steps_rollouts < dp:
        problems.append(f"a step holds {steps_rollouts} rollouts but data_parallel_size={dp}: every rank needs a "
                        f"sample; raise global_batch_size / rollout_batch_size")
    if not batch.use_dynamic_batch_size:
        if bounds["max_samples_per_rollout"] > 1:
            problems.append(
                f"use_dynamic_batch_size=false (static micro_batch_size={mbs}) needs the same number of samples in "
                f"every step, but synthetic_multi_sample_prob={options['synthetic_multi_sample_prob']} lets a "
                f"rollout emit up to {bounds['max_samples_per_rollout']} samples; set synthetic_multi_sample_prob: 0 "
                f"or use_dynamic_batch_size: true with max_tokens_per_gpu")
            return
        step_samples = rollouts // dp * dp if dyn_gbs else gbs
        count = -(-step_samples // mbs)
        if count % parallel.align:
            problems.append(
                f"a step of {step_samples} samples makes {count} micro-batches of micro_batch_size={mbs}, not a "
                f"multiple of data_parallel_size x microbatch_group_size = {parallel.align}; make "
                f"{'rollout_batch_size x n_samples_per_prompt' if dyn_gbs else 'global_batch_size'} a multiple of "
                f"{parallel.align * mbs}")


def validate(mapping: Mapping[str, Any], *, source: str | None = None) -> RunConfig:
    """Check a config mapping (the YAML's content) completely; :class:`ConfigError` lists every problem."""
    if not isinstance(mapping, Mapping):
        raise ConfigError([f"the config must be a mapping of key: value, got {type(mapping).__name__}"], source)
    given = {str(k).replace("-", "_"): v for k, v in mapping.items()}
    problems = [f"unknown key {k!r}: {_suggest(k)}" for k in sorted(set(given) - ALL_KEYS)]
    options = {**RUN_DEFAULTS, **{k: v for k, v in given.items() if k in RUN_DEFAULTS}}
    env_device = os.environ.get(DEVICE_ENV)
    if env_device:
        options["device"] = env_device
    for key in _POSITIVE_FLOATS:
        if isinstance(options[key], int) and not isinstance(options[key], bool):
            options[key] = float(options[key])
    _check_types(options, problems)

    train_keys = {k: v for k, v in given.items() if k in TRAIN_KEYS}
    backend = {"cpu": "gloo", "cuda": "nccl"}.get(options["device"])
    if backend and train_keys.get("dist_backend") not in (None, backend):
        problems.append(f"dist_backend={train_keys['dist_backend']!r} does not match device={options['device']!r}; "
                        f"drop dist_backend (the harness picks {backend!r})")
    elif backend:
        train_keys["dist_backend"] = backend
    try:
        train = TrainConfig.from_mapping(train_keys)
    except TrainConfigError as exc:
        problems.append(str(exc))
        raise ConfigError(problems, source) from None
    if problems:
        raise ConfigError(problems, source)
    _check_layout(train, options, problems)
    if not problems and options["device"] == "cuda":
        _check_gpus(train, options, problems)
    if not problems:
        _check_schedule(train, options, problems)
    if problems:
        raise ConfigError(problems, source)
    return RunConfig(train=train, options=options, source=source, given=given)


def load_run_config(source: str | Path | Mapping[str, Any], **overrides: Any) -> RunConfig:
    """A validated :class:`RunConfig` from a YAML path or a mapping; ``overrides`` replace keys of the file."""
    name = None
    if isinstance(source, (str, Path)):
        import yaml

        name = str(source)
        try:
            with open(source) as fh:
                mapping = yaml.safe_load(fh) or {}
        except FileNotFoundError:
            raise ConfigError([f"no such file {name!r}; pass --config path/to/config.yaml"]) from None
        except yaml.YAMLError as exc:
            raise ConfigError([f"not valid YAML: {exc}"], name) from None
    else:
        mapping = source
    if overrides:
        if not isinstance(mapping, Mapping):
            raise ConfigError([f"the config must be a mapping, got {type(mapping).__name__}"], name)
        mapping = {**mapping, **overrides}
    return validate(mapping, source=name)
