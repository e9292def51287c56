"""The slime integration reads Megatron's layout flags off slime's args (``--decoder-first-pipeline-num-layers``,
``--decoder-last-pipeline-num-layers``, ``--pipeline-model-parallel-layout``, ``--account-for-embedding/loss-in-
pipeline-split``): the plan's ParallelConfig carries them, and values Megatron refuses are refused by name."""

from __future__ import annotations

import pytest

from slime_ext.integrations.slime import planner
from slime_ext.schedule import ScheduleError, build_dp_schedule
from slime_ext.schedule.compat import parallel_from_args
from slime_ext.schedule.stages import StageCosts

from test_slime_integration import PARALLEL, slime_args

LENGTHS = [30, 20, 10, 50, 40, 40, 25, 25, 60, 35, 45, 15, 20, 30, 40, 50]
DIMS = dict(hidden_size=64, num_layers=8, num_attention_heads=4, vocab_size=1000)


def plan(**args):
    return planner.plan(slime_args(**args), PARALLEL, LENGTHS, global_batch_size=16, rollout_indices=list(range(16)))


def test_the_layout_flags_come_from_megatrons_args():
    sched = plan(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1,
                 decoder_last_pipeline_num_layers=1, **DIMS)
    p = sched.parallel
    assert (p.pp_size, p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers) == (4, 1, 1)
    assert p.stage_layers(8).decoder == (1, 3, 3, 1)
    assert StageCosts.from_model(sched.cost_model, p).linear_share[0] < 0.25  # one layer of eight, no output layer
    accounted = plan(pipeline_model_parallel_size=2, account_for_embedding_in_pipeline_split=True,
                     account_for_loss_in_pipeline_split=True, num_layers=6, hidden_size=64, num_attention_heads=4)
    assert accounted.parallel.stage_layers(6).decoder == (3, 3)
    assert accounted.parallel.account_for_loss_in_pipeline_split
    # args without them (Megatron's defaults None / False): the even split, as before
    assert plan(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=None,
                account_for_loss_in_pipeline_split=False).parallel == \
        plan(pipeline_model_parallel_size=4).parallel


def test_the_layout_string_comes_from_megatrons_args():
    vpp = {**PARALLEL, "vpp_size": 2, "microbatch_group_size_per_vp_stage": 2}  # Megatron derived vpp 2
    args = slime_args(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|tttt|tL", **DIMS)
    merged = parallel_from_args(args, vpp)
    assert merged.pipeline_model_parallel_layout == "Et|tt|tttt|tL"
    assert merged.stage_layers(8).decoder == (1, 2, 4, 1)
    # a dict that says otherwise is a conflict, never one side silently winning
    with pytest.raises(ScheduleError, match="must agree"):
        parallel_from_args(args, {**vpp, "pipeline_model_parallel_layout": "Et|ttt|ttt|tL"})
    tpc = planner.v024_parallel_config(args, 2)
    assert tpc["pipeline_model_parallel_layout"] == "Et|tt|tttt|tL" and tpc["vpp_size"] == 2


@pytest.mark.parametrize("args, match", [
    (dict(decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=1), "leave 5 layers for 2 middle"),
    (dict(decoder_first_pipeline_num_layers=2, account_for_loss_in_pipeline_split=True), "cannot be combined"),
    (dict(account_for_embedding_in_pipeline_split=True), r"9 layers \(num_layers 8 plus the embedding"),
    (dict(pipeline_model_parallel_layout="Et|t|t|t|t|t|t|tL"), "pass vpp_size = 2"),
    (dict(decoder_last_pipeline_num_layers=0), "decoder_last_pipeline_num_layers"),
])
def test_values_megatron_refuses_are_refused(args, match):
    with pytest.raises(ScheduleError, match=match):
        plan(pipeline_model_parallel_size=4, **DIMS, **args)


def test_the_library_entry_point_reads_them_alike():
    args = slime_args(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1,
                      decoder_last_pipeline_num_layers=1, **DIMS)
    ours = build_dp_schedule(args, PARALLEL, LENGTHS, global_batch_size=16, rollout_indices=list(range(16)))
    theirs = planner.plan(args, PARALLEL, LENGTHS, global_batch_size=16, rollout_indices=list(range(16)))
    assert ours.parallel == theirs.parallel and ours.parallel.decoder_first_pipeline_num_layers == 1
    assert ours.micro_batch_indices == theirs.micro_batch_indices
    with pytest.raises(ScheduleError, match="leave 5 layers for 2 middle"):
        build_dp_schedule(slime_args(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=2,
                                     decoder_last_pipeline_num_layers=1, **DIMS),
                          PARALLEL, LENGTHS, global_batch_size=16, rollout_indices=list(range(16)))
