"""DP=8 schedules replayed rank by rank on one GPU (``ci/gpu_bench``): measured step time of every scheme.

    python -m bench.gpu_replay                 # on a GPU: ~1B-parameter GPT under bf16 autocast (sized for ~4 min)
    python -m bench.gpu_replay --dry-run       # anywhere: a tiny model on CPU through the same code, ~1 min

1. Calibrate (:func:`slime_ext.training.calibrate.calibrate`) the model on this device: a cost profile in seconds.
2. For each distribution (``rl``, ``heavy``, ``reasoning``) plan one step for DP=8 with every scheme -- legacy
   (:class:`slime_ext.schemes.LegacySchedule`: the training side's first fit + all-reduce + even deal, computed here
   for all eight ranks), reference (upstream slime's own ``build_dp_schedule``, run by
   :class:`slime_ext.schemes.ReferenceSchedule`: it needs an installed slime or ``SLIME_GIT``, else its rows are
   skipped with the reason) and ours (strided, balance_data, balance_by_flops with the profile).
3. Replay: one training process (world size 1) runs each rank's micro-batches as one step, timed between
   ``torch.cuda.synchronize()`` calls; the step time of a scheme is the slowest rank's, as in a real DP=8 step (the
   gradient all-reduce, equal for every scheme, is not part of it). The median over ``--repeats`` is reported with
   the ratio to ours and the profile's prediction.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

from bench.runner import markdown_table, parser, target
from bench.workloads import GPU_REPLAY_SEEDS, OURS, OURS_FLAGS, SCHEMES, Workload

#: ~1.0B parameters (16 x 12 x 2048^2 + embeddings): fits with room on one 80 GB+ GPU at 4k-token micro-batches
GPU_MODEL = dict(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, vocab_size=32000)
TINY_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=128)
OPTIM = dict(optimizer="sgd", sgd_momentum=0.0, lr=1e-4, weight_decay=0.0, clip_grad=1.0, seed=1234)
DP = 8


def rank_micro_batches(scheme: str, lengths: list[int], cap: int, model: dict, profile) -> list[list[list[int]]]:
    """Per DP rank, the sample lengths of each of its micro-batches under ``scheme`` (one step)."""
    from slime_ext.schedule import BatchConfig, CostModel, ParallelConfig, plan_schedule
    from slime_ext.schemes import BASELINES

    n = len(lengths)
    if scheme in BASELINES:  # legacy: strided split; reference: balance_data, as upstream is usually run
        batch = BatchConfig(global_batch_size=n, use_dynamic_batch_size=True, max_tokens_per_gpu=cap,
                            balance_data=scheme == "reference")
        sched = BASELINES[scheme].schedule(lengths, ParallelConfig(dp_size=DP), batch, global_batch_size=n,
                                           cost_model=CostModel(**model))
    else:
        bd, bf = OURS_FLAGS[scheme]
        sched = plan_schedule(lengths, ParallelConfig(dp_size=DP),
                              BatchConfig(global_batch_size=n, use_dynamic_batch_size=True, max_tokens_per_gpu=cap,
                                          balance_data=bd, balance_by_flops=bf), cost_model=profile)
    return [[[lengths[sched.partitions[r][i]] for i in mb] for mb in sched.micro_batch_indices[r]] for r in range(DP)]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, prog="python -m bench.gpu_replay")
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU, small workloads (checks the code path)")
    p.add_argument("--repeats", type=int, default=None, help="replays per scheme (default 2; dry run 1)")
    p.add_argument("--out", help="also write the report (markdown) here")
    p.add_argument("--profile-out", help="write the calibrated profile (JSON) here")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the dry run stays on CPU even on a GPU host

    import torch

    from slime_ext.training.profile_fit import fit_summary
    from slime_ext.training.calibrate import calibrate, time_steps
    from slime_ext.schemes import BASELINES
    from slime_ext.training.worker import TrainWorker

    gpu = torch.cuda.is_available()
    if not gpu and not args.dry_run:
        print("bench.gpu_replay: no CUDA device; run it on a GPU (ci/gpu_bench) or pass --dry-run", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(1)
    model = TINY_MODEL if args.dry_run else GPU_MODEL
    cap = 256 if args.dry_run else 4096
    n = 48 if args.dry_run else 128  # GPU: ~4 micro-batches of up to 4096 tokens per rank
    repeats = args.repeats or (1 if args.dry_run else 2)
    scale = cap / 16384  # bench/workloads.py's lengths are planned for a 16k cap
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if gpu and not args.dry_run else None
    # no batch keys: calibrate() sets its own, and the rollout-path worker trains the plans it is sent
    config = {**model, **OPTIM, "seq_length": cap, "max_position_embeddings": cap}
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    t_start = time.perf_counter()
    device = torch.cuda.get_device_name() if gpu and not args.dry_run else "cpu (dry run)"
    params = 12 * model["num_layers"] * model["hidden_size"] ** 2 + model["vocab_size"] * model["hidden_size"]
    say(f"# DP={DP} schedules replayed rank by rank on one device ({'dry run' if args.dry_run else 'GPU'})\n")
    say(f"device: {device}; model {model} (~{params / 1e9:.2f}B parameters, "
        f"{'bf16 autocast' if autocast else 'fp32'}); max_tokens_per_gpu {cap}; {n} samples per step\n")

    profile, report, _ = calibrate(config, max_tokens=cap, repeats=1 if args.dry_run else 2, autocast=autocast)
    say(f"## Cost profile ({time.perf_counter() - t_start:.0f} s)\n\n```\n{fit_summary(profile, report)}\n```\n")
    if args.profile_out:
        profile.save(args.profile_out)

    reference = BASELINES["reference"]
    why = reference.missing()
    say(f"- reference: skipped: {why}" if why else f"- reference: upstream slime from {reference.source()}")
    schemes = [s for s in SCHEMES if not why or s != "reference"]
    worker = TrainWorker({**config, "dp_schedule": "rollout"}, 0, 1, "127.0.0.1", 0)  # its own store, port 0
    worker.setup()
    results: dict[tuple[str, str], dict] = {}
    try:
        for dist, seed in GPU_REPLAY_SEEDS.items():
            lengths = Workload(dist, dist, n, seed, cap=cap, scale=scale, max_len=cap).lengths().tolist()
            say(f"- {dist}: {n} samples, {sum(lengths)} tokens, max {max(lengths)}, median {int(np.median(lengths))}")
            plans = {s: rank_micro_batches(s, lengths, cap, model, profile) for s in schemes}
            steps = [(s, r, plans[s][r]) for s in schemes for r in range(DP)]
            obs = time_steps(worker, [mbs for _, _, mbs in steps], repeats=repeats, autocast=autocast, warmup=1)
            for s in schemes:
                rank_t = [o.seconds for (sc, _, _), o in zip(steps, obs) if sc == s]
                pred = [profile.rank_time(plans[s][r]) for r in range(DP)]
                results[(dist, s)] = dict(step=max(rank_t), mean=statistics.mean(rank_t), pred=max(pred),
                                          mbs=len(plans[s][0]), err=max((p / m - 1 for p, m in zip(pred, rank_t)),
                                                                        key=abs))
    finally:
        worker.shutdown()

    say(f"\n## Step time = slowest of {DP} ranks (median of {repeats} replays per rank), ratio = scheme / {OURS}\n")
    rows = [[dist, s, r["mbs"], f"{1000 * r['step']:.1f}", f"{1000 * r['mean']:.1f}",
             f"{r['step'] / ours['step']:.3f}", f"{r['pred'] / ours['pred']:.3f}", f"{100 * r['err']:+.1f}%"]
            for dist in GPU_REPLAY_SEEDS for ours in [results[(dist, OURS)]]
            for s in schemes for r in [results[(dist, s)]]]
    for line in markdown_table(["distribution", "scheme", "#mb/rank", "step (ms)", "mean rank (ms)", "ratio",
                                "predicted ratio", "worst rank pred error"], rows):
        say(line)
    say("\n## Targets\n")
    for dist in GPU_REPLAY_SEEDS:
        ours = results[(dist, OURS)]
        for other in [s for s in ("legacy", "reference") if s in schemes]:
            ratio = results[(dist, other)]["step"] / ours["step"]
            say(target(ratio >= 1, 1, "", f"{dist}: ours not slower than {other} (ratio {ratio:.3f})", markdown=True))
    errs = [abs(r["err"]) for r in results.values()]
    say(target(max(errs, default=0) <= 0.05, len(errs), "no scheme timed",
               f"predicted per-rank time within 5% of measured (worst {100 * max(errs, default=0):.1f}%)",
               markdown=True))
    say(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
