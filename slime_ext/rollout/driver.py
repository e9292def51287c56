"""The harness: start Ray on loopback, run ``num_rollout`` rollout -> train iterations, print each step, shut down
(``launcher: processes``: the same without Ray, :mod:`.processes`).

::

    config = load_run_config("configs/demo_cpu.yaml")     # validated: nothing has started yet
    result = run(config)                                  # starts Ray (unless running), actors, trains, stops

Failure handling -- a run never hangs and always fails with the original error:

* every wait on actors goes through :func:`gather`, which returns as soon as any awaited call fails and re-raises
  that call's exception (Ray re-raises it as a subclass of the original type, remote traceback included), or
  raises :class:`StepTimeout` naming the calls still running after the configured timeout;
* train ranks blocked in a collective with a failed peer are killed with their group (their process groups
  also time out on their own after ``dist_timeout_seconds``);
* actors are killed and Ray is shut down in ``finally`` -- Ray only if this run started it.

A :class:`TrainGroup` (the dp x pp train actors) can outlive one run: ``run(config, group=group)`` resets it to the
initial parameters with the config's batch/schedule/optimizer keys, so several configs with the same model and
layout share one set of processes (the e2e tests do).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Sequence

from slime_ext.schemes import RankResult
from slime_ext.train_config import RESETTABLE_KEYS

from .actors import RolloutManager, TrainActor, remote
from .config import RunConfig
from .harness import (HEADER, LEGEND, Phases, RunResult, StepTimeout, describe, finish_rollout, time_summary,
                      worker_env)

logger = logging.getLogger("slime_ext.rollout")


class DeviceError(RuntimeError):
    """The requested device is not there (e.g. ``device: cuda`` without enough GPUs)."""


# ---------------------------------------------------------------------------------------------------- Ray
def start_ray(config: RunConfig, *, extra_pythonpath: Sequence[str] = ()) -> bool:
    """``ray.init`` on loopback (no dashboard, small object store); ``False`` if Ray was already running.

    The job's ``runtime_env`` (:func:`worker_env`) is what makes ``slime_ext`` importable in every actor; a Ray
    started elsewhere must provide that itself (an installed ``slime-ext``, or ``PYTHONPATH``).
    """
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    device = config.options["device"]
    ray.init(
        address="local",
        num_cpus=config.options["ray_num_cpus"] or os.cpu_count() or 1,
        num_gpus=None if device == "cuda" else 0,
        object_store_memory=int(config.options["ray_object_store_memory_mb"]) * 1024 * 1024,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": worker_env(device, extra_pythonpath)},
        namespace="slime_ext",
        log_to_driver=True,
        configure_logging=False,
    )
    return True


#: after a call fails, how long the other calls get to show that a process died, which is then raised instead
DEAD_PEER_GRACE_S = 2.0


def gather(calls: Sequence[tuple[str, Any]], timeout: float, what: str,
           grace: float = DEAD_PEER_GRACE_S) -> list[Any]:
    """Results of ``calls`` (``(name, ObjectRef)``) in order; the first failure or the timeout raises at once.

    One exception: when a rank's process dies, its peers' collectives fail too ("connection reset by peer"), and
    one of those may arrive first. A failure that is not a dead actor therefore waits up to ``grace`` seconds
    (:data:`DEAD_PEER_GRACE_S`) for another call to report a dead process, and raises that one (the cause), with
    the first as a note.
    """
    import ray

    names = {ref: name for name, ref in calls}
    results: dict[Any, Any] = {}
    pending = [ref for _, ref in calls]
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StepTimeout(f"{what}: {', '.join(names[r] for r in pending)} did not finish within {timeout:.0f}s "
                              f"(raise the *_timeout_seconds key if the work is legitimately slower)")
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            try:
                results[ref] = ray.get(ref)
            except Exception as exc:
                dead = None if isinstance(exc, ray.exceptions.RayActorError) else _dead_peer(pending, grace)
                if dead is not None:
                    dead_ref, dead_exc = dead
                    _note(dead_exc, f"slime-ext: raised by {names[dead_ref]} during {what}; {names[ref]} failed "
                                    f"too, as its peer died: {type(exc).__name__}: {str(exc).splitlines()[-1][:300]}")
                    raise dead_exc from None
                _note(exc, f"slime-ext: raised by {names[ref]} during {what}")
                raise
    return [results[ref] for _, ref in calls]


def _dead_peer(pending: list, grace: float) -> tuple[Any, Exception] | None:
    """``(ref, error)`` of the first of ``pending`` to fail because its actor's process died, within ``grace``
    seconds; ``None`` if none does."""
    import ray

    deadline = time.monotonic() + grace
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return ref, exc
            except Exception:  # another symptom: keep looking for the cause
                pass
    return None


def _note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def _kill(actors: Sequence[Any]) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead
            pass


# ---------------------------------------------------------------------------------------------------- train group
class TrainGroup:
    """The ``world_size`` train actors of one layout (rank ``r``: dp_rank ``r % dp``, pp_rank ``r // dp``)."""

    def __init__(self, config: RunConfig, actors: list, setup_refs: list):
        self.config = config
        self.actors = actors
        self._setup_refs = setup_refs
        self.layouts: list[dict] = []
        self.alive = True

    @classmethod
    def launch(cls, config: RunConfig) -> "TrainGroup":
        """Create the actors and start their set-up (returns at once; :meth:`wait_ready` waits)."""
        import ray

        world = config.world_size
        device = config.options["device"]
        if device == "cuda":
            gpus = ray.cluster_resources().get("GPU", 0)
            if gpus < world:
                raise DeviceError(f"device=cuda needs one GPU per train process ({world}) but Ray sees {gpus:g}; "
                                  f"lower actor_num_gpus_per_node or run on a machine with more GPUs")
        cpus = ray.cluster_resources().get("CPU", 1) / (world + 1)
        opts = dict(num_cpus=cpus, num_gpus=1 if device == "cuda" else 0)
        actors = [remote(TrainActor, **opts).remote(config.options["train_worker_class"], config.train.to_dict(),
                                                    rank, world, config.options["train_autocast"])
                  for rank in range(world)]
        group = cls(config, actors, [])
        try:
            addr, port = gather([("train rank 0", actors[0].address.remote())], config.options["setup_timeout_seconds"],
                                "the rendezvous")[0]
            group._setup_refs = [a.setup.remote(addr, port, True) for a in actors]  # rank 0's actor serves it
        except BaseException:
            group.kill()
            raise
        return group

    def setup_calls(self) -> list[tuple[str, Any]]:
        return [(f"train rank {r}", ref) for r, ref in enumerate(self._setup_refs)]

    def wait_ready(self, extra: Sequence[tuple[str, Any]] = ()) -> list[Any]:
        """Wait for every rank's set-up (and ``extra`` calls, failing fast on any); returns the extra results."""
        if self._setup_refs:
            results = gather([*self.setup_calls(), *extra], self.config.options["setup_timeout_seconds"],
                             "set-up")
            self.layouts = results[:len(self._setup_refs)]
            self._setup_refs = []
            return results[len(self.layouts):]
        return gather(list(extra), self.config.options["setup_timeout_seconds"], "set-up") if extra else []

    def fixed_key_changes(self, config: RunConfig) -> list[str]:
        """Keys that differ from this group's and cannot change without new processes."""
        mine, theirs = self.config.train.to_dict(), config.train.to_dict()
        resettable = RESETTABLE_KEYS  # keys a running group may change; the rest need new processes
        diffs = [k for k in mine if mine[k] != theirs[k] and k not in resettable]
        if config.world_size != self.config.world_size:
            diffs.append("actor_num_gpus_per_node")
        if config.options["train_worker_class"] != self.config.options["train_worker_class"]:
            diffs.append("train_worker_class")
        return diffs

    def reset(self, config: RunConfig) -> None:
        """Back to the initial parameters, with ``config``'s batch/schedule/optimizer keys."""
        fixed = self.fixed_key_changes(config)
        if fixed:
            raise ValueError(f"this TrainGroup cannot run the config: {fixed} differ and are fixed at set-up; "
                             f"start a new group")
        resettable = RESETTABLE_KEYS
        changes = {k: v for k, v in config.train.to_dict().items() if k in resettable}
        self.wait_ready()
        gather([(f"train rank {r}", a.reset.remote(changes)) for r, a in enumerate(self.actors)],
               config.options["setup_timeout_seconds"], "reset")
        self.config = config

    def train(self, rollout_id: int, payload_refs: list, timeout: float) -> list[RankResult]:
        calls = [(f"train rank {r}", a.train_rollout.remote(rollout_id, payload_refs))
                 for r, a in enumerate(self.actors)]
        return gather(calls, timeout, f"training on rollout {rollout_id}")

    def shutdown(self, timeout: float = 30.0) -> None:
        """Leave the process groups cleanly, then end the processes (kill if that does not finish)."""
        if not self.alive:
            return
        try:
            if not self._setup_refs:
                gather([(f"train rank {r}", a.shutdown.remote()) for r, a in enumerate(self.actors)], timeout,
                       "shutdown")
        except Exception as exc:  # the processes are killed below either way
            logger.warning("train group shutdown: %s", exc)
        finally:
            self.kill()

    def kill(self) -> None:
        _kill(self.actors)
        self.alive = False


# ---------------------------------------------------------------------------------------------------- the run
def run(config: RunConfig, *, group: TrainGroup | None = None, out: Callable[[str], None] | None = print,
        extra_pythonpath: Sequence[str] = ()) -> RunResult:
    """Run ``config``: ``num_rollout`` rollouts, each trained to the end; see the module docstring.

    ``launcher: processes`` runs the same loop without Ray (:mod:`.processes`); ``group`` is Ray's only."""
    if config.options["launcher"] == "processes":
        if group is not None or extra_pythonpath:
            raise ValueError("launcher: processes starts its own train processes; group= and extra_pythonpath= "
                             "are for launcher: ray")
        from .processes import run as run_processes

        return run_processes(config, out=out)
    import ray

    emit = out or (lambda line: None)
    opts = config.options
    start = time.perf_counter()
    phases = Phases(emit)
    emit(f"set-up: {describe(config)}")
    with phases.phase("Ray start", "starting Ray on loopback (127.0.0.1) ...", done=None):
        started_ray = start_ray(config, extra_pythonpath=extra_pythonpath)
    emit(f"Ray start: {'started' if started_ray else 'already running, reused'} in "
         f"{phases.seconds['Ray start']:.1f} s")
    own_group = group is None
    manager = None
    try:
        with phases.phase("process start-up", _startup_text(config, own_group)):
            cpus = ray.cluster_resources().get("CPU", 1) / (config.world_size + 1)
            manager = remote(RolloutManager, num_cpus=cpus, num_gpus=0).remote(
                config.to_dict(), config.train_parallel_config())
            pending_generate = manager.generate.remote(0)
            if own_group:
                group = TrainGroup.launch(config)
            else:
                if not group.alive:
                    raise RuntimeError("the TrainGroup was killed by an earlier failure; start a new one")
                group.reset(config)
            first = group.wait_ready([("the rollout manager", pending_generate)])[0]
        result = RunResult(config=config, layouts=list(group.layouts), phases=phases.seconds)
        with phases.phase("steps", f"{opts['num_rollout']} rollouts, one line per optimizer step (columns explained "
                                   f"below)", done=None):
            emit(HEADER)
            _train_rollouts(config, group, manager, first, result, emit)
        for line in LEGEND:
            emit(line)
        result.seconds = time.perf_counter() - start
        return result
    except BaseException:
        if group is not None:
            group.kill()  # ranks may be stuck in a collective with a failed peer: no clean shutdown to wait for
        raise
    finally:
        if manager is not None:
            _kill([manager])
        if own_group and group is not None:
            group.shutdown()
        if started_ray:
            ray.shutdown()


def _startup_text(config: RunConfig, new_processes: bool) -> str:
    if not new_processes:
        return "resetting the running train processes; the rollout manager generates rollout 0 ..."
    return (f"starting {config.world_size} train processes (dp={config.dp_size} x pp={config.train.parallel.pp_size};"
            f" each imports torch and megatron-core, builds the model and joins the process group) and the rollout "
            f"manager, which generates rollout 0 meanwhile ...")


def _train_rollouts(config: RunConfig, group: "TrainGroup", manager, first: dict, result: RunResult,
                    emit: Callable[[str], None]) -> None:
    """Generate (rollout 0: already generated, ``first``), train and report every rollout in turn."""
    opts = config.options
    for rollout_id in range(opts["num_rollout"]):
        t0 = time.perf_counter()
        if rollout_id == 0:
            gen = first
        else:
            gen = gather([("the rollout manager", manager.generate.remote(rollout_id))],
                         opts["rollout_timeout_seconds"], f"rollout {rollout_id}")[0]
        plan = gen["plan"]
        if plan.dropped:
            emit(f"  rollout {rollout_id}: dropped {plan.dropped_reason}")
        ranks = group.train(rollout_id, gen["payload_refs"], opts["train_timeout_seconds"])
        result.rollouts.append(finish_rollout(config, rollout_id, plan, ranks, emit, gen["seconds"], t0))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m slime_ext.run --config FILE [--set key=value ...]``; exit 2 on a bad config, 1 on a failed run."""
    import argparse

    import yaml

    from .config import ConfigError, load_run_config

    parser = argparse.ArgumentParser(prog="python -m slime_ext.run", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (YAML value), e.g. --set num_rollout=5")
    parser.add_argument("--json", metavar="PATH", help="also write the train ranks' layouts and the per-step rows "
                                                       "as JSON")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    overrides = {}
    for item in ns.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = yaml.safe_load(value)
    try:
        config = load_run_config(ns.config, **overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run(config)
    except Exception as exc:
        print(f"error: the run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"done: {len(result.rollouts)} rollouts, {len(result.rows)} steps in {result.seconds:.1f}s")
    print(time_summary(result))
    if ns.json:
        import json

        with open(ns.json, "w") as fh:
            json.dump({"layouts": result.layouts, "rows": result.rows,
                       "dropped": {r.rollout_id: r.plan.dropped for r in result.rollouts}}, fh, indent=1)
    return 0
