"""A model of Megatron's pipeline schedules: the makespan of one step of one DP replica, from its micro-batches' costs.

The planner compares candidate schedules by it when ``pp_size > 1`` (the step time of a pipelined replica is the
makespan of megatron-core's schedule, not the sum of its micro-batches). Pure: standard library and numpy.

**What is modelled.** Each stage runs the program megatron-core 0.16's schedule function runs on that pipeline
rank, in the same order (read from ``forward_backward_pipelining_without_interleaving`` and ``..._with_interleaving``
in ``megatron/core/pipeline_parallel/schedules.py``, written here in our own words):

* 1F1B (``vpp_size == 1``): rank ``s`` runs ``min(pp - s - 1, M)`` warm-up forwards, then one forward and one
  backward in turn, then the remaining backwards (cool-down). Its p2p calls are the blocking ones megatron-core
  makes: ``recv_forward``, ``send_forward``, ``send_forward_recv_backward`` (one batch),
  ``send_backward_recv_forward`` (one batch), ``recv_backward``, ``send_backward``.
* Interleaved (``vpp_size > 1``): see :func:`interleaved_programs`.

**Time.** An operation starts when the previous one on its stage has ended (one stream per stage). A transfer of
one micro-batch's activation or gradient over one stage boundary takes ``p2p_s`` seconds, and it starts when both
sides have posted it: megatron-core's sends block until the peer receives (gloo; NCCL likewise for tensors this
size), so a blocking call that sends and receives returns when *all* its transfers are done. Messages on one
directed link pair up in program order (first send with first receive), as the communication libraries do.
The program is then a DAG whose node times are ``max(predecessors) + duration``; it is evaluated level by level,
vectorised over replicas (:func:`pipeline_makespan`).

**Assumptions.**

* Layers are split evenly: one stage's forward of micro-batch ``m`` takes ``fwd[m]`` on every stage (its
  backward ``bwd[m]``); under VPP one model chunk takes ``fwd[m] / vpp_size``. No first/last-stage extras
  (embedding, loss): fold them into the costs if a profile measures them.
* ``p2p_s`` is the same for every micro-batch and boundary (activations of a packed micro-batch have a fixed
  shape per token budget; a profile measures it once).
* Nothing else on the critical path: no optimizer, no DP gradient reduction, no kernel launch or wake-up latency.
  Measured on megatron-core's real schedule (``bench/pipeline.py``, the notes), such a model is a few percent low.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import ScheduleError
from .validate import MAX_PARALLEL_SIZE, check_bool, check_int, show

__all__ = ["PipelineSpec", "bubble_fraction", "pipeline_lower_bound", "pipeline_makespan", "pipeline_timeline",
           "stage_programs"]


@dataclass(frozen=True)
class PipelineSpec:
    """One replica's pipeline layout and p2p mode, as megatron-core runs it."""

    pp_size: int  # pipeline stages
    vpp_size: int = 1  # model chunks per stage (Megatron's interleaved schedule when > 1)
    #: consecutive micro-batches a stage runs per model chunk before switching chunk (interleaved schedule only);
    #: ``None`` is Megatron's default, ``pp_size``
    microbatch_group_size_per_vp_stage: int | None = None
    #: seconds of one stage-boundary send/recv of one micro-batch's activation or gradient
    p2p_s: float = 0.0
    #: interleaved schedule only: Megatron's ``overlap_p2p_comm`` (posted early, waited just before use; Megatron-LM
    #: training's default with VPP) instead of one blocking batch of sends and receives per iteration
    overlap_p2p_comm: bool = False

    def __post_init__(self) -> None:
        for name, fix in (("pp_size", "pass the pipeline-parallel size (>= 1)"),
                          ("vpp_size", "pass 1 without virtual pipeline parallelism")):
            object.__setattr__(self, name, check_int(f"PipelineSpec.{name}", getattr(self, name),
                                                     maximum=MAX_PARALLEL_SIZE, fix=fix))
        group = self.microbatch_group_size_per_vp_stage
        if group is None:
            group = self.pp_size
        object.__setattr__(self, "microbatch_group_size_per_vp_stage", check_int(
            "PipelineSpec.microbatch_group_size_per_vp_stage", group, maximum=MAX_PARALLEL_SIZE,
            fix="pass None for Megatron's default (pp_size)"))
        p2p = self.p2p_s
        if isinstance(p2p, bool) or not isinstance(p2p, (int, float, np.floating, np.integer)) \
                or not math.isfinite(float(p2p)) or p2p < 0:
            raise ScheduleError(f"PipelineSpec.p2p_s = {show(p2p)} must be a finite number of seconds >= 0; "
                                f"pass 0 to ignore point-to-point cost")
        object.__setattr__(self, "p2p_s", float(p2p))
        object.__setattr__(self, "overlap_p2p_comm", check_bool("PipelineSpec.overlap_p2p_comm",
                                                                self.overlap_p2p_comm))

    @property
    def group(self) -> int:
        """``microbatch_group_size_per_vp_stage``, resolved."""
        return int(self.microbatch_group_size_per_vp_stage)  # type: ignore[arg-type]

    def check_microbatches(self, num_microbatches: int) -> None:
        """Raise :class:`ScheduleError` where megatron-core refuses ``num_microbatches`` for this layout."""
        m = num_microbatches
        if m < 1:
            raise ScheduleError(f"num_microbatches = {m}: a pipelined step needs at least one micro-batch")
        if self.vpp_size > 1 and self.pp_size > 1:
            g = self.group
            if not self.pp_size <= g <= m:
                raise ScheduleError(
                    f"microbatch_group_size_per_vp_stage = {g} must lie in [pp_size = {self.pp_size}, "
                    f"num_microbatches = {m}] for the interleaved schedule (megatron-core refuses it otherwise); "
                    f"pass a group size in that range or plan at least {max(g, self.pp_size)} micro-batches per rank")
            if 0 < m % g < self.pp_size:
                raise ScheduleError(
                    f"num_microbatches = {m} leaves a last group of {m % g} < pp_size = {self.pp_size} micro-batches "
                    f"with microbatch_group_size_per_vp_stage = {g} (megatron-core refuses it); use a multiple of "
                    f"{g} or a remainder >= {self.pp_size}")


# ---------------------------------------------------------------------------------------------------- programs
# A stage's program is a list of operations, in the order megatron-core runs them:
#   ("C", kind, mb, chunk)   compute: kind "F" or "B" of micro-batch `mb` (index in run order) in model chunk `chunk`
#   ("X", items, blocking)   one p2p call; items are (link, role, handle): link ("f", src) carries activations from
#                            rank src to rank (src + 1) % pp, ("b", src) gradients from src to (src - 1) % pp; role
#                            "send" or "recv"; a blocking call returns when all its transfers are done
#   ("W", handles)           wait for the transfers of earlier non-blocking calls


class _Program:
    """Builds one stage's operation list; handles are unique per stage."""

    def __init__(self, rank: int, pp: int) -> None:
        self.rank, self.pp, self.ops, self._next = rank, pp, [], 0

    def compute(self, kind: str, mb: int, chunk: int = 0) -> None:
        self.ops.append(("C", kind, mb, chunk))

    def comm(self, *, send_next: bool = False, recv_prev: bool = False, send_prev: bool = False,
             recv_next: bool = False, blocking: bool = True) -> dict[str, int]:
        """One p2p call (the flags are megatron-core's names); returns the handle of each transfer it posted."""
        r, pp = self.rank, self.pp
        items, handles = [], {}
        for flag, name, link, role in ((send_next, "send_next", ("f", r), "send"),
                                       (recv_prev, "recv_prev", ("f", (r - 1) % pp), "recv"),
                                       (send_prev, "send_prev", ("b", r), "send"),
                                       (recv_next, "recv_next", ("b", (r + 1) % pp), "recv")):
            if flag:
                items.append((link, role, self._next))
                handles[name] = self._next
                self._next += 1
        if items:
            self.ops.append(("X", tuple(items), blocking))
        return handles

    def wait(self, *handles: int | None) -> None:
        hs = tuple(h for h in handles if h is not None)
        if hs:
            self.ops.append(("W", hs))


def one_f_one_b_programs(pp: int, m: int) -> list[list[tuple]]:
    """The non-interleaved schedule's programs, rank by rank (``forward_backward_pipelining_without_interleaving``)."""
    programs = []
    for s in range(pp):
        p = _Program(s, pp)
        first, last = s == 0, s == pp - 1
        warmup = min(pp - s - 1, m)
        remaining = m - warmup
        for i in range(warmup):
            p.comm(recv_prev=not first)  # recv_forward
            p.compute("F", i)
            p.comm(send_next=not last)  # send_forward
        if remaining:
            p.comm(recv_prev=not first)  # recv_forward of the first steady micro-batch
        for i in range(remaining):
            p.compute("F", warmup + i)
            p.comm(send_next=not last, recv_next=not last)  # send_forward_recv_backward
            p.compute("B", i)
            if i == remaining - 1:
                p.comm(send_prev=not first)  # send_backward
            else:
                p.comm(send_prev=not first, recv_prev=not first)  # send_backward_recv_forward
        for i in range(remaining, m):  # cool-down
            p.comm(recv_next=not last)  # recv_backward
            p.compute("B", i)
            p.comm(send_prev=not first)  # send_backward
        programs.append(p.ops)
    return programs


def stage_programs(spec: PipelineSpec, num_microbatches: int) -> list[list[tuple]]:
    """Every rank's program for ``num_microbatches`` micro-batches (see the comment above :class:`_Program`)."""
    spec.check_microbatches(num_microbatches)
    if spec.vpp_size == 1 or spec.pp_size == 1:
        return one_f_one_b_programs(spec.pp_size, num_microbatches)
    raise ScheduleError(f"PipelineSpec.vpp_size = {spec.vpp_size}: the interleaved schedule is not modelled yet; "
                        f"pass vpp_size = 1")


# ---------------------------------------------------------------------------------------------------- the DAG
@dataclass(frozen=True)
class _Dag:
    """A program set compiled to a DAG: node ``i`` ends at ``max(end of preds[i]) + duration column col[i]``.

    Columns ``0..M-1`` are forwards, ``M..2M-1`` backwards (of one chunk), ``2M`` the p2p time, ``2M+1`` zero.
    ``preds`` is padded with the sentinel ``num_nodes`` (always 0). ``levels`` lists node ids whose predecessors all
    lie in earlier levels. ``computes`` maps (stage, kind, mb, chunk) to its node, in program order per stage.
    """

    num_nodes: int
    col: np.ndarray
    preds: np.ndarray
    levels: tuple[np.ndarray, ...]
    computes: tuple[tuple[tuple[str, int, int], ...], ...]  # per stage: (kind, mb, chunk) in program order
    compute_nodes: tuple[np.ndarray, ...]  # per stage: node ids of those computes


def _compile(programs: list[list[tuple]], m: int) -> _Dag:
    p2p_col, zero_col = 2 * m, 2 * m + 1
    col: list[int] = []
    preds: list[list] = []  # entries: node id (int) or ("T", stage, handle), resolved below
    ends: dict[tuple, list] = {}  # link -> {"send": [(post node, stage, handle)], "recv": [...]}
    computes, compute_nodes = [], []

    def node(c: int, p: list) -> int:
        col.append(c)
        preds.append(p)
        return len(col) - 1

    source = -1  # "time 0"
    for s, ops in enumerate(programs):
        cur = source
        comp, comp_nodes = [], []
        for op in ops:
            if op[0] == "C":
                _, kind, mb, chunk = op
                cur = node(mb if kind == "F" else m + mb, [cur])
                comp.append((kind, mb, chunk))
                comp_nodes.append(cur)
            elif op[0] == "X":
                _, items, blocking = op
                for link, role, h in items:
                    ends.setdefault(link, {"send": [], "recv": []})[role].append((cur, s, h))
                if blocking:
                    cur = node(zero_col, [cur] + [("T", s, h) for _, _, h in items])
            else:  # "W"
                cur = node(zero_col, [cur] + [("T", s, h) for h in op[1]])
        computes.append(tuple(comp))
        compute_nodes.append(np.asarray(comp_nodes, dtype=np.int64))

    transfer: dict[tuple[int, int], int] = {}
    for link, sides in ends.items():
        sends, recvs = sides["send"], sides["recv"]
        if len(sends) != len(recvs):
            raise AssertionError(f"link {link}: {len(sends)} sends but {len(recvs)} receives")  # a program bug
        for (sp, ss, sh), (rp, rs, rh) in zip(sends, recvs):
            t = node(p2p_col, [sp, rp])
            transfer[(ss, sh)] = transfer[(rs, rh)] = t

    n = len(col)
    resolved = [[transfer[(q[1], q[2])] if isinstance(q, tuple) else (n if q == source else q) for q in p]
                for p in preds]
    # levels by Kahn's algorithm (a cycle would be a deadlock of the modelled schedule: a program bug)
    level = [-1] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for i, p in enumerate(resolved):
        for q in p:
            if q != n:
                succ[q].append(i)
                indeg[i] += 1
    frontier = [i for i in range(n) if indeg[i] == 0]
    for i in frontier:
        level[i] = 0
    head = 0
    while head < len(frontier):
        i = frontier[head]
        head += 1
        for j in succ[i]:
            level[j] = max(level[j], level[i] + 1)
            indeg[j] -= 1
            if indeg[j] == 0:
                frontier.append(j)
    if len(frontier) != n:
        raise AssertionError("the modelled schedule deadlocks")  # a program bug, never the caller's input
    width = max(len(p) for p in resolved)
    padded = np.full((n, width), n, dtype=np.int64)
    for i, p in enumerate(resolved):
        padded[i, :len(p)] = p
    lv = np.asarray(level)
    order = np.argsort(lv, kind="stable")
    bounds = np.searchsorted(lv[order], np.arange(lv.max() + 2))
    levels = tuple(order[bounds[k]:bounds[k + 1]] for k in range(len(bounds) - 1))
    return _Dag(n, np.asarray(col, dtype=np.int64), padded, levels, tuple(computes), tuple(compute_nodes))


@lru_cache(maxsize=256)
def _dag(spec: PipelineSpec, m: int) -> _Dag:
    return _compile(stage_programs(spec, m), m)


# ---------------------------------------------------------------------------------------------------- evaluation
def _as_costs(fwd, bwd) -> tuple[np.ndarray, np.ndarray, bool]:
    f = np.asarray(fwd, dtype=np.float64)
    b = np.asarray(bwd, dtype=np.float64)
    one = f.ndim == 1
    if f.ndim not in (1, 2) or f.shape != b.shape:
        raise ScheduleError(f"fwd and bwd must have the same shape, (M,) or (replicas, M); got {f.shape} and "
                            f"{b.shape}; pass one cost per micro-batch in run order")
    if f.shape[-1] == 0:
        raise ScheduleError("fwd has no micro-batches; a pipelined step needs at least one")
    for name, a in (("fwd", f), ("bwd", b)):
        if not np.isfinite(a).all() or (a < 0).any():
            raise ScheduleError(f"{name} holds a negative or non-finite cost ({show(a.min())}); pass per-stage "
                                f"seconds (or FLOPs) >= 0")
    if one:
        f, b = f[None, :], b[None, :]
    return f, b, one


def _node_ends(f: np.ndarray, b: np.ndarray, spec: PipelineSpec) -> tuple[np.ndarray, _Dag]:
    """End time of every node, shape ``(R, num_nodes + 1)`` (the last column is the sentinel 0)."""
    r, m = f.shape
    dag = _dag(spec, m)
    v = spec.vpp_size
    dur = np.empty((r, 2 * m + 2))
    dur[:, :m] = f / v
    dur[:, m:2 * m] = b / v
    dur[:, 2 * m] = spec.p2p_s
    dur[:, 2 * m + 1] = 0.0
    end = np.zeros((r, dag.num_nodes + 1))
    for nodes in dag.levels:
        end[:, nodes] = end[:, dag.preds[nodes]].max(axis=2) + dur[:, dag.col[nodes]]
    return end, dag


def pipeline_makespan(fwd, bwd, spec: PipelineSpec):
    """Makespan of one step of Megatron's schedule per replica.

    ``fwd``, ``bwd``: ``(R, M)`` or ``(M,)`` per-stage seconds (or FLOP units) of each micro-batch in the order the
    micro-batches run (one stage's forward/backward of micro-batch ``m``; layers split evenly). Returns ``(R,)``
    makespans, or a float for 1-D input: the time the last operation of any stage ends.
    """
    f, b, one = _as_costs(fwd, bwd)
    if not isinstance(spec, PipelineSpec):
        raise ScheduleError(f"spec must be a PipelineSpec, got {type(spec).__name__}")
    end, _ = _node_ends(f, b, spec)
    out = end.max(axis=1)
    return float(out[0]) if one else out


def pipeline_timeline(fwd, bwd, spec: PipelineSpec) -> list[list[tuple]]:
    """One replica's timeline: per stage, ``(kind, mb, chunk, start, end)`` of each forward/backward in run order."""
    f, b, _ = _as_costs(fwd, bwd)
    if f.shape[0] != 1:
        raise ScheduleError(f"pipeline_timeline takes one replica's costs, shape (M,); got {f.shape}")
    end, dag = _node_ends(f, b, spec)
    m = f.shape[1]
    out = []
    for comp, nodes in zip(dag.computes, dag.compute_nodes):
        e = end[0, nodes]
        d = np.where([k == "F" for k, _, _ in comp], f[0, [mb for _, mb, _ in comp]],
                     b[0, [mb for _, mb, _ in comp]]) / spec.vpp_size if len(comp) else np.zeros(0)
        out.append([(k, mb, c, float(ei - di), float(ei)) for (k, mb, c), ei, di in zip(comp, e, d)])
    del m
    return out


def bubble_fraction(fwd, bwd, spec: PipelineSpec):
    """``1 - (one stage's work) / makespan``: the share of the step a stage idles (all stages do the same work,
    ``sum(fwd) + sum(bwd)``, since layers are split evenly). Shapes as :func:`pipeline_makespan`."""
    f, b, one = _as_costs(fwd, bwd)
    span = np.atleast_1d(pipeline_makespan(f, b, spec))
    work = f.sum(axis=1) + b.sum(axis=1)
    out = np.where(span > 0, 1.0 - work / np.where(span > 0, span, 1.0), 0.0)
    return float(out[0]) if one else out


def pipeline_lower_bound(fwd, bwd, spec: PipelineSpec):
    """No order of these micro-batches runs faster (proof to follow with the full model); shapes as
    :func:`pipeline_makespan`."""
    f, b, one = _as_costs(fwd, bwd)
    pp = spec.pp_size
    trip = (pp * (f + b)).max(axis=1) + 2 * (pp - 1) * spec.p2p_s
    work = f.sum(axis=1) + b.sum(axis=1)
    out = np.maximum(trip, work)
    return float(out[0]) if one else out
