"""Process-group set-up: torch.distributed plus ``megatron.core.parallel_state`` (tp = cp = 1, pp, vpp, dp).

Every process group gets the same bounded timeout (``dist_timeout_seconds``), so a dead or stuck peer fails a
collective within that time instead of hanging the job (gloo also fails at once when a peer's socket closes).
Joining is bounded separately (:data:`RENDEZVOUS_TIMEOUT_S`): ranks start seconds apart (process start, imports),
and a short collective timeout must not fail a job whose ranks are merely still starting.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from slime_ext.train_config import Layout, TrainConfig, TrainConfigError


#: how long rank 0 waits for every rank to join, and a rank for rank 0: Megatron's default
#: ``--distributed-timeout-minutes``, or ``dist_timeout_seconds`` where that is longer
RENDEZVOUS_TIMEOUT_S = 600.0


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(config: TrainConfig, rank: int, world_size: int, master_addr: str, master_port: int) -> Layout:
    """Join the process group and build Megatron's model-parallel groups; returns this rank's :class:`Layout`."""
    from megatron.core import parallel_state, tensor_parallel

    layout = config.layout(rank, world_size)  # validates world_size against tp*cp*pp before any rendezvous
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; call shutdown_parallel() "
                           "first (one TrainWorker per process)")
    timeout = timedelta(seconds=config.dist_timeout_seconds)
    backend = config.dist_backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # a store of our own: init_process_group would give the rendezvous the collectives' timeout
    store = dist.TCPStore(master_addr, int(master_port), world_size, is_master=rank == 0, wait_for_workers=True,
                          timeout=timedelta(seconds=max(RENDEZVOUS_TIMEOUT_S, config.dist_timeout_seconds)))
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=config.parallel.pp_size,
        virtual_pipeline_model_parallel_size=config.parallel.vpp_size if config.parallel.vpp_size > 1 else None,
        context_parallel_size=1,
        # typed int, but only fed to timedelta(minutes=...): a fraction gives every group the exact bound
        distributed_timeout_minutes=config.dist_timeout_seconds / 60.0,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(config.seed)

    got = (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
           parallel_state.get_pipeline_model_parallel_rank())
    if got != (layout.dp_rank, layout.dp_size, layout.pp_rank):
        raise TrainConfigError(f"rank {rank}: Megatron placed it at (dp_rank, dp_size, pp_rank)={got}, "
                               f"the config expects {(layout.dp_rank, layout.dp_size, layout.pp_rank)}")
    return layout


def shutdown_parallel() -> None:
    """Destroy Megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
