"""Log-prob passes planned forward-only against the training plan reused: predicted pass time and replay error.

    python -m bench.log_probs            # 4 workloads x PP 1, 4 x log-prob caps 1x, 2x, 4x (dp 8, 512 samples)
    python -m bench.log_probs --quick    # rl only, 128 samples (a few seconds)
    python -m bench.log_probs --set count_tie=0.003     # any PlannerConfig field (repeatable)

**The pass.** An RL step runs log-prob passes (actor, reference) over the rollout before training on it: forwards
only, megatron-core's schedule with ``forward_only=True``. slime reuses the training plan for them; the
forward-only plan instead packs the same samples under the log-prob cap (``--log-probs-max-tokens-per-gpu``: 1x,
2x, 4x the training cap of 16,384 tokens; a forward keeps no activations, so it fits larger micro-batches) and
chooses count, packing and order for the forward-only makespan (:func:`slime_ext.schedule.pipeline_pricing.
pipeline_pricing` with ``forward_only=True``). Both are planned through the planner's request
(:class:`slime_ext.schedule.PlanRequest`; the log-prob pass with ``forward_only=True``):
``dp = 8``, ``balance_data``, one step of the whole rollout, the workloads of :mod:`bench.workloads` (``rl``,
``heavy``, ``uniform``, ``bimodal``; ``n`` samples, seed 1).

**Prices** (:data:`PROFILE`): seconds of an H100-like GPU on the Qwen3-8B-like dims of :mod:`bench.workloads`
(forward + backward = 3 x forward FLOPs at :data:`ACHIEVED_FLOPS`, 4 ms per micro-batch, backward 2 x forward,
2 ms per stage-boundary transfer). Both plans are priced by the same forward-only pricing (the log-prob cap does
not enter a profile's prices); the pass ends when its slowest replica ends (a forward-only call waits for no
other replica). At PP 1 the pass is the sum of a replica's forwards.

**Replay error** (per case): every replica of both plans replayed through megatron-core's own forward-only
schedule (:func:`bench.schedule_replay.replay_makespan`: injected durations, virtual time, blocking sends as on
GPU), the largest relative difference from the model's prediction.

**The plan chosen** (:func:`choose_log_prob_plan`): the search's plan, or the training plan where that is
predicted at least as fast (the table shows the search's own time beside it).

**Target** (PASS/FAIL, per case and overall): the forward-only plan never slower than the training plan reused:
``forward-only / reused <= 1 +`` :data:`TOLERANCE`. The geometric mean of the ratios is printed last.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from slime_ext.schedule import (BatchConfig, CostModel, CostProfile, ParallelConfig, PlanRequest, PlannerConfig, plan,
                                plan_schedule)
from slime_ext.schedule.dp_schedule import DPSchedule
from slime_ext.schedule.pipeline_model import PipelineSpec, pipeline_makespan
from slime_ext.schedule.pipeline_pricing import pipeline_pricing, step_microbatch_costs

from .runner import add_planner_fields, parser, planner_config
from .verdict import verdict
from .workloads import MAX_TOKENS_PER_GPU, MODEL_DIMS, make_lengths

DP = 8
PP_SIZES = (1, 4)
CAP_FACTORS = (1, 2, 4)
DISTS = ("rl", "heavy", "uniform", "bimodal")
SEED = 1
#: "never slower": a forward-only plan may be predicted at most this much slower than the reused one (relative;
#: float summation order only -- the search compares with a tolerance of its own, ``PlannerConfig.objective.tie``)
TOLERANCE = 1e-9
#: achieved FLOP/s of the priced GPU (an H100 at ~40% of its dense bf16 peak)
ACHIEVED_FLOPS = 400e12


def _profile() -> CostProfile:
    linear, quadratic = CostModel(**MODEL_DIMS).coefficients()  # forward FLOPs per sample
    scale = 3.0 / ACHIEVED_FLOPS  # forward + backward seconds
    return CostProfile(step_overhead_s=0.0, microbatch_overhead_s=0.004, per_token_s=linear * scale,
                       per_sample_quadratic_s=quadratic * scale, backward_forward_ratio=2.0, p2p_s=0.002,
                       meta={"source": "bench.log_probs: Qwen3-8B-like FLOPs at 400 TFLOP/s"})


PROFILE = _profile()


def plan_log_probs(lengths: np.ndarray, parallel: ParallelConfig, batch: BatchConfig, config: PlannerConfig | None,
                   cost_model: CostModel | CostProfile | None = PROFILE) -> DPSchedule:
    """The forward-only plan of a log-prob pass: the planner's request at the log-prob cap (``batch``), priced
    forward-only."""
    return plan(PlanRequest(lengths=lengths, parallel=parallel, batch=batch, rollout_ids=np.arange(len(lengths)),
                            forward_only=True, cost_model=cost_model, config=config))


def choose_log_prob_plan(searched: DPSchedule, training: DPSchedule, parallel: ParallelConfig) -> DPSchedule:
    """The log-prob pass's plan: the forward-only search's, unless the training plan reused is predicted at least as
    fast for the pass (the search starts from the pp-unaware plan at the log-prob cap, never from the training
    plan, so it can miss a plan the training search found; the guard makes "never slower than reusing" hold by
    construction, and reusing also keeps the training packing bit-identical)."""
    return searched if pass_times(searched, parallel).max() < pass_times(training, parallel).max() else training


def _batch(n: int, cap: int) -> BatchConfig:
    return BatchConfig(global_batch_size=n, use_dynamic_batch_size=True, max_tokens_per_gpu=cap, balance_data=True)


def forward_stage_costs(schedule: DPSchedule, parallel: ParallelConfig) -> tuple[np.ndarray, PipelineSpec]:
    """Per-stage forward seconds of every replica's micro-batches in run order, ``(dp, M)`` (every stage alike) or
    ``(dp, pp * vpp, M)``, and the forward-only spec they run under (the same pricing for every plan)."""
    mb = step_microbatch_costs(schedule, 0)
    pricing = pipeline_pricing(parallel, PROFILE, None, forward_only=True)
    if pricing is None:  # pp 1: the whole model's forward, one stage
        ratio = PROFILE.backward_forward_ratio
        return mb / (1.0 + ratio), PipelineSpec(1, p2p_s=PROFILE.p2p_s, forward_only=True)
    return pricing.stage_costs(mb)[0], pricing.spec


def pass_times(schedule: DPSchedule, parallel: ParallelConfig) -> np.ndarray:
    """``(dp,)`` each replica's predicted forward-only pass, seconds."""
    f, spec = forward_stage_costs(schedule, parallel)
    return np.atleast_1d(pipeline_makespan(f, None, spec))


def replay_error(schedule: DPSchedule, parallel: ParallelConfig, replicas: str = "all") -> float:
    """The largest relative difference between the model and megatron-core's forward-only schedule replayed
    (:func:`bench.schedule_replay.replay_makespan`) over the replicas (``"all"`` or ``"slowest"``)."""
    from .schedule_replay import replay_makespan
    f, spec = forward_stage_costs(schedule, parallel)
    model = np.atleast_1d(pipeline_makespan(f, None, spec))
    rows = range(len(f)) if replicas == "all" else [int(np.argmax(model))]
    return max(abs(replay_makespan(f[r:r + 1] if f.ndim == 3 else f[r], None, spec) - model[r]) / model[r]
               for r in rows)


@dataclass(frozen=True)
class Row:
    dist: str
    pp: int
    factor: int
    reused_s: float  # the training plan reused: the slowest replica's predicted pass
    searched_s: float  # the forward-only search's plan
    forward_only_s: float  # the plan chosen (:func:`choose_log_prob_plan`)
    reused_mb: int  # micro-batches per rank
    forward_only_mb: int
    replay_error: float | None  # None where megatron-core is not installed

    @property
    def ratio(self) -> float:
        return self.forward_only_s / self.reused_s

    @property
    def search_ratio(self) -> float:
        return self.searched_s / self.reused_s

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0 + TOLERANCE


def run_case(dist: str, n: int, pp: int, factor: int, config: PlannerConfig | None, replay: str | None) -> Row:
    lengths = make_lengths(dist, n, SEED)
    parallel = ParallelConfig(dp_size=DP, pp_size=pp)
    training = plan_schedule(lengths, parallel, _batch(n, MAX_TOKENS_PER_GPU), rollout_ids=np.arange(n),
                             cost_model=PROFILE, config=config)
    searched = plan_log_probs(lengths, parallel, _batch(n, factor * MAX_TOKENS_PER_GPU), config)
    forward = choose_log_prob_plan(searched, training, parallel)
    error = None
    if replay is not None:
        error = max(replay_error(training, parallel, replay), replay_error(searched, parallel, replay))
    return Row(dist, pp, factor, float(pass_times(training, parallel).max()),
               float(pass_times(searched, parallel).max()), float(pass_times(forward, parallel).max()),
               training.num_microbatches[0], forward.num_microbatches[0], error)


def geomean(values: list[float]) -> float:
    if not values:
        raise ValueError("no cases: a geometric mean of nothing")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def print_table(rows: list[Row], replay: str | None) -> bool:
    """The table, the geometric mean and the verdict; whether every case passed (never over zero cases)."""
    print(f"{'workload':<9}{'pp':>3}{'cap':>5}{'reused s':>11}{'search s':>10}{'fwd-only s':>12}{'ratio':>8}"
          f"{'mb/rank':>10}{'replay err':>12}  verdict")
    for r in rows:
        err = "n/a" if r.replay_error is None else f"{r.replay_error:.1e}"
        print(f"{r.dist:<9}{r.pp:>3}{r.factor:>4}x{r.reused_s:>11.3f}{r.searched_s:>10.3f}{r.forward_only_s:>12.3f}"
              f"{r.ratio:>8.3f}{f'{r.reused_mb}->{r.forward_only_mb}':>10}{err:>12}  {'ok' if r.ok else 'FAIL'}")
    ok = bool(rows) and all(r.ok for r in rows)
    errors = [r.replay_error for r in rows if r.replay_error is not None]
    lost = sum(r.search_ratio > 1.0 + TOLERANCE for r in rows)
    print(f"geometric mean of forward-only / reused over {len(rows)} cases: {geomean([r.ratio for r in rows]):.3f} "
          f"(the search's plan alone: {geomean([r.search_ratio for r in rows]):.3f}, slower than reusing in {lost}; "
          f"there the training plan is kept)")
    if errors:
        print(f"model vs megatron-core's forward-only schedule replayed ({replay} replicas): max relative error "
              f"{max(errors):.1e}")
    print(f"target: forward-only never slower than the training plan reused (ratio <= 1 + {TOLERANCE:g}): "
          f"{verdict(ok, len(rows), 'no case planned')}")
    return ok


def _has_megatron() -> bool:
    try:
        import megatron.core.pipeline_parallel.schedules  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="rl only, 128 samples, the slowest replica replayed")
    ap.add_argument("--samples", type=int, default=512, help="samples per rollout (default 512, 64 per rank)")
    ap.add_argument("--no-replay", action="store_true", help="skip the replay (no megatron-core needed)")
    add_planner_fields(ap, "both plans")
    args = ap.parse_args(argv)
    config = planner_config(args.overrides)
    dists = ("rl",) if args.quick else DISTS
    n = 128 if args.quick else args.samples
    replay = None
    if not args.no_replay:
        if _has_megatron():
            replay = "slowest" if args.quick else "all"
        else:
            print("megatron-core is not installed: no replay (pip install megatron-core, or pass --no-replay)")
    rows = [run_case(dist, n, pp, factor, config, replay) for dist in dists for pp in PP_SIZES
            for factor in CAP_FACTORS]
    print(f"log-prob pass, dp {DP}, {n} samples, training cap {MAX_TOKENS_PER_GPU}; seconds of the slowest replica")
    return 0 if print_table(rows, replay) else 1


if __name__ == "__main__":
    sys.exit(main())
