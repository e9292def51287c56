"""The train loop: walk the steps of one rollout through Megatron's ``get_forward_backward_func()``.

Per rollout::

    scheme = state.scheme                                        # the dp_schedule, looked up when configured
    steps = scheme.iterators(args, model, payload)       # RankSteps: one iterator per VPP stage, counts per step
    check that every rank runs the same steps and micro-batches; count each step's loss tokens
    for s, n in enumerate(steps.num_microbatches):
        zero grads; forward_backward_func(n micro-batches)  # DDP reduces grads after the last one
        optimizer.step()                                     # Megatron optimizer, clips by clip_grad
        scheduler.step(increment=scheme.lr_increment(args, payload, s))
        scheme.record(steps, payload, step=s, ...)           # what the step returns: the scheme's StepRecord
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from slime_ext.schedule import RankPayload
from slime_ext.schemes import ForwardResult, RankSteps, Scheme, StepRecord
from slime_ext.schemes.data import RolloutDataError

from .batch import BATCH_KEYS, pack_micro_batch
from slime_ext.train_config import Layout, TrainConfig
from .loss import log_prob_func, loss_scale, train_loss_func
from .model import unwrap
from .optimizer import current_lr


@dataclass
class TrainState:
    """Everything a step touches (built by :class:`slime_ext.training.worker.TrainWorker`)."""

    config: TrainConfig
    args: Any  # slime-style namespace (config.to_args())
    layout: Layout
    model: list  # DDP-wrapped chunks, one per VPP stage
    optimizer: Any
    scheduler: Any
    #: the ``dp_schedule`` scheme (``get_dp_schedule(config.dp_schedule)``, looked up when the config is set)
    scheme: Scheme


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class _Ledger:
    """Global sample ids of the micro-batches each model chunk consumed, in order."""

    def __init__(self, num_chunks: int):
        self.per_chunk: list[list[list[int]]] = [[] for _ in range(num_chunks)]

    def record(self, chunk: int, ids: list[int]) -> None:
        self.per_chunk[chunk].append(ids)

    def micro_batches(self) -> list[list[int]]:
        first = self.per_chunk[0]
        for k, other in enumerate(self.per_chunk[1:], start=1):
            if other != first:
                raise RuntimeError(f"model chunk {k} consumed different micro-batches than chunk 0")
        return first


def _forward_step(state: TrainState, ledger: _Ledger, make_loss, data_iterator, model):
    """Megatron ``forward_step_func``: next micro-batch -> THD-packed tensors -> model -> (output, loss function)."""
    batch = data_iterator.get_next(BATCH_KEYS)
    chunk = unwrap(model).vp_stage or 0
    ledger.record(chunk, list(batch["sample_indices"]))
    packed = pack_micro_batch(batch, max_positions=state.config.model.max_positions, device=_device())
    output = model(packed.tokens, packed.position_ids, None, packed_seq_params=packed.packed_seq_params)
    return output, partial(make_loss, packed)


def _local_step_tokens(iterators: list, num_microbatches: list[int], payload: RankPayload) -> list[int]:
    """Loss-mask tokens of this rank in each step (read ahead without consuming the iterators)."""
    masks = payload.samples.loss_masks
    mbs = iterators[0].peek(sum(num_microbatches))
    if len(mbs) != sum(num_microbatches):
        raise RolloutDataError(f"the steps need {sum(num_microbatches)} micro-batches but the iterator has "
                               f"{len(mbs)}; sum(num_microbatches) must equal the micro-batches sent")
    local_tokens, first = [], 0
    for n in num_microbatches:
        local_tokens.append(sum(sum(masks[i]) for mb in mbs[first:first + n] for i in mb))
        first += n
    return local_tokens


def _agree(state: TrainState, local_error: Exception | None, num_microbatches: list[int],
           local_tokens: list[int], payload: RankPayload | None) -> list[int]:
    """Before any step: every rank is ready and runs the same steps; returns each step's loss tokens over DP.

    A few small all-reduces per rollout. A rank whose data failed validation makes every rank fail here (instead
    of leaving its peers in a collective until the timeout); a disagreement in ``num_microbatches`` would hang the
    pipeline stages (or silently mis-scale DP gradients), so it is an error too. When the schedule carries
    ``loss_tokens_per_step`` the DP sum of the local counts must equal it.
    """
    from megatron.core import parallel_state

    steps = len(num_microbatches)
    device = _device()
    head = torch.tensor([int(local_error is not None), steps, -steps], dtype=torch.int64, device=device)
    dist.all_reduce(head, op=dist.ReduceOp.MAX)
    if local_error is not None:
        raise local_error
    if int(head[0]):
        raise RolloutDataError("another rank rejected its payload (see that rank's error); nothing was trained")
    if int(head[1]) != -int(head[2]):
        raise RolloutDataError(f"ranks disagree on the number of steps (rank {state.layout.rank} has {steps}, the "
                               f"range is [{-int(head[2])}, {int(head[1])}]); every rank needs the same schedule")
    nmb = torch.tensor(list(num_microbatches) + [-n for n in num_microbatches], dtype=torch.int64, device=device)
    dist.all_reduce(nmb, op=dist.ReduceOp.MAX)
    if nmb[:steps].tolist() != [-x for x in nmb[steps:].tolist()]:
        raise RolloutDataError(f"ranks disagree on num_microbatches (rank {state.layout.rank}: {num_microbatches}); "
                               f"all DP ranks and pipeline stages must run the same micro-batch counts")
    tokens = torch.tensor(local_tokens, dtype=torch.int64, device=device)
    dist.all_reduce(tokens, group=parallel_state.get_data_parallel_group())
    totals = [int(t) for t in tokens.tolist()]
    given = None if payload is None else payload.loss_tokens_per_step
    if given is not None and list(given) != totals:
        raise RolloutDataError(f"loss_tokens_per_step={list(given)} but the DP ranks' loss masks sum to {totals}; "
                               f"the schedule was planned from other loss masks than the ones sent")
    return totals


def train_rollout(state: TrainState, payload: RankPayload) -> list[StepRecord]:
    """Train on one rollout; returns one record per step (see :func:`train_one_step`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    local_error, steps, local_tokens = None, RankSteps([], []), []
    try:
        steps = state.scheme.iterators(state.args, state.model, payload)
        local_tokens = _local_step_tokens(steps.iterators, steps.num_microbatches, payload)
    except ValueError as exc:  # RolloutDataError, ScheduleError: tell the other ranks before failing
        local_error, steps, local_tokens = exc, RankSteps([], []), []
    step_tokens = _agree(state, local_error, steps.num_microbatches, local_tokens, payload)
    forward_backward = get_forward_backward_func()
    return [train_one_step(state, forward_backward, steps, payload, s, step_tokens[s])
            for s in range(len(steps.num_microbatches))]


def train_one_step(state: TrainState, forward_backward, steps: RankSteps, payload: RankPayload,
                   step_id: int, step_loss_tokens: int) -> StepRecord:
    """Step ``step_id`` of ``steps`` (its ``num_microbatches[step_id]`` micro-batches per rank); returns the
    scheme's :class:`~slime_ext.schemes.StepRecord` subclass (its fields say what each number is)."""
    num_microbatches = steps.num_microbatches[step_id]
    start = time.perf_counter()
    model = state.model
    for chunk in model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()

    ledger = _Ledger(len(model))
    scale = loss_scale(num_microbatches, state.layout.dp_size, step_loss_tokens)
    step_func = partial(_forward_step, state, ledger, partial(train_loss_func, scale=scale))
    losses = forward_backward(
        forward_step_func=step_func,
        data_iterator=steps.iterators,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=state.config.model.seq_length,  # ignored with variable_seq_lengths; shapes travel with the tensors
        micro_batch_size=1,
        forward_only=False,
    )
    lr = current_lr(state.optimizer)
    update_successful, grad_norm, _ = state.optimizer.step()
    increment = state.scheme.lr_increment(state.args, payload, step_id)
    state.scheduler.step(increment=increment)

    # the step objective: last stages hold the micro-batch sums; summed over every rank (others add 0)
    local = sum(float(x["loss_sum"]) for x in losses) if losses else 0.0
    loss_t = torch.tensor([local], dtype=torch.float64, device=_device())
    dist.all_reduce(loss_t)
    micro_batches = ledger.micro_batches()
    samples = payload.samples_per_step
    return state.scheme.record(
        steps, payload,
        step=step_id,
        loss=float(loss_t.item()) / step_loss_tokens if step_loss_tokens else 0.0,
        lr=lr,
        samples=int(samples[step_id]) if samples is not None else _dp_sum(sum(len(mb) for mb in micro_batches)),
        num_microbatches=num_microbatches,
        seconds=time.perf_counter() - start,
        ledger=micro_batches,
        loss_tokens=step_loss_tokens,
        grad_norm=None if grad_norm is None else float(grad_norm),
        lr_increment=int(increment),
        scheduler_samples=int(state.scheduler.num_steps),
        update_successful=bool(update_successful),
    )


def _dp_sum(value: int) -> int:
    from megatron.core import parallel_state

    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return int(t.item())


@torch.no_grad()
def forward_only(state: TrainState, payload: RankPayload) -> ForwardResult:
    """Per-token log-probs of every response token, over the same iterators as training: a
    :class:`~slime_ext.schemes.ForwardResult` in payload order, ``log_probs`` filled on the last pipeline stage
    (where the logits are) and ``None`` elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    steps = state.scheme.iterators(state.args, state.model, payload)
    ids = list(payload.partition)
    forward_backward = get_forward_backward_func()
    for chunk in state.model:
        chunk.eval()
    ledger = _Ledger(len(state.model))
    outputs: list[dict] = []
    try:
        for n in steps.num_microbatches:
            outputs += forward_backward(
                forward_step_func=partial(_forward_step, state, ledger, log_prob_func),
                data_iterator=steps.iterators, model=state.model, num_microbatches=n,
                seq_length=state.config.model.seq_length, micro_batch_size=1, forward_only=True)
    finally:
        for chunk in state.model:
            chunk.train()
    if not state.layout.is_last_stage:
        return ForwardResult(sample_indices=ids, log_probs=None)
    position = {sid: k for k, sid in enumerate(ids)}
    log_probs: list[list[float] | None] = [None] * len(ids)
    for mb_ids, out in zip(ledger.micro_batches(), outputs):
        for sid, lp in zip(mb_ids, torch.split(out["log_probs"], out["response_lengths"])):
            log_probs[position[sid]] = lp.tolist()
    return ForwardResult(sample_indices=ids, log_probs=log_probs)
