"""TrainConfig: flat keys routed to nested sections and back, validation with clear messages (batch flags by the
planning layer's BatchConfig only), Megatron's rank layout; bad configs fail before any process."""

from __future__ import annotations

import pytest

from slime_ext.schedule import BatchConfig, ParallelConfig
from slime_ext.schedule.config import BATCH_FLAGS
from slime_ext.train_config import KEYS, RESETTABLE_KEYS, OptimConfig
from slime_ext.train_config import TrainConfig, TrainConfigError, load_train_config


def test_yaml_mapping_with_dashes_and_string_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-4\nmin-lr: 0\npipeline_model_parallel_size: 2\nnum_layers: 4\n"
                    "rollout_function: my.module.fn\n")
    with pytest.raises(TrainConfigError, match=r"unknown training config keys \['rollout_function'\]"):
        load_train_config(path)
    cfg = load_train_config(path, ignore_unknown=True, dp_schedule="legacy")
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.min_lr, float) and cfg.dp_schedule == "legacy"
    assert cfg.parallel == ParallelConfig(dp_size=None, pp_size=2) and cfg.model.num_layers == 4


def test_flat_keys_route_to_their_sections_and_flatten_back():
    flat = dict(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=96, balance_data=True,
                pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=4, hidden_size=32,
                lr=1e-3, lr_decay_style="cosine", lr_decay_samples=100, seed=7, dp_schedule="legacy")
    cfg = TrainConfig.from_mapping(flat)
    assert cfg.batch == BatchConfig(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=96,
                                    balance_data=True)
    # the planner's own layout, its group size resolved by Megatron's rule (the pipeline size by default)
    assert cfg.parallel == ParallelConfig(dp_size=None, pp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2)
    for group in (None, 3):
        par = TrainConfig.from_mapping(dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                            microbatch_group_size_per_vp_stage=group, num_layers=4)).parallel
        assert par.microbatch_group_size_per_vp_stage == par.for_world(4).microbatch_group_size_per_vp_stage \
            == (group or 2)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_size) == (4, 32, 128)
    assert (cfg.optim.lr, cfg.optim.lr_decay_steps, cfg.seed) == (1e-3, 100, 7)
    args = cfg.to_args()
    assert set(vars(args)) == KEYS and {k: getattr(args, k) for k in flat} == flat
    assert TrainConfig.from_args(args) == cfg and TrainConfig.from_mapping(cfg.to_dict()) == cfg
    assert cfg.replace(lr=2e-3, micro_batch_size=3).optim.lr == 2e-3
    assert cfg.replace(micro_batch_size=3).batch.micro_batch_size == 3
    with pytest.raises(TrainConfigError, match=r"unknown training config keys \['lrr'\]"):
        cfg.replace(lrr=1.0)


def test_without_batch_flags_the_process_plans_nothing():
    cfg = TrainConfig.from_mapping({"num_layers": 2})
    assert cfg.batch is None
    assert cfg.to_args().use_dynamic_batch_size is False and cfg.to_args().global_batch_size is None
    assert TrainConfig.from_args(cfg.to_args()) == cfg  # the batch flags' defaults are "not set"
    assert cfg.replace(use_dynamic_global_batch_size=True).batch == BatchConfig(use_dynamic_global_batch_size=True)


def test_resettable_keys_are_the_batch_flags_the_schedule_and_the_optimizer():
    assert RESETTABLE_KEYS == set(BATCH_FLAGS) | {"dp_schedule"} | set(OptimConfig.__dataclass_fields__)


def test_layout_follows_megatron_order_dp_fastest():
    cfg = TrainConfig.from_mapping(dict(pipeline_model_parallel_size=2, num_layers=4))
    assert [(cfg.layout(r, 4).dp_rank, cfg.layout(r, 4).pp_rank) for r in range(4)] == [(0, 0), (1, 0), (0, 1),
                                                                                         (1, 1)]
    assert cfg.train_parallel_config(4) == {"dp_size": 2, "cp_size": 1, "vpp_size": 1,
                                            "microbatch_group_size_per_vp_stage": 1, "pp_size": 2,
                                            "overlap_p2p_comm": False, "tp_size": 1,
                                            "decoder_first_pipeline_num_layers": None,
                                            "decoder_last_pipeline_num_layers": None,
                                            "pipeline_model_parallel_layout": None,
                                            "account_for_embedding_in_pipeline_split": False,
                                            "account_for_loss_in_pipeline_split": False}
    assert ParallelConfig.from_dict(cfg.train_parallel_config(4)) == cfg.parallel.for_world(4)
    assert cfg.parallel.for_world(4).align == 2 and cfg.dp_size(6) == 3 and cfg.parallel.dp_size is None


@pytest.mark.parametrize("flat", [
    dict(num_layers=2),  # every parallel key at its default: vpp None (Megatron's "off"), group 1
    dict(pipeline_model_parallel_size=2, num_layers=4, microbatch_group_size_per_vp_stage=None),
    dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=8),
    dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=1, num_layers=4),
    dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, num_layers=8,
         microbatch_group_size_per_vp_stage=6),
])
def test_parallel_keys_round_trip_under_megatron_names(flat):
    cfg = TrainConfig.from_mapping(flat)
    d = cfg.to_dict()
    assert TrainConfig.from_mapping(d) == cfg and TrainConfig.from_args(cfg.to_args()) == cfg
    par = cfg.parallel
    assert {k: d[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                              "virtual_pipeline_model_parallel_size", "microbatch_group_size_per_vp_stage")} == {
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": par.pp_size, "context_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None if par.vpp_size == 1 else par.vpp_size,
        "microbatch_group_size_per_vp_stage": par.microbatch_group_size_per_vp_stage}
    assert not {"dp_size", "pp_size", "vpp_size", "tp_size", "cp_size", "overlap_p2p_comm"} & set(d)
    if "virtual_pipeline_model_parallel_size" in flat and flat["virtual_pipeline_model_parallel_size"] > 1:
        assert d["microbatch_group_size_per_vp_stage"] == flat.get("microbatch_group_size_per_vp_stage",
                                                                   flat["pipeline_model_parallel_size"])


def test_a_bad_world_size_names_tp_cp_pp_and_the_fix():
    cfg = TrainConfig.from_mapping(dict(pipeline_model_parallel_size=2, num_layers=4))
    message = r"world_size=3 is not a multiple of tp\*cp\*pp = 2; start dp \* 2 train processes"
    for call in (cfg.dp_size, cfg.train_parallel_config, lambda w: cfg.layout(0, w)):
        with pytest.raises(TrainConfigError, match=message):
            call(3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp_schedule="both"), "dp_schedule='both'"),
    # batch flags: BatchConfig's own messages (key, value, fix), raised as TrainConfigError
    (dict(use_dynamic_batch_size=True), "global_batch_size is None; pass --global-batch-size N"),
    (dict(use_dynamic_batch_size=True, global_batch_size=4), "max_tokens_per_gpu is None but use_dynamic_batch_size"),
    (dict(global_batch_size=4, balance_by_flops=True), "balance_by_flops=True needs use_dynamic_batch_size=True"),
    (dict(global_batch_size=4, micro_batch_size=0), "micro_batch_size must be a positive integer, got 0"),
    (dict(global_batch_size=4, balance_data="yes"), "balance_data must be a bool"),
    (dict(tensor_model_parallel_size=2), "tensor_model_parallel_size=2: this adapter supports tensor parallelism 1 "
                                         "only"),
    (dict(context_parallel_size=2), "context_parallel_size=2: this adapter supports context parallelism 1 only"),
    (dict(virtual_pipeline_model_parallel_size=2), "virtual_pipeline_model_parallel_size=2: needs "
                                                   "pipeline_model_parallel_size > 1"),
    # ParallelConfig's refusals, under the training config's key names
    (dict(pipeline_model_parallel_size=0), "pipeline_model_parallel_size must be a positive integer, got 0"),
    (dict(virtual_pipeline_model_parallel_size=0), "virtual_pipeline_model_parallel_size must be a positive integer"),
    (dict(pipeline_model_parallel_size=2, num_layers=3), "multiple of pipeline_model_parallel_size"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=4,
          microbatch_group_size_per_vp_stage=1), "microbatch_group_size_per_vp_stage=1: Megatron's interleaved "
                                                 "schedule needs it >= pipeline_model_parallel_size = 2"),
    (dict(lr_decay_style="cosine"), "needs --lr-decay-samples"),
    (dict(lr_decay_samples=8, lr_warmup_samples=8), "must exceed lr_warmup_samples"),
    (dict(hidden_size=30, num_attention_heads=4), "multiple of num_attention_heads"),
    (dict(optimizer="lion"), "'adam' or 'sgd'"),
    (dict(lr="fast"), "lr='fast' must be a number"),
    (dict(dist_timeout_seconds=0), "dist_timeout_seconds=0.0: must be > 0"),
])
def test_bad_values_are_rejected_with_the_key(kwargs, message):
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig.from_mapping(kwargs)


def test_sections_must_be_sections():
    with pytest.raises(TrainConfigError, match="optim must be a OptimConfig, got dict"):
        TrainConfig(optim={"lr": 1.0})
    with pytest.raises(TrainConfigError, match="parallel must be a ParallelConfig, got dict"):
        TrainConfig(parallel={"pp_size": 2})


@pytest.mark.parametrize("parallel, message", [
    (ParallelConfig(dp_size=2), r"parallel.dp_size=2: the training config leaves the data-parallel size to the "
                                r"world size"),
    (ParallelConfig(dp_size=None, pp_size=2, vpp_size=2, overlap_p2p_comm=True),
     "parallel.overlap_p2p_comm=True: this trainer keeps megatron-core's default, batched p2p"),
    (ParallelConfig(dp_size=None, tp_size=2), "tensor_model_parallel_size=2: this adapter supports tensor "),
    (ParallelConfig(dp_size=None, cp_size=2), "context_parallel_size=2: this adapter supports context "),
    (ParallelConfig(dp_size=None, vpp_size=2, microbatch_group_size_per_vp_stage=1),
     "virtual_pipeline_model_parallel_size=2: needs pipeline_model_parallel_size > 1"),
])
def test_a_parallel_section_built_in_code_meets_the_trainers_limits(parallel, message):
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig(parallel=parallel, model=TrainConfig().model)


def test_world_size_must_match_the_model_parallel_size_before_any_process_starts():
    from slime_ext.training.worker import TrainWorker

    cfg = dict(pipeline_model_parallel_size=2, num_layers=4)
    with pytest.raises(TrainConfigError, match="world_size=3 is not a multiple of tp\\*cp\\*pp = 2"):
        TrainWorker(cfg, rank=0, world_size=3)
    with pytest.raises(TrainConfigError, match="rank=4 is outside"):
        TrainWorker(cfg, rank=4, world_size=4)
