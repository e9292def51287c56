"""``TrainWorker``: one training process (one rank of dp x pp), the unit the Ray side wraps in an actor.

::

    worker = TrainWorker(config, rank, world_size, master_addr, master_port)
    layout = worker.setup()                  # {"rank", "world_size", "dp_rank", "dp_size", "pp_rank", "pp_size"}
    records = worker.train_rollout(payload_of_my_dp_rank)   # a RankPayload; one StepRecord per step
    logp = worker.forward_only(payload_of_my_dp_rank)
    worker.shutdown()

Every rank of a DP replica (all its pipeline stages) gets the same payload: the first stage reads the
tokens, every stage the lengths (for the attention mask), the last stage the loss masks and advantages.
``config`` is a :class:`slime_ext.train_config.TrainConfig` or anything :func:`load_train_config` takes.
Process groups time out after ``dist_timeout_seconds``, so a dead or stuck peer makes every call fail within that
bound instead of hanging.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from slime_ext.patches import megatron_cpu
from slime_ext.schedule import RankPayload
from slime_ext.schemes import ForwardResult, StepRecord, get_dp_schedule

from slime_ext.train_config import RESETTABLE_KEYS, TrainConfig, TrainConfigError, load_train_config

class TrainWorker:
    def __init__(self, config: Any, rank: int, world_size: int, master_addr: str = "127.0.0.1",
                 master_port: int = 29500, *, store_hosted: bool = False):
        """``store_hosted``: the launcher serves the rendezvous store at ``master_addr:master_port``
        (:func:`slime_ext.training.parallel.host_store`); else rank 0 serves it (``master_port=0``: a free port of
        its own, for a job of one process)."""
        self.config: TrainConfig = load_train_config(config)
        self.layout_info = self.config.layout(rank, world_size)  # rejects a bad world size before any rendezvous
        self.rank, self.world_size = rank, world_size
        self.master_addr, self.master_port = master_addr, int(master_port)
        self.store_hosted = store_hosted
        self.state = None
        self._cpu_patched = False

    # ------------------------------------------------------------------ lifecycle
    def setup(self) -> dict:
        """Patch for CPU if there is no GPU, join the process groups, build model, optimizer and LR scheduler."""
        from .parallel import init_parallel

        if self.state is not None:
            raise RuntimeError("TrainWorker.setup() was already called")
        self._cpu_patched = megatron_cpu.apply_if_no_gpu()
        torch.manual_seed(self.config.seed)
        layout = init_parallel(self.config, self.rank, self.world_size, self.master_addr, self.master_port,
                               store_hosted=self.store_hosted)
        self._build(layout)
        return dataclasses.asdict(layout)

    def _build(self, layout) -> None:
        from .lr import build_scheduler
        from .model import build_model, wrap_ddp
        from .optimizer import build_optimizer
        from .train_step import TrainState

        model = wrap_ddp(build_model(self.config), self.config)
        optimizer = build_optimizer(self.config.optim, model)
        self.state = TrainState(config=self.config, args=self.config.to_args(), layout=layout, model=model,
                                optimizer=optimizer, scheduler=build_scheduler(self.config.optim, optimizer),
                                scheme=get_dp_schedule(self.config.dp_schedule))

    def reset(self, **changes: Any) -> None:
        """Back to the initial parameters with a fresh optimizer and LR scheduler; optionally change batch, schedule
        or optimizer keys (``RESETTABLE_KEYS``) -- e.g. to run the legacy baseline and the rollout-side schedule
        from the same start in one job."""
        from .lr import build_scheduler
        from .model import init_canonical, unwrap
        from .optimizer import build_optimizer

        state = self._require_setup()
        fixed = sorted(set(changes) - RESETTABLE_KEYS)
        if fixed:
            raise TrainConfigError(f"reset() cannot change {fixed}: they are fixed at setup(); start new workers")
        config = self.config.replace(**changes) if changes else self.config
        init_canonical([unwrap(c) for c in state.model], config)
        for chunk in state.model:
            chunk.zero_grad_buffer()
        optimizer = build_optimizer(config.optim, state.model)
        self.config = config
        state.config, state.args, state.optimizer = config, config.to_args(), optimizer
        state.scheme = get_dp_schedule(config.dp_schedule)
        state.scheduler = build_scheduler(config.optim, optimizer)

    def shutdown(self) -> None:
        """Leave the process groups and undo this worker's patches (safe to call twice, or before setup)."""
        from .parallel import shutdown_parallel

        try:
            if self.state is not None:
                shutdown_parallel()
        finally:
            self.state = None
            if self._cpu_patched:
                megatron_cpu.undo()
                self._cpu_patched = False

    # ------------------------------------------------------------------ work
    def train_rollout(self, payload: RankPayload) -> list[StepRecord]:
        """Train on this DP rank's share of one rollout; one record per step (``train_step.train_one_step``)."""
        from .train_step import train_rollout

        return train_rollout(self._require_setup(), payload)

    def forward_only(self, payload: RankPayload) -> ForwardResult:
        """Per-token log-probs of the response tokens (filled on the last pipeline stage)."""
        from .train_step import forward_only

        return forward_only(self._require_setup(), payload)

    # ------------------------------------------------------------------ inspection
    @property
    def layout(self):
        return self.layout_info

    def param_snapshot(self) -> dict[str, np.ndarray]:
        """Canonical parameter name -> flattened fp32 values of the parameters this rank holds."""
        from .model import param_snapshot

        return {k: v.numpy() for k, v in param_snapshot(self._require_setup().model).items()}

    def scheduler_state(self) -> dict:
        """``{"samples": scheduler sample counter, "lr": current LR}``."""
        state = self._require_setup()
        return {"samples": int(state.scheduler.num_steps), "lr": float(state.optimizer.param_groups[0]["lr"])}

    def _require_setup(self):
        if self.state is None:
            raise RuntimeError("TrainWorker.setup() has not been called (or the worker was shut down)")
        return self.state
