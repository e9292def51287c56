"""The harness without Ray (``launcher: processes``): train ranks as ``torch.multiprocessing`` processes, the rollout
generated and planned in the driver process.

::

    config = load_run_config({... "launcher": "processes"})
    result = run(config)          # the same RunResult, step table and ledger check as the Ray harness

For a machine where Ray cannot be installed (an offline GPU box: Ray's wheel alone is ~80 MB): the driver runs the
rollout function, converts and plans in-process (:meth:`RolloutManager.plan`, the code the Ray actor runs), and
hands each rank its payload through a queue. Each rank process hosts a :class:`TrainActor` (the class the Ray harness
wraps in an actor) and answers method calls in order.

Failure handling matches :mod:`.driver`: every wait goes through :meth:`ProcessTrainGroup.gather`, which raises
:class:`RankError` with the rank's traceback as soon as a call fails, :class:`RankDied` when a process exits
without answering (a crash, a kill, CUDA aborting), or :class:`~.harness.StepTimeout` naming the ranks still busy;
the processes are killed in ``finally``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
from typing import Any, Callable, Iterator, Sequence

from .actors import RolloutManager, TrainActor
from .config import RunConfig
from .harness import HEADER, LEGEND, Phases, RunResult, StepTimeout, describe, finish_rollout, worker_env
from .rendezvous import host_store

#: how often a wait looks at the processes' liveness
_POLL_S = 0.2


class RankError(RuntimeError):
    """A train rank's method raised; the message holds the rank's traceback."""


class RankDied(RuntimeError):
    """A train rank's process exited without answering a call."""


def _rank_main(worker_class: str, train_config: dict, rank: int, world_size: int, autocast: str | None,
               commands: Any, results: Any) -> None:
    """One train rank: a ``TrainActor`` answering ``(call_id, method, args)`` from ``commands`` until ``None``."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    actor = TrainActor(worker_class, train_config, rank, world_size, autocast)
    while True:
        message = commands.get()
        if message is None:
            break
        call_id, method, args = message
        try:
            results.put((rank, call_id, "ok", getattr(actor, method)(*args)))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the driver
            results.put((rank, call_id, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            if not isinstance(exc, Exception):
                raise
    actor.shutdown()


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``env`` in ``os.environ`` while the processes start (a spawned child starts with the parent's environment,
    before it imports torch: ``CUDA_VISIBLE_DEVICES`` and the thread counts take effect)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ProcessTrainGroup:
    """The ``world_size`` train ranks of one layout as spawned processes (rank ``r``: dp_rank ``r % dp``)."""

    def __init__(self, config: RunConfig):
        import torch.multiprocessing as mp

        self.config = config
        self.layouts: list[dict] = []
        self._ctx = mp.get_context("spawn")  # fork would inherit a CUDA context and the driver's threads
        self._results = self._ctx.Queue()
        self._commands = [self._ctx.Queue() for _ in range(config.world_size)]
        self._next_id = 0
        self._early: dict[tuple[int, int], tuple[str, Any]] = {}
        opts = config.options
        self.procs = [self._ctx.Process(target=_rank_main, name=f"slime-ext-train-rank{rank}", daemon=True,
                                        args=(opts["train_worker_class"], config.train.to_dict(), rank,
                                              config.world_size, opts["train_autocast"], self._commands[rank],
                                              self._results))
                      for rank in range(config.world_size)]
        with _environ(worker_env(opts["device"])):
            for p in self.procs:
                p.start()
        self.alive = True

    # ------------------------------------------------------------------ calls
    def call(self, method: str, per_rank_args: Sequence[tuple], timeout: float, what: str) -> list[Any]:
        """``method(*per_rank_args[r])`` on every rank; the results in rank order (see :meth:`gather`)."""
        call_id = self._next_id
        self._next_id += 1
        for rank, args in enumerate(per_rank_args):
            self._commands[rank].put((call_id, method, tuple(args)))
        return self.gather(call_id, timeout, what)

    def gather(self, call_id: int, timeout: float, what: str) -> list[Any]:
        world = len(self.procs)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < world:
            for key in [k for k in self._early if k[1] == call_id]:
                got[key[0]] = self._unpack(key[0], *self._early.pop(key), what)
            if len(got) == world:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                busy = [f"train rank {r}" for r in range(world) if r not in got]
                raise StepTimeout(f"{what}: {', '.join(busy)} did not finish within {timeout:.0f}s (raise the "
                                  f"*_timeout_seconds key if the work is legitimately slower)")
            try:
                rank, cid, status, value = self._results.get(timeout=min(_POLL_S, left))
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if r not in got and not p.is_alive():
                        raise RankDied(f"{what}: train rank {r} (pid {p.pid}) exited with code {p.exitcode} "
                                       f"without answering")
                continue
            if cid != call_id:  # an answer to an earlier call that timed out: keep it apart
                self._early[(rank, cid)] = (status, value)
                continue
            if status != "ok":
                self._raise_if_a_peer_died(rank, value, what)
            got[rank] = self._unpack(rank, status, value, what)
        return [got[r] for r in range(world)]

    def _raise_if_a_peer_died(self, rank: int, error: str, what: str, grace_s: float = 2.0) -> None:
        """A rank's collective fails at once when its peer's process dies; name the dead peer, the cause."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            dead = [(r, p) for r, p in enumerate(self.procs) if r != rank and p.exitcode not in (None, 0)]
            if dead:
                r, p = dead[0]
                first = error.strip().splitlines()[0] if error.strip() else "?"
                raise RankDied(f"{what}: train rank {r} (pid {p.pid}) exited with code {p.exitcode} without "
                               f"answering; train rank {rank} then failed: {first}")
            time.sleep(_POLL_S)

    @staticmethod
    def _unpack(rank: int, status: str, value: Any, what: str) -> Any:
        if status != "ok":
            raise RankError(f"train rank {rank} failed during {what}:\n{value}")
        return value

    # ------------------------------------------------------------------ lifecycle
    def setup(self) -> list[dict]:
        self._store = host_store()  # this process serves the rendezvous: every rank joins it
        world = len(self.procs)
        self.layouts = self.call("setup", [("127.0.0.1", self._store.port, True)] * world,
                                 self.config.options["setup_timeout_seconds"], "set-up")
        return self.layouts

    def train(self, rollout_id: int, payloads: list, timeout: float) -> list[dict]:
        """Every rank trains on its DP rank's payload (pipeline stages of one replica share it)."""
        args = [(rollout_id, payloads[layout["dp_rank"]]) for layout in self.layouts]
        return self.call("train_payload", args, timeout, f"training on rollout {rollout_id}")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Leave the process groups cleanly (the rank's actor shuts its worker down), then end the processes."""
        if not self.alive:
            return
        for q in self._commands:
            q.put(None)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        self.alive = False


def run(config: RunConfig, *, out: Callable[[str], None] | None = print,
        on_ready: Callable[[ProcessTrainGroup], None] | None = None,
        on_done: Callable[[ProcessTrainGroup], None] | None = None):
    """Run ``config`` without Ray: ``num_rollout`` rollouts, each trained to the end (see the module docstring).

    ``on_ready(group)`` runs once the ranks are set up, ``on_done(group)`` after the last rollout, before the
    processes are shut down (e.g. to fetch parameters with ``group.call("param_snapshot", ...)``). Returns
    :class:`~.harness.RunResult`."""
    emit = out or (lambda line: None)
    opts = config.options
    start = time.perf_counter()
    phases = Phases(emit)
    emit(f"set-up: {describe(config)} | launcher=processes")
    manager = RolloutManager(config.to_dict(), config.train_parallel_config())
    group = ProcessTrainGroup(config)
    try:
        with phases.phase("process start-up", f"starting {config.world_size} train processes (each imports torch "
                                              f"and megatron-core, builds the model and joins the process group) "
                                              f"while rollout 0 is generated here ..."):
            t0 = time.perf_counter()
            first = manager.plan(0)  # while the ranks import torch and megatron
            first_seconds = time.perf_counter() - t0
            group.setup()
        if on_ready is not None:
            on_ready(group)
        result = RunResult(config=config, layouts=list(group.layouts), phases=phases.seconds)
        phases.emit(f"steps: {opts['num_rollout']} rollouts, one line per optimizer step (columns explained below)")
        emit(HEADER)
        t_steps = time.perf_counter()
        for rollout_id in range(opts["num_rollout"]):
            t0 = time.perf_counter()
            if rollout_id == 0:
                (payloads, plan), generate_seconds = first, first_seconds
            else:
                payloads, plan = manager.plan(rollout_id)
                generate_seconds = time.perf_counter() - t0
            if plan.dropped:
                emit(f"  rollout {rollout_id}: dropped {plan.dropped_reason}")
            ranks = group.train(rollout_id, payloads, opts["train_timeout_seconds"])
            result.rollouts.append(finish_rollout(config, rollout_id, plan, ranks, emit, generate_seconds, t0))
        phases.seconds["steps"] = time.perf_counter() - t_steps
        for line in LEGEND:
            emit(line)
        if on_done is not None:
            on_done(group)
        result.seconds = time.perf_counter() - start
        group.shutdown()
        return result
    finally:
        group.kill()  # no-op after a clean shutdown; ranks stuck in a collective with a failed peer end here
