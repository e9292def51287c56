"""The planner's one request (:class:`slime_ext.schedule.PlanRequest`, :func:`slime_ext.schedule.plan`): its
refusals (each names the field, the value and the fix), explicit steps, a fixed micro-batch count per rank, the
pass it plans (training or forward-only), and the entry points built on it."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings as hsettings, strategies as st

import slime_ext
from slime_ext.schedule import (BatchConfig, CostModel, DPSchedule, ParallelConfig, PlanRequest, ScheduleError,
                                build_dp_schedule, check_schedule, plan, plan_schedule)
from slime_ext.schedule.bounds import align_up, bin_lower_bound
from slime_ext.schedule.compat import request_from_args
from slime_ext.schedule.steps import rollout_ordinals, split_into_steps

MODEL = CostModel(hidden_size=512, num_layers=8, num_attention_heads=8, vocab_size=32000)
DYNAMIC = BatchConfig(global_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=1000, balance_data=True)


def lengths_of(n: int, seed: int, longest: int = 900) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(longest, rng.lognormal(5.0, 0.8, n).astype(np.int64) + 4)


def request(**fields) -> PlanRequest:
    base = dict(lengths=[100, 200, 300, 400, 500, 600, 700, 800], parallel=ParallelConfig(dp_size=2), batch=DYNAMIC)
    return PlanRequest(**{**base, **fields})


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("fields, needles", [
    (dict(step_of=[0, 0, 1]), ["step_of has 3 entries", "total_lengths has 8", "exactly one per sample"]),
    (dict(step_of=[0, 0, 0, 0, 2, 2, 2, 2]), ["step_of has no sample in step 1", "without gaps"]),
    (dict(step_of=[0, -1, 0, 0, 1, 1, 1, 1]), ["step_of[1] = -1", ">= 0"]),
    (dict(step_of=[0, 0, 0, 0, 0, 0, 0, 1]), ["step 1 has 1 samples but dp_size = 2", "at least 2 samples"]),
    (dict(step_of=[0] * 8, batch=BatchConfig(use_dynamic_global_batch_size=True, use_dynamic_batch_size=True,
                                             max_tokens_per_gpu=1000)),
     ["use_dynamic_global_batch_size", "pass one of them"]),
    (dict(microbatches_per_rank=0), ["microbatches_per_rank must be a positive integer, got 0", "None to let"]),
    (dict(microbatches_per_rank=2.0), ["microbatches_per_rank must be a positive integer, got 2.0"]),
    (dict(microbatches_per_rank=3, parallel=ParallelConfig(dp_size=1, pp_size=2, vpp_size=2)),
     ["microbatches_per_rank = 3 is not a multiple of microbatch_group_size_per_vp_stage = 2", "e.g. 4"]),
    (dict(microbatches_per_rank=1, step_of=[0] * 8),  # 3600 tokens in 2 micro-batches of at most 1000
     ["microbatches_per_rank = 1", "need at least 4 micro-batches of at most 1000 tokens",
      "raise microbatches_per_rank to at least 2 or raise max_tokens_per_gpu"]),
    (dict(microbatches_per_rank=3, step_of=[0, 0, 0, 0, 1, 1, 1, 1]),
     ["microbatches_per_rank = 3", "step 0 has 4 samples but 3 x dp_size 2 = 6", "at most 2"]),
    (dict(microbatches_per_rank=1, step_of=[0] * 8, batch=BatchConfig(global_batch_size=8, micro_batch_size=2)),
     ["microbatches_per_rank = 1", "4 micro-batches of micro_batch_size=2, not 2", "microbatches_per_rank = 2"]),
    (dict(forward_only="yes"), ["forward_only must be a bool", "'yes'", "True for a forward-only"]),
    (dict(parallel={"dp_size": 2}), ["parallel must be a ParallelConfig", "ParallelConfig.from_dict"]),
    (dict(lengths=[5, 0, 7]), ["total_lengths[1] = 0 is below 1"]),
])
def test_a_bad_request_is_refused_naming_field_value_and_fix(fields, needles):
    with pytest.raises(ScheduleError) as info:
        request(**fields)
    for needle in needles:
        assert needle in str(info.value)


def test_a_fixed_count_the_derived_steps_cannot_hold_is_refused_when_planned():
    """With derived steps the steps are known only while planning: the same refusal, naming the step."""
    assert plan(request(microbatches_per_rank=2)).num_microbatches == [2, 2]  # steps of 4 rollouts: 4 micro-batches
    with pytest.raises(ScheduleError, match="microbatches_per_rank = 1: step 1's 2600 tokens need at least 4 micro"):
        plan(request(microbatches_per_rank=1))  # [500, 600, 700, 800] under 1000 tokens: no two share
    with pytest.raises(ScheduleError, match="microbatches_per_rank = 3: step 0 has 4 samples but 3 x dp_size 2"):
        plan(request(microbatches_per_rank=3))  # 6 micro-batches of 4 samples
    with pytest.raises(ScheduleError, match="request must be a PlanRequest, got dict; build one"):
        plan({"lengths": [1, 2]})


# ---------------------------------------------------------------------------------------------------- explicit steps
def test_explicit_steps_plan_every_sample_once_in_its_step():
    lengths = lengths_of(60, 1)
    step_of = np.random.default_rng(1).permutation(np.arange(60) % 3)  # interleaved, uneven rollouts below
    ids = np.arange(60) // 4
    s = plan(PlanRequest(lengths, ParallelConfig(dp_size=4), DYNAMIC, rollout_ids=ids, step_of=step_of,
                         cost_model=MODEL))
    assert check_schedule(s) == []
    assert s.dropped == [] and s.num_steps == 3 and s.step_of == step_of.tolist()
    for step, members in enumerate(s.step_samples):
        assert sorted(members) == np.flatnonzero(step_of == step).tolist()
    scheduled = sorted(s.partitions[r][i] for r in range(4) for mb in s.micro_batch_indices[r] for i in mb)
    assert scheduled == list(range(60))
    assert s.rollout_ids == ids.tolist()  # rollout ids stay rollout ids
    assert s.rollouts_per_step == [len(set(ids[step_of == k].tolist())) for k in range(3)]


def test_the_checker_catches_a_sample_moved_out_of_its_given_step():
    s = plan(request(step_of=[0, 1, 0, 1, 0, 1, 0, 1]))
    assert check_schedule(s) == []
    moved = dataclasses.replace(s, step_of=[1, 0, 0, 1, 0, 1, 0, 1])
    assert any("whose step_of is" in p for p in check_schedule(moved))


@pytest.mark.parametrize("pp, vpp, seed", [(1, 1, 0), (1, 1, 1), (2, 1, 2), (4, 1, 3), (2, 2, 4)])
def test_explicit_steps_equal_to_the_derived_ones_plan_the_same(pp, vpp, seed):
    """step_of = what split_into_steps derives (whole rollouts, global_batch_size of them per step): the same
    schedule, decision for decision."""
    rng = np.random.default_rng(seed)
    per_rollout = rng.integers(1, 5, size=24)
    ids = rng.permutation(np.repeat(np.arange(24), per_rollout))  # rollouts interleaved in the input
    lengths = lengths_of(len(ids), seed)
    parallel = ParallelConfig(dp_size=2, pp_size=pp, vpp_size=vpp,
                              microbatch_group_size_per_vp_stage=pp if vpp > 1 else None)
    batch = BatchConfig(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=1200,
                        balance_data=True)
    derived = plan_schedule(lengths, parallel, batch, rollout_ids=ids, cost_model=MODEL)
    steps, _, dropped = split_into_steps(rollout_ordinals(ids, len(ids)), lengths, parallel, batch)
    assert len(dropped) == 0
    step_of = np.empty(len(ids), dtype=np.int64)
    for k, members in enumerate(steps):
        step_of[members] = k
    given = plan(PlanRequest(lengths, parallel, batch, rollout_ids=ids, step_of=step_of, cost_model=MODEL))
    for name in ("partitions", "micro_batch_indices", "num_microbatches", "samples_per_step", "rollouts_per_step",
                 "dropped", "step_samples"):
        assert getattr(given, name) == getattr(derived, name), name
    assert [st_.strategy for st_ in given.stats] == [st_.strategy for st_ in derived.stats]
    assert check_schedule(given) == []


# ---------------------------------------------------------------------------------------------------- fixed count
@hsettings(max_examples=40, deadline=None)
@given(st.data())
def test_a_fixed_count_gives_exactly_k_per_rank_every_step_under_the_cap(data):
    """Draws dp, pp, VPP (and its group), balancing, explicit or derived steps, the cap and k between what the
    tokens need and what the samples can fill: every step runs exactly k micro-batches on every rank, the cap
    holds (the invariant checker), every sample once."""
    dp = data.draw(st.sampled_from([1, 2, 4]), label="dp")
    pp = data.draw(st.sampled_from([1, 2, 4]), label="pp")
    vpp = data.draw(st.sampled_from([1, 2]), label="vpp") if pp > 1 else 1
    group = pp if vpp > 1 else 1
    steps = data.draw(st.integers(1, 3), label="steps")
    per_step = data.draw(st.integers(dp * group * 2, dp * group * 2 + 30), label="samples per step")
    n = per_step * steps
    lengths = np.asarray(data.draw(st.lists(st.integers(1, 700), min_size=n, max_size=n), label="lengths"))
    cap = data.draw(st.sampled_from([700, 1000, 2000]), label="cap")
    balance = data.draw(st.booleans(), label="balance_data")
    explicit = data.draw(st.booleans(), label="explicit steps")
    parallel = ParallelConfig(dp_size=dp, pp_size=pp, vpp_size=vpp, microbatch_group_size_per_vp_stage=group)
    batch = BatchConfig(global_batch_size=per_step, use_dynamic_batch_size=True, max_tokens_per_gpu=cap,
                        balance_data=balance)
    step_of = np.repeat(np.arange(steps), per_step)
    least = max(align_up(bin_lower_bound(lengths[step_of == s], cap), parallel.align) for s in range(steps)) // dp
    most = per_step // dp // group * group
    if least > most:
        return
    k = data.draw(st.integers(least // group, most // group), label="k / group") * group
    req = PlanRequest(lengths, parallel, batch, step_of=step_of if explicit else None, microbatches_per_rank=k,
                      cost_model=MODEL)
    try:
        s = plan(req)
    except ScheduleError as exc:  # the only refusal left: the packing heuristics found no k*dp capped bins
        assert "the packing found no" in str(exc) and "microbatches_per_rank" in str(exc)
        return
    assert s.num_microbatches == [k] * steps and s.microbatches_per_rank == k
    assert all(len(mbs) == k * steps for mbs in s.micro_batch_indices)
    assert check_schedule(s) == []  # cap held, every sample once, stats re-measured, makespans re-priced


def test_a_fixed_count_below_the_aligned_target_is_packed_at_that_count():
    """k need not be what the planner would choose: here fewer micro-batches than its target (which counts
    the oversize sample with all its tokens), and more than it."""
    lengths = [2500, 100, 200, 300, 400, 500, 600, 700]
    parallel = ParallelConfig(dp_size=2)
    chosen = plan(PlanRequest(lengths, parallel, BatchConfig(global_batch_size=8, use_dynamic_batch_size=True,
                                                             max_tokens_per_gpu=1000)))
    assert chosen.num_microbatches == [3]
    for k in (2, 4):
        s = plan(PlanRequest(lengths, parallel, chosen.batch, microbatches_per_rank=k))
        assert s.num_microbatches == [k] and check_schedule(s) == []


def test_a_static_batch_with_the_count_it_gives_is_accepted():
    s = plan(request(batch=BatchConfig(global_batch_size=8, micro_batch_size=2), microbatches_per_rank=2))
    assert s.num_microbatches == [2] and check_schedule(s) == []


# ---------------------------------------------------------------------------------------------------- the pass
def test_the_pass_is_recorded_and_survives_a_round_trip():
    training = plan(request())
    forward = plan(request(forward_only=True, microbatches_per_rank=2, step_of=[0, 0, 0, 0, 1, 1, 1, 1]))
    assert (training.forward_only, forward.forward_only) == (False, True)
    back = DPSchedule.from_dict(forward.to_dict())
    assert (back.forward_only, back.microbatches_per_rank, back.step_of) == (True, 2, [0, 0, 0, 0, 1, 1, 1, 1])
    assert check_schedule(back) == []
    # with one pipeline stage there is no pipeline to price: the forward-only plan makes the training plan's choices
    same = plan(request(forward_only=True))
    assert (same.partitions, same.micro_batch_indices) == (training.partitions, training.micro_batch_indices)


def test_a_pipelined_forward_only_plan_keeps_every_sample_once_and_the_fixed_count():
    lengths = lengths_of(64, 9)
    s = plan(PlanRequest(lengths, ParallelConfig(dp_size=2, pp_size=4), DYNAMIC, step_of=np.zeros(64, np.int64),
                         forward_only=True, microbatches_per_rank=8, cost_model=MODEL))
    assert s.forward_only and s.num_microbatches == [8]
    assert sorted(g for part in s.partitions for g in part) == list(range(64))
    assert s.stats[0].predicted_makespan is not None


# ---------------------------------------------------------------------------------------------------- entry points
def test_plan_schedule_and_build_dp_schedule_are_the_request_planned():
    lengths, ids = lengths_of(40, 3).tolist(), [i // 2 for i in range(40)]
    parallel = ParallelConfig(dp_size=2, pp_size=2)
    a = plan_schedule(lengths, parallel, DYNAMIC, rollout_ids=ids, cost_model=MODEL)
    b = plan(PlanRequest(lengths, parallel, DYNAMIC, rollout_ids=ids, cost_model=MODEL))
    assert (a.partitions, a.micro_batch_indices, a.num_microbatches) == \
        (b.partitions, b.micro_batch_indices, b.num_microbatches)
    args = SimpleNamespace(global_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=1000,
                           balance_data=True, pipeline_model_parallel_size=2)
    c = build_dp_schedule(args, {"dp_size": 2}, lengths, rollout_indices=ids)
    d = plan(request_from_args(args, {"dp_size": 2}, lengths, rollout_indices=ids))
    assert (c.partitions, c.micro_batch_indices, c.parallel) == (d.partitions, d.micro_batch_indices, d.parallel)
    assert c.parallel.pp_size == 2


def _sources():
    root = Path(slime_ext.__file__).parent
    return [(path, path.read_text()) for path in sorted(root.rglob("*.py"))]


def test_one_build_dp_schedule_and_no_step_disguised_as_rollouts():
    defined = [f"{path.name}:{node.lineno}" for path, text in _sources() for node in ast.walk(ast.parse(text))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "build_dp_schedule"]
    assert defined == ["compat.py:" + defined[0].split(":")[1]] and len(defined) == 1
    integrations = Path(slime_ext.__file__).parent / "integrations"
    disguised = [str(path) for path in integrations.rglob("*.py") if "global_batch_size=1," in path.read_text()]
    assert disguised == []
