"""Every tunable of the planner in one frozen config of sections: :class:`PlannerConfig`.

The planner (:func:`slime_ext.schedule.plan`) takes one with a default (``PlannerConfig()``); the benches set any field
from the command line (``--set SECTION.FIELD=VALUE``, :meth:`PlannerConfig.replace_from`), so a sweep needs no edit.
Each field has one line on what it controls and the measurement behind its default; how the defaults were found is
in ``docs/pipeline.md`` ("Where the defaults come from"). A field nobody can justify is a field to remove.

Pure: standard library only (the shapes are plain tuples here; :mod:`.pipeline_shape` turns them into shapes).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from .errors import ScheduleError

__all__ = ["BudgetConfig", "CountSearchConfig", "DEFAULT_CONFIG", "ModelConfig", "ObjectiveConfig", "PackingConfig",
           "PlannerConfig", "RebalancingConfig", "RefinementConfig", "ShapeSpec", "ShapingConfig"]


class _Section:
    """A section's checks: every field of its default's kind (integers >= 1 unless listed in ``_LEAST``, finite
    numbers >= 0, non-empty tuples), shares in [0, 1)."""

    _SHARES: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = _checked(type(self).__name__, f.name, getattr(self, f.name), f.default)
            object.__setattr__(self, f.name, value)
        for name in self._SHARES:
            if getattr(self, name) >= 1:
                raise ScheduleError(f"{_where(self)}.{name} = {getattr(self, name)!r} is a share: pass a value in "
                                    f"[0, 1)")


@dataclass(frozen=True)
class ObjectiveConfig(_Section):
    """What a plan is judged by under pipeline parallelism, and the two rules every comparison uses."""

    #: FLOPs or token plans charge every micro-batch this share of a full one (a stand-in, not measured; a
    #: ``CostProfile`` brings its own measured overhead); the search is checked at 0.5x and 2x of it
    microbatch_overhead: float = 0.02
    #: FLOPs or token plans: backward = this times forward (a matmul's backward is two of its forward's size)
    backward_forward_ratio: float = 2.0
    #: uneven stages: a stage's share is weighed on ``cap`` tokens in samples of this share of ``cap``
    #: (``bench.pipeline_stages``: the shares within 1.5% of megatron-core's replay)
    stage_share_sample: float = 0.25
    #: ... and without a cap (static batches) on this many tokens
    stage_share_tokens: int = 4096
    #: a candidate beats another when its slowest makespan is lower by more than this share (summation order moves a
    #: makespan by ~1e-15 of itself: 1e-9 tells rounding from a gain)
    tie: float = 1e-9
    #: a loop that moves samples stops once a move (the refinement: its last ``refinement.refine_patience`` rounds)
    #: gains less than this share of the slowest makespan (inherited from the first rebalancing)
    min_gain: float = 1e-3

    _SHARES = ("microbatch_overhead", "tie", "min_gain")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backward_forward_ratio <= 0:
            raise ScheduleError(f"ObjectiveConfig.backward_forward_ratio = {self.backward_forward_ratio!r} must be > 0")


@dataclass(frozen=True)
class PackingConfig(_Section):
    """Stages 2-4 (pp-unaware packing and distribution; every plan of pp = 1)."""

    #: balance_data is done once the slowest rank is within this of the best any assignment can do (inherited; the
    #: pinned plans of ``bench.plan_digest`` are made with it)
    balance_tolerance: float = 2e-3
    #: swap refinement of packed bins stops this close to the mean rank cost (inherited)
    refine_tolerance: float = 1e-5
    #: ... or after this many rounds (inherited)
    refine_rounds: int = 64
    #: up to this many bins per rank the swaps score every pair at once, above by binary search (memory only)
    dense_swap_limit: int = 128
    #: ``align`` extra micro-batches must cut the slowest rank's FLOPs by this share (inherited; a profile needs none)
    extra_microbatch_gain: float = 0.01
    #: ... at most this many times
    max_extra_rounds: int = 3


@dataclass(frozen=True)
class CountSearchConfig(_Section):
    """The shaped candidate's count scan: which counts, on which replicas, how many go on."""

    #: replicas the counts are scanned on (likely slowest), as many as the budget pays for between these two (the
    #: earlier planner's large steps scanned on 2)
    scan_replicas: int = 8
    min_scan_replicas: int = 2
    #: the share of the shaped allowance the scan may take (at 0.25 the yardstick's rl-dp8-pp8 went 1.016 -> 1.070)
    scan_share: float = 0.5
    #: above ``rebalancing.water_fill_replicas`` half the scanned replicas come from this range of dp by cost
    #: (shares: the middle half; inherited)
    typical_replicas: tuple[float, ...] = (0.25, 0.75)
    #: the scan covers as many counts as the budget pays for, at least this many (the earlier planner's: 3)
    min_scan_counts: int = 3
    #: counts scanned: the pp-unaware count times these (the yardstick's bests use up to 2.3x it)
    count_factors: tuple[float, ...] = (1.0, 1.1, 1.2, 1.3, 1.45, 1.6, 1.8, 2.0, 2.3, 2.6)
    #: every shape at every count in one packing call up to this many rows (speed only, the same prices)
    one_scan_rows: int = 256
    #: (count, shape) combinations, best first, packed on every replica (as far as the budget pays)
    shaped_combos: int = 3
    #: counts rebalanced (as many as the budget pays for); the fastest after rebalancing wins
    rebalanced_counts: int = 3
    #: counts scanned within this share of the best go most micro-batches first (``--large``: steps over 0.5% slower
    #: than the earlier planner 18 -> 11 of 180; 3e-3: 16, 1e-2: 31)
    count_tie: float = 1e-3

    _SHARES = ("scan_share", "count_tie")


@dataclass(frozen=True)
class ShapeSpec:
    """One configured shape of a replica's micro-batch sizes (:class:`~.pipeline_shape.Shape` once the pipeline's
    depth is known): ``up`` micro-batches rising from ``low`` of the plateau to it, the plateau, ``down`` falling
    back to ``low``. A config or ``--set`` may give one as a list ``[up, down, low, ...]`` in this field order."""

    up: float  # micro-batches rising to the plateau (-1: over the whole step)
    down: float  # micro-batches falling from it at the end (-1: every one after the peak)
    low: float  # the first (last) micro-batch's target, a share of the plateau's
    order: str = "target"  # the run order: "target" (as shaped) or "rising" (cheapest first, the costliest second last)
    grouped: bool = False  # the ramps count whole VPP groups of micro-batches
    rise: float = 0.0  # > 1: the rise is geometric, each of the ``up`` micro-batches ``1 / rise`` of the next
    per_stage: bool = False  # ``up`` and ``down`` count micro-batches per pipeline stage (ramps as deep as the pipeline)

    @classmethod
    def of(cls, value: Any, where: str = "ShapingConfig.shapes") -> "ShapeSpec":
        if isinstance(value, ShapeSpec):
            return value
        value = tuple(value) if isinstance(value, list) else value
        problem = _shape_problem(value)
        if problem:
            raise ScheduleError(f"{where} holds {value!r}: {problem}; a shape is (up, down, low[, order[, grouped[, "
                                f"rise[, per_stage]]]]), e.g. (3, 8, 0.3) or (1.25, -1, 0.05, 'target', False, 0.0, "
                                f"True)")
        return cls(*value)


_SHAPES = ((0, 0, 1.0), (1, 4, 0.3), (2, 4, 0.3), (2, 6, 0.5), (3, 6, 0.3), (3, 8, 0.3), (4, 8, 0.3), (2, 2, 0.5),
           (-1, 1, 0.5), (-1, 2, 0.6), (0, 0, 1.0, "rising"), (3, 8, 0.6), (5, 10, 0.5), (4, 12, 0.4),
           (1, 1, 0.3, "target", True), (1, 2, 0.3, "target", True), (2, 3, 0.3, "target", True),
           (2, -1, 0.1, "target", False, 2.0), (3, -1, 0.1, "target", False, 2.0), (4, -1, 0.1, "target", False, 1.8),
           (5, -1, 0.1, "target", False, 1.6), (6, -1, 0.1, "target", False, 1.5),
           (1.25, -1, 0.05, "target", False, 0.0, True), (1.125, 2.0, 0.05, "target", False, 0.0, True),
           (1.125, -1, 0.05, "target", False, 1.5, True))
_SCAN_SHAPES = ((0, 0, 1.0), (0, 0, 1.0, "rising"), (3, -1, 0.1, "target", False, 2.0),
                (5, -1, 0.1, "target", False, 1.6), (1, 2, 0.3, "target", True),
                (1.25, -1, 0.05, "target", False, 0.0, True))
_SHAPES, _SCAN_SHAPES = (tuple(ShapeSpec(*s) for s in shapes) for shapes in (_SHAPES, _SCAN_SHAPES))


@dataclass(frozen=True)
class ShapingConfig(_Section):
    """The shapes of micro-batch sizes a replica's samples are packed in."""

    #: the shapes tried, read off the yardstick's best plans (scanning only ``scan_shapes``: pinned steps up to 1.9%
    #: slower, ``docs/pipeline.md``'s table)
    shapes: tuple[ShapeSpec, ...] = _SHAPES
    #: the shapes every count is scanned with, entries of ``shapes`` (``--large`` under VPP: +1.2% -> +0.3% of the
    #: earlier planner's makespans)
    scan_shapes: tuple[ShapeSpec, ...] = _SCAN_SHAPES

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("shapes", "scan_shapes"):
            object.__setattr__(self, name, tuple(ShapeSpec.of(s, f"ShapingConfig.{name}") for s in getattr(self, name)))
        missing = [s for s in self.scan_shapes if s not in self.shapes]
        if missing:
            raise ScheduleError(f"ShapingConfig.scan_shapes holds {missing}, which are not in shapes; scan a subset "
                                f"of shapes")


@dataclass(frozen=True)
class RebalancingConfig(_Section):
    """Samples moved between replicas after shaping (water-filling rounds, then single moves)."""

    #: the fastest replicas a move off the slowest may go to (rebalancing and refinement; inherited)
    balance_partners: int = 3
    #: single moves off the slowest replica (off: yardstick cases up to 4.2% slower)
    max_shed_moves: int = 12
    #: the shares of the slowest replica's movable cost a single move tries (inherited)
    shed_shares: tuple[float, ...] = (0.02, 0.06, 0.15, 0.35, 0.8)
    #: above this many replicas the rebalancing starts with water-filling (off: ``--large`` steps up to 10.6% slower)
    water_fill_replicas: int = 16
    #: ... its rounds, then this many single moves
    water_rounds: int = 2
    shed_moves_after_water: int = 2
    #: water-filling fills a replica's micro-batches to this share of their token room (``k * cap``; inherited)
    token_fill: float = 0.9
    #: a sample holding this share of its replica's cost is dominant: kept with the step's cheapest (inherited)
    strip_share: float = 0.25

    _SHARES = ("strip_share",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.token_fill <= 1:
            raise ScheduleError(f"RebalancingConfig.token_fill = {self.token_fill!r} must lie in (0, 1]")


@dataclass(frozen=True)
class RefinementConfig(_Section):
    """Order swaps and local sample moves on the slowest replica of the best plans."""

    #: the best plan of each of this many counts is refined
    finalists: int = 2
    #: the best finalist's share of the budget left (0.75 and 1.0 moved the yardstick's mean by under 0.001)
    lead_share: float = 0.5
    #: moves drawn per round, priced in one call (inherited)
    refine_moves: int = 256
    #: the share of swaps whose other sample is drawn from the slowest replica itself (inherited: an even split)
    swap_within_share: float = 0.5
    #: the refinement stops once this many rounds together gained less than ``objective.min_gain``
    refine_patience: int = 8
    #: the seed of its random stream (the same input always gives the same plan)
    refine_seed: int = 1
    #: order swaps tried per round: every pair up to this many (every pair of 24 micro-batches), else adjacent,
    #: end and in-group pairs (in-group pairs: the yardstick's pp 8 x VPP 2 from 1.017 to 1.008 of the best)
    max_order_swaps: int = 276
    #: rounds of order swaps (off: a ``--large`` step 2.3% slower)
    order_rounds: int = 6

    _SHARES = ("swap_within_share",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.lead_share <= 1:
            raise ScheduleError(f"RefinementConfig.lead_share = {self.lead_share!r} must lie in (0, 1]")


@dataclass(frozen=True)
class BudgetConfig(_Section):
    """The step's work budget (:class:`~.pipeline_pricing.Budget`) and the estimates it is counted in, in **cells**:
    one cell is one row x micro-batch x virtual stage priced by the pipeline model, every other kind of work counted
    as the cells that take as long (the ratios timed on the benches' 2-core machine: ``bench.pipeline_speed``,
    ``bench.pipeline_search``; a cell took 5.5 ns there when they were fitted, about 2.9 ns since the model's pass
    was made cheaper, so a million cells is about 3 ms of planning)."""

    #: the fixed part is ``min(floor_max, max(floor_min, floor / dp ** floor_power))``: 4.4M cells up to dp 12 (below
    #: it dp 4 x VPP 2 pinned steps planned up to 1.2% slower than the earlier planner), 2.4M at dp 32 (1.3M left a
    #: case at 1.047)
    floor: float = 1.818182e8
    floor_power: float = 1.25
    floor_max: float = 4.363636e6
    #: ... never below ``floor_min * (dp / 128) ** floor_min_dp_power / (pp / 4) ** floor_min_pp_power`` (dp 70 up):
    #: one count's shaped search, whose calls' fixed costs do not shrink with more replicas; fitted to
    #: ``bench.pipeline_speed``'s 16-per-replica layouts (docs/pipeline.md)
    floor_min: float = 9e5
    floor_min_dp_power: float = 0.7
    floor_min_pp_power: float = 0.17
    #: the growing part, per sample and per replica (times ``pp ** pp_power``): the large grid of
    #: ``bench.pipeline_speed`` at 0.75-0.95 of the earlier planner's planning time
    per_sample: float = 65.45455
    per_replica: float = 1545.455
    pp_power: float = 0.5
    #: the share of the fixed part the shaped candidate leaves to the refinement
    refine_share: float = 0.15
    #: a model call: per group of rows of one count, and per level of its DAG (fitted with the cell by least squares
    #: on 636 timed calls)
    model_call: float = 7272.727
    model_level: float = 581.8182
    #: a packing call: per sample rank, per row, per row x micro-batch (fitted on 280 timed calls)
    pack_pass: float = 1636.364
    pack_pass_row: float = 8.181818
    pack_cell: float = 0.1454545
    #: the numpy around a packing call or a round of the refinement or order search (timed: 27k-73k cells)
    loop_round: float = 45454.55
    #: a water-filling round's Python per replica (timed: 0.3-0.4 ms a round at dp 128)
    water_replica: float = 545.4545
    #: a refinement round prices its drawn moves' rows and, per two of them, this many partner rows (estimated)
    refine_partner_rows: int = 1
    #: a plan taken apart or put together: one pass-row per sample and this many per replica (timed)
    replica_passes: int = 10

    _SHARES = ("refine_share",)


@dataclass(frozen=True)
class ModelConfig(_Section):
    """How the pipeline model evaluates many replicas (memory and speed, never results)."""

    #: replicas are evaluated in passes of at most this many table entries
    model_table_entries: int = 1 << 23
    #: groups of replicas are evaluated in pieces of one width (the narrowest group's, or the widest's over this many)
    model_pieces: int = 4


#: the sections, by the name :class:`PlannerConfig` holds each under
SECTIONS = {"objective": ObjectiveConfig, "packing": PackingConfig, "count_search": CountSearchConfig,
            "shaping": ShapingConfig, "rebalancing": RebalancingConfig, "refinement": RefinementConfig,
            "budget": BudgetConfig, "model": ModelConfig}


@dataclass(frozen=True)
class PlannerConfig:
    """The planner's tunables, in sections (:data:`SECTIONS`); ``candidates``: the pipeline search's candidate
    generators that run, in registry order (:data:`slime_ext.schedule.pipeline_choice.CANDIDATES`; the first must
    be "unaware", the guard; a bench leaves one out to measure what it brings)."""

    candidates: tuple[str, ...] = ("unaware", "ordered", "shaped", "refined")
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    count_search: CountSearchConfig = field(default_factory=CountSearchConfig)
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    rebalancing: RebalancingConfig = field(default_factory=RebalancingConfig)
    refinement: RefinementConfig = field(default_factory=RefinementConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        value = _checked("PlannerConfig", "candidates", self.candidates, ("unaware",))
        object.__setattr__(self, "candidates", value)
        for name, kind in SECTIONS.items():
            if not isinstance(getattr(self, name), kind):
                raise ScheduleError(f"PlannerConfig.{name} = {getattr(self, name)!r} must be a {kind.__name__}")

    # ------------------------------------------------------------------ overrides (the benches' --set)
    def replace_from(self, items: Iterable[str]) -> "PlannerConfig":
        """A copy with ``SECTION.FIELD=VALUE`` overrides (a bench's ``--set``; a field name found in one section
        alone may go without it, and ``candidates`` has none): a number, ``true``/``false``, or JSON for a tuple
        (``count_search.count_factors=[1.0,1.2]``, ``shaping.shapes=[[0,0,1.0],[2,6,0.5]]``). An unknown name or a
        value of the wrong kind raises :class:`ScheduleError` naming it."""
        changes: dict[str, dict[str, Any]] = {}
        for item in items:
            name, sep, text = str(item).partition("=")
            section, key = self._locate(name.strip(), item, bool(sep))
            default = (getattr(self, section) if section else self).__dataclass_fields__[key]
            default = default.default if default.default is not dataclasses.MISSING else default.default_factory()
            changes.setdefault(section, {})[key] = _parsed(item, key, text, default)
        top = changes.pop("", {})
        sections = {s: dataclasses.replace(getattr(self, s), **fields) for s, fields in changes.items()}
        return dataclasses.replace(self, **top, **sections)

    def _locate(self, name: str, item: str, has_value: bool) -> tuple[str, str]:
        """``(section, field)`` of a ``--set`` name (``""``: a top-level field)."""
        known = _field_names()
        if "." in name:
            section, _, key = name.partition(".")
            found = [(section, key)] if section in SECTIONS and key in SECTIONS[section].__dataclass_fields__ else []
        else:
            found = [(s, name) for s, kind in SECTIONS.items() if name in kind.__dataclass_fields__]
            found += [("", name)] if name == "candidates" else []
        if not has_value or len(found) != 1:
            raise ScheduleError(f"--set {item!r}: expected NAME=VALUE with NAME a PlannerConfig field "
                                f"(SECTION.FIELD), one of {known}")
        return found[0]

    def describe(self) -> dict[str, Any]:
        """The fields that differ from the defaults, by dotted name (for a bench's header)."""
        base = PlannerConfig()
        out: dict[str, Any] = {"candidates": self.candidates} if self.candidates != base.candidates else {}
        for s in SECTIONS:
            for f in dataclasses.fields(getattr(self, s)):
                if getattr(getattr(self, s), f.name) != getattr(getattr(base, s), f.name):
                    out[f"{s}.{f.name}"] = getattr(getattr(self, s), f.name)
        return out


def _field_names() -> list[str]:
    return ["candidates"] + [f"{s}.{f.name}" for s, kind in SECTIONS.items() for f in dataclasses.fields(kind)]


#: integer fields that may be 0 (a loop that does not run; the seed); every other integer is at least 1
_LEAST = {"max_extra_rounds": 0, "order_rounds": 0, "max_shed_moves": 0, "water_rounds": 0,
          "shed_moves_after_water": 0, "refine_patience": 0, "refine_seed": 0}


def _where(section: object) -> str:
    return type(section).__name__


def _checked(where: str, name: str, value: Any, default: Any) -> Any:
    """``value`` as its field's kind (floats as float, lists as tuples), or a :class:`ScheduleError` naming it."""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= _LEAST.get(name, 1)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        value = float(value) if ok else value
    else:
        ok = isinstance(value, (tuple, list)) and len(value) > 0
        value = tuple(tuple(v) if isinstance(v, list) else v for v in value) if ok else value
    if not ok:
        raise ScheduleError(f"{where}.{name} = {value!r} must be {_kind(default, name)} (default {default!r}); see "
                            f"the field's documentation in slime_ext/schedule/planner_config.py")
    return value


def _parsed(item: str, name: str, text: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if text.strip().lower() not in ("true", "false"):
                raise ValueError
            return text.strip().lower() == "true"
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        return json.loads(text)
    except ValueError:
        raise ScheduleError(f"--set {item!r}: {name} takes {_kind(default, name)}, e.g. {name}={default!r}")


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
