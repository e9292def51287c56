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
        raise CLIError("--plot needs matplotlib, which is not installed: pip install matplotlib (or, from a clone "
                       "of slime-ext, pip install \"./slime-ext[plot]\")") from None


def step_spec(spec: str) -> list[int]:
    """The steps ``--plot-steps 0,2,5-7`` names, in order, checked before planning (the schedule's step count is
    checked by :func:`parse_steps` once it is known)."""
    steps: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise CLIError(f"--plot-steps {spec!r}: {part!r} is not a step number or a range like 2-5") from None
        if a < 0:
            raise CLIError(f"--plot-steps {spec!r}: {part!r}: steps count from 0")
        if a > b:
            raise CLIError(f"--plot-steps {spec!r}: {part!r} is a reversed range; write it low-high: {b}-{a}")
        steps.extend(s for s in range(a, b + 1) if s not in steps)
    if not steps:
        raise CLIError(f"--plot-steps {spec!r}: no steps; give e.g. 0,2-3 or all")
    return steps


def parse_steps(spec: str | None, num_steps: int) -> tuple[list[int], bool]:
    """``(steps to plot, truncated)`` from ``all`` / ``0,2,5-7`` / ``None`` (the first :data:`DEFAULT_MAX_STEPS`)."""
    if spec is None:
        return list(range(min(num_steps, DEFAULT_MAX_STEPS))), num_steps > DEFAULT_MAX_STEPS
    if spec.strip() == "all":
        return list(range(num_steps)), False
    steps = step_spec(spec)
    outside = [s for s in steps if s >= num_steps]
    if outside:
        raise CLIError(f"--plot-steps {spec!r}: step {outside[0]} is outside the schedule's steps 0..{num_steps - 1}")
    return steps, False


def microbatch_loads(view, step: int, weights: np.ndarray) -> np.ndarray:
    """``loads[r, k]``: summed ``weights`` of rank ``r``'s micro-batch ``k`` in ``step``.

    ``view`` is anything with ``partitions``, ``micro_batch_indices`` and ``num_microbatches`` (a ``DPSchedule``
    or a baseline's schedule).
    """
    counts = list(view.num_microbatches)
    lo = sum(counts[:step])
    m = counts[step]
    dp = len(view.partitions)
    loads = np.zeros((dp, m))
    for r in range(dp):
        part = np.asarray(view.partitions[r], dtype=np.int64)
        for k, mb in enumerate(view.micro_batch_indices[r][lo:lo + m]):
            loads[r, k] = weights[part[mb]].sum()
    return loads


def _draw_step(ax, view, step: int, lengths: np.ndarray, weights: np.ndarray, cap: int | None, metric: str,
               label: str | None) -> float:
    """Draw one step of one scheme; returns the height the y axis must reach."""
    loads = microbatch_loads(view, step, weights)
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
    title = f"{m} mbs/rank, {metric if metric == 'tokens' else 'FLOPs'} max/mean {totals.max() / totals.mean():.3f}"
    if cap is not None:
        tokens = loads if metric == "tokens" else microbatch_loads(view, step, lengths)
        title += f", util {100 * tokens.sum() / (tokens.size * cap):.1f}%"
        over = int(np.count_nonzero((tokens > cap) & (microbatch_loads(view, step, np.ones_like(lengths)) > 1)))
        if over:
            title += f"\n{over} micro-batches of several samples above the cap"
        if metric == "tokens":
            ax.axhline(m * cap, color="crimson", linestyle="--", linewidth=1.2,
                       label="rank capacity = cap x mbs/rank")
            top = max(top, m * cap)
    ax.set_title(f"{label + ', ' if label else ''}step {step}\n{title}", fontsize=9)
    ax.set_xlabel("DP rank", fontsize=8)
    ax.set_ylabel("tokens" if metric == "tokens" else "forward FLOPs (est.)", fontsize=8)
    if dp <= 16:
        ax.set_xticks(x)
    ax.tick_params(labelsize=7)
    ax.set_xlim(-0.6, dp - 0.4)
    return float(top)


def plot_schedules(path: str, schedule: DPSchedule, panels: Sequence[tuple[str | None, object]], metric: str,
                   steps: Sequence[int], title: str) -> None:
    """Write the figure: a grid of steps for one schedule, or one row per scheme when comparing.

    ``schedule`` gives the lengths, the cost model and the cap; ``panels`` the ``(label, view)`` pairs to draw
    (``view``: a ``DPSchedule`` or a baseline's schedule over the same samples).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lengths = np.asarray(schedule.total_lengths, dtype=np.float64)
    weights = lengths if metric == "tokens" else schedule.cost_model.flops(lengths)
    if len(panels) == 1:
        ncols = min(4, len(steps))
        nrows = math.ceil(len(steps) / ncols)
        where = lambda row, col: divmod(col, ncols)  # noqa: E731 -- one schedule: steps wrap over a grid
    else:
        nrows, ncols = len(panels), len(steps)
        where = lambda row, col: (row, col)  # noqa: E731 -- one row per scheme, one column per step
    fig = Figure(figsize=(4.6 * ncols, 3.6 * nrows + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    # comparing: the schemes of one step share the y axis, so bar heights compare across rows
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey="col" if len(panels) > 1 else False)
    used, col_top = [], {}
    for row, (label, view) in enumerate(panels):
        for col, s in enumerate(steps):
            if s < len(view.num_microbatches):  # a baseline may plan fewer steps
                ax = axes[where(row, col)]
                top = _draw_step(ax, view, s, lengths, weights, schedule.cap, metric, label)
                ax.set_ylim(0, 1.06 * top)
                col_top[col] = max(col_top.get(col, 0.0), top)
                used.append(ax)
    if len(panels) > 1:
        for col, top in col_top.items():
            axes[0, col].set_ylim(0, 1.06 * top)  # shared by the column
    for ax in axes.flat:
        if ax not in used:
            ax.set_visible(False)
    handles, labels = used[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"{title}\none bar per DP rank, one segment per micro-batch", fontsize=10)
    try:
        fig.savefig(path, dpi=110, format="png")
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror or e}") from None
