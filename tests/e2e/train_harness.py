"""Shared pieces of the training-side e2e tests: process launching, synthetic rollouts, the reference step.

Processes come from a ``forkserver`` that has imported torch and megatron-core once, so a rank starts in well under
a second instead of re-importing megatron (~6 s of CPU each on the CI machines). Each launched job returns a
picklable result through a file; a job that raises fails the launch with its traceback, a launch that outruns its
deadline is killed and fails with the jobs still running.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

# one small model for every layout, so one reference serves them all (4 layers: pp=2 x vpp=2)
MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64, seq_length=64)
# SGD without momentum: the update is -lr * grad, so comparing parameters compares gradients (Adam's first step
# is ~lr * sign(grad) and would hide a wrong loss scale)
OPTIM = dict(optimizer="sgd", sgd_momentum=0.0, lr=0.5, weight_decay=0.0, clip_grad=1.0, seed=1234)
CAP = 48  # max_tokens_per_gpu of the dynamic scenarios


# ---------------------------------------------------------------------------------------------------- processes
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "megatron.core", "megatron.core.models.gpt",
                                     "megatron.core.pipeline_parallel", "megatron.core.optimizer",
                                     "megatron.core.distributed", "slime_ext.training.worker"])
    return _CTX


@contextlib.contextmanager
def rendezvous() -> Iterator[int]:
    """The port of a rendezvous store this process serves while the ``with`` block runs (bound on port 0, the port
    read back, so no other process can take it between picking and binding); the ranks join it with
    ``TrainWorker(..., port, store_hosted=True)`` (:func:`join`)."""
    from slime_ext.training.parallel import host_store

    store = host_store()
    try:
        yield store.port
    finally:
        del store


def join(config: Any, rank: int, world_size: int, port: int):
    """This rank's ``TrainWorker`` for the store :func:`rendezvous` serves (not set up yet)."""
    from slime_ext.training.worker import TrainWorker

    return TrainWorker(config, rank, world_size, "127.0.0.1", port, store_hosted=True)


def _job_main(fn: Callable, args: tuple, out_path: str, gpu: bool) -> None:
    import faulthandler
    import signal

    if not gpu:  # CPU jobs stay on CPU + gloo even on a GPU host (CUDA is initialised lazily, after this)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    faulthandler.register(signal.SIGUSR1)  # the parent asks for stacks before it kills a job that overran
    torch.set_num_threads(1)
    try:
        result = ("ok", fn(*args))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(out_path + ".tmp", "wb") as fh:
        pickle.dump(result, fh)
    os.replace(out_path + ".tmp", out_path)
    os._exit(0 if result[0] == "ok" else 1)  # skip atexit handlers of half-torn-down process groups


class JobFailed(RuntimeError):
    pass


def launch(jobs: Sequence[tuple[Callable, tuple]], timeout: float = 180.0, *, keep_going: bool = False,
           wait_for: Sequence[int] | None = None, gpu: bool = False) -> list[Any]:
    """Run ``fn(*args)`` for every job in its own process; returns their results in order.

    Without ``keep_going`` the first failure kills the rest and raises :class:`JobFailed`; with it every job
    runs to its end (or the deadline) and failures come back as ``JobFailed`` instances in the result list.
    ``wait_for``: return once these jobs are done; the others are killed (their results stay ``None``).
    ``gpu``: let the jobs see the host's GPUs (otherwise ``CUDA_VISIBLE_DEVICES`` is emptied: CPU and gloo).
    """
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"job{i}.pkl") for i in range(len(jobs))]
        procs = [ctx.Process(target=_job_main, args=(fn, args, path, gpu), daemon=True)
                 for (fn, args), path in zip(jobs, paths)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * len(jobs)
        pending = set(range(len(jobs)) if wait_for is None else wait_for)
        try:
            while pending:
                for i in sorted(pending):
                    if not os.path.exists(paths[i]):
                        if not procs[i].is_alive() and not os.path.exists(paths[i]):
                            raise JobFailed(f"job {i} died with exit code {procs[i].exitcode} and no result")
                        continue
                    with open(paths[i], "rb") as fh:
                        status, value = pickle.load(fh)
                    pending.discard(i)
                    if status == "ok":
                        results[i] = value
                    elif keep_going:
                        results[i] = JobFailed(value)
                    else:
                        raise JobFailed(f"job {i} failed:\n{value}")
                if pending and time.monotonic() > deadline:
                    for i in pending:
                        if procs[i].is_alive():
                            os.kill(procs[i].pid, signal.SIGUSR1)
                    time.sleep(1.0)
                    raise TimeoutError(f"jobs {sorted(pending)} still running after {timeout:.0f}s")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
        return results


# ---------------------------------------------------------------------------------------------------- rollouts
def make_samples(num_rollouts: int, seed: int, *, vocab: int = 64, max_response: int = 30,
                 multi_every: int = 4) -> list[dict]:
    """Synthetic samples with long-tailed response lengths; every ``multi_every``-th rollout emits 2-3 samples."""
    rng = np.random.default_rng(seed)
    samples = []
    for rid in range(num_rollouts):
        count = int(rng.integers(2, 4)) if multi_every and rid % multi_every == multi_every - 1 else 1
        for _ in range(count):
            prompt = int(rng.integers(2, 9))
            response = int(min(max_response, 1 + rng.pareto(1.5) * 4))
            total = prompt + response
            mask = (rng.random(response) > 0.15).astype(int).tolist()
            samples.append(dict(tokens=rng.integers(0, vocab, total).tolist(), total_length=total,
                                response_length=response, loss_mask=mask, reward=float(rng.normal()),
                                advantage=float(rng.normal()), rollout_id=rid))
    return samples


def plan(samples: list[dict], train_config: dict, world_size: int, *, pipeline_aware: bool = True):
    """The rollout side's job, for the tests: the DPSchedule of ``samples`` for ``train_config``.

    ``pipeline_aware=False`` plans as if there were no pipeline (``pp_size = 1``: the planner before issue 15,
    micro-batches heaviest first), for comparing a pipeline-aware plan with the unordered one."""
    from slime_ext.schedule import build_dp_schedule
    from slime_ext.train_config import TrainConfig

    cfg = TrainConfig.from_mapping(train_config)
    parallel = cfg.train_parallel_config(world_size)
    args = cfg.to_dict()
    if not pipeline_aware:  # both say so: the planner reads the pipeline size off args and the dict alike
        parallel = {**parallel, "pp_size": 1}
        args["pipeline_model_parallel_size"] = 1
    return build_dp_schedule(
        SimpleNamespace(**args), parallel,
        [s["total_length"] for s in samples], rollout_indices=[s["rollout_id"] for s in samples],
        loss_tokens=[sum(s["loss_mask"]) for s in samples])


def _batch(samples: list[dict]):
    from slime_ext.schedule import SampleBatch

    return SampleBatch(tokens=[s["tokens"] for s in samples], total_lengths=[s["total_length"] for s in samples],
                       response_lengths=[s["response_length"] for s in samples],
                       loss_masks=[s["loss_mask"] for s in samples], rewards=[s["reward"] for s in samples],
                       advantages=[s["advantage"] for s in samples], rollout_ids=[s["rollout_id"] for s in samples])


def rollout_payloads(samples: list[dict], schedule) -> list:
    """Per DP rank: ``schedule.rank_payload(r, samples)``."""
    batch = _batch(samples)
    return [schedule.rank_payload(r, batch) for r in range(schedule.dp_size)]


def legacy_payloads(samples: list[dict], dp_size: int, global_batch_size: int) -> list:
    """Upstream's split for the legacy path: strided over DP ranks, equal counts."""
    from slime_ext.schedule import RankPayload

    batch, n = _batch(samples), len(samples) - len(samples) % dp_size
    return [RankPayload(rollout_id=0, dp_rank=r, dp_size=dp_size, partition=list(range(r, n, dp_size)),
                        samples=batch.take(range(r, n, dp_size)), global_batch_size=global_batch_size)
            for r in range(dp_size)]


def legacy_step_samples(payloads: list[dict], global_batch_size: int) -> list[list[int]]:
    """Global ids per legacy step: rank r's samples [s * gbs/dp, (s+1) * gbs/dp), over all ranks."""
    local = global_batch_size // len(payloads)
    steps = len(payloads[0].partition) // local
    return [sorted(i for p in payloads for i in p.partition[s * local:(s + 1) * local]) for s in range(steps)]


# ---------------------------------------------------------------------------------------------------- group jobs
def group_job(rank: int, world_size: int, port: int, config: dict, scenarios: list[dict]) -> dict:
    """One rank (of the store :func:`rendezvous` serves at ``port``): for each scenario, reset, optionally log-probs
    of the initial model, train its rollouts."""
    worker = join(config, rank, world_size, port)
    layout = worker.setup()
    out = {"layout": layout, "scenarios": {}}
    try:
        for sc in scenarios:
            worker.reset(**sc.get("changes", {}))
            rollouts = [r[layout["dp_rank"]] for r in sc["rollouts"]]
            res: dict = {}
            if sc.get("forward_only"):
                res["forward_only"] = worker.forward_only(rollouts[0])
            res["records"] = [worker.train_rollout(rd) for rd in rollouts]
            res["params"] = worker.param_snapshot()
            res["scheduler"] = worker.scheduler_state()
            out["scenarios"][sc["name"]] = res
    finally:
        worker.shutdown()
    return out


def reference_job(config: dict, scenarios: list[dict]) -> dict:
    """Single process, no schedule: each step's samples one by one, plain autograd, then the same optimizer. It
    serves its own rendezvous store on a port the OS gives it (port 0).

    ``scenarios[i]["samples"]``: one sample list per rollout; ``scenarios[i]["reference_steps"]``: list of
    ``(rollout index, global sample ids, lr increment)``; ``scenarios[i]["forward_only"]``: sample ids of rollout 0
    whose log-probs under the initial parameters to return.
    """
    import torch

    from slime_ext.training.model import param_snapshot
    from slime_ext.training.worker import TrainWorker

    worker = TrainWorker(config, 0, 1, "127.0.0.1", 0)
    worker.setup()
    state = worker.state
    out: dict = {"initial": {k: v.numpy() for k, v in param_snapshot(state.model).items()}, "scenarios": {}}
    try:
        for sc in scenarios:
            worker.reset(**sc.get("changes", {}))
            samples = sc["samples"]
            res: dict = {"lrs": []}
            if sc.get("forward_only"):
                with torch.no_grad(), _cpu_context():
                    res["log_probs"] = {i: _sample_log_probs(state.model[0], samples[0][i]).tolist()
                                        for i in sc["forward_only"]}
            for rollout, ids, increment in sc["reference_steps"]:
                res["lrs"].append(float(state.optimizer.param_groups[0]["lr"]))
                _reference_step(state, [samples[rollout][i] for i in ids])
                state.scheduler.step(increment=increment)
            res["params"] = {k: v.numpy() for k, v in param_snapshot(state.model).items()}
            res["scheduler"] = worker.scheduler_state()
            out["scenarios"][sc["name"]] = res
    finally:
        worker.shutdown()
    return out


def _sample_log_probs(model, sample: dict):
    import torch

    total, response = sample["total_length"], sample["response_length"]
    device = next(model.parameters()).device
    tokens = torch.tensor(sample["tokens"], device=device)[None]
    causal = torch.triu(torch.ones(total, total, dtype=torch.bool, device=device), diagonal=1)[None, None]
    logits = model(tokens, torch.arange(total, device=device)[None], causal)[0].float()
    predicted = logits[total - response - 1: total - 1]
    return torch.log_softmax(predicted, -1).gather(-1, tokens[0, total - response:, None]).squeeze(-1)


def _cpu_context():
    """The CPU device context when training on CPU (the reference calls the model outside Megatron's schedules)."""
    import contextlib

    import torch

    from slime_ext.patches.megatron_cpu import cpu_device_context

    return contextlib.nullcontext() if torch.cuda.is_available() else cpu_device_context()


def _reference_step(state, samples: list[dict]) -> None:
    import torch

    model = state.model[0]
    model.zero_grad_buffer()
    state.optimizer.zero_grad()
    total_tokens = sum(sum(s["loss_mask"]) for s in samples)
    with _cpu_context():
        for s in samples:
            logp = _sample_log_probs(model, s)
            mask = torch.tensor(s["loss_mask"], dtype=torch.float32, device=logp.device)
            (-(s["advantage"] * logp * mask).sum() / total_tokens).backward()
        model.finish_grad_sync()
    state.optimizer.step()


# ---------------------------------------------------------------------------------------------------- checks
def merged_params(group_result: list[dict], name: str) -> dict[str, np.ndarray]:
    """Parameters of scenario ``name`` over all ranks; replicas (DP ranks, tied copies) must agree exactly."""
    merged: dict[str, np.ndarray] = {}
    for rank_result in group_result:
        for key, value in rank_result["scenarios"][name]["params"].items():
            if key in merged:
                assert np.array_equal(merged[key], value), f"{name}: replicas of {key} differ across ranks"
            else:
                merged[key] = value
    return merged


def assert_params_match(got: dict, ref: dict, initial: dict, *, rtol: float = 1e-5, label: str = "") -> dict:
    """Same parameter set; every tensor within ``rtol`` relative; the update itself matches too. Returns errors."""
    assert set(got) == set(ref), f"{label}: parameter names differ: {sorted(set(got) ^ set(ref))}"
    worst_param, delta_err, delta_norm, init_norm = 0.0, 0.0, 0.0, 0.0
    for key in ref:
        g, r, p0 = got[key].astype(np.float64), ref[key].astype(np.float64), initial[key].astype(np.float64)
        scale = max(np.abs(r).max(), 1e-12)
        worst_param = max(worst_param, float(np.abs(g - r).max() / scale))
        delta_err += float(np.sum(((g - p0) - (r - p0)) ** 2))
        delta_norm += float(np.sum((r - p0) ** 2))
        init_norm += float(np.sum(p0 ** 2))
    rel_update = math.sqrt(delta_err / delta_norm) if delta_norm else float("inf")
    assert delta_norm > (1e-3 ** 2) * init_norm, f"{label}: the step barely moved the parameters"
    assert worst_param <= rtol, f"{label}: parameters differ from the reference by {worst_param:.2e} (relative)"
    assert rel_update <= 1e-4, f"{label}: the update differs from the reference update by {rel_update:.2e}"
    return {"param_rel": worst_param, "update_rel": rel_update}
