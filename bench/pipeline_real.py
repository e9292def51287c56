"""Real compute at DP = 1 x PP = 2 (``python -m bench.pipeline --real``): the tiny GPT, two processes, one core each.

The benchmark model of :mod:`bench.train_step` (4 layers, hidden 256) is split over two pipeline stages and trains
one step of one workload from the same initial parameters under two plans of the same samples:

* ``before`` -- the planner without the pipeline size (heaviest micro-batch first);
* ``after, heaviest first`` -- the micro-batches of ``after``, run heaviest first (the order alone);
* ``after``  -- the planner told ``pp_size = 2`` (its count and its order).

Each stage is pinned to its own core (``sched_setaffinity``) and runs one torch thread.

Both plans are made with the calibrated CPU profile ``docs/cpu_bench_profile.json`` (measured on this model, one
torch thread), which also gives the prediction: one stage's forward of a micro-batch is
``microbatch_time / (1 + BACKWARD_FORWARD_RATIO) / pp``, its backward ``BACKWARD_FORWARD_RATIO`` times that, and
the step's fixed cost is added once. On a shared CPU the profile's absolute seconds are those of the load it
was calibrated under, so the table compares each plan's step with ``before``'s, measured beside predicted. The
measured step is the slowest rank's ``seconds`` of the step record (``forward_backward_func`` plus the optimizer),
the minimum over ``REPEATS`` calls after a warm-up; the order of the plans reverses between calls so that load
drift spreads over all. Parameters after the step must match between the plans (1e-5): micro-batches and their
order do not change the gradient.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench.pipeline_costs import BACKWARD_FORWARD_RATIO, stage_costs
from bench.train_step import MODEL, OPTIM, make_samples
from bench.workloads import REAL_PIPELINE_WORKLOADS, Workload

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "docs" / "cpu_bench_profile.json"
PP = 2
REPEATS = 6
HEAVIEST = "after, heaviest first"


def load_profile():
    """The calibrated CPU profile, with the bench's backward/forward ratio (the file predates the pipeline fields)."""
    from slime_ext.schedule import CostProfile

    d = CostProfile.load(str(PROFILE)).to_dict()
    d["backward_forward_ratio"] = BACKWARD_FORWARD_RATIO
    return CostProfile.from_dict(d)


def plan(samples: list[dict], w: Workload, profile, pipeline_aware: bool):
    from slime_ext.schedule import BatchConfig, ParallelConfig, plan_schedule

    n = len(samples)
    parallel = ParallelConfig(dp_size=1, pp_size=PP) if pipeline_aware else ParallelConfig(dp_size=1)
    return plan_schedule([s["total_length"] for s in samples], parallel,
                         BatchConfig(global_batch_size=n, use_dynamic_batch_size=True, max_tokens_per_gpu=w.cap,
                                     balance_data=True),
                         rollout_ids=list(range(n)), loss_tokens=[sum(s["loss_mask"]) for s in samples],
                         cost_model=profile)


def heaviest_first(payload, profile):
    """``payload`` (one step) with the same micro-batches run heaviest first by the profile's prediction."""
    import dataclasses

    lengths = payload.samples.total_lengths
    mbs = sorted(payload.micro_batch_indices, key=lambda mb: -profile.microbatch_time([lengths[i] for i in mb]))
    order = [i for mb in mbs for i in mb]
    starts = np.cumsum([0] + [len(mb) for mb in mbs])
    return dataclasses.replace(payload, partition=[payload.partition[i] for i in order],
                               samples=payload.samples.take(order),
                               micro_batch_indices=[list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])])


def real_job(rank: int, port: int, config: dict, runs: list[dict], repeats: int) -> dict:
    """One stage: per repeat, every run from the initial parameters; step seconds per call, parameters after."""
    import os

    import torch
    import torch.distributed as dist

    from slime_ext.training.worker import TrainWorker

    if hasattr(os, "sched_setaffinity"):  # one core per stage
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})

    worker = TrainWorker(config, rank, PP, "127.0.0.1", port, store_hosted=True)
    worker.setup()
    initial = worker.param_snapshot()
    seconds: dict[str, list[float]] = {r["label"]: [] for r in runs}
    params: dict[str, dict] = {}
    try:
        for rep in range(repeats + 1):
            for run in (runs if rep % 2 == 0 else runs[::-1]):
                worker.reset()
                dist.barrier()
                records = worker.train_rollout(run["payload"])
                step = torch.tensor([records[0]["seconds"]], dtype=torch.float64)
                dist.all_reduce(step, op=dist.ReduceOp.MAX)
                if rep > 0:
                    seconds[run["label"]].append(float(step.item()))
                else:
                    params[run["label"]] = worker.param_snapshot()
    finally:
        worker.shutdown()
    return {"seconds": seconds, "params": params, "initial": initial}


def real_section(repeats: int = REPEATS) -> list[str]:
    """Run the real-compute comparison and print its table; returns the table lines."""
    from train_harness import assert_params_match, launch, rendezvous, rollout_payloads

    from slime_ext.schedule import ParallelConfig
    from slime_ext.schedule.pipeline_model import PipelineSpec, pipeline_makespan

    profile = load_profile()
    spec = PipelineSpec(PP)
    config = {**MODEL, **OPTIM, "seq_length": 512, "pipeline_model_parallel_size": PP, "dp_schedule": "rollout",
              "use_dynamic_batch_size": True, "balance_data": True, "dist_timeout_seconds": 120,
              "global_batch_size": REAL_PIPELINE_WORKLOADS[0].n}
    runs, predicted, counts = [], {}, {}
    for w in REAL_PIPELINE_WORKLOADS:
        samples = make_samples(w.lengths().tolist(), w.seed, MODEL["vocab_size"])
        before = rollout_payloads(samples, plan(samples, w, profile, False))[0]
        after = rollout_payloads(samples, plan(samples, w, profile, True))[0]
        for name, payload in (("before", before), (HEAVIEST, heaviest_first(after, profile)), ("after", after)):
            lengths = payload.samples.total_lengths
            mbs = [[lengths[i] for i in mb] for mb in payload.micro_batch_indices]
            fwd, bwd = stage_costs(profile, mbs, ParallelConfig(dp_size=1, pp_size=PP), per_stage=True)
            label = f"{w.name}/{name}"
            predicted[label] = float(np.max(pipeline_makespan(fwd, bwd, spec))) + profile.step_overhead_s
            counts[label] = len(mbs)
            runs.append({"label": label, "payload": payload})
    config["max_tokens_per_gpu"] = max(w.cap for w in REAL_PIPELINE_WORKLOADS)
    t0 = time.perf_counter()
    with rendezvous() as port:
        results = launch([(real_job, (rank, port, config, runs, repeats)) for rank in range(PP)], timeout=900)
    print(f"\nreal compute, DP=1 x PP=2 (tiny GPT {MODEL}, 1 thread per stage): {time.perf_counter() - t0:.0f}s")
    seconds = {label: min(v) for label, v in results[0]["seconds"].items()}
    spread = {label: max(v) / min(v) - 1 for label, v in results[0]["seconds"].items()}
    lines = ["| workload | plan | #mb | predicted s | measured s | spread | model err | / before, measured "
             "| / before, predicted |", "|---" * 9 + "|"]
    for w in REAL_PIPELINE_WORKLOADS:
        b, a = f"{w.name}/before", f"{w.name}/after"
        for label in (b, f"{w.name}/{HEAVIEST}", a):
            ratios = ["", ""] if label == b else [f"{seconds[label] / seconds[b]:.3f}",
                                                  f"{predicted[label] / predicted[b]:.3f}"]
            lines.append(f"| {w.name} | {label.split('/')[1]} | {counts[label]} | {predicted[label]:.3f} | "
                         f"{seconds[label]:.3f} | {spread[label]:.1%} | {predicted[label] / seconds[label] - 1:+.1%} | "
                         + " | ".join(ratios) + " |")
        for rank_result in results:  # the micro-batches and their order must not change the step's result
            for label in (a, f"{w.name}/{HEAVIEST}"):
                assert_params_match(rank_result["params"][label], rank_result["params"][b], rank_result["initial"],
                                    rtol=1e-5, label=f"{label} vs before")
    print("\n".join(lines))
    print("  measured = slowest stage's step seconds (forward_backward_func + optimizer), min of "
          f"{repeats} calls after a warm-up (spread = max/min - 1: CPU-bound, so the machine's load shows);"
          "\n  predicted = pipeline_makespan on the calibrated profile (p2p_s = 0) + step overhead; the profile was"
          "\n  measured under another load, so read the ratios to `before` (measured beside predicted), not the errors;"
          "\n  parameters after the step match between the plans (1e-5) on every stage.")
    return lines
