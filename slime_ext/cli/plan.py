"""``slime-ext plan``: see what the scheduler will do before launching the job.

Two modes:

* **plan** ``INPUT`` (JSONL or ``.npy``) or ``--synthetic SPEC``, with the training flags (and ``--config``): calls
  :func:`slime_ext.schedule.plan_schedule` once and prints the per-step table; ``--json`` saves the schedule,
  ``--plot`` draws it.
* **replay** ``--from-json FILE``: loads a saved schedule, runs the invariant checker
  (:func:`slime_ext.schedule.check_schedule`) and prints every violation (exit 1), or the table when it is valid.

Exit codes: 0 ok, 1 the saved schedule is invalid, 2 bad input or flags (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..schedule import DPSchedule, ScheduleError, check_schedule, plan_schedule
from ..schedule.pipeline_pricing import pipeline_pricing
from ..schemes import BASELINES, get_dp_schedule
from . import compare, inputs, options, pipeline_plot, plot, report
from .errors import CLIError

EXIT_INVALID = 1
#: print "planning N samples ..." on stderr from this many samples on
PLAN_PROGRESS_FROM = 200_000
#: warn when more than this share of the samples is longer than the cap (each then fills a micro-batch alone)
OVERSIZE_WARN_SHARE = 0.5


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="plan one rollout's schedule and print per-step stats (or validate a saved one)",
        description="Plan one rollout's micro-batch schedule with the training flags and print, per step: "
                    "samples, micro-batches per rank vs the planner's target, token utilisation, largest "
                    "micro-batch vs the cap, FLOPs max/mean over DP ranks and an estimated step time.",
        epilog="synthetic SPEC: " + inputs.SYNTHETIC_HELP + ". JSONL fields: total_length or tokens (list or int), "
               "optional rollout_id, loss_tokens. Exit codes: 0 ok, 1 invalid saved schedule, 2 bad input.",
    )
    src = p.add_argument_group("input (exactly one)")
    src.add_argument("input", nargs="?", metavar="INPUT",
                     help="sample lengths: a JSONL file (.gz ok) or a .npy array")
    src.add_argument("--synthetic", metavar="SPEC", help="generate lengths, e.g. "
                     "lognormal:n=4096,mu=7.5,sigma=1.0,prompt=100-1500,cap=16000,seed=0 or pareto:alpha=1.2")
    src.add_argument("--from-json", metavar="FILE", help="validate a schedule saved with --json (every violation "
                                                         "is listed; exit 1 when invalid) and print its table")
    p.add_argument("--config", metavar="YAML", help="run config with slime's flag names as keys (flags override it)")
    out = p.add_argument_group("output")
    out.add_argument("--compare", metavar="SCHEMES", help="also run the baselines on the same input and show them "
                                                           "side by side: legacy, reference or legacy,reference "
                                                           "(dynamic batches only)")
    out.add_argument("--json", metavar="OUT.json", help="write the schedule (DPSchedule.to_dict()) as JSON")
    out.add_argument("--plot", metavar="OUT.png", help="write a figure: per step, a stacked bar per DP rank, one "
                                                        "segment per micro-batch (needs slime-ext[plot])")
    out.add_argument("--plot-pipeline", metavar="OUT.png",
                     help="with --pipeline-model-parallel-size > 1: write the pipeline picture of one step (the first "
                          "of --plot-steps, default 0): one row per stage, F and B boxes per micro-batch, for the "
                          "slowest replica, ours above each --compare scheme (needs slime-ext[plot])")
    out.add_argument("--plot-metric", choices=("tokens", "flops"), default="tokens",
                     help="segment height (default tokens; flops needs the model dims)")
    out.add_argument("--plot-steps", metavar="STEPS",
                     help=f"steps to plot: 0,2,4-6 or all (default: the first {plot.DEFAULT_MAX_STEPS})")
    out.add_argument("--no-legend", action="store_true", help="omit the column legend under the table")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr (warnings stay)")
    options.add_arguments(p)
    p.set_defaults(func=run)
    return p


# ---------------------------------------------------------------------------------------------------- helpers
def _warn(msg: str) -> None:
    print(f"slime-ext plan: warning: {msg}", file=sys.stderr)


def _write_json(path: str, schedule: DPSchedule) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(schedule.to_dict(), f, separators=(",", ":"))
            f.write("\n")
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror}") from None


def _check_writable(flag: str, path: str) -> None:
    """An output path that cannot be written is refused before planning, not after the table has printed."""
    target = Path(path)
    if target.is_dir():
        raise CLIError(f"{flag} {path}: is a directory; give a file name in it, e.g. {target / 'plan.png'}")
    folder = target.parent
    if not folder.is_dir():
        raise CLIError(f"{flag} {path}: the directory {folder} does not exist; create it (mkdir -p {folder}) or "
                       f"give another path")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise CLIError(f"{flag} {path}: not writable by this user; give a path you can write")


def _plot_steps(args, schedule: DPSchedule) -> tuple[list[int], bool] | None:
    """The steps to draw, checked against the schedule before anything is printed."""
    if args.plot is None and args.plot_pipeline is None:
        return None
    return plot.parse_steps(args.plot_steps, schedule.num_steps)


def _warn_oversize(lengths, cap: int | None, cp_size: int) -> None:
    """A cap below most samples plans a micro-batch per sample, each above the cap: say so, and the fix."""
    if cap is None or len(lengths) == 0:
        return
    lengths = np.asarray(lengths)
    over = int((lengths > cap).sum())
    if over > OVERSIZE_WARN_SHARE * len(lengths):
        _warn(f"{over / len(lengths):.0%} of the samples ({over:,} of {len(lengths):,}) are longer than the cap of "
              f"{cap:,} tokens per micro-batch (max_tokens_per_gpu x cp_size={cp_size}): each trains alone in a "
              f"micro-batch above the cap; raise --max-tokens-per-gpu (the median sample has "
              f"{int(np.median(lengths)):,} tokens, the longest {int(lengths.max()):,})")


def _plot(args, panels, steps: tuple[list[int], bool], title: str) -> None:
    steps, truncated = steps
    plot.plot_schedules(args.plot, panels[0][1], panels, args.plot_metric, steps, title)
    note = f" (steps {steps[0]}-{steps[-1]} of {panels[0][1].num_steps}; --plot-steps all for every step)" \
        if truncated else ""
    print(f"wrote {args.plot}{note}")


def _plot_pipeline(args, schedule: DPSchedule, panels, steps: tuple[list[int], bool], title: str) -> None:
    steps, _ = steps
    pricing = pipeline_pricing(schedule.parallel, schedule.cost_model, schedule.cap)
    lines = pipeline_plot.plot_pipelines(
        args.plot_pipeline, schedule, [(label or "ours", view) for label, view in panels], steps[0], pricing,
        title)
    print("\n".join(lines))
    print(f"wrote {args.plot_pipeline}")


def _check_outputs(args, has_cost_model: bool, pp_size: int = 1) -> None:
    """Output flags that cannot work are rejected before any work is done."""
    for flag, path in (("--json", args.json), ("--plot", args.plot), ("--plot-pipeline", args.plot_pipeline)):
        if path is not None:
            _check_writable(flag, path)
    if args.plot_steps is not None and args.plot_steps.strip() != "all":
        plot.step_spec(args.plot_steps)
    if args.plot_pipeline is not None:
        if pp_size < 2:
            raise CLIError("--plot-pipeline draws a pipelined step: pass --pipeline-model-parallel-size N (N >= 2)")
        plot.require_matplotlib()
    if args.plot is None:
        if args.plot_metric != "tokens" or (args.plot_steps is not None and args.plot_pipeline is None):
            raise CLIError("--plot-steps/--plot-metric need --plot OUT.png (--plot-steps also picks the step of "
                           "--plot-pipeline)")
        return
    plot.require_matplotlib()
    if args.plot_metric == "flops" and not has_cost_model:
        raise CLIError("--plot-metric flops needs the model dims (--hidden-size --num-layers "
                       "--num-attention-heads ...); without them the cost is tokens: use --plot-metric tokens")


# ---------------------------------------------------------------------------------------------------- modes
def _replay(args) -> int:
    cli = options.given_values(args)
    planning = sorted(k for k in cli if k in options.PLAN_KEYS)
    if planning:
        flags = ", ".join("--" + k.replace("_", "-") for k in planning)
        raise CLIError(f"--from-json replays a saved schedule with the config it was planned with; {flags} "
                       f"cannot change it (plan again from the lengths instead)")
    if args.compare is not None:
        raise CLIError("--compare runs the baselines on the input lengths: use it when planning, not with --from-json")
    if args.config is not None:
        raise CLIError("--from-json replays a saved schedule with its own config; drop --config (pass "
                       "--tensor-model-parallel-size/--tflops for the step time)")
    data = inputs.load_schedule_json(args.from_json)
    try:
        schedule = DPSchedule.from_dict(data)
    except (ScheduleError, TypeError, ValueError, KeyError, AttributeError) as e:
        print(f"INVALID: {args.from_json} is not a readable schedule: {type(e).__name__}: {e}")
        return EXIT_INVALID
    try:
        problems = check_schedule(schedule, max_report=sys.maxsize)
    except Exception as e:  # a malformed field the checker trips over is a violation too, not a crash
        problems = [f"the checker could not walk the schedule: {type(e).__name__}: {e}"]
    if problems:
        print(f"INVALID: {args.from_json}: {len(problems)} violation{'s' if len(problems) > 1 else ''}:")
        for p in problems:
            print(f"  - {p}")
        return EXIT_INVALID
    _check_outputs(args, schedule.cost_model is not None, schedule.parallel.pp_size)
    steps = _plot_steps(args, schedule)
    setup = options.replay_setup(cli, schedule)
    print(f"valid: {args.from_json} passes every schedule invariant (check_schedule); stats as recorded in the file")
    print(report.report(schedule, setup, args.from_json, with_legend=not args.no_legend))
    if args.json:
        _write_json(args.json, schedule)
    if args.plot:
        _plot(args, [(None, schedule)], steps, f"{args.from_json}: {report.short_config(schedule)}")
    if args.plot_pipeline:
        _plot_pipeline(args, schedule, [(None, schedule)], steps,
                       f"{args.from_json}: {report.short_config(schedule)}")
    return 0


def _plan(args) -> int:
    config = options.load_config(args.config) if args.config else {}
    cli = options.given_values(args)
    setup = options.resolve(cli, config, args.config)
    merged = {**config, **cli}
    if not setup.batch.use_dynamic_batch_size and "max_tokens_per_gpu" in merged:
        _warn("--max-tokens-per-gpu has no effect without --use-dynamic-batch-size (static micro-batches of "
              f"micro_batch_size={setup.batch.micro_batch_size} samples)")
    if setup.batch.use_dynamic_batch_size and merged.get("micro_batch_size", 1) != 1:
        _warn(f"--micro-batch-size {merged['micro_batch_size']} has no effect with --use-dynamic-batch-size "
              f"(micro-batches are cut by tokens, up to --max-tokens-per-gpu); drop it, or drop "
              f"--use-dynamic-batch-size for static micro-batches of {merged['micro_batch_size']} samples")
    scheme = get_dp_schedule(setup.dp_schedule)
    if scheme is not get_dp_schedule():  # the table is the default scheme's plan
        _warn(f"the config runs {scheme.title} (dp_schedule: {scheme.name}, global_batch_size counts "
              f"{scheme.batch_unit} there); the table shows the rollout-side plan for the same flags"
              + (f"; --compare {scheme.name} shows {scheme.title} on this input" if scheme.name in BASELINES else ""))
    _check_outputs(args, setup.cost_model is not None, setup.parallel.pp_size)
    schemes = compare.parse_compare(args.compare) if args.compare is not None else []
    if schemes and not setup.batch.use_dynamic_batch_size:
        raise CLIError("--compare needs --use-dynamic-batch-size --max-tokens-per-gpu N: with static micro-batches "
                       "every scheme cuts the same fixed chunks")

    samples = inputs.load_samples(args.input, args.synthetic, progress=not args.quiet)
    _warn_oversize(samples.total_lengths, setup.batch.cap(setup.parallel.cp_size), setup.parallel.cp_size)
    big = samples.num_samples >= PLAN_PROGRESS_FROM and not args.quiet
    if big:
        print(f"planning {samples.num_samples:,} samples ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        schedule = plan_schedule(samples.total_lengths, setup.parallel, setup.batch, rollout_ids=samples.rollout_ids,
                                 loss_tokens=samples.loss_tokens, cost_model=setup.cost_model)
    except ScheduleError as e:
        raise CLIError(f"cannot plan {samples.source}: {e}") from None
    plan_seconds = time.perf_counter() - t0
    if big:
        print(f"planned in {plan_seconds:.2f} s", file=sys.stderr, flush=True)
    steps = _plot_steps(args, schedule)

    if args.json:
        _write_json(args.json, schedule)
    print(report.report(schedule, setup, samples.source, with_legend=not args.no_legend))
    panels = [(None, schedule)]
    if schemes:
        runs = compare.run_compare(schemes, schedule, setup, plan_seconds, quiet=args.quiet)
        print()
        print(compare.compare_table(runs, schedule, setup))
        panels = [(r.name, r.schedule) for r in runs if r.metrics is not None and r.metrics.steps]
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        _plot(args, panels, steps, f"{samples.source}: {report.short_config(schedule)}")
    if args.plot_pipeline:
        _plot_pipeline(args, schedule, panels, steps, f"{samples.source}: {report.short_config(schedule)}")
    return 0


def run(args) -> int:
    sources = [x for x in (args.input, args.synthetic, args.from_json) if x is not None]
    if len(sources) != 1:
        raise CLIError("give exactly one input: a JSONL/.npy file, --synthetic SPEC or --from-json FILE"
                       + (f" (got {len(sources)})" if sources else ""))
    return _replay(args) if args.from_json is not None else _plan(args)
