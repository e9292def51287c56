"""ParallelConfig, the one parallel-layout class (issue 16): tp_size, a data-parallel size left to the world size
(``dp_size=None``, resolved by ``for_world`` and refused by every planner entry), and Megatron's group-size rule."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from slime_ext.schedule import (BatchConfig, CostModel, DPSchedule, ParallelConfig, ScheduleError, build_dp_schedule,
                                check_schedule, plan_schedule)
from slime_ext.schedule.pipeline_pricing import pipeline_pricing
from slime_ext.schemes import get_dp_schedule

UNRESOLVED = r"parallel.dp_size is None: resolve it with ParallelConfig.for_world\(world_size\)"
BATCH = BatchConfig(global_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=200)
LENGTHS = [100, 50, 30, 90, 20, 60, 70, 40]


@pytest.mark.parametrize("parallel", [ParallelConfig(dp_size=None), ParallelConfig(dp_size=None, pp_size=2),
                                      ParallelConfig(dp_size=None, pp_size=2, vpp_size=2)])
def test_an_unresolved_dp_size_is_refused_by_every_planner_entry(parallel):
    entries = [
        lambda: parallel.align,
        lambda: plan_schedule(LENGTHS, parallel, BATCH),
        lambda: build_dp_schedule(SimpleNamespace(**dataclasses.asdict(BATCH)), parallel, LENGTHS),
        lambda: pipeline_pricing(parallel, None, 200),
        lambda: get_dp_schedule("legacy").dry_run(LENGTHS, list(range(8)), SimpleNamespace(global_batch_size=4),
                                                  parallel, BATCH),
        lambda: get_dp_schedule("legacy").schedule(LENGTHS, parallel, BATCH, global_batch_size=4),
        lambda: get_dp_schedule("rollout").dry_run(LENGTHS, list(range(8)), SimpleNamespace(), parallel, BATCH),
    ]
    for entry in entries:
        with pytest.raises(ScheduleError, match=UNRESOLVED):
            entry()
    resolved = parallel.for_world(2 * parallel.model_parallel_size)
    assert resolved.dp_size == 2 and plan_schedule(LENGTHS, resolved, BATCH).dp_size == 2


def test_a_saved_schedule_needs_its_dp_size():
    d = plan_schedule(LENGTHS, ParallelConfig(dp_size=2), BATCH).to_dict()
    d["parallel"]["dp_size"] = None
    with pytest.raises(ScheduleError, match="malformed schedule dict: " + UNRESOLVED):
        DPSchedule.from_dict(d)


def test_schedules_saved_before_tp_size_was_recorded_still_load():
    s = plan_schedule(LENGTHS, ParallelConfig(dp_size=2), BATCH, cost_model=CostModel(
        hidden_size=64, num_layers=2, num_attention_heads=4, vocab_size=128))
    d = s.to_dict()
    assert d["parallel"]["tp_size"] == 1
    del d["parallel"]["tp_size"]
    back = DPSchedule.from_dict(d)
    assert back == s and back.parallel.tp_size == 1 and check_schedule(back) == []
    tp2 = plan_schedule(LENGTHS, ParallelConfig(dp_size=2, tp_size=2), BATCH)  # the planner ignores tp_size
    assert DPSchedule.from_dict(tp2.to_dict()).parallel.tp_size == 2
    tp1 = plan_schedule(LENGTHS, ParallelConfig(dp_size=2), BATCH)
    assert (tp2.partitions, tp2.micro_batch_indices) == (tp1.partitions, tp1.micro_batch_indices)


def test_for_world_resolves_dp_from_tp_cp_pp():
    par = ParallelConfig(dp_size=None, tp_size=2, cp_size=2, pp_size=2, vpp_size=2)
    assert par.model_parallel_size == 8
    assert par.for_world(16) == dataclasses.replace(par, dp_size=2)
    assert par.for_world(np.int64(8)).dp_size == 1 and type(par.for_world(np.int64(8)).dp_size) is int
    assert ParallelConfig(dp_size=3).for_world(4).dp_size == 4  # the world decides
    for world in (12, 0, -8, True, 8.0, "16", None):
        with pytest.raises(ScheduleError, match=rf"world_size={world!r} is not a multiple of tp\*cp\*pp = 8; "
                                                rf"start dp \* 8 train processes \(one per rank of dp x pp\)"):
            par.for_world(world)


def test_the_group_size_follows_megatrons_rule():
    # vpp > 1 without a group: the pipeline size where it is known (Megatron's default) ...
    assert ParallelConfig(dp_size=2, pp_size=4, vpp_size=2).microbatch_group_size_per_vp_stage == 4
    assert ParallelConfig(dp_size=2, pp_size=4, vpp_size=2) == ParallelConfig.from_megatron(
        2, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, overlap_p2p_comm=False)
    # ... else refused (slime's dict has no pipeline size), as from_dict refuses a dict without it
    with pytest.raises(ScheduleError, match=r"microbatch_group_size_per_vp_stage is None but vpp_size = 2; pass it"):
        ParallelConfig(dp_size=2, vpp_size=2)
    with pytest.raises(ScheduleError, match=r"vpp_size = 2 but no microbatch_group_size_per_vp_stage"):
        ParallelConfig.from_dict({"dp_size": 2, "vpp_size": 2, "pp_size": 2})
    # Megatron's interleaved schedule needs the group >= pp; a group of any size without pp (slime's dict)
    assert ParallelConfig(dp_size=2, pp_size=4, vpp_size=2, microbatch_group_size_per_vp_stage=6).align == 12
    assert ParallelConfig(dp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=1).align == 2
    with pytest.raises(ScheduleError, match=r"microbatch_group_size_per_vp_stage=3: Megatron's interleaved schedule "
                                            r"needs it >= pp_size = 4; pass a group size >= 4"):
        ParallelConfig(dp_size=2, pp_size=4, vpp_size=2, microbatch_group_size_per_vp_stage=3)
    # without VPP the group is unused: 1 whatever is given (slime's dict and Megatron give the pipeline size), so
    # configs that plan alike compare equal, built directly, from slime's dict or from Megatron's sizes
    assert ParallelConfig(pp_size=4).microbatch_group_size_per_vp_stage == 1
    assert ParallelConfig(pp_size=4, microbatch_group_size_per_vp_stage=2) == ParallelConfig(pp_size=4)
    assert ParallelConfig.from_dict({"dp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 4,
                                     "pp_size": 4}) == ParallelConfig.from_megatron(1, pipeline_model_parallel_size=4)
    with pytest.raises(ScheduleError, match="microbatch_group_size_per_vp_stage must be a positive integer"):
        ParallelConfig(microbatch_group_size_per_vp_stage=0)  # checked even where it is unused
    # from_megatron resolves as before: without a pipeline size the default group is 1
    assert ParallelConfig.from_megatron(2, virtual_pipeline_model_parallel_size=2).microbatch_group_size_per_vp_stage \
        == 1


def test_tp_size_is_a_checked_size():
    assert ParallelConfig.from_megatron(2, tensor_model_parallel_size=4).tp_size == 4
    assert ParallelConfig.from_megatron(2, tensor_model_parallel_size=None).tp_size == 1
    assert ParallelConfig.from_dict({"dp_size": 2, "tp_size": 2}).tp_size == 2
    assert ParallelConfig.from_dict({"dp_size": 2}).tp_size == 1  # slime's dict lacks it
    for bad in (0, 2.0, True, None):
        with pytest.raises(ScheduleError, match=r"tp_size must be a positive integer.*pass 1 without tensor "):
            ParallelConfig(tp_size=bad)
