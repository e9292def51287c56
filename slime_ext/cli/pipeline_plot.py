"""``slime-ext plan --plot-pipeline out.png``: the usual pipeline picture of one step.

One row per pipeline stage, one box per forward (light) and backward (dark) of each micro-batch, labelled with the
micro-batch's position in the step, drawn from :func:`slime_ext.schedule.pipeline_model.pipeline_timeline` for the
replica whose predicted makespan is the longest. With ``--compare``, each scheme gets a panel under ours, on one
shared time axis, so the bubbles compare directly. matplotlib is imported lazily, object API only (as in
:mod:`slime_ext.cli.plot`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..schedule import DPSchedule
from ..schedule.pipeline_model import pipeline_timeline
from ..schedule.pipeline_pricing import PipelinePricing, pipeline_pricing, step_microbatch_costs
from .errors import CLIError


class _Priced:
    """A baseline's micro-batches over ``schedule``'s samples, with its cost model and lengths: what
    :func:`step_microbatch_costs` reads."""

    def __init__(self, schedule: DPSchedule, view) -> None:
        self.total_lengths, self.cost_model = schedule.total_lengths, schedule.cost_model
        self.partitions, self.micro_batch_indices = view.partitions, view.micro_batch_indices
        self.num_microbatches, self.dp_size = list(view.num_microbatches), len(view.partitions)


def _draw(ax, timeline: Sequence[Sequence[tuple]], label: str, span: float, unit: str) -> None:
    pp = len(timeline)
    for stage, ops in enumerate(timeline):
        y = pp - 1 - stage  # stage 0 on top, as Megatron's figures draw it
        for kind, mb, chunk, start, end in ops:
            color = f"C{mb % 10}"
            ax.broken_barh([(start, end - start)], (y + 0.08, 0.84), facecolors=color,
                           alpha=0.45 if kind == "F" else 0.95, edgecolor="white", linewidth=0.5)
            if end - start > span / 60:
                ax.text((start + end) / 2, y + 0.5, f"{kind}{mb}" + (f".{chunk}" if chunk else ""), ha="center",
                        va="center", fontsize=6, color="black" if kind == "F" else "white")
    ax.set_yticks([pp - 1 - s + 0.5 for s in range(pp)], [f"stage {s}" for s in range(pp)], fontsize=7)
    ax.set_ylim(0, pp)
    ax.set_title(label, fontsize=9, loc="left")
    ax.set_xlabel(unit, fontsize=8)
    ax.tick_params(labelsize=7)


def plot_pipelines(path: str, schedule: DPSchedule, panels: Sequence[tuple[str, object]], step: int,
                   pricing: PipelinePricing, title: str) -> list[str]:
    """Write the figure; returns one line per panel (scheme, slowest replica, makespan, bubble) for the terminal.

    ``panels``: ``(label, view)`` pairs over ``schedule``'s samples (``view``: anything with ``partitions``,
    ``micro_batch_indices`` and ``num_microbatches``), every one priced by ``pricing``, the planner's own
    (:func:`slime_ext.schedule.pipeline_pricing.pipeline_pricing`).
    """
    spec, unit = pricing.spec, pricing.units
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    drawn, lines = [], []
    for label, view in panels:
        if step >= len(view.num_microbatches):
            lines.append(f"{label}: no step {step} (it planned {len(view.num_microbatches)})")
            continue
        view_of = _Priced(schedule, view)
        try:
            costs = step_microbatch_costs(view_of, step)
            fwd, bwd = pricing.stage_costs(costs)
            spans = pricing.makespans(costs)
        except ValueError as e:  # a count megatron-core would refuse for this layout (e.g. a baseline's)
            lines.append(f"{label}: cannot run step {step} on this pipeline: {e}")
            continue
        rank = int(np.argmax(spans))
        one = slice(rank, rank + 1) if fwd.ndim == 3 else rank  # per-stage costs stay (1, stages, M)
        timeline = pipeline_timeline(fwd[one], bwd[one], spec)
        bubble = pricing.bubble(costs[rank])
        text = (f"{label}: step {step}, slowest replica = DP rank {rank}, {costs.shape[1]} micro-batches, "
                f"makespan {spans[rank]:.4g} {unit}, bubble {100 * bubble:.1f}%")
        drawn.append((text, timeline, float(spans[rank])))
        lines.append(text)
    if not drawn:
        raise CLIError(f"--plot-pipeline: no scheme has a step {step} that runs on this pipeline")
    span = max(d[2] for d in drawn)
    fig = Figure(figsize=(12, 0.45 * spec.pp_size * len(drawn) + 1.4 * len(drawn) + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(drawn), 1, squeeze=False, sharex=True)[:, 0]
    for ax, (text, timeline, _) in zip(axes, drawn):
        _draw(ax, timeline, text, span, unit)
        ax.set_xlim(0, span * 1.01)
    layout = f"pp={spec.pp_size}" + (f" vpp={spec.vpp_size} group={spec.group}" if spec.vpp_size > 1 else "")
    fig.suptitle(f"{title}\n{layout}: one row per stage; F light, B dark; label = micro-batch (.chunk)",
                 fontsize=10)
    try:
        fig.savefig(path, dpi=110, format="png")
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror or e}") from None
    return lines


def step_makespans(schedule: DPSchedule, view) -> list[float]:
    """``view``'s predicted pipeline makespan per step (its slowest replica), priced as the planner prices ours
    (``schedule``'s pricing, in :attr:`PipelinePricing.units`). Raises ValueError where a step's micro-batch count
    is one megatron-core would refuse on this pipeline."""
    pricing = pipeline_pricing(schedule.parallel, schedule.cost_model, schedule.cap)
    priced = _Priced(schedule, view)
    return [float(pricing.makespans(step_microbatch_costs(priced, s)).max())
            for s in range(len(priced.num_microbatches))]
