"""verl's own micro-batch planning next to slime-ext's engine-depth plan, on the same trainer steps (issue 23), and
each rank's planning time at DP 8 to 128 (issue 30).

    .venv-verl/bin/python -m bench.verl                          # the installed verl (ci/verl_test's venv)
    PYTHONPATH=.verl-trees/<commit> .venv-verl/bin/python -m bench.verl   # verl HEAD (ci/verl_test extracts it)
    .venv-verl/bin/python -m bench.verl --quick                  # one workload, one layout (smoke run)
    .venv-verl/bin/python -m bench.verl --only time --repeats 5  # the planning-time table alone

**One trainer step, as verl runs it** (everything named "verl" below is verl's code, imported from the installed
verl or a tree on ``PYTHONPATH``; nothing of it is copied here):

1. dispatch: the V1 trainer's ``_balance_batch``: ``get_seqlen_balanced_partitions(calculate_workload(lengths), dp,
   equal_size=True)``, the partitions concatenated in order, and equal contiguous chunks per DP rank;
2. mini-batches: each rank's chunk sliced into ``--mini-batches`` contiguous mini-batches (``shuffle`` off);
3. micro-batches, per mini-batch, by either
   * **verl**: ``rearrange_micro_batches`` (what ``prepare_micro_batches`` calls) on each rank's samples, with the
     DP group's agreement emulated without processes: every rank is re-run with ``min_num_micro_batch`` = the
     largest count any rank returned until all return the same count (verl's MAX all-reduce; its cap loop, where
     the version has one, re-partitions in lockstep the same way);
   * **engine**: :func:`slime_ext.integrations.verl.plan.plan_engine_step` on the same ranks' samples (what
     ``SLIME_EXT_VERL=1`` runs inside the engine), told the pipeline size;
   * **trainer**: the trainer depth: :func:`slime_ext.integrations.verl.plan.plan_dispatch` instead of step 1 (per
     mini-batch, equal counts per rank, FLOPs balanced; ``SLIME_EXT_VERL=trainer``), then the engine depth.

**Columns**, summed or taken over the step's mini-batches: micro-batches holding more than one sample above the cap
(``over cap``); micro-batches per rank (per mini-batch, the same on every rank); the per-mini-batch FLOPs max/mean over
DP ranks (the worst mini-batch; it is the dispatch's: verl's for verl and the engine depth, slime-ext's for the
trainer depth); the predicted step time at pp 1, 4 and 8
(each mini-batch: its slowest replica's makespan in the micro-batch order the plan runs, priced the same way for
every plan by slime-ext's pipeline model, :func:`slime_ext.schedule.pipeline_pricing.pipeline_pricing`: forward FLOPs of
Qwen3-8B-like dims plus 2% of a full micro-batch, backward twice forward; pp 1 is the same model with one stage),
relative to verl's, for the engine depth before issue 30 (``before``: commit :data:`BASELINE`'s whole ``slime_ext``,
its plan.py and the planner it ran on, extracted with ``git archive`` and run in a subprocess: :class:`Baseline`),
the engine depth and the trainer depth; ``plan ms per rank``: each
rank's planning per mini-batch, CPU time (``before``: one call plans every rank, on every rank).

**Planning time** (issue 30; :func:`print_planning_times`): rl-like lengths dispatched by verl's V1 functions to dp 8,
32 and 128 ranks, 16 and 64 samples per rank (one mini-batch), pp 1, pp 4 and pp 4 x VPP 2 (group 4). Each rank's
stages are timed as the engine runs them on that rank (its draft on its own samples; the agreement and its
micro-batches; the invariant check), one process playing every rank in turn; the all-reduce between them is not run
here but measured separately over gloo (:func:`collective_times`). Beside it, verl's own ``rearrange_micro_batches``
(imported from the installed verl) on each rank's samples, nested ``input_ids`` as verl's engine holds them, with the
count its all-reduce would agree on passed in (the all-reduce itself not run; ``build``: the part of it that builds
the micro-batch TensorDicts), and the 'before' engine depth (all-gathered lengths, every rank planned on every rank;
one call = one rank's time, its all-gathers not run). Times are CPU time of this process (``CLOCK``), each rank's
best of ``--repeats`` runs, median and max over the ranks.

Workloads (:data:`bench.workloads.ROLLOUT_SHAPES`): ``rl-like``, ``bimodal``, ``long tail``; 1024
samples per trainer step, dp 8, 4 mini-batches (32 samples per rank per mini-batch), cap 16384; lengths are clipped to
the cap, since verl refuses a longer sample (its config makes the longest prompt + response fit).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from slime_ext.integrations.verl.plan import (GRID_MULTIPLES, Ballot, EngineLayout, EngineSearch, agree,
                                              check_rank_plan, draft_rank, finish_rank, plan_dispatch,
                                              plan_engine_step)
from slime_ext.schedule import CostModel, ParallelConfig, PlannerConfig
from slime_ext.schedule.cost import sample_costs
from slime_ext.schedule.pipeline_model import PipelineSpec
from slime_ext.schedule.pipeline_pricing import PipelinePricing, pipeline_pricing

from .runner import add_planner_fields, parser, planner_config
from .workloads import MAX_TOKENS_PER_GPU, MODEL_DIMS, ROLLOUT_SHAPES, make_lengths

N, DP, MINI_BATCHES, SEED = 1024, 8, 4, 1
#: the engine depth before issue 30 (every rank planned every rank), for the 'before' columns
BASELINE = "cfaa6b5"
#: planning times are CPU time of this process (one process plays every rank, one after the other; the machine is
#: shared, and wall time there would count other people's work too)
CLOCK = time.process_time
PP_SIZES = (1, 4, 8)


def dispatch(lengths: np.ndarray, dp: int) -> list[np.ndarray]:
    """verl's V1 ``_balance_batch``: equal-count, workload-balanced partitions, concatenated; rank r's chunk."""
    import torch
    import verl.utils.seqlen_balancing as verl_balancing  # verl's module, used by attribute (nothing copied here)

    workload = verl_balancing.calculate_workload(torch.as_tensor(lengths)).tolist()
    parts = verl_balancing.get_seqlen_balanced_partitions(workload, k_partitions=dp, equal_size=True)
    order = np.array([j for p in parts for j in p])
    return list(order.reshape(dp, -1))


def _verl_batch(lengths):
    import torch
    from tensordict import TensorDict

    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.int8)
    for i, L in enumerate(lengths):
        mask[i, :L] = 1
    return TensorDict({"input_ids": mask, "attention_mask": mask}, batch_size=[len(lengths)])


def verl_plan(ranks: list[list[int]], cap: int, divided_by: int | None) -> list[list[list[int]]]:
    """verl's ``rearrange_micro_batches`` on every rank, agreeing on one count as its DP all-reduce does."""
    import verl.utils.seqlen_balancing as verl_balancing

    batches = [_verl_batch(x) for x in ranks]
    count = None
    for _ in range(64):
        plans = [verl_balancing.rearrange_micro_batches(b, max_token_len=cap, dp_group=None,
                                                        num_batches_divided_by=divided_by,
                                                        min_num_micro_batch=count)[1] for b in batches]
        counts = {len(p) for p in plans}
        if len(counts) == 1:
            return plans
        count = max(counts)
    raise AssertionError("verl's emulated DP agreement did not settle")


def pricing_for(pp: int, cost_model: CostModel, cap: int) -> PipelinePricing:
    if pp > 1:
        return pipeline_pricing(ParallelConfig(dp_size=DP, pp_size=pp), cost_model, cap)
    two = pipeline_pricing(ParallelConfig(dp_size=DP, pp_size=2), cost_model, cap)
    return dataclasses.replace(two, spec=PipelineSpec(pp_size=1), scale=1.0, stage_share=None)  # one stage


@dataclasses.dataclass
class Tally:
    over_cap: int = 0
    counts: list[int] = dataclasses.field(default_factory=list)
    makespan: float = 0.0
    plan_s: float = 0.0


def judge(tally: Tally, plans, ranks, costs, lengths, cap, pricing) -> None:
    """Add one mini-batch's plan (``plans[r]`` = rank r's micro-batches as positions into ``ranks[r]``)."""
    counts = {len(p) for p in plans}
    assert len(counts) == 1, f"counts differ across ranks: {counts}"
    tally.counts.append(counts.pop())
    rows = []
    for idx, mbs in zip(ranks, plans):
        seen = sorted(i for mb in mbs for i in mb)
        assert seen == list(range(len(idx))), "a plan does not train each sample once"
        for mb in mbs:
            members = idx[list(mb)]
            if len(mb) > 1 and int(lengths[members].sum()) > cap:
                tally.over_cap += 1
        rows.append([float(costs[idx[list(mb)]].sum()) for mb in mbs])
    tally.makespan += float(pricing.makespans(np.array(rows)).max())


def _minis(chunks: list[np.ndarray], mini_batches: int) -> list[list[np.ndarray]]:
    per = len(chunks[0]) // mini_batches
    return [[c[m * per:(m + 1) * per] for c in chunks] for m in range(mini_batches)]


def _balance(minis, costs) -> float:
    """The worst mini-batch's FLOPs max/mean over DP ranks."""
    return max(float(max(costs[x].sum() for x in ranks) / np.mean([costs[x].sum() for x in ranks]))
               for ranks in minis)


#: what :class:`Baseline`'s subprocess runs: JSON lines in (one mini-batch each), JSON lines out
_BASELINE_WORKER = r"""
import json, sys, time
from slime_ext.integrations.verl.plan import EngineLayout, plan_engine_step
from slime_ext.schedule import CostModel
for line in sys.stdin:
    ask = json.loads(line)
    try:
        t = time.process_time()
        plan = plan_engine_step(ask["ranks"], ask["cap"], EngineLayout(*ask["layout"]),
                                cost_model=CostModel(**ask["dims"]))
        out = {"micro_batches": plan.micro_batches, "count": plan.count, "seconds": time.process_time() - t}
    except Exception as exc:  # noqa: BLE001 -- reported by the caller
        out = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out), flush=True)
"""


class Baseline:
    """The engine depth of commit ``rev`` as it ran then: that commit's whole ``slime_ext`` (its ``plan.py`` and
    the planner under it), extracted with ``git archive`` and run in a subprocess of this Python, one mini-batch
    per request; its planning time is the CPU time of the call in that process."""

    def __init__(self, rev: str, tree: str, proc: subprocess.Popen) -> None:
        self.rev, self.tree, self._proc = rev, tree, proc

    def plan_engine_step(self, ranks, cap: int, pp: int, vpp: int = 1, group: int | None = None) -> dict:
        """``{"micro_batches", "count", "seconds"}`` of the old engine depth on ``ranks`` (every rank planned)."""
        ask = {"ranks": [[int(v) for v in x] for x in ranks], "cap": int(cap), "layout": [pp, vpp, group],
               "dims": dict(MODEL_DIMS)}
        self._proc.stdin.write(json.dumps(ask) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.rev}'s engine depth stopped (its subprocess exited {self._proc.poll()})")
        got = json.loads(line)
        if "error" in got:
            raise RuntimeError(f"{self.rev}'s engine depth failed: {got['error']}")
        return got

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        shutil.rmtree(self.tree, ignore_errors=True)


def load_baseline(rev: str) -> Baseline | str:
    """The engine depth of commit ``rev`` with the planner it ran on (:class:`Baseline`), or why it cannot be
    loaded (no git, a shallow clone without ``rev``)."""
    root = Path(__file__).resolve().parents[1]
    tree = tempfile.mkdtemp(prefix=f"slime-ext-{rev}-")
    try:
        archive = subprocess.run(["git", "archive", rev, "slime_ext"], cwd=root, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        shutil.rmtree(tree, ignore_errors=True)
        return f"cannot extract {rev}'s slime_ext with git ({exc}); run from a clone that has commit {rev}"
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.Popen([sys.executable, "-c", _BASELINE_WORKER], cwd=tree, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    baseline = Baseline(rev, tree, proc)
    try:  # one small mini-batch: it imports and runs
        baseline.plan_engine_step([[100, 200], [300, 50]], 1024, 1)
    except RuntimeError as exc:
        baseline.close()
        return str(exc)
    return baseline


def run_case(name: str, n: int, dp: int, mini_batches: int, pp_sizes=PP_SIZES,
             baseline: Baseline | None = None, search: EngineSearch = EngineSearch()) -> list[dict]:
    cost_model = CostModel(**MODEL_DIMS)
    cap = MAX_TOKENS_PER_GPU
    # verl refuses a sample longer than the cap (its config makes max prompt + response fit): clip to it
    lengths = np.minimum(make_lengths(ROLLOUT_SHAPES[name], n, SEED), cap)
    costs = sample_costs(lengths, cost_model)
    minis = _minis(dispatch(lengths, dp), mini_batches)
    # the trainer depth: slime-ext's dispatch (per mini-batch, equal counts), then the engine depth
    order = np.asarray(plan_dispatch(lengths, dp, n // mini_batches, cost_model=cost_model))
    trainer_minis = _minis(list(order.reshape(dp, -1)), mini_batches)
    t = CLOCK()
    verl_plans = [verl_plan([lengths[x].tolist() for x in ranks], cap, None) for ranks in minis]
    verl_s = CLOCK() - t
    out = []
    for pp in pp_sizes:
        pricing = pricing_for(pp, cost_model, cap)
        verl, ours, trainer, before = Tally(plan_s=verl_s), Tally(), Tally(), Tally()
        for ranks, vplans in zip(minis, verl_plans):
            judge(verl, vplans, ranks, costs, lengths, cap, pricing)
            t = CLOCK()
            plan = plan_engine_step([lengths[x] for x in ranks], cap, EngineLayout(pp_size=pp), cost_model=cost_model,
                                    search=search)
            ours.plan_s += (CLOCK() - t) / dp  # one process plans every rank: per rank
            judge(ours, [list(map(list, p)) for p in plan.micro_batches], ranks, costs, lengths, cap, pricing)
            if baseline is not None:  # every rank planned every rank: one call is one rank's time
                old = baseline.plan_engine_step([lengths[x] for x in ranks], cap, pp)
                before.plan_s += old["seconds"]
                judge(before, old["micro_batches"], ranks, costs, lengths, cap, pricing)
        for ranks in trainer_minis:
            plan = plan_engine_step([lengths[x] for x in ranks], cap, EngineLayout(pp_size=pp), cost_model=cost_model,
                                    search=search)
            judge(trainer, [list(map(list, p)) for p in plan.micro_batches], ranks, costs, lengths, cap, pricing)
        out.append(dict(name=name, pp=pp, balance=_balance(minis, costs),
                        trainer_balance=_balance(trainer_minis, costs),
                        verl=verl, ours=ours, trainer=trainer, before=before if baseline is not None else None,
                        units=pricing.units))
    return out


def _counts(t: Tally) -> str:
    return ",".join(map(str, t.counts))


# ---------------------------------------------------------------------------------------------------- planning time
#: the planning-time table (issue 30): DP sizes, samples per rank per mini-batch, layouts
TIME_DPS = (8, 32, 128)
TIME_SAMPLES = (16, 64)
TIME_LAYOUTS = {"pp 1": EngineLayout(), "pp 4": EngineLayout(pp_size=4),
                "pp 4 x vpp 2": EngineLayout(pp_size=4, vpp_size=2, vpp_group=4)}


def time_ours(ranks: list[np.ndarray], cap: int, layout: EngineLayout, cost_model: CostModel,
              search: EngineSearch) -> tuple[np.ndarray, int]:
    """Each rank's planning, timed as the engine runs it on that rank: its draft (its own samples), then the
    agreement and its micro-batches at the agreed count, with the invariant check. The collective between the two
    is the element-wise MAX of the ballots here (not timed; measured separately: :func:`collective_times`).
    Returns per-rank seconds and the agreed count."""
    drafts, seconds = [], []
    for r, x in enumerate(ranks):
        t = CLOCK()
        drafts.append(draft_rank(x, cap, layout, rank=r, cost_model=cost_model, search=search))
        seconds.append(CLOCK() - t)
    reduced = Ballot.reduce([d.ballot.vector() for d in drafts])
    count = None
    for r, d in enumerate(drafts):
        t = CLOCK()
        agreement = agree(reduced, layout, cap, mine=d)
        plan = finish_rank(d, agreement)
        check_rank_plan(plan.micro_batches, plan.count, d.lengths, cap, layout.align, r)
        seconds[r] += CLOCK() - t
        count = plan.count
    return np.asarray(seconds), count


def _nested_batch(lengths):
    """A batch as verl's engine holds it: nested ``input_ids``."""
    import torch
    from tensordict import TensorDict

    ids = torch.nested.as_nested_tensor([torch.ones(int(L), dtype=torch.int64) for L in lengths], layout=torch.jagged)
    return TensorDict({"input_ids": ids}, batch_size=[len(lengths)])


def time_verl(ranks: list[np.ndarray], cap: int, divided_by: int | None) -> tuple[np.ndarray, np.ndarray]:
    """verl's own ``rearrange_micro_batches`` on each rank (imported from the installed verl), timed per rank: one
    call with the count its MAX all-reduce would return (the largest any rank asks for, passed as
    ``min_num_micro_batch``; the all-reduce itself is not run). Returns per-rank seconds, and the part of them that
    builds the micro-batch TensorDicts (verl's ``index_select_tensor_dict`` on the returned partition)."""
    import verl.utils.seqlen_balancing as verl_balancing
    from verl.utils import tensordict_utils as tu

    batches = [_nested_batch(x) for x in ranks]
    counts = [len(verl_balancing.rearrange_micro_batches(b, max_token_len=cap, num_batches_divided_by=divided_by)[1])
              for b in batches]
    agreed = max(counts)
    seconds, building = [], []
    for b in batches:
        t = CLOCK()
        _, parts = verl_balancing.rearrange_micro_batches(b, max_token_len=cap, num_batches_divided_by=divided_by,
                                                          min_num_micro_batch=agreed)
        seconds.append(CLOCK() - t)
        t = CLOCK()
        for p in parts:
            tu.index_select_tensor_dict(b, p)
        building.append(CLOCK() - t)
    return np.asarray(seconds), np.asarray(building)


def planning_times(dp: int, per_rank: int, layout: EngineLayout, repeats: int, baseline: Baseline | None,
                   search: EngineSearch) -> dict:
    """One cell of the planning-time table: rl-like lengths (cap 16384, Qwen3-8B-like FLOPs), dispatched by verl's
    V1 functions, ``per_rank`` samples on each of ``dp`` ranks; per-rank seconds (median and max over ranks, the
    best of ``repeats`` runs) for slime-ext, verl's ``rearrange_micro_batches`` and (once) the baseline."""
    cost_model, cap = CostModel(**MODEL_DIMS), MAX_TOKENS_PER_GPU
    lengths = np.minimum(make_lengths("rl", dp * per_rank, SEED), cap)
    ranks = [lengths[x] for x in dispatch(lengths, dp)]
    ours = np.min([time_ours(ranks, cap, layout, cost_model, search)[0] for _ in range(repeats)], axis=0)
    verl_runs = [time_verl(ranks, cap, layout.vpp_group) for _ in range(repeats)]
    verl_s = np.min([v for v, _ in verl_runs], axis=0)
    verl_build = np.min([b for _, b in verl_runs], axis=0)
    out = dict(ours_median=float(np.median(ours)), ours_max=float(ours.max()),
               verl_median=float(np.median(verl_s)), verl_max=float(verl_s.max()),
               verl_build=float(np.median(verl_build)), count=time_ours(ranks, cap, layout, cost_model, search)[1])
    if baseline is not None:  # every rank runs exactly this (after its all-gathers); CPU time in its process
        old = baseline.plan_engine_step(ranks, cap, layout.pp_size, layout.vpp_size, layout.vpp_group)
        out["before"] = old["seconds"]
        out["before_count"] = old["count"]
    return out


def _collective_worker(rank: int, world: int, init: str, size: int, rounds: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    t = torch.zeros(size, dtype=torch.float64)
    took = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        took.append(time.perf_counter() - start)
    out.put((rank, statistics.median(took)))
    dist.destroy_process_group()


def collective_times(worlds=(2,), rounds: int = 200) -> dict[int, float]:
    """The ballot's all-reduce (MAX, ``Ballot.HEAD + len(GRID_MULTIPLES)`` float64) over gloo on this machine:
    the median per call on the slowest rank, per world size (a stand-in: a job runs it over NCCL on its DP group;
    more processes than this machine's 2 cores would time the scheduler, not the collective)."""
    import multiprocessing as mp
    import tempfile

    size = Ballot.HEAD + len(GRID_MULTIPLES)
    ctx = mp.get_context("spawn")
    out = {}
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            q = ctx.Queue()
            procs = [ctx.Process(target=_collective_worker, args=(r, world, f"file://{tmp}/init", size, rounds, q))
                     for r in range(world)]
            for p in procs:
                p.start()
            got = [q.get(timeout=300) for _ in procs]
            for p in procs:
                p.join()
        out[world] = max(t for _, t in got)
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:,.2f}" if x < 1 else f"{x * 1e3:,.0f}"


def print_planning_times(dps, sizes, layouts, repeats, baseline, search, collective) -> list[dict]:
    import torch
    import verl

    torch.set_num_threads(1)  # verl's tensors on one thread, as the planner's numpy (CPU time counts every thread)
    coll = collective.get(2, 0.0) if collective else 0.0
    rows = []
    print(f"\nplanning time per rank per mini-batch (issue 30), verl {verl.__version__}; rl-like lengths, cap "
          f"{MAX_TOKENS_PER_GPU}; CPU ms; slime-ext and verl: median / max over the ranks, each rank's best of "
          f"{repeats} runs; '+ coll.': the median plus the ballot's all-reduce measured below (gloo, 2 processes); "
          f"'before' (every rank plans every rank, so one call is one rank's time, its all-gathers not run): one run")
    print(f"{'dp':>4} {'samples':>7} {'layout':<13} | {'slime-ext':^17} {'+ coll.':>7} | {'verl rearrange':^17} "
          f"{'(build)':>7} | {'before':>8} | {'count':>5} {'before':>6}")
    for per_rank in sizes:
        for name, layout in layouts.items():
            for dp in dps:
                cell = planning_times(dp, per_rank, layout, repeats, baseline, search)
                cell.update(dp=dp, samples=per_rank, layout=name)
                rows.append(cell)
                before = _ms(cell["before"]) if "before" in cell else "-"
                print(f"{dp:>4} {per_rank:>7} {name:<13} | {_ms(cell['ours_median']):>8} {_ms(cell['ours_max']):>8} "
                      f"{_ms(cell['ours_median'] + coll):>7} | {_ms(cell['verl_median']):>8} "
                      f"{_ms(cell['verl_max']):>8} {_ms(cell['verl_build']):>7} | {before:>8} | {cell['count']:>5} "
                      f"{cell.get('before_count', '-'):>6}")
    print("\nratios (slime-ext, median per rank; with the all-reduce in brackets):")
    for per_rank in sizes:
        for name in layouts:
            cells = {c["dp"]: c for c in rows if c["samples"] == per_rank and c["layout"] == name}
            if min(dps) in cells and max(dps) in cells:
                r = cells[max(dps)]["ours_median"] / cells[min(dps)]["ours_median"]
                print(f"  {per_rank:>3} samples, {name:<13}: dp {max(dps)} / dp {min(dps)} = {r:.2f} (target <= 1.5)")
        for dp in dps:
            cells = {c["layout"]: c for c in rows if c["samples"] == per_rank and c["dp"] == dp}
            if "pp 1" in cells:
                for name in layouts:
                    if name != "pp 1" and name in cells:
                        a, b = cells[name]["ours_median"], cells["pp 1"]["ours_median"]
                        print(f"  {per_rank:>3} samples, dp {dp:>3}: {name} / pp 1 = {a / b:.2f} "
                              f"({(a + coll) / (b + coll):.2f}) (target <= 5)")
    if collective:
        print("\nthe collective, measured separately (one process plays every rank above): the ballot's all-reduce "
              f"(MAX, {Ballot.HEAD + len(GRID_MULTIPLES)} float64) over gloo on this machine, median per call on the "
              "slowest process: " + ", ".join(f"{w} processes: {t * 1e3:.3f} ms" for w, t in collective.items()) +
              " (a job runs it over NCCL on its DP group)")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="rl-like only, pp 1 and 4, 256 samples; dp 8 and 32, 16 samples per rank in the "
                               "timing table")
    ap.add_argument("--dp", type=int, default=DP)
    ap.add_argument("--samples", type=int, default=N, help="samples per trainer step")
    ap.add_argument("--mini-batches", type=int, default=MINI_BATCHES)
    ap.add_argument("--baseline", default=BASELINE, help="the commit whose engine-depth plan is 'before' ('none': "
                                                         "skip it)")
    ap.add_argument("--only", choices=("steps", "time"), help="print one of the two tables")
    ap.add_argument("--repeats", type=int, default=3, help="timing runs per cell (the best is kept)")
    ap.add_argument("--no-collective", action="store_true", help="skip the gloo measurement of the all-reduce")
    for f in dataclasses.fields(EngineSearch):
        if f.type in ("float", "bool"):
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=float if f.type == "float" else int,
                            default=None, help=f"EngineSearch.{f.name} (default {f.default})")
    add_planner_fields(ap, "the engine depth's shaping (its shapes, scan_shapes, ...), e.g. "
                           "--set scan_shapes=[[0,0,1.0]]")
    args = ap.parse_args(argv)
    import verl

    search = EngineSearch(**{f.name: (bool if f.type == "bool" else float)(getattr(args, f.name))
                             for f in dataclasses.fields(EngineSearch)
                             if f.type in ("float", "bool") and getattr(args, f.name) is not None},
                          planner=planner_config(args.overrides) or PlannerConfig())
    baseline = None
    if args.baseline != "none":
        got = load_baseline(args.baseline)
        if isinstance(got, str):
            print(f"no 'before' column: {got}")
        else:
            baseline = got
    names = ["rl-like"] if args.quick else list(ROLLOUT_SHAPES)
    pps = (1, 4) if args.quick else PP_SIZES
    n = 256 if args.quick else args.samples
    if args.only != "time":
        print(f"verl {verl.__version__} ({verl.__path__[0]}); {n} samples per step, dp {args.dp}, "
              f"{args.mini_batches} mini-batches, cap {MAX_TOKENS_PER_GPU}; Qwen3-8B-like FLOPs; 'before': "
              f"{args.baseline if baseline is not None else '-'}'s engine depth")
        print(f"{'':<10} {'':>2} | {'over cap':^17} | {'micro-batches per rank':^41} | {'FLOPs max/mean':^15} | "
              f"{'step time / verl':^26} | {'plan ms per rank':^15}")
        print(f"{'workload':<10} {'pp':>2} | {'verl':>8} {'ours':>8} | {'verl':>13} {'engine':>13} {'trainer':>13} | "
              f"{'verl':>7} {'trainer':>7} | {'before':>8} {'engine':>8} {'trainer':>8} | {'before':>7} {'engine':>7}")
        for name in names:
            for row in run_case(name, n, args.dp, args.mini_batches, pps, baseline, search):
                v, o, t, b = row["verl"], row["ours"], row["trainer"], row["before"]
                before = f"{b.makespan / v.makespan:>8.3f}" if b is not None else f"{'-':>8}"
                before_ms = f"{b.plan_s * 1e3 / args.mini_batches:>7.1f}" if b is not None else f"{'-':>7}"
                print(f"{name:<10} {row['pp']:>2} | {v.over_cap:>8} {o.over_cap + t.over_cap:>8} | {_counts(v):>13} "
                      f"{_counts(o):>13} {_counts(t):>13} | {row['balance']:>7.3f} {row['trainer_balance']:>7.3f} | "
                      f"{before} {o.makespan / v.makespan:>8.3f} {t.makespan / v.makespan:>8.3f} | {before_ms} "
                      f"{o.plan_s * 1e3 / args.mini_batches:>7.2f}")
    if args.only != "steps":
        dps, sizes = ((8, 32), (16,)) if args.quick else (TIME_DPS, TIME_SAMPLES)
        collective = None if args.no_collective else collective_times()
        print_planning_times(dps, sizes, TIME_LAYOUTS, args.repeats, baseline, search, collective)
    if baseline is not None:
        baseline.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
