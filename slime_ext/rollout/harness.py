"""What both launchers share (:mod:`.driver` with Ray, :mod:`.processes` without): the train processes' environment,
the error for a wait that ran out, the run's result records, its step table, and the end of every rollout (the
ledger check, the step rows). Both launchers import it; it imports neither.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from slime_ext.schedule import CostModel
from slime_ext.schemes import PlanInfo, RankResult

from .config import RunConfig
from .ledger import check_ledger


class StepTimeout(TimeoutError):
    """Actor calls still running after their timeout; the message names them."""


class LedgerError(RuntimeError):
    """A trained rollout broke a ledger invariant (:mod:`slime_ext.rollout.ledger`)."""


# ---------------------------------------------------------------------------------------------------- processes
def _package_root() -> str:
    """The directory that holds ``slime_ext``: the repo in a checkout, site-packages installed."""
    return str(Path(__file__).resolve().parents[2])


#: megatron-core warnings that only say TE/Apex are missing (always true on CPU)
_CPU_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated")


def worker_env(device: str, extra_pythonpath: Sequence[str] = ()) -> dict[str, str]:
    """Environment of every actor: ``slime_ext`` importable, one compute thread per process on CPU."""
    paths = [_package_root(), *map(str, extra_pythonpath)]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "RAY_USAGE_STATS_ENABLED": "0"}
    if device == "cpu":
        env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
        # expected on a CPU host without TE/Apex; every other warning still shows
        env["PYTHONWARNINGS"] = ",".join(f"ignore:{m}:UserWarning" for m in _CPU_WARNINGS)
    return env


# ---------------------------------------------------------------------------------------------------- results
@dataclass
class RolloutResult:
    rollout_id: int
    plan: PlanInfo
    ranks: list[RankResult]
    rows: list[dict]
    generate_seconds: float
    seconds: float


@dataclass
class RunResult:
    config: RunConfig
    layouts: list[dict]
    rollouts: list[RolloutResult] = field(default_factory=list)
    seconds: float = 0.0
    #: wall seconds of each phase (:class:`Phases`), in the order they ran
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def rows(self) -> list[dict]:
        return [row for r in self.rollouts for row in r.rows]


def step_rows(config: RunConfig, plan: PlanInfo, ranks: list[RankResult]) -> list[dict]:
    """Per step: samples, micro-batches per DP rank, tokens and estimated FLOPs per DP rank, loss, LR, time."""
    lengths = plan.total_lengths
    cost = CostModel.from_args(config.args())
    flops = cost.flops(lengths).tolist() if cost is not None else [float(x) for x in lengths]
    stage0 = sorted((r for r in ranks if r.pp_rank == 0), key=lambda r: r.dp_rank)
    rows = []
    for s in range(plan.num_steps):
        recs = [r.records[s] for r in stage0]
        tokens = [sum(lengths[i] for mb in rec.ledger for i in mb) for rec in recs]
        rank_flops = [sum(flops[i] for mb in rec.ledger for i in mb) for rec in recs]
        mean_flops = sum(rank_flops) / len(rank_flops)
        rows.append({
            "rollout": plan.rollout_id,
            "step": s,
            "samples": recs[0].samples,
            "mbs_per_rank": [rec.num_microbatches for rec in recs],
            "tokens_per_rank": tokens,
            "flops_balance": max(rank_flops) / mean_flops if mean_flops else 1.0,
            "loss": recs[0].loss,
            "lr": recs[0].lr,
            "seconds": max(r.records[s].seconds for r in ranks),
        })
    return rows


HEADER = (f"{'rollout':>7} {'step':>4} {'samples':>7} {'mbs/rank':>10} {'tokens/rank':>15} {'FLOPs max/mean':>14} "
          f"{'loss':>10} {'lr':>9} {'time s':>7}")


def format_row(row: dict) -> str:
    mbs = ",".join(str(m) for m in row["mbs_per_rank"])
    tokens = ",".join(str(t) for t in row["tokens_per_rank"])
    return (f"{row['rollout']:>7} {row['step']:>4} {row['samples']:>7} {mbs:>10} {tokens:>15} "
            f"{row['flops_balance']:>14.3f} {row['loss']:>10.4f} {row['lr']:>9.2e} {row['seconds']:>7.2f}")


#: what the step table's columns mean, printed under it
LEGEND = (
    "columns: samples = samples trained in the step; mbs/rank = micro-batches per DP rank; tokens/rank = tokens per "
    "DP rank; FLOPs max/mean = the slowest DP rank's estimated FLOPs over the mean (1.000 is perfect balance);",
    "  loss = the policy-gradient loss, -advantage x log p averaged over the step's loss tokens; an advantage is a "
    "reward minus its prompt group's mean, so the loss takes either sign: a negative loss is expected, not a fault;",
    "  lr = the learning rate the step trained with: Megatron's warm-up starts at 0 (lr_warmup_samples), so step 0 "
    "of rollout 0 shows 0.00e+00 and changes no weight; time s = the slowest train rank's wall time for the step.",
)


class Phases:
    """Announces each phase of a run on ``emit`` as it starts and ends, and keeps its wall time, so a run says
    what it is waiting for and, at the end, where the time went (:func:`time_summary`)."""

    def __init__(self, emit: Callable[[str], None]):
        self.emit = emit
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, doing: str, done: str | None = "ready"):
        """``name: doing ...`` now; ``name: done in X s`` after (nothing with ``done=None``)."""
        self.emit(f"{name}: {doing}")
        t0 = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - t0
        if done is not None:
            self.emit(f"{name}: {done} in {self.seconds[name]:.1f} s")


def time_summary(result: "RunResult") -> str:
    """One line: each phase's wall time, and how much of the steps phase the training itself took."""
    trained = sum(row["seconds"] for row in result.rows)
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result.phases.items())
    return (f"where the time went: {phases}; of the steps, training took {trained:.1f} s (the time s column), "
            f"the rest generated the rollouts, planned them and handed them to the ranks")


def describe(config: RunConfig) -> str:
    t = config.train
    b = t.batch
    batch = (f"dynamic max_tokens_per_gpu={b.max_tokens_per_gpu}" if b.use_dynamic_batch_size
             else f"static micro_batch_size={b.micro_batch_size}")
    gbs = "dynamic" if b.use_dynamic_global_batch_size else str(b.global_batch_size)
    return (f"world={config.world_size} dp={config.dp_size} pp={t.parallel.pp_size} "
            f"vpp={t.parallel.vpp_size} backend={t.dist_backend} | dp_schedule={t.dp_schedule} batch={batch} "
            f"global_batch_size={gbs} balance_data={b.balance_data} | model layers={t.model.num_layers} "
            f"hidden={t.model.hidden_size} vocab={t.model.vocab_size} seq={t.model.seq_length}")


def finish_rollout(config, rollout_id: int, plan, ranks: list, emit: Callable[[str], None],
                   generate_seconds: float, t0: float) -> "RolloutResult":
    """What every launcher does once a rollout trained: check the ledger (``verify_ledger``), print its step rows,
    and return its :class:`RolloutResult` (``t0``: when the rollout started)."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    if config.options["verify_ledger"]:
        problems = check_ledger(plan, ranks)
        if problems:
            raise LedgerError(f"rollout {rollout_id}: the trained samples do not match the plan:\n  "
                              + "\n  ".join(problems))
    rows = step_rows(config, plan, ranks)
    for row in rows:
        emit(format_row(row))
    return RolloutResult(rollout_id=rollout_id, plan=plan, ranks=ranks, rows=rows,
                         generate_seconds=generate_seconds, seconds=time.perf_counter() - t0)
