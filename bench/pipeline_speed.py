"""What pipeline-aware planning costs next to pp-unaware planning of the same input (issue 22, item 2).

    python -m bench.pipeline_speed            # dp 128 and 512, pp 4 and 8, VPP 1 and 2, 2,048 and 8,192 samples
    python -m bench.pipeline_speed --quick    # dp 128, 2,048 samples, pp 4 (CI smoke)

One rollout of rl-like samples (:mod:`bench.workloads`: prompt U[100, 1500] + lognormal(7.5, 1.0) response capped
at 16,000), one step, ``--max-tokens-per-gpu 16384``, ``--balance-data``, Qwen3-8B-like dims with 32 layers
(``SEARCH_DIMS``: every layout splits evenly; the output layer makes the last stage heavier, priced per stage),
planned through
``slime_ext.schedule.build_dp_schedule`` with slime-shaped args, as a slime job calls it. Per layout, in one
process and one run: the pp = 1 planning time of the same input, the pipeline-aware planning time, their ratio and
the predicted step time (the slowest replica's makespan, in seconds at ``--tflops`` achieved per GPU; the planner's
per-stage forward-FLOP units times ``1 + backward/forward``, divided by the GPU rate).

Times are CPU seconds of this process (``time.process_time``: the planner is single-threaded, and on a shared
machine CPU time is what the planner costs, where wall time also counts the neighbours), the **median of
--repeats calls** after one warm-up call per layout (the warm-up compiles the pipeline
model's schedule for the counts it meets, once per process and layout, as a long-running RolloutManager does; the
cold first call is printed too). On a shared 2-core machine read the ratios, not the absolute times. Targets
(printed, never asserted in tests): ratio <= 5 at every layout; time growth from 2,048 to 8,192 samples per step
and from dp 128 to 512 no faster than linear.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from types import SimpleNamespace

from slime_ext.schedule import build_dp_schedule

from .pipeline_search import SEARCH_DIMS
from .workloads import MAX_TOKENS_PER_GPU, make_lengths

LAYOUTS = [(4, 1), (4, 2), (8, 1), (8, 2)]


def slime_args(n: int, pp: int, vpp: int) -> SimpleNamespace:
    return SimpleNamespace(global_batch_size=n, use_dynamic_batch_size=True, max_tokens_per_gpu=MAX_TOKENS_PER_GPU,
                           micro_batch_size=1, balance_data=True, balance_by_flops=False,
                           use_dynamic_global_batch_size=False, disable_rollout_trim_samples=False,
                           pipeline_model_parallel_size=pp,
                           virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                           microbatch_group_size_per_vp_stage=None, overlap_p2p_comm=False, **SEARCH_DIMS)


def timed(lengths: list[int], dp: int, pp: int, vpp: int, repeats: int) -> tuple[float, float, object]:
    """``(cold s, median warm s, the schedule)`` of planning ``lengths`` for this layout."""
    args = slime_args(len(lengths), pp, vpp)
    parallel = {"dp_size": dp, "cp_size": 1, "vpp_size": vpp,
                "microbatch_group_size_per_vp_stage": pp if vpp > 1 else None}
    ids = list(range(len(lengths)))

    def once():
        t0 = time.process_time()
        out = build_dp_schedule(args, parallel, lengths, global_batch_size=len(lengths), rollout_indices=ids)
        return time.process_time() - t0, out

    cold, schedule = once()
    warm = [once()[0] for _ in range(repeats)]
    return cold, statistics.median(warm), schedule


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU for the step time column")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    grid = [(128, 2048)] if args.quick else [(128, 2048), (128, 8192), (512, 8192)]
    layouts = LAYOUTS[:1] if args.quick else LAYOUTS
    print(f"rl-like, one step, cap {MAX_TOKENS_PER_GPU}, balance_data, Qwen3-8B-like (32 layers); median CPU time "
          f"of {args.repeats} warm calls (cold: the first call of the layout in this process)")
    print(f"{'dp':>5}{'samples':>9}{'layout':>10}{'pp=1 ms':>9}{'aware ms':>10}{'ratio':>7}{'cold ms':>9}"
          f"{'mbs':>5}{'step s':>8}")
    worst, times = 0.0, {}
    for dp, n in grid:
        lengths = make_lengths("rl", n, 7).tolist()
        _, base, _ = timed(lengths, dp, 1, 1, args.repeats)
        for pp, vpp in layouts:
            cold, aware, schedule = timed(lengths, dp, pp, vpp, args.repeats)
            ratio = aware / base
            worst = max(worst, ratio)
            times[(dp, n, pp, vpp)] = aware
            span = schedule.stats[0].predicted_makespan  # per-stage forward FLOPs of the slowest replica
            step_s = span * 3.0 / (args.tflops * 1e12)  # forward + backward (2x) per stage, at the GPU's rate
            print(f"{dp:>5}{n:>9}{f'pp{pp} v{vpp}':>10}{base * 1e3:>9.1f}{aware * 1e3:>10.1f}{ratio:>7.1f}"
                  f"{cold * 1e3:>9.1f}{schedule.num_microbatches[0]:>5}{step_s:>8.2f}", flush=True)
    print(f"worst ratio: {worst:.1f} -> {'PASS' if worst <= 5 else 'FAIL'} (target <= 5)")
    if not args.quick:
        for pp, vpp in layouts:
            by_n = times[(128, 8192, pp, vpp)] / times[(128, 2048, pp, vpp)]
            by_dp = times[(512, 8192, pp, vpp)] / times[(128, 8192, pp, vpp)]
            print(f"pp{pp} v{vpp}: 2,048 -> 8,192 samples x{by_n:.2f} (linear: x4); dp 128 -> 512 x{by_dp:.2f} "
                  f"(linear: x4)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
