"""``slime-ext plan --plot out.png``: per step, one stacked bar per DP rank, one segment per micro-batch.

Segment height is the micro-batch's tokens or estimated forward FLOPs (``--plot-metric``). Tokens mode draws the
rank's token capacity (``cap x micro-batches per rank``; the bar's height over it is the utilisation); both modes
draw the mean over ranks (a bar above it is the step's straggler). matplotlib is imported here only, lazily, and
only through its object API (``Figure`` + the Agg canvas: no pyplot, no global backend switch).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..schedule import DPSchedule
from .errors import CLIError

#: steps plotted when ``--plot-steps`` is not given
DEFAULT_MAX_STEPS = 8


def require_matplotlib() -> None:
    """Fail early (before planning) with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        raise CLIError("--plot needs matplotlib, which is not installed: pip install 'slime-ext[plot]' "
                       "(or pip install matplotlib)") from None


def parse_steps(spec: str | None, num_steps: int) -> tuple[list[int], bool]:
    """``(steps to plot, truncated)`` from ``all`` / ``0,2,5-7`` / ``None`` (the first :data:`DEFAULT_MAX_STEPS`)."""
    if spec is None:
        return list(range(min(num_steps, DEFAULT_MAX_STEPS))), num_steps > DEFAULT_MAX_STEPS
    if spec.strip() == "all":
        return list(range(num_steps)), False
    steps: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise CLIError(f"--plot-steps {spec!r}: {part!r} is not a step number or a range like 2-5") from None
        if not 0 <= a <= b < num_steps:
            raise CLIError(f"--plot-steps {spec!r}: {part!r} is outside the schedule's steps 0..{num_steps - 1}")
        steps.extend(s for s in range(a, b + 1) if s not in steps)
    if not steps:
        raise CLIError(f"--plot-steps {spec!r}: no steps; give e.g. 0,2-3 or all")
    return steps, False


def microbatch_loads(schedule: DPSchedule, step: int, metric: str) -> np.ndarray:
    """``loads[r, k]``: tokens or forward FLOPs of rank ``r``'s micro-batch ``k`` in ``step``."""
    lengths = np.asarray(schedule.total_lengths, dtype=np.float64)
    weights = lengths if metric == "tokens" else schedule.cost_model.flops(lengths)
    lo, hi = schedule.step_bounds()[step]
    loads = np.zeros((schedule.dp_size, hi - lo))
    for r in range(schedule.dp_size):
        part = np.asarray(schedule.partitions[r], dtype=np.int64)
        for k, mb in enumerate(schedule.micro_batch_indices[r][lo:hi]):
            loads[r, k] = weights[part[mb]].sum()
    return loads


def _draw_step(ax, schedule: DPSchedule, step: int, metric: str, label: str | None) -> None:
    loads = microbatch_loads(schedule, step, metric)
    dp, m = loads.shape
    x = np.arange(dp)
    bottoms = np.zeros(dp)
    colors = [f"C{i}" for i in range(10)]
    edge = 0.4 if dp <= 64 else 0.0
    for k in range(m):
        ax.bar(x, loads[:, k], bottom=bottoms, width=0.85, color=colors[k % len(colors)], edgecolor="white",
               linewidth=edge)
        bottoms += loads[:, k]
    totals = loads.sum(axis=1)
    top = totals.max()
    ax.axhline(totals.mean(), color="black", linestyle=":", linewidth=1.0, label="mean over ranks")
    st = schedule.stats[step]
    title = f"step {step}: {m} mbs/rank, max/mean {totals.max() / totals.mean():.3f}"
    if metric == "tokens" and schedule.cap is not None:
        ax.axhline(m * schedule.cap, color="crimson", linestyle="--", linewidth=1.2,
                   label="rank capacity = cap x mbs/rank")
        title += f", util {100 * st.token_utilization:.1f}%"
        top = max(top, m * schedule.cap)
    ax.set_ylim(0, 1.06 * top)
    if label:
        title = f"{label} | {title}"
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("DP rank", fontsize=8)
    ax.set_ylabel("tokens" if metric == "tokens" else "forward FLOPs (est.)", fontsize=8)
    if dp <= 16:
        ax.set_xticks(x)
    ax.tick_params(labelsize=7)
    ax.set_xlim(-0.6, dp - 0.4)


def plot_schedules(path: str, panels: Sequence[tuple[str | None, DPSchedule]], metric: str,
                   steps: Sequence[int], title: str) -> None:
    """Write the figure: a grid of steps for one schedule, or one row per schedule when comparing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells = [(label, sched, s) for label, sched in panels for s in steps]
    if len(panels) == 1:
        ncols = min(4, len(steps))
        nrows = math.ceil(len(steps) / ncols)
    else:
        nrows, ncols = len(panels), len(steps)
    fig = Figure(figsize=(4.6 * ncols, 3.4 * nrows + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, (label, sched, s) in zip(axes.flat, cells):
        _draw_step(ax, sched, s, metric, label)
    for ax in list(axes.flat)[len(cells):]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"{title}\none bar per DP rank, one segment per micro-batch", fontsize=10)
    try:
        fig.savefig(path, dpi=110, format="png")
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror or e}") from None
