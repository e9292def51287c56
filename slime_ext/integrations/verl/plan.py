"""slime-ext's plans for verl, at two depths: the engine depth (one mini-batch's micro-batches on each DP rank of
verl's Megatron engine: :func:`draft_rank`, :func:`agree`, :func:`finish_rank`) and the trainer depth
(:func:`plan_dispatch`: which samples each DP rank trains in each mini-batch, before verl dispatches them).

**The engine depth.**
Inside ``MegatronEngine.forward_backward_batch`` each DP rank already holds its samples (verl dispatched them), so
the plan cannot move samples between ranks; it decides how each rank cuts its own samples into micro-batches and
how many micro-batches every rank runs. Each rank plans **only its own samples**; the ranks agree on the count
through one all-reduce (MAX) of a small vector, the *ballot* (:class:`Ballot`), so a rank's work does not grow with
the DP size.

Strategy, per mini-batch:

1. **Draft** (:func:`draft_rank`, each rank on its own samples). Without a pipeline: slime-ext's planner packs the
   rank's samples under the cap, FLOP-balanced (``pack_replica``: the planner's own packing of one replica); its
   count, rounded up to the VPP group, is the rank's *need* (at least verl's ``min_num_micro_batch``). With
   ``pp_size > 1``: the rank's samples are shaped for the pipeline at every count of the ballot's grid from the
   fewest the cap could allow (tokens / cap, and one micro-batch per sample over half the cap) up to ``reach``
   times that (:class:`EngineSearch`) by the planner's shaping (``scan_replica``: ``PlannerConfig.shaping.scan_shapes`` at
   every count, the heuristic run orders, every count in one packing call and one pass of the pipeline model).
   Its need is the fewest count that fits there, or the planner's count where the cap is tight. A forward-only
   pass (verl's log-prob and reference passes) is priced by the pipeline's forward-only schedules.
2. **Ballot** (what travels; :class:`Ballot`): the rank's need, minus its sample count, whether its draft failed,
   and per count of a fixed grid (:data:`GRID_MULTIPLES`: every multiple of the VPP group up to 16 of them, then
   each about 10% above the last) its predicted makespan, ``+inf`` where it cannot run that count (below its need,
   above its sample count, or no packing holds the cap) and ``-inf`` where it did not price it (above its reach:
   it raises no objection). 61 float64 (488 bytes), whatever the DP size.
3. **Agree** (:func:`agree`, every rank on the same reduced vector, so on the same answer): the element-wise MAX
   over the DP group gives the largest need, the fewest samples, and per count the slowest rank's makespan. The
   count is the grid count between the two whose slowest rank is predicted fastest (ties: the smaller count);
   without a pipeline, or where no grid count was priced by anyone and refused by no one, the largest need. A
   need above the fewest samples, an empty rank or a failed draft is the same ``ScheduleError`` on every rank,
   after the collective, so no rank hangs.
4. **Finish** (:func:`finish_rank`, each rank): without a pipeline, the draft's micro-batches where their count is
   the agreed one, else the rank's samples in exactly that many, balanced under the cap (``shape_replica``). With
   one, the draft's shaped packing at the agreed count (a count the rank did not scan is shaped now:
   ``shape_replica``, every ``PlannerConfig.shaping.shapes`` shape and the pipeline model's order search); the ranks within
   ``order_band`` of the slowest run it in the fastest of its shape's order and the model's heuristic orders. The
   slowest rank (the ranks within ``polish_band`` of it) also shapes the agreed count with ``shape_replica`` and
   keeps it where the model predicts it faster.

:func:`plan_engine_step` runs the four stages for all ranks in one process (tests, benchmarks); the engine
(:mod:`.engine`) runs stages 1, 3 and 4 on each rank around one ``all_reduce``.

Invariants (:func:`check_rank_plan` on every rank's plan, :func:`check_engine_plan` over all ranks in the tests):

* every rank has exactly ``count`` micro-batches, the same number on every rank, a multiple of the VPP group;
* each rank's micro-batches hold each of its local indices ``0 .. n_r - 1`` exactly once, none is empty;
* no micro-batch holding more than one sample exceeds the cap (a sample longer than the cap sits alone).

Pure: standard library, numpy and :mod:`slime_ext.schedule`'s public API (the planner, and its one-replica shaping:
``pack_replica``, ``scan_replica``, ``shape_replica``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np

from slime_ext.schedule import (BatchConfig, CostModel, CostProfile, ParallelConfig, PlannerConfig, ReplicaPlan,
                                ReplicaScan, ScheduleError, pack_replica, plan_schedule, scan_replica, shape_replica)

__all__ = ["Agreement", "Ballot", "EngineLayout", "EnginePlan", "EngineSearch", "GRID_MULTIPLES", "RankDraft",
           "RankPlan", "agree", "check_engine_plan", "check_rank_plan", "draft_rank", "finish_rank",
           "plan_dispatch", "plan_engine_step"]


def _grid_multiples(dense: int = 16, growth: float = 1.1, top: int = 1024) -> tuple[int, ...]:
    out = list(range(1, dense + 1))
    while out[-1] < top:
        out.append(max(out[-1] + 1, math.ceil(out[-1] * growth)))
    return tuple(out)


#: a rank's scan reaches at least this many counts (of the alignment) above the least it may need
MIN_REACH_STEPS = 4

#: the counts a ballot prices, as multiples of the alignment (the VPP group, else 1): every one up to 16, then each
#: about 10% above the last, up to 1094 (58 entries); a count above the last is agreed only as the largest need
GRID_MULTIPLES = _grid_multiples()


@lru_cache(maxsize=64)
def _grid(align: int) -> np.ndarray:
    grid = np.asarray(GRID_MULTIPLES, dtype=np.int64) * align
    grid.flags.writeable = False
    return grid


@dataclass(frozen=True)
class EngineLayout:
    """What the engine plan needs of the job's layout: megatron-core's parallel state and verl's
    ``num_batches_divided_by``."""

    pp_size: int = 1
    vpp_size: int = 1
    #: verl's ``num_batches_divided_by`` (megatron's ``microbatch_group_size_per_vp_stage``, which verl passes under
    #: VPP only): every count is a multiple of it
    vpp_group: int | None = None

    @property
    def align(self) -> int:
        """Every count is a multiple of this: the VPP group when verl gives one, else 1."""
        return int(self.vpp_group) if self.vpp_group else 1

    def parallel(self) -> ParallelConfig:
        """One replica's layout as the planner takes it: the pipeline, and under VPP its group (made once per
        layout). The counts' alignment (:attr:`align`) is the engine plan's own: its grid and needs are multiples
        of it."""
        return _parallel(self)

    def grid(self) -> np.ndarray:
        """The counts of the ballot's grid (:data:`GRID_MULTIPLES` times the alignment; read-only)."""
        return _grid(self.align)


@lru_cache(maxsize=64)
def _parallel(layout: EngineLayout) -> ParallelConfig:
    if layout.pp_size == 1:
        return ParallelConfig(dp_size=1)
    return ParallelConfig(dp_size=1, pp_size=layout.pp_size, vpp_size=layout.vpp_size,
                          microbatch_group_size_per_vp_stage=layout.vpp_group if layout.vpp_size > 1 else None)


@dataclass(frozen=True)
class EngineSearch:
    """The engine depth's count search on each rank (``pp_size > 1``); ``python -m bench.verl`` sets the numbers.
    The shapes and run orders are the planner's (``planner``: ``PlannerConfig.shaping.scan_shapes`` at every scanned count,
    ``PlannerConfig.shaping.shapes`` where a rank packs the agreed count afresh)."""

    #: a rank prices the grid's counts from the fewest the cap allows up to ``reach`` times that (at least
    #: MIN_REACH_STEPS counts more); the planner's own count search reaches 2.3 times its pp-unaware count
    #: (``PlannerConfig.count_search.count_factors``). Measured with ``bench.verl`` before the shapes became the planner's: a
    #: smaller reach (1.6-1.8) saved under 10% of the planning and predicted up to 1.6% slower steps
    reach: float = 2.0
    #: the ranks predicted within this share of the slowest at the agreed count (0: the slowest alone; negative:
    #: none) pack that count afresh with every shape of ``PlannerConfig.shaping.shapes`` and the pipeline model's order
    #: search (``shape_replica``), keeping it where it is faster. The step waits for the slowest replica, so that
    #: is where it pays
    polish_band: float = 0.0
    #: the ranks predicted within this share of the slowest at the agreed count run their micro-batches in the
    #: fastest of their shape's order and the pipeline model's heuristic orders (one pass of the model); the others
    #: keep the shape's order (the step does not wait for them). ``bench.verl``'s steps at pp 8 under the trainer
    #: depth (ranks balanced to 1-4%): bimodal 0.802 of verl's step at 0 (the slowest alone), 0.790 at 0.02, 0.787
    #: at 0.05 and every rank (rl-like 0.775, 0.774, 0.774); but at 64 samples per rank every rank of the planning
    #: -time table is within 2% of the slowest, and the extra pass of the model made the median rank's planning
    #: 5-15% dearer under VPP (above pp 1's 5x): 0 keeps it at or below the cost of the shaping this replaced
    order_band: float = 0.0
    #: the planner's tunables: the shapes, the pricing's overhead and ratio, the order search
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    def __post_init__(self) -> None:
        if not (isinstance(self.reach, (int, float)) and not isinstance(self.reach, bool) and self.reach >= 1):
            raise ValueError(f"EngineSearch.reach={self.reach!r} must be a number >= 1 (1 prices the need alone)")
        if not (isinstance(self.order_band, (int, float)) and not isinstance(self.order_band, bool)):
            raise ValueError(f"EngineSearch.order_band={self.order_band!r} must be a number (a share; < 0: none)")
        if not isinstance(self.planner, PlannerConfig):
            raise ValueError(f"EngineSearch.planner={self.planner!r} must be a PlannerConfig")


@dataclass(frozen=True)
class Ballot:
    """What one rank sends, and (element-wise MAX over the DP group) what every rank gets back: one float64 vector of
    ``HEAD + len(GRID_MULTIPLES)`` entries."""

    #: the rank's need: the micro-batches its pp-unaware packing needs under the cap (>= min_count, aligned)
    need: float
    #: its sample count (sent negated, so that the MAX is the fewest)
    samples: float
    #: ``dp_rank + 1`` if its draft failed, else 0 (the MAX names the last failed rank)
    failed: float
    #: per grid count: its predicted makespan, ``+inf`` (cannot run it) or ``-inf`` (not priced: no objection)
    spans: np.ndarray

    HEAD = 3

    def vector(self) -> np.ndarray:
        return np.concatenate(([self.need, -self.samples, self.failed], self.spans)).astype(np.float64)

    @classmethod
    def from_vector(cls, vector: Sequence[float]) -> "Ballot":
        v = np.asarray(vector, dtype=np.float64)
        if v.shape != (cls.HEAD + len(GRID_MULTIPLES),):
            raise ScheduleError(f"a ballot has {cls.HEAD + len(GRID_MULTIPLES)} entries, got shape {v.shape}: every DP "
                                f"rank must run the same slime-ext version")
        return cls(need=float(v[0]), samples=float(-v[1]), failed=float(v[2]), spans=v[cls.HEAD:])

    @classmethod
    def failed_by(cls, rank: int) -> "Ballot":
        """The ballot of a rank whose draft raised: it names the rank and changes nothing else."""
        return cls(need=-np.inf, samples=np.inf, failed=rank + 1, spans=np.full(len(GRID_MULTIPLES), -np.inf))

    @staticmethod
    def reduce(vectors: Sequence[np.ndarray]) -> np.ndarray:
        """The collective's result, in one process: the element-wise MAX of the ranks' vectors."""
        return np.maximum.reduce([np.asarray(v, dtype=np.float64) for v in vectors])


@dataclass(frozen=True)
class RankDraft:
    """Stage 1 on one rank: its pp-unaware packing, its shaped packings at the scanned counts, and its ballot."""

    rank: int
    lengths: np.ndarray
    cap: int
    layout: EngineLayout
    cost_model: CostModel | CostProfile | None
    search: EngineSearch
    #: the planner's pp-unaware micro-batches (local indices): empty if the draft failed, ``None`` until needed
    #: (with a pipeline the draft needs them only where the cap is tight)
    own: tuple[tuple[int, ...], ...] | None
    need: int
    ballot: Ballot
    #: the pass has no backward (log-probs, a reference model): priced by the forward-only schedules
    forward_only: bool = False
    #: with a pipeline: the shaped packing per scanned count (``scan_replica``); counts that did not pack are absent
    scan: ReplicaScan | None = None
    #: why the draft failed (this rank's planner error), or None
    error: str | None = None

    def shape(self, count: int) -> ReplicaPlan:
        """This rank's samples in exactly ``count`` micro-batches, shaped for the layout (``shape_replica``)."""
        return shape_replica(self.lengths, count, self.layout.parallel(), self.cap, cost_model=self.cost_model,
                             forward_only=self.forward_only, config=self.search.planner)


@dataclass(frozen=True)
class Agreement:
    """Stage 3's answer, the same on every rank."""

    #: micro-batches per rank
    count: int
    #: the slowest rank's predicted makespan at ``count`` (the ballots' estimate; the finished plans are at most
    #: this slow), ``None`` without a pipeline or where the count is the largest need
    predicted: float | None
    #: the largest need and the fewest samples over the DP group
    need: int
    fewest: int


@dataclass(frozen=True)
class RankPlan:
    """One rank's micro-batches for one mini-batch."""

    count: int
    #: local sample indices per micro-batch, in run order
    micro_batches: tuple[tuple[int, ...], ...]
    #: ``"own"`` (the draft's pp-unaware packing), ``"recount"`` (packed to exactly ``count``, balanced) or
    #: ``"shape"`` (packed to exactly ``count`` for the pipeline)
    how: str
    #: this rank's need (stage 1) and predicted makespan (``None`` without a pipeline)
    need: int
    predicted: float | None


@dataclass(frozen=True)
class EnginePlan:
    """One mini-batch's plan over the DP group (all ranks planned in one process: :func:`plan_engine_step`)."""

    #: micro-batches per rank, the same on every rank
    count: int
    #: ``micro_batches[r][j]``: rank ``r``'s local sample indices in its ``j``-th micro-batch, in run order
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    #: each rank's need (stage 1), before the ranks agreed on ``count``
    needs: tuple[int, ...]
    #: the token cap per micro-batch
    cap: int
    #: per rank: how its micro-batches were made (:attr:`RankPlan.how`)
    how: tuple[str, ...]
    agreement: Agreement


def _check_cap(cap: object) -> int:
    if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 1:
        raise ScheduleError(f"cap={cap!r} must be a positive token count (verl's max_token_len_per_gpu * "
                            f"context-parallel size)")
    return int(cap)


# ---------------------------------------------------------------------------------------------------- 1. draft
def _failed(common: dict, x: np.ndarray, spans: np.ndarray, why: str) -> RankDraft:
    rank, cap, align = common["rank"], common["cap"], common["layout"].align
    error = (f"DP rank {rank} ({len(x)} samples, {int(x.sum())} tokens, cap {cap}, VPP group {align}) cannot be "
             f"planned: {why}")
    return RankDraft(own=(), need=0, ballot=Ballot(0, len(x), rank + 1, spans), error=error, **common)


def draft_rank(lengths: Sequence[int], cap: int, layout: EngineLayout = EngineLayout(), *, rank: int = 0,
               min_count: int | None = None, cost_model: CostModel | CostProfile | None = None,
               search: EngineSearch = EngineSearch(), forward_only: bool = False) -> RankDraft:
    """Stage 1 on DP rank ``rank``: its own samples' ``lengths`` (tokens, local order) only. ``forward_only``: a
    pass without backward (verl's log-prob and reference passes), priced by the forward-only schedules.

    A planner error on these samples does not raise here (the other ranks would wait in the collective): it is
    recorded in the ballot and raised by :func:`agree` on every rank. A bad ``cap`` raises at once (it is the same
    on every rank)."""
    cap, align = _check_cap(cap), layout.align
    floor = 0 if min_count is None else -(-int(min_count) // align) * align
    x = np.asarray(lengths, dtype=np.int64).reshape(-1)
    grid = layout.grid()
    spans = np.full(len(grid), -np.inf)
    common = dict(rank=rank, lengths=x, cap=cap, layout=layout, cost_model=cost_model, search=search,
                  forward_only=bool(forward_only))
    if len(x) == 0:  # agree() names the empty rank on every rank
        return RankDraft(own=(), need=floor, ballot=Ballot(floor, 0, 0, spans), **common)
    if int(x.min()) < 1:
        return _failed(common, x, spans, f"sample {int(np.argmin(x))} has {int(x.min())} tokens (every sample needs "
                                         f"at least one)")
    own: tuple[tuple[int, ...], ...] | None = None
    need, scan = None, None
    if layout.pp_size > 1:
        # the pipeline: the grid's counts from what the cap needs at least up to reach x that (and at least
        # MIN_REACH_STEPS counts more), each shaped by the planner's scan and priced
        least = max(floor, align * -(-max(-(-int(x.sum()) // cap), int((x > cap // 2).sum()), 1) // align))
        top = min(len(x), max(math.floor(search.reach * least), least + MIN_REACH_STEPS * align))
        window = (grid >= least) & (grid <= top)
        try:
            scan = scan_replica(x, grid[window].tolist(), layout.parallel(), cap, cost_model=cost_model,
                                forward_only=forward_only, config=search.planner)
        except ScheduleError as exc:
            return _failed(common, x, spans, str(exc))
        spans[window] = [scan.spans.get(c, np.inf) for c in grid[window].tolist()]
        if least in scan:  # the least count fits: that is the need
            need = least
    if need is None:  # no pipeline, or the cap is tight (or nothing scanned fits): the planner's packing and count
        try:
            own = pack_replica(x, cap, cost_model=cost_model)
        except ScheduleError as exc:
            return _failed(common, x, spans, str(exc))
        need = max(-(-len(own) // align) * align, floor)
    spans[(grid < need) | (grid > len(x))] = np.inf
    return RankDraft(own=own, need=need, ballot=Ballot(need, len(x), 0, spans), scan=scan, **common)


# ---------------------------------------------------------------------------------------------------- 3. agree
def agree(reduced: Sequence[float], layout: EngineLayout, cap: int, *, mine: RankDraft | None = None) -> Agreement:
    """Stage 3: the count from the MAX-reduced ballots (the same on every rank, so the same answer), or the same
    :class:`ScheduleError` on every rank. ``mine``: this rank's draft (its planner error, where it is the rank that
    failed)."""
    votes = Ballot.from_vector(reduced)
    fix = ("raise max_token_len_per_gpu (or *_log_prob_max_token_len_per_gpu), or give each rank more samples per "
           "mini-batch (ppo_mini_batch_size)")
    if votes.failed > 0:
        r = int(votes.failed) - 1
        what = mine.error if mine is not None and mine.rank == r and mine.error else \
            f"DP rank {r} cannot be planned (that rank's error names its samples)"
        raise ScheduleError(f"{what}. In verl: {fix}")
    need, fewest = int(votes.need), int(votes.samples)
    if fewest < 1:
        raise ScheduleError("every DP rank needs at least one sample; a DP rank has none in this mini-batch (verl "
                            "dispatches equal chunks: check the batch and ppo_mini_batch_size)")
    if need > fewest:
        raise ScheduleError(
            f"the DP ranks need {need} micro-batches each to hold the cap {cap} (a multiple of the VPP group "
            f"{layout.align}), but a rank holds only {fewest} samples; {fix}")
    grid = layout.grid()
    usable = (grid >= need) & (grid <= fewest) & np.isfinite(votes.spans)
    if usable.any():
        i = int(np.flatnonzero(usable)[np.argmin(votes.spans[usable])])  # ties: the smaller count
        return Agreement(count=int(grid[i]), predicted=float(votes.spans[i]), need=need, fewest=fewest)
    return Agreement(count=need, predicted=None, need=need, fewest=fewest)


# ---------------------------------------------------------------------------------------------------- 4. finish
def finish_rank(draft: RankDraft, agreement: Agreement) -> RankPlan:
    """Stage 4: this rank's ``agreement.count`` micro-batches (see the module docstring)."""
    if draft.error is not None or not len(draft.lengths):
        raise ScheduleError(f"DP rank {draft.rank}'s draft failed; agree() raises on such ballots")
    count = agreement.count
    if draft.scan is None:  # no pipeline: the draft's packing where its count is the agreed one, else balanced
        if len(draft.own) == count:
            return RankPlan(count, draft.own, "own", draft.need, None)
        return RankPlan(count, draft.shape(count).micro_batches, "recount", draft.need, None)
    slowest, search = agreement.predicted, draft.search
    scanned = draft.scan.spans.get(count)  # this rank's ballot at the count (None: not scanned, or did not pack)

    def near(band: float) -> bool:  # within the band of the slowest rank's ballot
        return band >= 0 and (slowest is None or scanned >= (1 - band) * slowest)

    if scanned is None:  # above this rank's reach, or no scan shape holds the cap there: shape it now
        got = draft.shape(count)
        return RankPlan(count, got.micro_batches, "shape", draft.need, got.predicted_makespan)
    got = draft.scan.plan(count, reorder=near(search.order_band))
    if near(search.polish_band):  # every shape and the order search: where the step waits
        full = draft.shape(count)
        if full.predicted_makespan < got.predicted_makespan * (1 - search.planner.objective.tie):
            got = full
    return RankPlan(count, got.micro_batches, "shape", draft.need, got.predicted_makespan)


# ---------------------------------------------------------------------------------------------------- all ranks
def plan_engine_step(lengths_per_rank: Sequence[Sequence[int]], cap: int, layout: EngineLayout = EngineLayout(), *,
                     min_count: int | None = None, cost_model: CostModel | CostProfile | None = None,
                     search: EngineSearch = EngineSearch(), forward_only: bool = False) -> EnginePlan:
    """Stages 1-4 for every rank in one process (``lengths_per_rank[r]``: rank ``r``'s sample lengths, in its local
    order), the collective replaced by the element-wise MAX of the ballots: exactly what the engine's ranks compute.
    Raises :class:`ScheduleError` where the cap cannot be held with one count on every rank."""
    if not len(lengths_per_rank):
        raise ScheduleError("no DP ranks: pass one list of sample lengths per DP rank")
    drafts = [draft_rank(x, cap, layout, rank=r, min_count=min_count, cost_model=cost_model, search=search,
                         forward_only=forward_only) for r, x in enumerate(lengths_per_rank)]
    reduced = Ballot.reduce([d.ballot.vector() for d in drafts])
    failed = int(Ballot.from_vector(reduced).failed)
    agreement = agree(reduced, layout, drafts[0].cap, mine=drafts[failed - 1] if failed else None)
    plans = [finish_rank(d, agreement) for d in drafts]
    plan = EnginePlan(count=agreement.count, micro_batches=tuple(p.micro_batches for p in plans),
                      needs=tuple(d.need for d in drafts), cap=drafts[0].cap, how=tuple(p.how for p in plans),
                      agreement=agreement)
    check_engine_plan(plan, [len(d.lengths) for d in drafts], [d.lengths for d in drafts], layout.align)
    return plan


def check_rank_plan(micro_batches: Sequence[Sequence[int]], count: int, lengths: Sequence[int], cap: int,
                    align: int = 1, rank: int = 0) -> None:
    """Raise ``AssertionError`` naming the broken invariant of one rank's plan (see the module docstring)."""
    assert count % align == 0, f"count {count} is not a multiple of the VPP group {align}"
    assert len(micro_batches) == count, (f"rank {rank} has {len(micro_batches)} micro-batches, the agreed count is "
                                         f"{count}")
    n = len(lengths)
    flat = sorted(int(i) for mb in micro_batches for i in mb)
    assert flat == list(range(n)), f"rank {rank}'s micro-batches do not hold each of its {n} samples exactly once"
    assert all(len(mb) > 0 for mb in micro_batches), f"rank {rank} has an empty micro-batch"
    ln = np.asarray(lengths, dtype=np.int64)
    for j, mb in enumerate(micro_batches):
        tokens = int(ln[list(mb)].sum())
        assert len(mb) == 1 or tokens <= cap, (
            f"rank {rank} micro-batch {j} holds {len(mb)} samples, {tokens} tokens > cap {cap}")


def check_engine_plan(plan: EnginePlan, sizes: Sequence[int], lengths: Sequence[Sequence[int]] | None = None,
                      align: int = 1) -> None:
    """Raise ``AssertionError`` naming the broken invariant (see the module docstring): every rank's
    (:func:`check_rank_plan`, with the cap where ``lengths`` are given), and one count on all."""
    assert len(plan.micro_batches) == len(sizes), f"{len(plan.micro_batches)} ranks planned, {len(sizes)} given"
    for r, (mbs, n) in enumerate(zip(plan.micro_batches, sizes)):
        ln = lengths[r] if lengths is not None else [0] * n
        assert len(ln) == n, f"rank {r}: {len(ln)} lengths for {n} samples"
        check_rank_plan(mbs, plan.count, ln, plan.cap, align, r)


# ---------------------------------------------------------------------------------------------------- trainer depth
def plan_dispatch(lengths: Sequence[int], dp_size: int, mini_batch_size: int, *,
                  cost_model: CostModel | CostProfile | None = None) -> list[int]:
    """The trainer depth: the order of a trainer step's samples that verl's dispatch then cuts into DP ranks.

    verl gives DP rank ``r`` the ``r``-th of ``dp_size`` equal contiguous chunks of the batch, and each rank cuts
    its chunk into contiguous mini-batches of ``mini_batch_size // dp_size`` samples (one optimizer step each). Here
    mini-batch ``m`` holds samples ``m * mini_batch_size ..`` of the step, in the step's own order, and the planner
    decides which of them each rank trains: equal counts per rank (verl asserts equal chunks) with the estimated
    FLOPs balanced per mini-batch -- the planner's static layout with one sample per micro-batch and
    ``balance_data``. Each rank's micro-batches are then the engine depth's. Returns the permutation of
    ``range(len(lengths))`` to hand to verl's ``reorder``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if dp_size < 1 or mini_batch_size < 1 or mini_batch_size % dp_size or n % mini_batch_size:
        raise ScheduleError(
            f"{n} samples, mini_batch_size={mini_batch_size}, dp_size={dp_size}: the step must be whole mini-batches "
            f"and a mini-batch a multiple of dp_size (verl pads the batch to lcm(dp, mini-batch sizes) first)")
    per_rank = mini_batch_size // dp_size
    batch = BatchConfig(global_batch_size=mini_batch_size, micro_batch_size=1, balance_data=True,
                        disable_rollout_trim_samples=True)
    chunks: list[list[int]] = [[] for _ in range(dp_size)]
    for start in range(0, n, mini_batch_size):
        members = np.arange(start, start + mini_batch_size)
        schedule = plan_schedule(lengths[members], ParallelConfig(dp_size=dp_size), batch, cost_model=cost_model)
        for r in range(dp_size):
            part = schedule.partitions[r]
            assert len(part) == per_rank, f"the planner gave rank {r} {len(part)} samples, not {per_rank}"
            chunks[r].extend(int(members[i]) for i in part)
    order = [i for chunk in chunks for i in chunk]
    assert sorted(order) == list(range(n))
    return order
