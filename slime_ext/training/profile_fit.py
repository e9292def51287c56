"""The fit of a :class:`~slime_ext.schedule.profile.CostProfile` to timed training steps: calibration's arithmetic.

The planner reads a profile; it never fits one. Fitting timings is calibration, which measures them here in
:mod:`.calibrate` and fits them with :func:`fit_profile`: non-negative least squares on the relative error, refusing
timings that cannot determine the terms with a :class:`ScheduleError` that names the field. Pure: numpy only.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from slime_ext.schedule.errors import ScheduleError
from slime_ext.schedule.profile import TERM_NAMES, TERMS, CostProfile

__all__ = ["FitReport", "Observation", "design_row", "fit_profile", "fit_summary"]


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
