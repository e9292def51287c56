"""slime-ext's plan of a Megatron-RL rollout collection (:mod:`slime_ext.integrations.megatron_rl.plan`), its
settings and refusals (:mod:`.settings`), and the launcher's split of the command line: the parts of the Megatron-LM
integration that need no Megatron-LM checkout (ci/megatron_rl_test runs the rest against real Megatron-LM)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from slime_ext.integrations.megatron_rl.plan import (CollectionPlan, check_collection_plan, plan_collection,
                                                     split_rows_into_steps)
from slime_ext.integrations.megatron_rl.settings import MegatronRLSettingError, Options, PlanSettings
from slime_ext.schedule import CostModel, ParallelConfig, ScheduleError
from slime_ext.schedule import microbatch_costs, pipeline_pricing

MODEL = CostModel(hidden_size=256, num_layers=8, num_attention_heads=8, vocab_size=32000)


def rollout_lengths(n: int, seed: int, pad: int = 0, longest: int = 4096) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = np.minimum(longest, rng.lognormal(6.0, 0.9, n).astype(int) + 8)
    return np.concatenate([lengths, np.zeros(pad, dtype=int)])


# ---------------------------------------------------------------------------------------------------- the plan
def test_every_row_once_padding_nowhere_equal_counts():
    lengths = rollout_lengths(256, 0, pad=8)
    plan = plan_collection(lengths, parallel=ParallelConfig(dp_size=8), num_steps=4, cap=4096, cost_model=MODEL)
    trained = sorted(i for r in range(8) for mb in plan.rank_micro_batches(r) for i in mb)
    assert trained == list(range(256))  # the 8 padding rows (256..263) nowhere, every other row once
    assert plan.padding_rows == tuple(range(256, 264))
    assert plan.samples_per_step == (64, 64, 64, 64)
    assert plan.step_rows[1] == tuple(range(64, 128))  # steps are contiguous runs, in collection order
    for s in range(4):
        assert {len(plan.micro_batches[r][s]) for r in range(8)} == {plan.num_microbatches[s]}
    assert plan.computed_tokens() == int(lengths.sum())  # no padding at all without CP / SP


def test_uneven_collection_splits_into_steps_that_differ_by_one():
    assert [len(r) for r in split_rows_into_steps(10, 4)] == [3, 3, 2, 2]
    lengths = rollout_lengths(66, 1)
    plan = plan_collection(lengths, parallel=ParallelConfig(dp_size=2), num_steps=4, cap=4096)
    assert plan.samples_per_step == (17, 17, 16, 16)


def test_pipeline_and_vpp_counts_align_to_the_group():
    lengths = rollout_lengths(256, 2)
    parallel = ParallelConfig.from_megatron(4, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    plan = plan_collection(lengths, parallel=parallel, num_steps=2, cap=4096, cost_model=MODEL)
    assert all(n % 4 == 0 for n in plan.num_microbatches)  # the VPP group (= pp)
    assert all(stats.predicted_makespan is not None for stats in plan.schedule.stats)


def test_context_parallel_slots_and_sequence_parallel_tail():
    lengths = np.array([5, 7, 12, 3, 9, 30, 1, 2])
    plan = plan_collection(lengths, parallel=ParallelConfig(dp_size=2, cp_size=2), num_steps=1, cap=64,
                           seq_length_multiple=4, token_multiple=6)
    assert plan.row_multiple == 12  # lcm(tp*cp = 6, cp = 2, 2*cp = 4)
    assert plan.slot_lengths == (8, 8, 12, 4, 12, 32, 4, 4)
    for r in range(2):
        for mb, tokens in zip(plan.rank_micro_batches(r), plan.rank_micro_batch_tokens(r)):
            slots = sum(plan.slot_lengths[i] for i in mb)
            assert tokens % 12 == 0 and slots <= tokens < slots + 12
            assert tokens <= plan.cap or len(mb) == 1
    assert plan.cap == 60  # 64 rounded down to the row multiple, so tail padding never takes a bin over it


def test_a_row_longer_than_the_cap_sits_alone():
    lengths = np.array([900, 10, 20, 30, 40, 50])
    plan = plan_collection(lengths, parallel=ParallelConfig(dp_size=2), num_steps=1, cap=512)
    alone = [mb for r in range(2) for mb in plan.rank_micro_batches(r) if 0 in mb]
    assert alone == [(0,)]


def test_plan_is_deterministic():
    lengths = rollout_lengths(128, 3)
    parallel = ParallelConfig.from_megatron(4, pipeline_model_parallel_size=2)
    a = plan_collection(lengths, parallel=parallel, num_steps=2, cap=4096, cost_model=MODEL)
    b = plan_collection(lengths, parallel=parallel, num_steps=2, cap=4096, cost_model=MODEL)
    assert a.micro_batches == b.micro_batches


@pytest.mark.parametrize("lengths, kwargs, needle", [
    ([5, 6, 7], dict(num_steps=2), "optimizer step 0 of the collection has 2 samples but every one of the "
                                   "dp_size*mb_group = 4"),
    ([0, 0, 0, 0], dict(num_steps=1), "none holds a token"),
    ([5, -1, 7, 8], dict(num_steps=1), "row 1 has length -1"),
    ([5, 6, 7, 8], dict(num_steps=0), "num_steps = 0"),
    ([5, 6, 7, 8], dict(num_steps=1, cap=3, token_multiple=4), "below one aligned unit of 4 tokens"),
])
def test_bad_input_is_refused_naming_the_fix(lengths, kwargs, needle):
    with pytest.raises(ScheduleError, match=needle.replace("*", r"\*")):
        plan_collection(lengths, parallel=ParallelConfig(dp_size=4), **{"cap": 64, **kwargs})


def test_the_checker_catches_a_broken_plan():
    lengths = rollout_lengths(32, 4)
    plan = plan_collection(lengths, parallel=ParallelConfig(dp_size=2), num_steps=2, cap=4096)
    check_collection_plan(plan, lengths, align=2)
    steps = [[list(mb) for mb in step] for step in plan.micro_batches[0]]
    steps[0][0][0], steps[1][0][0] = steps[1][0][0], steps[0][0][0]  # a row of step 1 trained in step 0, and back
    rank0 = tuple(tuple(tuple(mb) for mb in step) for step in steps)
    tokens = tuple(tuple(int(sum(lengths[i] for i in mb)) for mb in step) for step in rank0)
    broken = dataclasses.replace(plan, micro_batches=(rank0, *plan.micro_batches[1:]),
                                 micro_batch_tokens=(tokens, *plan.micro_batch_tokens[1:]))
    with pytest.raises(ScheduleError, match="do not hold exactly the step's rows"):
        check_collection_plan(broken, lengths, align=2)
    wrong_tokens = dataclasses.replace(plan, micro_batch_tokens=((tuple(t + 1 for t in plan.micro_batch_tokens[0][0]),
                                                                  *plan.micro_batch_tokens[0][1:]),
                                                                 *plan.micro_batch_tokens[1:]))
    with pytest.raises(ScheduleError, match="computes"):
        check_collection_plan(wrong_tokens, lengths, align=2)
    too_big = dataclasses.replace(plan, cap=1)
    with pytest.raises(ScheduleError, match="above the cap"):
        check_collection_plan(too_big, lengths, align=2)
    twice = dataclasses.replace(plan, logprob_order=((0, 0, *plan.logprob_order[0][2:]), *plan.logprob_order[1:]))
    with pytest.raises(ScheduleError, match="log-prob order of DP rank 0"):
        check_collection_plan(twice, lengths, align=2)


@hsettings(max_examples=25, deadline=None)
@given(st.data())
def test_plan_invariants_over_layouts(data):
    """Draws the DP, pipeline, VPP and CP sizes, the steps, the cap and padding rows; the plan's own checker (run
    inside plan_collection) and these assertions must hold."""
    dp = data.draw(st.sampled_from([1, 2, 4]), label="dp")
    # (pipelined plans order the log-prob call forward-only: drawn once this tree prices forward-only pipelines)
    pp = data.draw(st.sampled_from([1, 2, 4]), label="pp")
    vpp = data.draw(st.sampled_from([1, 2]), label="vpp") if pp > 1 else 1
    cp = data.draw(st.sampled_from([1, 2]), label="cp")
    steps = data.draw(st.integers(1, 3), label="steps")
    group = pp if vpp > 1 else 1
    n = data.draw(st.integers(dp * group * steps, dp * group * steps + 40), label="rows")
    lengths = data.draw(st.lists(st.integers(1, 500), min_size=n, max_size=n), label="lengths")
    pad = data.draw(st.integers(0, 5), label="padding rows")
    lengths = lengths + [0] * pad
    cap = data.draw(st.sampled_from([2048, 4096]), label="cap")  # a step never needs more micro-batches than rows
    parallel = ParallelConfig.from_megatron(dp, context_parallel_size=cp, pipeline_model_parallel_size=pp,
                                            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    plan = plan_collection(lengths, parallel=parallel, num_steps=steps, cap=cap, cost_model=MODEL,
                           seq_length_multiple=2 * cp if cp > 1 else 1)
    trained = sorted(i for r in range(dp) for mb in plan.rank_micro_batches(r) for i in mb)
    assert trained == list(range(n))
    assert all(c % group == 0 for c in plan.num_microbatches)
    assert sum(plan.samples_per_step) == n and max(plan.samples_per_step) - min(plan.samples_per_step) <= 1
    for r in range(dp):  # the log-prob call runs each of the rank's micro-batches once
        assert sorted(plan.logprob_order[r]) == list(range(sum(plan.num_microbatches)))


def test_the_steps_are_the_requests_explicit_steps():
    """The collection's steps reach the planner as steps (PlanRequest.step_of), not as rollouts of one sample:
    the schedule records them, drops nothing, and step s plans exactly the rows of step s."""
    lengths = rollout_lengths(66, 5, pad=3)
    plan = plan_collection(lengths, parallel=ParallelConfig(dp_size=2), num_steps=4, cap=4096, cost_model=MODEL)
    schedule = plan.schedule
    real = np.flatnonzero(lengths > 0)
    assert schedule.step_of == [s for s, rows in enumerate(plan.step_rows) for _ in rows]
    assert schedule.dropped == [] and schedule.num_steps == 4
    for s, rows in enumerate(plan.step_rows):
        assert sorted(int(real[i]) for i in schedule.step_samples[s]) == list(rows)
    assert schedule.rollout_ids is None  # no rollout ids disguise the steps


def test_one_pipeline_stage_keeps_the_plan_order_for_log_probs():
    plan = plan_collection(rollout_lengths(64, 6), parallel=ParallelConfig(dp_size=2), num_steps=2, cap=4096)
    assert plan.logprob_order == tuple(tuple(range(sum(plan.num_microbatches))) for _ in range(2))
    assert plan.logprob_makespan is None


def test_the_log_prob_call_is_ordered_for_the_forward_only_pipeline():
    """Pipelined: each rank's order is the forward-only model's best (priced here through the public API, apart
    from the plan), never predicted slower than the plan order, and every micro-batch runs once."""
    lengths = rollout_lengths(192, 7)
    parallel = ParallelConfig.from_megatron(2, pipeline_model_parallel_size=4)
    plan = plan_collection(lengths, parallel=parallel, num_steps=2, cap=4096, cost_model=MODEL)
    pricing = pipeline_pricing(parallel, MODEL, plan.cap, forward_only=True)
    slots = np.asarray(plan.slot_lengths)
    costs = np.stack([microbatch_costs(slots, plan.rank_micro_batches(r), MODEL) for r in range(2)])
    in_plan_order = pricing.makespans(costs)
    chosen = pricing.makespans(np.take_along_axis(costs, np.asarray(plan.logprob_order), axis=1))
    assert np.all(chosen <= in_plan_order * (1 + 1e-12))
    assert plan.logprob_makespan == pytest.approx(float(chosen.max()))
    assert np.isfinite(plan.logprob_makespan)


# ---------------------------------------------------------------------------------------------------- settings
def megatron_args(**overrides) -> SimpleNamespace:
    args = dict(rl_use_sequence_packing=True, calculate_per_token_loss=True, rl_training_cuda_graphs=False,
                cuda_graph_impl="none", cuda_graph_scope=None, micro_batch_size=1, seq_length=4096,
                context_parallel_size=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None, microbatch_group_size_per_vp_stage=None,
                overlap_p2p_comm=True, sequence_parallel=False, grpo_prompts_per_step=16, grpo_group_size=8,
                global_batch_size=32, data_parallel_size=4, hidden_size=256, num_layers=8, num_attention_heads=8,
                padded_vocab_size=32000, gtp_weight_remat_size=1)
    args.update(overrides)
    return SimpleNamespace(**args)


def test_settings_from_megatron_args():
    s = PlanSettings.from_args(megatron_args(context_parallel_size=2, pipeline_model_parallel_size=2,
                                             virtual_pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                                             sequence_parallel=True, data_parallel_size=2))
    assert s.num_steps == 4 and s.cap == 4096 and s.seq_length_multiple == 4 and s.token_multiple == 4
    assert (s.parallel.dp_size, s.parallel.pp_size, s.parallel.vpp_size, s.parallel.cp_size) == (2, 2, 2, 2)
    assert s.cost_model == CostModel(hidden_size=256, num_layers=8, num_attention_heads=8, vocab_size=32000)
    assert PlanSettings.from_args(megatron_args(context_parallel_size=2),
                                  Options(max_tokens_per_gpu=1024)).cap == 2048


@pytest.mark.parametrize("overrides, needle", [
    (dict(rl_use_sequence_packing=False), "--rl-use-sequence-packing is off"),
    (dict(calculate_per_token_loss=False), "--calculate-per-token-loss is off"),
    (dict(rl_training_cuda_graphs=True), "--rl-training-cuda-graphs is set"),
    (dict(cuda_graph_impl="full_iteration"), "--cuda-graph-impl full_iteration"),
    (dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]), "--cuda-graph-scope full_iteration"),
    (dict(micro_batch_size=2), "--micro-batch-size 2"),
    (dict(global_batch_size=1000), "--global-batch-size 1000"),
    (dict(data_parallel_size=None), "validate_args"),
    (dict(gtp_weight_remat_size=2), "--gtp-weight-remat-size 2"),
    (dict(sequence_parallel=True, tensor_model_parallel_size=3, seq_length=4096), "a multiple of 3"),
])
def test_settings_slime_ext_cannot_honour_are_refused(overrides, needle):
    with pytest.raises(MegatronRLSettingError, match=needle):
        PlanSettings.from_args(megatron_args(**overrides))


def test_a_cap_above_the_seq_length_is_refused():
    with pytest.raises(MegatronRLSettingError, match="pass --max-tokens-per-gpu <= 2048"):
        PlanSettings.from_args(megatron_args(context_parallel_size=2), Options(max_tokens_per_gpu=4096))
    with pytest.raises(MegatronRLSettingError, match="max_tokens_per_gpu = 0"):
        Options(max_tokens_per_gpu=0)


# ---------------------------------------------------------------------------------------------------- launcher
def test_launcher_splits_its_options_from_megatron_arguments(tmp_path):
    from slime_ext.integrations.megatron_rl.__main__ import parse

    script = tmp_path / "train_rl.py"
    script.write_text("")
    ns, path, rest = parse(["--max-tokens-per-gpu", "8192", str(script), "--seq-length", "16384",
                            "--max-tokens-per-gpu", "1"])
    assert ns.max_tokens_per_gpu == 8192 and path == str(script)
    assert rest == ["--seq-length", "16384", "--max-tokens-per-gpu", "1"]  # after the script: Megatron's, untouched
    with pytest.raises(SystemExit):
        parse(["--bogus", str(script)])
    with pytest.raises(SystemExit):
        parse([str(tmp_path / "missing.py")])


def test_too_few_samples_for_the_tokens_is_refused():
    with pytest.raises(ScheduleError, match="too few samples"):
        plan_collection([256, 257, 257], parallel=ParallelConfig(dp_size=2), num_steps=1, cap=512)
