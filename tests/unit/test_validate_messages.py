"""The input boundary's messages, word for word, and its edges: each helper of ``slime_ext.schedule.validate`` called
directly (the planner's entries reach them too, but a message that names the wrong field or loses its fix would pass
a test that only looks for the field's name)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from slime_ext.schedule import ScheduleError
from slime_ext.schedule.cost import CostModel
from slime_ext.schedule.validate import (
    INT64_MAX,
    INT64_MIN,
    MAX_MODEL_DIM,
    MAX_SAMPLES,
    MAX_TOKENS,
    check_bool,
    check_coefficients,
    check_int,
    check_int_array,
    check_mapping,
    check_number,
    check_samples,
    int_list,
    is_bool,
    is_int,
    limit_name,
    nested_int_lists,
    show,
)


def refusal(fn, *args, **kwargs) -> str:
    with pytest.raises(ScheduleError) as e:
        fn(*args, **kwargs)
    return str(e.value)


class HostileRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


def test_show_shortens_and_names_what_it_cannot_print():
    assert show(10**30) == repr(10**30)  # at the bound: printed as it is
    assert show(10**30 + 1) == "an integer of 100 bits (~2**99)"
    assert show(-(10**30) - 1) == "a negative integer of 100 bits (~-2**99)"
    assert show(np.uint64(2**64 - 1)) == "18446744073709551615 (uint64)"
    assert show(True) == "True"
    assert show(HostileRepr()) == "<HostileRepr>"
    assert show("x" * 58) == repr("x" * 58)  # 60 characters with the quotes: kept
    assert show("x" * 59) == "'" + "x" * 56 + "..."  # 61: cut to 60
    assert show("abcdef", width=5) == "'a..."


def test_limits_are_named_by_value():
    assert limit_name(MAX_TOKENS) == "MAX_TOKENS = 2**32 = 4,294,967,296"
    assert limit_name(INT64_MAX) == "2**63 - 1 (int64)"
    assert limit_name(1234567) == "1,234,567"


def test_what_counts_as_an_int_and_a_bool():
    assert is_int(3) and is_int(np.int8(3)) and is_int(np.uint64(3))
    assert not is_int(True) and not is_int(np.bool_(True)) and not is_int(3.0) and not is_int("3")
    assert is_bool(True) and is_bool(np.bool_(False)) and not is_bool(0) and not is_bool("False")


def test_check_int_messages():
    assert check_int("x", np.int32(7), maximum=10) == 7 and type(check_int("x", np.int32(7), maximum=10)) is int
    assert check_int("x", 1, maximum=1) == 1 and check_int("x", 0, minimum=0, maximum=0) == 0  # both bounds held
    assert refusal(check_int, "x", 2.0, maximum=10) == "x must be a positive integer, got 2.0 (float)"
    assert refusal(check_int, "x", None, minimum=0, maximum=10, fix="give a size") == (
        "x must be an integer >= 0, got None (NoneType); give a size")
    assert refusal(check_int, "x", 0, maximum=10) == "x must be a positive integer, got 0"
    assert refusal(check_int, "x", -1, minimum=0, maximum=10, fix="f") == "x must be an integer >= 0, got -1; f"
    assert refusal(check_int, "x", 11, maximum=10) == "x = 11 is above the limit 10"
    assert refusal(check_int, "x", 2**32 + 1, maximum=MAX_TOKENS, fix="f") == (
        "x = 4294967297 is above the limit MAX_TOKENS = 2**32 = 4,294,967,296 (so that token sums stay far inside "
        "int64); f")


def test_check_bool_messages():
    assert check_bool("flag", np.bool_(True)) is True and check_bool("flag", False) is False
    assert refusal(check_bool, "flag", "False") == (
        "flag must be a bool (True or False), got 'False' (str); pass a real boolean, not a string or a number")
    assert refusal(check_bool, "flag", 1, fix="use --flag") == (
        "flag must be a bool (True or False), got 1 (int); use --flag")


class HugeSequence:
    """A sized sequence that says it holds more samples than any rollout may (and holds none)."""

    def __len__(self):
        return MAX_SAMPLES + 1

    def __iter__(self):
        return iter(())


class NoLength:
    """Has __len__ but no length (as a 0-d tensor)."""

    def __len__(self):
        raise TypeError("len() of a 0-d tensor")

    def __iter__(self):
        return iter(())


def test_check_int_array_refuses_shapes_and_dtypes_by_name():
    assert refusal(check_int_array, "ids", np.array(3)) == (
        "ids is a 0-d array (a single number); it must be one-dimensional, one entry per sample")
    assert refusal(check_int_array, "ids", np.zeros((2, 2), dtype=np.int64)) == (
        "ids is an array of shape (2, 2); it must be one-dimensional, one entry per sample")
    assert refusal(check_int_array, "ids", np.zeros(2), what="integer ids") == (
        "ids is a numpy array of dtype float64; it must hold integer ids (an integer dtype such as int64)")
    assert refusal(check_int_array, "ids", np.array([1, 2], dtype=object)) == (
        "ids is a numpy array of dtype object (an object array: convert it with np.asarray(x, dtype=np.int64)); it "
        "must hold integer counts (an integer dtype such as int64)")
    for value, kind in ((None, "NoneType"), ("12", "str"), (b"12", "bytes"), (bytearray(b"1"), "bytearray"),
                        ({1: 2}, "dict"), ({1, 2}, "set"), (7, "int"), (iter([1]), "list_iterator")):
        assert refusal(check_int_array, "ids", value) == (
            f"ids must be a sequence of integers (a list or a 1-D numpy array), got {kind}"), value
    assert refusal(check_int_array, "ids", NoLength()) == (
        "ids must be a sequence of integers (a list or a 1-D numpy array), got NoLength without a length")


def test_check_int_array_counts():
    assert refusal(check_int_array, "loss", [1, 2], n=3) == (
        "loss has 2 entries but total_lengths has 3; give exactly one per sample")
    assert check_int_array("loss", [1, 2, 3], n=3).tolist() == [1, 2, 3]
    assert refusal(check_int_array, "lengths", HugeSequence()) == (
        "lengths has 134,217,729 entries, above the limit MAX_SAMPLES = 2**27 = 134,217,728 samples per rollout (so "
        "that token sums stay far inside int64 and the plan fits in memory); plan the rollout in parts")
    huge = np.broadcast_to(np.int64(1), MAX_SAMPLES + 1)  # no memory behind it
    assert refusal(check_int_array, "lengths", huge).startswith("lengths has 134,217,729 entries, above the limit")
    at_limit = np.broadcast_to(np.int64(1), MAX_SAMPLES)  # exactly the limit is allowed
    assert len(check_int_array("lengths", at_limit)) == MAX_SAMPLES
    empty = check_int_array("lengths", [])
    assert empty.dtype == np.int64 and empty.shape == (0,)
    empty = check_int_array("lengths", np.zeros(0, dtype=np.uint8))
    assert empty.dtype == np.int64 and empty.shape == (0,)


def test_check_int_array_entries():
    out = check_int_array("ids", (np.int16(3), 4, np.uint64(5)))
    assert out.dtype == np.int64 and out.tolist() == [3, 4, 5]
    assert check_int_array("ids", np.array([1, 2], dtype=np.uint8)).dtype == np.int64
    assert check_int_array("ids", {"a": 1, "b": 2}.values()).tolist() == [1, 2]  # sized and iterable, not indexable
    for nested, kind in (([2], "list"), ((2,), "tuple")):
        assert refusal(check_int_array, "ids", [1, nested]) == (
            f"ids[1] is a {kind}: ids must be one-dimensional, one integer per sample")
    assert refusal(check_int_array, "ids", [1, np.array([2])]) == (
        "ids[1] is a ndarray: ids must be one-dimensional, one integer per sample")
    assert refusal(check_int_array, "ids", [1, 2.5], what="integer ids") == (
        "ids[1] = 2.5 is not an integer (float); ids must hold integer ids")
    assert refusal(check_int_array, "ids", [True]) == (
        "ids[0] = True is not an integer (bool); ids must hold integer counts")


def test_check_int_array_ranges():
    assert refusal(check_int_array, "ids", [0, 2**63]) == (
        "ids[1] = 9223372036854775808 is above the limit 2**63 - 1 (int64); every entry must be <= "
        "9,223,372,036,854,775,807")
    assert refusal(check_int_array, "ids", [0, -(2**63) - 1]) == (
        "ids[1] = -9223372036854775809 is below -9223372036854775808; every entry must be >= -9223372036854775808")
    assert check_int_array("ids", [INT64_MIN, INT64_MAX]).tolist() == [INT64_MIN, INT64_MAX]
    assert refusal(check_int_array, "ids", [INT64_MAX, INT64_MIN, 2**63]) == (  # the int64 ends are not the culprit
        "ids[2] = 9223372036854775808 is above the limit 2**63 - 1 (int64); every entry must be <= "
        "9,223,372,036,854,775,807")
    assert refusal(check_int_array, "ids", np.array([1, 2**64 - 1], dtype=np.uint64)) == (
        "ids[1] = 18446744073709551615 is above the limit 2**63 - 1 (int64); every entry must be <= "
        "9,223,372,036,854,775,807")
    assert refusal(check_int_array, "len", [3, 0, 5, 0], minimum=1, maximum=4) == (
        "len[1] = 0 is below 1; every entry must be >= 1")
    assert refusal(check_int_array, "len", [4, 6, 5, 7], minimum=1, maximum=4) == (  # 4 is at the limit, not above
        "len[1] = 6 is above the limit 4; every entry must be <= 4")
    assert refusal(check_int_array, "len", [3, 2**32 + 1], minimum=1, maximum=MAX_TOKENS) == (
        "len[1] = 4294967297 is above the limit MAX_TOKENS = 2**32 = 4,294,967,296 (so that token sums stay far "
        "inside int64); every entry must be <= 4,294,967,296")
    assert check_int_array("len", [1, 4], minimum=1, maximum=4).tolist() == [1, 4]  # both bounds held


def test_check_samples_messages():
    assert refusal(check_samples, []) == (
        "total_lengths is empty: the rollout produced no samples; check the rollout function")
    assert refusal(check_samples, [5, 5], None, [5, 6]) == (
        "loss_tokens[1] = 6 exceeds total_lengths[1] = 5; a sample cannot have more loss tokens than tokens")
    assert refusal(check_samples, [5, 5], [1.5, 2]) == (
        "rollout_ids[0] = 1.5 is not an integer (float); rollout_ids must hold integer ids")
    assert refusal(check_samples, [5, 5], None, [-1, 2]) == (
        "loss_tokens[0] = -1 is below 0; every entry must be >= 0")
    assert refusal(check_samples, [5, 2.5]) == (
        "total_lengths[1] = 2.5 is not an integer (float); total_lengths must hold integer token counts")
    assert refusal(check_samples, [5, 5], None, [5, 0.5]) == (
        "loss_tokens[1] = 0.5 is not an integer (float); loss_tokens must hold integer token counts")
    assert refusal(check_samples, [5, 5], [1]) == (
        "rollout_ids has 1 entries but total_lengths has 2; give exactly one per sample")
    assert refusal(check_samples, [5, 5], None, [5, 0, 0]) == (
        "loss_tokens has 3 entries but total_lengths has 2; give exactly one per sample")
    assert refusal(check_samples, [5], None, [2**32 + 1]) == (  # its own limit, before the comparison with lengths
        "loss_tokens[0] = 4294967297 is above the limit MAX_TOKENS = 2**32 = 4,294,967,296 (so that token sums stay "
        "far inside int64); every entry must be <= 4,294,967,296")
    lengths, ids, loss = check_samples([5, 5], [3, 3], [5, 0])
    assert lengths.tolist() == [5, 5] and ids.tolist() == [3, 3] and loss.tolist() == [5, 0]


def test_check_coefficients_message():
    check_coefficients(1.0, 0.0)
    for linear, quadratic in ((0.0, 1.0), (1.0, -1.0), (float("inf"), 1.0), (1.0, float("nan"))):
        assert refusal(check_coefficients, linear, quadratic) == (
            f"the FLOPs model gives fwd_flops(L) = {linear!r} * L + {quadratic!r} * L**2, not finite and positive; "
            f"check the model dims")


def test_saved_fields_messages():
    assert refusal(check_mapping, "batch", [1]) == "batch must be a JSON object (a mapping), got [1] (list)"
    assert check_mapping("batch", {"a": 1}, ["a", "b"]) == {"a": 1}
    assert refusal(check_mapping, "batch", {k: 0 for k in "gfedcba"}, ["a"]) == (
        "batch has unknown keys ['b', 'c', 'd', 'e', 'f']; the keys are a")
    assert refusal(check_mapping, "batch", {"z": 0, 1: 0}, ["a", "b"]) == (
        "batch has unknown keys ['1', 'z']; the keys are a, b")
    assert refusal(int_list, "dropped", "12") == "dropped must be a list of integers, got '12' (str)"
    assert int_list("dropped", (1, 2)) == [1, 2] and type(int_list("dropped", [np.int8(1)])[0]) is int
    assert refusal(int_list, "dropped", [0, 5], minimum=0, maximum=4) == (
        "dropped[1] = 5 is above the limit 4; every entry must be <= 4")
    assert refusal(int_list, "ids", [0.5], what="integer ids") == (
        "ids[0] = 0.5 is not an integer (float); ids must hold integer ids")
    assert refusal(int_list, "d", [-1], minimum=0) == "d[0] = -1 is below 0; every entry must be >= 0"
    assert nested_int_lists("p", [[1], (2, 3)], 1) == [[1], [2, 3]]
    assert refusal(nested_int_lists, "p", {"a": 1}, 1) == "p must be a list, got {'a': 1} (dict)"
    assert refusal(nested_int_lists, "p", [[[1]], [[2], 3]], 2) == "p[1][1] must be a list of integers, got 3 (int)"
    assert refusal(nested_int_lists, "p", [[1], [2.0]], 1) == (
        "p[1][0] = 2.0 is not an integer (float); p[1] must hold integers")
    assert refusal(nested_int_lists, "p", [[1], [5]], 1, maximum=4) == (
        "p[1][0] = 5 is above the limit 4; every entry must be <= 4")


def test_check_number_messages():
    assert check_number("x", 3) == 3.0 and type(check_number("x", np.int8(3))) is float
    assert check_number("x", np.float32(0.5)) == 0.5
    for value, shown in ((True, "True (bool)"), ("1", "'1' (str)"), (None, "None (NoneType)"),
                         (float("inf"), "inf (float)"), (float("nan"), "nan (float)"),
                         (10**400, "an integer of 1329 bits (~2**1328) (int)")):
        assert refusal(check_number, "x", value) == f"x must be a finite number, got {shown}", value


def test_limits_are_powers_of_two_named_once():
    assert (MAX_TOKENS, MAX_SAMPLES, MAX_MODEL_DIM) == (2**32, 2**27, 2**30)


def model_fields(**changes):
    """CostModel's fields at their defaults, a small model's required dims, then ``changes``, checked."""
    fields = {f.name: f.default for f in dataclasses.fields(CostModel)}
    fields.update({"hidden_size": 64, "num_layers": 4, "num_attention_heads": 4, **changes})
    return dataclasses.asdict(CostModel(**fields))


def test_cost_model_field_messages():
    out = model_fields(num_layers=np.int64(3), kv_channels=np.int32(8), moe_layer_freq=np.array([0, 1, 1]),
                       num_experts=4)
    assert out["num_layers"] == 3 and type(out["num_layers"]) is int and type(out["kv_channels"]) is int
    assert out["moe_layer_freq"] == (0, 1, 1) and all(type(f) is int for f in out["moe_layer_freq"])
    assert model_fields(moe_layer_freq=[1, 0, 1, 1])["moe_layer_freq"] == (1, 0, 1, 1)  # no experts: not counted
    assert model_fields(num_attention_heads=64)["num_attention_heads"] == 64  # heads == hidden: kv_channels 1
    assert model_fields(vocab_size=0, moe_router_topk=1)["vocab_size"] == 0
    assert refusal(model_fields, hidden_size=0) == (
        "CostModel.hidden_size must be a positive integer, got 0; pass the model's --hidden-size")
    assert refusal(model_fields, num_layers=MAX_MODEL_DIM + 1) == (
        "CostModel.num_layers = 1073741825 is above the limit MAX_MODEL_DIM = 2**30 = 1,073,741,824 (so that the "
        "FLOPs estimate stays finite in float64); pass the model's --num-layers")
    assert refusal(model_fields, ffn_hidden_size=0) == (
        "CostModel.ffn_hidden_size must be a positive integer, got 0; give a positive size or leave it unset (None) "
        "for Megatron's default")
    assert refusal(model_fields, num_attention_heads=65) == (
        "CostModel.num_attention_heads = 65 exceeds hidden_size = 64: the default kv_channels = hidden_size // "
        "num_attention_heads would be 0 (no attention FLOPs); pass kv_channels or check the dims")
    assert model_fields(num_attention_heads=65, kv_channels=1)["kv_channels"] == 1
    assert refusal(model_fields, vocab_size=-1) == (
        "CostModel.vocab_size must be an integer >= 0, got -1; give the (padded) vocabulary size, or 0 to leave the "
        "LM head out")
    assert refusal(model_fields, moe_router_topk=0) == (
        "CostModel.moe_router_topk must be a positive integer, got 0; give the experts routed per token (>= 1)")
    assert refusal(model_fields, swiglu=1) == (
        "CostModel.swiglu must be a bool (True or False), got 1 (int); pass a real boolean, not a string or a number")
    assert refusal(model_fields, moe_layer_freq=(0, 2, 1)) == (
        "CostModel.moe_layer_freq[1] = 2; a per-layer moe_layer_freq holds 0 (dense) or 1 (MoE) for each layer, "
        "e.g. [0, 1, 1, 1]")
    assert refusal(model_fields, moe_layer_freq=[0, True]) == (
        "CostModel.moe_layer_freq[1] = True; a per-layer moe_layer_freq holds 0 (dense) or 1 (MoE) for each layer, "
        "e.g. [0, 1, 1, 1]")
    assert refusal(model_fields, moe_layer_freq=[0, 1], num_experts=4) == (
        "CostModel.moe_layer_freq has 2 entries but num_layers=4; give one 0/1 per layer")
    assert refusal(model_fields, moe_layer_freq=0) == (
        "CostModel.moe_layer_freq must be a positive integer, got 0; give k >= 1 (every k-th layer is MoE) or a list "
        "of 0/1 per layer, e.g. [0, 1, 1, 1]")
    assert model_fields(moe_layer_freq=np.int8(2))["moe_layer_freq"] == 2
    assert refusal(model_fields, moe_layer_freq=np.array([0, 2, 1])) == (  # a numpy entry shown as a plain int
        "CostModel.moe_layer_freq[1] = 2; a per-layer moe_layer_freq holds 0 (dense) or 1 (MoE) for each layer, "
        "e.g. [0, 1, 1, 1]")


def test_cost_model_fields_come_back_normalised_under_their_own_names():
    given = dict(vocab_size=np.int64(5), moe_router_topk=np.int32(3), swiglu=np.bool_(True),
                 moe_layer_freq=np.int8(2))
    out = model_fields(**given)
    assert set(out) == {f.name for f in dataclasses.fields(CostModel)}
    for name, value in given.items():
        assert out[name] == value and type(out[name]) is type(value.item()), name
