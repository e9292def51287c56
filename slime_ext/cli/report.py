"""The text report of ``slime-ext plan``: a header, one row per step from ``DPSchedule.stats``, a total row, a legend.

Nothing here plans or recomputes the schedule: every number is a field of :class:`StepStats` (or a sum of them),
plus the step-time estimate ``3 x rank_cost_max / (tflops x GPUs per replica)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..schedule import CostProfile, DPSchedule
from ..schedule.dp_schedule import StepStats
from ..schedule.config import LAYOUT_FLAGS
from ..schedule.stages import StageCosts
from .options import FWD_BWD_FACTOR, Setup


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def fmt_float(x: float | None, digits: int = 3) -> str:
    """Three significant digits (``1.23e+15`` for large numbers), ``-`` for ``None``."""
    if x is None:
        return "-"
    return f"{x:.{digits}g}"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


@dataclass(frozen=True)
class Column:
    header: str
    legend: str


def _columns(unit: str, piped: bool = False) -> list[Column]:
    pipeline = [
        Column(f"makespan_{unit}", "pipeline (pp > 1): the slowest replica's predicted makespan of megatron-core's "
                                   f"schedule (slime_ext.schedule.pipeline_model), in one stage's {unit} (see time:)"),
        Column("bubble", "... and that replica's bubble: 1 - one stage's work / makespan"),
    ] if piped else []
    return [
        Column("step", ""),
        Column("rollouts", ""),
        Column("samples", "samples trained in the step (the LR scheduler steps by this)"),
        Column("tokens", ""),
        Column("mbs/rank", "micro-batches per DP rank (the same on every rank)"),
        Column("target/rank", "micro-batches per rank the planner aimed for: the aligned token bound, raised where "
                             "packing needs more (packing_target / dp_size); a target, not a bound (--compare prints "
                             "the true lower bound)"),
        Column("util", "token utilisation: tokens / (micro-batches x cap); above 100% with oversize samples"),
        Column("largest", "tokens in the largest micro-batch (* above the cap: a single oversize sample, alone)"),
        Column("cap", "token cap per micro-batch (max_tokens_per_gpu x cp_size)"),
        Column(f"rank_{unit}_max", f"estimated {'forward FLOPs' if unit == 'FLOPs' else 'tokens'} summed per DP "
                                   f"rank: the slowest rank"),
        Column(f"rank_{unit}_mean", "... and the mean over ranks"),
        Column("imbal", "max/mean over ranks (1.00 is perfect)"),
        Column("imbal_lb", "no assignment can do better: max(1, largest sample / mean rank); in the all row, the "
                           "steps' bounds weighted by their mean rank"),
        *pipeline,
        Column("time_s", "estimated step time in seconds (see time: above)"),
    ]


def fmt_cost(x: float, tokens: bool) -> str:
    """Token sums exactly, FLOPs to three significant digits."""
    return str(round(x)) if tokens else fmt_float(x)


def fmt_largest(tokens: int, cap: int | None) -> str:
    """``*`` marks a micro-batch above the cap: legal only as a single oversize sample (see cap_violations)."""
    return f"{tokens}*" if cap is not None and tokens > cap else str(tokens)


def piped(schedule: DPSchedule) -> bool:
    """Whether the step times are pipeline makespans (pp > 1 and every step priced by the pipeline model)."""
    return schedule.parallel.pp_size > 1 and all(s.predicted_makespan is not None for s in schedule.stats)


def _step_time(s: StepStats, setup: Setup) -> float | None:
    if s.predicted_makespan is not None:
        return setup.makespan_seconds(s.predicted_makespan)
    return setup.step_seconds(s.rank_cost_max)


def _row(s: StepStats, dp: int, setup: Setup, piped: bool = False) -> list[str]:
    tok = setup.cost_model is None
    pipeline = [fmt_float(s.predicted_makespan), fmt_pct(s.bubble_fraction)] if piped else []
    return [
        str(s.step), str(s.num_rollouts), str(s.num_samples), str(s.total_tokens),
        str(s.num_microbatches), str(s.packing_target // dp), fmt_pct(s.token_utilization),
        fmt_largest(s.largest_bin_tokens, s.cap), "-" if s.cap is None else str(s.cap),
        fmt_cost(s.rank_cost_max, tok), fmt_cost(s.rank_cost_mean, tok), f"{s.flops_imbalance:.3f}",
        f"{s.balance_lower_bound:.3f}", *pipeline, fmt_float(_step_time(s, setup)),
    ]


def _total_time(stats: Sequence[StepStats], setup: Setup) -> float | None:
    times = [_step_time(s, setup) for s in stats]  # steps run one after another: their times add up
    return None if None in times else sum(times)  # type: ignore[arg-type]


def pooled_balance_bound(steps: Sequence[tuple[float, float]]) -> float:
    """The ``all`` row's ``imbal_lb`` from each step's ``(bound, mean rank cost)``: the steps' bounds weighted by
    their mean. A true bound on ``sum(max) / sum(mean)``: every step's slowest rank costs at least its bound times
    its mean, and the sums keep that (the largest step's bound alone would not: it can exceed the pooled ratio)."""
    total = sum(mean for _, mean in steps)
    return sum(bound * mean for bound, mean in steps) / total if total > 0 else 1.0


def _total_row(stats: Sequence[StepStats], dp: int, setup: Setup, piped: bool = False) -> list[str]:
    caps = {s.cap for s in stats}
    tokens = sum(s.total_tokens for s in stats)
    util = None
    if None not in caps:
        util = tokens / sum(s.total_microbatches * s.cap for s in stats)
    fmax = sum(s.rank_cost_max for s in stats)  # steps run one after another: slowest ranks add up
    fmean = sum(s.rank_cost_mean for s in stats)
    return [
        "all", str(sum(s.num_rollouts for s in stats)), str(sum(s.num_samples for s in stats)), str(tokens),
        str(sum(s.num_microbatches for s in stats)), str(sum(s.packing_target // dp for s in stats)),
        fmt_pct(util), fmt_largest(max(s.largest_bin_tokens for s in stats), min(caps, default=None)
                                   if None not in caps else None),
        "-" if None in caps else "/".join(map(str, sorted(caps))),
        fmt_cost(fmax, setup.cost_model is None), fmt_cost(fmean, setup.cost_model is None), f"{fmax / fmean if fmean else 1.0:.3f}",
        f"{pooled_balance_bound([(s.balance_lower_bound, s.rank_cost_mean) for s in stats]):.3f}",
        *([fmt_float(sum(s.predicted_makespan for s in stats)), "-"] if piped else []),
        fmt_float(_total_time(stats, setup)),
    ]


def render_table(rows: list[list[str]], headers: list[str], rule_before_last: bool = False) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])]
    for i, r in enumerate(rows):
        if rule_before_last and i == len(rows) - 1:
            out.append(line(["-" * w for w in widths]))
        out.append(line(r))
    return "\n".join(out)


def short_config(schedule: DPSchedule) -> str:
    """One line for figure titles: ``dp_size=8, cap 16384, global_batch_size=1024, balance_data``."""
    p, b = schedule.parallel, schedule.batch
    parts = [f"dp_size={p.dp_size}"]
    if p.cp_size > 1:
        parts.append(f"cp_size={p.cp_size}")
    if p.vpp_size > 1:
        parts.append(f"vpp_size={p.vpp_size} mb_group={p.microbatch_group_size_per_vp_stage}")
    parts.append(f"cap {schedule.cap}" if b.use_dynamic_batch_size else f"micro_batch_size={b.micro_batch_size}")
    parts.append("dynamic global batch" if b.use_dynamic_global_batch_size
                 else f"global_batch_size={b.global_batch_size}")
    parts += [f for f in ("balance_data", "balance_by_flops") if getattr(b, f)]
    return ", ".join(parts)


def header(schedule: DPSchedule, setup: Setup, source: str) -> str:
    p, b = schedule.parallel, schedule.batch
    kept = sum(schedule.samples_per_step)
    rollouts = len(set(schedule.rollout_ids)) if schedule.rollout_ids is not None else schedule.num_samples
    layout = f"dp_size={p.dp_size} cp_size={p.cp_size} pp_size={p.pp_size} vpp_size={p.vpp_size}"
    if p.vpp_size > 1:
        layout += f" microbatch_group_size_per_vp_stage={p.microbatch_group_size_per_vp_stage}"
    layout += f" (micro-batch count aligned to {p.align})"
    if b.use_dynamic_batch_size:
        packing = f"dynamic batch: cap {schedule.cap} tokens per micro-batch (max_tokens_per_gpu={b.max_tokens_per_gpu})"
    else:
        packing = f"static batch: micro_batch_size={b.micro_batch_size}"
    steps = ("use_dynamic_global_batch_size (one step)" if b.use_dynamic_global_batch_size
             else f"global_batch_size={b.global_batch_size} rollouts per step")
    flags = [f for f in ("balance_data", "balance_by_flops", "disable_rollout_trim_samples") if getattr(b, f)]
    lines = [
        f"input: {source}: {schedule.num_samples} samples in {rollouts} rollouts, "
        f"{sum(schedule.total_lengths)} tokens; {kept} samples scheduled in {plural(schedule.num_steps, 'step')}",
        f"layout: {layout}",
        f"batch: {packing}; {steps}" + (f"; {' '.join(flags)}" if flags else ""),
    ]
    if schedule.cost_model is None:
        lines.append("cost: tokens (no model dims: pass --hidden-size --num-layers --num-attention-heads ... "
                     "for FLOPs and a step-time estimate)")
    elif isinstance(schedule.cost_model, CostProfile):
        prof = schedule.cost_model
        lines.append(f"cost: measured profile (seconds; the FLOPs columns hold seconds) = {prof.per_token_s:.3g} x L + "
                     f"{prof.per_sample_quadratic_s + prof.packed_quadratic_s:.3g} x L^2 per sample of L tokens, "
                     f"+ {prof.microbatch_overhead_s:.3g} per micro-batch; measured on "
                     f"{prof.meta.get('device', '?')}")
        lines.append("time: time_s = the predicted pipeline makespan (seconds)" if piped(schedule) else
                     "time: time_s = the slowest rank's per-sample seconds (micro-batch and step overheads excluded)")
    else:
        lin, quad = schedule.cost_model.coefficients()
        lines.append(f"cost: forward FLOPs = {lin:.3g} x L + {quad:.3g} x L^2 per sample of L tokens")
        if piped(schedule):
            lines.append(f"time: time_s = the predicted pipeline makespan (per-stage forward FLOPs, backward 2x) / "
                         f"({setup.tflops:g} TFLOP/s x {setup.gpus_per_replica // p.pp_size} GPUs per stage = tp*cp)")
        else:
            lines.append(f"time: time_s = {FWD_BWD_FACTOR:g} (fwd+bwd) x FLOPs max/rank / ({setup.tflops:g} TFLOP/s "
                         f"x {setup.gpus_per_replica} GPUs per replica = tp*pp*cp); no pipeline bubble or "
                         f"communication")
    if piped(schedule):
        spec = f"pp_size={p.pp_size}" + (f" vpp_size={p.vpp_size} ({'overlapped' if p.overlap_p2p_comm else 'batched'}"
                                         f" p2p)" if p.vpp_size > 1 else "")
        lines.append(f"pipeline: {spec}; micro-batch order and count chosen by the predicted makespan of the "
                     f"slowest replica (megatron-core's {'interleaved' if p.vpp_size > 1 else '1F1B'} schedule)")
        lines.append(stages_line(schedule))
    return "\n".join(lines)


def stages_line(schedule: DPSchedule) -> str:
    """Each pipeline stage's share of a micro-batch's forward cost (per token), from the layout flags and the cost
    model (:class:`slime_ext.schedule.stages.StageCosts`)."""
    p = schedule.parallel
    costs = StageCosts.from_model(schedule.cost_model, p)
    flags = [f"{k}={getattr(p, k)}" for k in LAYOUT_FLAGS if getattr(p, k) not in (None, False)]
    shares = " ".join(f"{x:.3f}" for x in costs.linear_share)
    return (f"stages: forward cost share per pipeline stage {shares} ({costs.basis}"
            + (f"; {' '.join(flags)}" if flags else "; layers split evenly") + ")")


def step_table(schedule: DPSchedule, setup: Setup) -> str:
    pipe = piped(schedule)
    cols = _columns(schedule.cost_unit, pipe)
    dp = schedule.dp_size
    rows = [_row(s, dp, setup, pipe) for s in schedule.stats]
    rows.append(_total_row(schedule.stats, dp, setup, pipe))
    return render_table(rows, [c.header for c in cols], rule_before_last=True)


def legend(schedule: DPSchedule) -> str:
    cols = _columns(schedule.cost_unit, piped(schedule))
    width = max(len(c.header) for c in cols if c.legend)
    return "\n".join(f"  {c.header.ljust(width)}  {c.legend}" for c in cols if c.legend)


def summary(schedule: DPSchedule, setup: Setup) -> str:
    """The one-line total: what was trained, what was dropped, micro-batches vs bound, time."""
    stats = schedule.stats
    dp = schedule.dp_size
    kept = sum(schedule.samples_per_step)
    mbs = sum(schedule.num_microbatches)
    bound = sum(s.packing_target // dp for s in stats)
    if schedule.dropped:
        rids = schedule.rollout_ids
        n_roll = len({rids[i] for i in schedule.dropped}) if rids is not None else len(schedule.dropped)
        dropped = (f"{len(schedule.dropped)} dropped ({plural(n_roll, 'trailing rollout')} that do not fill a step; "
                   f"--disable-rollout-trim-samples makes this an error)")
    else:
        dropped = "0 dropped"
    fmax = sum(s.rank_cost_max for s in stats)
    t = _total_time(stats, setup)
    over = sum(s.cap_violations for s in stats)
    parts = [
        f"total: {plural(schedule.num_steps, 'step')}, {kept} samples trained, {dropped}",
        f"{mbs} micro-batches per rank (target {bound}{', +%d' % (mbs - bound) if mbs > bound else ''})",
        f"{schedule.cost_unit} max/mean {fmax / max(1e-300, sum(s.rank_cost_mean for s in stats)):.3f}",
    ]
    if t is not None:
        parts.append(f"est. {fmt_float(t)} s")
    if over:
        parts.append(f"WARNING: {over} micro-batches above the cap")
    return ", ".join(parts)


def report(schedule: DPSchedule, setup: Setup, source: str, with_legend: bool = True) -> str:
    parts = [header(schedule, setup, source), "", step_table(schedule, setup), summary(schedule, setup)]
    if with_legend:
        parts += ["", legend(schedule)]
    return "\n".join(parts)
