"""``slime-ext calibrate``: time real training steps of this model on this device and write a cost profile.

::

    slime-ext calibrate --config configs/demo_cpu.yaml --max-tokens 2048 --out profile.json
    slime-ext plan --synthetic pareto:n=4096 --max-tokens-per-gpu 2048 ... --cost-profile profile.json

It builds the model of ``--config`` (a training config: model dims, optimizer; :mod:`slime_ext.train_config`)
in this one process (world size 1: gloo on CPU, NCCL on a GPU), times forward + backward + optimizer of
micro-batches of varying sample lengths and counts (:func:`slime_ext.training.calibrate.calibration_design`), fits
``step = step_overhead + sum(microbatch_overhead + per_token*T + per_sample_quadratic*sum(len^2) +
packed_quadratic*T^2)`` by non-negative least squares and prints the coefficients and the fit error. The profile
(JSON) goes to ``--cost-profile`` of ``slime-ext plan`` or to a run config's ``cost_profile`` key.

Needs the ``train`` extra (torch, megatron-core). Exit codes: 0 ok, 2 bad input or a fit the data cannot support.
"""

from __future__ import annotations

import argparse
import sys

from .errors import CLIError
from .options import LAYOUT


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate",
        help="time training steps on this model and device; write a cost profile for --cost-profile",
        description="Time forward+backward of micro-batches of varying lengths and counts on the model of --config "
                    "and fit per-micro-batch time = overhead + a*tokens + b*sum(len^2) (+ c*tokens^2 for attention "
                    "over the packed row); write the profile as JSON.",
    )
    p.add_argument("--config", metavar="YAML", required=True,
                   help="training config (model dims, optimizer; e.g. configs/demo_cpu.yaml)")
    p.add_argument("--max-tokens", type=int, required=True, metavar="N",
                   help="the largest micro-batch to time, in tokens (use your --max-tokens-per-gpu)")
    p.add_argument("--out", metavar="PROFILE.json", required=True, help="where to write the profile")
    p.add_argument("--repeats", type=int, default=3, metavar="K", help="times each step is timed (default 3)")
    p.add_argument("--statistic", choices=("median", "min"), default="median",
                   help="what of the K timings a step's observation is: median (default) or min (the least "
                        "disturbed run, for machines shared with other jobs)")
    p.add_argument("--min-length", type=int, default=32, metavar="N", help="shortest sample timed (default 32)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's; 1 times with the calling thread's CPU time)")
    p.add_argument("--timer", choices=("thread", "process", "cuda"), default=None,
                   help="default: cuda on a GPU, thread with one CPU thread, else process")
    p.add_argument("--bf16", action="store_true", help="GPU: run the steps under torch.autocast(bfloat16)")
    p.add_argument("--no-pipeline", action="store_true",
                   help="skip what the pipeline model reads (pp > 1): the backward/forward ratio, fitted on "
                        "forward-only passes of the same steps, and p2p_s, one activation send/recv between two "
                        "processes")
    stages = p.add_argument_group(
        "pipeline stages (optional)",
        "the training job's pipeline layout: checked against --config's num_layers as Megatron checks it, and each "
        "stage's share of the profile's cost is printed and recorded in the profile (meta.stages)")
    stages.add_argument("--pipeline-model-parallel-size", type=int, default=None, metavar="N")
    stages.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None, metavar="N")
    for key in LAYOUT:
        flag = "--" + key.name.replace("_", "-")
        if key.kind == "bool":
            stages.add_argument(flag, dest=key.name, action="store_true", default=False, help=key.help)
        else:
            stages.add_argument(flag, dest=key.name, type=int if key.kind == "int" else str, default=None,
                                metavar="N" if key.kind == "int" else "TEXT", help=key.help)
    p.set_defaults(func=run)
    return p


def pipeline_layout(args, num_layers: int):
    """The job's pipeline layout from the flags (``None`` without a pipeline size), checked against the model's
    ``num_layers`` as Megatron checks it; :class:`CLIError` naming the flag otherwise."""
    from ..schedule import ParallelConfig, ScheduleError

    given = [k.name for k in LAYOUT if getattr(args, k.name) not in (None, False)]
    pp = args.pipeline_model_parallel_size
    if pp is None:
        if given or args.virtual_pipeline_model_parallel_size is not None:
            raise CLIError(f"--{given[0].replace('_', '-') if given else 'virtual-pipeline-model-parallel-size'} "
                           f"needs --pipeline-model-parallel-size N (the job's pipeline size)")
        return None
    try:
        parallel = ParallelConfig.from_megatron(
            1, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            **{k.name: getattr(args, k.name) for k in LAYOUT})
        parallel.stage_layers(num_layers)
    except ScheduleError as e:
        raise CLIError(f"{e} (--config has num_layers = {num_layers})") from None
    return parallel


def stage_meta(profile, parallel) -> dict:
    """What the profile records of the job's pipeline stages: the layout and each rank's share of its cost."""
    from ..schedule.config import LAYOUT_FLAGS
    from ..schedule.stages import StageCosts

    costs = StageCosts.from_model(profile, parallel)
    return {"pp_size": parallel.pp_size, "vpp_size": parallel.vpp_size,
            **{k: getattr(parallel, k) for k in LAYOUT_FLAGS},
            "linear_share": [round(float(x), 6) for x in costs.linear_share],
            "quadratic_share": [round(float(x), 6) for x in costs.quadratic_share],
            "basis": costs.basis}


def run(args) -> int:
    if args.max_tokens < 4 * args.min_length:
        raise CLIError(f"--max-tokens {args.max_tokens} must be at least 4 x --min-length = {4 * args.min_length}")
    if args.repeats < 1:
        raise CLIError(f"--repeats {args.repeats} must be >= 1")
    try:
        import torch

        from slime_ext.training.calibrate import calibrate
        from slime_ext.train_config import TrainConfigError, load_train_config
    except ImportError as e:
        raise CLIError(f"calibrate needs the training extra ({e}): pip install \"./slime-ext[train]\" from a clone "
                       f"of slime-ext (docs/install.md)") from None
    from ..schedule import ScheduleError
    from ..training.profile_fit import fit_summary

    if args.threads is not None:
        if args.threads < 1:
            raise CLIError(f"--threads {args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    try:
        config = load_train_config(args.config, ignore_unknown=True)
    except (OSError, TrainConfigError) as e:
        raise CLIError(f"--config {args.config}: {e}") from None
    parallel = pipeline_layout(args, config.model.num_layers)  # before minutes of timing
    autocast = None
    if args.bf16:
        if not torch.cuda.is_available():
            raise CLIError("--bf16 needs a CUDA GPU (the CPU path trains in fp32)")
        autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    progress = (lambda msg: print(f"slime-ext calibrate: {msg}", file=sys.stderr, flush=True))
    try:
        profile, report, _ = calibrate(config, max_tokens=args.max_tokens, repeats=args.repeats,
                                       statistic=args.statistic,
                                       min_length=args.min_length, timer=args.timer, autocast=autocast,
                                       progress=progress, pipeline=not args.no_pipeline)
    except ScheduleError as e:
        raise CLIError(f"the timings do not support a fit: {e}") from None
    if parallel is not None:
        import dataclasses

        stages = stage_meta(profile, parallel)
        profile = dataclasses.replace(profile, meta={**profile.meta, "stages": stages})
        print(f"stages: share of the cost per pipeline stage {' '.join(f'{x:.3f}' for x in stages['linear_share'])} "
              f"({stages['basis']})")
    print(fit_summary(profile, report))
    if not args.no_pipeline:
        print(f"pipeline: backward/forward = {profile.backward_forward_ratio:.3f}, p2p_s = {profile.p2p_s:.3g} "
              f"({profile.meta.get('pipeline', {}).get('p2p_s', '')})")
    try:
        profile.save(args.out)
    except OSError as e:
        raise CLIError(f"cannot write {args.out}: {e.strerror}") from None
    print(f"wrote {args.out} (measured on {profile.meta.get('device')}, timer {profile.meta.get('timer')})")
    return 0
