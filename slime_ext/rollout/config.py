"""The run config: one YAML file with the training keys and the rollout/harness keys, validated before any process.

Training keys are :class:`slime_ext.train_config.TrainConfig`'s (flat names); the rollout/harness keys are
:data:`RUN_DEFAULTS`. Each is documented where it is declared. :func:`load_run_config` raises :class:`ConfigError`
listing every problem, each naming the key and the fix. The schedule is checked by running the planner itself (or
the legacy path: the ``dp_schedule`` scheme's own ``dry_run``) on the extreme rollouts the rollout function can
produce (:func:`_dry_run`), not by a copy of its rules.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

from slime_ext.schedule import BatchConfig, ScheduleError
from slime_ext.schemes import Scheme, get_dp_schedule
from slime_ext.train_config import KEYS as TRAIN_KEYS
from slime_ext.train_config import TrainConfig, TrainConfigError

from .synthetic import SYNTHETIC_DEFAULTS, synthetic_bounds

DEFAULT_ROLLOUT_FUNCTION = "slime_ext.rollout.synthetic.generate_rollout"
DEVICE_ENV = "SLIME_EXT_DEVICE"
DEVICES = ("cpu", "cuda")
LAUNCHERS = ("ray", "processes")
AUTOCAST_DTYPES = (None, "bfloat16", "float16")

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
    "launcher": "ray",  # ray: Ray actors (slime's layout); processes: torch.multiprocessing, no Ray (.processes)
    "train_autocast": None,  # null: the model's fp32; bfloat16: each train step under torch.autocast (GPU runs)
    "train_worker_class": "slime_ext.training.worker.TrainWorker",
    "ray_num_cpus": None,  # logical CPUs Ray advertises (default: the machine's)
    "ray_object_store_memory_mb": 128,
    "setup_timeout_seconds": 300.0,
    "rollout_timeout_seconds": 300.0,
    "train_timeout_seconds": 600.0,  # per rollout; a train call that outruns it fails the run
    "verify_ledger": True,  # check after every rollout that each kept sample trained exactly once, where planned
    "cost_profile": None,  # a measured cost profile (slime-ext calibrate) for the planner instead of FLOPs
}
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
    if options["launcher"] not in LAUNCHERS:
        problems.append(f"launcher={options['launcher']!r}: must be one of {LAUNCHERS}")
    if options["train_autocast"] not in AUTOCAST_DTYPES:
        problems.append(f"train_autocast={options['train_autocast']!r}: must be one of {AUTOCAST_DTYPES} "
                        f"(null: fp32)")
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
    par = train.parallel
    sizes = (f"pipeline_model_parallel_size={par.pp_size} x tensor_model_parallel_size={par.tp_size} x "
             f"context_parallel_size={par.cp_size}")
    mp = par.model_parallel_size
    try:
        dp = train.dp_size(world)
    except TrainConfigError:
        problems.append(f"actor_num_nodes x actor_num_gpus_per_node = {world} train processes is not a multiple of "
                        f"{sizes} = {mp}: data_parallel_size would not be whole; set actor_num_gpus_per_node to a "
                        f"multiple of {mp}")
        return
    given = options["data_parallel_size"]
    if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given != dp):
        problems.append(f"data_parallel_size={given!r} x {sizes} = {given * mp if isinstance(given, int) else '?'} "
                        f"but actor_num_nodes x actor_num_gpus_per_node = {world} train processes; set "
                        f"actor_num_gpus_per_node: {given * mp if isinstance(given, int) else '?'} or "
                        f"data_parallel_size: {dp}")


def _check_gpus(options: Mapping[str, Any], problems: list[str]) -> None:
    import torch  # only for device: cuda

    world = _world_size(options)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < world:
        problems.append(f"device='cuda' (or {DEVICE_ENV}=cuda) needs one GPU per train process: {world}, but this "
                        f"machine has {have}; lower actor_num_gpus_per_node or use device: cpu")


def _check_sample_lengths(train: TrainConfig, options: Mapping[str, Any], bounds: dict, problems: list[str]) -> None:
    """What the synthetic generator's lengths need from the model and the token cap (not planner rules)."""
    seq_length, batch = train.model.seq_length, train.batch
    p_min, p_max = options["synthetic_prompt_length_min"], options["synthetic_prompt_length_max"]
    if not p_min <= p_max < seq_length:
        problems.append(f"synthetic_prompt_length_min={p_min}, synthetic_prompt_length_max={p_max}: need min <= "
                        f"max < seq_length={seq_length} (every sample needs a response token)")
    if batch.max_tokens_per_gpu is not None and batch.max_tokens_per_gpu * train.parallel.cp_size \
            < bounds["min_total_length"]:
        problems.append(
            f"max_tokens_per_gpu={batch.max_tokens_per_gpu} is below every sample: the shortest sample the "
            f"generator emits has synthetic_prompt_length_min + 1 = {bounds['min_total_length']} tokens, so every "
            f"micro-batch would exceed the cap; raise max_tokens_per_gpu to at least seq_length={seq_length}")


_MULTI_SAMPLE_FIX = ("rollouts that emit several samples change the samples per step: set "
                     "synthetic_multi_sample_prob: 0, or use_dynamic_batch_size: true with max_tokens_per_gpu")


def _extreme_rollouts(train: TrainConfig, options: Mapping[str, Any], bounds: dict | None, scheme: Scheme
                      ) -> list[tuple[str, list[int], list[int], str]]:
    """``(what, total_lengths, rollout_ids, fix)`` of the rollouts the pre-check plans.

    The sample counts are the extremes the rollout function can produce; the lengths are the easiest for the
    ``scheme`` (:meth:`~slime_ext.schemes.Scheme.easiest_length`), so a refusal is one the run meets whenever a
    rollout reaches those counts. Synthetic generator (``bounds``): one sample per rollout;
    the most samples per rollout; and, if rollouts may emit several samples, the first ``e`` rollouts with one extra
    sample (``e`` up to ``micro_batch_size``: every step size up to the next micro-batch). Any other rollout
    function: one sample per rollout.
    """
    rollouts = int(options["rollout_batch_size"]) * int(options["n_samples_per_prompt"])
    batch = train.batch
    shortest = bounds["min_total_length"] if bounds else 1
    length = scheme.easiest_length(batch, shortest, train.model.seq_length)

    def make(what: str, per_rollout: list[int], fix: str = "") -> tuple[str, list[int], list[int], str]:
        ids = [r for r, k in enumerate(per_rollout) for _ in range(k)]
        return f"{what} of {length} tokens", [length] * len(ids), ids, fix

    out = [make("one sample per rollout", [1] * rollouts)]
    most = bounds["max_samples_per_rollout"] if bounds else 1
    if most > 1:
        out.append(make(f"{most} samples per rollout", [most] * rollouts))
        for extra in range(1, min(1 if batch.use_dynamic_batch_size else batch.micro_batch_size, rollouts) + 1):
            per_rollout = [2] * extra + [1] * (rollouts - extra)
            out.append(make(f"{extra} of the rollouts with 2 samples, the rest with 1 (synthetic_multi_sample_prob="
                            f"{options['synthetic_multi_sample_prob']}), samples", per_rollout, _MULTI_SAMPLE_FIX))
    return out


def _dry_run(train: TrainConfig, options: Mapping[str, Any], problems: list[str]) -> None:
    """Plan the extreme rollouts of the configured rollout function with the real planner, before any process
    starts: whatever it refuses there, a rollout of the run could make it refuse too."""
    args = SimpleNamespace(**train.to_dict(), **options)
    synthetic = options["rollout_function_path"] == DEFAULT_ROLLOUT_FUNCTION
    bounds = synthetic_bounds(args) if synthetic else None
    if synthetic:
        _check_sample_lengths(train, options, bounds, problems)
    scheme = get_dp_schedule(train.dp_schedule)
    parallel = train.parallel_for_world(_world_size(options))
    for what, lengths, ids, fix in _extreme_rollouts(train, options, bounds, scheme):
        try:
            scheme.dry_run(lengths, ids, args, parallel, train.batch)
        except ScheduleError as exc:
            problems.append(f"dp_schedule={scheme.name}: a rollout of rollout_batch_size x n_samples_per_prompt "
                            f"= {len(set(ids))} rollouts, {what}, is refused by {scheme.title}: {exc}"
                            f"{'; ' + fix if fix else ''}")
            return


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
    if train.batch is None:  # no batch flag given: BatchConfig says what it needs
        try:
            BatchConfig()
        except ScheduleError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError(problems, source)
    _check_layout(train, options, problems)
    if not problems and options["device"] == "cuda":
        _check_gpus(options, problems)
    if not problems:
        _dry_run(train, options, problems)
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
