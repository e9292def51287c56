"""One entry point (issue 22, item 4): ``slime_ext.schedule.build_dp_schedule(args, train_parallel_config, ...)``
reads slime's and Megatron's flags off ``args`` exactly as the slime integration does, pipeline size included, so
the library and the integration plan alike (both build one ``PlanRequest`` with ``compat.request_from_args``; the
library's ``build_dp_schedule`` is the only one, and slime's hook gets its plain 4-tuple from
``planner.slime_dp_schedule``); a layout field given two different ways is refused, not guessed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.workloads import make_lengths
from slime_ext.integrations.slime import planner
from slime_ext.schedule import CostProfile, ParallelConfig, ScheduleError, build_dp_schedule
from slime_ext.schedule.compat import parallel_from_args

DIMS = dict(hidden_size=512, num_layers=8, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=1536,
            vocab_size=32000, swiglu=True)
N = 96


def slime_args(**megatron):
    """slime's flags as its argparse namespace holds them, Megatron's parallel sizes among them."""
    return SimpleNamespace(global_batch_size=24, micro_batch_size=1, use_dynamic_batch_size=True,
                           max_tokens_per_gpu=4096, balance_data=True, balance_by_flops=False,
                           use_dynamic_global_batch_size=False, disable_rollout_trim_samples=False,
                           use_wandb=False, use_tensorboard=False, **DIMS, **megatron)


def rollout(seed=7):
    lengths = [min(int(x), 4096) for x in make_lengths("rl", N, seed)]  # rl-like, capped at max_tokens_per_gpu
    ids = [i // 2 for i in range(N)]  # rollouts of two samples
    return lengths, ids


def slimes_dict(dp=2, vpp=1, group=1):
    """slime's ``train_parallel_config``: no pipeline size, no p2p mode (slime/backends/megatron_utils/actor.py)."""
    return {"dp_size": dp, "cp_size": 1, "vpp_size": vpp, "microbatch_group_size_per_vp_stage": group}


def both_paths(args, tpc, lengths, ids):
    library = build_dp_schedule(args, tpc, lengths, global_batch_size=args.global_batch_size, rollout_indices=ids)
    integration = planner.plan(args, tpc, lengths, global_batch_size=args.global_batch_size, rollout_indices=ids)
    return library, integration


LAYOUTS = [  # (Megatron's args, slime's dict): pp > 1 with and without VPP, the p2p mode given or Megatron's default
    pytest.param(dict(pipeline_model_parallel_size=4), slimes_dict(), id="pp4"),
    pytest.param(dict(pipeline_model_parallel_size=2), slimes_dict(dp=3), id="pp2-dp3"),
    pytest.param(dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
                 slimes_dict(vpp=2, group=4), id="pp4-vpp2-overlap-default"),
    pytest.param(dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, overlap_p2p_comm=False),
                 slimes_dict(vpp=2, group=2), id="pp2-vpp2-batched"),
]


@pytest.mark.parametrize("megatron, tpc", LAYOUTS)
def test_the_library_and_the_integration_plan_pipelines_alike(megatron, tpc):
    args = slime_args(**megatron)
    lengths, ids = rollout()
    library, integration = both_paths(args, tpc, lengths, ids)
    pp = megatron["pipeline_model_parallel_size"]
    assert library.parallel == integration.parallel
    assert library.parallel.pp_size == pp
    assert library.parallel.overlap_p2p_comm == (tpc["vpp_size"] > 1 and megatron.get("overlap_p2p_comm", True))
    assert library.partitions == integration.partitions
    assert library.micro_batch_indices == integration.micro_batch_indices
    assert library.num_microbatches == integration.num_microbatches
    spans = [s.predicted_makespan for s in library.stats]
    assert spans == [s.predicted_makespan for s in integration.stats]
    assert all(span is not None and span > 0 for span in spans)  # planned for the pipeline
    # slime's own signature unpacks to the same plan
    assert planner.slime_dp_schedule(args, tpc, lengths, global_batch_size=args.global_batch_size,
                                     rollout_indices=ids) == (library.partitions, library.micro_batch_indices,
                                                              library.num_microbatches, library.rollouts_per_step)


def test_the_library_no_longer_plans_a_pipeline_job_as_if_it_had_none():
    """What the issue saw: slime's dict has no pipeline size, so the library planned pp-unaware. Now the same input
    plans with the pipeline objective, and that differs from the pp = 1 plan on this rollout."""
    lengths, ids = rollout()
    piped = build_dp_schedule(slime_args(pipeline_model_parallel_size=4), slimes_dict(), lengths,
                              rollout_indices=ids)
    flat = build_dp_schedule(slime_args(), slimes_dict(), lengths, rollout_indices=ids)
    assert piped.parallel.pp_size == 4 and flat.parallel.pp_size == 1
    assert flat.stats[0].predicted_makespan is None and piped.stats[0].predicted_makespan is not None
    assert (piped.micro_batch_indices, piped.num_microbatches) != (flat.micro_batch_indices, flat.num_microbatches)


def test_a_measured_profile_on_args_prices_both_paths(tmp_path):
    profile = CostProfile(step_overhead_s=0.01, microbatch_overhead_s=0.003, per_token_s=1e-5,
                          per_sample_quadratic_s=2e-10, backward_forward_ratio=2.0, p2p_s=0.001)
    path = tmp_path / "profile.json"
    profile.save(str(path))
    args = slime_args(pipeline_model_parallel_size=4, cost_profile=str(path))
    lengths, ids = rollout(seed=8)
    library, integration = both_paths(args, slimes_dict(), lengths, ids)
    assert library.cost_model == integration.cost_model == profile
    assert [s.predicted_makespan for s in library.stats] == [s.predicted_makespan for s in integration.stats]
    assert library.micro_batch_indices == integration.micro_batch_indices


@pytest.mark.parametrize("path", ["library", "integration"])
def test_a_pipeline_size_given_two_ways_must_agree(path):
    lengths, ids = rollout()
    args = slime_args(pipeline_model_parallel_size=4)
    tpc = {**slimes_dict(), "pp_size": 2}
    with pytest.raises(ScheduleError) as info:
        if path == "library":
            build_dp_schedule(args, tpc, lengths, rollout_indices=ids)
        else:
            planner.plan(args, tpc, lengths, global_batch_size=None, rollout_indices=ids)
    message = str(info.value)
    assert "pp_size=2" in message and "args.pipeline_model_parallel_size=4" in message and "must agree" in message
    # agreeing is fine, and a dict that says nothing takes args' value
    assert parallel_from_args(args, {**slimes_dict(), "pp_size": 4}) == parallel_from_args(args, slimes_dict())


def test_a_parallel_config_is_held_to_the_same_rule():
    """A ``ParallelConfig`` states every field: args that disagree with it are refused, args that agree (or say
    nothing) leave it as it is."""
    layout = ParallelConfig(dp_size=2, pp_size=4, vpp_size=2, microbatch_group_size_per_vp_stage=4,
                            overlap_p2p_comm=True)
    assert parallel_from_args(slime_args(pipeline_model_parallel_size=4, overlap_p2p_comm=True), layout) is layout
    assert parallel_from_args(slime_args(), layout) is layout
    with pytest.raises(ScheduleError, match=r"pp_size=1 but args.pipeline_model_parallel_size=4"):
        parallel_from_args(slime_args(pipeline_model_parallel_size=4), ParallelConfig(dp_size=2))
    with pytest.raises(ScheduleError, match=r"overlap_p2p_comm=True but args.overlap_p2p_comm=False"):
        parallel_from_args(slime_args(overlap_p2p_comm=False), layout)


def test_the_p2p_mode_counts_only_under_vpp():
    """Without VPP there is no p2p mode to choose: a dict's and args' disagreeing flags are not a conflict; with VPP
    they are, and neither given is Megatron-LM's default (overlapped)."""
    plain = parallel_from_args(slime_args(pipeline_model_parallel_size=2, overlap_p2p_comm=True),
                               {**slimes_dict(), "overlap_p2p_comm": False})
    assert plain.pp_size == 2 and plain.overlap_p2p_comm is False
    interleaved = slimes_dict(vpp=2, group=2)
    assert parallel_from_args(slime_args(pipeline_model_parallel_size=2), interleaved).overlap_p2p_comm is True
    with pytest.raises(ScheduleError, match="overlap_p2p_comm=False but args.overlap_p2p_comm=True"):
        parallel_from_args(slime_args(pipeline_model_parallel_size=2, overlap_p2p_comm=True),
                           {**interleaved, "overlap_p2p_comm": False})


def test_bad_input_is_still_refused_by_the_layouts_own_checks():
    with pytest.raises(ScheduleError, match="dp_size"):
        parallel_from_args(slime_args(pipeline_model_parallel_size=2), [2, 1])
    with pytest.raises(ScheduleError, match="pp_size"):
        parallel_from_args(slime_args(pipeline_model_parallel_size=0), slimes_dict())
