"""Run-config validation: every shipped config loads; every bad one is refused with the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_ext.rollout.config import DEVICE_ENV, RUN_DEFAULTS, ConfigError, load_run_config, validate

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").rglob("*.yaml"))
GOOD = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=128,
            global_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=96, actor_num_gpus_per_node=2)


@pytest.fixture(autouse=True)
def _no_device_override(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_are_valid(path):
    cfg = load_run_config(path)
    assert cfg.world_size == cfg.dp_size * cfg.train.parallel.model_parallel_size
    if cfg.options["data_parallel_size"] is not None:
        assert cfg.options["data_parallel_size"] == cfg.dp_size


def test_defaults_and_derived_sizes():
    cfg = validate(dict(GOOD, pipeline_model_parallel_size=2, actor_num_gpus_per_node=4, num_layers=4))
    assert cfg.dp_size == 2 and cfg.world_size == 4
    assert cfg.train_parallel_config() == {"dp_size": 2, "cp_size": 1, "vpp_size": 1,
                                           "microbatch_group_size_per_vp_stage": 1, "pp_size": 2,
                                           "overlap_p2p_comm": False, "tp_size": 1,
                                           "decoder_first_pipeline_num_layers": None,
                                           "decoder_last_pipeline_num_layers": None,
                                           "pipeline_model_parallel_layout": None,
                                           "account_for_embedding_in_pipeline_split": False,
                                           "account_for_loss_in_pipeline_split": False}
    assert cfg.train.dist_backend == "gloo"
    assert {k: cfg.options[k] for k in RUN_DEFAULTS if k not in GOOD} == \
        {k: v for k, v in RUN_DEFAULTS.items() if k not in GOOD}
    args = cfg.args()
    assert args.global_batch_size == 4 and args.rollout_function_path == RUN_DEFAULTS["rollout_function_path"]


def test_dashes_and_yaml_number_strings():
    cfg = validate({**{k.replace("_", "-"): v for k, v in GOOD.items()}, "lr": "1e-4"})
    assert cfg.train.batch.use_dynamic_batch_size and cfg.train.optim.lr == 1e-4


def _problems(**changes):
    with pytest.raises(ConfigError) as info:
        validate({**GOOD, **changes})
    return "\n".join(info.value.problems)


@pytest.mark.parametrize("changes, expected", [
    (dict(global_batch_sise=4), "unknown key 'global_batch_sise': did you mean 'global_batch_size'?"),
    (dict(totally_unrelated=1), "unknown key 'totally_unrelated': remove it"),
    (dict(data_parallel_size=4), "data_parallel_size=4 x pipeline_model_parallel_size=1"),
    (dict(pipeline_model_parallel_size=2, num_layers=4, actor_num_gpus_per_node=3), "3 train processes is not a"),
    (dict(actor_num_nodes=2), "single-node Ray on loopback"),
    (dict(use_dynamic_batch_size=False, micro_batch_size=2), "synthetic_multi_sample_prob: 0"),
    (dict(use_dynamic_batch_size=False, micro_batch_size=4, synthetic_multi_sample_prob=0),
     "a step's micro-batch count, ceil(samples per step / micro_batch_size), is a multiple of dp_size*mb_group"),
    (dict(max_tokens_per_gpu=4), "max_tokens_per_gpu=4 is below every sample"),
    (dict(use_dynamic_batch_size=False, micro_batch_size=2, synthetic_multi_sample_prob=0, max_tokens_per_gpu=4),
     "max_tokens_per_gpu=4 is below every sample"),
    (dict(global_batch_size=64), "16 rollouts but global_batch_size=64 (rollouts per step): not even one step"),
    (dict(use_dynamic_batch_size=True, max_tokens_per_gpu=None), "max_tokens_per_gpu"),
    (dict(dp_schedule="legacy", global_batch_size=5), "global_batch_size=5 (samples per step on the legacy path) "
                                                      "must be a positive multiple of dp_size=2"),
    (dict(dp_schedule="legacy", global_batch_size=6, use_dynamic_batch_size=False, micro_batch_size=2),
     "global_batch_size/dp_size = 3 is not a multiple of micro_batch_size=2; make global_batch_size a multiple of 4"),
    (dict(dp_schedule="legacy", global_batch_size=40), "16 samples but global_batch_size=40 samples per step (legacy "
                                                       "path): not even one step"),
    (dict(dp_schedule="planner"), "dp_schedule"),
    (dict(launcher="slurm"), "launcher='slurm': must be one of ('ray', 'processes')"),
    (dict(train_autocast="bf16"), "train_autocast='bf16': must be one of (None, 'bfloat16', 'float16')"),
    # found by the dry run, not by a re-coded rule
    (dict(global_batch_size=1), "step 0 has 1 samples but dp_size = 2"),
    (dict(global_batch_size=5, disable_rollout_trim_samples=True), "the rollout has 16 rollouts, not a multiple of "
                                                                   "global_batch_size=5"),
    (dict(dp_schedule="legacy", pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=4,
          actor_num_gpus_per_node=4, use_dynamic_batch_size=False, global_batch_size=6, synthetic_multi_sample_prob=0),
     "3 micro-batches per rank and step is not a multiple of microbatch_group_size_per_vp_stage=2"),
    (dict(dp_schedule="legacy", pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=4,
          actor_num_gpus_per_node=4, global_batch_size=2), "below one microbatch_group_size_per_vp_stage=2"),
    (dict(dp_schedule="legacy", global_batch_size=8, disable_rollout_trim_samples=True),
     "the rollout has 17 samples, not a multiple of global_batch_size=8 (legacy path)"),
    (dict(global_batch_size=None, use_dynamic_batch_size=False, max_tokens_per_gpu=None),
     "global_batch_size is None; pass --global-batch-size N"),
    (dict(use_dynamic_batch_size=True, balance_by_flops=True, use_dynamic_global_batch_size=True,
          global_batch_size=None, rollout_batch_size=1, n_samples_per_prompt=1),
     "the rollout has 1 samples (1 rollouts) but dp_size = 2 micro-batch slots"),
    (dict(dist_backend="nccl"), "dist_backend='nccl' does not match device='cpu'"),
    (dict(device="tpu"), "device='tpu'"),
    (dict(num_rollout=0), "num_rollout=0: must be a positive integer"),
    (dict(synthetic_multi_sample_prob=1.5), "synthetic_multi_sample_prob=1.5: must be a probability"),
    (dict(synthetic_prompt_length_max=128), "synthetic_prompt_length_max=128: need min <= max < seq_length=128"),
    (dict(rollout_function_path="no_such_module.fn"), "module 'no_such_module' is not importable"),
    (dict(train_timeout_seconds=0), "train_timeout_seconds=0"),
])
def test_bad_config_names_key_and_fix(changes, expected):
    assert expected in _problems(**changes)


def test_every_problem_is_listed_at_once():
    problems = _problems(num_rollout=0, device="tpu", global_batch_sise=1)
    assert "num_rollout=0" in problems and "device='tpu'" in problems and "global_batch_sise" in problems


def test_device_env_overrides_the_file(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    assert "device='tpu'" in _problems()


def test_cuda_without_gpus_is_refused_before_anything_starts():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    assert "needs one GPU per train process: 2" in _problems(device="cuda")


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_run_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_run_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_run_config(bad)


def test_other_rollout_functions_are_dry_run_with_what_holds_for_any_samples():
    """Samples per rollout are unknown: only refusals that no rollout can avoid are reported."""
    other = dict(rollout_function_path="slime_ext.rollout.synthetic.my_generator")
    static = dict(use_dynamic_batch_size=False, micro_batch_size=2)  # refused above for the multi-sample generator
    assert validate({**GOOD, **other, **static}).dp_size == 2  # this one may emit one sample per rollout
    assert "global_batch_size=64 (rollouts per step): not even one step" in _problems(**other, global_batch_size=64)
    assert "must be a positive multiple of dp_size=2" in _problems(**other, dp_schedule="legacy", global_batch_size=5)
    assert "is not a multiple of micro_batch_size=2" in _problems(**other, dp_schedule="legacy", global_batch_size=6,
                                                                  use_dynamic_batch_size=False, micro_batch_size=2)


def test_every_refusal_names_the_rollout_it_came_from_and_the_fix():
    problems = _problems(use_dynamic_batch_size=False, micro_batch_size=2)
    assert problems.startswith("dp_schedule=rollout: a rollout of rollout_batch_size x n_samples_per_prompt = 16 "
                               "rollouts, 1 of the rollouts with 2 samples")
    assert "micro_batch_size=2" in problems and "is a multiple of dp_size*mb_group" in problems
