"""The pipeline model (slime_ext.schedule.pipeline_model): hand-computed cases, megatron-core's order of operations, an
independent event simulation, and the lower bound against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from slime_ext.schedule import ParallelConfig, ScheduleError
from slime_ext.schedule.pipeline_model import (PipelineSpec, bubble_fraction, pipeline_lower_bound, pipeline_makespan,
                                         pipeline_timeline)


# ---------------------------------------------------------------------------------------------------- configs
def test_parallel_config_gains_pp_size_and_stays_backwards_compatible():
    assert ParallelConfig(dp_size=2).pp_size == 1
    assert ParallelConfig(dp_size=2) == ParallelConfig.from_megatron(2)  # configs that plan alike compare equal
    assert ParallelConfig.from_megatron(8, pipeline_model_parallel_size=4).pp_size == 4
    assert ParallelConfig.from_megatron(8, pipeline_model_parallel_size=None).pp_size == 1
    assert ParallelConfig.from_dict({"dp_size": 2, "pp_size": 4}).pp_size == 4
    assert ParallelConfig.from_dict({"dp_size": 2}).pp_size == 1  # slime's dict without it
    assert ParallelConfig(dp_size=2, pp_size=4).to_dict()["pp_size"] == 4
    cfg = ParallelConfig.from_megatron(4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ScheduleError, match="pp_size"):
        ParallelConfig(dp_size=2, pp_size=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pp_size=0), "pp_size"),
    (dict(pp_size=2, vpp_size=0), "vpp_size"),
    (dict(pp_size=2, p2p_s=-1.0), "p2p_s"),
    (dict(pp_size=2, p2p_s=float("nan")), "p2p_s"),
    (dict(pp_size=2, overlap_p2p_comm="yes"), "overlap_p2p_comm"),
    (dict(pp_size=2, microbatch_group_size_per_vp_stage=0), "microbatch_group_size_per_vp_stage"),
])
def test_spec_refuses_bad_fields_by_name(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        PipelineSpec(**kwargs)


def test_costs_are_checked():
    spec = PipelineSpec(2)
    with pytest.raises(ScheduleError, match="same shape"):
        pipeline_makespan([1.0, 2.0], [1.0], spec)
    with pytest.raises(ScheduleError, match="fwd holds a negative"):
        pipeline_makespan([-1.0], [1.0], spec)
    with pytest.raises(ScheduleError, match="bwd holds a negative"):
        pipeline_makespan([1.0], [float("inf")], spec)
    with pytest.raises(ScheduleError, match="no micro-batches"):
        pipeline_makespan(np.zeros(0), np.zeros(0), spec)
    with pytest.raises(ScheduleError, match="arrays of numbers"):
        pipeline_makespan(["a"], [1.0], spec)
    for fn in (pipeline_makespan, pipeline_timeline, bubble_fraction, pipeline_lower_bound):
        with pytest.raises(ScheduleError, match="spec must be a PipelineSpec"):
            fn([1.0], [1.0], 4)
    with pytest.raises(ScheduleError, match="one replica"):
        pipeline_timeline(np.ones((2, 3)), np.ones((2, 3)), spec)


# ---------------------------------------------------------------------------------------------------- 1F1B by hand
def test_equal_costs_give_the_textbook_makespan():
    # (M + pp - 1) * (f + b) for equal micro-batches and free p2p
    for pp in (1, 2, 4, 8):
        for m in (1, 3, 8, 16):
            assert pipeline_makespan([1.0] * m, [2.0] * m, PipelineSpec(pp)) == pytest.approx((m + pp - 1) * 3.0)


def test_pp1_is_the_sum():
    f = np.array([1.0, 4.0, 2.0])
    assert pipeline_makespan(f, 2 * f, PipelineSpec(1)) == pytest.approx(21.0)
    assert bubble_fraction(f, 2 * f, PipelineSpec(1)) == pytest.approx(0.0)


def test_two_stage_timeline_by_hand():
    # stage 1 (last) runs F0 B0 F1 B1 F2 B2; stage 0 warms up with F0, then F1 B0 F2 B1, cools down with B2
    tl = pipeline_timeline([1, 2, 3], [2, 4, 6], PipelineSpec(2))
    assert tl[0] == [("F", 0, 0, 0, 1), ("F", 1, 0, 1, 3), ("B", 0, 0, 4, 6), ("F", 2, 0, 6, 9),
                     ("B", 1, 0, 10, 14), ("B", 2, 0, 19, 25)]
    assert tl[1] == [("F", 0, 0, 1, 2), ("B", 0, 0, 2, 4), ("F", 1, 0, 4, 6), ("B", 1, 0, 6, 10),
                     ("F", 2, 0, 10, 13), ("B", 2, 0, 13, 19)]
    assert pipeline_makespan([1, 2, 3], [2, 4, 6], PipelineSpec(2)) == 25


def test_replicas_in_blocks_give_the_same_makespans():
    from slime_ext.schedule.pipeline_model import _cost_table, _table_makespans
    from slime_ext.schedule.planner_config import ModelConfig, PlannerConfig
    rng = np.random.default_rng(1)
    f = rng.random((37, 9))
    spec = PipelineSpec(3, 3, p2p_s=0.1, overlap_p2p_comm=True)
    whole = pipeline_makespan(f, 2 * f, spec)
    table, form = _cost_table(f, 2 * f, spec)
    # 162 computes: 3 per block
    for config in (PlannerConfig(model=ModelConfig(model_table_entries=500)), PlannerConfig(model=ModelConfig(model_pieces=1))):
        np.testing.assert_array_equal(_table_makespans([(table, form, 9)], spec, config)[0], whole)


def test_groups_of_several_counts_in_one_pass_equal_separate_calls():
    # the model evaluates groups of different counts, replica counts and cost forms side by side: the makespans
    # must be exactly those of one call per group, also when the replicas go in blocks
    import slime_ext.schedule.pipeline_model as pipeline
    from slime_ext.schedule.planner_config import ModelConfig, PlannerConfig
    rng = np.random.default_rng(4)
    for spec, counts in ((PipelineSpec(4), (1, 3, 8, 20)), (PipelineSpec(2, 3, 3, p2p_s=0.05), (3, 6, 8)),
                         (PipelineSpec(4, 2, 5, overlap_p2p_comm=True), (5, 9, 15))):
        groups = []
        for i, m in enumerate(counts):
            r = int(rng.integers(1, 9))
            shape = [(r, m), (r, spec.pp_size, m), (r, spec.pp_size * spec.vpp_size, m)][i % 3]
            f = rng.random(shape)
            groups.append((f, f * rng.uniform(1, 3, shape)))
        alone = [pipeline_makespan(f, b, spec) for f, b in groups]
        tables = [(*pipeline._cost_table(f, b, spec), f.shape[-1]) for f, b in groups]
        for config in (PlannerConfig(), PlannerConfig(model=ModelConfig(model_table_entries=300))):
            got = pipeline._table_makespans(tables, spec, config)
            assert len(got) == len(alone)
            for one, want in zip(got, alone):
                np.testing.assert_array_equal(one, want)
    assert pipeline._table_makespans([], PipelineSpec(2)) == []
    with pytest.raises(ScheduleError, match="num_microbatches = 5 leaves a last group"):
        pipeline._table_makespans([(np.ones((16, 1)), (0,) * 8, 8), (np.ones((10, 1)), (0,) * 8, 5)],
                                  PipelineSpec(4, 2, 4))


def test_vectorised_rows_equal_single_rows():
    rng = np.random.default_rng(0)
    f = rng.random((5, 7))
    spec = PipelineSpec(3, p2p_s=0.05)
    rows = pipeline_makespan(f, 2 * f, spec)
    assert rows.shape == (5,)
    for r in range(5):
        assert rows[r] == pytest.approx(pipeline_makespan(f[r], 2 * f[r], spec))


# ---------------------------------------------------------------------------------------------------- the reference
def event_simulation(programs, fwd, bwd, p2p, chunks):
    """A straightforward discrete-event reference: every stage executes its program one operation at a time; a
    transfer completes ``p2p`` after both its sender and its receiver posted it (the k-th send on a link pairs with
    the k-th receive); a blocking call or a wait lets its stage go on only when its transfers completed. Returns
    the makespan and, per stage, ``(kind, mb, chunk, start, end)``. Costs ``(M,)`` (every stage alike), ``(pp, M)``
    per stage or ``(pp * chunks, M)`` per virtual stage ``chunk * pp + stage``."""
    pp = len(programs)
    fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)

    def cost(a, s, mb, chunk):
        if a.ndim == 1:
            return a[mb] / chunks
        if len(a) == pp:
            return a[s, mb] / chunks
        return a[chunk * pp + s, mb]
    pc = [0] * pp
    clock = [0.0] * pp
    posted = [False] * pp  # whether the call at pc has posted its transfers
    queues = {}  # link -> {"send": [time], "recv": [time]}
    where = [{} for _ in range(pp)]  # stage -> handle -> (link, role, index)
    timeline = [[] for _ in range(pp)]
    latest = 0.0

    def done(s, h):
        link, role, i = where[s][h]
        other = queues[link]["recv" if role == "send" else "send"]
        if i >= len(other):
            return None
        return max(queues[link][role][i], other[i]) + p2p

    progress = True
    while progress:
        progress = False
        for s in range(pp):
            while pc[s] < len(programs[s]):
                op = programs[s][pc[s]]
                if op[0] == "C":
                    _, kind, mb, chunk = op
                    d = cost(fwd if kind == "F" else bwd, s, mb, chunk)
                    timeline[s].append((kind, mb, chunk, clock[s], clock[s] + d))
                    clock[s] += d
                elif op[0] == "X":
                    _, items, blocking = op
                    if not posted[s]:
                        for link, role, h in items:
                            q = queues.setdefault(link, {"send": [], "recv": []})[role]
                            where[s][h] = (link, role, len(q))
                            q.append(clock[s])
                        posted[s] = True
                    if blocking:
                        ends = [done(s, h) for _, _, h in items]
                        if any(e is None for e in ends):
                            break
                        clock[s] = max([clock[s]] + ends)
                else:
                    ends = [done(s, h) for h in op[1]]
                    if any(e is None for e in ends):
                        break
                    clock[s] = max([clock[s]] + ends)
                posted[s] = False
                pc[s] += 1
                progress = True
            latest = max(latest, clock[s])
    assert all(pc[s] == len(programs[s]) for s in range(pp)), "the programs deadlock"
    for s in range(pp):  # transfers left pending by their sender still end before the step does
        for h in where[s]:
            latest = max(latest, done(s, h))
    return latest, timeline


def random_costs(rng, m):
    kind = rng.integers(3)
    if kind == 0:
        f = rng.lognormal(0, 0.6, m)
    elif kind == 1:
        f = np.where(rng.random(m) < 0.2, 5.0, 1.0) * rng.uniform(0.9, 1.1, m)
    else:
        f = rng.integers(1, 4, m).astype(float)  # ties
    return f, f * rng.uniform(1.5, 3.0, m)


def random_spec(rng, vpp_max=3):
    pp = int(rng.integers(1, 6))
    vpp = int(rng.integers(1, vpp_max + 1)) if pp > 1 else 1
    group = None
    m = int(rng.integers(1, 13))
    if vpp > 1:
        group = int(rng.integers(pp, pp + 3))
        m = int(rng.integers(group, group + 9))
        if 0 < m % group < pp:
            m += pp - m % group
    spec = PipelineSpec(pp, vpp, group, p2p_s=float(rng.choice([0.0, 0.05, 0.3])),
                        overlap_p2p_comm=bool(rng.random() < 0.5))
    return spec, m


def test_vectorised_model_equals_the_event_simulation_on_random_cases():
    from slime_ext.schedule.pipeline_model import stage_programs
    rng = np.random.default_rng(15)
    seen = set()
    for _ in range(300):
        spec, m = random_spec(rng)
        seen.add((spec.pp_size > 1, spec.vpp_size > 1, spec.overlap_p2p_comm))
        f, b = random_costs(rng, m)
        ref, ref_tl = event_simulation(stage_programs(spec, m), f, b, spec.p2p_s, spec.chunks)
        assert pipeline_makespan(f, b, spec) == pytest.approx(ref, rel=1e-12), (spec, m)
        tl = pipeline_timeline(f, b, spec)
        for stage, ref_stage in zip(tl, ref_tl):
            assert [op[:3] for op in stage] == [op[:3] for op in ref_stage]
            np.testing.assert_allclose([op[3:] for op in stage], [op[3:] for op in ref_stage], rtol=1e-12)
    assert {(True, False, False), (True, True, False), (True, True, True)} <= seen


def test_every_operation_waits_for_its_data():
    """The p2p pairing carries the right tensors: each chunk's forward starts after the previous virtual stage's
    forward of the same micro-batch ended plus one transfer, each backward after the next virtual stage's backward
    (or its own forward on the last one); every (mb, chunk) runs once forward and once backward per rank."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        spec, m = random_spec(rng)
        f, b = random_costs(rng, m)
        tl = pipeline_timeline(f, b, spec)
        pp, v = spec.pp_size, spec.chunks
        at = {}
        for r, stage in enumerate(tl):
            assert sorted(op[:3] for op in stage) == sorted((k, mb, c) for k in "BF" for mb in range(m)
                                                            for c in range(v))
            for kind, mb, c, start, end in stage:
                at[(kind, mb, c * pp + r)] = (start, end)
            for (_, _, _, _, e0), (_, _, _, s1, _) in zip(stage, stage[1:]):
                assert s1 >= e0 - 1e-9  # one operation at a time
        eps, c = 1e-9, spec.p2p_s
        for mb in range(m):
            for vs in range(v * pp):
                if vs:
                    assert at[("F", mb, vs)][0] >= at[("F", mb, vs - 1)][1] + c - eps
                if vs < v * pp - 1:
                    assert at[("B", mb, vs)][0] >= at[("B", mb, vs + 1)][1] + c - eps
                else:
                    assert at[("B", mb, vs)][0] >= at[("F", mb, vs)][1] - eps


def test_batched_p2p_idles_stage_0_at_the_end_of_warm_up():
    """Under VPP the batched mode's last warm-up call also receives the first gradient, so rank 0 cannot run its
    next forward before that gradient has come back; overlapped p2p runs it meanwhile (the notes' measurement)."""
    f, b = np.ones(8), 2 * np.ones(8)
    batched = pipeline_timeline(f, b, PipelineSpec(4, 2, p2p_s=0.1))
    overlapped = pipeline_timeline(f, b, PipelineSpec(4, 2, p2p_s=0.1, overlap_p2p_comm=True))
    warmup = 2 * 3 + 4  # 2 (pp - 1) + (vpp - 1) group on rank 0
    _, mb, chunk, _, _ = [op for op in batched[0] if op[0] == "B"][0]
    grad_sent = [op for op in batched[1] if op[:3] == ("B", mb, chunk)][0][4]  # by rank 1, then one transfer
    assert batched[0][warmup][0] == "F" and batched[0][warmup][3] == pytest.approx(grad_sent + 0.1)
    assert batched[0][warmup][3] > batched[0][warmup - 1][4] + 1.0  # rank 0 idled
    assert overlapped[0][warmup][3] == pytest.approx(overlapped[0][warmup - 1][4] + 0.1)  # runs after one transfer
    assert pipeline_makespan(f, b, PipelineSpec(4, 2, p2p_s=0.1, overlap_p2p_comm=True)) < \
        pipeline_makespan(f, b, PipelineSpec(4, 2, p2p_s=0.1))


def test_equal_costs_interleaved_give_the_textbook_makespan():
    # M (f + b) + (pp - 1)(f + b) / vpp with free p2p (the interleaved schedule's smaller bubble)
    for pp, v, m in ((2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 2, 12)):
        for overlap in (False, True):
            spec = PipelineSpec(pp, v, overlap_p2p_comm=overlap)
            assert pipeline_makespan(np.ones(m), 2 * np.ones(m), spec) == pytest.approx(3 * m + 3 * (pp - 1) / v)


def test_interleaved_refuses_what_megatron_core_refuses():
    with pytest.raises(ScheduleError, match="microbatch_group_size_per_vp_stage = 4 must lie in"):
        pipeline_makespan(np.ones(3), np.ones(3), PipelineSpec(4, 2))
    with pytest.raises(ScheduleError, match="last group of 2 < pp_size = 4"):
        pipeline_makespan(np.ones(10), np.ones(10), PipelineSpec(4, 2))


# ---------------------------------------------------------------------------------------------------- megatron-core
def test_order_of_operations_is_megatron_cores():
    """Each rank's forwards/backwards come in megatron-core's order: its schedule table, its warm-up count."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from types import SimpleNamespace

    from slime_ext.schedule.pipeline_model import stage_programs, warmup_microbatches

    def megatron_warmup(pp, rank, m, vpp, group):
        comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
                               virtual_pipeline_model_parallel_size=None if vpp == 1 else vpp)
        _, _, warm, _ = schedules.get_pp_rank_microbatches(m, vpp, group, p2p_communicator=comm)
        return min(warm, m * vpp)  # the non-interleaved schedule caps it at M itself

    for pp, vpp, group, m in ((2, 1, 1, 1), (4, 1, 1, 3), (4, 1, 1, 9), (8, 1, 1, 64), (2, 2, 2, 4), (2, 2, 3, 5),
                              (4, 2, 4, 8), (4, 2, 4, 12), (4, 2, 5, 9), (4, 2, 6, 10), (4, 3, 6, 10), (3, 2, 3, 3)):
        spec = PipelineSpec(pp, vpp, group)
        table = schedules.get_schedule_table(m, vpp, group) if vpp > 1 else [(mb, 0) for mb in range(m)]
        total = m * vpp
        for rank, ops in enumerate(stage_programs(spec, m)):
            warm = megatron_warmup(pp, rank, m, vpp, group)
            assert warmup_microbatches(pp, rank, m, vpp, group) == warm
            fwd = [("F", mb, c) for mb, c in table]
            bwd = [("B", mb, vpp - 1 - c) for mb, c in table]
            expect = fwd[:warm]
            for k in range(total - warm):
                expect += [fwd[warm + k], bwd[k]]
            expect += bwd[total - warm:]
            assert [op[1:] for op in ops if op[0] == "C"] == expect, (pp, vpp, group, m, rank)


# ---------------------------------------------------------------------------------------------------- lower bound
def test_lower_bound_never_exceeds_the_best_order_brute_force():
    from itertools import permutations
    rng = np.random.default_rng(3)
    tight = 0
    kinds = set()
    for _ in range(200):
        spec, m = random_spec(rng)
        if m > 6:
            continue
        kinds.add((spec.pp_size > 1, spec.vpp_size > 1, spec.p2p_s > 0))
        f, b = random_costs(rng, m)
        orders = np.array(list(permutations(range(m))))
        best = pipeline_makespan(f[orders], b[orders], spec).min()
        bound = pipeline_lower_bound(f, b, spec)
        assert bound <= best * (1 + 1e-12), (spec, m, bound, best)
        assert pipeline_lower_bound(f[::-1], b[::-1], spec) == pytest.approx(bound)  # a bound of the set
        tight += bound >= best * (1 - 1e-9)
    assert tight  # and it is reached in some cases (equal costs, pp = 1, ...)
    assert {(True, False, True), (True, True, True), (True, True, False)} <= kinds


def test_lower_bound_holds_the_largest_trip_and_the_last_stage():
    spec = PipelineSpec(4, p2p_s=0.5)
    # one huge micro-batch: its trip dominates
    assert pipeline_lower_bound([10, 1, 1], [20, 2, 2], spec) == pytest.approx(4 * 30 + 2 * 3 * 0.5)
    # equal micro-batches: the last stage's work plus fill and drain, which 1F1B reaches without p2p cost (with it,
    # the blocking calls put transfers on the critical path of the steady state too)
    f, b = np.ones(8), 2 * np.ones(8)
    assert pipeline_lower_bound(f, b, spec) == pytest.approx(24 + 3 * 3 + 2 * 3 * 0.5)
    assert pipeline_makespan(f, b, spec) > pipeline_lower_bound(f, b, spec)
    assert pipeline_makespan(f, b, PipelineSpec(4)) == pytest.approx(pipeline_lower_bound(f, b, PipelineSpec(4)))


def test_bubble_fraction_is_idle_share_of_a_stage():
    f, b = np.ones(8), 2 * np.ones(8)
    assert bubble_fraction(f, b, PipelineSpec(4)) == pytest.approx(1 - 24 / 33)
    rows = bubble_fraction(np.stack([f, 2 * f]), np.stack([b, 2 * b]), PipelineSpec(4))
    np.testing.assert_allclose(rows, [1 - 24 / 33, 1 - 24 / 33])


def megatron_programs(pp: int, vpp: int, group: int, m: int, overlap: bool, forward_only: bool = False):
    """Every rank's operations as megatron-core's own schedule function issues them (``forward_only``: its
    forward-only path): its forward/backward and p2p calls are recorded (compute replaced by tags, the communicator
    by a recorder that keeps megatron-core's public send/recv methods and their first/last-stage guards), in the
    normalised form of :func:`normalise`."""
    torch = pytest.importorskip("torch")
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from bench.schedule_replay import Group, model_chunks, rank_groups, schedule_config, schedule_function
    from slime_ext.patches.megatron_cpu import cpu_device_context

    spec = PipelineSpec(pp, vpp, group, overlap_p2p_comm=overlap, forward_only=forward_only)
    config = schedule_config(spec)

    programs = []
    for rank in range(pp):
        ops = []

        class Recorder(P2PCommunicator):
            def __init__(self):  # no process group: every call is recorded, none is sent
                self.pp_group, self.config = Group(pp, rank), config
                self.next_rank, self.prev_rank = (rank + 1) % pp, (rank - 1) % pp
                self.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None

            def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                             wait_on_reqs=True):
                flags = {"send_next": tensor_send_next is not None, "recv_prev": recv_prev,
                         "send_prev": tensor_send_prev is not None, "recv_next": recv_next}
                posted = tuple(sorted(k for k, v in flags.items() if v))
                handles = None
                if posted:
                    call = sum(op[0] == "X" for op in ops)
                    ops.append(("X", posted, wait_on_reqs))
                    if not wait_on_reqs:
                        handles = {k: SimpleNamespace(wait=lambda key=(call, k): ops.append(("W", (key,))))
                                   for k in posted}
                elif not wait_on_reqs:
                    handles = {}
                return (torch.zeros(1) if recv_prev else None), (torch.zeros(1) if recv_next else None), handles

        def forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor, *args,
                         current_microbatch=None, vp_stage=None, **kwargs):
            chunk = 0 if vp_stage is None else vp_stage
            ops.append(("C", "F", current_microbatch, chunk))
            out = SimpleNamespace(tag=(current_microbatch, chunk))  # as megatron-core's: a list in, a list out
            return [out] if isinstance(input_tensor, list) else out, torch.zeros([], dtype=torch.int)

        def backward_step(input_tensor, output_tensor, output_tensor_grad, *model_type_and_config):
            # 0.16: (..., model_type, config); 0.19: (..., config)
            ops.append(("C", "B") + (output_tensor[0] if isinstance(output_tensor, list) else output_tensor).tag)
            return [torch.zeros(1)] if isinstance(input_tensor, list) else torch.zeros(1)

        chunks = model_chunks(config, vpp)
        groups = rank_groups(pp, rank)
        run = schedule_function(spec)
        with pytest.MonkeyPatch.context() as mp, cpu_device_context():
            mp.setattr(schedules, "forward_step", forward_step)
            mp.setattr(schedules, "backward_step", backward_step)
            mp.setattr(torch.distributed, "is_initialized", lambda: True)  # the fake groups' ranks count
            run(forward_step_func=None, data_iterator=[iter(())] * vpp if vpp > 1 else iter(()),
                model=chunks if vpp > 1 else chunks[0], num_microbatches=m, seq_length=4, micro_batch_size=1,
                forward_only=forward_only, p2p_communicator=Recorder(), pg_collection=groups)
        programs.append(ops)
    return programs


def normalise(programs, pp):
    """Our programs in the recorder's form: p2p calls as sorted megatron flag names, waits by (call, flag)."""
    out = []
    for rank, ops in enumerate(programs):
        names = {(("f", rank), "send"): "send_next", (("f", (rank - 1) % pp), "recv"): "recv_prev",
                 (("b", rank), "send"): "send_prev", (("b", (rank + 1) % pp), "recv"): "recv_next"}
        handle, calls, norm = {}, 0, []
        for op in ops:
            if op[0] == "C":
                norm.append(op)
            elif op[0] == "X":
                flags = []
                for link, role, h in op[1]:
                    handle[h] = (calls, names[(link, role)])
                    flags.append(names[(link, role)])
                norm.append(("X", tuple(sorted(flags)), op[2]))
                calls += 1
            else:
                norm.extend(("W", (handle[h],)) for h in op[1])
        out.append(norm)
    return out


LAYOUTS = [(2, 1, 1, 1), (2, 1, 1, 5), (4, 1, 1, 3), (4, 1, 1, 9), (2, 2, 2, 2), (2, 2, 2, 4), (2, 2, 3, 5),
           (4, 2, 4, 8), (4, 2, 5, 9), (4, 2, 4, 12), (4, 3, 4, 4), (3, 2, 4, 7)]


@pytest.mark.parametrize("pp, vpp, group, m, overlap",  # megatron-core refuses overlap_p2p_comm without VPP
                         [lay + (False,) for lay in LAYOUTS] + [lay + (True,) for lay in LAYOUTS if lay[1] > 1])
def test_p2p_calls_are_megatron_cores(pp, vpp, group, m, overlap):
    """Our programs are megatron-core's: the same computes and the same p2p calls in the same order -- which
    transfers each call combines, whether it blocks, and which earlier transfer each wait is for -- recorded from
    megatron-core's own schedule functions."""
    from slime_ext.schedule.pipeline_model import stage_programs
    theirs = megatron_programs(pp, vpp, group, m, overlap)
    ours = normalise(stage_programs(PipelineSpec(pp, vpp, group, overlap_p2p_comm=overlap), m), pp)
    assert len(ours) == len(theirs) == pp, (len(ours), len(theirs))
    for rank, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"rank {rank}"


# ---------------------------------------------------------------------------------------------------- uneven stages
def random_stage_costs(rng, spec, m, per_virtual=False):
    """Per-stage costs ``(pp, M)`` (or ``(pp * vpp, M)``): a micro-batch's costs times a factor per stage, as
    Megatron's first stage (embedding) and last (output layer, loss) are heavier, plus some noise."""
    f, b = random_costs(rng, m)
    stages = spec.pp_size * (spec.chunks if per_virtual else 1)
    weight = rng.uniform(0.6, 1.8, stages)[:, None] * rng.uniform(0.9, 1.1, (stages, m))
    return f * weight, b * weight * rng.uniform(0.8, 1.2, (stages, 1))


def test_per_stage_costs_equal_the_event_simulation_on_random_cases():
    from slime_ext.schedule.pipeline_model import stage_programs
    rng = np.random.default_rng(22)
    seen = set()
    for i in range(200):
        spec, m = random_spec(rng)
        per_virtual = bool(i % 2) and spec.chunks > 1
        seen.add((spec.pp_size > 1, spec.vpp_size > 1, spec.overlap_p2p_comm, per_virtual))
        f, b = random_stage_costs(rng, spec, m, per_virtual)
        ref, ref_tl = event_simulation(stage_programs(spec, m), f, b, spec.p2p_s, spec.chunks)
        assert pipeline_makespan(f[None], b[None], spec)[0] == pytest.approx(ref, rel=1e-12), (spec, m)
        tl = pipeline_timeline(f[None], b[None], spec)
        for stage, ref_stage in zip(tl, ref_tl):
            assert [op[:3] for op in stage] == [op[:3] for op in ref_stage]
            np.testing.assert_allclose([op[3:] for op in stage], [op[3:] for op in ref_stage], rtol=1e-12)
    assert {(True, False, False, False), (True, True, False, False), (True, True, True, True),
            (True, True, False, True)} <= seen


def test_per_stage_costs_alike_on_every_stage_give_todays_makespan():
    rng = np.random.default_rng(5)
    for _ in range(60):
        spec, m = random_spec(rng)
        f = rng.lognormal(0, 0.6, (3, m))
        b = f * rng.uniform(1.5, 3.0, (3, m))
        stages = lambda a: np.repeat(a[:, None, :], spec.pp_size, axis=1)  # noqa: E731
        virtual = lambda a: np.repeat(a[:, None, :] / spec.chunks, spec.pp_size * spec.chunks, axis=1)  # noqa: E731
        for fn in (pipeline_makespan, pipeline_lower_bound, bubble_fraction):
            np.testing.assert_allclose(fn(stages(f), stages(b), spec), fn(f, b, spec), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(fn(virtual(f), virtual(b), spec), fn(f, b, spec), rtol=1e-12, atol=1e-12)


def test_two_uneven_stages_by_hand():
    # stage 0 forwards 1, 2 and backwards 2, 4; stage 1 (last, the heavier) forwards 3, 3 and backwards 4, 4.
    # stage 1: F0 [1, 4], B0 [4, 8], F1 [8, 11] (its input was ready at 3), B1 [11, 15];
    # stage 0: F0 [0, 1], F1 [1, 3], B0 [8, 10], B1 [15, 19]
    f = np.array([[[1.0, 2.0], [3.0, 3.0]]])
    b = np.array([[[2.0, 4.0], [4.0, 4.0]]])
    tl = pipeline_timeline(f, b, PipelineSpec(2))
    assert tl[0] == [("F", 0, 0, 0, 1), ("F", 1, 0, 1, 3), ("B", 0, 0, 8, 10), ("B", 1, 0, 15, 19)]
    assert tl[1] == [("F", 0, 0, 1, 4), ("B", 0, 0, 4, 8), ("F", 1, 0, 8, 11), ("B", 1, 0, 11, 15)]
    assert pipeline_makespan(f, b, PipelineSpec(2)) == pytest.approx([19.0])
    # stage 0 works 9 and stage 1 14 of the 19: the busiest stage idles 5 of them
    assert bubble_fraction(f, b, PipelineSpec(2)) == pytest.approx([1 - 14 / 19])
    # (2) for stage 1: F_1 = min(1, 2) + its work 14 + B_1 = min(2, 4) = 17; the trip of mb 1: 2 + 3 + 4 + 4 = 13
    assert pipeline_lower_bound(f, b, PipelineSpec(2)) == pytest.approx([17.0])


def test_a_heavier_first_or_last_stage_by_hand():
    """Eight equal micro-batches on pp = 4 (forward 1, backward 2 per stage, free p2p), one stage 1.5x heavier.

    Last stage heavy: it never idles after its first forward (its inputs come from lighter stages), so the step is
    the fill (3 forwards of 1), its work (8 x 4.5) and the drain (3 backwards of 2): 45, the lower bound's (2).
    First stage heavy: it runs its 3 warm-up forwards and F3 (4 x 1.5 = 6), then waits for B0's gradient: F0
    ended at 1.5, crosses 3 stages forward (3) and back (6), so B0 starts at 10.5 and the stage never idles again:
    10.5 + 8 x 4.5 - 6 = 40.5."""
    m, pp, x = 8, 4, 1.5
    # the bound: heavy last, rank 3's (2) is the makespan; heavy first, rank 0's work alone (36) beats rank 3's
    # 3.5 + 24 + 7
    for heavy, expect, bound in ((pp - 1, 45.0, 45.0), (0, 40.5, 36.0)):
        w = np.ones(pp)
        w[heavy] = x
        f = w[None, :, None] * np.ones((1, pp, m))
        assert pipeline_makespan(f, 2 * f, PipelineSpec(pp)) == pytest.approx([expect])
        assert pipeline_lower_bound(f, 2 * f, PipelineSpec(pp)) == pytest.approx([bound])


def test_per_stage_costs_are_checked():
    with pytest.raises(ScheduleError, match="3 stages .* pp_size = 4"):
        pipeline_makespan(np.ones((1, 3, 5)), np.ones((1, 3, 5)), PipelineSpec(4))
    with pytest.raises(ScheduleError, match=r"\(replicas, 8, M\) per virtual stage"):
        pipeline_makespan(np.ones((1, 6, 8)), np.ones((1, 6, 8)), PipelineSpec(4, 2))
    with pytest.raises(ScheduleError, match="no stages"):
        pipeline_makespan(np.ones((1, 0, 5)), np.ones((1, 0, 5)), PipelineSpec(4))
    with pytest.raises(ScheduleError, match="same shape"):
        pipeline_makespan(np.ones((1, 4, 5)), np.ones((1, 4, 4)), PipelineSpec(4))
    with pytest.raises(ScheduleError, match="one replica"):
        pipeline_timeline(np.ones((2, 4, 5)), np.ones((2, 4, 5)), PipelineSpec(4))
    with pytest.raises(ScheduleError, match="bwd holds a negative"):
        pipeline_lower_bound(np.ones((1, 4, 5)), -np.ones((1, 4, 5)), PipelineSpec(4))


def test_lower_bound_with_uneven_stages_never_exceeds_the_best_order_brute_force():
    from itertools import permutations
    rng = np.random.default_rng(33)
    tight, kinds = 0, set()
    for i in range(200):
        spec, m = random_spec(rng)
        if m > 6:
            continue
        per_virtual = bool(i % 2) and spec.chunks > 1
        kinds.add((spec.pp_size > 1, spec.vpp_size > 1, spec.p2p_s > 0))
        f, b = random_stage_costs(rng, spec, m, per_virtual)
        orders = np.array(list(permutations(range(m))))
        best = pipeline_makespan(f[:, orders].transpose(1, 0, 2), b[:, orders].transpose(1, 0, 2), spec).min()
        bound = pipeline_lower_bound(f[None], b[None], spec)[0]
        assert bound <= best * (1 + 1e-12), (spec, m, bound, best)
        assert pipeline_lower_bound(f[None, :, ::-1], b[None, :, ::-1], spec)[0] == pytest.approx(bound)
        tight += bound >= best * (1 - 1e-9)
    assert tight
    assert {(True, False, True), (True, True, True), (True, True, False), (True, False, False)} <= kinds


def test_lower_bound_sees_a_heavy_middle_stage():
    # with even stages the last rank's work is the binding one; a middle stage twice as heavy binds instead
    spec = PipelineSpec(4)
    f = np.ones((1, 4, 8))
    f[0, 1] *= 2
    bound = pipeline_lower_bound(f, 2 * f, spec)[0]
    assert bound == pytest.approx(1 + 2 * 24 + 2)  # F_1 = 1, W_1 = 48, B_1 = 2
    assert bound <= pipeline_makespan(f, 2 * f, spec)[0]
