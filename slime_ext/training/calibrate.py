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
``backward_forward_ratio`` and ``p2p_s`` say: the same design steps are timed forward only
(:func:`time_forward_only`, megatron-core's schedule with ``forward_only=True``), and the ratio is
:func:`fit_backward_forward_ratio`; ``p2p_s`` is the time of one
send/recv of one capped micro-batch's activation between two processes on the job's backend
(:func:`measure_p2p`: gloo on CPU; NCCL needs two GPUs, else it is left 0 and the profile's meta says why).

A busy machine disturbs timings; the fit stays physical (:func:`fit_calibration`). Each step is timed ``repeats``
times, interleaved, and its observation is the median (or min) of them; how much the repeats disagree is the
timings' *spread* (:class:`RepeatTimings`), recorded in the profile's meta. The profile's coefficients are
non-negative (the fit is constrained). A backward pass costs at least its forward pass
(:data:`MIN_BACKWARD_FORWARD_RATIO`): a smaller fitted ratio from noisy timings (spread over
:attr:`CalibrationChecks.noisy_spread`, or a single repeat) is raised to that floor with a WARNING naming the fitted
value and the fix (more ``--repeats``, ``--statistic min``, an idle node); from timings whose repeats agree it is
held at the floor too, the warning naming the timer first (``--timer cuda``: the timer may not see the backward
work). A calibration is never refused for load: a busy node gets a physical profile and a warning. Noisy timings are
warned about even when the fit is physical; the warnings are kept in ``meta["warnings"]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from slime_ext.schedule.errors import ScheduleError
from slime_ext.schedule.profile import CostProfile

from .profile_fit import FitReport, Observation, fit_profile

logger = logging.getLogger("slime_ext.calibrate")

TIMERS = ("thread", "process", "cuda")

#: ``clock(fn) -> (fn(), busy seconds, wall seconds)``: how one run is timed (:func:`make_clock`; tests inject one)
Clock = Callable[[Callable[[], Any]], tuple[Any, float, float]]

#: the least backward/forward ratio a profile may carry: a backward pass computes the input gradients with the
#: forward pass's matrix products (transposed) and the weight gradients with as many again, so it never costs less
#: than its forward pass
MIN_BACKWARD_FORWARD_RATIO = 1.0

#: what to do about noisy timings, in the words of the CLI's flags and the node (named in every warning and error)
NOISE_FIX = "re-run with more --repeats (or --statistic min) on an idle node"


class CalibrationError(ScheduleError):
    """The timings cannot support a physical fit; the message says what was measured and how to fix it."""


@dataclass(frozen=True)
class CalibrationChecks:
    """How the calibration judges its own timings."""

    #: timings whose repeats disagree by more than this (the :attr:`RepeatTimings.spread`: median over the steps of
    #: ``(max - min) / median`` of one step's repeats) count as noisy: warned about, and the warning for an
    #: unphysical ratio fitted on them names more repeats first. Repeats on an idle node agree within a few percent; a
    #: node shared with other jobs spreads them by tens of percent.
    noisy_spread: float = 0.2

    def __post_init__(self) -> None:
        if not self.noisy_spread > 0:
            raise ValueError(f"CalibrationChecks.noisy_spread={self.noisy_spread!r} must be > 0 (a relative spread)")


@dataclass(frozen=True)
class RepeatTimings:
    """Busy seconds of each timed payload, every repeat in run order: ``samples[i][k]`` is payload ``i``'s repeat
    ``k``."""

    samples: tuple[tuple[float, ...], ...]

    def of(self, statistic: str) -> list[float]:
        """Each payload's ``statistic`` (:data:`STATISTICS`) of its repeats."""
        return [STATISTICS[check_statistic(statistic)](t) for t in self.samples]

    @property
    def spread(self) -> float | None:
        """How much the repeats disagree: the median over payloads of ``(max - min) / median``; ``None`` with one
        repeat (nothing to compare)."""
        if not self.samples or min(len(t) for t in self.samples) < 2:
            return None
        return float(statistics.median((max(t) - min(t)) / max(statistics.median(t), 1e-300) for t in self.samples))


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


def _timer_reading(timer: str) -> Callable[[], float]:
    """``timer``'s current reading in seconds (with ``cuda``: wall time after a synchronize)."""
    if timer not in TIMERS:
        raise ValueError(f"timer={timer!r} must be one of {TIMERS}")
    cpu = {"thread": time.thread_time, "process": time.process_time}.get(timer)
    if cpu is not None:
        return cpu
    import torch

    def cuda_now() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()

    return cuda_now


@contextlib.contextmanager
def _no_context():
    yield


def make_clock(timer: str) -> Clock:
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


def check_statistic(statistic: str) -> str:
    """``statistic`` if it names one of :data:`STATISTICS`, else a ``ValueError`` naming the choices."""
    if statistic not in STATISTICS:
        raise ValueError(f"statistic={statistic!r} must be one of {sorted(STATISTICS)}")
    return statistic


def time_steps(worker, steps: Sequence[Sequence[Sequence[int]]], *, repeats: int = 3, timer: str | None = None,
               autocast: Callable[[], Any] | None = None, warmup: int = 1,
               progress: Callable[[str], None] | None = None, statistic: str = "median",
               clock: Clock | None = None) -> list[Observation]:
    """Busy seconds of each step in ``steps`` (run ``repeats`` times, interleaved; ``statistic`` of the repeats, see
    :data:`STATISTICS`) on ``worker``.

    ``worker`` is a set-up :class:`slime_ext.training.worker.TrainWorker` on the rollout-side path, alone in its
    data-parallel group (world size 1, or the caller times one rank while the others wait). ``autocast`` wraps
    each step (e.g. ``lambda: torch.autocast("cuda", torch.bfloat16)``). ``clock`` replaces ``timer``'s.
    """
    check_statistic(statistic)
    timings = step_repeats(worker, steps, repeats=repeats, timer=timer, autocast=autocast, warmup=warmup,
                           progress=progress, clock=clock)
    return observe(steps, timings.of(statistic))


def observe(steps: Sequence[Sequence[Sequence[int]]], seconds: Sequence[float]) -> list[Observation]:
    """One :class:`Observation` per step and its seconds."""
    if len(steps) != len(seconds):
        raise ValueError(f"{len(steps)} steps but {len(seconds)} timings")
    return [Observation(tuple(tuple(int(x) for x in mb) for mb in s), float(t)) for s, t in zip(steps, seconds)]


def step_repeats(worker, steps: Sequence[Sequence[Sequence[int]]], *, repeats: int = 3, timer: str | None = None,
                 autocast: Callable[[], Any] | None = None, warmup: int = 1,
                 progress: Callable[[str], None] | None = None, clock: Clock | None = None) -> RepeatTimings:
    """Every repeat of :func:`time_steps`'s timings (the biggest step runs ``warmup`` times first, not counted)."""
    payloads = [synthetic_step(s, vocab_size=worker.config.model.vocab_size, seed=i) for i, s in enumerate(steps)]
    biggest = max(range(len(steps)), key=lambda i: sum(map(sum, steps[i])))
    return time_repeats(worker.train_rollout, payloads, [payloads[biggest]] * warmup, repeats=repeats,
                        clock=clock or make_clock(timer or default_timer()), autocast=autocast, progress=progress)


def time_repeats(run: Callable[[Any], Any], payloads: list, warmup: list, *, repeats: int, clock: Clock,
                 autocast: Callable[[], Any] | None = None,
                 progress: Callable[[str], None] | None = None) -> RepeatTimings:
    """``run`` each payload ``repeats`` times, forward then backward order in turn (slow drift hits every payload
    alike), after the ``warmup`` payloads (allocator and first-call costs stay out); every repeat's busy seconds."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
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
    return RepeatTimings(tuple(tuple(t) for t in samples))


def time_forward_only(worker, steps: Sequence[Sequence[Sequence[int]]], *, repeats: int = 3,
                      timer: str | None = None, autocast: Callable[[], Any] | None = None,
                      clock: Clock | None = None) -> RepeatTimings:
    """Every repeat of each step's forward-only pass (megatron-core's schedule with ``forward_only=True``, no
    optimizer), interleaved, on the same kind of payloads as :func:`time_steps`."""
    payloads = [synthetic_step(s, vocab_size=worker.config.model.vocab_size, seed=i) for i, s in enumerate(steps)]
    return time_repeats(worker.forward_only, payloads, payloads[:1], repeats=repeats,
                        clock=clock or make_clock(timer or default_timer()), autocast=autocast)


def time_piece_shares(worker, steps: Sequence[Sequence[Sequence[int]]], *, repeats: int = 3,
                      timer: str | None = None, autocast: Callable[[], Any] | None = None,
                      now: Callable[[], float] | None = None) -> dict:
    """Each piece's share of the model's forward time, measured on the same payloads as :func:`time_steps`:
    ``{"embedding": e, "layer": l, "head": h}`` with ``e + num_layers * l + h = 1`` (``layer``: one decoder layer,
    the mean of all; ``head``: the final norm and the output layer). Forward hooks on the ``GPTModel``'s modules
    read ``timer``'s clock before and after each piece (with ``cuda``, after a synchronize), over ``repeats``
    forward-only passes of every step. What the pipeline stages' per-stage costs are split by
    (:class:`slime_ext.schedule.stages.StageCosts`); the loss, computed outside the model, is not counted. ``now``
    (a reading in seconds) replaces ``timer``'s."""
    from .model import unwrap

    now = now or _timer_reading(timer or default_timer())
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


@dataclass(frozen=True)
class RatioFit:
    """The backward/forward ratio a profile carries, and what the timings gave."""

    #: what the profile carries: ``fitted``, or :data:`MIN_BACKWARD_FORWARD_RATIO` where noise put it below
    ratio: float
    #: the least-squares ratio of the timings
    fitted: float
    #: what was wrong with the timings (``None``: nothing); also logged as a WARNING
    warning: str | None = None


def fit_backward_forward_ratio(train_seconds: Sequence[float], forward_seconds: Sequence[float],
                               step_overhead_s: float, *, spread: float | None = 0.0,
                               checks: CalibrationChecks = CalibrationChecks()) -> RatioFit:
    """``r`` in ``train = step_overhead + (1 + r) * forward``, fitted over the design's steps (least squares through
    the origin of ``train - step_overhead - forward`` on ``forward``): a step's micro-batches take ``1 + r`` times
    their forward pass to train, the optimizer and the other per-step costs land in ``step_overhead``.

    ``spread``: how much the timings' repeats disagree (:attr:`RepeatTimings.spread`; ``None`` for one repeat).
    A fitted ``r`` under :data:`MIN_BACKWARD_FORWARD_RATIO` is unphysical: from noisy timings (``spread`` over
    ``checks.noisy_spread``, or ``None``) the ratio is raised to that floor and a WARNING says so; from timings
    whose repeats agree too, the WARNING then naming the timer first. Only a ratio that cannot be fitted at all
    (not finite) is refused with :class:`CalibrationError`."""
    t = np.asarray(train_seconds, dtype=np.float64) - step_overhead_s
    f = np.asarray(forward_seconds, dtype=np.float64)
    if len(t) != len(f) or not len(f) or float(f @ f) <= 0 or np.any(f < 0):
        raise CalibrationError(f"fit_backward_forward_ratio needs one non-negative forward time per timed step "
                               f"(got {len(f)} forward times for {len(t)} steps)")
    fitted = float((t - f) @ f / (f @ f))
    if np.isfinite(fitted) and fitted >= MIN_BACKWARD_FORWARD_RATIO:
        return RatioFit(fitted, fitted)
    noisy = spread is None or spread > checks.noisy_spread
    found = (f"the timings give backward/forward = {fitted:.3g}, under {MIN_BACKWARD_FORWARD_RATIO:g} (a backward "
             f"pass cheaper than its forward pass)")
    if not np.isfinite(fitted):
        raise CalibrationError(f"{found}: no ratio can be fitted; time on the device that trains (--timer cuda on a "
                               f"GPU), or {NOISE_FIX}")
    if noisy:
        why = f"from noisy timings (spread {_spread_text(spread)})"
        fix = f"{NOISE_FIX} for a fitted ratio"
    else:  # the repeats agree, yet load that shifts between the interleaved passes can still do it (seen: 0.95)
        why = (f"although the repeats agree (spread {_spread_text(spread)}): the timer may not see the backward work, "
               f"or the machine's load shifted between the passes")
        fix = f"time on the device that trains (--timer cuda on a GPU), or {NOISE_FIX}"
    warning = (f"{found} {why}: the profile carries {MIN_BACKWARD_FORWARD_RATIO:g}, the physical floor; {fix}")
    logger.warning("slime-ext calibrate: %s", warning)
    return RatioFit(MIN_BACKWARD_FORWARD_RATIO, fitted, warning)


def _spread_text(spread: float | None) -> str:
    return "unknown: one repeat per step" if spread is None else f"{100 * spread:.0f}% between repeats"


def fit_calibration(observations: Sequence[Observation], meta: dict, *,
                    checks: CalibrationChecks = CalibrationChecks()) -> tuple[CostProfile, FitReport]:
    """The profile the measured timings support (:func:`measure`'s ``(observations, meta)``).

    The coefficients are fitted non-negative (:func:`~.profile_fit.fit_profile`); with
    ``meta["forward_only_seconds"]`` the backward/forward ratio is fitted too (:func:`fit_backward_forward_ratio`,
    at least :data:`MIN_BACKWARD_FORWARD_RATIO`). Timings that are noisy (``meta["repeat_spread"]`` over
    ``checks.noisy_spread``) or repeated once get a WARNING naming the fix; the warnings land in
    ``meta["warnings"]``. Raises :class:`CalibrationError` (a ``ScheduleError``) where no physical fit exists."""
    meta = dict(meta)
    forward = meta.pop("forward_only_seconds", None)
    spread = meta.get("repeat_spread", {})
    warnings = [_noise_warning(name, spread[name], checks) for name in spread
                if spread[name] is None or spread[name] > checks.noisy_spread]
    for warning in warnings:
        logger.warning("slime-ext calibrate: %s", warning)
    profile, report = fit_profile(observations, meta=meta)
    if forward is not None:
        worst = None if None in spread.values() else max(spread.values(), default=0.0)
        ratio = fit_backward_forward_ratio([o.seconds for o in observations], forward, profile.step_overhead_s,
                                           spread=worst, checks=checks)
        warnings += [ratio.warning] if ratio.warning else []
        how = (f"fitted on {len(forward)} forward-only steps" if ratio.warning is None else
               f"{MIN_BACKWARD_FORWARD_RATIO:g}, the physical floor (fitted {ratio.fitted:.3g} on {len(forward)} "
               f"noisy forward-only steps)")
        profile = dataclasses.replace(profile, backward_forward_ratio=ratio.ratio,
                                      meta={**profile.meta, "pipeline": {"backward_forward_ratio": how}})
    if warnings:
        profile = dataclasses.replace(profile, meta={**profile.meta, "warnings": warnings})
    return profile, report


def _noise_warning(name: str, spread: float | None, checks: CalibrationChecks) -> str:
    if spread is None:
        return f"{name} timings: one repeat per step, so noise cannot be told from the cost; {NOISE_FIX}"
    return (f"{name} timings vary by {100 * spread:.0f}% between repeats (over {100 * checks.noisy_spread:.0f}%: the "
            f"machine is busy); the fit may be off; {NOISE_FIX}")


def _p2p_rank(rank: int, port: int, backend: str, shape: tuple[int, ...], dtype: str, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    # the parent serves the store (host_store): every rank joins it as a client
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=2)
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
    import torch
    import torch.multiprocessing as mp

    from .parallel import host_store

    if torch.cuda.is_available():
        if torch.cuda.device_count() < 2:
            return 0.0, "not measured: one GPU (NCCL puts one rank per device); p2p_s = 0"
        backend = "nccl"
    else:
        backend = "gloo"
    store = host_store()  # bound on port 0 before the ranks learn its port: no other process can take it
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_p2p_rank, args=(r, store.port, backend, (tokens, 1, hidden_size), dtype, repeats,
                                                 out))
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
        del store
    return float(seconds), f"{backend}: {tokens} x {hidden_size} {dtype}, min of {repeats} ping-pongs / 2"


def calibrate(config: Any, *, max_tokens: int, repeats: int = 3, min_length: int = 32, timer: str | None = None,
              autocast: Callable[[], Any] | None = None, master_port: int | None = None,
              progress: Callable[[str], None] | None = None, seed: int = 0, statistic: str = "median",
              pipeline: bool = True) -> tuple[CostProfile, FitReport, list[Observation]]:
    """Set up one training process (world size 1) for ``config``, time :func:`calibration_design`, fit a profile
    (:func:`fit_calibration`: physical coefficients, warnings for noisy timings).

    ``config``: anything :func:`slime_ext.train_config.load_train_config` takes (its model dims and optimizer
    are what is timed; the parallel layout is forced to one process, the schedule to the rollout-side path).
    ``pipeline``: also fit ``backward_forward_ratio`` and measure ``p2p_s`` (module docstring).
    """
    observations, meta = measure(config, max_tokens=max_tokens, repeats=repeats, min_length=min_length, timer=timer,
                                 autocast=autocast, master_port=master_port, progress=progress, seed=seed,
                                 statistic=statistic, forward_only=pipeline)
    profile, report = fit_calibration(observations, meta)
    if pipeline:
        dtype = "bfloat16" if autocast is not None else "float32"
        p2p, how = measure_p2p(meta["model"]["hidden_size"], max_tokens, dtype=dtype)
        if progress:
            progress(f"backward/forward = {profile.backward_forward_ratio:.3f}; p2p {p2p * 1e3:.3f} ms ({how})")
        profile = dataclasses.replace(profile, p2p_s=p2p, meta={**profile.meta, "pipeline": {
            **profile.meta["pipeline"], "p2p_s": how}})
    return profile, report, observations


def measure(config: Any, *, max_tokens: int, repeats: int = 3, min_length: int = 32, timer: str | None = None,
            autocast: Callable[[], Any] | None = None, master_port: int | None = None,
            progress: Callable[[str], None] | None = None, seed: int | Sequence[int] = 0,
            statistic: str = "median", forward_only: bool = False) -> tuple[list[Observation], dict]:
    """The timing half of :func:`calibrate`: ``(observations, meta)``; with ``forward_only``, ``meta`` also holds
    each step's forward-only seconds (``forward_only_seconds``, :func:`time_forward_only`); ``repeat_spread`` says how
    much the repeats disagree (:attr:`RepeatTimings.spread`). Several processes may measure at once (with different
    ``seed``) and pool their observations into one fit -- e.g. one per core, as the job will run; or one
    process may time several draws of the design (``seed`` a sequence), interleaved in one :func:`time_steps`."""
    import torch

    from slime_ext.train_config import load_train_config
    from .worker import TrainWorker

    check_statistic(statistic)
    cfg = load_train_config(config)
    cfg = cfg.replace(dp_schedule="rollout", pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                      use_dynamic_batch_size=True, max_tokens_per_gpu=max_tokens,
                      use_dynamic_global_batch_size=True,
                      seq_length=max(cfg.model.seq_length, max_tokens),
                      max_position_embeddings=max(cfg.model.max_positions, max_tokens))
    if master_port is None:
        master_port = 0  # one process: it serves its rendezvous store on a port the OS gives it
    seeds = [seed] if isinstance(seed, int) else list(seed)
    steps = [step for sd in seeds for step in calibration_design(max_tokens, min_length=min_length, seed=sd)]
    timer = timer or default_timer()
    worker = TrainWorker(cfg, 0, 1, "127.0.0.1", master_port)
    worker.setup()
    try:
        train = step_repeats(worker, steps, repeats=repeats, timer=timer, autocast=autocast, progress=progress)
        forward = time_forward_only(worker, steps, repeats=repeats, timer=timer,
                                    autocast=autocast) if forward_only else None
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
        "repeat_spread": {"training": train.spread},
    }
    observations = observe(steps, train.of(statistic))
    if forward is not None:
        meta["forward_only_seconds"] = forward.of(statistic)
        meta["repeat_spread"]["forward-only"] = forward.spread
    if pieces is not None:
        meta["piece_shares"] = {**{k: round(v, 6) for k, v in pieces.items()},
                                "how": f"forward hooks on the GPTModel's modules, {timer} timer, the design's steps"}
    return observations, meta
