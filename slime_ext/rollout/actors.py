"""The actors: ``RolloutManager`` (rollout -> schedule -> per-rank payloads) and ``TrainActor`` (one train rank).

Data flow of one rollout::

    refs = RolloutManager.generate(rollout_id)      # one ObjectRef per DP rank, put in the object store here
    TrainActor[rank].train_rollout(rollout_id, refs) # each rank fetches refs[its dp_rank] itself

Every pipeline stage of a DP replica fetches the same payload. The classes are plain Python; :func:`remote`
turns them into Ray actor classes (so they stay importable and testable without a running Ray), and
:mod:`.processes` hosts the same classes without Ray (``RolloutManager.plan`` in the driver, one ``TrainActor`` per
``torch.multiprocessing`` process, payloads passed directly to ``TrainActor.train_payload``).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from types import SimpleNamespace
from typing import Any, Callable, Mapping

from slime_ext.schemes import PlanInfo, RankResult

from .dispatch import plan_rollout
from .rendezvous import host_store
from .train_data import flatten_samples, samples_to_train_data

logger = logging.getLogger("slime_ext.rollout")


def load_object(path: str) -> Any:
    """``package.module.name`` -> the object (slime's ``load_function``)."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"cannot import {path!r} ({exc}); check the dotted path and PYTHONPATH") from exc


class RolloutManager:
    """Runs the rollout function, converts samples to train data, plans the schedule, puts one payload per rank."""

    def __init__(self, args: Mapping[str, Any], train_parallel_config: Mapping[str, int]):
        self.args = SimpleNamespace(**args)
        self.train_parallel_config = dict(train_parallel_config)
        self.generate_rollout: Callable = load_object(self.args.rollout_function_path)

    def generate(self, rollout_id: int) -> dict:
        """Returns ``{"payload_refs": [ObjectRef per DP rank], "plan": PlanInfo, "seconds": ...}``: :meth:`plan`'s
        payloads put in Ray's object store, one per DP rank."""
        import ray

        start = time.perf_counter()
        payloads, info = self.plan(rollout_id)
        refs = [ray.put(p) for p in payloads]
        return {"payload_refs": refs, "plan": info, "seconds": time.perf_counter() - start}

    def plan(self, rollout_id: int) -> tuple[list, PlanInfo]:
        """Generate, convert and plan one rollout in this process: ``(payload per DP rank, plan)``.

        ``plan`` (:class:`slime_ext.schemes.PlanInfo`) is what the driver checks and prints: partitions,
        step_samples, dropped (+ reason), the full schedule dict (rollout path) and the per-sample ``total_lengths``
        / ``rollout_ids`` / ``loss_tokens``.
        """
        output = self.generate_rollout(self.args, rollout_id, None, False)
        samples = flatten_samples(output)
        train_data = samples_to_train_data(samples, vocab_size=self.args.vocab_size,
                                           seq_length=self.args.seq_length)
        plan = plan_rollout(train_data, self.args, self.train_parallel_config, rollout_id=rollout_id)
        if plan.dropped:  # also in the returned plan; the driver prints it with the step table
            logger.info("rollout %d: dropped %s", rollout_id, plan.dropped_reason)
        info = PlanInfo(dp_schedule=plan.dp_schedule, rollout_id=rollout_id, num_samples=plan.num_samples,
                        partitions=plan.partitions, step_samples=plan.step_samples, dropped=plan.dropped,
                        dropped_reason=plan.dropped_reason, total_lengths=train_data.total_lengths,
                        rollout_ids=train_data.rollout_ids, loss_tokens=train_data.loss_tokens,
                        schedule=plan.schedule)
        return list(plan.payloads), info


class TrainActor:
    """One rank of the dp x pp world, wrapping a ``TrainWorker`` (``train_worker_class``)."""

    def __init__(self, worker_class: str, train_config: Mapping[str, Any], rank: int, world_size: int,
                 autocast: str | None = None):
        self.worker_class = worker_class
        self.autocast = autocast  # the run config's train_autocast: None or a torch dtype name
        self.train_config = dict(train_config)
        self.rank, self.world_size = rank, world_size
        self.worker = None
        self.info: dict = {}

    def address(self) -> tuple[str, int]:
        """Serve the torch.distributed rendezvous store from this actor (rank 0's) and return this node's loopback
        address and the store's port: bound on port 0 before any rank learns it, so no other process can take it.
        Every rank then joins with ``setup(addr, port, store_hosted=True)``."""
        self._store = host_store()
        return "127.0.0.1", self._store.port

    def setup(self, master_addr: str, master_port: int, store_hosted: bool = False) -> dict:
        """Build the worker and join the process groups; returns the rank's layout, backend and pid.
        ``store_hosted``: the launcher (or rank 0's actor, :meth:`address`) serves the rendezvous store."""
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        cls = load_object(self.worker_class)
        self.worker = cls(self.train_config, self.rank, self.world_size, master_addr, master_port,
                          store_hosted=store_hosted)
        layout = dict(self.worker.setup())
        import slime_ext

        self.info = {**layout, "backend": dist.get_backend(), "pid": os.getpid(),
                     "device": "cuda" if torch.cuda.is_available() else "cpu", "slime_ext": slime_ext.__file__}
        return self.info

    def reset(self, changes: Mapping[str, Any]) -> None:
        """Initial parameters, fresh optimizer and LR scheduler; batch/schedule/optimizer keys may change."""
        self._require().reset(**dict(changes))

    def train_rollout(self, rollout_id: int, payload_refs: list) -> RankResult:
        """Fetch this rank's payload (``payload_refs[dp_rank]``) and train on it; one record per step."""
        import ray

        self._require()
        start = time.perf_counter()
        payload = ray.get(payload_refs[self.info["dp_rank"]])
        return self.train_payload(rollout_id, payload, fetch_seconds=time.perf_counter() - start)

    def train_payload(self, rollout_id: int, payload: Any, fetch_seconds: float = 0.0) -> RankResult:
        """Train on this rank's payload of ``rollout_id`` (already fetched); one record per step.

        ``train_autocast`` (``bfloat16``) runs the steps under ``torch.autocast`` on the rank's device."""
        worker = self._require()
        if payload.rollout_id != rollout_id or payload.dp_rank != self.info["dp_rank"]:
            raise RuntimeError(f"rank {self.rank} (dp_rank {self.info['dp_rank']}) got the payload of rollout "
                               f"{payload.rollout_id} / dp_rank {payload.dp_rank}, expected rollout "
                               f"{rollout_id}; the payload refs are out of order")
        with self._autocast():
            records = worker.train_rollout(payload)
        return RankResult(rank=self.rank, dp_rank=self.info["dp_rank"], pp_rank=self.info["pp_rank"],
                          records=list(records), fetch_seconds=fetch_seconds)

    def _autocast(self):
        import contextlib

        import torch

        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.info["device"], dtype=getattr(torch, self.autocast))

    def param_snapshot(self) -> dict:
        return self._require().param_snapshot()

    def scheduler_state(self) -> dict:
        return self._require().scheduler_state()

    def shutdown(self) -> None:
        if self.worker is not None:
            try:
                self.worker.shutdown()
            finally:
                self.worker = None

    def _require(self):
        if self.worker is None:
            raise RuntimeError(f"TrainActor rank {self.rank}: setup() has not run")
        return self.worker


def remote(cls: type, **options: Any):
    """``ray.remote(cls).options(**options)`` with the defaults every actor here needs (no restarts, no retries)."""
    import ray

    return ray.remote(max_restarts=0, max_task_retries=0)(cls).options(**options)
