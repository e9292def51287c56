"""Sleep replay: megatron-core's own pipeline schedule, with every micro-batch's compute replaced by a sleep.

One process per pipeline stage (gloo, CPU, this repo's CPU patches for megatron-core), ``dp = 1``. Each rank builds
``vpp`` model chunks; a chunk's forward is a :class:`torch.autograd.Function` that sleeps the micro-batch's per-chunk
forward time and whose backward sleeps its per-chunk backward time. Megatron hands each chunk's
``forward_step_func`` the chunk's own data iterator and consumes it in micro-batch order, so the iterator yields
the micro-batch id and the chunk looks its times up. Sleeps cost no CPU, so 8 stages fit on 2 cores; what remains
is the schedule's own work (p2p over gloo, Python), which is what a model of the schedule leaves out.

Costs are **per stage**, in the shapes ``slime_ext.schedule.pipeline_model`` takes: ``fwd[m]`` is the forward time of
micro-batch ``m`` on every pipeline stage alike (all of that stage's chunks together; under VPP each chunk sleeps
``fwd[m] / vpp``), or ``fwd[s][m]`` one row per stage (uneven stages: the embedding on the first, the output layer
and the loss on the last), or one row per virtual stage ``chunk * pp + s`` (each chunk sleeps its own row).

A run's makespan is the wall time of ``forward_backward_func`` on the slowest stage, measured after a barrier; the
first call of every launch is a warm-up (p2p shapes, first-call imports) and is not reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class ReplayRun:
    """One replay: per-stage forward/backward seconds of each micro-batch, in run order, and the p2p mode."""

    label: str
    #: per micro-batch (every stage alike), or per stage / per virtual stage: a tuple of rows, one per micro-batch
    fwd: tuple[float, ...] | tuple[tuple[float, ...], ...]
    bwd: tuple[float, ...] | tuple[tuple[float, ...], ...]
    overlap_p2p_comm: bool = False
    #: megatron-core's ``forward_only=True`` (``bwd`` is not slept)
    forward_only: bool = False
    #: forward-only runs: every blocking p2p call also waits for its sends (megatron-core's behaviour on GPU, where a
    #: send of a large activation completes only when received) instead of the CPU patch's background sends
    sends_block: bool = False

    def __post_init__(self) -> None:
        if self.sends_block and not self.forward_only:
            raise ValueError(f"{self.label}: sends_block needs forward_only (gloo deadlocks a training schedule "
                             f"whose blocking calls wait for their sends; see slime_ext/patches/megatron_cpu.py)")
        f, b = np.asarray(self.fwd, dtype=float), np.asarray(self.bwd, dtype=float)
        if f.shape != b.shape or f.ndim not in (1, 2) or not f.size:
            raise ValueError(f"{self.label}: fwd and bwd need one entry per micro-batch (or one row per stage), got "
                             f"shapes {f.shape} and {b.shape}")
        object.__setattr__(self, "fwd", tuple(f.tolist()) if f.ndim == 1 else tuple(map(tuple, f.tolist())))
        object.__setattr__(self, "bwd", tuple(b.tolist()) if b.ndim == 1 else tuple(map(tuple, b.tolist())))

    @property
    def num_microbatches(self) -> int:
        return np.shape(self.fwd)[-1]

    @property
    def per_stage(self) -> bool:
        return np.ndim(self.fwd) == 2

    def chunk_times(self, rank: int, chunk: int, layout: "Layout") -> tuple[list[float], list[float]]:
        """What model chunk ``chunk`` of pipeline rank ``rank`` sleeps per micro-batch: ``(fwd, bwd)``."""
        f, b = np.asarray(self.fwd), np.asarray(self.bwd)
        if f.ndim == 1:
            return list(f / layout.vpp), list(b / layout.vpp)
        if len(f) == layout.pp:
            return list(f[rank] / layout.vpp), list(b[rank] / layout.vpp)
        if len(f) == layout.pp * layout.vpp:
            k = chunk * layout.pp + rank
            return list(f[k]), list(b[k])
        raise ValueError(f"{self.label}: {len(f)} rows of costs, but the layout has {layout.pp} stages x "
                         f"{layout.vpp} chunks; give one row per stage or per virtual stage")

    def model_costs(self) -> tuple[np.ndarray, np.ndarray]:
        """The same costs in the pipeline model's shapes: ``(M,)`` or ``(1, stages, M)``."""
        f, b = np.asarray(self.fwd), np.asarray(self.bwd)
        return (f, b) if f.ndim == 1 else (f[None], b[None])


@dataclass(frozen=True)
class Layout:
    pp: int
    vpp: int = 1

    @property
    def name(self) -> str:
        return f"pp{self.pp}" + (f"xvpp{self.vpp}" if self.vpp > 1 else "")


@dataclass
class ReplayResult:
    label: str
    #: makespan (slowest stage) of each measured repeat, seconds
    makespans: list[float] = field(default_factory=list)

    @property
    def best(self) -> float:
        return min(self.makespans)


def _sleep_function():
    import torch

    class SleepChunk(torch.autograd.Function):
        """``y = x + 0 * w``, sleeping ``fwd_s`` in forward and ``bwd_s`` in backward."""

        @staticmethod
        def forward(ctx, x, w, fwd_s: float, bwd_s: float):
            ctx.bwd_s = bwd_s
            time.sleep(fwd_s)
            return x + 0.0 * w

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.bwd_s)
            return grad, grad.sum().reshape(1) * 0.0, None, None

    return SleepChunk


def _build_chunks(config, vpp: int):
    import torch
    from megatron.core.enums import ModelType

    sleep = _sleep_function()

    class Chunk(torch.nn.Module):
        """One model chunk (virtual stage ``vp_stage``): ``times`` is set per run to its ``(fwd, bwd)`` seconds per
        micro-batch."""

        def __init__(self, vp_stage: int):
            super().__init__()
            self.config = config
            self.model_type = ModelType.encoder_or_decoder
            self.vp_stage = vp_stage
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.input_tensor = None
            self.times: tuple[Sequence[float], Sequence[float]] = ((), ())

        def set_input_tensor(self, input_tensor):
            self.input_tensor = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor

        def forward(self, micro_batch: int):
            x = self.input_tensor
            if x is None:  # first stage: the "embedding" makes the activation
                x = torch.zeros((1, 1, config.hidden_size), dtype=torch.float32)
            fwd, bwd = self.times  # this chunk's own seconds (ReplayRun.chunk_times)
            return sleep.apply(x, self.weight, fwd[micro_batch], bwd[micro_batch])

    return [Chunk(v) for v in range(vpp)]


def _forward_step(data_iterator, model):
    micro_batch = next(data_iterator)
    output = model(micro_batch)
    return output, lambda out: (out.sum(), {})


def settled(makespans: list[float], min_repeats: int, max_repeats: int, tolerance: float) -> bool:
    """Stop repeating a run: ``max_repeats`` calls, or at least ``min_repeats`` whose two fastest agree within
    ``tolerance`` (relative) -- on a loaded machine a slow call is interference, two alike fast ones are the run."""
    if len(makespans) >= max_repeats:
        return True
    if len(makespans) < max(2, min_repeats):
        return False
    a, b = sorted(makespans)[:2]
    return b <= a * (1 + tolerance)


#: whether the current run's blocking p2p calls wait for their sends (:attr:`ReplayRun.sends_block`)
_SENDS_BLOCK = [False]


def _wait_for_sends_in_blocking_calls() -> None:
    """In this replay process only: after a p2p call megatron-core waits on (``wait_on_reqs``), also wait for the
    sends the CPU patch left in flight, when the current run asks for it (:data:`_SENDS_BLOCK`)."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from slime_ext.patches.megatron_cpu import drain_pending_sends

    communicate = P2PCommunicator._communicate

    def blocking_communicate(self, *args, wait_on_reqs=True, **kwargs):
        out = communicate(self, *args, wait_on_reqs=wait_on_reqs, **kwargs)
        if wait_on_reqs and _SENDS_BLOCK[0]:
            drain_pending_sends()
        return out

    P2PCommunicator._communicate = blocking_communicate


def replay_job(rank: int, world_size: int, port: int, layout: Layout, runs: list[ReplayRun],
               min_repeats: int, max_repeats: int, tolerance: float = 0.005) -> list[ReplayResult] | None:
    """One pipeline stage: replay every run until :func:`settled` (the first call of the launch is a warm-up).

    Every rank sees the same all-reduced makespans, so all stop repeating at the same call."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from slime_ext.patches import megatron_cpu
    from slime_ext.training.parallel import join_store

    megatron_cpu.apply_if_no_gpu()
    _wait_for_sends_in_blocking_calls()
    # the launcher serves the store (tests/e2e/train_harness.rendezvous): every rank joins it
    store = join_store("127.0.0.1", port, rank, world_size, store_hosted=True, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None)
        config = TransformerConfig(
            num_layers=layout.pp * layout.vpp, hidden_size=8, num_attention_heads=1,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
            microbatch_group_size_per_vp_stage=layout.pp if layout.vpp > 1 else None,
            pipeline_dtype=torch.float32, params_dtype=torch.float32, use_cpu_initialization=True,
            deallocate_pipeline_outputs=False)
        chunks = _build_chunks(config, layout.vpp)
        forward_backward = get_forward_backward_func()
        results = []
        warm = False
        for run in runs:
            config.overlap_p2p_comm = run.overlap_p2p_comm
            config.batch_p2p_comm = not run.overlap_p2p_comm
            _SENDS_BLOCK[0] = run.sends_block
            for v, chunk in enumerate(chunks):
                chunk.times = run.chunk_times(rank, v, layout)
            result = ReplayResult(run.label)
            while not settled(result.makespans, min_repeats, max_repeats, tolerance):
                iterators = [iter(range(run.num_microbatches)) for _ in chunks]
                dist.barrier()
                start = time.perf_counter()
                forward_backward(forward_step_func=_forward_step,
                                 data_iterator=iterators if layout.vpp > 1 else iterators[0],
                                 model=chunks if layout.vpp > 1 else chunks[0],
                                 num_microbatches=run.num_microbatches, seq_length=1, micro_batch_size=1,
                                 forward_only=run.forward_only)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if warm:
                    result.makespans.append(float(elapsed.item()))
                warm = True
            results.append(result)
        return results if rank == 0 else None
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
