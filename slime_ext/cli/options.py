"""The planning flags of ``slime-ext plan`` under slime's/Megatron's names, from the command line and ``--config``.

Every key is a command-line flag (``--max-tokens-per-gpu``) and a YAML key (``max_tokens_per_gpu``; ``-`` and ``_``
are the same); flags given on the command line override the YAML. The keys are declared once, with their help, in
:data:`GROUPS`: batch flags (checked by ``BatchConfig`` only), parallel layout, the world it follows from, model dims
for the FLOPs model, the step-time estimate. A YAML config may also hold training-only keys (:data:`IGNORED_KEYS`);
they are accepted and ignored. Any other key is an error naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

from ..schedule import BatchConfig, CostModel, CostProfile, ParallelConfig, ScheduleError
from ..schedule.config import BATCH_FLAGS, LAYOUT_FLAGS, PARALLEL_KEYS
from ..schedule.pipeline_layout import layout_vpp_size
from ..schedule.cost import REQUIRED_DIMS
from ..schedule.validate import MAX_PARALLEL_SIZE, limit_name, show
from ..schemes import DEFAULT as DEFAULT_DP_SCHEDULE
from ..schemes import DP_SCHEDULES, get_dp_schedule
from .errors import CLIError

#: Achieved bf16 TFLOP/s per GPU assumed by the step-time estimate: ~40% MFU of an H100's 989 dense TFLOP/s.
DEFAULT_TFLOPS = 400.0
#: forward + backward = 3x forward FLOPs (backward computes gradients w.r.t. activations and weights).
FWD_BWD_FACTOR = 3.0


@dataclass(frozen=True)
class Key:
    name: str
    kind: str  # "int" | "bool" | "float" | "freq" | "choice" | "path" | "str"
    help: str


BATCH = [
    Key("global_batch_size", "int", "rollouts per training step"),
    Key("use_dynamic_batch_size", "bool", "pack micro-batches up to --max-tokens-per-gpu tokens (else fixed "
                                          "--micro-batch-size)"),
    Key("max_tokens_per_gpu", "int", "token cap per micro-batch per GPU (times cp_size)"),
    Key("micro_batch_size", "int", "samples per micro-batch without --use-dynamic-batch-size (default 1)"),
    Key("balance_data", "bool", "balance estimated FLOPs across DP ranks"),
    Key("balance_by_flops", "bool", "also balance FLOPs across the micro-batches of a step (dynamic only)"),
    Key("use_dynamic_global_batch_size", "bool",
        "one step of every whole rollout (counts samples; --global-batch-size unused)"),
    Key("disable_rollout_trim_samples", "bool", "an incomplete trailing step is an error instead of dropped"),
    Key("dp_schedule", "choice", "rollout (default) or legacy: the path the training job takes; the table always "
                                 "shows the rollout-side plan (see --compare legacy)"),
]
#: values of the "choice" keys
CHOICES = {"dp_schedule": DP_SCHEDULES}
PARALLEL = [
    Key("dp_size", "int", "data-parallel size (default: from --num-gpus, else 1)"),
    Key("cp_size", "int", "context-parallel size (default 1)"),
    Key("vpp_size", "int", "virtual pipeline stages per rank (default 1)"),
    Key("microbatch_group_size_per_vp_stage", "int", "with vpp_size > 1 (default: "
                                                     "--pipeline-model-parallel-size, as Megatron)"),
]
WORLD = [
    Key("num_gpus", "int", "GPUs of the training job; gives dp_size = num_gpus / (tp * pp * cp)"),
    Key("actor_num_nodes", "int", "slime: training nodes (num_gpus = nodes * GPUs per node)"),
    Key("actor_num_gpus_per_node", "int", "slime: training GPUs per node"),
    Key("tensor_model_parallel_size", "int", "TP size (default 1): for dp_size and the step-time estimate"),
    Key("pipeline_model_parallel_size", "int", "PP size (default 1): the pipeline objective, dp_size and the "
                                             "step-time estimate"),
    Key("data_parallel_size", "int", "Megatron's name for --dp-size"),
    Key("context_parallel_size", "int", "Megatron's name for --cp-size"),
    Key("virtual_pipeline_model_parallel_size", "int", "Megatron's name for --vpp-size"),
]
#: Megatron's flags that place layers on pipeline stages (ParallelConfig's layout fields): the per-stage costs
LAYOUT = [
    Key("decoder_first_pipeline_num_layers", "int", "decoder layers on the first pipeline stage (default: even split)"),
    Key("decoder_last_pipeline_num_layers", "int", "decoder layers on the last pipeline stage (default: even split)"),
    Key("pipeline_model_parallel_layout", "str", "Megatron's layout string, e.g. 'Ett|(tt|)*6,tL' (E embedding, t "
                                                 "decoder layer, m MTP, L loss; | between stages; sets the VPP size)"),
    Key("account_for_embedding_in_pipeline_split", "bool", "the embedding counts as a layer in the even split"),
    Key("account_for_loss_in_pipeline_split", "bool", "the loss counts as a layer in the even split"),
]
#: the model dims, as CostModel declares them (name, kind, help): one declaration, see slime_ext.schedule.cost
MODEL = [Key(f.name, f.metadata["kind"], f.metadata["help"]) for f in dataclasses.fields(CostModel)]
ESTIMATE = [
    Key("cost_profile", "path", "a measured cost profile (JSON from `slime-ext calibrate`): balance and price "
                                "micro-batches by seconds on your hardware instead of the FLOPs model"),
    Key("tflops", "float", f"achieved TFLOP/s per GPU for the step-time estimate (default {DEFAULT_TFLOPS:g}: "
                           f"~40%% MFU of an H100 in bf16)"),
]
GROUPS = [("batch flags (slime)", BATCH), ("parallel layout", PARALLEL), ("world (derives dp_size)", WORLD),
          ("pipeline stages (Megatron's layout flags)", LAYOUT), ("model dims (FLOPs model; without them the cost is tokens)", MODEL), ("step-time estimate", ESTIMATE)]
KEYS: dict[str, Key] = {k.name: k for _, group in GROUPS for k in group}
assert set(BATCH_FLAGS) | {"dp_schedule"} == {k.name for k in BATCH}
assert set(PARALLEL_KEYS) == {k.name for k in PARALLEL}
assert set(LAYOUT_FLAGS) == {k.name for k in LAYOUT}
#: keys that change the plan (not allowed with --from-json, which replays a saved schedule as it is; the saved
#: schedule's own pp_size, for one, is what its makespans were planned for)
PLAN_KEYS = {k.name for k in BATCH + PARALLEL + LAYOUT + MODEL} | {"cost_profile",
    "num_gpus", "actor_num_nodes", "actor_num_gpus_per_node", "data_parallel_size", "context_parallel_size",
    "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size"}

#: Keys of a run config that do not change the plan; ``slime-ext plan`` accepts and ignores them. They cover
#: the run configs of this repository (``configs/*.yaml``: ``slime_ext.train_config.TrainConfig``'s fields and
#: ``slime_ext.rollout.config.RUN_DEFAULTS``; a test keeps them in sync) and common slime/Megatron training keys.
IGNORED_KEYS = frozenset("""
    seq_length max_position_embeddings untie_embeddings_and_output_weights init_method_std hidden_dropout
    attention_dropout optimizer lr min_lr lr_warmup_init lr_decay_style lr_warmup_samples lr_decay_samples
    weight_decay clip_grad adam_beta1 adam_beta2 adam_eps sgd_momentum seed dist_backend dist_timeout_seconds
    rollout_function_path num_rollout rollout_batch_size n_samples_per_prompt rollout_seed
    synthetic_prompt_length_min synthetic_prompt_length_max synthetic_response_length_median
    synthetic_response_length_sigma synthetic_multi_sample_prob synthetic_max_samples_per_rollout
    synthetic_masked_span_prob device launcher train_autocast train_worker_class ray_num_cpus ray_object_store_memory_mb
    setup_timeout_seconds rollout_timeout_seconds train_timeout_seconds verify_ledger
    lr_warmup_iters lr_warmup_fraction lr_decay_iters train_iters num_epoch num_steps_per_rollout
    rollout_max_response_len rollout_max_prompt_len rollout_temperature rollout_top_p loss_type kl_coef
    kl_loss_coef use_kl_loss entropy_coef eps_clip eps_clip_high advantage_estimator gamma lambd bf16 fp16
    params_dtype expert_model_parallel_size expert_tensor_parallel_size sequence_parallel recompute_granularity
    recompute_method recompute_num_layers normalization norm_epsilon position_embedding_type rotary_base
    rotary_percent group_query_attention disable_bias_linear add_qkv_bias qk_layernorm attention_backend
    transformer_impl save load save_interval hf_checkpoint ref_load log_interval eval_interval use_wandb
    wandb_project colocate offload actor_num_gpus rollout_num_gpus rollout_num_gpus_per_engine
""".split())
assert not IGNORED_KEYS & set(KEYS)


# ---------------------------------------------------------------------------------------------------- argparse
def _int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _freq_arg(text: str) -> int | list[int]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, an integer of > 4300 digits, nested too deeply
        value = None
    if type(value) is int or (isinstance(value, list) and all(type(v) is int for v in value)):
        return value
    raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor a list like [0,1,1]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per key, ``--max-tokens-per-gpu`` for ``max_tokens_per_gpu``; all default to ``None`` (unset)."""
    for title, keys in GROUPS:
        group = parser.add_argument_group(title)
        for key in keys:
            flag = "--" + key.name.replace("_", "-")
            if key.kind == "bool":
                group.add_argument(flag, dest=key.name, action=argparse.BooleanOptionalAction, default=None,
                                   help=key.help or None)
            elif key.kind == "choice":
                group.add_argument(flag, dest=key.name, choices=CHOICES[key.name], default=None,
                                   help=key.help or None)
            else:
                kind = {"int": _int_arg, "float": float, "freq": _freq_arg, "path": str, "str": str}[key.kind]
                group.add_argument(flag, dest=key.name, type=kind, default=None,
                                   metavar={"path": "FILE", "str": "TEXT"}.get(key.kind, "N"),
                                   help=key.help or None)


# ---------------------------------------------------------------------------------------------------- YAML
def _check_type(where: str, key: Key, value: Any) -> Any:
    ok = {
        "int": type(value) is int,
        "bool": type(value) is bool,
        "float": type(value) in (int, float),
        "freq": type(value) is int or (isinstance(value, list) and all(type(v) is int for v in value)),
        "choice": value in CHOICES.get(key.name, ()),
        "path": isinstance(value, str) and bool(value),
        "str": isinstance(value, str) and bool(value),
    }[key.kind]
    if not ok:
        want = {"int": "an integer", "bool": "true or false", "float": "a number",
                "freq": "an integer or a list of 0/1 integers",
                "choice": " or ".join(CHOICES.get(key.name, ())), "path": "a file path",
                "str": "a non-empty string"}[key.kind]
        raise CLIError(f"{where}: key '{key.name}' is {value!r}; it must be {want}")
    return value


def load_config(path: str) -> dict[str, Any]:
    """The planning keys of a YAML run config (training-only keys dropped); unknown keys are an error."""
    try:
        import yaml
    except ImportError:
        raise CLIError("--config needs PyYAML: pip install pyyaml (it comes with slime-ext[train] and [rollout])") \
            from None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise CLIError(f"{path}: not UTF-8 text (byte {e.start}); a run config is a UTF-8 YAML mapping") from None
    except RecursionError:
        raise CLIError(f"{path}: YAML nested too deeply to read; a run config is a flat mapping of flag names "
                       f"to values") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = " ".join(str(getattr(e, "problem", None) or e).split())  # one line
        raise CLIError(f"{where}: not valid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CLIError(f"{path}: the config is a YAML {type(data).__name__}; it must be a mapping of slime flag "
                       f"names to values, e.g. 'max_tokens_per_gpu: 16384'")
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        name = str(raw_key).replace("-", "_")
        if name in IGNORED_KEYS:
            continue
        if name not in KEYS:
            close = difflib.get_close_matches(name, list(KEYS) + sorted(IGNORED_KEYS), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise CLIError(f"{path}: unknown key '{raw_key}'{hint}; `slime-ext plan --help` lists the keys it reads")
        if name in out:
            raise CLIError(f"{path}: key '{name}' is given twice (as '-' and '_' spellings)")
        if value is not None:  # batch flags are checked by BatchConfig (resolve), everything else here
            out[name] = value if name in BATCH_FLAGS else _check_type(f"{path}", KEYS[name], value)
    return out


# ---------------------------------------------------------------------------------------------------- resolve
@dataclass(frozen=True)
class Setup:
    """Everything the planner and the report need, resolved from the flags and the config."""

    parallel: ParallelConfig  # with tp_size, which only the step-time estimate reads
    batch: BatchConfig
    cost_model: CostModel | CostProfile | None
    tflops: float
    #: the training job's path (``rollout`` or ``legacy``); planning always shows the rollout-side schedule
    dp_schedule: str = DEFAULT_DP_SCHEDULE
    #: the FLOPs model from the model dims even when a measured profile is the cost (upstream's reference needs them)
    flops_model: CostModel | None = None

    @property
    def gpus_per_replica(self) -> int:
        """GPUs of one DP rank's model replica: ``tp * pp * cp``."""
        return self.parallel.model_parallel_size

    def step_seconds(self, rank_cost_max: float) -> float | None:
        """The slowest rank's step time from its cost (``StepStats.rank_cost_max``): a profile's cost is already
        seconds of forward + backward; forward FLOPs become ``3 x`` FLOPs over the replica's throughput; ``None``
        without a cost model (the cost is tokens)."""
        if self.cost_model is None:
            return None
        if isinstance(self.cost_model, CostProfile):
            return rank_cost_max
        return FWD_BWD_FACTOR * rank_cost_max / (self.tflops * 1e12 * self.gpus_per_replica)

    def makespan_seconds(self, predicted_makespan: float | None) -> float | None:
        """A pipelined step's predicted makespan in seconds: a profile's are seconds already; FLOPs plans' are
        per-stage forward FLOPs, run by one stage's ``tp * cp`` GPUs; ``None`` without a FLOPs model."""
        if predicted_makespan is None or self.cost_model is None:
            return None
        if isinstance(self.cost_model, CostProfile):
            return predicted_makespan
        return predicted_makespan / (self.tflops * 1e12 * self.parallel.tp_size * self.parallel.cp_size)


def given_values(args: argparse.Namespace) -> dict[str, Any]:
    """The keys set on the command line."""
    return {k: getattr(args, k) for k in KEYS if getattr(args, k, None) is not None}


def _positive(values: Mapping[str, Any], source: Mapping[str, str], name: str, default: int | None) -> int | None:
    """A parallel size or GPU count: a positive integer up to ``MAX_PARALLEL_SIZE``."""
    value = values.get(name, default)
    if value is not None and (type(value) is not int or value < 1):
        raise CLIError(f"{source.get(name, name)} is {show(value)}; it must be a positive integer")
    if value is not None and value > MAX_PARALLEL_SIZE:
        raise CLIError(f"{source.get(name, name)} is {show(value)}, above the limit {limit_name(MAX_PARALLEL_SIZE)}; "
                       f"give the real size")
    return value


#: the achieved TFLOP/s per GPU the step-time estimate accepts (outside it the estimate is 0 s or inf s)
TFLOPS_RANGE = (1e-6, 1e6)


def _tflops(values: Mapping[str, Any], source: str) -> float:
    tflops = values.get("tflops", DEFAULT_TFLOPS)
    if type(tflops) not in (int, float) or not (math.isfinite(tflops) and tflops > 0):
        raise CLIError(f"{source} is {show(tflops)}; it must be a finite number > 0 (achieved TFLOP/s per GPU)")
    if not TFLOPS_RANGE[0] <= tflops <= TFLOPS_RANGE[1]:
        raise CLIError(f"{source} is {tflops:g}; it must be in [{TFLOPS_RANGE[0]:g}, {TFLOPS_RANGE[1]:g}] "
                       f"(achieved TFLOP/s per GPU, e.g. {DEFAULT_TFLOPS:g} on an H100)")
    return float(tflops)


def _one_of(values, source, a: str, b: str) -> int | None:
    """``a`` and its Megatron alias ``b``: either may be given; both must then agree."""
    va, vb = _positive(values, source, a, None), _positive(values, source, b, None)
    if va is not None and vb is not None and va != vb:
        raise CLIError(f"{source[a]} is {va} but {source[b]} is {vb}; they name the same size, give one")
    return va if va is not None else vb


def resolve(cli: Mapping[str, Any], config: Mapping[str, Any], config_path: str | None) -> Setup:
    """Merge config and command line (the command line wins) into the planner's configs."""
    values = {**config, **cli}
    source = {k: f"{config_path}: {k}" for k in config}
    source.update({k: "--" + k.replace("_", "-") for k in cli})
    for k in KEYS:
        source.setdefault(k, "--" + k.replace("_", "-"))

    tp = _positive(values, source, "tensor_model_parallel_size", 1)
    pp = _positive(values, source, "pipeline_model_parallel_size", 1)
    cp = _one_of(values, source, "cp_size", "context_parallel_size") or 1
    vpp = _one_of(values, source, "vpp_size", "virtual_pipeline_model_parallel_size")
    layout = values.get("pipeline_model_parallel_layout")
    if vpp is None and isinstance(layout, str):  # Megatron derives the VPP size from the layout string
        try:
            vpp = layout_vpp_size(layout, pp)
        except ScheduleError as e:
            raise CLIError(f"{source['pipeline_model_parallel_layout']}: {e}") from None
    vpp = vpp or 1
    world = _positive(values, source, "num_gpus", None)
    gpus_per_node = _positive(values, source, "actor_num_gpus_per_node", None)
    nodes = _positive(values, source, "actor_num_nodes", None)
    if gpus_per_node is not None or nodes is not None:
        if gpus_per_node is None:
            raise CLIError(f"{source['actor_num_nodes']} is given without actor_num_gpus_per_node; give both "
                           f"(or num_gpus)")
        from_nodes = (nodes or 1) * gpus_per_node
        if world is not None and world != from_nodes:
            raise CLIError(f"{source['num_gpus']} is {world} but actor_num_nodes * actor_num_gpus_per_node is "
                           f"{from_nodes}; give one of them")
        world = from_nodes
    dp = _one_of(values, source, "dp_size", "data_parallel_size")
    replica_layout = ParallelConfig(dp_size=None, tp_size=tp, cp_size=cp, pp_size=pp)
    replica = replica_layout.model_parallel_size
    if world is not None:
        try:
            world_dp = replica_layout.for_world(world).dp_size
        except ScheduleError:
            raise CLIError(f"{world} GPUs do not divide into model replicas of tp*pp*cp = {tp}*{pp}*{cp} = "
                           f"{replica} GPUs; fix num_gpus or the parallel sizes") from None
        if dp is not None and dp != world_dp:
            dp_source = source["dp_size"] if "dp_size" in values else source["data_parallel_size"]
            raise CLIError(f"{dp_source} is {dp} but {world} GPUs / (tp*pp*cp = {replica}) give "
                           f"dp_size = {world_dp}; give one of them")
        dp = world_dp
    mb_group = _positive(values, source, "microbatch_group_size_per_vp_stage", None)
    if mb_group is None and vpp > 1 and "pipeline_model_parallel_size" not in values:
        raise CLIError(f"vpp_size = {vpp} needs --microbatch-group-size-per-vp-stage (Megatron defaults it to "
                       f"--pipeline-model-parallel-size; give either)")

    tflops = _tflops(values, source["tflops"])
    model = {k.name: values[k.name] for k in MODEL if k.name in values}
    if model and not all(k in model for k in REQUIRED_DIMS):
        missing = ", ".join("--" + k.replace("_", "-") for k in REQUIRED_DIMS if k not in model)
        raise CLIError(f"the FLOPs model needs {missing} too (given: {', '.join(sorted(model))}); "
                       f"give all three core dims or no model dims (cost = tokens)")
    try:  # the batch flags' only check
        batch = BatchConfig.from_args(argparse.Namespace(**{k: values[k] for k in BATCH_FLAGS if k in values}))
    except ScheduleError as e:
        from_file = config_path is not None and any(k in config and k not in cli for k in BATCH_FLAGS)
        raise CLIError(f"{config_path}: {e}" if from_file else str(e)) from None
    try:
        parallel = ParallelConfig.from_megatron(dp or 1, context_parallel_size=cp, pipeline_model_parallel_size=pp,
                                                virtual_pipeline_model_parallel_size=vpp,
                                                microbatch_group_size_per_vp_stage=mb_group,
                                                tensor_model_parallel_size=tp,
                                                **{k: values[k] for k in LAYOUT_FLAGS if k in values})
        dp_schedule = get_dp_schedule(values.get("dp_schedule")).name
        cost_model = CostModel.from_args(model)
        if cost_model is not None:
            cost_model.coefficients()  # validates moe_layer_freq against num_layers
            parallel.stage_layers(cost_model.num_layers)  # the layout flags against num_layers, as Megatron
        flops_model = cost_model
        if values.get("cost_profile"):  # measured seconds replace the FLOPs estimate
            cost_model = CostProfile.load(values["cost_profile"])
    except ScheduleError as e:
        raise CLIError(str(e)) from None
    return Setup(parallel=parallel, batch=batch, cost_model=cost_model, tflops=float(tflops),
                 dp_schedule=dp_schedule, flops_model=flops_model)


def replay_setup(cli: Mapping[str, Any], schedule) -> Setup:
    """A saved schedule's own configs, plus the step-time keys from the command line: --tflops, and
    --tensor-model-parallel-size over the recorded tp_size (1 in schedules saved before it was recorded)."""
    source = {k: "--" + k.replace("_", "-") for k in KEYS}
    tflops = _tflops(cli, "--tflops")
    tp = _positive(cli, source, "tensor_model_parallel_size", schedule.parallel.tp_size)
    return Setup(parallel=dataclasses.replace(schedule.parallel, tp_size=tp), batch=schedule.batch,
                 cost_model=schedule.cost_model, tflops=float(tflops))
