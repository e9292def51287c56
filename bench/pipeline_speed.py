"""What pipeline-aware planning costs next to pp-unaware planning of the same input (issue 22, item 2; issue 29).

    python -m bench.pipeline_speed                        # every layout below
    python -m bench.pipeline_speed --quick                # dp 128, 2,048 samples, pp 4 (CI smoke)
    python -m bench.pipeline_speed --baseline ../old      # also the planner of another checkout, in the same run
    python -m bench.pipeline_speed --set NAME=VALUE       # a PlannerConfig field
    python -m bench.pipeline_speed --model                # instead: the pipeline model's own speed (below)

**Layouts.** Dynamic batches (the issue-22 grid): one rollout of rl-like samples (:mod:`bench.workloads`: prompt
U[100, 1500] + lognormal(7.5, 1.0) response capped at 16,000), one step, ``--max-tokens-per-gpu 16384``,
``--balance-data``, at dp 128 and 512, 2,048 and 8,192 samples, pp 4 and 8, VPP 1 and 2. And (issue 29) layouts
with many micro-batches per replica:

* ``static``: static batches, ``--micro-batch-size 1``, dp 1, pp 8 x VPP 3, two steps of 512 samples: 512
  micro-batches per rank and step (the issue's case: 7.7 s at cfaa6b5);
* ``many``: dynamic batches with a small cap, dp 8 x 2,048 samples at ``--max-tokens-per-gpu 4096`` (~100
  micro-batches per rank), pp 4; and dp 1 x 1,024 samples at 16,384 tokens (~220 per rank), pp 8 x VPP 2.

Qwen3-8B-like dims with 32 layers (``SEARCH_DIMS``; 48 for the static layout, so that 24 virtual stages split
evenly; the LM head makes the last stage heavier, priced per stage), planned through
``slime_ext.schedule.build_dp_schedule`` with slime-shaped args, as a slime job calls it. Per layout, in one process:
the pp = 1 planning time of the same input, the pipeline-aware planning time, their ratio and the predicted step
time (the slowest replica's makespan, summed over steps, in seconds at ``--tflops`` achieved per GPU).
``--baseline DIR`` times another checkout's planner on the same inputs in a subprocess, right after.

Times are CPU seconds (``time.process_time``: the planner is single-threaded, and on a shared machine CPU time is
what the planner costs), the **median of --repeats calls** after one warm-up call per layout (the warm-up compiles
the pipeline model's schedule for the counts it meets, once per process and layout, as a long-running
RolloutManager does; the cold first call is printed too). On a shared 2-core machine read the ratios, not the
absolute times. Targets (printed, never asserted in tests): the issue-22 grid at most 4x the pp = 1 planning, the
many-micro-batch layouts at most 4x the pp = 1 planning + 20 ms per step.

**The model's own speed** (``--model``): ``pipeline_makespan`` of 128 replicas x 64 micro-batches x 8 stages
(lognormal costs, seed 0), every stage alike and with per-stage costs (a heavier first and last stage), per call
(mean of 20 after the first, which compiles the schedule), for pp 8 and pp 8 x VPP 2 with batched and overlapped
p2p.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

from slime_ext.schedule import build_dp_schedule

from .pipeline_search import SEARCH_DIMS
from .runner import add_planner_fields, parser, planner_config
from .verdict import verdict
from .workloads import MAX_TOKENS_PER_GPU, make_lengths

LAYOUTS = [(4, 1), (4, 2), (8, 1), (8, 2)]


@dataclass(frozen=True)
class SpeedCase:
    """One timed layout: ``n`` rl-like samples (seed 7) in steps of ``per_step``."""

    label: str
    dp: int
    n: int
    pp: int
    vpp: int
    cap: int | None = MAX_TOKENS_PER_GPU  # None: static batches of one sample
    per_step: int | None = None  # None: one step
    layers: int = 32
    allowance_ms: float = 0.0  # the target's fixed part per step (ms)

    @property
    def steps(self) -> int:
        return self.n // (self.per_step or self.n)

    def args(self, pp: int) -> SimpleNamespace:
        return SimpleNamespace(global_batch_size=self.per_step or self.n, use_dynamic_batch_size=self.cap is not None,
                               max_tokens_per_gpu=self.cap, micro_batch_size=1, balance_data=True,
                               balance_by_flops=False, use_dynamic_global_batch_size=False,
                               disable_rollout_trim_samples=False, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=self.vpp if self.vpp > 1 else None,
                               microbatch_group_size_per_vp_stage=None, overlap_p2p_comm=False,
                               **{**SEARCH_DIMS, "num_layers": self.layers})

    def parallel(self) -> dict:
        return {"dp_size": self.dp, "cp_size": 1, "vpp_size": self.vpp,
                "microbatch_group_size_per_vp_stage": self.pp if self.vpp > 1 else None}


def grid(quick: bool) -> list[SpeedCase]:
    sizes = [(128, 2048)] if quick else [(128, 2048), (128, 8192), (512, 8192)]
    layouts = LAYOUTS[:1] if quick else LAYOUTS
    out = [SpeedCase(f"pp{pp} v{vpp}", dp, n, pp, vpp) for dp, n in sizes for pp, vpp in layouts]
    if not quick:
        out += [SpeedCase("static", 1, 1024, 8, 3, cap=None, per_step=512, layers=48, allowance_ms=20.0),
                SpeedCase("many", 8, 2048, 4, 1, cap=4096, allowance_ms=20.0),
                SpeedCase("many", 1, 1024, 8, 2, allowance_ms=20.0)]
    return out


def timed(case: SpeedCase, pp: int, repeats: int, config=None) -> tuple[float, float, object]:
    """``(cold s, median warm s, the schedule)`` of planning the case at pipeline size ``pp``."""
    lengths = make_lengths("rl", case.n, 7).tolist()
    args = case.args(pp)
    ids = list(range(case.n))
    kwargs = {} if config is None else {"config": config}

    def once():
        t0 = time.process_time()
        out = build_dp_schedule(args, case.parallel(), lengths, global_batch_size=case.per_step or case.n,
                                rollout_indices=ids, **kwargs)
        return time.process_time() - t0, out

    cold, schedule = once()
    warm = [once()[0] for _ in range(repeats)]
    return cold, statistics.median(warm), schedule


#: run with another checkout first on sys.path: its planner's times on the cases given on stdin
_BASELINE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])  # the other checkout's planner: imported first, so it stays the one in use
import slime_ext.schedule, slime_ext.schedule.compat
sys.path[0] = sys.argv[2]  # this checkout's bench
from bench.pipeline_speed import SpeedCase, timed
out = []
for c in json.load(sys.stdin):
    case = SpeedCase(**c["case"])
    cold, warm, schedule = timed(case, case.pp, c["repeats"])
    out.append({"cold": cold, "warm": warm, "k": schedule.num_microbatches[0],
                "span": sum(st.predicted_makespan for st in schedule.stats)})
json.dump(out, sys.stdout)
"""


def baseline_times(root: str, cases: list[SpeedCase], repeats: int) -> list[dict]:
    """The planner at ``root`` on ``cases`` (this bench's cases and timing, the other checkout's planner)."""
    here = __file__.rsplit("/bench/", 1)[0]
    payload = [{"case": c.__dict__, "repeats": repeats} for c in cases]
    got = subprocess.run([sys.executable, "-c", _BASELINE, root, here], input=json.dumps(payload),
                         capture_output=True, text=True, check=True)
    return json.loads(got.stdout)


def model_speed(replicas: int = 128, micro_batches: int = 64, calls: int = 20) -> None:
    """Print how long ``pipeline_makespan`` takes per call (module docstring)."""
    import numpy as np

    from slime_ext.schedule.pipeline_model import PipelineSpec, pipeline_makespan

    f = np.random.default_rng(0).lognormal(0.0, 0.6, (replicas, micro_batches))
    for spec in (PipelineSpec(8, p2p_s=0.01), PipelineSpec(8, 2, p2p_s=0.01),
                 PipelineSpec(8, 2, p2p_s=0.01, overlap_p2p_comm=True)):
        weight = np.ones(spec.pp_size)
        weight[0], weight[-1] = 1.3, 1.5  # a heavier first and last stage, as Megatron's embedding and output layer
        per_stage = f[:, None, :] * weight[None, :, None]
        times = []
        for costs in (f, per_stage):
            t0 = time.perf_counter()
            pipeline_makespan(costs, 2 * costs, spec)  # compiles the schedule (cached per layout and count)
            t1 = time.perf_counter()
            for _ in range(calls):
                pipeline_makespan(costs, 2 * costs, spec)
            times.append((t1 - t0, (time.perf_counter() - t1) / calls))
        (first, alike), (_, staged) = times
        print(f"pipeline_makespan, pp={spec.pp_size} vpp={spec.vpp_size} overlap_p2p_comm={spec.overlap_p2p_comm}: "
              f"{replicas} replicas x {micro_batches} micro-batches in {1e3 * alike:.1f} ms per call "
              f"({1e3 * first:.0f} ms the first, compiling the schedule); per-stage costs ({replicas}, "
              f"{spec.pp_size}, {micro_batches}): {1e3 * staged:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="one size (dp 128, 2048 samples) at pp 4, no static or many-step case")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU for the step time column")
    ap.add_argument("--baseline", metavar="DIR", help="also time the planner of the checkout at DIR (same run)")
    ap.add_argument("--model", action="store_true", help="instead: time the pipeline model itself (128 x 64 x 8)")
    add_planner_fields(ap)
    args = ap.parse_args(argv)
    if args.model:
        model_speed()
        return 0
    config = planner_config(args.overrides)
    cases = grid(args.quick)
    print(f"rl-like, balance_data, Qwen3-8B-like; median CPU time of {args.repeats} warm calls (cold: the first "
          f"call of the layout in this process)" + (f"; config {config.describe()}" if config else ""))
    head = f"{'dp':>5}{'samples':>9}{'layout':>10}{'pp=1 ms':>9}{'aware ms':>10}{'ratio':>7}{'cold ms':>9}" \
           f"{'mbs':>5}{'step s':>8}"
    if args.baseline:
        head += f"{'base ms':>9}{'b ratio':>8}{'base step s':>12}{'new/base':>9}"
    print(head)
    worst, worst_base, verdicts, times = 0.0, 0.0, [], {}
    flat = {}
    for case in cases:
        key = (case.dp, case.n, case.cap, case.per_step, case.layers, case.vpp)
        if key not in flat:  # the pp = 1 planning of the same input (VPP alignment kept)
            flat[key] = timed(case, 1, args.repeats)[1]
        base = flat[key]
        cold, aware, schedule = timed(case, case.pp, args.repeats, config)
        ratio = aware / base
        span = sum(st.predicted_makespan for st in schedule.stats)  # per-stage forward FLOPs, slowest replica
        step_s = span * 3.0 / (args.tflops * 1e12)  # forward + backward (2x) per stage, at the GPU's rate
        line = (f"{case.dp:>5}{case.n:>9}{case.label:>10}{base * 1e3:>9.1f}{aware * 1e3:>10.1f}{ratio:>7.1f}"
                f"{cold * 1e3:>9.1f}{schedule.num_microbatches[0]:>5}{step_s:>8.2f}")
        allowed = 4 * base + case.allowance_ms * 1e-3 * case.steps
        if case.allowance_ms:
            verdicts.append((case, aware, allowed))
        else:
            worst = max(worst, ratio)
        times[(case.dp, case.n, case.pp, case.vpp, case.label)] = aware
        if args.baseline:
            b = baseline_times(args.baseline, [case], args.repeats)[0]
            worst_base = max(worst_base, b["warm"] / base) if not case.allowance_ms else worst_base
            line += (f"{b['warm'] * 1e3:>9.1f}{b['warm'] / base:>8.1f}{b['span'] * 3.0 / (args.tflops * 1e12):>12.2f}"
                     f"{aware / b['warm']:>9.2f}")
        print(line, flush=True)
    grid_cases = sum(1 for case in cases if not case.allowance_ms)
    print(f"worst ratio (issue-22 grid): {worst:.2f} -> {verdict(worst <= 4, grid_cases, 'no grid case')} "
          f"(target <= 4; moonshot 2)"
          + (f"; the baseline's worst: {worst_base:.2f}" if args.baseline else ""))
    for case, aware, allowed in verdicts:
        print(f"{case.label} dp {case.dp} x {case.n}: {aware * 1e3:.1f} ms against 4 x pp=1 + {case.allowance_ms:g} ms "
              f"x {case.steps} step(s) = {allowed * 1e3:.1f} ms -> {verdict(aware <= allowed, 1, '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
