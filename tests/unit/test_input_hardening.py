"""Issue 9: no input makes the planning layer raise anything but a ``ScheduleError`` that names the field.

One section per class of the issue; each has property tests over types and magnitudes (the expected outcome comes
from an oracle written here, independently of ``slime_ext.schedule.validate``) and the issue's own examples:

  A. numbers outside what int64/float64 hold (lengths, rollout ids, loss tokens; Python ints, numpy scalars)
  B. containers (numpy arrays of any dtype and shape, object and 0-d arrays, sets, dicts, strings, iterators)
  C. the cost model (dims, MoE layout, FLOPs finite and positive)
  D. sizes that would exhaust memory before the check (dp_size, global_batch_size, ...)
  E. silent coercions at slime's entry ``build_dp_schedule`` (strict booleans, ``None``, VPP, numpy ints)
  F. saved schedules: ``DPSchedule.from_dict`` and ``check_schedule`` re-validate the recorded inputs;
     ``to_dict`` returns copies
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import tracemalloc
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from slime_ext.schedule import (
    BatchConfig,
    CostModel,
    DPSchedule,
    ParallelConfig,
    ScheduleError,
    build_dp_schedule,
    check_schedule,
    plan_schedule,
)
from slime_ext.schedule.steps import compute_dynamic_global_batch_size
from slime_ext.schedule.validate import MAX_MODEL_DIM, MAX_PARALLEL_SIZE, MAX_SAMPLES, MAX_TOKENS
from tests.conftest import examples, json_paths

INT64 = (-(2**63), 2**63 - 1)
ODD_VALUES = [np.bool_(True), np.bool_(False), np.float64(3.0), np.float32("nan"), Decimal(3), Fraction(7, 2),
              3 + 0j, [1], (2,), {}, {1}, np.array(5), np.array([1, 2]), object(), 10**400, -(10**400), "3", b"3",
              float("inf"), 2.0]
#: every kind of value a hostile caller could put where an integer belongs
HOSTILE = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(MAX_TOKENS - 2, MAX_TOKENS + 2), st.integers(2**63 - 2, 2**64 + 2),
    st.integers(-(2**63) - 2, -(2**63) + 2),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3), st.binary(max_size=2),
    st.integers(1, 3000).map(np.int64), st.integers(0, 2**64 - 1).map(np.uint64), st.integers(-5, 5).map(np.int32),
    st.sampled_from(ODD_VALUES),
)
STATIC = (ParallelConfig(), BatchConfig(global_batch_size=1))
DYNAMIC = (ParallelConfig(), BatchConfig(global_batch_size=1, use_dynamic_batch_size=True,
                                         max_tokens_per_gpu=MAX_TOKENS, balance_data=True, balance_by_flops=True))
MODEL = CostModel(hidden_size=64, num_layers=2, num_attention_heads=4, vocab_size=500)


def exact_int(v, lo: int, hi: int) -> bool:
    """The oracle: an int or numpy integer (never a bool) in ``[lo, hi]``."""
    return (type(v) is int or isinstance(v, np.integer)) and lo <= int(v) <= hi


def names_field(msg: str, field: str) -> bool:
    return re.search(rf"(?<![A-Za-z_]){re.escape(field)}(?![A-Za-z_])", msg) is not None


# ---------------------------------------------------------------------------------------------------- A. numbers
@settings(max_examples=examples(400))
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=10), st.data(), HOSTILE,
       st.sampled_from(["total_lengths", "rollout_ids", "loss_tokens"]), st.sampled_from([STATIC, DYNAMIC]))
def test_one_bad_entry_is_refused_naming_it(lengths, data, value, field, cfg):
    n = len(lengths)
    i = data.draw(st.integers(0, n - 1), label="index")
    inputs = {"total_lengths": list(lengths), "rollout_ids": list(range(n)), "loss_tokens": [0] * n}
    inputs[field][i] = value
    lo, hi = {"total_lengths": (1, MAX_TOKENS), "rollout_ids": INT64, "loss_tokens": (0, lengths[i])}[field]
    ok = exact_int(value, lo, hi)
    try:
        s = plan_schedule(inputs["total_lengths"], *cfg, rollout_ids=inputs["rollout_ids"],
                          loss_tokens=inputs["loss_tokens"], cost_model=MODEL)
    except ScheduleError as e:
        assert not ok, f"the valid {field}[{i}] = {value!r} was refused: {e}"
        assert f"{field}[{i}]" in str(e), str(e)
        return
    assert ok, f"{field}[{i}] = {value!r} was accepted"
    assert check_schedule(s, total_lengths=inputs["total_lengths"], rollout_ids=inputs["rollout_ids"]) == []
    assert all(type(x) is int for x in s.total_lengths + s.rollout_ids + s.loss_tokens)


@settings(max_examples=examples(300))
@given(st.lists(st.one_of(st.integers(1, 5000), st.integers(1, 2**64 - 1), st.integers(-(2**63), 0)),
                min_size=1, max_size=8),
       st.sampled_from(["list", "int64", "uint64", "numpy scalars"]))
def test_magnitudes_never_wrap(values, container):
    """Lengths up to MAX_TOKENS plan with exact token sums (no int64 wrap); anything above names the limit."""
    if container == "int64" and max(values) > INT64[1] or container == "uint64" and min(values) < 0:
        container = "list"  # not representable in that dtype: try it as Python ints
    lengths = {"list": lambda: values, "int64": lambda: np.array(values, dtype=np.int64),
               "uint64": lambda: np.array(values, dtype=np.uint64),
               "numpy scalars": lambda: [np.uint64(v) if v >= 0 else np.int64(v) for v in values]}[container]()
    ok = all(1 <= v <= MAX_TOKENS for v in values)
    try:
        s = plan_schedule(lengths, *DYNAMIC, cost_model=MODEL)
    except ScheduleError as e:
        assert not ok, f"refused valid lengths: {e}"
        assert "total_lengths[" in str(e)
        if max(values) > MAX_TOKENS and min(values) >= 1:
            assert "MAX_TOKENS = 2**32" in str(e)
        return
    assert ok
    assert sum(st_.total_tokens for st_ in s.stats) == sum(values)  # exact, as Python ints
    assert all(0 < st_.largest_bin_tokens <= st_.total_tokens for st_ in s.stats)
    assert all(np.isfinite(st_.rank_cost_max) and st_.rank_cost_max > 0 for st_ in s.stats)
    assert check_schedule(s) == []


@pytest.mark.parametrize("call, field, pattern", [
    (lambda: plan_schedule([10] * 7 + [2**63], *STATIC), "total_lengths[7]", "above the limit MAX_TOKENS = 2**32"),
    (lambda: plan_schedule([2**62] * 4, *DYNAMIC), "total_lengths[0]", "above the limit MAX_TOKENS"),
    (lambda: plan_schedule([10, 10], *STATIC, rollout_ids=np.array([2**63, 2**63 + 1], dtype=np.uint64)),
     "rollout_ids[0]", "above the limit 2**63 - 1"),
    (lambda: plan_schedule([10, 10], *STATIC, rollout_ids=[np.uint64(2**64 - 1), 0]), "rollout_ids[0]",
     "above the limit"),
    (lambda: plan_schedule([10, 10**400], *STATIC), "total_lengths[1]", "an integer of 1329 bits"),
])
def test_issue_examples_numbers(call, field, pattern):
    with pytest.raises(ScheduleError) as e:
        call()
    assert field in str(e.value) and pattern in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------------- B. containers
_ARRAY_DTYPES = [np.int8, np.int64, np.uint8, np.uint64, np.float64, np.bool_, np.complex128, "U3", object]
ARRAYS = st.sampled_from(_ARRAY_DTYPES).flatmap(lambda dt: arrays(
    dt, array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    elements=st.integers(-3, 2**40) if dt is object else None))
CONTAINERS = st.one_of(
    ARRAYS,
    st.sets(st.integers(1, 9), max_size=3), st.dictionaries(st.integers(1, 9), st.integers(1, 9), max_size=3),
    st.text(max_size=3), st.binary(max_size=3), st.none(), st.integers(), st.floats(),
    st.lists(st.integers(1, 9), max_size=4).map(tuple), st.lists(st.integers(1, 9), max_size=4).map(iter),
    st.builds(range, st.integers(-2, 3), st.integers(0, 6)),
    st.lists(st.lists(st.integers(1, 9), max_size=2), min_size=1, max_size=2),
)


def _container_ok(x) -> bool:
    if isinstance(x, np.ndarray):
        return x.ndim == 1 and x.dtype.kind in "iu" and x.size > 0 and bool(((x >= 1) & (x <= MAX_TOKENS)).all())
    if isinstance(x, (tuple, range, list)):
        return len(x) > 0 and all(exact_int(v, 1, MAX_TOKENS) for v in x)
    return False


@settings(max_examples=examples(300))
@given(CONTAINERS, st.sampled_from([STATIC, DYNAMIC]))
def test_any_container_plans_or_is_refused_naming_it(lengths, cfg):
    ok = _container_ok(lengths)
    try:
        s = plan_schedule(lengths, *cfg)
    except ScheduleError as e:
        assert not ok, f"refused {lengths!r}: {e}"
        assert names_field(str(e), "total_lengths") or "total_lengths[" in str(e), str(e)
        return
    assert ok, f"accepted {lengths!r}"
    assert check_schedule(s) == []


@pytest.mark.parametrize("lengths, pattern", [
    (np.array([10, 20], dtype=object), r"total_lengths is a numpy array of dtype object \(an object array"),
    (np.array(5), r"total_lengths is a 0-d array \(a single number\)"),
    (np.ones((2, 2), dtype=np.int64), r"total_lengths is an array of shape \(2, 2\)"),
    (np.array([1.0, 2.0]), r"dtype float64"),
    ({1, 2}, r"total_lengths must be a sequence of integers .* got set"),
    ({1: 2}, r"got dict"),
    (iter([1, 2]), r"got list_iterator"),
    ([10, np.float64(3.0)], r"total_lengths\[1\] = 3.0 \(float64\) is not an integer"),
    ([10, np.bool_(True)], r"total_lengths\[1\] = True \(bool\) is not an integer"),
    (type("ZeroDim", (), {"__len__": lambda self: len(5), "__iter__": lambda self: iter(())})(),
     r"got ZeroDim without a length"),  # like a 0-d tensor
])
def test_issue_examples_containers(lengths, pattern):
    with pytest.raises(ScheduleError, match=pattern):
        plan_schedule(lengths, *STATIC)


def test_numpy_integers_are_accepted_as_lengths_and_as_sizes_alike():
    lengths = [np.int32(10), np.uint16(20), 30, np.int64(40)]
    s = plan_schedule(lengths, ParallelConfig(dp_size=np.int64(2), cp_size=np.uint8(1)),
                      BatchConfig(global_batch_size=np.int16(4), use_dynamic_batch_size=np.bool_(True),
                                  max_tokens_per_gpu=np.uint32(64)))
    assert s == plan_schedule([10, 20, 30, 40], ParallelConfig(dp_size=2),
                              BatchConfig(global_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=64))
    assert type(s.parallel.dp_size) is int and type(s.batch.use_dynamic_batch_size) is bool
    json.dumps(s.to_dict())  # plain Python types all the way


# ---------------------------------------------------------------------------------------------------- C. cost model
DIM = st.one_of(st.integers(-3, 5000), st.integers(MAX_MODEL_DIM - 1, MAX_MODEL_DIM + 1), HOSTILE)
OPTIONAL_DIMS = ["num_query_groups", "kv_channels", "ffn_hidden_size", "num_experts", "moe_ffn_hidden_size",
                 "moe_shared_expert_intermediate_size", "vocab_size", "moe_router_topk"]
COST_KWARGS = st.fixed_dictionaries(
    {"hidden_size": DIM, "num_layers": st.one_of(st.integers(1, 8), DIM), "num_attention_heads": DIM},
    optional={**{k: st.one_of(st.none(), DIM) for k in OPTIONAL_DIMS},
              "swiglu": st.one_of(st.booleans(), HOSTILE),
              "moe_layer_freq": st.one_of(DIM, st.lists(st.one_of(st.integers(-1, 2), HOSTILE), max_size=8))})


@settings(max_examples=examples(500))
@given(COST_KWARGS)
def test_cost_model_is_valid_or_refused_naming_the_dim(kwargs):
    try:
        m = CostModel(**kwargs)
    except ScheduleError as e:
        field = re.search(r"CostModel\.(\w+)", str(e))
        assert field and field.group(1) in kwargs, str(e)
        return
    linear, quadratic = m.coefficients()
    assert np.isfinite(linear) and np.isfinite(quadratic) and linear > 0 and quadratic > 0
    f = m.flops([1, 1000, MAX_TOKENS])
    assert np.all(np.isfinite(f)) and np.all(f > 0) and f[0] < f[1] < f[2]
    for name in ["hidden_size", "num_layers", "num_attention_heads", *OPTIONAL_DIMS]:
        v = getattr(m, name)
        assert v is None or type(v) is int
    assert type(m.swiglu) is bool
    assert CostModel(**m.to_dict()) == m  # what to_dict writes reads back


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_experts=4, moe_layer_freq=0), "CostModel.moe_layer_freq must be a positive integer, got 0"),
    (dict(num_experts=4, moe_layer_freq=[1, 2]), "CostModel.moe_layer_freq[1] = 2"),
    (dict(num_experts=4, moe_layer_freq=[1, 0, 1]), "moe_layer_freq has 3 entries but num_layers=2"),
    (dict(vocab_size=-10000), "CostModel.vocab_size must be an integer >= 0, got -10000"),
    (dict(kv_channels=-1), "CostModel.kv_channels must be a positive integer, got -1"),
    (dict(ffn_hidden_size=0), "CostModel.ffn_hidden_size must be a positive integer, got 0"),
    (dict(hidden_size=10**200), "CostModel.hidden_size = an integer of 665 bits"),
    (dict(hidden_size=10**200), "MAX_MODEL_DIM = 2**30"),
    (dict(swiglu="False"), "CostModel.swiglu must be a bool"),
    (dict(num_query_groups=2.0), "CostModel.num_query_groups must be a positive integer, got 2.0 (float)"),
    (dict(num_attention_heads=16), "CostModel.num_attention_heads = 16 exceeds hidden_size = 8"),
])
def test_issue_examples_cost_model(kwargs, field):
    base = dict(hidden_size=8, num_layers=2, num_attention_heads=2)
    for make in (lambda: CostModel(**{**base, **kwargs}), lambda: CostModel.from_args({**base, **kwargs}),
                 lambda: build_dp_schedule(SimpleNamespace(**{**base, **kwargs}, global_batch_size=1), {"dp_size": 1},
                                           [10, 20])):
        with pytest.raises(ScheduleError) as e:
            make()
        assert field in str(e.value), str(e.value)


def test_a_non_cost_model_is_refused():
    with pytest.raises(ScheduleError, match="cost_model must be a CostModel, a CostProfile or None, got dict"):
        plan_schedule([10], *STATIC, cost_model={"hidden_size": 8})


def test_configs_as_dicts_are_refused_with_the_converter_to_use():
    parallel, batch = STATIC
    with pytest.raises(ScheduleError, match=r"parallel must be a ParallelConfig, got dict; use ParallelConfig\.from_"):
        plan_schedule([10], {"dp_size": 1}, batch)
    with pytest.raises(ScheduleError, match=r"batch must be a BatchConfig, got dict; use BatchConfig\.from_args"):
        plan_schedule([10], parallel, {"global_batch_size": 1})


# ---------------------------------------------------------------------------------------------------- D. sizes
def _peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        try:
            fn()
        except ScheduleError:
            pass
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


@settings(max_examples=examples(100))
@given(st.one_of(st.integers(1, 8), st.integers(1, MAX_PARALLEL_SIZE)), st.integers(1, 64), st.booleans())
def test_dp_size_is_checked_against_the_samples_before_any_allocation(dp, n, dynamic):
    cfg = DYNAMIC[1] if dynamic else BatchConfig(global_batch_size=n)
    batch = dataclasses.replace(cfg, global_batch_size=n)
    if dp > n:
        with pytest.raises(ScheduleError, match=rf"step 0 has {n} samples but dp_size = {dp}"):
            plan_schedule([100] * n, ParallelConfig(dp_size=dp), batch)
        assert _peak_mib(lambda: plan_schedule([100] * n, ParallelConfig(dp_size=dp), batch)) < 16
        return
    try:
        s = plan_schedule([100] * n, ParallelConfig(dp_size=dp), batch)
    except ScheduleError as e:  # static: n micro-batches of one sample that dp does not divide
        assert not dynamic and n % dp and str(e).startswith("step 0"), str(e)
        return
    assert check_schedule(s) == [] and s.num_microbatches[0] * dp >= dp


@pytest.mark.parametrize("make, field, limit", [
    (lambda: ParallelConfig(dp_size=10**9), "dp_size", "MAX_PARALLEL_SIZE = 2**24"),
    (lambda: ParallelConfig(vpp_size=2), "microbatch_group_size_per_vp_stage", "vpp_size = 2; pass it"),
    (lambda: ParallelConfig(microbatch_group_size_per_vp_stage=2**40), "microbatch_group_size_per_vp_stage",
     "MAX_PARALLEL_SIZE"),
    (lambda: BatchConfig(global_batch_size=10**12), "global_batch_size", "MAX_SAMPLES = 2**27"),
    (lambda: BatchConfig(global_batch_size=1, micro_batch_size=2**30), "micro_batch_size", "MAX_SAMPLES"),
    (lambda: BatchConfig(global_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=2**62),
     "max_tokens_per_gpu", "MAX_TOKENS = 2**32"),
    (lambda: compute_dynamic_global_batch_size(10**20, 8), "num_samples", "MAX_SAMPLES"),
    (lambda: plan_schedule(np.ones(MAX_SAMPLES + 1, dtype=np.int8), *STATIC), "total_lengths", "MAX_SAMPLES"),
])
def test_sizes_above_their_limit_are_refused_naming_it(make, field, limit):
    with pytest.raises(ScheduleError) as e:
        make()
    assert names_field(str(e.value), field) and limit in str(e.value), str(e.value)


def test_huge_dp_size_with_few_samples_allocates_nothing():
    """The issue's dp_size=10**9 ended in a MemoryError; dp is now bounded and checked before per-rank lists."""
    assert _peak_mib(lambda: plan_schedule([10, 20], ParallelConfig(dp_size=MAX_PARALLEL_SIZE), *STATIC[1:])) < 16
    with pytest.raises(ScheduleError, match="dp_size = 10000000000000"):
        build_dp_schedule(SimpleNamespace(global_batch_size=1), {"dp_size": 10**13}, [10, 20])


# ---------------------------------------------------------------------------------------------------- E. coercions
BOOL_FLAGS = ["use_dynamic_batch_size", "balance_data", "balance_by_flops", "use_dynamic_global_batch_size",
              "disable_rollout_trim_samples"]
FLAG_VALUE = st.one_of(st.booleans(), st.none(), st.sampled_from(
    ["False", "True", "", "0", 0, 1, np.bool_(False), np.bool_(True), 1.0, [], "no"]))


@settings(max_examples=examples(300))
@given(st.fixed_dictionaries({}, optional={k: FLAG_VALUE for k in BOOL_FLAGS}))
def test_boolean_flags_are_strict(flags):
    args = SimpleNamespace(global_batch_size=2, micro_batch_size=1, max_tokens_per_gpu=4096, **flags)
    bad = [k for k, v in flags.items() if v is not None and not isinstance(v, (bool, np.bool_))]
    try:
        s = build_dp_schedule(args, {"dp_size": 1}, [10, 20, 30, 40])
    except ScheduleError as e:
        if bad:
            assert any(names_field(str(e), k) for k in bad) and "must be a bool" in str(e), str(e)
        return
    assert not bad, f"accepted non-boolean flags {bad}"
    for k in BOOL_FLAGS:  # None is unset (False, argparse's default); a bool is itself
        assert getattr(s.batch, k) is bool(flags.get(k) or False)


SIZE = st.one_of(st.integers(-1, 4), st.integers(1, 4).map(np.int64), st.none(), HOSTILE)


@settings(max_examples=examples(400))
@given(st.fixed_dictionaries({}, optional={"dp_size": SIZE, "cp_size": SIZE, "vpp_size": SIZE,
                                           "microbatch_group_size_per_vp_stage": SIZE}),
       st.booleans())
def test_train_parallel_config_is_exact(tpc, dynamic):
    """dp_size is required (None never means 1); cp/vpp None mean "not used" (1); the VPP group is required with
    vpp_size > 1, as in the CLI; numpy integers are accepted."""
    def size_ok(key, required):
        v = tpc.get(key)
        return (v is None and not required) or exact_int(v, 1, MAX_PARALLEL_SIZE)
    vpp = tpc.get("vpp_size")
    ok = ("dp_size" in tpc and size_ok("dp_size", True) and size_ok("cp_size", False) and size_ok("vpp_size", False)
          and size_ok("microbatch_group_size_per_vp_stage", vpp is not None and exact_int(vpp, 2, 2**70)))
    args = SimpleNamespace(global_batch_size=8, use_dynamic_batch_size=dynamic, max_tokens_per_gpu=4096)
    try:
        s = build_dp_schedule(args, tpc, [100] * 8)
    except ScheduleError as e:
        msg = str(e)
        if ok:  # a real layout that cannot split these 8 samples: the refusal is about the steps
            assert msg.startswith("step 0"), msg
        else:
            assert any(names_field(msg, k) for k in ["train_parallel_config", *tpc]), msg
        return
    assert ok, f"accepted {tpc}"
    assert s.parallel.dp_size == int(tpc["dp_size"]) and type(s.parallel.dp_size) is int
    assert check_schedule(s) == []


@pytest.mark.parametrize("tpc, args, pattern", [
    ({"dp_size": None}, {}, r"train_parallel_config\['dp_size'\] is None"),
    ({"dp_size": 2, "vpp_size": 2, "microbatch_group_size_per_vp_stage": None}, {},
     r"vpp_size = 2 but no microbatch_group_size_per_vp_stage"),
    ({"dp_size": 2, "vpp_size": 2}, {}, r"vpp_size = 2 but no microbatch_group_size_per_vp_stage"),
    ({"dp_size": 1}, {"use_dynamic_batch_size": "False"}, r"use_dynamic_batch_size must be a bool .* got 'False'"),
    ({"dp_size": 1}, {"balance_data": 1}, r"balance_data must be a bool .* got 1 \(int\)"),
    ({"dp_size": "2"}, {}, r"dp_size must be a positive integer, got '2' \(str\)"),
    ([("dp_size", 2)], {}, r"train_parallel_config must be a mapping"),
])
def test_issue_examples_coercions(tpc, args, pattern):
    with pytest.raises(ScheduleError, match=pattern):
        build_dp_schedule(SimpleNamespace(global_batch_size=2, **args), tpc, [10, 20])


def test_numpy_dp_size_plans_like_an_int():
    a = build_dp_schedule(SimpleNamespace(global_batch_size=2), {"dp_size": np.int64(2)}, [10, 20])
    b = build_dp_schedule(SimpleNamespace(global_batch_size=2), {"dp_size": 2}, [10, 20])
    assert a == b and type(a.parallel.dp_size) is int


# ---------------------------------------------------------------------------------------------------- F. saved
@pytest.fixture(scope="module")
def saved():
    """A small schedule with every optional field: rollout groups, loss tokens, a cost model, two steps, dp=2."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 900, 12).tolist()
    s = plan_schedule(lengths, ParallelConfig(dp_size=2), BatchConfig(global_batch_size=3, use_dynamic_batch_size=True,
                      max_tokens_per_gpu=1024, balance_data=True), rollout_ids=[i // 2 for i in range(12)],
                      loss_tokens=[x // 2 for x in lengths], cost_model=MODEL)
    assert check_schedule(s) == []
    return s


def _paths(obj):
    return json_paths(obj, list_items=(0, 1, -1))


def _set(d, path, value):
    if not path:
        return value
    d = copy.deepcopy(d)
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return d


def _input_ok(d, path, value) -> bool | None:
    """The oracle for a recorded input entry; ``None`` for other paths."""
    if len(path) != 2 or path[0] not in ("total_lengths", "loss_tokens", "rollout_ids"):
        return None
    field, i = path
    if field == "total_lengths":
        return exact_int(value, max(1, d["loss_tokens"][i]), MAX_TOKENS)
    if field == "loss_tokens":
        return exact_int(value, 0, d["total_lengths"][i])
    return exact_int(value, *INT64)


@settings(max_examples=examples(600))
@given(st.data(), HOSTILE)
def test_an_edited_saved_schedule_is_refused_or_checked_never_crashes(saved, data, value):
    base = saved.to_dict()
    path = data.draw(st.sampled_from(list(_paths(base))), label="path")
    edited = _set(base, path, value)
    expected = _input_ok(base, path, value)
    try:
        s = DPSchedule.from_dict(edited)
    except ScheduleError as e:
        assert expected is not True, f"refused the valid {path} = {value!r}: {e}"
        if expected is False:
            assert f"{path[0]}[{path[1]}]" in str(e), str(e)
        return
    assert expected is not False, f"from_dict accepted {path} = {value!r}"
    problems = check_schedule(s)  # never raises
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems)


@pytest.mark.parametrize("field, value, pattern", [
    ("total_lengths", 0, r"total_lengths\[0\] = 0 is below 1"),
    ("total_lengths", -100, r"total_lengths\[0\] = -100 is below 1"),
    ("total_lengths", 100.5, r"total_lengths\[0\] = 100.5 is not an integer"),
    ("total_lengths", True, r"total_lengths\[0\] = True is not an integer"),
    ("loss_tokens", 10**6, r"loss_tokens\[0\] = 1000000 exceeds total_lengths\[0\]"),
    ("loss_tokens", -1, r"loss_tokens\[0\] = -1 is below 0"),
    ("rollout_ids", "7", r"rollout_ids\[0\] = '7' is not an integer"),
])
def test_issue_examples_saved_inputs(saved, field, value, pattern):
    """from_dict refuses them; a schedule edited in memory (no from_dict) is invalid for check_schedule."""
    d = saved.to_dict()
    d[field][0] = value
    with pytest.raises(ScheduleError, match=pattern):
        DPSchedule.from_dict(d)
    edited = list(getattr(saved, field))
    edited[0] = value
    problems = check_schedule(dataclasses.replace(saved, **{field: edited}))
    assert len(problems) == 1 and re.search(pattern, problems[0]), problems


def test_check_schedule_revalidates_the_given_inputs(saved):
    assert check_schedule(saved, total_lengths=saved.total_lengths, rollout_ids=saved.rollout_ids) == []
    bad = [x + 0.5 for x in saved.total_lengths]  # int() would read 100.5 as 100
    problems = check_schedule(saved, total_lengths=bad)
    assert re.search(r"the given total_lengths\[0\] = [\d.]+ is not an integer", problems[0]), problems
    assert "the given rollout_ids[1] = 'x'" in check_schedule(saved, rollout_ids=[0, "x"])[0]


def test_structure_that_could_hang_or_index_out_is_a_violation(saved):
    huge = dataclasses.replace(saved, num_microbatches=[2**62] * saved.num_steps)
    assert "more than the 12 samples" in check_schedule(huge)[0]
    assert "dropped lists sample indices outside [0, 12)" in check_schedule(dataclasses.replace(saved, dropped=[-1]))[0]
    moved = [list(x) for x in saved.step_samples]
    moved[0][0], moved[1][0] = moved[1][0], moved[0][0]
    problems = check_schedule(dataclasses.replace(saved, step_samples=moved))
    assert any("step_samples does not list" in p for p in problems), problems


def test_to_dict_returns_copies(saved):
    before = copy.deepcopy(saved.to_dict())
    d = saved.to_dict()
    for path in _paths(d):
        node = d
        for key in path:
            node = node[key]
        if isinstance(node, list):
            node.append(-1)
    assert saved.to_dict() == before
    assert DPSchedule.from_dict(before) == saved


def test_a_schema_2_schedule_reads_with_the_stats_old_names(saved):
    """Schema 3 renamed StepStats.rank_flops_* / microbatch_flops_* to *_cost_* (they hold seconds with a
    CostProfile); a file written before reads to the same schedule, one written by an older schema is refused."""
    from slime_ext.schedule.dp_schedule import RENAMED_IN_3

    old = saved.to_dict()
    old["schema_version"] = 2
    old["stats"] = [{({v: k for k, v in RENAMED_IN_3.items()}).get(k, k): v for k, v in st_.items()}
                    for st_ in old["stats"]]
    assert "rank_flops_max" in old["stats"][0] and "rank_cost_max" not in old["stats"][0]
    assert DPSchedule.from_dict(old) == saved
    with pytest.raises(ScheduleError, match=r"schema_version=1 is not supported \(expected 3, or 2\)"):
        DPSchedule.from_dict({**old, "schema_version": 1})
    with pytest.raises(ScheduleError, match=r"stats\[0\] has unknown keys \[.*'rank_flops_max'"):
        DPSchedule.from_dict({**old, "schema_version": 3})  # the old names are not read as schema 3


def test_from_dict_refuses_non_mappings_and_unknown_keys(saved):
    for bad in (None, [], "x", 3):
        with pytest.raises(ScheduleError, match="a schedule must be a JSON object"):
            DPSchedule.from_dict(bad)
    for version in (np.array([1, 2]), True, 1.0, "1", None):  # found by the fuzz: an array compared elementwise
        with pytest.raises(ScheduleError, match="schema_version=.* is not supported"):
            DPSchedule.from_dict({**saved.to_dict(), "schema_version": version})
    d = saved.to_dict()
    d["batch"]["use_dynamic_batch_size"] = "True"
    with pytest.raises(ScheduleError, match="use_dynamic_batch_size must be a bool"):
        DPSchedule.from_dict(d)
    d = saved.to_dict()
    d["parallel"]["ep_size"] = 2
    with pytest.raises(ScheduleError, match=r"parallel has unknown keys \['ep_size'\]"):
        DPSchedule.from_dict(d)
