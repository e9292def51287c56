"""Start the ranks of one worker run (:mod:`rl_worker`) as processes on this machine and collect what they left.

``run_worker(tree, layout, ...)`` starts ``WORLD_SIZE`` processes of ``rl_worker.py`` with the Megatron-LM tree
first on ``PYTHONPATH``, waits for all of them (killing every one when the time is up), and returns a
:class:`WorkerRun`: the result file when the run succeeded, else each failed rank's error record.

Also a command line, for running one layout by hand::

    python tests/megatron_rl/mrl_launch.py --tree .megatron-lm-trees/HEAD --layout dp2pp2 --path megatron --out r.pt
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "rl_worker.py")
WORLD = {"dp2": 2, "dp2pp2": 4, "dp2pp2vpp2": 4}


@dataclasses.dataclass
class WorkerRun:
    out: str
    returncodes: list[int]
    errors: dict[int, dict]  # rank -> {"error", "traceback"} of every rank that wrote one
    logs: list[str]  # per rank: the last lines of its output
    wall_s: float
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes) and os.path.exists(self.out)

    def result(self) -> dict:
        import mrl_results

        if not self.ok:
            raise AssertionError(f"the worker run failed:\n{self.describe()}")
        return mrl_results.load(self.out)

    def describe(self) -> str:
        lines = [f"return codes {self.returncodes}, {self.wall_s:.1f} s" + (" (timed out)" if self.timed_out else "")]
        for rank, err in sorted(self.errors.items()):
            lines.append(f"rank {rank}: {err['error']}\n{err['traceback'][-3000:]}")
        if not self.errors:
            lines += [f"--- rank {r} output (tail) ---\n{log}" for r, log in enumerate(self.logs)]
        return "\n".join(lines)


def run_worker(tree: str, layout: str, out: str, *, path: str = "megatron", steps_per_collection: int = 1,
               iterations: int = 2, seed: int = 1, extra: tuple[str, ...] = (), timeout: float = 600) -> WorkerRun:
    """Run every rank of one worker configuration; ``out`` is the result file (``.pt``)."""
    world = WORLD[layout]
    for stale in [out] + [f"{out}.rank{r}.error.json" for r in range(world)]:
        if os.path.exists(stale):
            os.remove(stale)
    from slime_ext.training.parallel import host_store, hosted_store_env

    store = host_store()  # served here, on a port bound before the ranks learn it; they join as clients
    env_base = {**os.environ, **hosted_store_env(store), "WORLD_SIZE": str(world),
                "OMP_NUM_THREADS": "1", "MEGATRON_LM_TREE": os.path.abspath(tree),
                # megatron.core.package_info appends `git rev-parse HEAD` of the folder it sits in, which for an
                # extracted tree is this repository's commit, not Megatron-LM's
                "NO_VCS_VERSION": "1",
                "PYTHONPATH": os.pathsep.join([os.path.abspath(tree), ROOT, HERE])}
    cmd = [sys.executable, WORKER, "--path", path, "--layout", layout, "--steps-per-collection",
           str(steps_per_collection), "--iterations", str(iterations), "--seed", str(seed), "--out", out, *extra]
    t0 = time.time()
    procs, logs = [], []
    for rank in range(world):
        log = open(f"{out}.rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env={**env_base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = t0 + timeout
    # wait for every rank; once one has failed, its peers (likely waiting in a collective) get a grace period
    failed_at = None
    while any(p.poll() is None for p in procs):
        now = time.time()
        if failed_at is None and any(p.returncode not in (0, None) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + 20):
            break
        time.sleep(0.2)
    timed_out = time.time() > deadline
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for log in logs:
        log.close()
    errors = {}
    for rank in range(world):
        path_err = f"{out}.rank{rank}.error.json"
        if os.path.exists(path_err):
            with open(path_err) as f:
                errors[rank] = json.load(f)
    tails = []
    for rank in range(world):
        with open(f"{out}.rank{rank}.log", errors="replace") as f:
            tails.append("".join(f.readlines()[-40:]))
    return WorkerRun(out=out, returncodes=[p.returncode for p in procs], errors=errors, logs=tails,
                     wall_s=time.time() - t0, timed_out=timed_out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", required=True, help="a Megatron-LM tree (e.g. .megatron-lm-trees/HEAD)")
    p.add_argument("--layout", choices=sorted(WORLD), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=600)
    opts, rest = p.parse_known_args(argv)
    run = run_worker(opts.tree, opts.layout, opts.out, extra=tuple(rest), timeout=opts.timeout)
    print(run.describe() if not run.ok else f"ok: {opts.out} ({run.wall_s:.1f} s)")
    return 0 if run.ok else 1


if __name__ == "__main__":
    sys.exit(main())
