"""Calibration: time real training steps of chosen micro-batches on this model and device, fit a :class:`CostProfile`.

::

    profile, report, observations = calibrate(train_config, max_tokens=4096)   # one process, world size 1
    profile.save("profile.json")                                               # slime-ext plan --cost-profile ...

Every timed step goes through the same path as training (:class:`TrainWorker` ``.train_rollout`` on a rollout-side
payload of one step): data validation, packing into tensors, megatron-core's ``forward_backward_func`` over the
step's micro-batches, the gradient reduction and the optimizer. What a step costs beyond its micro-batches lands
in ``step_overhead_s``; what each micro-batch costs beyond its tokens in ``microbatch_overhead_s``.

Timers (``timer``): ``"thread"`` -- CPU time of the calling thread (``time.thread_time``; the default on CPU with
one torch thread: other processes sharing the cores do not inflate it, and a wait in a collective is not counted);
``"process"`` -- CPU time of the process (CPU with several torch threads); ``"cuda"`` -- wall time between two
``torch.cuda.synchronize()`` (GPU).

:func:`calibration_design` chooses the steps: single samples over a geometric range of lengths (the linear and
quadratic terms), micro-batches packing 2-6 samples of mixed lengths (separating attention within a sample from
attention over the packed row) and 1-3 micro-batches per step (separating the per-step from the per-micro-batch
overhead).

For the pipeline model (``pp_size > 1``) calibration also measures each piece's share of the forward time (the
embedding, one decoder layer, the final norm and output layer: :func:`time_piece_shares`, recorded in
``meta["piece_shares"]``; the per-stage costs split a profile by them) and fits what a profile's
``backward_forward_ratio`` and ``p2p_s`` say: the same design steps are timed forward only (:func:`time_forward_only`, megatron-core's schedule
with ``forward_only=True``), and the ratio is :func:`fit_backward_forward_ratio`; ``p2p_s`` is the time of one
send/recv of one capped micro-batch's activation between two processes on the job's backend
(:func:`measure_p2p`: gloo on CPU; NCCL needs two GPUs, else it is left 0 and the profile's meta says why).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np

from slime_ext.schedule.profile import CostProfile, FitReport, Observation, fit_profile

TIMERS = ("thread", "process", "cuda")


def calibration_design(max_tokens: int, *, min_length: int = 32, seed: int = 0) -> list[list[list[int]]]:
    """Steps to time: each a list of micro-batches, each a list of sample lengths (no micro-batch over
    ``max_tokens`` tokens)."""
    if max_tokens < 4 * min_length:
        raise ValueError(f"max_tokens={max_tokens} must be at least 4 * min_length = {4 * min_length}")
    rng = np.random.default_rng(seed)
    singles = np.unique(np.geomspace(min_length, max_tokens, num=7).astype(int)).tolist()
    micro_batches: list[list[int]] = [[L] for L in singles]
    for parts in (2, 3, 4, 6, 12):  # packed: `parts` samples of mixed lengths filling 50-100% of the cap
        if parts * min_length * 2 > max_tokens:
            continue
        for fill in (0.5, 1.0):
            budget = max(parts * min_length, int(max_tokens * fill))
            cuts = np.sort(rng.choice(np.arange(1, budget // min_length), size=parts - 1, replace=False))
            lengths = np.diff(np.concatenate(([0], cuts, [budget // min_length]))) * min_length
            micro_batches.append([int(x) for x in lengths])
    steps = [[mb] for mb in micro_batches]  # one micro-batch per step
    order = rng.permutation(len(micro_batches)).tolist()
    for k in (2, 3):  # several micro-batches per step, drawn from the same shapes
        for start in range(0, len(order) - k + 1, 2 * k):
            steps.append([micro_batches[i] for i in order[start:start + k]])
    return steps


def synthetic_step(micro_batches: Sequence[Sequence[int]], *, vocab_size: int, seed: int = 0,
                   global_offset: int = 0):
    """One DP rank's :class:`~slime_ext.schedule.RankPayload` for one step made of ``micro_batches`` (a rollout-side
    payload of random tokens, planned as given).

    Every sample has a prompt of ``max(1, L // 4)`` tokens and the rest as response, all counted in the loss.
    """
    from slime_ext.schedule import RankPayload, SampleBatch

    rng = np.random.default_rng(seed)
    lengths = [int(L) for mb in micro_batches for L in mb]
    if any(L < 2 for L in lengths):
        raise ValueError(f"sample lengths must be >= 2 (a prompt token and a response token), got {min(lengths)}")
    responses = [L - max(1, L // 4) for L in lengths]
    mbi, start = [], 0
    for mb in micro_batches:
        mbi.append(list(range(start, start + len(mb))))
        start += len(mb)
    ids = list(range(global_offset, global_offset + len(lengths)))
    samples = SampleBatch(tokens=[rng.integers(0, vocab_size, L).tolist() for L in lengths], total_lengths=lengths,
                          response_lengths=responses, loss_masks=[[1] * r for r in responses],
                          rewards=[0.0] * len(lengths), advantages=rng.standard_normal(len(lengths)).tolist(),
                          rollout_ids=ids)
    return RankPayload(rollout_id=0, dp_rank=0, dp_size=1, partition=ids, samples=samples, micro_batch_indices=mbi,
                       num_microbatches=[len(micro_batches)], samples_per_step=[len(lengths)],
                       rollouts_per_step=[len(lengths)], loss_tokens_per_step=[sum(responses)])


def default_timer() -> str:
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "thread" if torch.get_num_threads() == 1 else "process"


@contextlib.contextmanager
def _no_context():
    yield


def make_clock(timer: str) -> Callable[[Callable[[], Any]], tuple[Any, float, float]]:
    """``clock(fn) -> (fn(), busy seconds by ``timer``, wall seconds)``."""
    if timer not in TIMERS:
        raise ValueError(f"timer={timer!r} must be one of {TIMERS}")
    import torch

    cpu = {"thread": time.thread_time, "process": time.process_time}.get(timer)

    def clock(fn: Callable[[], Any]) -> tuple[Any, float, float]:
        if timer == "cuda":
            torch.cuda.synchronize()
        w0 = time.perf_counter()
        c0 = cpu() if cpu else 0.0
        out = fn()
        if timer == "cuda":
            torch.cuda.synchronize()
        c1 = cpu() if cpu else 0.0
        wall = time.perf_counter() - w0
        return out, (c1 - c0) if cpu else wall, wall

    return clock


#: how the repeats of one step become its observation: ``median`` (the default) or ``min`` (the least-disturbed run:
#: on a shared machine other processes only ever add time, so the minimum of k repeats is the stablest estimate)
STATISTICS = {"median": statistics.median, "min": min}


def time_steps(worker, steps: Sequence[Sequence[Sequence[int]]], *, repeats: int = 3, timer: str | None = None,
               autocast: Callable[[], Any] | None = None, warmup: int = 1,
               progress: Callable[[str], None] | None = None, statistic: str = "median") -> list[Observation]:
    """Busy seconds of each step in ``steps`` (run ``repeats`` times, interleaved; ``statistic`` of the repeats, see
    :data:`STATISTICS`) on ``worker``.

    ``worker`` is a set-up :class:`slime_ext.training.worker.TrainWorker` on the rollout-side path, alone in its
    data-parallel group (world size 1, or the caller times one rank while the others wait). ``autocast`` wraps
    each step (e.g. ``lambda: torch.autocast("cuda", torch.bfloat16)``).
    """
    vocab = worker.config.model.vocab_size
    payloads = [synthetic_step(s, vocab_size=vocab, seed=i) for i, s in enumerate(steps)]
    biggest = max(range(len(steps)), key=lambda i: sum(map(sum, steps[i])))
    seconds = _time_interleaved(worker.train_rollout, payloads, [payloads[biggest]] * warmup, repeats=repeats,
                                timer=timer, autocast=autocast, statistic=statistic, progress=progress)
    return [Observation(tuple(tuple(int(x) for x in mb) for mb in s), t) for s, t in zip(steps, seconds)]


def _time_interleaved(run: Callable[[Any], Any], payloads: list, warmup: list, *, repeats: int, timer: str | None,
                      autocast: Callable[[], Any] | None, statistic: str,
                      progress: Callable[[str], None] | None = None) -> list[float]:
    """``run`` each payload ``repeats`` times, forward then backward order in turn (slow drift hits every payload
    alike), after the ``warmup`` payloads (allocator and first-call costs stay out); busy seconds per payload,
    ``statistic`` of its repeats."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic={statistic!r} must be one of {sorted(STATISTICS)}")
    reduce = STATISTICS[statistic]
    clock = make_clock(timer or default_timer())
    ctx = autocast or _no_context
    for payload in warmup:
        with ctx():
            run(payload)
    samples: list[list[float]] = [[] for _ in payloads]
    for rep in range(repeats):
        for i in (range(len(payloads)) if rep % 2 == 0 else reversed(range(len(payloads)))):
            with ctx():
                _, busy, _ = clock(lambda: run(payloads[i]))
            samples[i].append(busy)
        if progress:
            progress(f"repeat {rep + 1}/{repeats}: {len(payloads)} steps timed")
    return [reduce(t) for t in samples]


def time_forward_only(worker, steps: Sequence[Sequence[Sequence[int]]], *, repeats: int = 3,
                      timer: str | None = None, autocast: Callable[[], Any] | None = None,
                      statistic: str = "median") -> list[float]:
    """Busy seconds of each step's forward-only pass (megatron-core's schedule with ``forward_only=True``, no
    optimizer), ``statistic`` of ``repeats`` interleaved runs, on the same kind of payloads as :func:`time_steps`."""
    payloads = [synthetic_step(s, vocab_size=worker.config.model.vocab_size, seed=i) for i, s in enumerate(steps)]
    return _time_interleaved(worker.forward_only, payloads, payloads[:1], repeats=repeats, timer=timer,
                             autocast=autocast, statistic=statistic)


def time_piece_shares(worker, steps: Sequence[Sequence[Sequence[int]]], *, repeats: int = 3,
                      timer: str | None = None, autocast: Callable[[], Any] | None = None) -> dict:
    """Each piece's share of the model's forward time, measured on the same payloads as :func:`time_steps`:
    ``{"embedding": e, "layer": l, "head": h}`` with ``e + num_layers * l + h = 1`` (``layer``: one decoder layer,
    the mean of all; ``head``: the final norm and the output layer). Forward hooks on the ``GPTModel``'s modules
    read ``timer``'s clock before and after each piece (with ``cuda``, after a synchronize), over ``repeats``
    forward-only passes of every step. What the pipeline stages' per-stage costs are split by
    (:class:`slime_ext.schedule.stages.StageCosts`); the loss, computed outside the model, is not counted."""
    import torch

    from .model import unwrap

    timer = timer or default_timer()
    if timer not in TIMERS:
        raise ValueError(f"timer={timer!r} must be one of {TIMERS}")
    cpu = {"thread": time.thread_time, "process": time.process_time}.get(timer)

    def now() -> float:
        if timer == "cuda":
            torch.cuda.synchronize()
        return cpu() if cpu else time.perf_counter()

    model = unwrap(worker.state.model[0])
    layers = list(model.decoder.layers)
    pieces = {"embedding": [model.embedding], "layer": layers,
              "head": [m for m in (getattr(model.decoder, "final_layernorm", None), model.output_layer)
                       if m is not None]}
    totals = dict.fromkeys(pieces, 0.0)
    handles, started = [], {}
    for name, modules in pieces.items():
        for module in modules:
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, key=id(module): started.__setitem__(key, now())))
            handles.append(module.register_forward_hook(
                lambda mod, args, out, key=id(module), name=name: totals.__setitem__(
                    name, totals[name] + now() - started.pop(key))))
    payloads = [synthetic_step(s, vocab_size=worker.config.model.vocab_size, seed=i) for i, s in enumerate(steps)]
    ctx = autocast or _no_context
    try:
        with ctx():
            worker.forward_only(payloads[0])  # warm-up, not counted
        totals = dict.fromkeys(pieces, 0.0)
        for _ in range(repeats):
            for payload in payloads:
                with ctx():
                    worker.forward_only(payload)
    finally:
        for h in handles:
            h.remove()
    whole = sum(totals.values())
    if not whole > 0:
        raise ValueError("the forward hooks measured no time; is the model on this process?")
    return {"embedding": totals["embedding"] / whole, "layer": totals["layer"] / whole / len(layers),
            "head": totals["head"] / whole}


def fit_backward_forward_ratio(train_seconds: Sequence[float], forward_seconds: Sequence[float],
                               step_overhead_s: float) -> float:
    """``r`` in ``train = step_overhead + (1 + r) * forward``, fitted over the design's steps (least squares through
    the origin of ``train - step_overhead - forward`` on ``forward``): a step's micro-batches take ``1 + r`` times
    their forward pass to train, the optimizer and the other per-step costs land in ``step_overhead``.

    Raises ``ValueError`` when the timings give no positive ratio (a forward pass that costs as much as training:
    the timer did not see the work)."""
    t = np.asarray(train_seconds, dtype=np.float64) - step_overhead_s
    f = np.asarray(forward_seconds, dtype=np.float64)
    if len(t) != len(f) or not len(f) or float(f @ f) <= 0:
        raise ValueError("fit_backward_forward_ratio needs one positive forward time per timed step")
    ratio = float((t - f) @ f / (f @ f))
    if not np.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"the timings give backward/forward = {ratio:.3g} (forward-only passes as slow as training); "
                         f"re-run with more --repeats or --statistic min on a quieter machine")
    return ratio


def _p2p_rank(rank: int, port: int, backend: str, shape: tuple[int, ...], dtype: str, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(rank)
        buf = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
        times = []
        for i in range(repeats + 1):  # the first exchange sets up the connection: not counted
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if backend == "nccl":
                torch.cuda.synchronize()
            if i:
                times.append((time.perf_counter() - start) / 2)  # one way
        if rank == 0:
            out.put(min(times))
    finally:
        dist.destroy_process_group()


def measure_p2p(hidden_size: int, tokens: int, *, dtype: str = "float32", repeats: int = 10
                ) -> tuple[float, str]:
    """``(seconds, how)``: one send/recv of one micro-batch's activation (``tokens x hidden_size``) between two
    processes, the least of ``repeats`` ping-pongs (half a round trip). On a GPU machine it needs two GPUs (NCCL
    cannot put two ranks on one device): with one, ``(0.0, why)``."""
    import socket

    import torch
    import torch.multiprocessing as mp

    if torch.cuda.is_available():
        if torch.cuda.device_count() < 2:
            return 0.0, "not measured: one GPU (NCCL puts one rank per device); p2p_s = 0"
        backend = "nccl"
    else:
        backend = "gloo"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_p2p_rank, args=(r, port, backend, (tokens, 1, hidden_size), dtype, repeats, out))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        seconds = out.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return float(seconds), f"{backend}: {tokens} x {hidden_size} {dtype}, min of {repeats} ping-pongs / 2"


def calibrate(config: Any, *, max_tokens: int, repeats: int = 3, min_length: int = 32, timer: str | None = None,
              autocast: Callable[[], Any] | None = None, master_port: int | None = None,
              progress: Callable[[str], None] | None = None, seed: int = 0, statistic: str = "median",
              pipeline: bool = True) -> tuple[CostProfile, FitReport, list[Observation]]:
    """Set up one training process (world size 1) for ``config``, time :func:`calibration_design`, fit a profile.

    ``config``: anything :func:`slime_ext.train_config.load_train_config` takes (its model dims and optimizer
    are what is timed; the parallel layout is forced to one process, the schedule to the rollout-side path).
    ``pipeline``: also fit ``backward_forward_ratio`` and measure ``p2p_s`` (module docstring).
    """
    import dataclasses

    observations, meta = measure(config, max_tokens=max_tokens, repeats=repeats, min_length=min_length, timer=timer,
                                 autocast=autocast, master_port=master_port, progress=progress, seed=seed,
                                 statistic=statistic, forward_only=pipeline)
    forward = meta.pop("forward_only_seconds", None)
    profile, report = fit_profile(observations, meta=meta)
    if pipeline:
        ratio = fit_backward_forward_ratio([o.seconds for o in observations], forward, profile.step_overhead_s)
        dtype = "bfloat16" if autocast is not None else "float32"
        p2p, how = measure_p2p(meta["model"]["hidden_size"], max_tokens, dtype=dtype)
        if progress:
            progress(f"backward/forward = {ratio:.3f}; p2p {p2p * 1e3:.3f} ms ({how})")
        profile = dataclasses.replace(profile, backward_forward_ratio=ratio, p2p_s=p2p,
                                      meta={**profile.meta, "pipeline": {
                                          "backward_forward_ratio": f"fitted on {len(forward)} forward-only steps",
                                          "p2p_s": how}})
    return profile, report, observations


def measure(config: Any, *, max_tokens: int, repeats: int = 3, min_length: int = 32, timer: str | None = None,
            autocast: Callable[[], Any] | None = None, master_port: int | None = None,
            progress: Callable[[str], None] | None = None, seed: int | Sequence[int] = 0,
            statistic: str = "median", forward_only: bool = False) -> tuple[list[Observation], dict]:
    """The timing half of :func:`calibrate`: ``(observations, meta)``; with ``forward_only``, ``meta`` also holds
    each step's forward-only seconds (``forward_only_seconds``, :func:`time_forward_only`). Several processes may measure at once (with
    different ``seed``) and pool their observations into one fit -- e.g. one per core, as the job will run; or one
    process may time several draws of the design (``seed`` a sequence), interleaved in one :func:`time_steps`."""
    import socket

    import torch

    from slime_ext.train_config import load_train_config
    from .worker import TrainWorker

    cfg = load_train_config(config)
    cfg = cfg.replace(dp_schedule="rollout", pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                      use_dynamic_batch_size=True, max_tokens_per_gpu=max_tokens,
                      use_dynamic_global_batch_size=True,
                      seq_length=max(cfg.model.seq_length, max_tokens),
                      max_position_embeddings=max(cfg.model.max_positions, max_tokens))
    if master_port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            master_port = s.getsockname()[1]
    seeds = [seed] if isinstance(seed, int) else list(seed)
    steps = [step for sd in seeds for step in calibration_design(max_tokens, min_length=min_length, seed=sd)]
    timer = timer or default_timer()
    worker = TrainWorker(cfg, 0, 1, "127.0.0.1", master_port)
    worker.setup()
    try:
        observations = time_steps(worker, steps, repeats=repeats, timer=timer, autocast=autocast, progress=progress,
                                  statistic=statistic)
        forward = time_forward_only(worker, steps, repeats=repeats, timer=timer, autocast=autocast,
                                    statistic=statistic) if forward_only else None
        pieces = time_piece_shares(worker, steps, repeats=repeats, timer=timer,
                                   autocast=autocast) if forward_only else None
    finally:
        worker.shutdown()
    meta = {
        "device": torch.cuda.get_device_name() if timer == "cuda" else "cpu",
        "timer": timer,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": {k: getattr(cfg.model, k) for k in ("num_layers", "hidden_size", "num_attention_heads",
                                               "ffn_hidden_size", "vocab_size")},
        "optimizer": cfg.optim.optimizer,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "statistic": statistic,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if forward is not None:
        meta["forward_only_seconds"] = forward
    if pieces is not None:
        meta["piece_shares"] = {**{k: round(v, 6) for k, v in pieces.items()},
                                "how": f"forward hooks on the GPTModel's modules, {timer} timer, the design's steps"}
    return observations, meta
