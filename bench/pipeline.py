"""Pipeline-aware plans measured on megatron-core's own schedule code (issue 15, items 4 and 5).

    python -m bench.pipeline                 # sleep replay: PP = 2, 4, 8 and PP = 2 x VPP = 2 (a few minutes)
    python -m bench.pipeline --quick         # smoke run: one small case, one repeat (CI)
    python -m bench.pipeline --real          # instead: real compute at DP = 1 x PP = 2 on the tiny GPT
    SLIME_GIT=/path/to/slime/.git python -m bench.pipeline   # adds slime HEAD's build_dp_schedule as a plan

**Plans.** Every workload (:mod:`bench.workloads`: ``rl``, ``bimodal``, ``heavy`` = long tail) is one rollout, one
step, planned for ``dp = 8`` with ``max_tokens_per_gpu = 16384`` and ``balance_data`` by

* ``before`` -- :func:`slime_ext.schedule.plan_schedule` without the pipeline size (``pp_size = 1``): the plan
  slime-ext made before issue 15, micro-batches heaviest first;
* ``after``  -- the same planner told the pipeline layout (``ParallelConfig(pp_size=..)``): it orders and counts
  the micro-batches by the pipeline model;
* ``slime``  -- slime HEAD's ``build_dp_schedule``, imported from a tree extracted at run time from ``SLIME_GIT``
  (``slime_ext.schemes``' reference scheme; nothing of slime is stored here). Without ``SLIME_GIT`` its rows say how
  to get it and are skipped.

**Costs** (:func:`bench_profile`): the issue's: a micro-batch's forward is its estimated FLOPs (Qwen3-8B-like dims)
plus 2% of a full micro-batch's (a one-sample micro-batch of the cap), backward twice forward; layers split evenly,
so one stage's forward of a micro-batch is ``1/pp`` of the model's. The plans are made in these units; the replay
scales them to seconds so that every sleep lasts at least ``--min-op-ms`` (20 ms by default; a run whose scale is
capped by ``--max-run-s`` says so).

**Replay** (:mod:`bench.pipeline_replay`): one process per pipeline stage runs megatron-core's real
``get_forward_backward_func()`` over gloo with this repo's CPU patches; each model chunk sleeps its micro-batch's
forward and backward. It replays the **slowest replica** of each plan (the replica with the largest predicted
makespan; a step waits for it in the DP gradient reduction) after one warm-up call per launch, ``--repeats`` times
and more (up to :data:`MAX_REPEATS_FACTOR` times as many) until its two fastest calls agree within :data:`NOISE`;
the measured makespan is the **minimum** over the calls of the slowest stage's wall time of
``forward_backward_func`` (a slow call on the shared machine is interference, not the schedule).
Identical runs (e.g. ``after`` = ``before``) are replayed once.

**Prediction**: :func:`slime_ext.schedule.pipeline_model.pipeline_makespan` on the same costs, with ``p2p_s`` fitted
once per layout on a separate run (uniform micro-batches) -- the schedule's per-call overhead on this machine. The
table also shows the prediction with ``p2p_s = 0``.

**Targets** (printed as PASS/FAIL, never asserted in tests): the model within 3% of the replay (1F1B and VPP);
``after`` >= 5% faster than ``before`` on rl-like at pp = 4 and >= 10% on bimodal at pp = 4; within 3% of the
stated lower bound (:func:`pipeline_lower_bound`) on the long tail at pp = 4; never slower than ``before`` nor than
slime HEAD (slower = by more than :data:`NOISE`, the replay's repeat noise).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.pipeline_costs import BACKWARD_FORWARD_RATIO, stage_costs
from bench.pipeline_replay import Layout, ReplayRun, replay_job
from bench.runner import parser, target
from bench.workloads import MAX_TOKENS_PER_GPU, MODEL_DIMS, REPLAY_QUICK_WORKLOADS, REPLAY_WORKLOADS, Workload

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # the e2e harness: process launcher

DP_SIZE = 8
#: fixed cost of one micro-batch, as a share of a full one (one sample of the cap)
MICROBATCH_OVERHEAD_SHARE = 0.02
#: two measured makespans closer than this (relative) are "equal": the spread of repeats of one run on a loaded
#: 2-core machine (see the table's "spread" column)
NOISE = 0.005
#: a run is repeated up to this many times --repeats while its two fastest calls disagree by more than NOISE
MAX_REPEATS_FACTOR = 4


@dataclass(frozen=True)
class Setup:
    """One replay layout and the workloads run on it."""

    layout: Layout
    overlap_p2p_comm: bool
    workloads: tuple[str, ...]

    @property
    def name(self) -> str:
        if self.layout.vpp == 1:
            return self.layout.name
        return f"{self.layout.name} {'overlap' if self.overlap_p2p_comm else 'batched'}"


SETUPS = (
    Setup(Layout(2), False, ("rl-like", "bimodal")),
    Setup(Layout(4), False, ("rl-like", "bimodal", "long-tail")),
    Setup(Layout(8), False, ("rl-like", "bimodal")),
    Setup(Layout(2, 2), True, ("rl-like", "bimodal")),  # Megatron-LM training's default p2p mode with VPP
    Setup(Layout(2, 2), False, ("rl-like", "bimodal")),
)
QUICK_SETUPS = (Setup(Layout(2), False, ("rl-like",)),)


# ---------------------------------------------------------------------------------------------------- costs
def bench_profile():
    """The cost profile every plan and prediction uses (module docstring), in units of one full micro-batch's
    forward + backward over the whole model. ``p2p_s = 0``: plans are made before the replay measures it."""
    from slime_ext.schedule import CostModel, CostProfile

    linear, quadratic = CostModel(**MODEL_DIMS).coefficients()
    cap = MAX_TOKENS_PER_GPU
    full = linear * cap + quadratic * cap * cap
    return CostProfile(step_overhead_s=0.0, microbatch_overhead_s=MICROBATCH_OVERHEAD_SHARE,
                       per_token_s=linear / full, per_sample_quadratic_s=quadratic / full,
                       backward_forward_ratio=BACKWARD_FORWARD_RATIO, p2p_s=0.0,
                       meta={"source": "bench.pipeline: Qwen3-8B-like FLOPs, 1 = one full micro-batch"})


# ---------------------------------------------------------------------------------------------------- plans
@dataclass
class Plan:
    """One planner's first step: per DP rank, its micro-batches (sample lengths) in run order."""

    name: str
    ranks: list[list[list[int]]] | None
    skipped: str = ""


def _first_step(lengths: np.ndarray, partitions, micro_batch_indices, num_microbatches) -> list[list[list[int]]]:
    n0 = num_microbatches[0]
    return [[[int(lengths[part[i]]) for i in mb] for mb in mbi[:n0]]
            for part, mbi in zip(partitions, micro_batch_indices)]


def parallel_for(setup: Setup, pipeline_aware: bool = True):
    """The planner's layout: dp x pp (x vpp, Megatron's default group size pp), the replay's p2p mode; without
    ``pipeline_aware`` the pipeline size is left out (``pp_size = 1``, the planner before issue 15)."""
    from slime_ext.schedule import ParallelConfig

    lay = setup.layout
    return ParallelConfig(dp_size=DP_SIZE, vpp_size=lay.vpp,
                          microbatch_group_size_per_vp_stage=lay.pp if lay.vpp > 1 else None,
                          pp_size=lay.pp if pipeline_aware else 1, overlap_p2p_comm=setup.overlap_p2p_comm)


def plan_ours(lengths: np.ndarray, setup: Setup, profile, pipeline_aware: bool) -> Plan:
    from slime_ext.schedule import BatchConfig, plan_schedule

    n = len(lengths)
    batch = BatchConfig(global_batch_size=n, use_dynamic_batch_size=True, max_tokens_per_gpu=MAX_TOKENS_PER_GPU,
                        balance_data=True)
    sch = plan_schedule([int(x) for x in lengths], parallel_for(setup, pipeline_aware), batch,
                        rollout_ids=list(range(n)), cost_model=profile)
    return Plan("after" if pipeline_aware else "before",
                _first_step(lengths, sch.partitions, sch.micro_batch_indices, sch.num_microbatches))


def slime_head_build_dp_schedule():
    """The reference scheme (upstream slime's own ``build_dp_schedule``, loaded at run time from an installed slime
    or ``SLIME_GIT``; ``SLIME_REV`` defaults to HEAD), or a string saying how to get it."""
    from slime_ext.schemes import BASELINES

    reference = BASELINES["reference"]
    missing = reference.missing()
    return f"skipped: {missing}" if missing else reference


def plan_slime(lengths: np.ndarray, setup: Setup, reference) -> Plan:
    from slime_ext.schedule import BatchConfig, CostModel, ParallelConfig

    if isinstance(reference, str):
        return Plan("slime", None, skipped=reference)
    n = len(lengths)
    lay = setup.layout
    parallel = ParallelConfig(dp_size=DP_SIZE, vpp_size=lay.vpp,
                              microbatch_group_size_per_vp_stage=lay.pp if lay.vpp > 1 else None)
    batch = BatchConfig(global_batch_size=n, use_dynamic_batch_size=True, max_tokens_per_gpu=MAX_TOKENS_PER_GPU,
                        balance_data=True)
    sch = reference.schedule([int(x) for x in lengths], parallel, batch, global_batch_size=n,
                             rollout_ids=list(range(n)), cost_model=CostModel(**MODEL_DIMS))
    return Plan("slime", _first_step(lengths, sch.partitions, sch.micro_batch_indices, sch.num_microbatches))


# ---------------------------------------------------------------------------------------------------- one row
@dataclass
class Row:
    setup: Setup
    workload: str
    plan: str
    skipped: str = ""
    replica: int = -1
    num_microbatches: int = 0
    fwd: np.ndarray | None = None  # slowest replica, per stage, in units
    bwd: np.ndarray | None = None
    all_fwd: np.ndarray | None = None  # every replica's costs (units), for the lower bound
    all_bwd: np.ndarray | None = None
    scale: float = 1.0  # seconds per unit
    run: ReplayRun | None = None
    measured: list[float] = field(default_factory=list)
    predicted: float = float("nan")
    predicted_p2p0: float = float("nan")
    bound: float = float("nan")

    @property
    def best(self) -> float:
        return min(self.measured) if self.measured else float("nan")

    @property
    def settled(self) -> bool:
        """The two fastest calls agree within NOISE (else the run hit its repeat limit on a busy machine)."""
        fastest = sorted(self.measured)[:2]
        return len(fastest) == 2 and fastest[1] <= fastest[0] * (1 + NOISE)


def spec_for(setup: Setup, p2p_s: float = 0.0):
    from slime_ext.schedule.pipeline_model import PipelineSpec

    lay = setup.layout
    return PipelineSpec(lay.pp, lay.vpp, p2p_s=p2p_s, overlap_p2p_comm=setup.overlap_p2p_comm)


def plan_rows(setup: Setup, workloads: dict[str, Workload], profile, slime_build) -> list[Row]:
    from slime_ext.schedule.pipeline_model import pipeline_makespan

    rows = []
    spec = spec_for(setup)
    for wname in setup.workloads:
        w = workloads[wname]
        lengths = w.lengths()
        plans = [plan_ours(lengths, setup, profile, False), plan_ours(lengths, setup, profile, True),
                 plan_slime(lengths, setup, slime_build)]
        for plan in plans:
            row = Row(setup, wname, plan.name, skipped=plan.skipped)
            if plan.ranks is not None:
                costs = [stage_costs(profile, mbs, parallel_for(setup)) for mbs in plan.ranks]
                fwd, bwd = np.stack([c[0] for c in costs]), np.stack([c[1] for c in costs])
                spans = pipeline_makespan(fwd, bwd, spec)
                row.replica = int(np.argmax(spans))
                row.fwd, row.bwd = fwd[row.replica], bwd[row.replica]
                row.num_microbatches = len(row.fwd)
                row.all_fwd, row.all_bwd = fwd, bwd
            rows.append(row)
    return rows


def scale_rows(rows: list[Row], min_op_s: float, max_run_s: float) -> list[str]:
    """Seconds per unit, one per (setup, workload): the smallest sleep of its plans lasts ``min_op_s``, unless the
    longest predicted run would exceed ``max_run_s``. Returns notes for capped scales."""
    from slime_ext.schedule.pipeline_model import pipeline_makespan

    notes = []
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if row.fwd is not None:
            groups.setdefault((row.setup.name, row.workload), []).append(row)
    for (sname, wname), group in groups.items():
        vpp = group[0].setup.layout.vpp
        smallest = min(float(r.fwd.min()) / vpp for r in group)
        longest = max(pipeline_makespan(r.fwd, r.bwd, spec_for(r.setup)) for r in group)
        scale = min(min_op_s / smallest, max_run_s / longest)
        if scale < min_op_s / smallest:
            notes.append(f"{sname} {wname}: scale capped by --max-run-s; smallest sleep "
                         f"{smallest * scale * 1e3:.0f} ms")
        for r in group:
            r.scale = scale
            r.run = ReplayRun(f"{sname}/{wname}/{r.plan}", tuple(float(x) for x in r.fwd * scale),
                              tuple(float(x) for x in r.bwd * scale), r.setup.overlap_p2p_comm)
    return notes


# ---------------------------------------------------------------------------------------------------- replay
def calibration_run(setup: Setup, op_s: float) -> ReplayRun:
    """Uniform micro-batches (2 pp of them, forward ``op_s`` per chunk): what ``p2p_s`` is fitted on."""
    m = 2 * setup.layout.pp
    f = op_s * setup.layout.vpp
    return ReplayRun(f"{setup.name}/calibration", (f,) * m, (BACKWARD_FORWARD_RATIO * f,) * m,
                     setup.overlap_p2p_comm)


def fit_p2p(fwd, bwd, spec_with, measured: float, offset: float = 0.0) -> float:
    """The ``p2p_s`` at which ``pipeline_makespan(fwd, bwd, spec_with(p2p_s)) + offset`` equals ``measured``
    (bisection: the makespan grows with it); 0 when the model without p2p cost is already at or above it."""
    from slime_ext.schedule.pipeline_model import pipeline_makespan

    f, b = np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64)
    lo, hi = 0.0, 0.1
    if pipeline_makespan(f, b, spec_with(0.0)) + offset >= measured:
        return 0.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if pipeline_makespan(f, b, spec_with(mid)) + offset < measured:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def replay_setup(setup: Setup, runs: list[ReplayRun], repeats: int, timeout: float) -> list[list[float]]:
    """Makespans of each run on ``setup``'s pipeline: after one warm-up call, ``repeats`` calls, more (up to
    ``MAX_REPEATS_FACTOR`` times as many) until the two fastest agree within :data:`NOISE`."""
    from train_harness import launch, rendezvous

    pp = setup.layout.pp
    with rendezvous() as port:
        results = launch([(replay_job, (rank, pp, port, setup.layout, runs, repeats, MAX_REPEATS_FACTOR * repeats,
                                        NOISE)) for rank in range(pp)], timeout=timeout)
    return [r.makespans for r in results[0]]


def measure(rows: list[Row], setups: tuple[Setup, ...], repeats: int, min_op_s: float) -> dict[str, float]:
    """Replay every row (identical runs once); fills measured, predicted and bound. Returns p2p_s per setup."""
    from slime_ext.schedule.pipeline_model import pipeline_lower_bound, pipeline_makespan

    fitted = {}
    for setup in setups:
        mine = [r for r in rows if r.setup == setup and r.run is not None]
        unique: dict[tuple, ReplayRun] = {}
        for r in mine:
            unique.setdefault((r.run.fwd, r.run.bwd), r.run)
        calib = calibration_run(setup, min_op_s)
        runs = [calib] + list(unique.values())
        budget = sum(pipeline_makespan(np.array(x.fwd), np.array(x.bwd), spec_for(setup)) for x in runs)
        t0 = time.perf_counter()
        spans = replay_setup(setup, runs, repeats, timeout=120 + 3 * (MAX_REPEATS_FACTOR * repeats + 1) * budget)
        by_key = {(x.fwd, x.bwd): s for x, s in zip(runs, spans)}
        p2p = fit_p2p(calib.fwd, calib.bwd, lambda x: spec_for(setup, x), min(spans[0]))
        fitted[setup.name] = p2p
        for r in mine:
            r.measured = by_key[(r.run.fwd, r.run.bwd)]
            f, b = np.array(r.run.fwd), np.array(r.run.bwd)
            r.predicted = float(pipeline_makespan(f, b, spec_for(setup, p2p)))
            r.predicted_p2p0 = float(pipeline_makespan(f, b, spec_for(setup, 0.0)))
            r.bound = float(np.max(pipeline_lower_bound(r.all_fwd * r.scale, r.all_bwd * r.scale,
                                                        spec_for(setup, p2p))))
        calls = sum(len(x) for x in spans) + 1
        print(f"  replayed {setup.name}: {len(runs)} runs, {calls} calls in {time.perf_counter() - t0:.1f}s; "
              f"p2p_s fitted on the uniform run: {p2p * 1e3:.2f} ms", flush=True)
    return fitted


# ---------------------------------------------------------------------------------------------------- report
HEADER = ("| layout | workload | plan | replica | #mb | predicted s | p2p=0 s | measured s | calls | model err "
          "| spread | vs before | vs slime | bound s |")


def _row_text(r: Row, before: Row | None, slime: Row | None) -> str:
    if r.skipped:
        return f"| {r.setup.name} | {r.workload} | {r.plan} |" + " |" * (HEADER.count("|") - 5) + f" {r.skipped} |"
    err = r.predicted / r.best - 1
    spread = max(r.measured) / r.best - 1 if r.measured else float("nan")
    vs_before = f"{r.best / before.best:.3f}" if before is not None and before.measured else ""
    vs_slime = f"{r.best / slime.best:.3f}" if slime is not None and slime.measured else ""
    return (f"| {r.setup.name} | {r.workload} | {r.plan} | {r.replica} | {r.num_microbatches} | {r.predicted:.3f} "
            f"| {r.predicted_p2p0:.3f} | {r.best:.3f} | {len(r.measured)}{'' if r.settled else '*'} | {err:+.1%} "
            f"| {spread:.1%} | {vs_before} | {vs_slime} "
            f"| {r.bound:.3f} |")


def table(rows: list[Row]) -> list[str]:
    out = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in rows:
        peers = {p.plan: p for p in rows if p.setup == r.setup and p.workload == r.workload and not p.skipped}
        out.append(_row_text(r, peers.get("before"), peers.get("slime")))
    return out


def targets(rows: list[Row]) -> list[tuple[bool | None, str, int]]:
    """``(ok, text, cases)`` per target; ``ok`` None and no cases where its runs were not measured."""
    out: list[tuple[bool | None, str, int]] = []
    done = [r for r in rows if r.measured]
    for kind, pick in (("1F1B", lambda r: r.setup.layout.vpp == 1), ("VPP", lambda r: r.setup.layout.vpp > 1)):
        sel = [r for r in done if pick(r)]
        if not sel:
            out.append((None, f"model within 3% of the replay ({kind}): not measured", 0))
            continue
        worst = max(sel, key=lambda r: abs(r.predicted / r.best - 1))
        e = worst.predicted / worst.best - 1
        out.append((abs(e) <= 0.03, f"model within 3% of the replay ({kind}): worst {e:+.1%} "
                                    f"({worst.setup.name} {worst.workload} {worst.plan}) over {len(sel)} runs",
                    len(sel)))

    def pair(wname: str, pp: int):
        sel = {r.plan: r for r in done if r.workload == wname and r.setup.layout == Layout(pp)}
        return sel.get("before"), sel.get("after")

    for wname, need in (("rl-like", 0.05), ("bimodal", 0.10)):
        before, after = pair(wname, 4)
        if before is None or after is None:
            out.append((None, f"after >= {need:.0%} faster than before on {wname} at pp=4: not measured", 0))
            continue
        gain = 1 - after.best / before.best
        out.append((gain >= need, f"after >= {need:.0%} faster than before on {wname} at pp=4: {gain:+.1%} "
                                  f"({before.best:.3f} s -> {after.best:.3f} s)", 1))
    _, after = pair("long-tail", 4)
    if after is None:
        out.append((None, "long-tail at pp=4 within 3% of the lower bound: not measured", 0))
    else:
        gap = after.best / after.bound - 1
        out.append((gap <= 0.03, f"long-tail at pp=4 within 3% of the lower bound: measured {gap:+.1%} above it "
                                 f"(predicted {after.predicted / after.bound - 1:+.1%}; bound {after.bound:.3f} s)", 1))
    for other in ("before", "slime"):
        cmp = []
        for r in done:
            if r.plan != "after":
                continue
            peer = next((p for p in done if p.plan == other and p.setup == r.setup and p.workload == r.workload), None)
            if peer is not None:
                cmp.append((r.best / peer.best - 1, f"{r.setup.name} {r.workload}"))
        if not cmp:
            out.append((None, f"after never slower than {other}: not measured" +
                        (" (set SLIME_GIT)" if other == "slime" else ""), 0))
            continue
        worst = max(cmp)
        slower = [f"{name} {d:+.1%}" for d, name in cmp if d > NOISE]
        out.append((not slower, f"after never slower than {other} (by > {NOISE:.1%}): worst {worst[0]:+.1%} "
                                f"({worst[1]}) over {len(cmp)} cases" + (f"; slower: {', '.join(slower)}" if slower
                                                                        else ""), len(cmp)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, quick="one small case (pp=2, rl-like, 128 samples), one repeat")
    p.add_argument("--repeats", type=int, default=None, help="measured calls per run after the warm-up "
                                                             "(default 2; 1 with --quick)")
    p.add_argument("--min-op-ms", type=float, default=20.0, help="shortest sleep of any run (ms)")
    p.add_argument("--max-run-s", type=float, default=6.0, help="longest predicted run (s); caps the scale")
    p.add_argument("--setups", default=None, help="comma-separated layout names to run (e.g. pp4,pp8)")
    p.add_argument("--real", action="store_true", help="instead of the replay: time real steps at DP=1 x PP=2 on "
                                                        "the tiny GPT (bench.pipeline_real)")
    args = p.parse_args(argv)
    if args.real:
        from bench.pipeline_real import real_section

        real_section(args.repeats or 6)
        return 0

    setups = QUICK_SETUPS if args.quick else SETUPS
    if args.setups:
        wanted = set(args.setups.split(","))
        setups = tuple(s for s in setups if s.layout.name in wanted or s.name in wanted)
    workloads = REPLAY_QUICK_WORKLOADS if args.quick else REPLAY_WORKLOADS
    repeats = args.repeats or (1 if args.quick else 2)
    min_op_s = args.min_op_ms / 1e3

    profile = bench_profile()
    slime_build = slime_head_build_dp_schedule()
    t0 = time.perf_counter()
    rows = [row for s in setups for row in plan_rows(s, workloads, profile, slime_build)]
    notes = scale_rows(rows, min_op_s, args.max_run_s)
    print(f"planned {len(rows)} rows in {time.perf_counter() - t0:.1f}s; dp={DP_SIZE}, cap {MAX_TOKENS_PER_GPU}, "
          f"balance_data; replaying each plan's slowest replica (min of {repeats} to {MAX_REPEATS_FACTOR * repeats} "
          f"calls after a warm-up, until the two fastest agree within {NOISE:.1%})", flush=True)
    measure(rows, setups, repeats, min_op_s)

    print()
    print("\n".join(table(rows)))
    print()
    print("columns: replica = the plan's slowest DP replica (by the model), the one replayed; #mb = its micro-batches;"
          "\n  predicted = pipeline_makespan with p2p_s fitted per layout on a uniform run; p2p=0 = without p2p cost;"
          "\n  measured = min over the calls of the slowest stage's wall time of forward_backward_func;"
          f"\n  calls = how many (* = its two fastest still differ by more than {NOISE:.1%}: the machine stayed busy);"
          "\n  spread = max/min - 1 over the calls; vs before / vs slime = measured / that plan's measured;"
          "\n  bound = the plan's pipeline_lower_bound (max over replicas), seconds at this row's scale.")
    for note in notes:
        print(f"note: {note}")
    print("\ntargets:")
    for ok, text, cases in targets(rows):
        print(target(bool(ok), cases, "not measured", text))  # SKIP where its runs were not measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
