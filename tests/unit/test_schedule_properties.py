"""Property tests: thousands of random rollouts, parallel layouts and flag combinations per run.

Every schedule must satisfy the invariant checker; every refusal must be a ScheduleError whose claim is true.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from slime_ext.schedule import (
    BatchConfig,
    CostModel,
    DPSchedule,
    ParallelConfig,
    ScheduleError,
    bin_lower_bound,
    plan_schedule,
)
from tests.conftest import plan_checked

MODELS = [None, CostModel(hidden_size=64, num_layers=2, num_attention_heads=4, vocab_size=500),
          CostModel(hidden_size=256, num_layers=4, num_attention_heads=8, num_query_groups=2, num_experts=4,
                    moe_ffn_hidden_size=128, moe_router_topk=2, vocab_size=1000)]

def fast(max_examples: int):
    return settings(max_examples=max_examples, deadline=None,
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
    )
    return parallel, batch


def _steps(lengths, ids, batch, dp):
    """Independent re-derivation of stage 1 (sample ids per step, number of rollouts)."""
    ids = list(range(len(lengths))) if ids is None else ids
    order = []
    members = {}
    for i, rid in enumerate(ids):
        if rid not in members:
            members[rid] = []
            order.append(rid)
        members[rid].append(i)
    if batch.use_dynamic_global_batch_size:
        gbs = len(order) if batch.disable_rollout_trim_samples else max(dp, len(order) // dp * dp)
    else:
        gbs = batch.global_batch_size
    return [[i for rid in order[s * gbs:(s + 1) * gbs] for i in members[rid]] for s in range(len(order) // gbs)], \
        len(order), gbs


def _refusal_is_true(msg: str, lengths, ids, parallel, batch) -> bool:
    """Re-derive, independently of the planner, that the refused input really cannot be scheduled."""
    steps, num_rollouts, gbs = _steps(lengths, ids, batch, parallel.dp_size)
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
    cap = batch.max_tokens_per_gpu * parallel.cp_size
    needed = math.ceil(bin_lower_bound(np.array(step), cap) / align) * align
    if "needs at least" in msg:
        return n < needed
    if "the samples need" in msg:  # best fit decreasing could not leave room for alignment
        k = int(re.search(r"the samples need (\d+)", msg).group(1))
        return k >= bin_lower_bound(np.array(step), cap) and math.ceil(k / align) * align > n
    return False


def _run(data, parallel, batch, cost_model):
    lengths, ids, loss_tokens = data
    try:
        s = plan_checked(lengths, parallel, batch, rollout_ids=ids, loss_tokens=loss_tokens, cost_model=cost_model)
    except ScheduleError as e:
        assert _refusal_is_true(str(e), lengths, ids, parallel, batch), f"unjustified refusal: {e}"
        event("refused: " + re.sub(r"[\d.]+", "N", str(e))[:40])
        return None
    event("planned")
    steps, _, _ = _steps(lengths, ids, batch, parallel.dp_size)
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


@fast(1500)
@given(rollouts(), configs(dynamic=True), st.sampled_from(MODELS))
def test_dynamic_schedules_satisfy_every_invariant(data, cfg, cost_model):
    _run(data, *cfg, cost_model)


@fast(600)
@given(rollouts(), configs(dynamic=False), st.sampled_from(MODELS))
def test_static_schedules_satisfy_every_invariant(data, cfg, cost_model):
    _run(data, *cfg, cost_model)


@fast(300)
@given(rollouts(max_samples=120), configs(dynamic=True), st.sampled_from(MODELS))
def test_same_input_same_schedule_and_json_round_trip(data, cfg, cost_model):
    s = _run(data, *cfg, cost_model)
    if s is None:
        return
    lengths, ids, loss_tokens = data
    again = plan_schedule(list(lengths), *cfg, rollout_ids=None if ids is None else list(ids),
                          loss_tokens=loss_tokens, cost_model=cost_model)
    assert again == s
    assert DPSchedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s
