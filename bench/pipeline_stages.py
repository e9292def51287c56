"""Uneven pipeline stages: the pipeline model's per-stage costs against megatron-core's own schedule (issue 22.3).

    python -m bench.pipeline_stages            # pp 4 (even, first 1.3x, last 1.3x / 1.6x, both, Qwen3-8B split)
                                               # and pp 2 x vpp 2 (overlapped p2p, per virtual stage); ~2 min
    python -m bench.pipeline_stages --quick    # smoke run: pp 2, two cases, one repeat (CI)

**Runs.** One rollout of rl-like samples (:mod:`bench.workloads`, 256 samples, ``dp = 8``, cap 16384,
``balance_data``) planned by ``plan_schedule`` for the layout; the slowest replica's micro-batches (their
forward costs ``f[m]`` as :mod:`bench.pipeline` prices them: Qwen3-8B-like FLOPs plus 2% of a full micro-batch,
backward ``2 f[m]``) become per-stage costs ``w[s] f[m]``: every stage alike (``w = 1``, the reference, as
``bench.pipeline``), a first stage 1.3x heavier, a last stage 1.3x and 1.6x heavier, both, and the split
:class:`slime_ext.schedule.stages.StageCosts` derives for Qwen3-8B-like dims (36 layers: the last stage carries
the output layer, ``2 h vocab`` per token). Under VPP the costs are per virtual stage (``chunk * pp + rank``), the
heavier pieces on the first and last chunk.

**Replay** (:mod:`bench.pipeline_replay`): one process per stage runs megatron-core's real
``get_forward_backward_func()`` over gloo; each model chunk sleeps its own per-stage time. The costs are scaled so
that the shortest sleep lasts ``--min-op-ms`` (unless the longest run would pass ``--max-run-s``). Every run is
repeated until its two fastest calls agree within 0.5% (at most 4x ``--repeats``); the measured makespan is the
fastest call.

**Reordered**: each uneven case also replays the same micro-batches in an order chosen for its stage costs
(:func:`order_for_stages`: from the plan's order -- chosen for even stages -- the best swap of two micro-batches by
the per-stage model, until none improves it), what a planner given per-stage costs could gain by the order alone.

**Prediction**: :func:`slime_ext.schedule.pipeline_model.pipeline_makespan` on the per-stage costs ``(1, stages, M)``, with
``p2p_s`` fitted once per layout on a uniform run (as ``bench.pipeline``); ``as even`` is the same model told every
stage costs the stages' mean (what a model without per-stage costs predicts). Target (PASS/FAIL, not asserted in
tests): the model within 3% of the replay on every uneven case.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

from bench.pipeline import (DP_SIZE, MAX_REPEATS_FACTOR, NOISE, Setup, bench_profile, parallel_for,
                            calibration_run, fit_p2p, plan_ours, spec_for)
from bench.pipeline_costs import stage_costs
from bench.pipeline_replay import Layout, ReplayRun, replay_job
from bench.runner import parser, target
from bench.workloads import MODEL_DIMS, REPLAY_WORKLOADS, make_lengths

TARGET = 0.03


@dataclass
class Case:
    """One replay: a label and per-stage (or per-virtual-stage) weights on the slowest replica's costs."""

    label: str
    weights: np.ndarray  # (stages,)
    run: ReplayRun | None = None
    measured: list[float] = field(default_factory=list)
    predicted: float = float("nan")
    predicted_p2p0: float = float("nan")
    predicted_even: float = float("nan")
    #: the same micro-batches in an order chosen for these stage costs (:func:`order_for_stages`)
    reordered: ReplayRun | None = None
    reordered_measured: list[float] = field(default_factory=list)
    reordered_predicted: float = float("nan")

    @property
    def best(self) -> float:
        return min(self.measured)

    @property
    def error(self) -> float:
        return self.predicted / self.best - 1


def qwen3_weights(layout: Layout) -> np.ndarray:
    """Per-stage (per virtual stage under VPP) weights of the FLOPs split :class:`StageCosts` derives for the
    bench's Qwen3-8B-like dims (linear term: what dominates at these lengths), relative to the mean stage."""
    from slime_ext.schedule import CostModel, ParallelConfig
    from slime_ext.schedule.stages import StageCosts

    parallel = ParallelConfig(dp_size=1, pp_size=layout.pp, vpp_size=layout.vpp,
                              microbatch_group_size_per_vp_stage=layout.pp if layout.vpp > 1 else None)
    costs = StageCosts.from_model(CostModel(**MODEL_DIMS), parallel)
    w = np.asarray(costs.virtual_linear if layout.vpp > 1 else costs.linear)
    return w / w.mean()


def cases_for(layout: Layout, quick: bool) -> list[Case]:
    stages = layout.pp * layout.vpp

    def w(first: float = 1.0, last: float = 1.0) -> np.ndarray:
        out = np.ones(stages)
        out[0], out[-1] = first, last
        return out

    if quick:
        return [Case("even", w()), Case("last 1.5x", w(last=1.5))]
    out = [Case("even", w()), Case("first 1.3x", w(first=1.3)), Case("last 1.3x", w(last=1.3)),
           Case("last 1.6x", w(last=1.6)), Case("first 1.3x, last 1.5x", w(1.3, 1.5))]
    out.append(Case("Qwen3-8B split", qwen3_weights(layout)))
    return out


def slowest_replica(setup: Setup, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward cost (units) of each micro-batch of the pipeline-aware plan's slowest replica, in
    run order, every stage alike."""
    from slime_ext.schedule.pipeline_model import pipeline_makespan

    wl = REPLAY_WORKLOADS["rl-like"]
    lengths = make_lengths(wl.dist, n, wl.seed)
    profile = bench_profile()
    plan = plan_ours(lengths, setup, profile, True)
    costs = [stage_costs(profile, mbs, parallel_for(setup)) for mbs in plan.ranks]
    f, b = np.stack([c[0] for c in costs]), np.stack([c[1] for c in costs])
    r = int(np.argmax(pipeline_makespan(f, b, spec_for(setup))))
    return f[r], b[r]


def order_for_stages(fw: np.ndarray, bw: np.ndarray, spec, max_rounds: int = 100) -> np.ndarray:
    """A run order of the micro-batches for per-stage costs ``(stages, M)``: from the given order, the best swap of
    two micro-batches by the pipeline model (every swap priced in one vectorised call) until none improves it."""
    from slime_ext.schedule.pipeline_model import pipeline_makespan

    m = fw.shape[1]
    order = np.arange(m)
    pairs = np.array([(i, j) for i in range(m) for j in range(i + 1, m)])
    best = float(pipeline_makespan(fw[None], bw[None], spec)[0])
    for _ in range(max_rounds):
        if not len(pairs):
            break
        cand = np.repeat(order[None], len(pairs), axis=0)
        rows = np.arange(len(pairs))
        cand[rows, pairs[:, 0]], cand[rows, pairs[:, 1]] = order[pairs[:, 1]], order[pairs[:, 0]]
        spans = pipeline_makespan(fw[:, cand].transpose(1, 0, 2), bw[:, cand].transpose(1, 0, 2), spec)
        k = int(np.argmin(spans))
        if spans[k] >= best * (1 - 1e-9):
            break
        best, order = float(spans[k]), cand[k]
    return order


def build_runs(setup: Setup, cases: list[Case], f: np.ndarray, b: np.ndarray, min_op_s: float,
               max_run_s: float) -> float:
    """Fill each case's run (seconds); returns the scale (seconds per unit)."""
    from slime_ext.schedule.pipeline_model import pipeline_makespan

    lay = setup.layout

    def sleep_share(c: Case) -> int:  # per-stage rows are split over a rank's chunks, per-virtual-stage rows not
        return lay.vpp if len(c.weights) == lay.pp else 1

    smallest = min(float(c.weights.min() * f.min()) / sleep_share(c) for c in cases)
    longest = max(float(pipeline_makespan(c.weights[None, :, None] * f[None, None],
                                          c.weights[None, :, None] * b[None, None], spec_for(setup))[0])
                  for c in cases)
    scale = min(min_op_s / smallest, max_run_s / longest)
    for c in cases:
        fw, bw = c.weights[:, None] * f[None] * scale, c.weights[:, None] * b[None] * scale
        c.run = ReplayRun(f"{setup.name}/{c.label}", fw, bw, setup.overlap_p2p_comm)
        if np.ptp(c.weights) > 0:
            order = order_for_stages(fw, bw, spec_for(setup))
            if (order != np.arange(len(order))).any():
                c.reordered = ReplayRun(f"{setup.name}/{c.label}/reordered", fw[:, order], bw[:, order],
                                        setup.overlap_p2p_comm)
    return scale


def replay(setup: Setup, runs: list[ReplayRun], repeats: int, timeout: float) -> list[list[float]]:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests" / "e2e"))
    from train_harness import launch, rendezvous

    pp = setup.layout.pp
    with rendezvous() as port:
        results = launch([(replay_job, (rank, pp, port, setup.layout, runs, repeats, MAX_REPEATS_FACTOR * repeats,
                                        NOISE)) for rank in range(pp)], timeout=timeout)
    return [r.makespans for r in results[0]]


def measure(setup: Setup, cases: list[Case], repeats: int, min_op_s: float) -> float:
    """Replay the calibration run and every case; fill the predictions. Returns the fitted ``p2p_s``."""
    from slime_ext.schedule.pipeline_model import pipeline_makespan

    calib = calibration_run(setup, min_op_s)
    reordered = [c for c in cases if c.reordered is not None]
    runs = [calib] + [c.run for c in cases] + [c.reordered for c in reordered]
    budget = sum(float(np.max(pipeline_makespan(*r.model_costs(), spec_for(setup)))) for r in runs)
    t0 = time.perf_counter()
    spans = replay(setup, runs, repeats, timeout=120 + 3 * (MAX_REPEATS_FACTOR * repeats + 1) * budget)
    p2p = fit_p2p(calib.fwd, calib.bwd, lambda x: spec_for(setup, x), min(spans[0]))
    for c, s in zip(reordered, spans[1 + len(cases):]):
        c.reordered_measured = s
        c.reordered_predicted = float(pipeline_makespan(*c.reordered.model_costs(), spec_for(setup, p2p))[0])
    for c, s in zip(cases, spans[1:]):
        c.measured = s
        fw, bw = c.run.model_costs()
        c.predicted = float(pipeline_makespan(fw, bw, spec_for(setup, p2p))[0])
        c.predicted_p2p0 = float(pipeline_makespan(fw, bw, spec_for(setup, 0.0))[0])
        # what a model without per-stage costs predicts: every stage at the stages' mean
        stages = fw.shape[1]
        mean_f = fw[0].mean(axis=0) * (setup.layout.vpp if stages > setup.layout.pp else 1)
        mean_b = bw[0].mean(axis=0) * (setup.layout.vpp if stages > setup.layout.pp else 1)
        c.predicted_even = float(pipeline_makespan(mean_f, mean_b, spec_for(setup, p2p)))
    print(f"  replayed {setup.name}: {len(runs)} runs, {sum(map(len, spans)) + 1} calls in "
          f"{time.perf_counter() - t0:.1f}s; p2p_s fitted on the uniform run: {p2p * 1e3:.2f} ms", flush=True)
    return p2p


def table(setup: Setup, cases: list[Case], num_microbatches: int) -> list[str]:
    out = ["| layout | case | stage weights | #mb | predicted s | p2p=0 s | as even s | measured s | calls "
           "| model err | as-even err | reordered predicted s | reordered measured s | reordered err | gain |", "|" + "---|" * 15]
    for c in cases:
        weights = " ".join(f"{x:.2f}" for x in c.weights)
        line = (f"| {setup.name} | {c.label} | {weights} | {num_microbatches} | {c.predicted:.3f} | "
                f"{c.predicted_p2p0:.3f} | {c.predicted_even:.3f} | {c.best:.3f} | {len(c.measured)} | "
                f"{c.error:+.1%} | {c.predicted_even / c.best - 1:+.1%} |")
        if c.reordered_measured:
            r = min(c.reordered_measured)
            line += (f" {c.reordered_predicted:.3f} | {r:.3f} | {c.reordered_predicted / r - 1:+.1%} | "
                     f"{1 - r / c.best:+.1%} |")
        else:
            line += " | | | |"
        out.append(line)
    return out


SETUPS = (Setup(Layout(4), False, ("rl-like",)), Setup(Layout(2, 2), True, ("rl-like",)))
QUICK_SETUPS = (Setup(Layout(2), False, ("rl-like",)),)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, quick="pp 2, two cases, one repeat (CI smoke run)")
    p.add_argument("--repeats", type=int, default=None, help="measured calls per run (default 2; 1 with --quick)")
    p.add_argument("--min-op-ms", type=float, default=20.0, help="shortest sleep of any run (ms)")
    p.add_argument("--max-run-s", type=float, default=4.0, help="longest predicted run (s); caps the scale")
    p.add_argument("--samples", type=int, default=None, help="samples of the rollout (default 256; 128 quick)")
    args = p.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 2)
    n = args.samples or (128 if args.quick else 256)
    min_op_s = args.min_op_ms / 1e3
    worst: list[float] = []
    lines = []
    for setup in (QUICK_SETUPS if args.quick else SETUPS):
        f, b = slowest_replica(setup, n)
        cases = cases_for(setup.layout, args.quick)
        scale = build_runs(setup, cases, f, b, min_op_s, args.max_run_s)
        print(f"{setup.name}: rl-like, {n} samples, dp={DP_SIZE}: the slowest replica's {len(f)} micro-batches, "
              f"{scale:.3g} s per unit", flush=True)
        measure(setup, cases, repeats, min_op_s)
        lines += table(setup, cases, len(f))[0 if not lines else 2:]
        worst += [abs(c.error) for c in cases if c.label != "even"]
        worst += [abs(c.reordered_predicted / min(c.reordered_measured) - 1) for c in cases if c.reordered_measured]
    print()
    print("\n".join(lines))
    print()
    print("columns: predicted = pipeline_makespan of the per-stage costs, p2p_s fitted per layout on a uniform run;"
          "\n  p2p=0 = without p2p cost; as even = the same model with every stage at the stages' mean cost;"
          "\n  measured = the fastest call's slowest-stage wall time of megatron-core's forward_backward_func;"
          "\n  reordered = the same micro-batches in an order chosen for these stage costs (best swaps by the"
          "\n  per-stage model, from the plan's order); gain = 1 - reordered measured / measured.")
    ok = max(worst, default=0) <= TARGET
    print("\ntargets:")
    print(target(ok, len(worst), "no uneven case replayed", f"model within {TARGET:.0%} of the replay on uneven "
                 f"stages: worst {max(worst, default=0):.1%} over {len(worst)} cases"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
