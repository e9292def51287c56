"""A model of Megatron's pipeline schedules: the makespan of one step of one DP replica, from its micro-batches' costs
(the planner's objective when ``pp_size > 1``). Pure: standard library and numpy.

Each stage runs the program megatron-core 0.16's schedule function runs on that rank, in the same order
(:func:`one_f_one_b_programs`, :func:`interleaved_programs`, each with its forward-only path; written in our own
words). ``tests/unit/test_pipeline_model.py`` records megatron-core's own schedule functions and checks that every
rank's computes, p2p calls and waits are exactly these programs'. The programs are compiled once per layout into a
DAG of the computes and evaluated level by level, vectorised over replicas. The time rules (blocking sends, one
stream per stage), the cost forms and the assumptions: ``docs/pipeline.md``, "The pipeline model".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import ScheduleError
from .planner_config import DEFAULT_CONFIG, PlannerConfig
from .validate import MAX_PARALLEL_SIZE, check_bool, check_int, check_number, show

__all__ = ["PipelineSpec", "bubble_fraction", "pipeline_lower_bound", "pipeline_makespan", "pipeline_makespans",
           "pipeline_timeline", "stage_programs"]


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
    #: megatron-core's ``forward_only=True`` (log-prob and reference passes): every micro-batch's forward only, no
    #: backward and no 1F1B steady state; backward costs are not read
    forward_only: bool = False

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
        p2p = check_number("PipelineSpec.p2p_s", self.p2p_s)
        if p2p < 0:
            raise ScheduleError(f"PipelineSpec.p2p_s = {p2p} must be >= 0 seconds; pass 0 to ignore point-to-point cost")
        object.__setattr__(self, "p2p_s", p2p)
        object.__setattr__(self, "overlap_p2p_comm", check_bool("PipelineSpec.overlap_p2p_comm",
                                                                self.overlap_p2p_comm))
        object.__setattr__(self, "forward_only", check_bool("PipelineSpec.forward_only", self.forward_only))

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
        """One half of an interleaved iteration with ``overlap_p2p_comm``: wait for the oldest ``pending`` receive
        (unless ``skip_wait``), ``run`` the compute, post the transfers, wait for the previous send (``sending``);
        the new receive joins ``pending``. Returns the new send's handle."""
        if not skip_wait and pending:
            self.wait(pending.pop(0))
        run()
        h = self.comm(blocking=False, **flags)
        self.wait(sending)
        if recv in h:
            pending.append(h[recv])
        return h.get(send)


def one_f_one_b_programs(pp: int, m: int, forward_only: bool = False) -> list[list[tuple]]:
    """The non-interleaved schedule's programs, rank by rank (``forward_backward_pipelining_without_interleaving``).

    ``forward_only``: its forward-only path. The warm-up forwards and the steady loop's forwards then run alike:
    every micro-batch is ``recv_forward``, forward, ``send_forward`` (each call blocking), in micro-batch order,
    and nothing follows the last one (``pp = 1``: ``forward_backward_no_pipelining``, the forwards alone)."""
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
    """``(micro-batch, model chunk)`` of each virtual micro-batch id of the interleaved schedule: micro-batches in
    groups of ``group``, each group through chunk 0, then chunk 1, ...; the last group takes all that are left
    (megatron-core's ``get_schedule_table``)."""
    table = []
    for start in range(0, m, group):
        stop = m if start + group >= m else start + group
        table.extend((mb, chunk) for chunk in range(vpp) for mb in range(start, stop))
    return table


def warmup_microbatches(pp: int, rank: int, m: int, vpp: int = 1, group: int | None = None) -> int:
    """Forwards rank ``rank`` runs before its first backward (megatron-core's ``get_pp_rank_microbatches`` and the
    non-interleaved schedule): ``pp - rank - 1`` (1F1B) or ``2 (pp - rank - 1) + (vpp - 1) group`` virtual
    micro-batches (interleaved), at most all of them."""
    if vpp == 1:
        return min(pp - rank - 1, m)
    return min(2 * (pp - rank - 1) + (vpp - 1) * (pp if group is None else group), m * vpp)


def interleaved_programs(pp: int, vpp: int, m: int, group: int, overlap: bool,
                         forward_only: bool = False) -> list[list[tuple]]:
    """The interleaved schedule's programs (``forward_backward_pipelining_with_interleaving``, default flags:
    ``overlap_p2p_comm_warmup_flush`` off, no MoE overlap).

    ``forward_only``: its forward-only path. Every virtual micro-batch is a warm-up forward, in the schedule
    table's order: one blocking ``recv_forward`` of chunk 0's first input, then per forward one blocking call that
    sends its output and receives the next input -- in both p2p modes (the forward-only path never posts a
    transfer early: ``overlap_p2p_comm`` changes nothing) -- and no backward, no cool-down.

    Virtual micro-batch ``k`` is forward ``schedule_table[k]`` and backward of the same micro-batch in chunk
    ``vpp - 1 - chunk``; chunk ``c`` of rank ``pp - 1`` feeds chunk ``c + 1`` of rank 0. The p2p calls of each
    ``overlap_p2p_comm`` mode: ``docs/pipeline.md``, "The pipeline model".
    """
    table = schedule_table(m, vpp, group)
    return [_InterleavedRank(r, pp, vpp, m, group, table).program(overlap, forward_only) for r in range(pp)]


class _InterleavedRank:
    """Rank ``r``'s program of the interleaved schedule (:func:`interleaved_programs`), phase by phase."""

    def __init__(self, r: int, pp: int, vpp: int, m: int, group: int, table: list[tuple[int, int]]) -> None:
        self.r, self.pp, self.vpp, self.m, self.group, self.table = r, pp, vpp, m, group, table
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
    if spec.vpp_size == 1 or spec.pp_size == 1:
        return one_f_one_b_programs(spec.pp_size, num_microbatches, spec.forward_only)
    return interleaved_programs(spec.pp_size, spec.vpp_size, num_microbatches, spec.group, spec.overlap_p2p_comm,
                                spec.forward_only)


# ---------------------------------------------------------------------------------------------------- the DAG
@dataclass(frozen=True)
class _Dag:
    """A program set compiled to a DAG of its computes: a compute ends at ``max over its predecessors q of
    (end(q) + hops(q) * p2p_s)`` plus its duration (the predecessor ``num_nodes`` is time 0). ``levels`` groups
    the computes whose predecessors all lie in earlier levels. ``computes`` / ``compute_nodes`` list each stage's
    ``(kind, mb, chunk)`` and their nodes in program order.
    """

    num_nodes: int  # computes only
    #: (nodes, their padded predecessors, the transfers on the way from each)
    levels: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]
    computes: tuple[tuple[tuple[str, int, int], ...], ...]  # per stage: (kind, mb, chunk) in program order
    compute_nodes: tuple[np.ndarray, ...]  # per stage: node ids of those computes
    #: per level, the nodes' rows in a per-virtual-stage cost table: forward on virtual stage ``k = chunk * pp +
    #: s`` row ``k M + mb``, backward ``V M + k M + mb`` (``V = pp * vpp``)
    virtual_stage_cols: tuple[np.ndarray, ...] = ()


def _compile(programs: list[list[tuple]], m: int) -> _Dag:
    col, resolved, computes, compute_nodes = _program_nodes(programs, m)
    order = _topological(resolved)
    # keep only the computes: a call or wait ends at the latest of its inputs, a transfer one p2p after its later
    # side, so every compute starts at max over earlier computes q (or time 0) of end(q) + hops(q) * p2p_s
    n = len(col)
    is_compute = [c < 2 * m for c in col]
    through: list[dict[int, int]] = [{} for _ in range(n)]  # non-compute node -> {compute or n: most hops}
    new_id: dict[int, int] = {}
    edges: list[dict[int, int]] = []
    for i in order:
        merged: dict[int, int] = {}
        for q in resolved[i]:
            for k, h in ({q: 0} if q == n or is_compute[q] else through[q]).items():
                if merged.get(k, -1) < h:
                    merged[k] = h
        if is_compute[i]:
            new_id[i] = len(edges)
            edges.append(merged)
        else:
            hop = 1 if col[i] == 2 * m else 0  # (a transfer)
            through[i] = {k: h + hop for k, h in merged.items()}
    levels = _levels(edges, new_id, n)
    node_ids = tuple(np.asarray([new_id[i] for i in nodes], dtype=np.int64) for nodes in compute_nodes)
    virtual_col = _table_cols(computes, node_ids, len(edges), m)
    return _Dag(len(edges), tuple(levels), tuple(computes), node_ids,
                tuple(virtual_col[nodes] for nodes, _, _ in levels))


def _program_nodes(programs: list[list[tuple]], m: int):
    """Every op of the programs as a node: ``(its column, its predecessors (node ids; ``len(col)``: time 0), per
    stage its computes and their nodes)``. A transfer is one node after its send and its receive are posted."""
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
    return col, resolved, computes, compute_nodes


def _topological(resolved: list[list[int]]) -> list[int]:
    """The nodes in a topological order by Kahn's algorithm (a cycle would be a deadlock of the modelled schedule:
    a program bug); predecessor ``len(resolved)`` is time 0."""
    n = len(resolved)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for i, p in enumerate(resolved):
        for q in p:
            if q != n:
                succ[q].append(i)
                indeg[i] += 1
    order = [i for i in range(n) if indeg[i] == 0]
    head = 0
    while head < len(order):
        for j in succ[order[head]]:
            indeg[j] -= 1
            if indeg[j] == 0:
                order.append(j)
        head += 1
    if len(order) != n:
        raise AssertionError("the modelled schedule deadlocks")  # a program bug, never the caller's input
    return order


def _levels(edges: list[dict[int, int]], new_id: dict[int, int], n: int) -> list:
    """The computes grouped in levels (:attr:`_Dag.levels`), ``edges``: each compute's predecessors (old ids; ``n``:
    time 0) and the transfers on the way."""
    c_count = len(edges)
    level = [0] * c_count
    preds_of, hops_of = [], []
    for i, e in enumerate(edges):
        ps = [c_count if k == n else new_id[k] for k in e]
        level[i] = 1 + max((level[q] for q in ps if q != c_count), default=-1)
        preds_of.append(ps)
        hops_of.append(list(e.values()))
    lv = np.asarray(level)
    by_level = np.argsort(lv, kind="stable")
    bounds = np.searchsorted(lv[by_level], np.arange(lv.max() + 2))
    levels = []
    for k in range(len(bounds) - 1):
        nodes = by_level[bounds[k]:bounds[k + 1]]
        width = max(len(preds_of[i]) for i in nodes)
        preds = np.full((len(nodes), width), c_count, dtype=np.int64)
        hops = np.zeros((len(nodes), width))
        for row, i in enumerate(nodes):
            preds[row, :len(preds_of[i])] = preds_of[i]
            hops[row, :len(hops_of[i])] = hops_of[i]
        levels.append((nodes, preds, hops))
    return levels


def _table_cols(computes: list, node_ids: tuple, c_count: int, m: int) -> np.ndarray:
    """Each compute's row in a per-virtual-stage cost table (:class:`_Dag`)."""
    pp, virtual = len(computes), 1 + max((c for comp in computes for _, _, c in comp), default=0)
    virtual *= pp
    virtual_col = np.zeros(c_count, dtype=np.int64)
    for s, (comp, ids) in enumerate(zip(computes, node_ids)):
        for (kind, mb, chunk), i in zip(comp, ids):
            virtual_col[i] = (virtual * m if kind == "B" else 0) + (chunk * pp + s) * m + mb
    return virtual_col


@lru_cache(maxsize=256)
def _compiled(pp: int, vpp: int, group: int, overlap: bool, m: int, forward_only: bool = False) -> _Dag:
    """The compiled schedule; it depends on the layout, the pass and the count, not on the costs or ``p2p_s``."""
    return _compile(stage_programs(PipelineSpec(pp, vpp, group, overlap_p2p_comm=overlap,
                                                forward_only=forward_only), m), m)


# ---------------------------------------------------------------------------------------------------- evaluation
def _as_costs(fwd, bwd) -> tuple[np.ndarray, np.ndarray, bool]:
    """``(f, b, one)``: the costs as float arrays ``(R, M)`` (every stage alike) or ``(R, S, M)`` (per stage), and
    whether the input was one replica's ``(M,)``. The stage count ``S`` is checked against a spec by
    :func:`_per_virtual_stage`."""
    try:
        f = np.asarray(fwd, dtype=np.float64)
        b = np.asarray(bwd, dtype=np.float64)
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
    return f, b, one


def _pass_costs(fwd, bwd, spec) -> tuple[np.ndarray, np.ndarray, bool]:
    """:func:`_as_costs` for ``spec``'s pass: on a forward-only pass the backward costs are zero (``bwd`` may be
    ``None`` there; given, it is checked but not read)."""
    if not isinstance(spec, PipelineSpec):
        raise ScheduleError(f"spec must be a PipelineSpec, got {type(spec).__name__}; e.g. PipelineSpec(pp_size=4)")
    if bwd is None and not spec.forward_only:
        raise ScheduleError("bwd is None on a training pass; pass the backward costs, or "
                            "PipelineSpec(..., forward_only=True) for a forward-only (log-prob) pass")
    f, b, one = _as_costs(fwd, fwd if bwd is None else bwd)
    return (f, np.zeros_like(f), one) if spec.forward_only else (f, b, one)


def _per_virtual_stage(a: np.ndarray, spec: PipelineSpec) -> np.ndarray:
    """Per-stage costs ``(R, pp, M)`` or ``(R, pp * vpp, M)`` as ``(R, V, M)``: what one model chunk of virtual
    stage ``k = chunk * pp + s`` takes (a stage's cost split evenly over its chunks)."""
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
    """One or more compiled DAGs (each with its own count) evaluated together, level by level: the computes
    renumbered so that a level is one slice, level ``k`` of every DAG side by side, each reading its duration from
    one row of a stacked cost table (DAG ``d``'s rows after those of DAGs ``0 .. d - 1``)."""

    num_nodes: int
    #: per level: (first node, end, its nodes' predecessors in the new numbers as ``w`` columns ``(n,)``
    #: (``num_nodes`` is time 0), the transfers on the way from each as ``w`` columns ``(n, 1)`` (``None`` where
    #: there are none))
    levels: tuple[tuple[int, int, tuple[np.ndarray, ...], tuple[np.ndarray, ...] | None], ...]
    new_ids: tuple[np.ndarray, ...]  # per DAG: the new number of each of its computes
    lasts: tuple[np.ndarray, ...]  # per DAG: each stage's last compute (new numbers)
    rows: np.ndarray  # every compute's row in the stacked cost table (the levels' rows, in node order)


def _table_rows(dag: _Dag, form: tuple[int, ...], pp: int, vpp: int, m: int) -> tuple[tuple[np.ndarray, ...], int]:
    """Per level, the rows a DAG's computes read in its cost table, and the table's row count. The table's form
    ``kinds``: virtual stage ``k`` reads the rows of its kind ``kinds[k]``, ``2 U M`` rows for ``U`` kinds
    (forwards, then backwards; stages that cost alike share theirs: every stage alike is one kind)."""
    kinds = np.asarray(form, dtype=np.int64)
    block, kinds_m = pp * vpp * m, (max(form) + 1) * m
    rows = tuple((cols // block) * kinds_m + kinds[(cols % block) // m] * m + cols % m
                 for cols in dag.virtual_stage_cols)
    return rows, 2 * kinds_m


@lru_cache(maxsize=256)
def _sweep(keys: tuple[tuple, ...]) -> _Sweep:
    """The DAGs of ``keys`` (``(pp, vpp, group, overlap, M, form, forward_only)`` each) compiled for one
    evaluation."""
    dags = [(_compiled(*key[:5], key[6]), key[5]) for key in keys]
    depth = max(len(dag.levels) for dag, _ in dags)
    sizes = [dag.num_nodes for dag, _ in dags]
    total = sum(sizes)
    new_ids = [np.full(size + 1, total, dtype=np.int64) for size in sizes]  # the sentinel maps to time 0
    cols, offsets, row0, starts = [[] for _ in range(depth)], [], 0, []
    for (dag, form), key in zip(dags, keys):
        rows, count = _table_rows(dag, form, key[0], key[1], key[4])
        offsets.append((rows, row0))
        row0 += count
    at = 0
    for k in range(depth):
        starts.append(at)
        for d, (dag, _) in enumerate(dags):
            if k < len(dag.levels):
                nodes = dag.levels[k][0]
                new_ids[d][nodes] = np.arange(at, at + len(nodes))
                rows, base = offsets[d]
                cols[k].append(rows[k] + base)
                at += len(nodes)
    starts.append(at)
    levels = []
    for k in range(depth):
        parts = [(d, dag.levels[k]) for d, (dag, _) in enumerate(dags) if k < len(dag.levels)]
        width = max(level[1].shape[1] for _, level in parts)
        preds = np.full((starts[k + 1] - starts[k], width), total, dtype=np.int64)
        hops = np.zeros((len(preds), width))
        row = 0
        for d, (nodes, p, h) in parts:
            preds[row:row + len(nodes), :p.shape[1]] = new_ids[d][p]
            hops[row:row + len(nodes), :p.shape[1]] = h
            row += len(nodes)
        # one contiguous column per predecessor slot (``take`` and an element-wise max beat a gather of ``(n, w,
        # R)`` and a reduction over its short middle axis)
        pred_cols = tuple(np.ascontiguousarray(preds[:, i]) for i in range(width))
        hop_cols = tuple(np.ascontiguousarray(hops[:, i:i + 1]) for i in range(width)) if hops.any() else None
        levels.append((starts[k], starts[k + 1], pred_cols, hop_cols))
    lasts = tuple(new_ids[d][np.asarray([nodes[-1] for nodes in dag.compute_nodes if len(nodes)], dtype=np.int64)]
                  for d, (dag, _) in enumerate(dags))
    rows = np.concatenate([c for level in cols for c in level]) if depth else np.zeros(0, dtype=np.int64)
    return _Sweep(total, tuple(levels), tuple(ids[:-1] for ids in new_ids), lasts, rows)


def _cost_table(f: np.ndarray, b: np.ndarray, spec: PipelineSpec) -> tuple[np.ndarray, str]:
    """A DAG's durations as a ``(rows, R)`` table and its form (:func:`_table_rows`)."""
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
    for start, stop, pred_cols, hop_cols in sweep.levels:  # a level's predecessors all lie in earlier levels
        hop = hop_cols is not None and p2p
        latest = None
        for i, preds in enumerate(pred_cols):  # the latest predecessor's end (+ its transfer), slot by slot
            before = end.take(preds, axis=0)
            if hop:
                before += hop_cols[i] * p2p
            latest = before if latest is None else np.maximum(latest, before, out=latest)
        level = end[start:stop]
        np.add(level, latest, out=level)  # duration + the latest predecessor's end (exact: + commutes)
    return end


def _spec_key(spec: PipelineSpec, m: int, form) -> tuple:
    """A DAG's key in :func:`_sweep`: the layout, the count, the form of its cost table (:func:`_table_rows`) and
    the pass (``overlap_p2p_comm`` changes neither a forward-only pass nor one without VPP)."""
    spec.check_microbatches(m)
    return (spec.pp_size, spec.chunks, spec.group if spec.chunks > 1 else 1,
            spec.overlap_p2p_comm and spec.chunks > 1 and not spec.forward_only, m, form, spec.forward_only)


def pipeline_makespans(costs, spec: PipelineSpec) -> list[np.ndarray]:
    """:func:`pipeline_makespan` of several groups of replicas, each its own count and cost form (``costs``: a
    list of ``(fwd, bwd)``), in one level-by-level pass: a list of ``(R_i,)`` makespans, exactly those of separate
    calls."""
    tables = []
    for fwd, bwd in costs:
        f, b, _ = _pass_costs(fwd, bwd, spec)
        tables.append((*_cost_table(f, b, spec), f.shape[-1]))
    return _table_makespans(tables, spec)


def _table_makespans(tables: list[tuple[np.ndarray, object, int]], spec: PipelineSpec,
                     config: PlannerConfig = DEFAULT_CONFIG) -> list[np.ndarray]:
    """Makespans of groups given as cost tables ``(table (rows, R), form, M)`` (:func:`_table_rows`' layouts;
    :func:`_cost_table` writes them from costs, the planner's pricing directly). Groups evaluated together are cut
    into pieces of one width (the narrowest group's, or the widest's over ``model.model_pieces``), so that a
    narrow group is not padded to a wide one's replicas; a pass evaluates at most ``model.model_table_entries``
    computes x replicas (memory). Neither changes a makespan."""
    if not tables:
        return []
    widths = [t.shape[1] for t, _, _ in tables]
    width = max(1, min(widths), -(-max(widths) // config.model.model_pieces))
    pieces = []  # (group, first replica, its table's columns): every piece at most `width` replicas
    for d, (t, form, m) in enumerate(tables):
        for lo in range(0, max(widths[d], 1), width):
            pieces.append((d, lo, t[:, lo:lo + width], _spec_key(spec, m, form)))
    sweep = _sweep(tuple(key for *_, key in pieces))
    block = max(1, config.model.model_table_entries // max(sweep.num_nodes, 1))  # replicas per pass (memory, not speed)
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
    out = pipeline_makespans([(f, b)], spec)[0] if len(f) else np.zeros(0)
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
    out = []
    dag = _compiled(*key[:5], key[6])
    for comp, nodes in zip(dag.computes, dag.compute_nodes):
        ids = sweep.new_ids[0][nodes].tolist()
        out.append([(k, mb, c, float(end[i] - length[i]), float(end[i])) for (k, mb, c), i in zip(comp, ids)])
    return out


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
    """A makespan no order of these micro-batches can beat, in this model or any schedule of the same work.

    Write ``f[k, m]``, ``b[k, m]`` for one model chunk's forward and backward of micro-batch ``m`` on virtual
    stage ``k = chunk * pp + s`` (``V = vpp * pp`` of them; with every stage alike ``f[k, m] = f_m / vpp``),
    ``W_s`` for rank ``s``'s work (its chunks' forwards and backwards of every micro-batch), ``c = p2p_s``, and
    ``F_s(m) = sum_{k < s} f[k, m]``, ``B_s(m) = sum_{k < s} b[k, m]`` (chunk 0 of ranks ``0 .. s - 1``). Then::

        bound = max( max_m sum_k (f[k, m] + b[k, m]) + 2 (V - 1) c,                     # (1) the largest trip
                     max_s  min_m F_s(m) + s c + W_s + min_m B_s(m) + s c )            # (2) each rank's work

    With every stage alike this is, for ``pp > 1``, ``max(max_m pp (f_m + b_m) + 2 (V - 1) c,
    W + (pp - 1) (min_m f_m + min_m b_m) / vpp + 2 (pp - 1) c)`` (rank ``pp - 1`` gives the largest (2)),
    and ``W`` for ``pp = 1``.

    The proof, and the forward-only form (``b = 0``, one transfer per boundary): ``docs/pipeline.md``, "The
    pipeline model".

    Shapes as :func:`pipeline_makespan`. ``tests/unit/test_pipeline_model.py`` checks it against the best
    makespan over all orders of small cases, with every stage alike and with uneven stages.
    """
    f, b, one = _pass_costs(fwd, bwd, spec)
    spec.check_microbatches(f.shape[-1])
    pp, v = spec.pp_size, spec.chunks
    c = spec.p2p_s / 2 if spec.forward_only else spec.p2p_s  # 2 c per boundary below: one transfer forward-only
    if f.ndim == 3:
        fv, bv = _per_virtual_stage(f, spec), _per_virtual_stage(b, spec)
        trip = (fv + bv).sum(axis=1).max(axis=1) + 2 * (v * pp - 1) * c
        work = _stage_work(f, b, spec)  # (R, pp)
        # F_s(m), B_s(m): sums over virtual stages 0 .. s - 1 (chunk 0 of ranks before s); 0 for s = 0
        zeros = np.zeros((len(fv), 1, fv.shape[2]))
        head = np.concatenate([zeros, np.cumsum(fv[:, :pp - 1], axis=1)], axis=1).min(axis=2)
        tail = np.concatenate([zeros, np.cumsum(bv[:, :pp - 1], axis=1)], axis=1).min(axis=2)
        per_rank = head + work + tail + 2 * c * np.arange(pp)
        out = np.maximum(trip, per_rank.max(axis=1))
        return float(out[0]) if one else out
    work = f.sum(axis=1) + b.sum(axis=1)
    if pp == 1:
        out = work
    else:
        trip = pp * (f + b).max(axis=1) + 2 * (v * pp - 1) * c
        last_stage = work + (pp - 1) * (f.min(axis=1) + b.min(axis=1)) / v + 2 * (pp - 1) * c
        out = np.maximum(trip, last_stage)
    return float(out[0]) if one else out
