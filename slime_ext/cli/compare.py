"""``slime-ext plan --compare legacy,reference``: the baselines of :mod:`slime_ext.schemes` on the same input.

* ``legacy``    -- :class:`~slime_ext.schemes.LegacySchedule`, the training-side scheme (our own code, the one a job
  with ``dp_schedule: legacy`` runs): the rollout is split across DP ranks, every rank first-fit counts its
  micro-batches per step, the counts are all-reduced (MAX), then each rank deals its step into that many
  micro-batches of even tokens with no cap. It counts ``global_batch_size`` in samples and has no
  ``balance_by_flops``.
* ``reference`` -- :class:`~slime_ext.schemes.ReferenceSchedule`: upstream slime's own rollout-side
  ``build_dp_schedule``, imported at run time from an installed slime or ``SLIME_GIT``; without either its rows
  say how to get it.

Every scheme, ours included, is measured by the same function, :func:`slime_ext.metrics.measure`, from the
schedule's shape and one cost (our :class:`CostModel`'s FLOPs, or tokens without model dims), never from a
scheme's own statistics. Only dynamic batches are compared (with static micro-batches every scheme cuts the same
fixed chunks). A baseline that cannot run on the input (e.g. upstream would assert) gets a row saying why.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..schedule import CostModel, CostProfile, DPSchedule
from ..schemes import BASELINES, NotComparable
from .errors import CLIError
from .options import Setup
from .pipeline_plot import step_makespans
from .report import fmt_cost, fmt_float, fmt_largest, fmt_pct, piped, pooled_balance_bound, render_table

SCHEMES = tuple(BASELINES)


def parse_compare(spec: str) -> list[str]:
    names = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [x for x in names if x not in SCHEMES]
    if bad or not names:
        what = f"unknown scheme {bad[0]!r}" if bad else "no scheme"
        raise CLIError(f"--compare {spec!r}: {what}; give a comma list of {', '.join(SCHEMES)}")
    return list(dict.fromkeys(names))


@dataclass
class SchemeRun:
    name: str
    #: anything with partitions / micro_batch_indices / num_microbatches; None when the scheme did not run
    schedule: Any = None
    seconds: float | None = None
    metrics: Any = None
    #: tokens per step (over all ranks), for the utilisation
    step_tokens: list[int] | None = None
    note: str = ""
    #: how ``seconds`` was measured, when it is not one plain call
    time_note: str = ""
    #: under pipeline parallelism: the predicted makespan per step (slowest replica), ours' pricing; else None
    makespans: list[float] | None = None


def _dense_source(setup: Setup):
    """The FLOPs model upstream's estimate is fed from (the model dims, also where a measured profile is the cost)."""
    return setup.flops_model if setup.flops_model is not None else setup.cost_model


def _run(name: str, ours: DPSchedule, setup: Setup) -> SchemeRun:
    """The baseline ``name`` on the rollout ``ours`` planned, with the same flags; a row saying why where it cannot."""
    baseline = BASELINES[name]
    dense = _dense_source(setup)
    cost_model = dense if isinstance(dense, CostModel) else None
    try:
        same = baseline.same_input(ours, setup.batch, cost_model)
    except NotComparable as e:
        return SchemeRun(name, note=f"not run: {e}")
    why = baseline.missing()
    if why:
        return SchemeRun(name, note=f"not run: {why}")
    lengths = [ours.total_lengths[i] for i in same.sample_ids]
    t0 = time.perf_counter()
    sched = baseline.schedule(lengths, setup.parallel, setup.batch, global_batch_size=same.global_batch_size,
                              rollout_ids=same.rollout_ids, cost_model=cost_model)
    elapsed = time.perf_counter() - t0
    sched.partitions = [[same.sample_ids[i] for i in part] for part in sched.partitions]  # ours' sample ids
    return SchemeRun(name, sched, sched.timings.get("wall", elapsed), note=baseline.note(setup.batch),
                     time_note=baseline.time_note)


def _step_tokens(view, lengths: np.ndarray) -> list[int]:
    out, first = [], 0
    for m in view.num_microbatches:
        total = 0
        for r, part in enumerate(view.partitions):
            part = np.asarray(part, dtype=np.int64)
            total += sum(int(lengths[part[mb]].sum()) for mb in view.micro_batch_indices[r][first:first + m])
        out.append(total)
        first += m
    return out


def run_compare(names: list[str], schedule: DPSchedule, setup: Setup, plan_seconds: float,
                quiet: bool = False) -> list[SchemeRun]:
    """Ours first, then each baseline, all measured the same way."""
    from ..metrics import measure

    lengths = np.asarray(schedule.total_lengths, dtype=np.int64)
    flops = setup.cost_model.flops(lengths) if setup.cost_model is not None else lengths.astype(np.float64)
    runs = [SchemeRun("ours", schedule, plan_seconds)]
    for name in names:
        if not quiet:
            print(f"running the {name} baseline ...", file=sys.stderr, flush=True)
        try:
            runs.append(_run(name, schedule, setup))
        except (AssertionError, ValueError, ZeroDivisionError) as e:  # upstream asserts where it cannot schedule
            runs.append(SchemeRun(name, note=f"failed as upstream would: {type(e).__name__}: {e}"))
    expected = sum(schedule.samples_per_step)
    for run in runs:
        if run.schedule is None:
            continue
        run.metrics = measure(run.schedule, lengths, dp_size=setup.parallel.dp_size, cap=schedule.cap,
                              align=setup.parallel.align, flops=flops, expected_samples=expected)
        if run.metrics.problems:
            run.note = "; ".join([*run.metrics.problems[:3], run.note]).strip("; ")
        else:
            run.step_tokens = _step_tokens(run.schedule, lengths)
            _price_pipeline(run, schedule)
    return runs


def _price_pipeline(run: SchemeRun, schedule: DPSchedule) -> None:
    """Under pipeline parallelism every scheme's step time is its predicted makespan, as ours' is in the main
    table: one model for every time and ratio the command prints."""
    if not piped(schedule):
        return
    try:
        run.makespans = step_makespans(schedule, run.schedule)
    except ValueError as e:
        run.note = "; ".join([f"cannot run on this pipeline ({e})", run.note]).strip("; ")


def _time(run: SchemeRun, costs: list[float], rank_cost_max: float, schedule: DPSchedule,
          setup: Setup) -> float | None:
    """Seconds of the steps whose makespans are ``costs`` (pipelined) or of a slowest rank's cost (no pipeline)."""
    if piped(schedule):
        return setup.makespan_seconds(sum(costs)) if run.makespans is not None else None
    return setup.step_seconds(rank_cost_max)


# ---------------------------------------------------------------------------------------------------- the table
def compare_table(runs: list[SchemeRun], schedule: DPSchedule, setup: Setup) -> str:
    unit = schedule.cost_unit
    tok = setup.cost_model is None
    dp, cap, pipe = setup.parallel.dp_size, schedule.cap, piped(schedule)
    headers = ["step", "scheme", "mbs/rank", "bound/rank", "util", "largest", "over_cap", f"rank_{unit}_max",
               f"rank_{unit}_mean", "imbal", "imbal_lb", *([f"makespan_{unit}"] if pipe else []), "time_s"]
    ok = [r for r in runs if r.metrics is not None and r.metrics.steps]

    def makespan(r: SchemeRun, steps: slice) -> list[str]:
        if not pipe:
            return []
        return [fmt_float(sum(r.makespans[steps])) if r.makespans is not None else "-"]

    rows = []
    num_steps = max((len(r.metrics.steps) for r in ok), default=0)
    for s in range(num_steps):
        for r in ok:
            if s >= len(r.metrics.steps):
                continue
            m = r.metrics.steps[s]
            rows.append([str(s), r.name, str(m.total_microbatches // dp), _bound(m.valid_bound // dp, m.cap_violations),
                         fmt_pct(r.step_tokens[s] / (m.total_microbatches * cap)),
                         fmt_largest(m.largest_microbatch_tokens, cap), str(m.cap_violations),
                         fmt_cost(m.rank_cost_max, tok), fmt_cost(m.rank_cost_mean, tok), f"{m.imbalance:.3f}",
                         f"{m.balance_bound:.3f}", *makespan(r, slice(s, s + 1)),
                         fmt_float(_time(r, (r.makespans or [])[s:s + 1], m.rank_cost_max, schedule, setup))])
    for r in ok:
        st = r.metrics.steps
        fmax, fmean = sum(m.rank_cost_max for m in st), sum(m.rank_cost_mean for m in st)
        rows.append(["all", r.name, str(r.metrics.total_microbatches // dp),
                     _bound(sum(m.valid_bound // dp for m in st), r.metrics.cap_violations),
                     fmt_pct(sum(r.step_tokens) / (r.metrics.total_microbatches * cap)),
                     fmt_largest(r.metrics.largest_microbatch_tokens, cap), str(r.metrics.cap_violations),
                     fmt_cost(fmax, tok), fmt_cost(fmean, tok), f"{fmax / fmean if fmean else 1.0:.3f}",
                     f"{pooled_balance_bound([(m.balance_bound, m.rank_cost_mean) for m in st]):.3f}",
                     *makespan(r, slice(None)), fmt_float(_time(r, r.makespans or [], fmax, schedule, setup))])
    time_basis = ("time_s = the slowest replica's predicted pipeline makespan in seconds, as in the table above"
                  if pipe else "time_s = the slowest rank's cost in seconds, as in the table above")
    lines = [f"compare on the same input: every scheme measured by slime_ext.metrics.measure with the same cost "
             f"({unit}); {time_basis}",
             f"bound/rank = true lower bound on micro-batches per rank of a schedule within the cap (- where the "
             f"scheme broke it); over_cap = micro-batches of several samples above the cap {cap}; imbal_lb as in the "
             f"table above"]
    if rows:
        table = render_table(rows, headers).splitlines()
        # a rule between the steps and the totals
        split = 2 + sum(1 for row in rows if row[0] != "all")
        table.insert(split, table[1])
        lines += ["", *table]
    lines += ["", *_verdicts(runs, schedule, setup)]
    return "\n".join(lines)


def _bound(bound_per_rank: int, cap_violations: int) -> str:
    """The lower bound binds a schedule that keeps the cap; a scheme that broke it (over_cap) may go below: '-'."""
    return "-" if cap_violations else str(bound_per_rank)


def _total_cost(r: SchemeRun, schedule: DPSchedule) -> float | None:
    """What the verdict's ratio compares: the summed pipeline makespans (pipelined) or slowest-rank costs."""
    if piped(schedule):
        return sum(r.makespans) if r.makespans is not None else None
    return sum(s.rank_cost_max for s in r.metrics.steps)


def _verdicts(runs: list[SchemeRun], schedule: DPSchedule, setup: Setup) -> list[str]:
    ours = runs[0]
    om = ours.metrics
    ours_total = _total_cost(ours, schedule) if om is not None and om.steps else None
    if setup.cost_model is not None:
        what = "est. step time"
    else:
        what = "pipeline makespan (tokens)" if piped(schedule) else "slowest-rank tokens"
    out = []
    for r in runs:
        head = f"{r.name}:"
        if r.metrics is None or not r.metrics.steps:
            out.append(f"{head} {r.note or 'no result'}")
            continue
        m = r.metrics
        if r is ours:
            r.time_note = "one run; python -m bench.run times the schemes properly"
        parts = [f"planned in {r.seconds * 1e3:.1f} ms" + (f" ({r.time_note})" if r.time_note else "")]
        if r is not ours and om is not None and om.steps:
            parts.append(f"micro-batches/rank {m.total_microbatches // setup.parallel.dp_size} vs ours "
                         f"{om.total_microbatches // setup.parallel.dp_size}")
            total = _total_cost(r, schedule)
            if total is not None and ours_total:
                parts.append(f"{what} x{total / ours_total:.3f} of ours")
        if m.cap_violations:
            parts.append(f"{m.cap_violations} micro-batches break the cap")
        if r.note:
            parts.append(r.note)
        out.append(f"{head} " + ", ".join(p for p in parts if p))
    return out
