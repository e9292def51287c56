"""TrainConfig: loading, validation with clear messages, Megatron's rank layout; bad configs fail before any process."""

from __future__ import annotations

import pytest

from slime_ext.training.config import TrainConfig, TrainConfigError, load_train_config


def test_yaml_mapping_with_dashes_and_string_floats(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-4\nmin-lr: 0\npipeline_model_parallel_size: 2\nnum_layers: 4\n"
                    "rollout_function: my.module.fn\n")
    with pytest.raises(TrainConfigError, match=r"unknown training config keys \['rollout_function'\]"):
        load_train_config(path)
    cfg = load_train_config(path, ignore_unknown=True, dp_schedule="legacy")
    assert cfg.lr == 1e-4 and isinstance(cfg.min_lr, float) and cfg.dp_schedule == "legacy"


def test_layout_follows_megatron_order_dp_fastest():
    cfg = TrainConfig(pipeline_model_parallel_size=2, num_layers=4)
    assert [(cfg.layout(r, 4).dp_rank, cfg.layout(r, 4).pp_rank) for r in range(4)] == [(0, 0), (1, 0), (0, 1),
                                                                                         (1, 1)]
    assert cfg.train_parallel_config(4) == {"dp_size": 2, "cp_size": 1, "vpp_size": 1,
                                            "microbatch_group_size_per_vp_stage": 2}


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp_schedule="both"), "dp_schedule='both'"),
    (dict(use_dynamic_batch_size=True), "max_tokens_per_gpu=None: use_dynamic_batch_size needs"),
    (dict(tensor_model_parallel_size=2), "tensor parallelism 1 only"),
    (dict(virtual_pipeline_model_parallel_size=2), "needs pipeline_model_parallel_size > 1"),
    (dict(pipeline_model_parallel_size=2, num_layers=3), "multiple of pipeline_model_parallel_size"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=4,
          microbatch_group_size_per_vp_stage=1), ">= pipeline_model_parallel_size"),
    (dict(lr_decay_style="cosine"), "needs --lr-decay-samples"),
    (dict(lr_decay_samples=8, lr_warmup_samples=8), "must exceed lr_warmup_samples"),
    (dict(hidden_size=30, num_attention_heads=4), "multiple of num_attention_heads"),
    (dict(optimizer="lion"), "'adam' or 'sgd'"),
])
def test_bad_values_are_rejected_with_the_key(kwargs, message):
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig(**kwargs)


def test_world_size_must_match_the_model_parallel_size_before_any_process_starts():
    from slime_ext.training.worker import TrainWorker

    cfg = dict(pipeline_model_parallel_size=2, num_layers=4)
    with pytest.raises(TrainConfigError, match="world_size=3 is not a multiple of tp\\*cp\\*pp = 2"):
        TrainWorker(cfg, rank=0, world_size=3)
    with pytest.raises(TrainConfigError, match="rank=4 is outside"):
        TrainWorker(cfg, rank=4, world_size=4)
