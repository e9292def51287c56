"""The pieces of ``bench/megatron_rl.py`` that need no Megatron-LM: the pricing of a Megatron-RL bin (padding and
all) next to a real-token micro-batch, Megatron-RL's step split in our words, the forward-only pipeline model, and
the figures of a run. :func:`test_the_bench_against_megatron_lm` runs the bench itself on a Megatron-LM tree
(``MEGATRON_LM_TREE``; skipped without one): there Megatron-RL's own functions run and the bench checks them against
these pieces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.megatron_rl import (HOW, MicroBatch, Run, bin_cost, bin_segments, collection, cycled_steps,
                               forward_only_makespans, judge, load_megatron_lm, megatron_rl_run, micro_batch_cost,
                               ours_run, pricing_for, segments_from_cu_seqlens, stage_forwards)
from bench.workloads import MODEL_DIMS
from slime_ext.schedule import CostModel

S = 16384
CM = CostModel(**MODEL_DIMS)
LINEAR, QUADRATIC = CM.coefficients()
REPO = Path(__file__).resolve().parents[2]


def test_a_bins_segments_are_its_sequences_then_its_padding():
    assert bin_segments([3000, 5000], S) == [3000, 5000, 8384]
    assert bin_segments([8192, 8192], S) == [8192, 8192]  # a full bin has no padding segment
    assert bin_segments([], S) == [S]  # an empty bin: one causal sequence of seq_length
    with pytest.raises(ValueError, match="do not fit"):
        bin_segments([10000, 7000], S)
    # cu_seqlens as create_packed_seq_params_for_bin lays them out: padded to a fixed size with zero-length ghosts
    assert segments_from_cu_seqlens([0, 3000, 8000, S, S, S]) == [3000, 5000, 8384]


def test_a_padded_bin_costs_every_token_and_a_real_token_micro_batch_only_its_own():
    padded = bin_cost(bin_segments([3000, 5000], S), S, CM)
    real = micro_batch_cost([3000, 5000], 8000, CM)
    # closed forms from the model's coefficients: a bin is seq_length tokens through every linear layer and the LM
    # head, attention within each segment (the padding attends to itself); ours is its real tokens
    assert padded == pytest.approx(LINEAR * S + QUADRATIC * (3000**2 + 5000**2 + 8384**2), rel=1e-12)
    assert real == pytest.approx(LINEAR * 8000 + QUADRATIC * (3000**2 + 5000**2), rel=1e-12)
    assert padded - real == pytest.approx(LINEAR * 8384 + QUADRATIC * 8384**2, rel=1e-9)
    assert bin_cost(bin_segments([], S), S, CM) == pytest.approx(LINEAR * S + QUADRATIC * S * S, rel=1e-12)
    # tail padding of ours (sequence parallelism) at the linear rate, no attention
    assert micro_batch_cost([3000, 5000], 8004, CM) - real == pytest.approx(4 * LINEAR, rel=1e-6)
    with pytest.raises(ValueError, match="tile"):
        bin_cost([3000, 5000], S, CM)
    with pytest.raises(ValueError, match="cannot hold"):
        micro_batch_cost([3000, 5000], 7999, CM)


def test_megatron_rls_step_split_cycles_and_retrains_the_first_bins():
    # 5 bins, 4 steps: ceil(0.25 * 5) = 2 bins per step; the third step wraps round, the fourth re-trains bins 1, 2
    assert cycled_steps(5, 0.25, 4) == [[0, 1], [2, 3], [4, 0], [1, 2]]
    assert cycled_steps(8, 0.25, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # an exact split trains each bin once
    assert cycled_steps(5, 1.0, 1) == [[0, 1, 2, 3, 4]]


def test_the_figures_count_retrained_samples_padding_and_empty_bins():
    lengths = np.array([4000, 3000, 9000, 16000, 100, 200])
    # one rank: bins (0, 1), (2,), (3,), (4, 5), and an empty bin; 4 steps of ceil(0.25 * 5) = 2 bins
    bins = [(0, 1), (2,), (3,), (4, 5), ()]
    segments = [bin_segments([lengths[i] for i in b], S) for b in bins]
    positions = cycled_steps(len(bins), 0.25, 4)
    run = megatron_rl_run("fifo", [bins], [segments], positions, S, CM)
    fig = judge(run, lengths, pricing_for(1, 1, CM, S))
    assert fig.micro_batches == (2, 2, 2, 2)
    # bins 0, 1 and 2 run twice (positions 0, 1, 2 come round again): samples 0, 1, 2, 3
    assert fig.trained_twice == 4 and fig.never_trained == 0
    assert fig.computed_tokens == 8 * S
    assert fig.padding_tokens == 8 * S - int(lengths.sum() + lengths[[0, 1, 2, 3]].sum())
    # a split that stops short leaves samples out: one step of 2 bins trains samples 0, 1, 2 only
    short = judge(megatron_rl_run("fifo", [bins], [segments], [[0, 1]], S, CM), lengths, pricing_for(1, 1, CM, S))
    assert short.never_trained == 3 and short.trained_twice == 0


def test_the_figures_refuse_ranks_with_different_counts():
    mb = MicroBatch((0,), 10, 1.0)
    run = Run("x", (((mb,), (mb, mb)),), (((1.0,),), ((1.0,),)))
    with pytest.raises(AssertionError, match="different micro-batch counts"):
        judge(run, np.array([10]), pricing_for(2, 1, CM, S))


def test_forward_only_makespans():
    rng = np.random.default_rng(0)
    f = rng.uniform(1, 5, size=(3, 1, 7))
    assert forward_only_makespans(f) == pytest.approx(f.sum(axis=(1, 2)))  # one stage: the sum
    one = rng.uniform(1, 5, size=(2, 4, 1))
    assert forward_only_makespans(one) == pytest.approx(one.sum(axis=(1, 2)))  # one micro-batch crosses the stages
    assert forward_only_makespans(np.full((1, 4, 6), 2.0))[0] == pytest.approx((6 + 4 - 1) * 2.0)  # fill, then flow
    # a send blocks until the next stage receives: stage 1 cannot take micro-batch 2 before stage 2 took
    # micro-batch 1 (worked by hand: 9; with unbounded buffers the flow shop would take 8)
    blocked = np.array([[[2.0, 1.0, 1.0], [2.0, 1.0, 2.0], [2.0, 1.0, 1.0]]])
    assert forward_only_makespans(blocked)[0] == pytest.approx(9.0)
    with pytest.raises(ValueError, match="replicas, stages"):
        forward_only_makespans(np.ones((2, 3)))


def test_stage_forwards_follow_the_pricing():
    pricing = pricing_for(8, 4, CM, S)
    costs = np.array([[1e13, 2e13, 3e13]])
    f = stage_forwards(pricing, costs)
    assert f.shape == (1, 4, 3)
    # the stages of one micro-batch add up to its cost and overhead (the output layer makes the last stage heavier)
    assert f.sum(axis=1) == pytest.approx(costs + pricing.overhead)
    assert f[0, 3, 0] > f[0, 0, 0]
    one = stage_forwards(pricing_for(8, 1, CM, S), costs)
    assert one.shape == (1, 1, 3) and one[0, 0] == pytest.approx(costs[0] + pricing.overhead)


def test_megatron_rls_log_prob_pass_is_one_bin_at_a_time_and_ours_is_pipelined():
    lengths = collection("rl-like", 8, S)[:64]
    pricing = pricing_for(1, 4, CM, S)
    bins = [(i,) for i in range(8)]
    segments = [bin_segments([lengths[i]], S) for i in range(8)]
    mrl = judge(megatron_rl_run("fifo", [bins], [segments], [list(range(8))], S, CM), lengths[:8], pricing)
    flops = [bin_cost(seg, S, CM) for seg in segments]
    # no overlap: every bin crosses all four stages alone
    assert mrl.logprob_time == pytest.approx(sum(c + pricing.overhead for c in flops))
    # the same micro-batches in one forward-only call overlap across the stages
    one_call = Run("x", (), (((tuple(flops)),),))
    piped = judge(one_call, lengths[:8], pricing).logprob_time
    assert piped < 0.5 * mrl.logprob_time


@pytest.mark.parametrize("pp, steps", [(1, 1), (4, 4)])
def test_ours_is_priced_as_the_planner_prices_it(pp, steps):
    lengths = collection("long tail", 8, S)[:512]
    run, _ = ours_run(lengths, 8, pp, steps, S, CM)
    fig = judge(run, lengths, pricing_for(8, pp, CM, S))
    assert fig.padding_tokens == 0 and fig.trained_twice == 0 and fig.never_trained == 0
    assert fig.computed_tokens == fig.real_tokens == int(lengths.sum())
    assert len(fig.micro_batches) == steps
    # every micro-batch's FLOPs as the planner's cost model gives them (real tokens only)
    for step in run.steps:
        for rank in step:
            for mb in rank:
                assert mb.flops == pytest.approx(float(CM.flops(lengths[list(mb.samples)]).sum()), rel=1e-12)
    if pp > 1:  # the bench's step time is the plan's makespans re-priced independently (the invariant checker's
        # replica_makespans: the documented rule through the public pipeline model, not the planner's pricing)
        from slime_ext.integrations.megatron_rl.plan import plan_collection
        from slime_ext.schedule import ParallelConfig
        from slime_ext.schedule.invariants import replica_makespans

        plan = plan_collection(lengths, parallel=ParallelConfig(dp_size=8, pp_size=pp), num_steps=steps, cap=S,
                               cost_model=CM)
        assert plan.schedule.num_steps == steps
        oracle = sum(float(replica_makespans(plan.schedule, s)[0].max()) for s in range(steps))
        assert fig.step_time == pytest.approx(oracle, rel=1e-9)


def test_the_collections_are_grpo_sized_and_fit_seq_length():
    for dp, rows in ((8, 1024), (32, 4096)):
        lengths = collection("long tail", dp, S)
        assert len(lengths) == rows and lengths.max() <= S and lengths.min() >= 1


def test_without_a_megatron_lm_tree_the_bench_says_how_to_get_one(tmp_path):
    with pytest.raises(SystemExit, match="MEGATRON_LM_TREE") as exc:
        load_megatron_lm(None)
    assert HOW in str(exc.value)
    with pytest.raises(SystemExit, match="no megatron/rl/sequence_packing_utils.py"):
        load_megatron_lm(str(tmp_path))


def test_the_bench_against_megatron_lm():
    """``python -m bench.megatron_rl --quick`` on ``MEGATRON_LM_TREE`` with ``MEGATRON_LM_PYTHON`` (default: this
    Python; Megatron-LM HEAD needs 3.12). The bench checks Megatron-RL's cu_seqlens against :func:`bin_segments` and
    its step split against :func:`cycled_steps`, and fails on a mismatch."""
    tree = os.environ.get("MEGATRON_LM_TREE")
    if not tree:
        pytest.skip(f"no Megatron-LM tree: {HOW} (MEGATRON_LM_PYTHON picks the interpreter)")
    python = os.environ.get("MEGATRON_LM_PYTHON", sys.executable)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MEGATRON_LM_TREE": tree}
    done = subprocess.run([python, "-m", "bench.megatron_rl", "--quick"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ours over all 4 cases: padding tokens 0 (goal 0: PASS), samples trained twice 0 (goal 0: PASS)" \
        in done.stdout, done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("rl-like")]
    assert len(rows) == 4, done.stdout
