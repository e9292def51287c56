"""A measured cost profile: seconds per micro-batch on the user's model and device, in place of the FLOPs estimate.

One rank's step (forward + backward of its micro-batches, plus the optimizer) is modelled as::

    step_time = step_overhead
              + sum over micro-batches of ( microbatch_overhead
                                            + per_token              * T           # T = tokens of the micro-batch
                                            + per_sample_quadratic   * sum(len**2) # attention within each sample
                                            + packed_quadratic       * T**2 )      # attention over the packed row

``slime-ext calibrate`` fits the terms to timed steps (:func:`slime_ext.training.profile_fit.fit_profile`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import ScheduleError

PROFILE_KIND = "slime_ext.cost_profile"
PROFILE_VERSION = 1

#: the model's terms, in design-matrix column order: (coefficient field, what the column sums per observation)
TERMS = (
    ("step_overhead_s", "1 per step"),
    ("microbatch_overhead_s", "1 per micro-batch"),
    ("per_token_s", "tokens"),
    ("per_sample_quadratic_s", "sum of len**2 over samples"),
    ("packed_quadratic_s", "tokens**2 per micro-batch"),
)
TERM_NAMES = tuple(name for name, _ in TERMS)
#: what the pipeline model reads besides the terms (optional in a file: defaults 2.0 and 0.0)
PIPELINE_FIELDS = ("backward_forward_ratio", "p2p_s")


@dataclass(frozen=True)
class CostProfile:
    """Seconds per step on one rank, fitted from measurements (see the module docstring for the formula)."""

    step_overhead_s: float
    microbatch_overhead_s: float
    per_token_s: float
    per_sample_quadratic_s: float
    packed_quadratic_s: float = 0.0
    #: where it was measured and how well it fits: device, model dims, points, rms/max relative error, ...
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)
    #: pipeline model: a micro-batch's backward over its forward (the seconds above split ``1 : ratio``)
    backward_forward_ratio: float = 2.0
    #: pipeline model: seconds of one stage-boundary send/recv of one micro-batch's activation or gradient
    p2p_s: float = 0.0

    def __post_init__(self) -> None:
        for name in TERM_NAMES + PIPELINE_FIELDS:  # a term: seconds >= 0; the ratio > 0, p2p_s >= 0 (optional)
            value, positive = getattr(self, name), name == "backward_forward_ratio"
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (positive and value == 0):
                fix = (" (seconds); re-run `slime-ext calibrate` or fix the profile file" if name in TERM_NAMES else
                       f"; fix the profile file or omit it (default {2.0 if positive else 0.0})")
                raise ScheduleError(f"CostProfile.{name} = {value!r} must be a finite number "
                                    f"{'> 0' if positive else '>= 0'}{fix}")
            object.__setattr__(self, name, float(value))
        if self.per_token_s + self.per_sample_quadratic_s + self.packed_quadratic_s <= 0:
            raise ScheduleError("CostProfile has per_token_s = per_sample_quadratic_s = packed_quadratic_s = 0: "
                                "every sample would cost nothing, so there is nothing to balance by; re-calibrate")
        object.__setattr__(self, "meta", dict(self.meta))

    def sample_costs(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """The additive per-sample part (seconds; the packed term's cross terms belong to no single sample)."""
        L = np.asarray(lengths, dtype=np.float64)
        return L * (self.per_token_s + (self.per_sample_quadratic_s + self.packed_quadratic_s) * L)

    flops = sample_costs  #: as :meth:`CostModel.flops`: per-sample seconds

    def coefficients(self) -> tuple[float, float]:
        """``(linear, quadratic)`` of :meth:`sample_costs`."""
        return self.per_token_s, self.per_sample_quadratic_s + self.packed_quadratic_s

    def microbatch_time(self, lengths: Sequence[int]) -> float:
        """Predicted seconds of one micro-batch holding samples of ``lengths``."""
        L = np.asarray(lengths, dtype=np.float64)
        return float(self.price_sums(float(L.sum()), float((L * L).sum())))

    def rank_time(self, micro_batches: Sequence[Sequence[int]]) -> float:
        """Predicted busy seconds of one rank in one step: ``step_overhead`` plus its micro-batches."""
        return self.step_overhead_s + sum(self.microbatch_time(mb) for mb in micro_batches)

    def bin_times(self, lengths: np.ndarray, bin_of: np.ndarray, count: int) -> np.ndarray:
        """Predicted seconds of each of ``count`` micro-batches given as labels (``bin_of[i]`` = sample i's)."""
        L = np.asarray(lengths, dtype=np.float64)
        tokens = np.bincount(bin_of, weights=L, minlength=count)
        squares = np.bincount(bin_of, weights=L * L, minlength=count)
        return self.price_sums(tokens, squares)

    def price_sums(self, tokens: np.ndarray, squares: np.ndarray) -> np.ndarray:
        """Predicted seconds of micro-batches of ``tokens`` tokens and ``squares = sum L**2`` each."""
        return (self.microbatch_overhead_s + self.per_token_s * tokens + self.per_sample_quadratic_s * squares
                + self.packed_quadratic_s * tokens * tokens)

    def to_dict(self) -> dict:
        d = {"kind": PROFILE_KIND, "version": PROFILE_VERSION}
        d.update({name: getattr(self, name) for name in TERM_NAMES + PIPELINE_FIELDS})
        d["meta"] = dict(self.meta)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "the profile") -> "CostProfile":
        if not isinstance(d, Mapping):
            raise ScheduleError(f"{source} must be a JSON object written by `slime-ext calibrate`, got "
                                f"{type(d).__name__}")
        if d.get("kind") != PROFILE_KIND:
            raise ScheduleError(f"{source}: kind = {d.get('kind')!r}, expected {PROFILE_KIND!r}; pass a file written "
                                f"by `slime-ext calibrate`")
        if d.get("version") != PROFILE_VERSION:
            raise ScheduleError(f"{source}: version = {d.get('version')!r}, this slime-ext reads version "
                                f"{PROFILE_VERSION}; re-run `slime-ext calibrate`")
        missing = [name for name in TERM_NAMES if name not in d]
        if missing:
            raise ScheduleError(f"{source} is missing {missing}; re-run `slime-ext calibrate`")
        return cls(**{name: d[name] for name in TERM_NAMES + PIPELINE_FIELDS if name in d}, meta=d.get("meta") or {})

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2, sort_keys=False)
            fh.write("\n")

    @classmethod
    def load(cls, path: str) -> "CostProfile":
        try:
            with open(path) as fh:
                d = json.load(fh)
        except OSError as e:
            raise ScheduleError(f"cost profile {path!r} cannot be read ({e.strerror}); run `slime-ext calibrate "
                                f"--out {path}` first") from None
        except json.JSONDecodeError as e:
            raise ScheduleError(f"cost profile {path!r} is not JSON ({e}); pass a file written by "
                                f"`slime-ext calibrate`") from None
        return cls.from_dict(d, source=f"cost profile {path!r}")


__all__ = ["CostProfile", "PIPELINE_FIELDS", "PROFILE_KIND", "TERMS", "TERM_NAMES"]
