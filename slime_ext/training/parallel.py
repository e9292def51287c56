"""Process-group set-up: torch.distributed plus ``megatron.core.parallel_state`` (tp = cp = 1, pp, vpp, dp).

Every process group gets the same bounded timeout (``dist_timeout_seconds``), so a dead or stuck peer fails a
collective within that time instead of hanging the job (gloo also fails at once when a peer's socket closes).
Joining is bounded separately (:data:`RENDEZVOUS_TIMEOUT_S`): ranks start seconds apart (process start, imports),
and a short collective timeout must not fail a job whose ranks are merely still starting.

Where the ranks meet (a ``TCPStore``) is never a port picked, released and then bound again: another process may take
it in between. Either the store's server binds port 0 and hands the port it got to the ranks -- a launcher serves it
(:func:`host_store`) and every rank joins it (``store_hosted=True``) -- or a job of one process serves its own store
on port 0 (``master_port=0``).
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


#: the keys each rank sets in a launcher's store when it arrives (``JOINED_KEY/<rank>``)
JOINED_KEY = "slime_ext/joined"


def _rendezvous_timeout(config: TrainConfig | None = None) -> timedelta:
    return timedelta(seconds=max(RENDEZVOUS_TIMEOUT_S, config.dist_timeout_seconds if config else 0.0))


def host_store(master_addr: str = "127.0.0.1", config: TrainConfig | None = None) -> dist.TCPStore:
    """A rendezvous store served by this process on a port the OS gives it (its ``.port``): bound before any rank
    is told the port, so no other process can take it. Hand ``.port`` to the ranks, which join with
    ``store_hosted=True``, and keep the store alive until they have joined (the launcher's lifetime)."""
    return dist.TCPStore(master_addr, 0, None, is_master=True, wait_for_workers=False,
                         timeout=_rendezvous_timeout(config))


def hosted_store_env(store: dist.TCPStore, master_addr: str = "127.0.0.1") -> dict[str, str]:
    """The environment of ranks that join ``store`` (:func:`host_store`) through ``init_process_group``'s
    ``env://`` rendezvous (a host's own launcher code): ``MASTER_ADDR``/``MASTER_PORT`` name it, and
    ``TORCHELASTIC_USE_AGENT_STORE=True`` makes every rank, rank 0 included, join it as a client (torch's
    convention for a store its launcher serves)."""
    return {"MASTER_ADDR": master_addr, "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def join_store(master_addr: str, master_port: int, rank: int, world_size: int, *, store_hosted: bool,
               timeout: timedelta) -> dist.TCPStore:
    """This rank's rendezvous store, once every rank has arrived (each waits up to ``timeout``): the launcher's
    (``store_hosted``: :func:`host_store`), else rank 0 serves it on ``master_port`` (0 only for a job of one
    process: the others could not learn the port)."""
    if int(master_port) == 0 and world_size > 1 and not store_hosted:
        raise ValueError(f"master_port=0 with world_size={world_size}: the other ranks cannot learn the port rank 0 "
                         f"binds; serve the store from the launcher (slime_ext.training.parallel.host_store(), its "
                         f".port to every rank with store_hosted=True) or give a port")
    is_master = rank == 0 and not store_hosted
    store = dist.TCPStore(master_addr, int(master_port), world_size, is_master=is_master, wait_for_workers=is_master,
                          timeout=timeout)
    if store_hosted:  # what wait_for_workers does for a store rank 0 serves: every rank waits for all to arrive
        store.set(f"{JOINED_KEY}/{rank}", "1")
        store.wait([f"{JOINED_KEY}/{r}" for r in range(world_size)], timeout)
    return store


def init_parallel(config: TrainConfig, rank: int, world_size: int, master_addr: str, master_port: int, *,
                  store_hosted: bool = False) -> Layout:
    """Join the process group and build Megatron's model-parallel groups; returns this rank's :class:`Layout`.

    ``store_hosted``: the rendezvous store at ``master_addr:master_port`` is served by the launcher
    (:func:`host_store`); otherwise rank 0 serves it (``master_port=0``: on a free port of its own, one process
    only)."""
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
    store = join_store(master_addr, master_port, rank, world_size, store_hosted=store_hosted,
                       timeout=_rendezvous_timeout(config))
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
