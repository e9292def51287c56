"""A model of Megatron's pipeline schedules: the makespan of one step of one DP replica, from its micro-batches' costs
(the planner's objective when ``pp_size > 1``). Each stage runs the program megatron-core 0.16 runs on that rank
(:func:`stage_programs`); the programs are compiled once per layout into a DAG of the computes and evaluated level by
level, vectorised over replicas. What it models and assumes: ``docs/pipeline.md``, "The pipeline model".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import ScheduleError
from .planner_config import DEFAULT_CONFIG, PlannerConfig
from .validate import MAX_PARALLEL_SIZE, check_bool, check_int, check_number, show

__all__ = ["PipelineSpec", "bubble_fraction", "pipeline_lower_bound", "pipeline_makespan", "pipeline_timeline",
           "stage_programs"]


@dataclass(frozen=True)
class PipelineSpec:
    """One replica's pipeline layout and p2p mode, as megatron-core runs it."""

    pp_size: int  # pipeline stages
    vpp_size: int = 1  # model chunks per stage (Megatron's interleaved schedule when > 1)
    #: micro-batches a stage runs per model chunk before switching chunk (interleaved only); ``None``: ``pp_size``
    microbatch_group_size_per_vp_stage: int | None = None
    #: seconds of one stage-boundary send/recv of one micro-batch's activation or gradient
    p2p_s: float = 0.0
    #: interleaved only: Megatron's ``overlap_p2p_comm`` (transfers posted early, waited just before use)
    overlap_p2p_comm: bool = False
    #: megatron-core's ``forward_only=True`` (log-prob and reference passes): forwards only, backward costs unread
    forward_only: bool = False

    def __post_init__(self) -> None:
        for name, fix in (("pp_size", "pass the pipeline-parallel size (>= 1)"),
                          ("vpp_size", "pass 1 without virtual pipeline parallelism")):
            object.__setattr__(self, name, check_int(f"PipelineSpec.{name}", getattr(self, name),
                                                     maximum=MAX_PARALLEL_SIZE, fix=fix))
        group = self.microbatch_group_size_per_vp_stage
        object.__setattr__(self, "microbatch_group_size_per_vp_stage", check_int(
            "PipelineSpec.microbatch_group_size_per_vp_stage", self.pp_size if group is None else group,
            maximum=MAX_PARALLEL_SIZE, fix="pass None for Megatron's default (pp_size)"))
        p2p = check_number("PipelineSpec.p2p_s", self.p2p_s)
        if p2p < 0:
            raise ScheduleError(f"PipelineSpec.p2p_s = {p2p} must be >= 0 seconds; pass 0 to ignore point-to-point "
                                f"cost")
        object.__setattr__(self, "p2p_s", p2p)
        for name in ("overlap_p2p_comm", "forward_only"):
            object.__setattr__(self, name, check_bool(f"PipelineSpec.{name}", getattr(self, name)))

    @property
    def chunks(self) -> int:
        """Model chunks per stage as megatron-core runs them: ``vpp_size``, but 1 without pipelining."""
        return self.vpp_size if self.pp_size > 1 else 1

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

    def overlapped(self, run, pending: list[int], skip_wait: bool, sending: int | None, send: str, recv: str,
                   **flags: bool) -> int | None:
        """Half an interleaved iteration with ``overlap_p2p_comm``: wait for the oldest ``pending`` receive (unless
        ``skip_wait``), ``run`` the compute, post the transfers, wait for the previous send (``sending``); the new
        receive joins ``pending``. Returns the new send's handle."""
        if not skip_wait and pending:
            self.wait(pending.pop(0))
        run()
        h = self.comm(blocking=False, **flags)
        self.wait(sending)
        if recv in h:
            pending.append(h[recv])
        return h.get(send)


def one_f_one_b_programs(pp: int, m: int, forward_only: bool = False) -> list[list[tuple]]:
    """The non-interleaved schedule's programs, rank by rank (``forward_backward_pipelining_without_interleaving``,
    ``forward_only``: its forward-only path)."""
    programs = []
    for s in range(pp):
        p = _Program(s, pp)
        first, last = s == 0, s == pp - 1
        warmup = m if forward_only else min(pp - s - 1, m)
        remaining = m - warmup
        for i in range(warmup):
            p.comm(recv_prev=not first)  # recv_forward
            p.compute("F", i)
            p.comm(send_next=not last)  # send_forward
        if forward_only:
            programs.append(p.ops)
            continue
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


def schedule_table(m: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """``(micro-batch, model chunk)`` of each virtual micro-batch of the interleaved schedule: groups of ``group``
    micro-batches, each through chunk 0, then 1, ...; the last group takes all that are left."""
    table = []
    for start in range(0, m, group):
        stop = m if start + group >= m else start + group
        table.extend((mb, chunk) for chunk in range(vpp) for mb in range(start, stop))
    return table


def warmup_microbatches(pp: int, rank: int, m: int, vpp: int = 1, group: int | None = None) -> int:
    """Forwards rank ``rank`` runs before its first backward: ``pp - rank - 1`` (1F1B) or ``2 (pp - rank - 1) +
    (vpp - 1) group`` virtual micro-batches (interleaved), at most all of them."""
    if vpp == 1:
        return min(pp - rank - 1, m)
    return min(2 * (pp - rank - 1) + (vpp - 1) * (pp if group is None else group), m * vpp)


class _InterleavedRank:
    """Rank ``r``'s program of the interleaved schedule (``forward_backward_pipelining_with_interleaving``, default
    flags), phase by phase; its p2p calls per mode: ``docs/pipeline.md``, "The pipeline model"."""

    def __init__(self, r: int, pp: int, vpp: int, m: int, group: int) -> None:
        self.r, self.pp, self.vpp, self.m, self.group = r, pp, vpp, m, group
        self.table = schedule_table(m, vpp, group)
        self.total = m * vpp
        self.first, self.last = r == 0, r == pp - 1
        self.p = _Program(r, pp)
        self.recv_prev_handles: list[int] = []
        self.recv_next_handles: list[int] = []

    def chunk(self, k: int, forward: bool) -> int:
        c = self.table[k % self.total][1]
        return c if forward else self.vpp - 1 - c

    def receives(self, k: int, forward: bool) -> bool:
        """Whether the rank receives, after virtual micro-batch k, an input (forward) or a gradient (backward)."""
        if not (self.first if forward else self.last):  # only the ring's leading rank skips receives
            return True
        if k < self.pp - 1:
            return False
        return self.chunk(k - (self.pp - 1), forward) != (self.vpp - 1 if forward else 0)

    def sends_output(self, k: int) -> bool:
        return not (self.last and self.chunk(k, True) == self.vpp - 1)

    def sends_grad(self, k: int) -> bool:
        return not (self.first and self.chunk(k, False) == 0)

    def forward(self, k: int) -> None:
        self.p.compute("F", self.table[k][0], self.chunk(k, True))

    def backward(self, k: int) -> None:
        self.p.compute("B", self.table[k][0], self.chunk(k, False))

    def program(self, overlap: bool, forward_only: bool) -> list:
        """The rank's operations; forward-only: every virtual micro-batch a warm-up forward (``overlap`` unread)."""
        total, p = self.total, self.p
        warmup = total if forward_only else warmup_microbatches(self.pp, self.r, self.m, self.vpp, self.group)
        self._warmup(warmup, overlap)
        send_prev_handle = self._steady(warmup, overlap)
        if forward_only:
            return p.ops
        if warmup == total:
            p.comm(recv_next=not self.last)  # recv_backward
        for k in range(total - warmup, total):  # the cool-down
            if not (self.last and self.chunk(k, False) == self.vpp - 1) and k != 0 and self.recv_next_handles:
                p.wait(self.recv_next_handles.pop(0))
            recv_next = self.receives(k, False) and k != total - 1
            self.backward(k)
            p.comm(send_prev=self.sends_grad(k), recv_next=recv_next)
        p.wait(send_prev_handle)  # (the last forward send is left pending; its receiver ends the step later)
        return p.ops

    def _warmup(self, warmup: int, overlap: bool) -> None:
        total, p, all_warmup = self.total, self.p, warmup == self.total
        p.comm(recv_prev=not self.first)  # recv_forward of chunk 0's first input
        for k in range(warmup):
            recv_prev = self.receives(k, True) and k != total - 1
            self.forward(k)
            if k == warmup - 1 and not overlap and not all_warmup:
                p.comm(send_next=self.sends_output(k), recv_prev=recv_prev, recv_next=not self.last)
            else:
                p.comm(send_next=self.sends_output(k), recv_prev=recv_prev)
            if overlap and k == warmup - 1 and not all_warmup:
                h = p.comm(recv_next=not self.last, blocking=False)  # posted only
                if "recv_next" in h:
                    self.recv_next_handles.append(h["recv_next"])

    def _steady(self, warmup: int, overlap: bool) -> int | None:
        """The steady state, one forward and one backward per iteration; returns the last gradient send pending."""
        p, remaining, vpp = self.p, self.total - warmup, self.vpp
        send_next_handle = send_prev_handle = None
        for k in range(remaining):
            fk = warmup + k
            recv_prev = self.receives(fk, True) and k != remaining - 1
            recv_next = self.receives(k, False)
            if overlap:
                send_next_handle = p.overlapped(
                    lambda: self.forward(fk), self.recv_prev_handles, self.first and self.chunk(fk, True) == 0,
                    send_next_handle, "send_next", "recv_prev", send_next=self.sends_output(fk), recv_prev=recv_prev)
                send_prev_handle = p.overlapped(
                    lambda: self.backward(k), self.recv_next_handles, self.last and self.chunk(k, False) == vpp - 1,
                    send_prev_handle, "send_prev", "recv_next", send_prev=self.sends_grad(k), recv_next=recv_next)
            else:
                self.forward(fk)
                self.backward(k)
                p.comm(send_next=self.sends_output(fk), recv_prev=recv_prev, send_prev=self.sends_grad(k),
                       recv_next=recv_next)
        return send_prev_handle


def stage_programs(spec: PipelineSpec, num_microbatches: int) -> list[list[tuple]]:
    """Every rank's program for ``num_microbatches`` micro-batches (see the comment above :class:`_Program`)."""
    spec.check_microbatches(num_microbatches)
    pp, m = spec.pp_size, num_microbatches
    if spec.vpp_size == 1 or pp == 1:
        return one_f_one_b_programs(pp, m, spec.forward_only)
    return [_InterleavedRank(r, pp, spec.vpp_size, m, spec.group).program(spec.overlap_p2p_comm, spec.forward_only)
            for r in range(pp)]


# ---------------------------------------------------------------------------------------------------- the DAG
_START = "start"  # the predecessor "time 0"
_CALL, _TRANSFER = "call", "transfer"  # what a node that is no compute is: a blocking call or a wait, a transfer


@dataclass(frozen=True)
class _Dag:
    """A program set compiled to a DAG of its computes: a compute ends at its duration plus the latest over its
    predecessors ``q`` of ``end(q) + hops(q) * p2p_s`` (predecessor ``num_nodes``: time 0). ``levels``: the computes
    whose predecessors all lie in earlier levels, ``(nodes, padded predecessors, hops)``; ``rows``: per level, its
    computes' rows in a per-virtual-stage cost table (forward on virtual stage ``k`` row ``k M + mb``, backward
    ``V M + k M + mb``); ``computes``, ``compute_nodes``: per stage, its ``(kind, mb, chunk)`` and their nodes."""

    num_nodes: int
    levels: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
    rows: tuple[np.ndarray, ...]
    computes: tuple[tuple[tuple[str, int, int], ...], ...]
    compute_nodes: tuple[np.ndarray, ...]


def _program_nodes(programs: list[list[tuple]], m: int, vpp: int):
    """Every operation as a node: per node its cost-table row (a compute), ``_CALL`` or ``_TRANSFER``, and its
    predecessors; per stage its computes and their nodes. A transfer is one node after its send and its receive are
    posted; on one link, sends and receives pair up in program order."""
    pp = len(programs)
    row, preds, computes, compute_nodes = [], [], [], []
    posted: dict[tuple, dict[str, list]] = {}  # link -> role -> (the node before the posting call, stage, handle)

    def node(r: int, p: list) -> int:
        row.append(r)
        preds.append(p)
        return len(row) - 1

    for s, ops in enumerate(programs):
        cur, comp, nodes = _START, [], []
        for op in ops:
            if op[0] == "C":
                _, kind, mb, chunk = op
                cur = node((pp * vpp * m if kind == "B" else 0) + (chunk * pp + s) * m + mb, [cur])
                comp.append((kind, mb, chunk))
                nodes.append(cur)
                continue
            if op[0] == "X":
                for link, role, h in op[1]:
                    posted.setdefault(link, {"send": [], "recv": []})[role].append((cur, s, h))
            if op[0] == "W" or op[2]:  # a wait, or a blocking call: it ends when its transfers have
                handles = op[1] if op[0] == "W" else [h for _, _, h in op[1]]
                cur = node(_CALL, [cur] + [(s, h) for h in handles])
        computes.append(tuple(comp))
        compute_nodes.append(nodes)
    transfer = {}
    for link, sides in posted.items():
        if len(sides["send"]) != len(sides["recv"]):  # a program bug, never the caller's input
            raise AssertionError(f"link {link}: {len(sides['send'])} sends but {len(sides['recv'])} receives")
        for (sp, ss, sh), (rp, rs, rh) in zip(sides["send"], sides["recv"]):
            transfer[ss, sh] = transfer[rs, rh] = node(_TRANSFER, [sp, rp])
    return row, [[transfer[q] if isinstance(q, tuple) else q for q in p] for p in preds], computes, compute_nodes


@lru_cache(maxsize=256)
def _compiled(pp: int, vpp: int, group: int, overlap: bool, m: int, forward_only: bool) -> _Dag:
    """The compiled schedule; it depends on the layout, the pass and the count, not on the costs or ``p2p_s``."""
    programs = stage_programs(PipelineSpec(pp, vpp, group, overlap_p2p_comm=overlap, forward_only=forward_only), m)
    row, preds, computes, compute_nodes = _program_nodes(programs, m, vpp)
    # keep only the computes: a call or wait ends at the latest of its inputs, a transfer one p2p after its later
    # side, so a compute starts at the latest over earlier computes q (or time 0) of end(q) + hops(q) * p2p_s
    reach = {_START: {_START: 0}}  # node -> {compute (new id) or _START: the most transfers on the way}
    edges, level, new_id = [], [], {}
    for i in _topological(preds):
        merged: dict[int, int] = {}
        for q in preds[i]:
            for c, h in reach[q].items():
                if merged.get(c, -1) < h:
                    merged[c] = h
        if row[i] in (_CALL, _TRANSFER):
            hop = 1 if row[i] == _TRANSFER else 0
            reach[i] = {c: h + hop for c, h in merged.items()}
        else:
            new_id[i] = len(edges)
            level.append(1 + max((level[c] for c in merged if c != _START), default=-1))
            edges.append(merged)
            reach[i] = {new_id[i]: 0}
    levels = _levels(edges, level)
    table_row = np.asarray([row[i] for i in new_id], dtype=np.int64)  # (new ids are in insertion order)
    return _Dag(len(edges), levels, tuple(table_row[nodes] for nodes, _, _ in levels), tuple(computes),
                tuple(np.asarray([new_id[i] for i in nodes], dtype=np.int64) for nodes in compute_nodes))


def _topological(preds: list[list[int]]) -> list[int]:
    """The nodes in a topological order (Kahn's algorithm); a cycle would be a deadlock of the modelled schedule."""
    succ: list[list[int]] = [[] for _ in preds]
    indeg = [0] * len(preds)
    for i, p in enumerate(preds):
        for q in p:
            if q != _START:
                succ[q].append(i)
                indeg[i] += 1
    order = [i for i, d in enumerate(indeg) if d == 0]
    for i in order:  # (the loop also visits the nodes it appends)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                order.append(j)
    if len(order) != len(preds):
        raise AssertionError("the modelled schedule deadlocks")  # a program bug, never the caller's input
    return order


def _levels(edges: list[dict[int, int]], level: list[int]) -> tuple:
    """The computes grouped by ``level`` (:attr:`_Dag.levels`); ``edges``: each compute's predecessors and hops."""
    count = len(edges)
    lv = np.asarray(level)
    by_level = np.argsort(lv, kind="stable")
    bounds = np.searchsorted(lv[by_level], np.arange(lv.max() + 2))
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        nodes = by_level[a:b]
        width = max(len(edges[i]) for i in nodes)
        preds = np.full((len(nodes), width), count, dtype=np.int64)
        hops = np.zeros((len(nodes), width))
        for j, i in enumerate(nodes):
            preds[j, :len(edges[i])] = [count if c == _START else c for c in edges[i]]
            hops[j, :len(edges[i])] = list(edges[i].values())
        out.append((nodes, preds, hops))
    return tuple(out)


# ---------------------------------------------------------------------------------------------------- evaluation
def _pass_costs(fwd, bwd, spec) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(f, b, one)``: the costs as float arrays ``(R, M)`` (every stage alike) or ``(R, S, M)`` (per stage), and
    whether the input was one replica's ``(M,)``; on a forward-only pass ``b`` is zero (``bwd`` may be ``None``)."""
    if not isinstance(spec, PipelineSpec):
        raise ScheduleError(f"spec must be a PipelineSpec, got {type(spec).__name__}; e.g. PipelineSpec(pp_size=4)")
    if bwd is None and not spec.forward_only:
        raise ScheduleError("bwd is None on a training pass; pass the backward costs, or "
                            "PipelineSpec(..., forward_only=True) for a forward-only (log-prob) pass")
    try:
        f = np.asarray(fwd, dtype=np.float64)
        b = np.asarray(fwd if bwd is None else bwd, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ScheduleError(f"fwd and bwd must be arrays of numbers (per-stage seconds or FLOPs per micro-batch), "
                            f"got {show(fwd)} and {show(bwd)} ({e})") from None
    one = f.ndim == 1
    if f.ndim not in (1, 2, 3) or f.shape != b.shape:
        raise ScheduleError(f"fwd and bwd must have the same shape, (M,) or (replicas, M) with every stage alike, "
                            f"or (replicas, pp, M) per stage; got {f.shape} and {b.shape}; pass one cost per "
                            f"micro-batch in run order")
    if f.shape[-1] == 0:
        raise ScheduleError("fwd has no micro-batches; a pipelined step needs at least one")
    if f.ndim == 3 and f.shape[1] == 0:
        raise ScheduleError(f"fwd has shape {f.shape}: no stages; pass (replicas, pp, M) per-stage costs")
    for name, a in (("fwd", f), ("bwd", b)):
        if not np.isfinite(a).all() or (a < 0).any():
            raise ScheduleError(f"{name} holds a negative or non-finite cost ({show(a.min())}); pass per-stage "
                                f"seconds (or FLOPs) >= 0")
    if one:
        f, b = f[None, :], b[None, :]
    return f, np.zeros_like(f) if spec.forward_only else b, one


def _per_virtual_stage(a: np.ndarray, spec: PipelineSpec) -> np.ndarray:
    """Per-stage costs ``(R, pp, M)`` or ``(R, pp * vpp, M)`` as ``(R, V, M)``: one model chunk of virtual stage
    ``k = chunk * pp + s`` (a stage's cost split evenly over its chunks)."""
    pp, v = spec.pp_size, spec.chunks
    stages = a.shape[1]
    if stages == pp * v:
        return a
    if stages != pp:
        raise ScheduleError(f"per-stage costs have {stages} stages (shape {a.shape}) but the layout has pp_size = "
                            f"{pp}" + (f" and vpp_size = {v}" if v > 1 else "") + f"; pass (replicas, {pp}, M) per "
                            f"stage" + (f" or (replicas, {pp * v}, M) per virtual stage" if v > 1 else ""))
    return np.tile(a / v, (1, v, 1))


@dataclass(frozen=True)
class _Sweep:
    """Compiled DAGs (each its own count) evaluated together, level by level: the computes renumbered so that a
    level is one slice, level ``k`` of every DAG side by side, DAG ``d``'s rows of the stacked cost table after
    those of DAGs ``0 .. d - 1``."""

    num_nodes: int
    #: per level: its first node, its end, its nodes' predecessors as ``w`` columns ``(n,)`` (``num_nodes``: time
    #: 0) and the transfers on the way as ``w`` columns ``(n, 1)`` (``None`` where there are none)
    levels: tuple[tuple[int, int, tuple[np.ndarray, ...], tuple[np.ndarray, ...] | None], ...]
    new_ids: tuple[np.ndarray, ...]  # per DAG: the new number of each of its computes
    lasts: tuple[np.ndarray, ...]  # per DAG: each stage's last compute
    rows: np.ndarray  # every compute's row in the stacked cost table, in node order


def _table_rows(dag: _Dag, form: tuple[int, ...], pp: int, vpp: int, m: int) -> tuple[tuple[np.ndarray, ...], int]:
    """Per level, the rows a DAG's computes read in its cost table, and the table's row count. The table's ``form``:
    virtual stage ``k`` reads the rows of kind ``form[k]``, ``2 U M`` rows for ``U`` kinds (forwards, then
    backwards; stages that cost alike share theirs)."""
    kinds = np.asarray(form, dtype=np.int64)
    block, kinds_m = pp * vpp * m, (max(form) + 1) * m
    rows = tuple((cols // block) * kinds_m + kinds[(cols % block) // m] * m + cols % m for cols in dag.rows)
    return rows, 2 * kinds_m


@lru_cache(maxsize=256)
def _sweep(keys: tuple[tuple, ...]) -> _Sweep:
    """The DAGs of ``keys`` (:func:`_spec_key`) compiled for one evaluation."""
    dags = [_compiled(*key[:6]) for key in keys]
    total = sum(dag.num_nodes for dag in dags)
    new_ids = [np.full(dag.num_nodes + 1, total, dtype=np.int64) for dag in dags]  # the sentinel maps to time 0
    dag_rows, row0 = [], 0
    for dag, key in zip(dags, keys):
        rows, count = _table_rows(dag, key[6], key[0], key[1], key[4])
        dag_rows.append([r + row0 for r in rows])
        row0 += count
    levels, rows, at = [], [], 0
    for k in range(max(len(dag.levels) for dag in dags)):
        parts = [d for d, dag in enumerate(dags) if k < len(dag.levels)]
        start = at
        for d in parts:  # a level's predecessors lie in earlier levels, numbered already
            nodes = dags[d].levels[k][0]
            new_ids[d][nodes] = np.arange(at, at + len(nodes))
            rows.append(dag_rows[d][k])
            at += len(nodes)
        width = max(dags[d].levels[k][1].shape[1] for d in parts)
        preds = np.full((at - start, width), total, dtype=np.int64)
        hops = np.zeros((at - start, width))
        row = 0
        for d in parts:
            _, p, h = dags[d].levels[k]
            preds[row:row + len(p), :p.shape[1]] = new_ids[d][p]
            hops[row:row + len(p), :p.shape[1]] = h
            row += len(p)
        # one contiguous column per predecessor slot (``take`` and an element-wise max beat a gather of ``(n, w,
        # R)`` and a reduction over its short middle axis)
        pred_cols = tuple(np.ascontiguousarray(preds[:, i]) for i in range(width))
        hop_cols = tuple(np.ascontiguousarray(hops[:, i:i + 1]) for i in range(width)) if hops.any() else None
        levels.append((start, at, pred_cols, hop_cols))
    lasts = tuple(new_ids[d][np.asarray([nodes[-1] for nodes in dag.compute_nodes], dtype=np.int64)]
                  for d, dag in enumerate(dags))
    return _Sweep(total, tuple(levels), tuple(ids[:-1] for ids in new_ids), lasts, np.concatenate(rows))


def _cost_table(f: np.ndarray, b: np.ndarray, spec: PipelineSpec) -> tuple[np.ndarray, tuple[int, ...]]:
    """Costs as a ``(rows, R)`` cost table and its form (:func:`_table_rows`)."""
    r, m = f.shape[0], f.shape[-1]
    v, virtual = spec.chunks, spec.pp_size * spec.chunks
    if f.ndim == 3:  # per stage: one row per (kind, stage, micro-batch)
        _per_virtual_stage(f[:1, :, :1], spec)  # checks the stage count
        sm = f.shape[1] * m
        dur_t = np.empty((2 * sm, r))
        dur_t[:sm] = f.transpose(1, 2, 0).reshape(sm, r)  # (stage, micro-batch) x replicas
        dur_t[sm:] = b.transpose(1, 2, 0).reshape(sm, r)
        if f.shape[1] == spec.pp_size and v > 1:  # one row per rank: each of its chunks takes 1 / vpp
            dur_t /= v
        return dur_t, tuple(k % f.shape[1] for k in range(virtual))
    dur_t = np.empty((2 * m, r))
    dur_t[:m] = (f / v).T
    dur_t[m:] = (b / v).T
    return dur_t, (0,) * virtual


def _sweep_ends(sweep: _Sweep, table: np.ndarray, p2p: float) -> np.ndarray:
    """End time of every compute (new numbers), ``(num_nodes + 1, R)``; the last row is the sentinel 0."""
    end = np.empty((sweep.num_nodes + 1, table.shape[1]))  # nodes x replicas: a level's nodes are one slice
    np.take(table, sweep.rows, axis=0, out=end[:-1], mode="clip")  # every compute's duration, gathered once
    end[-1] = 0.0
    for start, stop, pred_cols, hop_cols in sweep.levels:
        hop = hop_cols is not None and p2p
        latest = None
        for i, preds in enumerate(pred_cols):  # the latest predecessor's end (+ its transfers), slot by slot
            before = end.take(preds, axis=0)
            if hop:
                before += hop_cols[i] * p2p
            latest = before if latest is None else np.maximum(latest, before, out=latest)
        level = end[start:stop]
        np.add(level, latest, out=level)  # duration + the latest predecessor's end
    return end


def _spec_key(spec: PipelineSpec, m: int, form) -> tuple:
    """A DAG's key in :func:`_sweep`: :func:`_compiled`'s arguments (``overlap_p2p_comm`` changes neither a
    forward-only pass nor one without VPP), then the form of its cost table."""
    spec.check_microbatches(m)
    return (spec.pp_size, spec.chunks, spec.group if spec.chunks > 1 else 1,
            spec.overlap_p2p_comm and spec.chunks > 1 and not spec.forward_only, m, spec.forward_only, form)


def _table_makespans(tables: list[tuple[np.ndarray, object, int]], spec: PipelineSpec,
                     config: PlannerConfig = DEFAULT_CONFIG) -> list[np.ndarray]:
    """Makespans of groups of replicas given as cost tables ``(table (rows, R), form, M)`` (:func:`_cost_table`), in
    one level-by-level pass. The groups are cut into pieces of one width (the narrowest group's, or the widest's
    over ``model.model_pieces``) and a pass holds at most ``model.model_table_entries`` computes x replicas; neither
    changes a makespan."""
    if not tables:
        return []
    widths = [t.shape[1] for t, _, _ in tables]
    width = max(1, min(widths), -(-max(widths) // config.model.model_pieces))
    pieces = []  # (group, first replica, its table's columns, key): every piece at most `width` replicas
    for d, (t, form, m) in enumerate(tables):
        for lo in range(0, max(widths[d], 1), width):
            pieces.append((d, lo, t[:, lo:lo + width], _spec_key(spec, m, form)))
    sweep = _sweep(tuple(key for *_, key in pieces))
    block = max(1, config.model.model_table_entries // max(sweep.num_nodes, 1))  # replicas per pass
    out = [np.empty(w) for w in widths]
    for lo in range(0, width, block):
        hi = min(width, lo + block)
        if len(pieces) == 1:
            stacked = pieces[0][2][:, lo:hi]
        else:
            stacked = np.zeros((sum(len(t) for _, _, t, _ in pieces), hi - lo))
            row = 0
            for _, _, t, _ in pieces:
                part = t[:, lo:hi]
                stacked[row:row + len(t), :part.shape[1]] = part
                row += len(t)
        end = _sweep_ends(sweep, stacked, spec.p2p_s)
        for i, (d, first, t, _) in enumerate(pieces):
            n = max(0, min(hi, t.shape[1]) - lo)
            if n:
                out[d][first + lo:first + lo + n] = end[sweep.lasts[i]][:, :n].max(axis=0)
    return out


def pipeline_makespan(fwd, bwd, spec: PipelineSpec):
    """Makespan of one step of Megatron's schedule per replica: ``(R,)``, or a float for 1-D input.

    ``fwd``, ``bwd``: each micro-batch's cost in run order: ``(M,)`` or ``(R, M)`` every stage alike, ``(R, pp, M)``
    per rank (each chunk ``1 / vpp`` of it) or ``(R, pp * vpp, M)`` per virtual stage ``k = chunk * pp + s``.
    ``bwd`` may be ``None`` on a forward-only pass."""
    f, b, one = _pass_costs(fwd, bwd, spec)
    out = _table_makespans([(*_cost_table(f, b, spec), f.shape[-1])], spec)[0] if len(f) else np.zeros(0)
    return float(out[0]) if one else out


def pipeline_timeline(fwd, bwd, spec: PipelineSpec) -> list[list[tuple]]:
    """One replica's timeline: per stage, ``(kind, mb, chunk, start, end)`` of each forward/backward in run order.
    Costs ``(M,)`` (or ``(1, M)``) every stage alike, or ``(1, pp, M)`` / ``(1, pp * vpp, M)`` per stage."""
    f, b, _ = _pass_costs(fwd, bwd, spec)
    if f.shape[0] != 1:
        raise ScheduleError(f"pipeline_timeline takes one replica's costs, shape (M,) or (1, pp, M); got {f.shape}")
    table, form = _cost_table(f, b, spec)
    key = _spec_key(spec, f.shape[-1], form)
    sweep = _sweep((key,))
    end = _sweep_ends(sweep, table, spec.p2p_s)[:, 0]
    length = table[sweep.rows, 0]  # every compute's duration
    dag = _compiled(*key[:6])
    return [[(k, mb, c, float(end[i] - length[i]), float(end[i])) for (k, mb, c), i in zip(comp, ids)]
            for comp, ids in zip(dag.computes, (sweep.new_ids[0][nodes].tolist() for nodes in dag.compute_nodes))]


def _stage_work(f: np.ndarray, b: np.ndarray, spec: PipelineSpec) -> np.ndarray:
    """Busy time of each pipeline rank, ``(R, pp)``, from per-stage costs ``(R, S, M)``."""
    fv, bv = _per_virtual_stage(f, spec), _per_virtual_stage(b, spec)
    r, virtual, _ = fv.shape
    return (fv + bv).sum(axis=2).reshape(r, virtual // spec.pp_size, spec.pp_size).sum(axis=1)


def bubble_fraction(fwd, bwd, spec: PipelineSpec, makespan=None):
    """``1 - (the busiest pipeline rank's work) / makespan`` (at least 0): the one bubble definition. Shapes as
    :func:`pipeline_makespan`; ``makespan``: the replicas' makespans where the caller has them."""
    f, b, one = _pass_costs(fwd, bwd, spec)
    span = np.atleast_1d(pipeline_makespan(f, b, spec) if makespan is None else np.asarray(makespan, dtype=float))
    work = _stage_work(f, b, spec).max(axis=1) if f.ndim == 3 else f.sum(axis=1) + b.sum(axis=1)
    out = np.maximum(np.where(span > 0, 1.0 - work / np.where(span > 0, span, 1.0), 0.0), 0.0)
    return float(out[0]) if one else out


def pipeline_lower_bound(fwd, bwd, spec: PipelineSpec):
    """A makespan no order of these micro-batches can beat, in this model or any schedule of the same work: the
    larger of the largest micro-batch's trip through every virtual stage and, per rank, its work plus the least
    head before and tail after it. Shapes as :func:`pipeline_makespan`; the formula and its proof:
    ``docs/pipeline.md``, "The pipeline model"."""
    f, b, one = _pass_costs(fwd, bwd, spec)
    spec.check_microbatches(f.shape[-1])
    pp, v = spec.pp_size, spec.chunks
    if f.ndim == 2:  # every stage alike: each rank's costs are the replica's
        f, b = (np.broadcast_to(a[:, None, :], (len(a), pp, a.shape[1])) for a in (f, b))
    c = spec.p2p_s / 2 if spec.forward_only else spec.p2p_s  # 2 c per boundary below: one transfer forward-only
    fv, bv = _per_virtual_stage(f, spec), _per_virtual_stage(b, spec)
    trip = (fv + bv).sum(axis=1).max(axis=1) + 2 * (v * pp - 1) * c
    # F_s(m), B_s(m): sums over virtual stages 0 .. s - 1 (chunk 0 of ranks before s); 0 for s = 0
    zeros = np.zeros((len(fv), 1, fv.shape[2]))
    head = np.concatenate([zeros, np.cumsum(fv[:, :pp - 1], axis=1)], axis=1).min(axis=2)
    tail = np.concatenate([zeros, np.cumsum(bv[:, :pp - 1], axis=1)], axis=1).min(axis=2)
    per_rank = head + _stage_work(f, b, spec) + tail + 2 * c * np.arange(pp)
    out = np.maximum(trip, per_rank.max(axis=1))
    return float(out[0]) if one else out
