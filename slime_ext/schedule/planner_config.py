"""Every tunable of the planner in one frozen dataclass: :class:`PlannerConfig`.

The planner (:func:`slime_ext.schedule.plan`) takes one with a default (``PlannerConfig()``); the
benches set any field from the command line (``--set NAME=VALUE``, :meth:`PlannerConfig.replace_from`), so a sweep
needs no edit. Each field says what it controls and where its value comes from: a measurement (the bench command
that shows it), or "inherited" where the value predates the benches that could justify it (the sweep to run is
named). A field nobody can justify is a field to remove.

Pure: standard library only (the shapes are plain tuples here; :mod:`.pipeline_shape` turns them into shapes).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable

from .errors import ScheduleError

__all__ = ["DEFAULT_CONFIG", "PlannerConfig"]


@dataclass(frozen=True)
class PlannerConfig:
    """The planner's tunables. Sections: the objective's prices (pipeline only), the one comparison rule, the
    pp-unaware stages 2-4, the pipeline search's work budget, and each candidate family of the pipeline search
    (:data:`slime_ext.schedule.pipeline_choice.CANDIDATES`)."""

    # ------------------------------------------------------------------ the objective's prices (pp > 1)
    #: FLOPs or token plans charge every micro-batch this share of a full one (``cap`` tokens at the linear rate),
    #: so that more, smaller micro-batches are not free. Not measured on hardware: a stand-in for the fixed cost of
    #: a micro-batch (kernel launches, the optimizer's per-micro-batch work); a measured ``CostProfile`` brings its
    #: own (``microbatch_overhead_s``) and ignores this. Changing it changes the objective, not only the search.
    microbatch_overhead: float = 0.02
    #: FLOPs or token plans: backward = this times forward (a matmul's backward is two matmuls of its forward's
    #: size); a ``CostProfile`` brings its measured ratio and ignores this
    backward_forward_ratio: float = 2.0
    #: uneven stages: a stage's share of a micro-batch is weighed on ``cap`` tokens in samples of this share of
    #: ``cap`` (a stage's share depends a little on the mix of linear and attention cost). Inherited (issue 22);
    #: ``python -m bench.pipeline_stages`` measured the shares' effect within 1.5% of megatron-core's replay
    stage_share_sample: float = 0.25
    #: ... and without a cap (static batches) on this many tokens
    stage_share_tokens: int = 4096

    # ------------------------------------------------------------------ the one comparison rule
    #: one candidate beats another when its slowest predicted makespan is lower by more than this share; anything
    #: closer is a tie, won by the candidate found first. Summing the same costs in another order moves a
    #: makespan by ~1e-15 of itself, so 1e-9 tells rounding from a real gain; every comparison of the pipeline
    #: search (and every stop rule "while it gains") uses it (``tests/unit/test_pipeline_choice.py`` checks the
    #: documented rule)
    tie: float = 1e-9

    # ------------------------------------------------------------------ stages 2-4 (pp-unaware; pp = 1 plans)
    #: balance_data is done once the slowest rank is within this of the best any assignment can do (inherited;
    #: the 484 pinned plans of ``bench.plan_digest`` are made with it)
    balance_tolerance: float = 2e-3
    #: swap refinement of packed bins stops this close to the mean rank cost (inherited)
    refine_tolerance: float = 1e-5
    #: ... or after this many rounds (inherited)
    refine_rounds: int = 64
    #: up to this many bins per rank the swap refinement scores every pair at once (``per_rank**2`` memory per
    #: rank pair); above it, by binary search per bin (the same choice, less memory)
    dense_swap_limit: int = 128
    #: an extra ``align`` micro-batches (bins chosen per rank) must cut the slowest rank's FLOPs by this share
    #: (inherited; a profile prices the extra micro-batch itself and needs no margin)
    extra_microbatch_gain: float = 0.01
    #: ... at most this many times
    max_extra_rounds: int = 3

    # ------------------------------------------------------------------ pipeline search: candidates and budget
    #: the candidate generators that run, in registry order (:data:`slime_ext.schedule.pipeline_choice.CANDIDATES`);
    #: the first must be "unaware" (the guard). A bench may leave one out to measure what it brings
    candidates: tuple[str, ...] = ("unaware", "ordered", "shaped", "refined")
    #: the step's work budget in estimated microseconds (:class:`~slime_ext.schedule.pipeline_pricing.Budget`):
    #: ``min(budget_floor_max_us, budget_floor_us / dp ** budget_floor_power) + budget_per_sample_us * samples +
    #: budget_per_replica_us * pp ** budget_pp_power * dp``. The fixed part (the search around the slowest replicas:
    #: the scan, the refinement) is 24 ms up to dp 12, 13 ms at dp 32, 2.3 ms at dp 128. Measured (2026-12, the
    #: shared 2-core machine): below 24 ms at dp 1-4 a few dp 4 x VPP 2 pinned steps (``bench.plan_quality
    #: --compare``) plan up to 1.2% slower than cfaa6b5's, and 24 ms keeps ``bench.pipeline_speed``'s static and
    #: many-micro-batch layouts within 4x pp = 1 + 20 ms per step; at dp 32 the yardstick's tail-dp32-pp4 is 1.047 of
    #: its best with 7 ms and 1.003 with 13 ms; the per-sample and per-replica parts put the issue-22 grid of
    #: ``bench.pipeline_speed`` (dp 128-512, 2,048-8,192 samples) at 0.75-0.95 of cfaa6b5's planning time, pp 8
    #: getting sqrt(2) as much per replica as pp 4 (cfaa6b5 plans pp 8 in 1.1-1.5x its pp 4 time)
    budget_floor_us: float = 1000000.0
    budget_floor_power: float = 1.25
    budget_floor_max_us: float = 24000.0
    budget_per_sample_us: float = 0.36
    budget_per_replica_us: float = 8.5
    budget_pp_power: float = 0.5
    #: the share of the budget's fixed part the shaped candidate leaves to the refinement
    refine_share: float = 0.15
    #: the work estimate's coefficients (:class:`~slime_ext.schedule.pipeline_pricing.Budget`), fitted to the
    #: packing and model calls of ``bench.pipeline_speed``'s issue-22 grid and of the yardstick's 23 cases
    #: (``bench.pipeline_search``), timed where they run (CPU time, 280 packing and 636 model calls of two warm
    #: plannings each, the benches' 2-core machine shared as usual, 2026-12, numpy 2.4; least squares on the
    #: relative error: the middle half of the calls within -10%/+20% of the estimate, the totals within 10%).
    #: A call of the model: 40 us per group of rows of one count, 3.2 us per level of its DAG (about
    #: ``2 (M vpp + pp)`` levels), 5.5 ns per row x micro-batch x virtual stage. Since the model's pass was made
    #: cheaper (the same makespans; 2026-12-05) its calls take about half of these estimates (refitted on the same
    #: calls: 32 us, 1.3 us, 2.9 ns); the estimates are kept, so a step plans exactly as before, in less time. Refitted
    #: (``--set work_call_us=32.4 work_level_us=1.58 work_model_cell_us=0.004``, the refit scaled to the first
    #: fit's machine state) the search spends the saving: on ``bench.pipeline_speed``'s grid that moved the step
    #: times by -3.0% to +3.7% (mixed) at 0.75-1.00 of cfaa6b5's planning time, so it was not taken
    work_call_us: float = 40.0
    work_level_us: float = 3.2
    work_model_cell_us: float = 0.0055
    #: ... a packing call (:func:`~slime_ext.schedule.pipeline_shape.shape_pack`): per sample rank (a pass) 9 us,
    #: 45 ns per row and 0.8 ns per row x micro-batch (a plan taken apart into arrays or lists costs one pass-row per
    #: sample and ten per replica: 0.2-0.5 ms at 8,192 samples)
    work_pass_us: float = 9.0
    work_pass_row_us: float = 0.045
    work_pack_cell_us: float = 0.0008
    #: ... the numpy work around a packing call or a round of the refinement or of the order improvement:
    #: 150-400 us
    work_round_us: float = 250.0
    #: ... a water-filling round's Python per replica (after its vectorised prefilters): 0.3-0.4 ms per round at
    #: dp 128, 1-1.5 ms at dp 512
    work_replica_us: float = 3.0

    # ------------------------------------------------------------------ pipeline search: order
    #: the swaps tried per rank and round when an order is improved: every pair of positions while there are at
    #: most this many pairs (276 = every pair of 24 micro-batches), else adjacent pairs and pairs with the ends, and
    #: under VPP every pair within one of the interleaved schedule's groups and the pairs one group apart (on the
    #: yardstick's pp 8 x VPP 2 cases, 32 micro-batches, the in-group pairs took an order search from 1.017 to
    #: 1.008 of the best where adjacent pairs and the ends alone stopped)
    max_order_swaps: int = 276
    #: rounds of order improvement (each takes every row's best swap)
    order_rounds: int = 6

    # ------------------------------------------------------------------ pipeline search: more micro-batches

    # ------------------------------------------------------------------ pipeline search: shaped micro-batches
    #: replicas the count is chosen on (the heaviest by cost and by largest sample), as many as the budget pays
    #: for between these two; all replicas choose a shape. 2 at least: cfaa6b5's large steps scanned on 2
    scan_replicas: int = 8
    min_scan_replicas: int = 2
    #: the share of the shaped candidate's allowance (the budget left, less the refinement's share) the scan sizes
    #: itself to, beside what the full packing and the rebalancing reserve (issue 22's scan had half of it; at 0.25
    #: the yardstick's rl-dp8-pp8 went from 1.016 to 1.070 of its best: at a few replicas the scan is the count
    #: search)
    scan_share: float = 0.5
    #: with more than ``water_fill_replicas`` replicas the scan takes half its replicas from this range of the
    #: replicas by cost (shares of dp: the middle half), since the rebalancing levels them; inherited
    typical_replicas: tuple[float, ...] = (0.25, 0.75)
    #: the scan covers as many counts as the budget pays for, at least this many (cfaa6b5's large steps: 3)
    min_scan_counts: int = 3
    #: per-replica counts scanned: the pp-unaware count times these factors, rounded up to the step and at least one
    #: step more than the previous (capped by the samples of the smallest replica). The yardstick's best plans use
    #: up to 2.3x the pp-unaware count (rl-like, dp 8 x pp 8: 32 per replica against 14), hence the reach to 2.6x
    count_factors: tuple[float, ...] = (1.0, 1.1, 1.2, 1.3, 1.45, 1.6, 1.8, 2.0, 2.3, 2.6)
    #: the shapes of micro-batch sizes tried (:class:`~slime_ext.schedule.pipeline_shape.Shape` fields ``(up,
    #: down, low, order, grouped, rise, per_stage)``, the last four optional; ``up = -1`` rises over the whole
    #: step, ``down = -1`` falls over every micro-batch after the peak; ``per_stage`` true: ``up`` and ``down`` are
    #: per pipeline stage, the ramps as long as the pipeline is deep). The first 17 are issue 22's, read off the
    #: yardstick's best plans of then; the next five (a geometric rise to an early peak, then a linear fall to 0.1
    #: of it) are issue 29's, read off the annealing yardstick's best plans (rl-like, dp 8 x pp 4 and pp 8: e.g. 4,
    #: 9, 20, 36, 70, 55, 44, ..., 7, 5 overheads): on the six dp 8-32 yardstick cases they moved the worst plan /
    #: best from 1.042 to 1.014. The last three ramp over about 1.1-1.25 micro-batches per stage from 0.05 of the
    #: plateau (10 and 9 up, 16 or every one down at pp 8; 5 at pp 4): packed from one replica's samples of
    #: rl-dp128-pp8 over a grid of 2,040 shapes, the best shapes at pp 8 had ramps of 8-10 up and 16 or all down,
    #: 1.010 of the best against the fixed shapes' 1.029 (at pp 4 ramps of 5-6 up led, as the fixed ones do); with
    #: them the dp 128 x pp 8 cases plan 36-39 micro-batches per replica (24-25 before) at 1.017 and 1.010 of the
    #: yardstick's bests (1.029 and 1.023 before; ``docs/pipeline.md``)
    shapes: tuple[tuple, ...] = ((0, 0, 1.0), (1, 4, 0.3), (2, 4, 0.3), (2, 6, 0.5), (3, 6, 0.3), (3, 8, 0.3),
                                 (4, 8, 0.3), (2, 2, 0.5), (-1, 1, 0.5), (-1, 2, 0.6), (0, 0, 1.0, "rising"),
                                 (3, 8, 0.6), (5, 10, 0.5), (4, 12, 0.4), (1, 1, 0.3, "target", True),
                                 (1, 2, 0.3, "target", True), (2, 3, 0.3, "target", True),
                                 (2, -1, 0.1, "target", False, 2.0), (3, -1, 0.1, "target", False, 2.0),
                                 (4, -1, 0.1, "target", False, 1.8), (5, -1, 0.1, "target", False, 1.6),
                                 (6, -1, 0.1, "target", False, 1.5),
                                 (1.25, -1, 0.05, "target", False, 0.0, True),
                                 (1.125, 2.0, 0.05, "target", False, 0.0, True),
                                 (1.125, -1, 0.05, "target", False, 1.5, True))
    #: the shapes every count is scanned with (then every shape at the best counts); entries of ``shapes``: the
    #: flat one, the rising order, two early peaks and short ramps of whole VPP groups (added by issue 29's speed
    #: work: where the budget leaves no room for every shape at the best counts, it took the 180 large steps of
    #: ``bench.plan_quality --large`` under VPP from +1.2% to +0.3% of cfaa6b5's makespans, 1F1B alike), and the
    #: ramps of 1.25 micro-batches per stage (at dp 128 the budget scans few shapes and tries no other: without it
    #: there the deep pipeline's long ramps are never packed; in place of the early peak of 3 instead of beside it,
    #: the pinned plans' mean against cfaa6b5 was -0.70% instead of -0.71%, the large steps' -0.50% for -0.51%)
    scan_shapes: tuple[tuple, ...] = ((0, 0, 1.0), (0, 0, 1.0, "rising"), (3, -1, 0.1, "target", False, 2.0),
                                      (5, -1, 0.1, "target", False, 1.6), (1, 2, 0.3, "target", True),
                                      (1.25, -1, 0.05, "target", False, 0.0, True))
    #: the scan packs every shape at every count in one call where that is at most this many rows (the same
    #: prices, one call fewer)
    one_scan_rows: int = 256
    #: (count, shape) combinations, best by the scan first, priced on every replica (where the budget pays for
    #: it); the counts of the best ``rebalanced_counts`` (as many as the budget pays for) are rebalanced, and the
    #: fastest after rebalancing wins
    shaped_combos: int = 3
    rebalanced_counts: int = 3
    #: counts whose best scanned span is within this share of the best count's are ranked most micro-batches
    #: first: the scan prices each replica's own samples before the rebalancing moves any, and the rebalancing
    #: levels the slowest replicas further with more, smaller micro-batches (``bench.pipeline_search``'s
    #: tail-dp128-pp8: 6 and 7 micro-batches per replica scan 5e-5 apart and rebalance to 1.0200 and 1.0006 of the
    #: best; ``bench.plan_quality --large``: the mean makespan against cfaa6b5 from -0.45% to -0.51%, steps over
    #: 0.5% slower from 18 to 11 of 180; 3e-3: -0.50% and 16, 1e-2: -0.32% and 31)
    count_tie: float = 1e-3

    # ------------------------------------------------------------------ pipeline search: samples between replicas
    #: the fastest replicas a move off the slowest one may go to (shaped rebalancing, refinement)
    balance_partners: int = 3
    #: sample moves off the slowest shaped replica, and the shares of its cost a move tries
    max_shed_moves: int = 12
    shed_shares: tuple[float, ...] = (0.02, 0.06, 0.15, 0.35, 0.8)
    #: the search's stop rule (not a tie: ``tie`` compares candidates): a loop that moves samples (rebalancing,
    #: refinement) stops once it lowers the slowest makespan by less than this share per move (refinement: over
    #: its last ``refine_patience`` rounds). Inherited (issue 22's rebalancing used 1e-3)
    min_gain: float = 1e-3
    #: with more replicas than this, rebalancing starts with ``water_rounds`` global rounds, then
    #: ``shed_moves_after_water`` single moves
    water_fill_replicas: int = 16
    water_rounds: int = 2
    shed_moves_after_water: int = 2
    #: water-filling gives a replica samples only up to this share of its micro-batches' token room (k * cap)
    token_fill: float = 0.9
    #: a sample holding this share of its replica's cost is "dominant": the replica may keep it with only the
    #: step's cheapest samples
    strip_share: float = 0.25

    # ------------------------------------------------------------------ pipeline search: refinement
    #: the refinement improves the best plan of each of this many counts (the best counts first)
    finalists: int = 2
    #: ... the best of them within this share of the budget left (the others share the rest equally). 0.5 is
    #: equal shares for two finalists; 0.75 and 1.0 moved the yardstick's mean by under 0.001 (2026-12), and gave
    #: the best finalist's refinement more only where the other's had found nothing
    lead_share: float = 0.5
    #: moves drawn per round of the refinement, priced in one call
    refine_moves: int = 256
    #: the share of its swaps whose other sample is drawn from the slowest replica itself (the rest: from one of the
    #: ``balance_partners`` fastest); inherited, an even split
    swap_within_share: float = 0.5
    #: the refinement stops once its last ``refine_patience`` rounds together lowered the slowest makespan by less
    #: than ``min_gain`` of it (with many replicas near the slowest, a round gains little: it stops early there)
    refine_patience: int = 8
    #: the seed of its random stream (the same input always gives the same plan)
    refine_seed: int = 1

    # ------------------------------------------------------------------ the pipeline model's evaluation
    #: replicas are evaluated in passes of at most this many table entries (memory, not results)
    model_table_entries: int = 1 << 23
    #: groups of replicas evaluated together are cut into pieces of one width (the narrowest group's, or the
    #: widest's over this many), so that a narrow group is not padded to a wide one's replicas (speed, not results)
    model_pieces: int = 4

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default
            if isinstance(default, bool):
                ok = isinstance(value, bool)
            elif isinstance(default, int):
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= _LEAST.get(f.name, 1)
            elif isinstance(default, float):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                    and value >= 0
                if ok:
                    object.__setattr__(self, f.name, float(value))
            elif isinstance(default, tuple):
                ok = isinstance(value, (tuple, list)) and len(value) > 0
                if ok:
                    value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
                    object.__setattr__(self, f.name, value)
            else:  # pragma: no cover -- every field has one of the kinds above
                ok = True
            if not ok:
                raise ScheduleError(f"PlannerConfig.{f.name} = {value!r} must be {_kind(default, f.name)} (default "
                                    f"{default!r}); see the field's documentation in "
                                    f"slime_ext/schedule/planner_config.py")
        for name in ("microbatch_overhead", "tie", "count_tie", "min_gain", "strip_share", "refine_share",
                     "scan_share", "swap_within_share"):
            if getattr(self, name) >= 1:
                raise ScheduleError(f"PlannerConfig.{name} = {getattr(self, name)!r} is a share: pass a value in "
                                    f"[0, 1)")
        if not 0 < self.lead_share <= 1:
            raise ScheduleError(f"PlannerConfig.lead_share = {self.lead_share!r} must lie in (0, 1]")
        if not 0 < self.token_fill <= 1:
            raise ScheduleError(f"PlannerConfig.token_fill = {self.token_fill!r} must lie in (0, 1]")
        if self.backward_forward_ratio <= 0:
            raise ScheduleError(f"PlannerConfig.backward_forward_ratio = {self.backward_forward_ratio!r} must be > 0")
        for name in ("shapes", "scan_shapes"):
            for shape in getattr(self, name):
                problem = _shape_problem(shape)
                if problem:
                    raise ScheduleError(f"PlannerConfig.{name} holds {shape!r}: {problem}; a shape is (up, down, "
                                        f"low[, order[, grouped[, rise[, per_stage]]]]), e.g. (3, 8, 0.3) or "
                                        f"(1.25, -1, 0.05, 'target', False, 0.0, True)")
        missing = [s for s in self.scan_shapes if s not in self.shapes]
        if missing:
            raise ScheduleError(f"PlannerConfig.scan_shapes holds {missing}, which are not in shapes; scan a subset "
                                f"of shapes")

    # ------------------------------------------------------------------ overrides (the benches' --set)
    def replace_from(self, items: Iterable[str]) -> "PlannerConfig":
        """A copy with ``NAME=VALUE`` overrides (a bench's ``--set``): a number, ``true``/``false``, or JSON for a
        tuple (``count_factors=[1.0,1.2]``, ``shapes=[[0,0,1.0],[2,6,0.5]]``). An unknown name or a value of the
        wrong kind raises :class:`ScheduleError` naming it."""
        changes: dict[str, Any] = {}
        known = {f.name: f for f in dataclasses.fields(self)}
        for item in items:
            name, sep, text = str(item).partition("=")
            name = name.strip()
            if not sep or name not in known:
                raise ScheduleError(f"--set {item!r}: expected NAME=VALUE with NAME a PlannerConfig field, one of "
                                    f"{sorted(known)}")
            default = known[name].default
            try:
                if isinstance(default, bool):
                    if text.strip().lower() not in ("true", "false"):
                        raise ValueError
                    value: Any = text.strip().lower() == "true"
                elif isinstance(default, int):
                    value = int(text)
                elif isinstance(default, float):
                    value = float(text)
                else:
                    value = json.loads(text)
            except ValueError:
                raise ScheduleError(f"--set {item!r}: {name} takes {_kind(default, name)}, e.g. {name}={default!r}")
            changes[name] = value
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        """The fields that differ from the defaults (for a bench's header)."""
        base = PlannerConfig()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)}


#: integer fields that may be 0 (a loop that does not run; the seed); every other integer is at least 1
_LEAST = {"max_extra_rounds": 0, "order_rounds": 0, "max_shed_moves": 0, "water_rounds": 0,
          "shed_moves_after_water": 0, "refine_patience": 0, "refine_seed": 0}


def _kind(default: Any, name: str = "") -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return f"an integer >= {_LEAST.get(name, 1)}"
    if isinstance(default, float):
        return "a finite number >= 0"
    return "a non-empty JSON list"


def _shape_problem(shape: Any) -> str:
    """What is wrong with one ``shapes`` entry (empty: nothing)."""
    if not isinstance(shape, tuple) or not 3 <= len(shape) <= 7:
        return "it needs 3 to 7 fields"
    up, down, low, *rest = shape
    order, grouped, rise, per_stage = (list(rest) + ["target", False, 0.0, False][len(rest):])[:4]
    number = (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x))
    if not isinstance(per_stage, bool) or not isinstance(grouped, bool):
        return "grouped and per_stage are true or false"
    for name, x in (("up", up), ("down", down)):
        if not number(x) or x < 0 and x != -1 or not per_stage and x != int(x):
            return f"{name} = {x!r} must be a whole number >= 0 or -1 (per stage: any number >= 0)"
    if not number(low) or not 0 < low <= 1:
        return f"low = {low!r} must lie in (0, 1]"
    if order not in ("target", "rising"):
        return f"order = {order!r} must be 'target' or 'rising'"
    if not number(rise) or rise < 0:
        return f"rise = {rise!r} must be a number >= 0 (> 1: geometric)"
    return ""


#: the defaults, for callers that take an optional config
DEFAULT_CONFIG = PlannerConfig()
