"""Property tests: thousands of random rollouts, parallel layouts and flag combinations per run.

Every schedule must satisfy the invariant checker; every refusal must be a ScheduleError whose claim is true.

A refused draw checks only its refusal, so each property test that may refuse counts its outcomes and asserts a
floor on the share that plans (:data:`PLANNED_FLOOR`): a change to the drawing, or a planner that starts refusing
what it used to plan, cannot leave the invariants checked on a handful of schedules while the test stays green.
A refusal that only best fit decreasing makes (no exact or bound-based proof above brute-force size) is counted
apart and must stay rare (:data:`UNPROVEN_CEILING`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from slime_ext.schedule import (
    BatchConfig,
    CostModel,
    CostProfile,
    DPSchedule,
    ParallelConfig,
    ScheduleError,
    plan_schedule,
)
from slime_ext.schedule.bounds import bin_lower_bound
from slime_ext.schedule.invariants import replica_makespans
from slime_ext.schedule.pipeline_pricing import predicted_makespans
from tests.brute_force import min_bins
from tests.conftest import examples, plan_checked

MODELS = [None, CostModel(hidden_size=64, num_layers=2, num_attention_heads=4, vocab_size=500),
          CostModel(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2, num_experts=4,
                    moe_ffn_hidden_size=128, moe_router_topk=2, vocab_size=1000)]

def fast(max_examples: int):
    return settings(max_examples=examples(max_examples), deadline=None,  # HYPOTHESIS_PROFILE=thorough: x100
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def rollouts(draw, max_samples=240):
    n = draw(st.one_of(st.integers(1, 16), st.integers(16, max_samples)))
    shape = draw(st.sampled_from(["uniform", "long-tail", "bimodal"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if shape == "uniform":
        lengths = rng.integers(1, draw(st.integers(2, 3000)), n)
    elif shape == "long-tail":
        lengths = 1 + np.minimum(rng.lognormal(draw(st.floats(2, 7)), draw(st.floats(0.1, 1.5)), n), 20000)
    else:
        lengths = np.where(rng.random(n) < 0.2, rng.integers(500, 4000, n), rng.integers(1, 100, n))
    lengths = lengths.astype(int).tolist()
    grouping = draw(st.sampled_from(["none", "singletons", "groups"]))
    if grouping == "none":
        ids = None
    elif grouping == "singletons":
        ids = rng.permutation(n).tolist()
    else:
        ids = rng.integers(0, max(1, n // draw(st.integers(1, 4))), n).tolist()
    loss = draw(st.booleans())
    loss_tokens = [int(rng.integers(0, x + 1)) for x in lengths] if loss else None
    return lengths, ids, loss_tokens


@st.composite
def configs(draw, dynamic: bool):
    dp = draw(st.sampled_from([1, 2, 2, 3, 4, 8]))
    vpp = draw(st.sampled_from([1, 1, 2, 4]))
    parallel = ParallelConfig(
        dp_size=dp,
        cp_size=draw(st.sampled_from([1, 1, 2])),
        vpp_size=vpp,
        microbatch_group_size_per_vp_stage=draw(st.sampled_from([1, 2, 3])),
    )
    dyn_gbs = draw(st.booleans())
    batch = BatchConfig(
        global_batch_size=None if dyn_gbs else draw(st.one_of(st.integers(1, 12), st.integers(1, 64))),
        use_dynamic_batch_size=dynamic,
        max_tokens_per_gpu=draw(st.sampled_from([64, 500, 2048, 8192])) if dynamic else None,
        micro_batch_size=None if dynamic else draw(st.integers(1, 4)),
        balance_data=draw(st.booleans()),
        balance_by_flops=dynamic and draw(st.booleans()),
        use_dynamic_global_batch_size=dyn_gbs,
        disable_rollout_trim_samples=draw(st.booleans()) and draw(st.booleans()),
        dynamic_global_batch_rounds_samples=dyn_gbs and draw(st.booleans()),  # slime v0.2.4's rule
    )
    return parallel, batch


#: the pipelined draws price with these (8 layers split over every pp / VPP drawn, with or without the layout
#: flags; tokens; a measured-looking profile with p2p)
PIPE_MODELS = [None, CostModel(hidden_size=64, num_layers=8, num_attention_heads=4, vocab_size=500),
               CostProfile(step_overhead_s=0.01, microbatch_overhead_s=0.004, per_token_s=2e-6,
                           per_sample_quadratic_s=1e-10, backward_forward_ratio=2.2, p2p_s=0.001)]


@st.composite
def pipelines(draw, dynamic: bool):
    """A pipelined layout: pp, VPP, the VPP group, Megatron's layout flags and the p2p mode, as the planner branches
    on them (``event`` records each draw: ``pytest --hypothesis-show-statistics`` shows them)."""
    pp = draw(st.sampled_from([2, 2, 4]))
    vpp = draw(st.sampled_from([1, 1, 2]))
    group = pp + draw(st.sampled_from([0, 0, 1, 2])) if vpp > 1 else None
    flags = {}
    if draw(st.booleans()):
        flags["account_for_embedding_in_pipeline_split"] = draw(st.booleans())
        flags["account_for_loss_in_pipeline_split"] = draw(st.booleans())
    elif vpp == 1 and draw(st.booleans()):
        flags["decoder_last_pipeline_num_layers"] = draw(st.sampled_from([2, 8 // pp]))
    parallel = ParallelConfig(dp_size=draw(st.sampled_from([1, 2, 3, 4])), cp_size=draw(st.sampled_from([1, 1, 2])),
                              pp_size=pp, vpp_size=vpp, microbatch_group_size_per_vp_stage=group,
                              overlap_p2p_comm=vpp > 1 and draw(st.booleans()), **flags)
    try:
        parallel.stage_layers(8)
    except ScheduleError:  # a split Megatron refuses for these 8 layers: no pipelined draw
        parallel = ParallelConfig(dp_size=parallel.dp_size, cp_size=parallel.cp_size, pp_size=pp, vpp_size=vpp,
                                  microbatch_group_size_per_vp_stage=group)
    _, batch = draw(configs(dynamic))
    event(f"pp={pp} vpp={vpp} group={group} flags={sorted(k for k, v in flags.items() if v)} "
          f"overlap={parallel.overlap_p2p_comm}")
    return parallel, batch


def _dynamic_rollouts(lengths, order, members, parallel, batch):
    """Independent re-derivation of use_dynamic_global_batch_size's one step: the most whole rollouts (from the
    first) whose samples the layout can train -- each of the align slots needs a sample; static micro-batches make
    an aligned count; dynamic ones can fill the aligned bins their tokens need; slime v0.2.4's rule keeps them inside
    the sample count rounded down to a multiple of dp. ``None`` when no prefix qualifies."""
    align, dp, best, ends = parallel.align, parallel.dp_size, None, 0
    budget = max(dp, len(lengths) // dp * dp)
    for k, rid in enumerate(order, 1):
        ends += len(members[rid])
        ok = ends >= align
        if batch.dynamic_global_batch_rounds_samples and not batch.disable_rollout_trim_samples:
            ok = ok and ends <= budget
        if not batch.use_dynamic_batch_size:
            ok = ok and math.ceil(ends / batch.micro_batch_size) % align == 0
        elif ok:
            prefix = np.array([lengths[i] for r in order[:k] for i in members[r]])
            ok = -(-bin_lower_bound(prefix, batch.max_tokens_per_gpu * parallel.cp_size) // align) * align <= ends
        best = k if ok else best
    return best


def _steps(lengths, ids, batch, parallel):
    """Independent re-derivation of stage 1 (sample ids per step, number of rollouts, rollouts per step)."""
    ids = list(range(len(lengths))) if ids is None else ids
    order = []
    members = {}
    for i, rid in enumerate(ids):
        if rid not in members:
            members[rid] = []
            order.append(rid)
        members[rid].append(i)
    if batch.use_dynamic_global_batch_size:
        gbs = _dynamic_rollouts(lengths, order, members, parallel, batch) or len(order) + 1
        return ([[i for rid in order[:gbs] for i in members[rid]]] if gbs <= len(order) else []), len(order), gbs
    gbs = batch.global_batch_size
    return [[i for rid in order[s * gbs:(s + 1) * gbs] for i in members[rid]] for s in range(len(order) // gbs)], \
        len(order), gbs


#: the least share of draws that must plan, per property test. The ci profile (derandomized) planned 58% dynamic,
#: 45% static, 59% pipelined dynamic, 38% pipelined static and 60% round-trip draws when this was written; the
#: floors leave room for a planner or drawing change, not for a test to become a test of refusals.
PLANNED_FLOOR = {"dynamic": 0.40, "static": 0.33, "pipelined_dynamic": 0.45, "pipelined_static": 0.25,
                 "round_trip": 0.40}
#: the most draws (share) whose refusal is accepted on best fit decreasing's word alone (no proof: see
#: :func:`_refusal_is_true`); small steps are proved exactly, in test_small_steps_are_refused_exactly_when_...
UNPROVEN_CEILING = 0.02
#: outcomes of the draws of the property test now running: planned / refused / refused_unproven
TALLY: Counter = Counter()


def assert_enough_planned(name: str) -> None:
    """The share of ``TALLY``'s draws that planned is at least ``PLANNED_FLOOR[name]``, and unproven refusals are
    at most ``UNPROVEN_CEILING``; then ``TALLY`` is cleared for the next test."""
    tally, total = dict(TALLY), sum(TALLY.values())
    TALLY.clear()
    print(f"{name}: {tally}")
    assert total > 0, f"{name}: no draw ran"
    planned = tally.get("planned", 0) / total
    assert planned >= PLANNED_FLOOR[name], \
        f"{name}: only {planned:.1%} of {total} draws planned (floor {PLANNED_FLOOR[name]:.0%}): {tally}"
    unproven = tally.get("refused_unproven", 0) / total
    assert unproven <= UNPROVEN_CEILING, \
        f"{name}: {unproven:.1%} of {total} draws refused on best fit decreasing's word (ceiling " \
        f"{UNPROVEN_CEILING:.0%}): {tally}"


def run_counted(name: str, examples: int, strategies: tuple, run) -> None:
    """``run(data, *cfg, cost_model)`` over ``examples`` hypothesis draws of ``strategies``; then the floor on the
    share that planned (:func:`assert_enough_planned`)."""
    TALLY.clear()

    @fast(examples)
    @given(*strategies)
    def draw(data, cfg, cost_model):
        run(data, *cfg, cost_model)

    draw()
    assert_enough_planned(name)


def _refusal_is_true(msg: str, lengths, ids, parallel, batch) -> bool | str:
    """Re-derive, independently of the planner, that the refused input really cannot be scheduled: ``True``
    (proved), ``"unproven"`` (best fit decreasing found no packing and nothing here can prove there is none: the
    caller counts these) or ``False``."""
    steps, num_rollouts, gbs = _steps(lengths, ids, batch, parallel)
    if "micro-batch slots each need a sample" in msg:  # use_dynamic_global_batch_size, too few samples
        return len(lengths) < parallel.align
    if "no run of whole rollouts from the first" in msg:
        return batch.use_dynamic_global_batch_size and gbs > num_rollouts
    if "--disable-rollout-trim-samples forbids dropping" in msg:
        return batch.disable_rollout_trim_samples and gbs < num_rollouts
    if "not a multiple of global_batch_size" in msg:
        return batch.disable_rollout_trim_samples and num_rollouts % gbs != 0
    if "not even one step" in msg:
        return num_rollouts < gbs
    m = re.match(r"step (\d+)", msg)
    assert m, msg
    step = [lengths[i] for i in steps[int(m.group(1))]]
    n = len(step)
    align = parallel.align
    if "every rank needs at least one micro-batch" in msg:
        return n < parallel.dp_size
    if "micro-batches of micro_batch_size" in msg:
        return math.ceil(n / batch.micro_batch_size) % align != 0
    if "needs at least" in msg or "the samples need" in msg:  # no capped packing into a multiple of align bins
        cap = batch.max_tokens_per_gpu * parallel.cp_size
        if _no_aligned_packing(step, cap, align):
            return True
        # best fit decreasing is within 11/9 OPT + 6/9 of the fewest bins, not exact: above brute-force size its
        # refusal cannot be proven; it must at least name that heuristic (and small steps are checked exactly)
        event("refusal by best fit decreasing, not proven optimal")
        return "unproven" if n > 10 and "(best fit decreasing)" in msg else False
    return False


def _no_aligned_packing(step: list[int], cap: int, align: int) -> bool:
    """True when no packing of ``step`` into k non-empty capped bins exists for any multiple k of ``align``.

    Such packings exist exactly for ``min_bins <= k <= n`` (a capped bin splits into two capped bins). An oversize
    sample always sits alone, so ``min_bins`` is exact (brute force) when at most 10 samples fit under the cap;
    with more, :func:`bin_lower_bound` (tokens, halves, count: checked against brute force in
    ``test_bin_lower_bound_never_exceeds_the_optimum``), so a refusal there is only checked as far as it goes."""
    over = [x for x in step if x > cap]
    rest = [x for x in step if x <= cap]
    least = len(over) + min_bins(rest, cap) if len(rest) <= 10 else bin_lower_bound(np.array(step), cap)
    return -(-least // align) * align > len(step)


@pytest.mark.parametrize("step, cap, target", [
    # found by CI: 8 oversize samples and 5 that fit, no two of which share a bin (exact count)
    ([7755, 683, 1526, 4540, 485, 1869, 382, 5239, 165, 405, 431, 1859, 802], 500, 14),
    # 11 samples that fit, no two of which share a bin: more than brute force takes (the count bound)
    ([30] + [71] * 10, 100, 12),
])
def test_a_refusal_that_only_a_count_proves_is_judged_true(step, cap, target):
    """n samples that need n bins, n+1 aligned to dp=2: refused. Tokens and halves alone allow n-1 bins, which
    would call the refusal false."""
    parallel = ParallelConfig(dp_size=2)
    batch = BatchConfig(global_batch_size=len(step), use_dynamic_batch_size=True, max_tokens_per_gpu=cap)
    with pytest.raises(ScheduleError, match=f"needs at least {target} micro-batches") as e:
        plan_checked(step, parallel, batch)
    assert _refusal_is_true(str(e.value), step, list(range(len(step))), parallel, batch) is True


def _run(data, parallel, batch, cost_model):
    lengths, ids, loss_tokens = data
    try:
        s = plan_checked(lengths, parallel, batch, rollout_ids=ids, loss_tokens=loss_tokens, cost_model=cost_model)
    except ScheduleError as e:
        verdict = _refusal_is_true(str(e), lengths, ids, parallel, batch)
        assert verdict, f"unjustified refusal: {e}"
        TALLY["refused" if verdict is True else "refused_unproven"] += 1
        event("refused: " + re.sub(r"[\d.]+", "N", str(e))[:40])
        return None
    TALLY["planned"] += 1
    event("planned")
    steps, _, _ = _steps(lengths, ids, batch, parallel)
    assert s.step_samples == steps
    for st_, step in zip(s.stats, steps):
        assert st_.cap_violations == 0
        assert st_.total_microbatches >= st_.packing_target or batch.use_dynamic_batch_size is False
        if batch.use_dynamic_batch_size:
            cap = batch.max_tokens_per_gpu * parallel.cp_size
            true_bound = math.ceil(bin_lower_bound(np.array([lengths[i] for i in step]), cap) / parallel.align)
            assert st_.total_microbatches >= true_bound * parallel.align
        assert st_.flops_imbalance >= 1.0 - 1e-12
    return s


def test_dynamic_schedules_satisfy_every_invariant():
    run_counted("dynamic", 1500, (rollouts(), configs(dynamic=True), st.sampled_from(MODELS)), _run)


@fast(600)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=9), configs(dynamic=True), st.booleans())
def test_small_steps_are_refused_exactly_when_brute_force_finds_no_schedule(lengths, cfg, balance):
    """One step of one-sample rollouts, small enough for an exact answer: the planner schedules it iff some
    capped packing into a multiple of ``align`` (and at least ``dp_size``) micro-batches exists."""
    parallel, batch = cfg
    batch = BatchConfig(global_batch_size=len(lengths), use_dynamic_batch_size=True,
                        max_tokens_per_gpu=batch.max_tokens_per_gpu // 8 or 1, balance_data=balance)
    cap = batch.max_tokens_per_gpu * parallel.cp_size
    feasible = len(lengths) >= parallel.dp_size and not _no_aligned_packing(lengths, cap, parallel.align)
    try:
        plan_checked(lengths, parallel, batch)
    except ScheduleError as e:
        assert not feasible, f"refused a step that has a schedule: {e}"
        event("refused")
        return
    assert feasible
    event("planned")


def test_static_schedules_satisfy_every_invariant():
    run_counted("static", 600, (rollouts(), configs(dynamic=False), st.sampled_from(MODELS)), _run)


def _run_pipelined(data, parallel, batch, cost_model):
    """Every invariant (re-priced through the public model), and every step predicted no slower than the
    pp-unaware plan of the same step (stages 2-4 without the pipeline, heaviest first) under the same pricing."""
    s = _run(data, parallel, batch, cost_model)
    if s is None:
        return None
    lengths, ids, loss_tokens = data
    flat = ParallelConfig(dp_size=parallel.dp_size, cp_size=parallel.cp_size, vpp_size=parallel.vpp_size,
                          microbatch_group_size_per_vp_stage=parallel.microbatch_group_size_per_vp_stage)
    unaware = plan_schedule(lengths, flat, batch, rollout_ids=ids, loss_tokens=loss_tokens, cost_model=cost_model)
    unaware_on_pipeline = dataclasses.replace(unaware, parallel=parallel)  # re-priced by the oracle, not the planner
    assert unaware.step_samples == s.step_samples
    for step, st_ in enumerate(s.stats):
        assert st_.predicted_makespan <= float(replica_makespans(unaware_on_pipeline, step)[0].max()) * (1 + 1e-9)
        assert 0.0 <= st_.bubble_fraction < 1.0
        np.testing.assert_allclose(replica_makespans(s, step)[0], predicted_makespans(s, step), rtol=1e-9)
    event("pipelined: " + ("+pp" if any("+pp" in st_.strategy for st_ in s.stats) else "as pp-unaware"))
    return s


def test_pipelined_dynamic_schedules_satisfy_every_invariant():
    run_counted("pipelined_dynamic", 250, (rollouts(max_samples=160), pipelines(dynamic=True),
                                                st.sampled_from(PIPE_MODELS)), _run_pipelined)


def test_pipelined_static_schedules_satisfy_every_invariant():
    run_counted("pipelined_static", 120, (rollouts(max_samples=160), pipelines(dynamic=False),
                                              st.sampled_from(PIPE_MODELS)), _run_pipelined)


def test_same_input_same_schedule_and_json_round_trip():
    TALLY.clear()
    _round_trips()
    assert_enough_planned("round_trip")


@fast(300)
@given(rollouts(max_samples=120), configs(dynamic=True), st.sampled_from(MODELS))
def _round_trips(data, cfg, cost_model):
    s = _run(data, *cfg, cost_model)
    if s is None:
        return
    lengths, ids, loss_tokens = data
    again = plan_schedule(list(lengths), *cfg, rollout_ids=None if ids is None else list(ids),
                          loss_tokens=loss_tokens, cost_model=cost_model)
    assert again == s
    assert DPSchedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s
