"""``slime-ext plan --plot-pipeline out.png``: the usual pipeline picture of one step.

One row per pipeline stage, one box per forward (light) and backward (dark) of each micro-batch, labelled with the
micro-batch's position in the step, drawn from :func:`slime_ext.schedule.pipeline.pipeline_timeline` for the
replica whose predicted makespan is the longest. With ``--compare``, each scheme gets a panel under ours, on one
shared time axis, so the bubbles compare directly. matplotlib is imported lazily, object API only (as in
:mod:`slime_ext.cli.plot`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..schedule.pipeline import PipelineSpec, pipeline_makespan, pipeline_timeline
from .errors import CLIError
from .plot import microbatch_loads


def replica_stage_costs(view, step: int, weights: np.ndarray, pp_size: int, backward_forward_ratio: float):
    """``(fwd, bwd)``, each ``(dp, M)``: per-stage seconds (or cost units) of every rank's micro-batches of
    ``step`` in the order they run. A micro-batch's forward is its summed cost split evenly over the stages."""
    fwd = microbatch_loads(view, step, weights) / pp_size
    return fwd, backward_forward_ratio * fwd


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


def plot_pipelines(path: str, panels: Sequence[tuple[str, object]], step: int, weights: np.ndarray,
                   spec: PipelineSpec, backward_forward_ratio: float, unit: str, title: str) -> list[str]:
    """Write the figure; returns one line per panel (scheme, slowest replica, makespan, bubble) for the terminal.

    ``panels``: ``(label, view)`` pairs over the same samples (``view``: anything with ``partitions``,
    ``micro_batch_indices`` and ``num_microbatches``); ``weights``: each sample's forward cost through the whole
    model (seconds with a measured profile, else estimated FLOPs or tokens).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    drawn, lines = [], []
    for label, view in panels:
        if step >= len(view.num_microbatches):
            lines.append(f"{label}: no step {step} (it planned {len(view.num_microbatches)})")
            continue
        fwd, bwd = replica_stage_costs(view, step, weights, spec.pp_size, backward_forward_ratio)
        try:
            spans = np.atleast_1d(pipeline_makespan(fwd, bwd, spec))
        except ValueError as e:  # a count megatron-core would refuse for this layout (e.g. a baseline's)
            lines.append(f"{label}: cannot run step {step} on this pipeline: {e}")
            continue
        rank = int(np.argmax(spans))
        timeline = pipeline_timeline(fwd[rank], bwd[rank], spec)
        work = float(fwd[rank].sum() + bwd[rank].sum())
        bubble = 1.0 - work / spans[rank] if spans[rank] > 0 else 0.0
        text = (f"{label}: step {step}, slowest replica = DP rank {rank}, {fwd.shape[1]} micro-batches, "
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


# TODO(merge): these two move to the planner's single definition once i-pipe's planner lands
def pipeline_spec(parallel, cost_model) -> PipelineSpec:
    return PipelineSpec(parallel.pp_size, parallel.vpp_size, parallel.microbatch_group_size_per_vp_stage,
                        p2p_s=float(getattr(cost_model, "p2p_s", 0.0)))


def backward_forward_ratio(cost_model) -> float:
    return float(getattr(cost_model, "backward_forward_ratio", 2.0))
