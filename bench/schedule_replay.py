"""Virtual-time replay: megatron-core's own pipeline schedule functions, with injected durations, in one process.

``replay_makespan(fwd, bwd, spec)`` runs the schedule function megatron-core would run for ``spec``
(``forward_backward_pipelining_without_interleaving``, ``..._with_interleaving`` under VPP, or
``forward_backward_no_pipelining`` at ``pp = 1``), with ``forward_only=spec.forward_only``, one thread per pipeline
rank. Nothing is computed and nothing is sent: every forward and backward megatron-core calls advances its rank's
virtual clock by the injected duration of that ``(micro-batch, model chunk)``, and every p2p call its schedule makes
(``P2PCommunicator._communicate``, with the flags and ``wait_on_reqs`` megatron-core passes) posts its transfers at
the rank's clock and, where megatron-core waits on them, blocks the rank's thread until the peers have posted theirs.
The makespan is the latest clock. The order of operations, which calls combine which transfers and which calls
wait are therefore megatron-core's own, read at run time from the installed version, not from our model of it.

**The p2p semantics** (``sends_block``):

* ``True`` (default; megatron-core on GPU with ``batch_p2p_comm`` and ``batch_p2p_sync``, activations larger than
  NCCL's eager p2p buffers): a transfer completes ``p2p_s`` after *both* its sender and its receiver posted it, and
  a waited-on call returns when all its transfers completed, sends included. A stage's send of micro-batch ``j``
  waits for the next stage to post its receive of ``j``: on a forward-only pass the stages form a flow shop with
  no buffer between them, and the order of the micro-batches matters.
* ``False`` (a transport that completes sends in the background, as this repo's CPU patch over gloo does): a send
  completes when posted; a receive ``p2p_s`` after the send was posted (or when posted, if later). A forward-only
  pass is then a flow shop with unbounded buffers.

The pipeline model (:mod:`slime_ext.schedule.pipeline_model`) states the first semantics, so it is compared with
the first; ``tests/unit/test_pipeline_forward_only.py`` also shows that the two semantics rank orders differently.
Costs take the model's shapes (:func:`slime_ext.schedule.pipeline_model.pipeline_makespan`). A case takes
milliseconds (threads wait on a condition variable; no sleeps), so a grid of hundreds runs in seconds.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np

from slime_ext.schedule.pipeline_model import PipelineSpec

from .pipeline_replay import Layout, ReplayRun
from .runner import parser

#: seconds of real time a rank waits for a peer before the replay calls the schedule deadlocked
DEADLOCK_S = 30.0


class _Links:
    """The transfers posted on every directed link (``("f", src)`` activations to ``src + 1``, ``("b", src)``
    gradients to ``src - 1``), in posting order: the ``i``-th send pairs with the ``i``-th receive."""

    def __init__(self, p2p_s: float, sends_block: bool) -> None:
        self.p2p_s, self.sends_block = p2p_s, sends_block
        self.cond = threading.Condition()
        self.posts: dict[tuple, dict[str, list[float]]] = {}
        self.error: BaseException | None = None

    def post(self, link: tuple, role: str, at: float) -> tuple:
        with self.cond:
            q = self.posts.setdefault(link, {"send": [], "recv": []})[role]
            q.append(at)
            self.cond.notify_all()
            return link, role, len(q) - 1

    def _done_at(self, item: tuple) -> float | None:
        link, role, i = item
        q = self.posts[link]
        if role == "send" and not self.sends_block:
            return q["send"][i]
        if i >= len(q["recv" if role == "send" else "send"]):
            return None
        if self.sends_block:
            return max(q["send"][i], q["recv"][i]) + self.p2p_s
        return max(q["send"][i] + self.p2p_s, q["recv"][i])

    def wait(self, items: list[tuple]) -> float:
        """When the last of ``items`` completes (blocks until every peer has posted its side)."""
        with self.cond:
            while True:
                if self.error is not None:
                    raise RuntimeError("another rank of the replay failed") from self.error
                ends = [self._done_at(item) for item in items]
                if all(e is not None for e in ends):
                    return max(ends, default=0.0)
                if not self.cond.wait(timeout=DEADLOCK_S):
                    raise RuntimeError(f"the replayed schedule deadlocks: waiting for {items}")

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.error = error
            self.cond.notify_all()


class _Rank:
    """One pipeline rank's virtual clock and its injected durations per model chunk."""

    def __init__(self, rank: int, times: list[tuple[list[float], list[float]]]) -> None:
        self.rank, self.times, self.clock = rank, times, 0.0


_local = threading.local()


def _forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, *args,
                  current_microbatch=None, vp_stage=None, **kwargs):
    import torch
    state: _Rank = _local.rank
    chunk = 0 if vp_stage is None else vp_stage
    state.clock += state.times[chunk][0][current_microbatch]
    out = SimpleNamespace(tag=(current_microbatch, chunk))
    return ([out] if isinstance(input_tensor, list) else out), torch.zeros([], dtype=torch.int)


def _backward_step(input_tensor, output_tensor, output_tensor_grad, *model_type_and_config):
    import torch
    state: _Rank = _local.rank
    mb, chunk = (output_tensor[0] if isinstance(output_tensor, list) else output_tensor).tag
    state.clock += state.times[chunk][1][mb]
    return [torch.zeros(1)] if isinstance(input_tensor, list) else torch.zeros(1)


class Group:
    """A process group as a schedule function reads it (its size and this rank): nothing is sent through it."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _communicator(rank: int, pp: int, vpp: int, config, links: _Links, state: _Rank):
    import torch
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    class VirtualTimeCommunicator(P2PCommunicator):
        """megatron-core's communicator with its one transport method replaced: its public send/recv methods (and
        their first/last-stage guards) are upstream's."""

        def __init__(self) -> None:  # no process group
            self.pp_group, self.config = Group(pp, rank), config
            self.next_rank, self.prev_rank = (rank + 1) % pp, (rank - 1) % pp
            self.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None

        def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                         wait_on_reqs=True):
            wanted = (("send_next", tensor_send_next is not None, ("f", rank), "send"),
                      ("recv_prev", recv_prev, ("f", (rank - 1) % pp), "recv"),
                      ("send_prev", tensor_send_prev is not None, ("b", rank), "send"),
                      ("recv_next", recv_next, ("b", (rank + 1) % pp), "recv"))
            posted = {name: links.post(link, role, state.clock) for name, flag, link, role in wanted if flag}
            handles = None
            if wait_on_reqs:
                state.clock = max(state.clock, links.wait(list(posted.values())))
            else:
                def waiter(item):
                    def wait():
                        state.clock = max(state.clock, links.wait([item]))
                    return SimpleNamespace(wait=wait)
                handles = {name: waiter(item) for name, item in posted.items()}
            return (torch.zeros(1) if recv_prev else None), (torch.zeros(1) if recv_next else None), handles

    return VirtualTimeCommunicator()


def pg_collection(**groups):
    """megatron-core's ``ProcessGroupCollection`` with these groups (0.19 accepts nothing else; its fields are set
    after construction), or a namespace where the class does not exist."""
    try:
        from megatron.core.process_groups_config import ProcessGroupCollection
    except ImportError:
        return SimpleNamespace(**groups)
    collection = ProcessGroupCollection()
    for name, group in groups.items():
        setattr(collection, name, group)
    return collection


def rank_groups(pp: int, rank: int):
    """The groups a schedule function reads on pipeline rank ``rank`` of ``pp`` (no TP, CP or DP)."""
    return pg_collection(tp=Group(1), cp=Group(1), embd=None, pos_embd=None, pp=Group(pp, rank), dp_cp=Group(1))


def schedule_config(spec: PipelineSpec):
    """The ``TransformerConfig`` a schedule function reads for ``spec``'s layout and p2p mode (a tiny model)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    pp, vpp = spec.pp_size, spec.chunks
    overlap = spec.overlap_p2p_comm and vpp > 1
    return TransformerConfig(num_layers=pp * vpp, hidden_size=8, num_attention_heads=1, pipeline_dtype=torch.float32,
                             pipeline_model_parallel_size=pp,
                             virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                             microbatch_group_size_per_vp_stage=spec.group if vpp > 1 else None,
                             overlap_p2p_comm=overlap, batch_p2p_comm=not overlap)


def model_chunks(config, vpp: int) -> list:
    """``vpp`` empty model chunks as a schedule function reads them (their config and model type)."""
    import torch
    from megatron.core.enums import ModelType

    chunks = []
    for _ in range(vpp):
        chunk = torch.nn.Module()
        chunk.config, chunk.model_type = config, ModelType.encoder_or_decoder
        chunk.set_input_tensor = lambda tensor: None
        chunks.append(chunk)
    return chunks


def schedule_function(spec: PipelineSpec):
    """The schedule function megatron-core's ``get_forward_backward_func`` selects for ``spec``."""
    from megatron.core.pipeline_parallel import schedules

    if spec.pp_size == 1:
        return schedules.forward_backward_no_pipelining
    if spec.chunks > 1:
        return schedules.forward_backward_pipelining_with_interleaving
    return schedules.forward_backward_pipelining_without_interleaving


def _run_rank(rank: int, spec: PipelineSpec, m: int, run: ReplayRun, links: _Links, out: list) -> None:
    from slime_ext.patches.megatron_cpu import cpu_device_context

    pp, vpp = spec.pp_size, spec.chunks
    try:
        state = _Rank(rank, [run.chunk_times(rank, c, Layout(pp, vpp)) for c in range(vpp)])
        _local.rank = state
        config = schedule_config(spec)
        chunks = model_chunks(config, vpp)
        run_schedule = schedule_function(spec)
        with cpu_device_context():  # megatron-core's literal CUDA devices (thread-local: entered per rank)
            run_schedule(forward_step_func=None, data_iterator=[iter(())] * vpp if vpp > 1 else iter(()),
                         model=chunks if vpp > 1 else chunks[0], num_microbatches=m, seq_length=4,
                         micro_batch_size=1, forward_only=spec.forward_only,
                         p2p_communicator=_communicator(rank, pp, vpp, config, links, state),
                         pg_collection=rank_groups(pp, rank))
        out[rank] = state.clock
    except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
        out[rank] = e
        links.fail(e)


_lock = threading.Lock()  # the patches below are process-wide: one replay at a time


def replay_makespan(fwd, bwd, spec: PipelineSpec, *, sends_block: bool = True) -> float:
    """The makespan of megatron-core's schedule for ``spec`` (its ``forward_only`` included), replayed in virtual
    time with these per-stage durations (shapes as :func:`~slime_ext.schedule.pipeline_model.pipeline_makespan`,
    one replica; ``bwd`` may be ``None`` on a forward-only pass). See the module docstring for ``sends_block``."""
    import torch
    from megatron.core.pipeline_parallel import schedules

    f = np.asarray(fwd, dtype=float)
    b = np.zeros_like(f) if bwd is None else np.asarray(bwd, dtype=float)
    if f.ndim == 3:  # (1, stages, M) as the model takes one replica's per-stage costs
        f, b = f[0], b[0]
    m = f.shape[-1]
    spec.check_microbatches(m)
    run = ReplayRun("replay", tuple(f.tolist()), tuple(b.tolist()), spec.overlap_p2p_comm)
    links = _Links(spec.p2p_s, sends_block)
    out: list = [None] * spec.pp_size
    saved = (schedules.forward_step, schedules.backward_step, torch.distributed.is_initialized)
    with _lock:
        schedules.forward_step, schedules.backward_step = _forward_step, _backward_step
        torch.distributed.is_initialized = lambda: True  # the fake groups' ranks count
        try:
            threads = [threading.Thread(target=_run_rank, args=(r, spec, m, run, links, out), daemon=True)
                       for r in range(spec.pp_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            schedules.forward_step, schedules.backward_step, torch.distributed.is_initialized = saved
    for r, x in enumerate(out):
        if isinstance(x, BaseException):
            raise RuntimeError(f"replaying {spec} with {m} micro-batches failed on rank {r}: {x!r}") from x
    return float(max(out))


# ---------------------------------------------------------------------------------------------------- the grid
#: ``(pp, vpp, M)``: pp 2 and 4, vpp 1 and 2, counts megatron-core accepts (groups of ``pp`` under VPP)
GRID = tuple((pp, vpp, m) for pp in (2, 4) for vpp in (1, 2)
             for m in ((1, 3, 8, 13) if vpp == 1 else (pp, 2 * pp, 4 * pp)))


def grid_errors(seed: int = 0, forward_only: bool = True) -> list[tuple[str, float]]:
    """``(case, relative error)`` of the model against the replay (blocking sends) over :data:`GRID`, three cases
    per layout and count: lognormal costs every stage alike with ``p2p_s = 0``; per stage (stage factors 0.6-1.8)
    with ``p2p_s = 0.05`` (overlapped p2p under VPP); per virtual stage with ``p2p_s = 0.3``."""
    from slime_ext.schedule.pipeline_model import pipeline_makespan

    rng = np.random.default_rng(seed)
    out = []
    for pp, vpp, m in GRID:
        for trial, p2p in enumerate((0.0, 0.05, 0.3)):
            spec = PipelineSpec(pp, vpp, p2p_s=p2p, overlap_p2p_comm=vpp > 1 and trial == 1,
                                forward_only=forward_only)
            f = rng.lognormal(0.0, 0.6, m)
            if trial:
                f = (f * rng.uniform(0.6, 1.8, (pp * (vpp if trial == 2 else 1), 1)))[None]
            b = None if forward_only else 2.0 * f
            model = float(np.atleast_1d(pipeline_makespan(f, b, spec))[0])
            replayed = replay_makespan(f, b, spec)
            out.append((f"pp {pp} vpp {vpp} M {m} p2p {p2p}{' overlap' if spec.overlap_p2p_comm else ''}",
                        abs(replayed - model) / model))
    return out


#: the sleep replay's cases: (label, layout, costs in units); the notes' order case at pp 4 and under VPP
SLEEP_ORDERS = (("rising", np.arange(2.0, 10.0)), ("valley", np.array([9.0, 7, 5, 3, 2, 4, 6, 8])))
SLEEP_LAYOUTS = ((4, 1), (2, 2))


def sleep_check(unit_s: float = 0.025, repeats: int = 3, timeout: float = 600.0) -> list[tuple[str, float, float]]:
    """Wall-clock check on this machine: megatron-core's real forward-only schedule over gloo (one process per
    stage, this repo's CPU patches, every forward a sleep of ``cost * unit_s``), with sends completed in the
    background (the CPU patch) and with every blocking call waiting for its sends (as on GPU); ``(label, measured
    s, model s)`` per run, the measured makespan the fastest of the repeats."""
    import sys
    from pathlib import Path

    from slime_ext.schedule.pipeline_model import pipeline_makespan

    from .pipeline_replay import replay_job

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
    from train_harness import launch, rendezvous

    out = []
    for pp, vpp in SLEEP_LAYOUTS:
        layout = Layout(pp, vpp)
        runs = [ReplayRun(f"{layout.name} {name} {'blocking' if block else 'background'}",
                          tuple((costs * unit_s).tolist()), tuple(np.zeros(len(costs)).tolist()),
                          forward_only=True, sends_block=block)
                for name, costs in SLEEP_ORDERS for block in (True, False)]
        with rendezvous() as port:  # the store is served here, on a port bound once (the ranks join it)
            results = launch([(replay_job, (rank, pp, port, layout, runs, repeats, 2 * repeats, 0.01))
                              for rank in range(pp)], timeout=timeout)
        spec = PipelineSpec(pp, vpp, forward_only=True)
        for run, result in zip(runs, results[0], strict=True):
            out.append((run.label, result.best, float(pipeline_makespan(np.asarray(run.fwd), None, spec))))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = parser("The pipeline model against megatron-core's schedule replayed in virtual time, over a grid of "
                "layouts, counts and random costs.")
    ap.add_argument("--training", action="store_true", help="training passes instead of forward-only ones")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sleep", action="store_true", help="instead: megatron-core's real forward-only schedule over "
                    "gloo with sleeps, sends in the background and blocking (wall clock, about 2 minutes)")
    args = ap.parse_args(argv)
    if args.sleep:
        print(f"{'run':<28}{'measured s':>12}{'model s':>10}{'error':>8}")
        for label, measured, model in sleep_check():
            print(f"{label:<28}{measured:>12.3f}{model:>10.3f}{(model - measured) / measured:>+8.1%}")
        return 0
    errors = grid_errors(args.seed, forward_only=not args.training)
    for case, error in errors:
        print(f"{case:<32} {error:.1e}")
    kind = "training" if args.training else "forward-only"
    print(f"{kind}: {len(errors)} cases, max relative error {max(e for _, e in errors):.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
