"""A measured cost profile: seconds per micro-batch on the user's model and device, in place of the FLOPs estimate.

The time of one training step on one rank (forward + backward of its micro-batches, plus the optimizer) is modelled
as::

    step_time = step_overhead
              + sum over micro-batches of ( microbatch_overhead
                                            + per_token              * T           # T = tokens of the micro-batch
                                            + per_sample_quadratic   * sum(len**2) # attention within each sample
                                            + packed_quadratic       * T**2 )      # attention over the packed row

``per_sample_quadratic`` is attention that sees each sample alone (flash/THD varlen kernels, and this repo's CPU
THD attention); ``packed_quadratic`` is attention over the whole packed row, masked (a path that packs without THD).
:func:`fit_profile` fits all terms, non-negative, and refuses timings that cannot determine them, naming the field.
The planner reads a profile through :meth:`CostProfile.sample_costs` (what balancing balances),
:attr:`CostProfile.microbatch_overhead_s` and :meth:`CostProfile.rank_time` (the prediction it compares by).
"""

from __future__ import annotations

import itertools
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
    #: pipeline model (``pp_size > 1``): a micro-batch's backward takes this many times its forward; the seconds
    #: above (forward + backward of the whole model) split into ``1 : backward_forward_ratio``
    backward_forward_ratio: float = 2.0
    #: pipeline model: seconds of one stage-boundary send/recv of one micro-batch's activation or gradient
    p2p_s: float = 0.0

    def __post_init__(self) -> None:
        for name in TERM_NAMES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ScheduleError(f"CostProfile.{name} = {value!r} must be a finite number >= 0 (seconds); "
                                    f"re-run `slime-ext calibrate` or fix the profile file")
            object.__setattr__(self, name, float(value))
        for name, positive in (("backward_forward_ratio", True), ("p2p_s", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (positive and value == 0):
                raise ScheduleError(f"CostProfile.{name} = {value!r} must be a finite number "
                                    f"{'> 0' if positive else '>= 0'}; fix the profile file or omit it (default "
                                    f"{2.0 if positive else 0.0})")
            object.__setattr__(self, name, float(value))
        if self.per_token_s + self.per_sample_quadratic_s + self.packed_quadratic_s <= 0:
            raise ScheduleError("CostProfile has per_token_s = per_sample_quadratic_s = packed_quadratic_s = 0: "
                                "every sample would cost nothing, so there is nothing to balance by; re-calibrate")
        object.__setattr__(self, "meta", dict(self.meta))

    # ------------------------------------------------------------------ what the planner uses
    def sample_costs(self, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
        """The additive per-sample part (seconds): ``per_token * L + (per_sample_quadratic + packed_quadratic) * L**2``.

        The packed term's cross terms (``2 * L_i * L_j`` of two samples sharing a micro-batch) belong to no single
        sample; :meth:`microbatch_time` counts them.
        """
        L = np.asarray(lengths, dtype=np.float64)
        return L * (self.per_token_s + (self.per_sample_quadratic_s + self.packed_quadratic_s) * L)

    #: ``CostModel``-shaped alias: code that asks a cost model for per-sample ``flops`` gets seconds from a profile
    flops = sample_costs

    def coefficients(self) -> tuple[float, float]:
        """``(linear, quadratic)`` of :meth:`sample_costs`, as :meth:`CostModel.coefficients`."""
        return self.per_token_s, self.per_sample_quadratic_s + self.packed_quadratic_s

    def microbatch_time(self, lengths: Sequence[int]) -> float:
        """Predicted seconds of one micro-batch holding samples of ``lengths``."""
        L = np.asarray(lengths, dtype=np.float64)
        tokens = float(L.sum())
        return (self.microbatch_overhead_s + self.per_token_s * tokens
                + self.per_sample_quadratic_s * float((L * L).sum()) + self.packed_quadratic_s * tokens * tokens)

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

    def labelled_rank_times(self, lengths: np.ndarray, bin_of: np.ndarray, rank_of_bin: np.ndarray,
                            dp_size: int) -> np.ndarray:
        """Predicted seconds per rank of one step given as planner labels (``bin_of`` per sample, ``rank_of_bin``)."""
        mb = self.bin_times(lengths, bin_of, len(rank_of_bin))
        return self.step_overhead_s + np.bincount(rank_of_bin, weights=mb, minlength=dp_size)

    # ------------------------------------------------------------------ files
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
        # profiles written before the pipeline fields existed load with their defaults
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


def is_profile_dict(d: Any) -> bool:
    """Whether a serialized cost model (e.g. ``DPSchedule.to_dict()["cost_model"]``) is a profile."""
    return isinstance(d, Mapping) and d.get("kind") == PROFILE_KIND


# ---------------------------------------------------------------------------------------------------- fitting
@dataclass(frozen=True)
class Observation:
    """One timed step of one rank: its micro-batches (sample lengths of each) and the seconds it took."""

    micro_batches: tuple[tuple[int, ...], ...]
    seconds: float


def design_row(micro_batches: Sequence[Sequence[int]]) -> np.ndarray:
    """The five columns of :data:`TERMS` for one observation."""
    row = np.zeros(len(TERMS))
    row[0] = 1.0
    for mb in micro_batches:
        L = np.asarray(mb, dtype=np.float64)
        t = float(L.sum())
        row[1] += 1.0
        row[2] += t
        row[3] += float((L * L).sum())
        row[4] += t * t
    return row


@dataclass(frozen=True)
class FitReport:
    """How well a fitted profile reproduces its own observations."""

    num_points: int
    terms_used: tuple[str, ...]
    rms_rel_error: float
    max_rel_error: float
    residuals_rel: tuple[float, ...]


def _validate(observations: Sequence[Any], terms: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    unknown = [t for t in terms if t not in TERM_NAMES]
    if unknown:
        raise ScheduleError(f"terms {unknown} are not profile terms; choose from {list(TERM_NAMES)}")
    if "per_token_s" not in terms:
        raise ScheduleError(f"terms={list(terms)} must include 'per_token_s' (the cost of a token)")
    need = len(terms) + 2
    if len(observations) < need:
        raise ScheduleError(f"observations: {len(observations)} timed steps cannot fit {len(terms)} terms "
                            f"({', '.join(terms)}) with an error estimate; give at least {need}")
    rows, seconds = [], []
    for i, obs in enumerate(observations):
        mbs, secs = (obs.micro_batches, obs.seconds) if isinstance(obs, Observation) else obs
        if not isinstance(secs, (int, float)) or isinstance(secs, bool) or not math.isfinite(secs) or secs <= 0:
            raise ScheduleError(f"observations[{i}].seconds = {secs!r} must be a positive finite time; a negative, "
                                f"zero or NaN timing means the timer or the run failed -- re-measure that point")
        if not mbs or any(len(mb) == 0 for mb in mbs):
            raise ScheduleError(f"observations[{i}].micro_batches = {mbs!r} must hold at least one non-empty "
                                f"micro-batch")
        for mb in mbs:
            for length in mb:
                if isinstance(length, bool) or int(length) != length or length < 1:
                    raise ScheduleError(f"observations[{i}].micro_batches holds a sample length {length!r}; "
                                        f"lengths are positive integers (tokens)")
        rows.append(design_row(mbs))
        seconds.append(float(secs))
    return np.asarray(rows), np.asarray(seconds)


def _check_identifiable(X: np.ndarray, terms: Sequence[str]) -> None:
    """Every column must carry information the others do not: otherwise name the columns that depend on others."""
    scaled = X / np.maximum(np.abs(X).max(axis=0), 1e-300)
    full = np.linalg.matrix_rank(scaled, tol=1e-9 * len(X))
    if full == X.shape[1]:
        return
    dependent = [t for j, t in enumerate(terms)
                 if np.linalg.matrix_rank(np.delete(scaled, j, axis=1), tol=1e-9 * len(X)) == full]
    described = {name: what for name, what in TERMS}
    hint = []
    if "per_sample_quadratic_s" in dependent and "packed_quadratic_s" in dependent:
        hint.append("every micro-batch holds one sample, so sum(len**2) equals tokens**2: time micro-batches "
                    "that pack several samples")
    if "per_token_s" in dependent:
        hint.append("the sample lengths do not vary (tokens are a multiple of the sample count): time several "
                    "different lengths")
    if "microbatch_overhead_s" in dependent and "step_overhead_s" in dependent:
        hint.append("every step runs the same number of micro-batches: vary the micro-batches per step")
    raise ScheduleError(
        f"observations cannot separate the terms {dependent} "
        f"({'; '.join(f'{t}: {described[t]}' for t in dependent)}) -- their columns are collinear"
        f"{': ' + '; '.join(hint) if hint else ''}; or drop terms with fit_profile(..., terms=...)"
    )


def fit_profile(observations: Sequence[Observation | tuple], *, terms: Sequence[str] = TERM_NAMES,
                meta: Mapping[str, Any] | None = None) -> tuple[CostProfile, FitReport]:
    """Least-squares fit of :class:`CostProfile` to timed steps; returns the profile and its :class:`FitReport`.

    ``observations``: :class:`Observation` or ``(micro_batches, seconds)`` pairs. The fit minimises the squared
    *relative* error (each row weighted by ``1 / seconds``, so short and long steps count alike) under the
    constraint that every coefficient is ``>= 0`` -- exactly, by trying every subset of the terms (there are at
    most 32) and keeping the best fit whose coefficients are all non-negative. ``terms`` restricts the model
    (the others are fixed at 0).
    """
    terms = tuple(terms)
    X_all, y = _validate(observations, terms)
    cols = [TERM_NAMES.index(t) for t in terms]
    X = X_all[:, cols]
    _check_identifiable(X, terms)
    W = X / y[:, None]  # relative error: (x.c - y) / y
    ones = np.ones(len(y))
    scale = np.maximum(np.abs(W).max(axis=0), 1e-300)
    best: tuple[float, np.ndarray, tuple[int, ...]] | None = None
    for k in range(len(cols), 0, -1):
        for subset in itertools.combinations(range(len(cols)), k):
            A = W[:, subset] / scale[list(subset)]
            coef, *_ = np.linalg.lstsq(A, ones, rcond=None)
            coef = coef / scale[list(subset)]
            if np.any(coef < 0):
                continue
            sse = float(np.sum((W[:, subset] @ coef - ones) ** 2))
            if best is None or sse < best[0] - 1e-15:
                best = (sse, coef, subset)
    if best is None:  # pragma: no cover - a single column with positive data always has a non-negative fit
        raise ScheduleError("observations: no non-negative fit exists; re-measure")
    _, coef, subset = best
    values = dict.fromkeys(TERM_NAMES, 0.0)
    for c, j in zip(coef, subset):
        values[terms[j]] = float(c)
    predicted = X_all @ np.array([values[t] for t in TERM_NAMES])
    rel = (predicted - y) / y
    report = FitReport(num_points=len(y), terms_used=tuple(terms[j] for j in subset),
                       rms_rel_error=float(np.sqrt(np.mean(rel ** 2))), max_rel_error=float(np.abs(rel).max()),
                       residuals_rel=tuple(float(r) for r in rel))
    full_meta = dict(meta or {})
    full_meta.update(num_points=report.num_points, rms_rel_error=report.rms_rel_error,
                     max_rel_error=report.max_rel_error, terms_used=list(report.terms_used))
    if values["per_token_s"] + values["per_sample_quadratic_s"] + values["packed_quadratic_s"] <= 0:
        raise ScheduleError("observations: the best fit charges nothing per token (time does not grow with the "
                            "micro-batch size); the timings are dominated by noise or overhead -- time longer "
                            "samples or repeat each point more often")
    return CostProfile(**values, meta=full_meta), report


def fit_summary(profile: CostProfile, report: FitReport) -> str:
    """A few lines for humans: the coefficients and the fit error."""
    lines = [f"fitted on {report.num_points} timed steps; terms kept: {', '.join(report.terms_used)}"]
    for name, what in TERMS:
        lines.append(f"  {name:<24} = {getattr(profile, name):.4e}   ({what})")
    lines.append(f"  fit error: rms {100 * report.rms_rel_error:.2f}%, max {100 * report.max_rel_error:.2f}% "
                 f"(relative, on the calibration points)")
    return "\n".join(lines)


__all__ = ["CostProfile", "FitReport", "Observation", "PIPELINE_FIELDS", "PROFILE_KIND", "TERMS", "TERM_NAMES",
           "design_row", "fit_profile", "fit_summary", "is_profile_dict"]
