"""The planner's type and range checks, written once: a bad value is a :class:`ScheduleError` naming the field, the
value and the fix. Integers are exact (not ``bool``, floats or strings), booleans strict, and every count bounded
(``MAX_*``) so that no token sum, product or cast leaves int64 / float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from typing import Any

import numpy as np

from .errors import ScheduleError

#: longest sample (tokens) and largest ``max_tokens_per_gpu``; 2**32 = 4,294,967,296 tokens
MAX_TOKENS = 2**32
#: most samples in one rollout, and the largest ``global_batch_size`` / ``micro_batch_size``; 2**27 = 134,217,728
MAX_SAMPLES = 2**27
#: largest ``dp_size`` / ``cp_size`` / ``vpp_size`` / ``microbatch_group_size_per_vp_stage`` / TP / PP size
MAX_PARALLEL_SIZE = 2**24
#: largest model dimension of the FLOPs model (hidden size, layers, heads, vocabulary, ...); 2**30
MAX_MODEL_DIM = 2**30
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

LIMIT_NAMES = {value: f"{name} = 2**{value.bit_length() - 1} = {value:,}" for name, value in (
    ("MAX_TOKENS", MAX_TOKENS), ("MAX_SAMPLES", MAX_SAMPLES), ("MAX_PARALLEL_SIZE", MAX_PARALLEL_SIZE),
    ("MAX_MODEL_DIM", MAX_MODEL_DIM))} | {INT64_MAX: "2**63 - 1 (int64)"}
_WHY = {
    MAX_TOKENS: "so that token sums stay far inside int64",
    MAX_SAMPLES: "so that token sums stay far inside int64 and the plan fits in memory",
    MAX_PARALLEL_SIZE: "larger than any real job",
    MAX_MODEL_DIM: "so that the FLOPs estimate stays finite in float64",
}
assert len({MAX_TOKENS, MAX_SAMPLES, MAX_PARALLEL_SIZE, MAX_MODEL_DIM, INT64_MAX}) == 5  # a limit is named by value


def show(value: Any, width: int = 60) -> str:
    """``repr(value)`` shortened for a one-line message."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and abs(int(value)) > 10**30:
        v = int(value)
        bits = abs(v).bit_length()
        sign = "-" if v < 0 else ""
        return f"{'a negative' if v < 0 else 'an'} integer of {bits} bits (~{sign}2**{bits - 1})"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 -- a hostile __repr__ must not replace the real error
        text = f"<{type(value).__name__}>"
    if isinstance(value, np.generic):
        text = f"{value.item()!r} ({type(value).__name__})"
    return text if len(text) <= width else text[: width - 3] + "..."


def limit_name(limit: int) -> str:
    """``limit`` by its name where it has one."""
    return LIMIT_NAMES.get(limit, f"{limit:,}")


def read_arg(args: Any, name: str) -> Any:
    """``args.name`` of a host's args, an attribute object or a mapping; ``None`` when absent."""
    return args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)


def is_int(value: Any) -> bool:
    """An exact integer: ``int`` or a numpy integer scalar, not ``bool``."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def _kind(minimum: int) -> str:
    return "a positive integer" if minimum == 1 else f"an integer >= {minimum}"


def _fix(fix: str) -> str:
    return f"; {fix}" if fix else ""


def check_int(name: str, value: Any, *, minimum: int = 1, maximum: int, fix: str = "") -> int:
    """``value`` as a Python ``int`` in ``[minimum, maximum]``, or a :class:`ScheduleError` naming ``name``."""
    if not is_int(value):
        raise ScheduleError(f"{name} must be {_kind(minimum)}, got {show(value)} ({type(value).__name__}){_fix(fix)}")
    v = int(value)
    if v < minimum:
        raise ScheduleError(f"{name} must be {_kind(minimum)}, got {show(v)}{_fix(fix)}")
    if v > maximum:
        why = _WHY.get(maximum)
        raise ScheduleError(f"{name} = {show(v)} is above the limit {limit_name(maximum)}"
                            f"{f' ({why})' if why else ''}{_fix(fix)}")
    return v


def check_instance(name: str, value: Any, kinds: type | tuple[type, ...], what: str, fix: str = "") -> Any:
    """``value`` itself where it is one of ``kinds`` (``what`` names them), else a :class:`ScheduleError`."""
    if not isinstance(value, kinds):
        raise ScheduleError(f"{name} must be {what}, got {type(value).__name__}{_fix(fix)}")
    return value


def check_bool(name: str, value: Any, fix: str = "") -> bool:
    """``value`` as a ``bool``; strings, ints and ``None`` are refused (``"False"`` would be truthy)."""
    if not is_bool(value):
        raise ScheduleError(f"{name} must be a bool (True or False), got {show(value)} ({type(value).__name__})"
                            f"{_fix(fix or 'pass a real boolean, not a string or a number')}")
    return bool(value)


def check_int_array(name: str, values: Any, *, n: int | None = None, minimum: int = INT64_MIN,
                    maximum: int = INT64_MAX, what: str = "integer counts") -> np.ndarray:
    """``values`` (a 1-D integer array or a sized sequence of ints) as int64, each in ``[minimum, maximum]``, ``n``
    of them when given."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            shape = "a 0-d array (a single number)" if values.ndim == 0 else f"an array of shape {values.shape}"
            raise ScheduleError(f"{name} is {shape}; it must be one-dimensional, one entry per sample")
        if values.dtype.kind not in "iu":
            hint = (" (an object array: convert it with np.asarray(x, dtype=np.int64))" if values.dtype.kind == "O"
                    else "")
            raise ScheduleError(f"{name} is a numpy array of dtype {values.dtype}{hint}; it must hold {what} "
                                f"(an integer dtype such as int64)")
        count = len(values)
        arr = None
    else:
        if values is None or isinstance(values, (str, bytes, bytearray, Mapping, Set)) \
                or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
            raise ScheduleError(f"{name} must be a sequence of integers (a list or a 1-D numpy array), got "
                                f"{type(values).__name__}")
        try:
            count = len(values)
            arr = values if isinstance(values, list) else list(values)
        except TypeError:  # e.g. a 0-d tensor: it has __len__ but no length
            raise ScheduleError(f"{name} must be a sequence of integers (a list or a 1-D numpy array), got "
                                f"{type(values).__name__} without a length") from None
    _check_count(name, count, n)
    if count == 0:
        return np.zeros(0, dtype=np.int64)

    if arr is None:  # a numpy integer array: compare in its own dtype, so uint64 above int64 never wraps
        array = values
    else:
        types = set(map(type, arr))
        if not types <= {int}:
            for i, v in enumerate(arr):
                if not is_int(v):
                    if isinstance(v, (list, tuple, np.ndarray)):
                        raise ScheduleError(f"{name}[{i}] is a {type(v).__name__}: {name} must be one-dimensional, "
                                            f"one integer per sample")
                    raise ScheduleError(f"{name}[{i}] = {show(v)} is not an integer ({type(v).__name__}); {name} "
                                        f"must hold {what}")
            arr = [int(v) for v in arr]
        try:
            array = np.asarray(arr, dtype=np.int64)
        except OverflowError:  # an int outside int64: find it exactly
            bad = next(i for i, v in enumerate(arr) if not INT64_MIN <= v <= INT64_MAX)
            _out_of_range(name, bad, arr[bad], minimum, maximum)
    lo, hi = array.min(), array.max()
    if int(lo) < minimum or int(hi) > maximum:
        bad = int(np.argmax(array < minimum)) if int(lo) < minimum else int(np.argmax(array > maximum))
        _out_of_range(name, bad, int(array[bad]), minimum, maximum)
    return np.asarray(array, dtype=np.int64)


def _check_count(name: str, count: int, n: int | None) -> None:
    if n is not None and count != n:
        raise ScheduleError(f"{name} has {count} entries but total_lengths has {n}; give exactly one per sample")
    if count > MAX_SAMPLES:
        raise ScheduleError(f"{name} has {count:,} entries, above the limit {limit_name(MAX_SAMPLES)} samples per "
                            f"rollout ({_WHY[MAX_SAMPLES]}); plan the rollout in parts")


def _out_of_range(name: str, i: int, value: int, minimum: int, maximum: int) -> None:
    if value < minimum:
        raise ScheduleError(f"{name}[{i}] = {show(value)} is below {minimum}; every entry must be >= {minimum}")
    why = _WHY.get(maximum)
    raise ScheduleError(f"{name}[{i}] = {show(value)} is above the limit {limit_name(maximum)}"
                        f"{f' ({why})' if why else ''}; every entry must be <= {maximum:,}")


# ---------------------------------------------------------------------------------------------------- the samples
def check_samples(
    total_lengths: Any, rollout_ids: Any = None, loss_tokens: Any = None
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``(lengths, rollout_ids, loss_tokens)`` as int64 arrays: lengths in ``[1, MAX_TOKENS]``, rollout ids int64,
    ``0 <= loss_tokens[i] <= total_lengths[i]``."""
    lengths = check_int_array("total_lengths", total_lengths, minimum=1, maximum=MAX_TOKENS,
                              what="integer token counts")
    n = len(lengths)
    if n == 0:
        raise ScheduleError("total_lengths is empty: the rollout produced no samples; check the rollout function")
    ids = None if rollout_ids is None else check_int_array("rollout_ids", rollout_ids, n=n, what="integer ids")
    loss = None
    if loss_tokens is not None:
        loss = check_int_array("loss_tokens", loss_tokens, n=n, minimum=0, maximum=MAX_TOKENS,
                               what="integer token counts")
        if np.any(loss > lengths):
            bad = int(np.argmax(loss > lengths))
            raise ScheduleError(
                f"loss_tokens[{bad}] = {int(loss[bad])} exceeds total_lengths[{bad}] = {int(lengths[bad])}; "
                f"a sample cannot have more loss tokens than tokens"
            )
    return lengths, ids, loss


# ---------------------------------------------------------------------------------------------------- the model
def check_coefficients(linear: float, quadratic: float) -> None:
    """The FLOPs coefficients must be finite and positive (the dims above guarantee it; this is the backstop)."""
    if not (np.isfinite(linear) and np.isfinite(quadratic) and linear > 0 and quadratic >= 0):
        raise ScheduleError(f"the FLOPs model gives fwd_flops(L) = {linear!r} * L + {quadratic!r} * L**2, not finite "
                            f"and positive; check the model dims")


# ---------------------------------------------------------------------------------------------------- saved schedules
def check_mapping(name: str, value: Any, keys: Any = None) -> Mapping[str, Any]:
    """``value`` must be a mapping (with only ``keys``, when given)."""
    if not isinstance(value, Mapping):
        raise ScheduleError(f"{name} must be a JSON object (a mapping), got {show(value)} ({type(value).__name__})")
    if keys is not None:
        unknown = sorted(map(str, set(value) - set(keys)))
        if unknown:
            raise ScheduleError(f"{name} has unknown keys {unknown[:5]}; the keys are {', '.join(keys)}")
    return value


def int_list(name: str, value: Any, *, minimum: int = INT64_MIN, maximum: int = INT64_MAX,
             what: str = "integers") -> list[int]:
    """A list of exact ints in range, as plain Python ints (for fields read back from JSON)."""
    if not isinstance(value, (list, tuple)):
        raise ScheduleError(f"{name} must be a list of integers, got {show(value)} ({type(value).__name__})")
    return check_int_array(name, value, minimum=minimum, maximum=maximum, what=what).tolist()


def nested_int_lists(name: str, value: Any, depth: int, **bounds: int) -> list:
    """``depth`` levels of lists around :func:`int_list` (``depth=1``: ``[[1, 2], [3]]``)."""
    if depth == 0:
        return int_list(name, value, **bounds)
    if not isinstance(value, (list, tuple)):
        raise ScheduleError(f"{name} must be a list, got {show(value)} ({type(value).__name__})")
    return [nested_int_lists(f"{name}[{i}]", v, depth - 1, **bounds) for i, v in enumerate(value)]


def check_number(name: str, value: Any) -> float:
    """A finite real number (int or float, not bool)."""
    number = None
    if isinstance(value, (int, float, np.integer, np.floating)) and not is_bool(value):
        try:
            number = float(value)
        except OverflowError:
            number = None
    if number is None or not math.isfinite(number):
        raise ScheduleError(f"{name} must be a finite number, got {show(value)} ({type(value).__name__})")
    return number
