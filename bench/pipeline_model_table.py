"""Issue 15's table, from the pipeline model: how much the pipeline-aware planner predicts to take off a step.

    PYTHONPATH=$PWD .venv/bin/python -m bench.pipeline_model_table [--vpp]
    PYTHONPATH=$PWD .venv/bin/python -m bench.pipeline_model_table --speed   # the model's own speed

For each workload (rl-like, bimodal, long tail) and layout (dp 8 x pp 4 and 8; Qwen3-8B-like dims, cap 16384,
``balance_data``), two plans of the same rollout:

* **pp-unaware**: ``plan_schedule`` with ``pp_size = 1`` (today's plan: fewest micro-batches, ranks balanced on
  summed FLOPs, heaviest first), priced by the pipeline model of the real layout;
* **pipeline-aware**: ``plan_schedule`` with the real ``pp_size``.

The columns are step times summed over the rollout's steps (each step: its slowest replica's predicted makespan),
relative to the pp-unaware plan: the same micro-batches only reordered per rank by the model, the full
pipeline-aware plan, and a bound no plan with at least the pp-unaware count beats (per step, the larger of the
largest sample's trip through every stage forward and back, alone in its micro-batch, and a replica's mean share
of the step's work). Pricing as the planner's (FLOPs, backward = 2 x forward, p2p 0, every micro-batch charged 2%
of a full one: :mod:`slime_ext.schedule.pipeline_pricing`). These are predictions of the model, not measurements:
``bench/pipeline.py`` replays plans through megatron-core's schedule.

Workloads: ``n = 1024`` samples, ``global_batch_size = 256`` (4 steps), the rollout shapes of
:data:`bench.workloads.ROLLOUT_SHAPES`.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from slime_ext.schedule import BatchConfig, CostModel, ParallelConfig, plan_schedule
from slime_ext.schedule.cost import sample_costs
from slime_ext.schedule.pipeline_model import PipelineSpec, pipeline_makespan
from slime_ext.schedule.pipeline_orders import best_orders
from slime_ext.schedule.pipeline_pricing import pipeline_pricing, step_microbatch_costs

from .runner import parser
from .workloads import MAX_TOKENS_PER_GPU, MODEL_DIMS, ROLLOUT_SHAPES, make_lengths

N, GBS, DP, SEED = 1024, 256, 8, 1


def row(name: str, lengths: np.ndarray, pp: int, vpp: int = 1, overlap: bool = False) -> dict:
    cost_model = CostModel(**MODEL_DIMS)
    batch = BatchConfig(global_batch_size=GBS, use_dynamic_batch_size=True, max_tokens_per_gpu=MAX_TOKENS_PER_GPU,
                        balance_data=True)
    parallel = ParallelConfig(dp_size=DP, pp_size=pp, vpp_size=vpp,
                              microbatch_group_size_per_vp_stage=pp if vpp > 1 else None, overlap_p2p_comm=overlap)
    ids = list(range(len(lengths)))
    t0 = time.perf_counter()
    unaware = plan_schedule(lengths.tolist(), dataclasses.replace(parallel, pp_size=1), batch, rollout_ids=ids,
                            cost_model=cost_model)
    t1 = time.perf_counter()
    aware = plan_schedule(lengths.tolist(), parallel, batch, rollout_ids=ids, cost_model=cost_model)
    t2 = time.perf_counter()
    pricing = pipeline_pricing(parallel, cost_model, batch.cap(1))
    costs = sample_costs(lengths, cost_model)
    before = reordered = bound = 0.0
    for s in range(unaware.num_steps):
        rc = step_microbatch_costs(unaware, s)
        before += float(pricing.makespans(rc).max())
        reordered += float(best_orders(pricing, rc)[1].max())
        f, b = pricing.stage_costs(rc)
        members = unaware.step_samples[s]
        fl, bl = pricing.stage_costs(np.array([costs[members].max()]))
        if f.ndim == 3:  # per (virtual) stage: the trip crosses every row; a rank works all its chunks
            trip = float((fl + bl).sum())
            work = float((f + b).sum(axis=(0, 2)).reshape(-1, pp).sum(axis=0).max()) / DP
        else:
            trip, work = pp * float(fl[0] + bl[0]), float((f + b).sum()) / DP
        bound += max(trip, work)
    after = sum(st.predicted_makespan for st in aware.stats)
    layout = f"{DP}x{pp}" + (f" vpp {vpp} ({'overlapped' if overlap else 'batched'} p2p)" if vpp > 1 else "")
    return dict(name=name, layout=layout, mb_before=unaware.num_microbatches, mb_after=aware.num_microbatches,
                reordered=reordered / before, after=after / before, bound=bound / before,
                strategies=sorted({st.strategy for st in aware.stats}),
                plan_s=(t1 - t0, t2 - t1))


def speed() -> None:
    """How long the model takes for 128 replicas x 64 micro-batches x 8 stages (issue 15: milliseconds), with
    every stage alike and with per-stage costs."""
    rng = np.random.default_rng(0)
    f = rng.lognormal(0.0, 0.6, (128, 64))
    for spec in (PipelineSpec(8, p2p_s=0.01), PipelineSpec(8, 2, p2p_s=0.01),
                 PipelineSpec(8, 2, p2p_s=0.01, overlap_p2p_comm=True)):
        t0 = time.perf_counter()
        pipeline_makespan(f, 2 * f, spec)  # compiles the schedule (cached per layout and count)
        t1 = time.perf_counter()
        reps = 20
        for _ in range(reps):
            pipeline_makespan(f, 2 * f, spec)
        t2 = time.perf_counter()
        # per-stage costs (R, pp, M): a heavier first and last stage, as Megatron's embedding and output layer
        weight = np.ones(spec.pp_size)
        weight[0], weight[-1] = 1.3, 1.5
        per_stage = f[:, None, :] * weight[None, :, None]
        pipeline_makespan(per_stage, 2 * per_stage, spec)
        t3 = time.perf_counter()
        for _ in range(reps):
            pipeline_makespan(per_stage, 2 * per_stage, spec)
        t4 = time.perf_counter()
        print(f"pipeline_makespan, pp={spec.pp_size} vpp={spec.vpp_size} overlap_p2p_comm={spec.overlap_p2p_comm}: "
              f"128 replicas x 64 micro-batches in {1e3 * (t2 - t1) / reps:.1f} ms per call "
              f"({1e3 * (t1 - t0):.0f} ms the first, compiling the schedule); per-stage costs (128, "
              f"{spec.pp_size}, 64): {1e3 * (t4 - t3) / reps:.1f} ms")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--pp", type=int, nargs="*", default=[4, 8])
    p.add_argument("--vpp", action="store_true", help="also pp 4 x vpp 2 (group 4), batched and overlapped p2p")
    p.add_argument("--speed", action="store_true", help="only time the model (128 x 64 x 8)")
    args = p.parse_args(argv)
    if args.speed:
        speed()
        return 0
    layouts = [(pp, 1, False) for pp in args.pp] + ([(4, 2, False), (4, 2, True)] if args.vpp else [])
    print(f"predicted step time summed over {N // GBS} steps, relative to the pp-unaware plan (dp={DP}, cap "
          f"{MAX_TOKENS_PER_GPU}, balance_data, Qwen3-8B-like FLOPs)\n")
    print(f"| rollouts | dp x pp | pp-unaware | reordered only | pipeline-aware | bound | micro-batches/rank "
          f"before -> after | plan time (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, dist in ROLLOUT_SHAPES.items():
        lengths = make_lengths(dist, N, SEED)
        for pp, vpp, overlap in layouts:
            r = row(name, lengths, pp, vpp, overlap)
            print(f"| {r['name']} | {r['layout']} | 1 | {r['reordered']:.3f} | {r['after']:.3f} | {r['bound']:.3f} | "
                  f"{r['mb_before']} -> {r['mb_after']} | {r['plan_s'][1]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
