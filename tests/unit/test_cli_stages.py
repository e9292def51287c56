"""``slime-ext plan`` with Megatron's layout flags: accepted from the command line and a config, shown as each
stage's share of the forward cost, and refused with a clear error where Megatron refuses them."""

from __future__ import annotations

import re

import numpy as np
import pytest

from slime_ext.schedule import CostModel, ParallelConfig
from slime_ext.schedule.stages import StageCosts

from test_cli import run_main
from test_cli_pipeline import FLAGS

MODEL = CostModel(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=1024,
                  vocab_size=32000)


def shares(out: str) -> list[float]:
    line = next(line for line in out.splitlines() if line.startswith("stages:"))
    return [float(x) for x in re.search(r"stage ([0-9. ]+) \(", line).group(1).split()]


@pytest.mark.parametrize("flags, parallel", [
    ([], dict()),
    (["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"],
     dict(decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=1)),
    (["--pipeline-model-parallel-layout", "Ett|t|t|L"], dict(pipeline_model_parallel_layout="Ett|t|t|L")),
])
def test_plan_takes_the_layout_flags_and_shows_the_stage_split(flags, parallel):
    out = run_main("plan", *FLAGS, "--pipeline-model-parallel-size", "4", *flags).stdout
    expect = StageCosts.from_model(MODEL, ParallelConfig(dp_size=2, pp_size=4, **parallel)).linear_share
    np.testing.assert_allclose(shares(out), expect, atol=5e-4)
    assert shares(out)[-1] > shares(out)[1]  # the last stage carries the output layer


def test_a_layout_string_sets_the_virtual_pipeline_size(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("pipeline_model_parallel_layout: 'Et|t|t|t||||L'\naccount_for_loss_in_pipeline_split: false\n")
    out = run_main("plan", *FLAGS, "--pipeline-model-parallel-size", "4", "--config", cfg).stdout
    assert "vpp_size=2" in out and "pipeline_model_parallel_layout=Et|t|t|t||||L" in out
    expect = StageCosts.from_model(MODEL, ParallelConfig.from_megatron(
        2, pipeline_model_parallel_size=4, pipeline_model_parallel_layout="Et|t|t|t||||L")).linear_share
    np.testing.assert_allclose(shares(out), expect, atol=5e-4)


@pytest.mark.parametrize("flags, match", [
    (["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "3"],
     "leave -1 layers for 2 middle pipeline ranks"),
    (["--decoder-first-pipeline-num-layers", "0"], "decoder_first_pipeline_num_layers"),
    (["--decoder-first-pipeline-num-layers", "2"], "leave 2 layers for 3 middle ranks"),
    (["--account-for-embedding-in-pipeline-split"], r"5 layers \(num_layers 4 plus the embedding"),
    (["--pipeline-model-parallel-layout", "Ett|t|tL"], "3 stages, not a multiple of pp_size = 4"),
    (["--pipeline-model-parallel-layout", "Ett|t|t|L", "--vpp-size", "2"], "pass vpp_size = 1"),
    (["--pipeline-model-parallel-layout", "Ett|t|t|Q"], "'Q' at 8 is not a layer letter"),
    (["--pipeline-model-parallel-layout", "Ett|t|t|L", "--decoder-last-pipeline-num-layers", "1"],
     "cannot be combined"),
])
def test_plan_refuses_bad_layout_flags(flags, match):
    res = run_main("plan", *FLAGS, "--pipeline-model-parallel-size", "4", *flags, expect=2)
    assert re.search(match, res.stderr), res.stderr


def test_a_config_value_of_the_wrong_type_is_refused(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("pipeline_model_parallel_layout: 3\n")
    res = run_main("plan", *FLAGS, "--config", cfg, expect=2)
    assert "pipeline_model_parallel_layout' is 3; it must be a non-empty string" in res.stderr
